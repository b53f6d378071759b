"""Scheduling time of DeepSpeed DeepCompile's ZeRO-3 graphs: DeepSpeed's ``fast_free_schedule``
against ``zerosched.deepspeed.schedule_graph`` (undo DeepSpeed's insertion, export, schedule in
Rust, rebuild), on the same graphs after DeepSpeed's own insertion pass. Prints a table.

    PYTHONPATH=python python benches/deepspeed_adapter.py [--layers 8] [--repeat 3]

Graphs: the Llama-70B and Mixtral-8x7B shapes of the benchmark programs (meta device, bf16,
batch 1 x 4096 tokens), captured by the exporter; ``dc`` ops are the CPU tests' stubs.
Times are medians of ``--repeat`` runs, side by side in one process.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))

import deepspeed.compile.util as ds_util  # noqa: E402

ds_util.get_deepcompile_handle = lambda: None  # DeepSpeed's alias table without its CUDA build

import test_deepspeed as stubs  # noqa: E402  (registers the stub dc ops)
from deepspeed.compile import list_schedule  # noqa: E402
from deepspeed.compile.passes import zero3_compile  # noqa: E402
from deepspeed.compile.profilers.graph_profile import _backfill_missing_profile_metadata  # noqa: E402

from zerosched import _core, export, models  # noqa: E402
from zerosched import deepspeed as zds  # noqa: E402


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def inserted_graphs(spec: models.ModelSpec):
    """DeepSpeed's insertion on the first forward graph of one step and on its backward."""
    model, step = models.build(spec)
    graphs = export.capture(model, step)
    fw = graphs[0]
    bw = next(g for g in graphs if g.kind == "backward" and g.dynamo_index == fw.dynamo_index)
    manager, indices = stubs._manager(fw)
    fw_graph = zero3_compile.add_gather_and_release(0, fw.gm.graph, manager,
                                                    ds_util.get_param_nodes(fw.gm.graph, indices))
    bw_params, grads = manager.get_bwd_mapping(bw.gm.graph)
    bw_graph = zero3_compile.add_gather_and_reduce(0, bw.gm.graph, manager, bw_params, grads)
    for g in (fw_graph, bw_graph):
        _backfill_missing_profile_metadata(g)
    return [("fwd", fw_graph), ("bwd", bw_graph)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    specs = [("Llama-70B", models.ModelSpec(layers=a.layers, **models.LLAMA70B)),
             ("Mixtral-8x7B", models.ModelSpec(layers=max(1, a.layers // 4), **models.MIXTRAL8X7B))]
    rust = []
    core = _core.schedule

    def timed_core(data, options):
        t = time.perf_counter()
        try:
            return core(data, options)
        finally:
            rust.append(time.perf_counter() - t)

    zds._schedule = timed_core
    print("| graph | nodes | gathers | DeepSpeed `fast_free_schedule` s | adapter s | of which Rust s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for label, spec in specs:
        for kind, graph in inserted_graphs(spec):
            nodes = len(graph.nodes)
            gathers = sum(1 for n in graph.nodes if n.target is stubs.GATHER)
            ds = median_s(lambda: list_schedule.fast_free_schedule(graph, 0, 0, False), a.repeat)
            rust.clear()
            ours = median_s(lambda: zds.schedule_graph(graph, world_size=8), a.repeat)
            in_rust = statistics.median(rust)
            print(f"| {label} {spec.layers} layers {kind} | {nodes:,} | {gathers} | {ds:.2f} | {ours:.3f} | "
                  f"{in_rust:.3f} | {ds / ours:.0f}x |", flush=True)


if __name__ == "__main__":
    main()
