"""The training benchmark (python/bench_train.py) at its tiny size on the CPU: two gloo ranks,
the tiny Llama in float32, where zerosched's sharded training must follow the unsharded eager
run step for step (same initialisation, same batches, AdamW on float32 master weights)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "python", "bench_train.py")
STEPS = 4


def bench(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "rows.jsonl"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")}
    subprocess.run([sys.executable, SCRIPT, "--tiny", "--out", str(out), *args], check=True, env=env,
                   cwd=tmp_path, timeout=300, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return bench(tmp_path_factory.mktemp("bench"), "--nproc", "2", "--models", "llama-1b", "--configs", "eager",
                 "zerosched-eager", "--steps", str(STEPS), "--warmup", "2", "--dtype", "float32",
                 "--profile-steps", "1")


def test_one_well_formed_record_per_configuration(two_ranks):
    assert [(r["model"], r["config"]) for r in two_ranks] == [("llama-1b", "eager"), ("llama-1b", "zerosched-eager")]
    for r in two_ranks:
        assert r["status"] == "ok", r
        assert r["world_size"] == 2 and r["micro_batch"] == 2 and r["seq"] == 32
        assert len(r["losses"]) == len(r["step_s"]) == STEPS
        assert all(math.isfinite(x) for x in r["losses"])
        assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0
        assert r["mfu"] is None  # no peak FLOP/s on the CPU
        assert r["loss"] == r["losses"][-1]
    assert two_ranks[0]["losses"][-1] < two_ranks[0]["losses"][0]  # the repeated batches are learnt


def test_zerosched_trains_as_the_unsharded_eager_run(two_ranks):
    eager, zs = two_ranks
    assert zs["zerosched"]["graphs"] >= 2  # a forward and a backward graph went through the backend
    assert zs["zerosched"]["peak_gathered_bytes"] > 0
    for got, want in zip(zs["losses"], eager["losses"]):
        assert got == pytest.approx(want, rel=1e-5)


def test_profile_counts_the_inserted_ops_host_time(two_ranks):
    eager, zs = two_ranks
    assert eager["profile"]["inserted"] == {}  # nothing of zerosched's in the unsharded run
    ops = zs["profile"]["inserted"]
    # every parameter is gathered, waited on and released once per step, in one call or a bucket's
    assert ops["zerosched::wait"]["calls_per_step"] == ops["zerosched::release"]["calls_per_step"] > 0
    assert ops["zerosched::reduce_grad"]["calls_per_step"] > 0
    assert 0 < zs["profile"]["inserted_host_share"] < 1


def test_a_configuration_past_its_time_limit_is_recorded_and_the_run_goes_on(tmp_path):
    rows = bench(tmp_path, "--models", "llama-1b", "--configs", "eager", "deepspeed-z3-deepcompile", "--steps", "2",
                 "--warmup", "1", "--timeout", "1.5")
    assert [(r["config"], r["status"]) for r in rows] == [("eager", "timeout"), ("deepspeed-z3-deepcompile", "timeout")]
    assert rows[0]["error"] == "killed after 1.5 s"


def test_a_memory_below_every_schedule_runs_at_the_smallest_the_backend_names(tmp_path):
    (row,) = bench(tmp_path, "--models", "llama-1b", "--configs", "zerosched-memory", "--zerosched-memory", "1",
                   "--steps", "2", "--warmup", "1")
    assert row["status"] == "ok", row
    assert row["memory_asked"] == 1
    assert row["zerosched"]["memory"] > 1  # the named minimum, which then schedules


def test_arch_list_deepspeed_can_parse():
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from bench_train import deepspeed_arch_list

    assert deepspeed_arch_list("9.0a") == "9.0"
    assert deepspeed_arch_list("8.0;9.0a;10.0a+PTX") == "8.0;9.0;10.0+PTX"
    assert deepspeed_arch_list("7.5 8.6+PTX") == "7.5 8.6+PTX"
