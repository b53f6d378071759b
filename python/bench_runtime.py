"""Host time of zerosched's inserted ops per call and per step, on the CPU (gloo).

For each world size and model, the ranks shard the model, compile it with
``zerosched.backend(inner=...)``, run ``--warmup`` training steps (compiling), then ``--steps``
steps with a ``time.perf_counter`` timer around each call of the runtime function an inserted op
runs (its bookkeeping and the collective's enqueue; on gloo a wait or ``end_backward`` also waits
for the collective itself, which runs on gloo's thread).  Rank 0 prints one table row per
inserted op: calls per step, the median µs per call (the machine is shared: medians are what
stays put between runs) and the ms per step, then all inserted ops' ms per step beside the
median step.  ``--out`` appends one JSON line per (world size, model).  The custom op's own
dispatch (about 2.5 µs a call) is outside the timer.

    PYTHONPATH=python python python/bench_runtime.py                      # both models, 1 and 2 ranks
    PYTHONPATH=python python python/bench_runtime.py --world 2 --models llama-16 --out runtime.jsonl

The models are Llama-style at hidden 64 (sequence 32, micro-batch 2): ``llama-2`` (2 layers,
21 parameters) and ``llama-16`` (16 layers, 147 parameters: as many as ``llama-1b`` has), so the
step is short and the host cost of the inserted ops is most of it.  docs/training-benchmark.md
("Host overhead") has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: name -> zerosched.models.ModelSpec fields.
MODELS = {
    "llama-2": dict(model="llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=32),
    "llama-16": dict(model="llama", layers=16, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=32),
}


def _measure(name: str, args) -> dict:
    import zerosched
    from zerosched import compiler, models

    spec = models.ModelSpec(**MODELS[name], batch=args.micro_batch, dtype=args.dtype)
    model, _ = models.build(spec)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)
    sharded = zerosched.shard(model)
    opt = torch.optim.SGD(sharded.parameters(), lr=1e-3)
    fwd = torch.compile(model, backend=zerosched.backend(inner=args.inner))

    def step() -> float:
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    t0 = time.perf_counter()
    losses = [step() for _ in range(args.warmup)]
    compile_s = time.perf_counter() - t0
    calls: dict[str, list[float]] = {}
    saved = _time_runtime(calls)
    times = []
    try:
        for _ in range(args.steps):
            dist.barrier()
            t = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t)
    finally:
        _untime_runtime(saved)
    ops = {}
    for op, ts in sorted(calls.items()):
        ops[op] = {"calls_per_step": len(ts) / args.steps, "host_us_median": statistics.median(ts) * 1e6,
                   "host_ms_per_step": sum(ts) / args.steps * 1e3}
    sharded.close()
    step_ms = statistics.median(times) * 1e3
    inserted_ms = sum(o["host_ms_per_step"] for o in ops.values())
    return {"model": name, "world_size": dist.get_world_size(), "inner": args.inner, "dtype": args.dtype,
            "params": len(sharded.entries), "ops": ops, "inserted_host_ms_per_step": inserted_ms,
            "step_ms_median": step_ms, "warmup_s": compile_s, "zerosched_compile_s": compiler.STATS.total_s(),
            "losses": losses}


def _time_runtime(calls: dict[str, list[float]]) -> dict:
    """Wraps the runtime functions the ops call with timers (the ops look them up at each call);
    returns the originals.  A gather of several parameters is the op ``allgather_bucket``."""
    from zerosched import runtime

    saved = {n: getattr(runtime, n) for n in ("gather", "wait", "release", "reduce_grad", "end_backward")}

    def timed(name, fn):
        def call(*args):
            t = time.perf_counter()
            out = fn(*args)
            dt = time.perf_counter() - t
            op = "allgather_bucket" if name == "gather" and len(args[0]) > 1 else \
                "allgather" if name == "gather" else name
            calls.setdefault(op, []).append(dt)
            return out
        return call

    for n, fn in saved.items():
        setattr(runtime, n, timed(n, fn))
    return saved


def _untime_runtime(saved: dict) -> None:
    from zerosched import runtime

    for n, fn in saved.items():
        setattr(runtime, n, fn)


def _worker(rank: int, world: int, store: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for name in args.models:
            rec = _measure(name, args)
            if rank == 0:
                results.put(rec)
    finally:
        dist.destroy_process_group()


def _run(world: int, args) -> list[dict]:
    fd, store = tempfile.mkstemp(prefix="zerosched-bench-runtime-")
    os.close(fd)
    os.remove(store)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, store, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    recs = []
    deadline = time.monotonic() + args.timeout * len(args.models)
    while len(recs) < len(args.models):
        try:
            recs.append(results.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank exited with {dead[0]}" if dead else "timed out") from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return recs


def table(recs: list[dict]) -> str:
    lines = ["| world | model | op | calls/step | median µs/call | ms/step |", "|---|---|---|---|---|---|"]
    for r in recs:
        for op, o in sorted(r["ops"].items()):
            lines.append(f"| {r['world_size']} | {r['model']} | `{op}` | {o['calls_per_step']:.0f} | "
                         f"{o['host_us_median']:.1f} | {o['host_ms_per_step']:.2f} |")
        lines.append(f"| {r['world_size']} | {r['model']} | **all inserted** | | | "
                     f"**{r['inserted_host_ms_per_step']:.2f}** of a {r['step_ms_median']:.1f} ms step (median) |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2], help="gloo world sizes to run")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the measured ones (the first compiles)")
    ap.add_argument("--steps", type=int, default=8, help="steps measured")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one model's record")
    ap.add_argument("--out", help="append one JSON line per (world size, model)")
    args = ap.parse_args(argv)
    recs = []
    for world in args.world:
        recs += _run(world, args)
    if args.out:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    print(table(recs), flush=True)
    return recs


if __name__ == "__main__":
    main()
