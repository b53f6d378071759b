"""Dumps from a real run (zerosched.dump): every scheduled graph, rescheduled by the command
line to the bytes the run used."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

import dump_cases
from test_core import ROOT, cli
from zerosched import dump


def _replay(stem: pathlib.Path) -> bytes:
    options = json.loads(stem.with_suffix(".options.json").read_text())
    out = stem.parent / f"{stem.name}.cli.json"
    args = dump.command_args(options, str(stem) + ".json", str(out))
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    return out.read_bytes()


@pytest.mark.parametrize("via_env", [False, True], ids=["dump=", "ZEROSCHED_DUMP"])
def test_a_two_rank_run_dumps_graphs_the_command_line_reschedules_to_the_same_bytes(ranks, tmp_path, via_env):
    width = 28 if via_env else 36
    listings = ranks.run(dump_cases.train_and_dump, str(tmp_path), width, via_env)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    for rank, files in enumerate(listings):
        d = tmp_path / f"rank{rank}"
        stems = sorted(f[: -len(".options.json")] for f in files if f.endswith(".options.json"))
        # The forward and the backward graph; the second step runs them again, compiled once.
        assert stems == ["backward_0", "forward_0"], files
        for s in stems:
            options = json.loads((d / f"{s}.options.json").read_text())
            assert options["world_size"] == 2
            assert options["budget"] == ("16KiB" if via_env else 16384)
            assert ("cost" in options) != via_env
            graph = json.loads((d / f"{s}.json").read_text())
            assert graph["format"] == "fx-graph" and graph["name"] == s and graph["params"]
            scheduled = (d / f"{s}.scheduled.json").read_bytes()
            assert b"zerosched.allgather.default" in scheduled
            assert json.loads((d / f"{s}.report.json").read_text())["budget_bytes"] == 16384
            assert _replay(d / s) == scheduled, f"rank {rank}, {s}: the command line scheduled it differently"
    # Each rank schedules the same graphs: the schedules agree across ranks.
    for s in ("forward_0", "backward_0"):
        assert (tmp_path / "rank0" / f"{s}.scheduled.json").read_bytes() == \
            (tmp_path / "rank1" / f"{s}.scheduled.json").read_bytes()
    # replay.sh does the same with the binary cargo built for cli().
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    env = {**os.environ, "ZEROSCHED": str(target / "debug" / "zerosched")}
    r = subprocess.run(["sh", str(tmp_path / "rank0" / "replay.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_graph_the_schedule_cache_serves_is_dumped_under_its_own_name(ranks, tmp_path):
    for rank, (files, hits) in enumerate(ranks.run(dump_cases.dump_after_the_cache, str(tmp_path), 44)):
        assert hits == 2, "the cache should serve both graphs"
        d = tmp_path / f"rank{rank}"
        assert sorted(f for f in files if f.endswith(".options.json")) == [
            "backward_0.options.json", "forward_0.options.json"], files
        for s in ("forward_0", "backward_0"):
            scheduled = (d / f"{s}.scheduled.json").read_bytes()
            assert json.loads(scheduled)["name"] == s
            assert _replay(d / s) == scheduled


def test_a_name_dumped_twice_gets_a_suffix_and_nothing_half_written(tmp_path):
    d = dump.Dumper(str(tmp_path))
    opts = {"budget": None, "scheduler": "jit", "world_size": 1, "disable": ["keep"]}
    assert d.write("forward_0", b"{}", opts, b"[]", "{}").endswith("forward_0")
    assert d.write("forward_0", b"{}", opts, b"[]", "{}").endswith("forward_0-1")
    names = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert not [n for n in names if n.startswith(".tmp-")]
    assert "forward_0-1.scheduled.json" in names and "replay.sh" in names
    script = (tmp_path / "rank0" / "replay.sh").read_text()
    assert "schedule forward_0-1.json --world-size 1 --scheduler jit --disable keep -o forward_0-1.replayed.json" \
        in script


def test_no_dump_without_a_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(dump.ENV, raising=False)
    assert dump.resolve(None) is None
    monkeypatch.setenv(dump.ENV, str(tmp_path))
    assert dump.resolve(None).root == str(tmp_path)
    assert dump.resolve(tmp_path / "x").root == str(tmp_path / "x")
