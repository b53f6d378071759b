"""Compile-time share and step rate of zerosched's torch.compile backend, per model.

Two gloo ranks on this machine.  For each model (the test suite's small configurations, float32,
or larger ones with --layers/--hidden), rank 0 reports:

* compile: the first training step through ``torch.compile(backend=zerosched.backend(...))``
  less a steady step: dynamo, AOTAutograd, zerosched and the inner compiler;
* unsharded compile: the same for the model unsharded under ``torch.compile`` with the same inner
  compiler (Inductor, or ``aot_eager`` for ``--inner eager``);
* zerosched: export + schedule (the Rust core) + rebuild, summed over the graphs, and the Rust part alone, both as shares of compile; Inductor:
  its compile of the rebuilt graphs;
* steps/s of the sharded compiled model and of the same model unsharded and eager, on the same
  per-rank batch, medians of ``--steps`` steps.

    PYTHONPATH=python python python/bench_compile.py [--inner eager|inductor] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = ("llama", "qwen2-moe", "gpt2")


def _spec(name: str, layers: int, hidden: int):
    from zerosched import models

    impl = "batched_mm" if name == "qwen2-moe" else "grouped_mm"  # float32 experts, as in the tests
    return models.ModelSpec(model=name, layers=layers, hidden=hidden, intermediate=2 * hidden, experts_impl=impl)


def _median_step_s(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(name: str, args) -> dict:
    import zerosched
    from zerosched import compiler as zb
    from zerosched import models

    spec = _spec(name, args.layers, args.hidden)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)

    plain, _ = models.build(spec)
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    def plain_step():
        plain(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    plain_step()  # warm-up
    eager_s = _median_step_s(plain_step, args.steps)

    # The same model unsharded under torch.compile with the same inner compiler: what compiling
    # costs without zerosched (dynamo and AOTAutograd included in both).
    unsharded, _ = models.build(spec)
    uopt = torch.optim.SGD(unsharded.parameters(), lr=1e-3)
    torch._dynamo.reset()
    ucompiled = torch.compile(unsharded, backend="inductor" if args.inner == "inductor" else "aot_eager")

    def unsharded_step():
        ucompiled(input_ids=ids, labels=ids).loss.backward()
        uopt.step()
        uopt.zero_grad()

    t = time.perf_counter()
    unsharded_step()
    unsharded_compile_s = time.perf_counter() - t - _median_step_s(unsharded_step, args.steps)

    model, _ = models.build(spec)
    sharded = zerosched.shard(model)
    sopt = torch.optim.SGD(sharded.parameters(), lr=1e-3)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=zerosched.backend(budget=args.budget, inner=args.inner))

    def step():
        compiled(input_ids=ids, labels=ids).loss.backward()
        sopt.step()
        sopt.zero_grad()

    before = zb.Stats(**vars(zb.STATS))
    dist.barrier()
    t = time.perf_counter()
    step()
    first_s = time.perf_counter() - t
    after = zb.STATS
    step_s = _median_step_s(step, args.steps)
    sharded.close()
    torch._dynamo.reset()
    compile_s = first_s - step_s
    return {
        "model": name,
        "graphs": after.graphs - before.graphs,
        "compile_s": compile_s,
        "export_s": after.export_s - before.export_s,
        "schedule_s": after.schedule_s - before.schedule_s,
        "rebuild_s": after.rebuild_s - before.rebuild_s,
        "inductor_s": after.inductor_s - before.inductor_s,
        "unsharded_compile_s": unsharded_compile_s,
        "steps_per_s": 1 / step_s,
        "eager_steps_per_s": 1 / eager_s,
    }


def _worker(rank: int, world: int, store: str, out: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = [_measure(name, args) for name in args.models]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def table(rows: list[dict], inner: str) -> str:
    lines = [
        f"| model | graphs | compile s | unsharded compile s | zerosched s (export + schedule + rebuild) "
        f"| Inductor s | zerosched share | Rust share | steps/s, zerosched {inner} "
        f"| steps/s, unsharded eager | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        zs = r["export_s"] + r["schedule_s"] + r["rebuild_s"]
        lines.append(
            f"| {r['model']} | {r['graphs']} | {r['compile_s']:.2f} | {r['unsharded_compile_s']:.2f} | {zs:.3f} "
            f"({r['export_s']:.3f} + {r['schedule_s']:.3f} + {r['rebuild_s']:.3f}) "
            f"| {r['inductor_s']:.2f} | {100 * zs / r['compile_s']:.1f}% "
            f"| {100 * r['schedule_s'] / r['compile_s']:.2f}% | {r['steps_per_s']:.2f} | {r['eager_steps_per_s']:.2f} "
            f"| {r['steps_per_s'] / r['eager_steps_per_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inner", choices=["eager", "inductor"], default="eager")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--budget", type=int, default=None, help="bytes per graph (default: no limit)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "rows.json")
        mp.spawn(_worker, args=(2, store, out, args), nprocs=2)
        with open(out) as f:
            rows = json.load(f)
    print(table(rows, args.inner))


if __name__ == "__main__":
    main()
