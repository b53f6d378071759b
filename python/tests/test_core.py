"""zerosched._core: the Rust core in-process, against the command line it must agree with."""

from __future__ import annotations

import gzip
import json
import pathlib
import re
import subprocess
import threading
import time
import tomllib

import pytest

import zerosched
from zerosched import _core

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
PROGRAMS = ["llama.program.json", "qwen2_moe.program.json", "gpt2.program.json"]
LONG_PROGRAM = ROOT / "benches" / "data" / "llama70b_l80.program.json.gz"


def cli(*args: str) -> subprocess.CompletedProcess:
    """The zerosched command line of this checkout (cargo builds it if the test run has not)."""
    return subprocess.run(
        ["cargo", "run", "--quiet", "--locked", "--bin", "zerosched", "--", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_scheduled_fixture_passes_the_checker(name):
    budget = 1 << 20
    out, report = _core.schedule(fixture(name), {"budget": budget, "world_size": 2})
    doc = json.loads(out)
    assert doc["format"] == "fx-program"
    targets = {n["target"] for g in doc["graphs"] for n in g["nodes"]}
    assert {"zerosched.allgather.default", "zerosched.release.default"} <= targets

    summary = json.loads(_core.check(out, {"budget": budget, "world_size": 2}))
    assert [s["graph"] for s in summary["schedules"]] == [g["name"] for g in doc["graphs"]]
    assert all(s["gathers"] + s["reuses"] > 0 for s in summary["schedules"])
    assert all(s["peak_gathered"] <= budget for s in summary["schedules"])
    assert json.loads(report)["budget_bytes"] == budget


def test_the_checker_refuses_a_schedule_over_a_smaller_budget():
    out, _ = _core.schedule(fixture("llama.program.json"), {"budget": "1MiB"})
    peak = max(s["peak_gathered"] for s in json.loads(_core.check(out))["schedules"])
    with pytest.raises(zerosched.ZeroschedError, match="the schedule checker rejects it"):
        _core.check(out, {"budget": peak - 1})


def test_same_input_gives_identical_bytes():
    data = fixture("qwen2_moe.program.json")
    first = _core.schedule(data, {"budget": "2MiB", "scheduler": "jit"})
    second = _core.schedule(data, {"budget": "2MiB", "scheduler": "jit"})
    assert first == second


def test_a_graph_in_gives_a_graph_out():
    out, _ = _core.schedule(fixture("llama_fwd_0.json"))
    doc = json.loads(out)
    assert doc["format"] == "fx-graph" and doc["name"] == "llama_fwd_0"


def test_gzip_and_binary_inputs_schedule_like_json(tmp_path):
    data = fixture("gpt2.program.json")
    want = _core.schedule(data)
    assert _core.schedule(gzip.compress(data)) == want
    binary = tmp_path / "gpt2.zsg"
    done = cli("convert", str(FIXTURES / "gpt2.program.json"), "-o", str(binary))
    assert done.returncode == 0, done.stderr
    out, report = _core.schedule(binary.read_bytes())
    assert out == want[0] and report == want[1]


def test_the_report_is_the_command_lines(tmp_path):
    path = tmp_path / "report.json"
    args = ["--budget", "1MiB", "--world-size", "4", "--scheduler", "prefetch"]
    done = cli("schedule", str(FIXTURES / "llama.program.json"), *args, "--report", str(path))
    assert done.returncode == 0, done.stderr
    _, report = _core.schedule(
        fixture("llama.program.json"), {"budget": "1MiB", "world_size": 4, "scheduler": "prefetch"}
    )
    ours, theirs = json.loads(report), json.loads(path.read_text())
    assert ours.pop("input") == "<bytes>"
    theirs.pop("input")
    assert ours == theirs


def test_options_change_the_schedule():
    data = fixture("llama.program.json")
    base = json.loads(_core.schedule(data)[1])
    assert base["world_size"] == 8 and base["scheduler"] == "prefetch" and base["budget_bytes"] is None
    jit = json.loads(_core.schedule(data, {"scheduler": "jit", "world_size": 1})[1])
    assert jit["scheduler"] == "jit" and jit["world_size"] == 1
    slow = {
        "peak_flops": 1e12,
        "peak_flops_fp32": 1e11,
        "mem_bandwidth": 1e11,
        "launch_ms": 1.0,
        "collective": {"kind": "alpha_beta", "alpha_ms": 0.5, "beta_bytes_per_s": 1e9},
    }
    costed = json.loads(_core.schedule(data, {"cost": slow})[1])
    assert costed["simulation"]["total"]["step_ms"] > 10 * base["simulation"]["total"]["step_ms"]
    no_keep = json.loads(_core.schedule(data, {"disable": ["keep"], "verify": False})[1])
    assert no_keep["kept"] == [] and base["kept"] != []


@pytest.mark.parametrize(
    "options, message",
    [
        ({"budgett": 1}, "unknown field `budgett`"),
        ({"dump_after": ["insert"]}, "unknown field `dump_after`"),
        ({"budget": -1}, "budget: invalid value"),
        ({"budget": "lots"}, "budget: not a byte size"),
        ({"world_size": 0}, "the world size must be at least 1"),
        ({"world_size": "8"}, "world_size: invalid type"),
        ({"scheduler": "eager"}, "unknown scheduler `eager` (schedulers: prefetch, jit, deepcompile)"),
        ({"disable": ["fuse"]}, "unknown pass `fuse` (passes: insert, rewrite, schedule, keep)"),
        ({"cost": {"peak_flops": "fast"}}, "cost.peak_flops:"),
        ({"verify": "yes"}, "verify:"),
    ],
)
def test_bad_options_name_the_key(options, message):
    with pytest.raises(zerosched.ZeroschedError) as e:
        _core.schedule(fixture("llama_fwd_0.json"), options)
    assert message in str(e.value)


def test_check_refuses_schedule_options():
    with pytest.raises(zerosched.ZeroschedError, match="unknown field `scheduler`"):
        _core.check(fixture("llama_fwd_0.json"), {"scheduler": "jit"})


def test_options_that_are_not_a_dict_are_a_type_error():
    with pytest.raises(TypeError, match="options must be a dict, not list"):
        _core.schedule(fixture("llama_fwd_0.json"), [("budget", 1)])


def test_an_import_error_names_the_node_and_field_as_the_command_line_does(tmp_path):
    doc = json.loads(fixture("llama_fwd_0.json"))
    node = next(n for n in doc["nodes"] if n["op"] == "call_function")
    node["op"] = "call_method"
    data = json.dumps(doc).encode()
    with pytest.raises(zerosched.ZeroschedError) as e:
        _core.schedule(data)
    assert f"graph `llama_fwd_0`, node `{node['name']}`, field `op`" in str(e.value)
    with pytest.raises(zerosched.ZeroschedError) as checked:
        _core.check(data)
    assert str(checked.value) == str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_bytes(data)
    done = cli("check", str(bad))
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {bad}: {e.value}".strip()


@pytest.mark.parametrize("key", ["budget", "memory"])
@pytest.mark.parametrize("scheduler", ["prefetch", "jit", "deepcompile"])
def test_over_budget_carries_what_the_command_line_reports(scheduler, key):
    path = FIXTURES / "qwen2_moe.program.json"
    with pytest.raises(zerosched.OverBudgetError) as e:
        _core.schedule(path.read_bytes(), {key: 1024, "scheduler": scheduler})
    assert e.value.kind == key
    done = cli("schedule", str(path), f"--{key}", "1024", "--scheduler", scheduler)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {e.value}"
    figures = [int(n) for n in re.findall(r"(\d+) bytes", done.stderr)]
    assert e.value.needed == max(figures) and e.value.needed > 1024
    # The figure is the smallest that works for the whole program: it does, and one byte less
    # does not.
    _, report = _core.schedule(path.read_bytes(), {key: e.value.needed, "scheduler": scheduler})
    total = json.loads(report)["simulation"]["total"]
    assert total["peak_total_bytes" if key == "memory" else "peak_gathered_bytes"] <= e.value.needed
    with pytest.raises(zerosched.OverBudgetError):
        _core.schedule(path.read_bytes(), {key: e.value.needed - 1, "scheduler": scheduler})


def test_the_interpreter_lock_is_released_while_rust_works():
    data = LONG_PROGRAM.read_bytes()
    ticks: list[float] = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        start = time.perf_counter()
        _core.schedule(data)
        end = time.perf_counter()
    finally:
        stop.set()
        ticker.join()
    # Held, the lock would stop the ticker for the whole call; look well inside it.
    inner = [t for t in ticks if start + (end - start) / 4 < t < end - (end - start) / 4]
    assert end - start > 0.05, "the program is too small to tell"
    assert len(inner) >= 5, f"{len(inner)} ticks in the middle half of a {end - start:.3f}s call"


def test_the_version_is_the_packages():
    pyproject = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())
    assert zerosched.__version__ == _core.__version__ == pyproject["project"]["version"]


def test_simulate_reports_what_schedule_reported_for_its_own_output():
    scheduled, report = zerosched.schedule(fixture("llama.program.json"), {"budget": "1MiB"})
    sim = json.loads(zerosched.simulate(scheduled))
    assert sim["simulation"] == json.loads(report)["simulation"]
    slow = json.loads(zerosched.simulate(scheduled, {"cost": {
        "peak_flops": 1e12, "peak_flops_fp32": 1e11, "mem_bandwidth": 1e11, "launch_ms": 0.01,
        "collective": {"kind": "alpha_beta", "alpha_ms": 0.1, "beta_bytes_per_s": 1e9}}}))
    assert slow["simulation"]["total"]["step_ms"] > sim["simulation"]["total"]["step_ms"]


def test_compute_costs_sum_to_the_simulated_compute_time():
    data = fixture("llama.program.json")
    costs = json.loads(zerosched.compute_costs(data))
    sim = json.loads(zerosched.simulate(data))["simulation"]
    assert [c["graph"] for c in costs] == [g["graph"] for g in sim["graphs"]]
    for c, g in zip(costs, sim["graphs"]):
        assert sum(c["ms"].values()) == pytest.approx(g["compute_ms"])
        assert all(ms >= 0 for ms in c["ms"].values())


def test_collective_ms_is_the_alpha_beta_ring_and_refuses_unknown_kinds():
    ring = {"kind": "alpha_beta", "alpha_ms": 0.5, "beta_bytes_per_s": 1e9}
    cost = {"peak_flops": 1e12, "peak_flops_fp32": 1e11, "mem_bandwidth": 1e11, "launch_ms": 0.0,
            "collective": ring}
    ms = zerosched.collective_ms("all_gather", 8_000_000, {"world_size": 4, "cost": cost})
    assert ms == pytest.approx(0.5 + 8e6 * 3 / 4 / 1e9 * 1e3)
    assert zerosched.collective_ms("all_reduce", 8_000_000, {"world_size": 4, "cost": cost}) > ms
    with pytest.raises(zerosched.ZeroschedError, match="unknown collective `broadcast`"):
        zerosched.collective_ms("broadcast", 1)
    with pytest.raises(zerosched.ZeroschedError, match="world_size"):
        zerosched.collective_ms("all_gather", 1, {"world_size": 0})
