"""Where compile time goes: unsharded ``torch.compile``, FSDP2 + ``torch.compile`` and
zerosched's backend with Inductor, on the whole model and per decoder block (``*-per-block``:
the blocks compiled one by one, the rest eager), on bench_train.py's models at the CPU's size with
many layers.

Each (model, configuration) runs in a fresh process (one gloo rank, an empty Inductor cache
directory, bench_train.py's ``Run``), times the first training step (which compiles forward and
backward) less the median of the next ``--steps``, and splits the compile by PyTorch's own
``dynamo_timed`` phases (``torch._dynamo.utils.compilation_time_metrics``: dynamo's tracing,
AOTAutograd's joint trace and partition, Inductor's lowering, code generation and C++ build) and
zerosched's ``compiler.STATS`` (export, schedule, rebuild). ``--profile``
writes a cProfile of the first step per run into ``--out-dir``.

    PYTHONPATH=python python python/profile_compile.py --models llama-1b qwen2-moe --layers 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = ("compile", "fsdp2-compile", "fsdp2-per-block", "zerosched-inductor", "zerosched-per-block")

#: Output columns: (header, compilation_time_metrics keys summed).  A phase nested in another
#: (aot_trace_joint_graph inside create_aot_dispatcher_function) is reported on its own too.
PHASES = [
    ("dynamo total", ["_compile.compile_inner"]),
    ("backend", ["OutputGraph.call_user_compiler"]),
    ("AOT joint", ["aot_trace_joint_graph"]),
    ("partition", ["min_cut_rematerialization_partition"]),
    ("Inductor", ["compile_fx_inner"]),
    ("post-grad", ["_recursive_post_grad_passes"]),
    ("lowering", ["GraphLowering.run"]),
    ("Inductor scheduler", ["Scheduler.__init__"]),
    ("codegen", ["GraphLowering.codegen"]),
    ("C++ build", ["PyCodeCache.load_by_key_path"]),
]


def _time_partitioner() -> None:
    """zerosched's partitioner calls min-cut itself (compile_fx times its call under this name)."""
    import functorch.compile as fc
    from torch._dynamo.utils import dynamo_timed

    inner = fc.min_cut_rematerialization_partition

    def timed(*args, **kwargs):
        with dynamo_timed("min_cut_rematerialization_partition"):
            return inner(*args, **kwargs)

    fc.min_cut_rematerialization_partition = timed


def one(model: str, config: str, layers: int, dtype: str, device: str, steps: int, profile: str | None) -> dict:
    import cProfile

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_train
    import zerosched  # noqa: F401  (registers the ops)
    from torch._dynamo.utils import compilation_time_metrics

    torch.set_num_threads(1)
    if config.startswith("zerosched"):
        _time_partitioner()
    store = tempfile.mktemp()
    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            **({"device_id": torch.device("cuda", 0)} if cuda else {}))
    spec = dict((bench_train.MODELS if cuda else bench_train.TINY)[model], layers=layers)
    job = dict(model=model, config=config, spec=spec, dtype=dtype, device=device, micro_batch=1 if cuda else 2,
               budget=None, zerosched_memory=None)
    run = bench_train.Run(job)
    prof = cProfile.Profile() if profile else None
    t, c = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    run.step(1)
    bench_train._sync(run.device)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
    first, first_cpu = time.perf_counter() - t, time.process_time() - c
    from torch._inductor import metrics

    kernels = metrics.generated_kernel_count
    times, cpu = [], []
    for s in range(2, 2 + steps):
        t, c = time.perf_counter(), time.process_time()
        run.step(s)
        bench_train._sync(run.device)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    step = statistics.median(times)
    rec = {"model": model, "config": config, "layers": layers, "compile_s": first - step, "step_s": step,
           "compile_cpu_s": first_cpu - statistics.median(cpu), "kernels": kernels,
           "phases": {k: sum(v) for k, v in compilation_time_metrics.items()}}
    if config.startswith("zerosched"):
        from zerosched import compiler

        rec["zerosched"] = vars(compiler.STATS)
    return rec


def table(rows: list[dict]) -> str:
    head = ["model", "configuration", "compile s", "this process's CPU s", "step s", "kernels"] + [h for h, _ in PHASES] + [
        "zerosched: export", "schedule", "rebuild"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ph = r["phases"]
        cells = [r["model"], r["config"], f"{r['compile_s']:.1f}", f"{r['compile_cpu_s']:.1f}", f"{r['step_s']:.3f}",
                 str(r["kernels"])]
        cells += [f"{sum(ph.get(k, 0.0) for k in keys):.1f}" for _, keys in PHASES]
        z = r.get("zerosched")
        cells += ([f"{z[k]:.2f}" for k in ("export_s", "schedule_s", "rebuild_s")] if z
                  else ["—"] * 3)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-1b", "qwen2-moe"])
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="as bench_train.py's (grouped experts trace in bfloat16 only)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: bench_train.py's full-size models (micro-batch 1), with --layers")
    ap.add_argument("--steps", type=int, default=3, help="steps after the first, for the steady step time")
    ap.add_argument("--profile", action="store_true", help="cProfile of each first step into --out-dir")
    ap.add_argument("--out-dir", default="profile_compile")
    ap.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._one:
        model, config = args._one
        prof = os.path.join(args.out_dir, f"{model}.{config}.prof") if args.profile else None
        print("RECORD " + json.dumps(one(model, config, args.layers, args.dtype, args.device, args.steps, prof)), flush=True)
        return
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    for model in args.models:
        for config in args.configs:
            with tempfile.TemporaryDirectory() as cache:  # nothing compiled by an earlier run is reused
                # -O0: the C++ build is the CPU backend's own cost (a GPU compiles Triton kernels
                # instead, in parallel); unoptimized, it leaves the graph-size-driven phases visible.
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache,
                           **({"TORCHINDUCTOR_DEBUG_COMPILE": "1"} if args.device == "cpu" else {}))
                cmd = [sys.executable, os.path.abspath(__file__), "--_one", model, config, "--layers",
                       str(args.layers), "--dtype", args.dtype, "--device", args.device, "--steps", str(args.steps), "--out-dir", args.out_dir]
                res = subprocess.run(cmd + (["--profile"] if args.profile else []), env=env, capture_output=True,
                                     text=True)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RECORD ")]
            if not lines:
                sys.stderr.write(res.stderr[-4000:])
                continue
            rows.append(json.loads(lines[-1][7:]))
            with open(os.path.join(args.out_dir, "records.jsonl"), "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
