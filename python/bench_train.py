"""Training benchmark: zerosched's torch.compile backend beside FSDP2, plain torch.compile and
DeepSpeed ZeRO-3 (with and without DeepCompile), per model, in one run on the same machine.

Every (model, configuration) trains from the same random initialisation (seed 0), in bfloat16
with float32 master weights and AdamW (lr 1e-4, weight decay 0.01), on the same token batches,
in a process group of its own (one subprocess per rank, killed at ``--timeout``), and rank 0
appends one JSON line to ``--out``. The table at the end has, per line: tokens/s and model FLOPs
utilisation over the steps after ``--warmup`` (``--steps 30 --warmup 10``: steps 11-30), peak
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, compile seconds (the steps
before the window less as many steps at the window's median), the loss of the last step, and the
status (``ok``, ``oom``, ``timeout``, ``error``, ``skipped``) with the error's last line.
docs/training-benchmark.md describes the models, the configurations and the columns.

GPU (one process per GPU; under torchrun each rank runs its own copy, else it spawns
``--nproc`` ranks itself)::

    PYTHONPATH=python python3 python/bench_train.py --out $OUT/train.jsonl --log-dir $OUT/logs

CPU smoke (gloo, tiny models, a few steps)::

    PYTHONPATH=python python python/bench_train.py --tiny --nproc 2 --configs eager zerosched-eager

DeepSpeed is imported only by its configurations. For a machine without it (or without the
network), ``scripts/gpu-bench-prepare`` builds the extension and fills ``.whl/``; carry both
(git ignores them) and install from there, with ninja's directory on PATH for DeepSpeed's op
builds::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:python PATH=/tmp/site/bin:$PATH
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

# --------------------------------------------------------------------------------------------
# models and configurations
# --------------------------------------------------------------------------------------------

#: name -> zerosched.models.ModelSpec fields (dtype: bfloat16) and sequence length.
MODELS = {
    # Llama-3.2-1B's shape, embedding untied: 1.50 B parameters.
    "llama-1b": dict(model="llama", layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192,
                     vocab=128256, seq=4096),
    # GPT-2 medium: 355 M parameters, embedding tied to the output head, its 1024-token context.
    "gpt2-medium": dict(model="gpt2", layers=24, hidden=1024, heads=16, intermediate=4096, vocab=50257, seq=1024),
    # Qwen2-MoE-style: 16 experts (top 4) and a shared expert per layer: 1.28 B parameters, 0.42 B
    # active; experts through torch._grouped_mm.
    "qwen2-moe": dict(model="qwen2-moe", layers=16, hidden=1024, heads=16, kv_heads=4, intermediate=1408,
                      experts=16, top_k=4, vocab=32000, seq=4096, experts_impl="grouped_mm"),
    # The same with transformers' eager experts: a loop over the experts hit, found with `nonzero`,
    # which breaks the graph (zerosched's eager fallback runs the decoder around compiled pieces).
    "qwen2-moe-eager": dict(model="qwen2-moe", layers=16, hidden=1024, heads=16, kv_heads=4, intermediate=1408,
                            experts=16, top_k=4, vocab=32000, seq=4096, experts_impl="eager"),
}

#: The same families at the test suite's size, for the CPU (--tiny).
TINY = {
    "llama-1b": dict(model="llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, seq=32),
    "gpt2-medium": dict(model="gpt2", layers=2, hidden=64, heads=4, intermediate=128, vocab=256, seq=32),
    "qwen2-moe": dict(model="qwen2-moe", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=64, experts=4,
                      top_k=2, vocab=256, seq=32, experts_impl="grouped_mm"),
    "qwen2-moe-eager": dict(model="qwen2-moe", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=64,
                            experts=4, top_k=2, vocab=256, seq=32, experts_impl="eager"),
}

#: name -> what it runs (docs/training-benchmark.md).
CONFIGS = {
    "eager": "unsharded, no compile (the reference the others' losses are compared with)",
    "compile": "unsharded, torch.compile (Inductor): the upper bound at world size 1",
    "zerosched-eager": "zerosched.shard + torch.compile(backend=zerosched.backend(inner='eager'))",
    "zerosched-inductor": "zerosched.shard + torch.compile(backend=zerosched.backend(inner='inductor'))",
    "zerosched-per-block": "as zerosched-inductor, but each decoder block compiled on its own (block.compile), the "
                           "rest eager: one compiled block graph serves every block",
    "zerosched-memory": "as zerosched-inductor, with backend(memory=--zerosched-memory); by default the memory "
                        "at which the step peaks where fsdp2-compile did (needs both run before it)",
    "fsdp2-compile": "fully_shard per decoder block and on the root, then torch.compile (Inductor)",
    "fsdp2-per-block": "fully_shard per decoder block and on the root, then block.compile() on each decoder block, "
                       "the rest eager",
    "deepspeed-z3": "DeepSpeed ZeRO-3, bf16, no compile",
    "deepspeed-z3-deepcompile": "DeepSpeed ZeRO-3, bf16, DeepCompile (engine.compile())",
    "deepspeed-z3-deepcompile-zerosched": "as deepspeed-z3-deepcompile, with zerosched.deepspeed.install()",
}

LR = 1e-4
WEIGHT_DECAY = 0.01
#: Distinct batches the steps cycle through: a repeated batch is learnable, so the loss falls and
#: configurations that train differently end at visibly different losses.
DATA_POOL = 4

#: Dense bf16 peak FLOP/s by device name (the data sheets' SXM figures, without sparsity).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


# --------------------------------------------------------------------------------------------
# one configuration on one rank
# --------------------------------------------------------------------------------------------


class MasterAdamW:
    """AdamW on float32 copies of low-precision parameters: each step upcasts the gradients into
    the copies, steps them, and writes them back rounded. Works on any tensors an optimizer can
    step (the model's parameters, zerosched's flat shards, FSDP2's DTensors)."""

    def __init__(self, params, lr: float, weight_decay: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None


def flops_per_token(model: torch.nn.Module, spec) -> float:
    """6·N + 12·L·d·s: N counts the weights of matrix products a token passes through (every
    parameter of two or more dimensions but the input embeddings, the output head counted even when
    tied, each expert's weights times top_k / experts), 12·L·d·s the attention scores and their
    weighted sum, forward and backward (PaLM, appendix B; no discount for the causal mask)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    n = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in embeddings:
            continue
        n += p.numel() * (spec.top_k / spec.experts if ".experts." in name else 1)
    out = model.get_output_embeddings()
    if out is not None and id(out.weight) in embeddings:
        n += out.weight.numel()  # tied: the head's product is real compute
    return 6 * n + 12 * spec.layers * spec.hidden * spec.seq


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = model.base_model
    return list(base.layers if hasattr(base, "layers") else base.h)


def batch(spec, step: int, rank: int, micro_batch: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + (step % DATA_POOL) * 64 + rank)
    return torch.randint(0, spec.vocab, (micro_batch, spec.seq), generator=g).to(device)


class Run:
    """Sets up one configuration on this rank and trains it step by step."""

    def __init__(self, job: dict) -> None:
        import torch.distributed as dist

        from zerosched import models

        self.job, self.config = job, job["config"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = job["device"] == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.spec = models.ModelSpec(**job["spec"], dtype=job["dtype"])
        cfg = models.make_config(self.spec)
        torch.manual_seed(self.spec.seed)
        with torch.device(self.device):
            model = models.model_class(self.spec.model)(cfg)  # float32 init, as the reference
        model.loss_type = "ForCausalLM"  # GPT-2's class maps to no loss type: a logging graph break
        self.model = model.to(getattr(torch, job["dtype"])).train()
        if self.device.type == "cuda":  # the float32 initialisation is gone: count from the bf16 model on
            torch.cuda.reset_peak_memory_stats()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.flops = flops_per_token(self.model, self.spec)
        self.engine = None
        self.fwd = self._setup()

    def _setup(self):
        c, model = self.config, self.model
        if c in ("eager", "compile"):
            self.opt = MasterAdamW(model.parameters(), LR, WEIGHT_DECAY)
            return torch.compile(model) if c == "compile" else model
        if c.startswith("zerosched"):
            import zerosched

            kw = dict(inner="eager" if c == "zerosched-eager" else "inductor")
            if c == "zerosched-memory":
                if "memory" not in inspect.signature(zerosched.backend).parameters:
                    raise Skip("zerosched.backend has no memory= option in this checkout")
                kw["memory"] = self.job["zerosched_memory"]
            self.sharded = zerosched.shard(model)
            self.opt = MasterAdamW(self.sharded.parameters(), LR, WEIGHT_DECAY)
            backend = zerosched.backend(budget=self.job["budget"], **kw)
            if c == "zerosched-per-block":
                for block in decoder_blocks(model):
                    block.compile(backend=backend)
                return model
            return torch.compile(model, backend=backend)
        if c.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard

            for block in decoder_blocks(model):
                fully_shard(block)
            fully_shard(model)
            self.opt = MasterAdamW(model.parameters(), LR, WEIGHT_DECAY)
            if c == "fsdp2-per-block":
                for block in decoder_blocks(model):
                    block.compile()
                return model
            return torch.compile(model)
        if c.startswith("deepspeed"):
            return self._deepspeed()
        raise ValueError(f"unknown configuration {c!r}")

    def _deepspeed(self):
        try:
            import deepspeed
        except ImportError as e:
            raise Skip(f"deepspeed is not installed ({e})") from None
        if self.config != "deepspeed-z3" and self.device.type != "cuda":
            raise Skip("DeepCompile needs CUDA (deepspeed.compile.util.is_deepcompile_supported)")
        ds_config = {
            "train_micro_batch_size_per_gpu": self.job["micro_batch"],
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": self.job["dtype"] == "bfloat16"},
            "zero_optimization": {"stage": 3},
            # torch.optim.AdamW on DeepSpeed's float32 partitions (its FusedAdam would be built first).
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
            "steps_per_print": 10**9,
        }
        if self.config != "deepspeed-z3":
            ds_config["compile"] = {"deepcompile": True}
        engine, _, _, _ = deepspeed.initialize(model=self.model, model_parameters=self.model.parameters(),
                                               config=ds_config)
        if self.config == "deepspeed-z3-deepcompile-zerosched":
            import zerosched.deepspeed

            zerosched.deepspeed.install()
        if self.config != "deepspeed-z3":
            engine.compile()
        self.engine = engine
        return engine

    def step(self, step: int, collectives: bool = True) -> float:
        """One training step; the mean loss over the ranks (this rank's, without ``collectives``:
        only the unsharded configurations can do without)."""
        import torch.distributed as dist

        from zerosched import models

        ids = batch(self.spec, step, self.rank, self.job["micro_batch"], self.device)
        with models._grouped_mm_everywhere():
            loss = self.fwd(input_ids=ids, labels=ids).loss
            if self.engine is not None:
                self.engine.backward(loss)
                self.engine.step()
            else:
                loss.backward()
                if self.config in ("eager", "compile") and self.world > 1 and collectives:
                    for p in self.model.parameters():  # data parallel without sharding
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= self.world
                self.opt.step()
                self.opt.zero_grad()
        t = loss.detach().float().reshape(1)
        if not collectives:
            return t.item()
        dist.all_reduce(t)
        return t.item() / self.world


class Skip(Exception):
    """The configuration cannot run here; the message says why."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_job(job: dict) -> dict:
    """Trains one configuration on this rank; returns the record (rank 0's is kept)."""
    import torch.distributed as dist

    rec: dict = {"model": job["model"], "config": job["config"], "world_size": dist.get_world_size(),
                 "micro_batch": job["micro_batch"], "seq": job["spec"]["seq"], "dtype": job["dtype"]}
    cuda = job["device"] == "cuda"
    peak = job["peak_flops"]
    if cuda:
        rec["device"] = torch.cuda.get_device_name()
        if peak is None:
            peak = next((v for k, v in PEAK_BF16.items() if k in rec["device"]), None)
    t0 = time.perf_counter()
    run = Run(job)
    rec.update(params=run.params, flops_per_token=run.flops, setup_s=time.perf_counter() - t0)
    losses, times = [], []
    for s in range(1, job["steps"] + 1):
        dist.barrier()
        _sync(run.device)
        t = time.perf_counter()
        losses.append(run.step(s))
        _sync(run.device)
        times.append(time.perf_counter() - t)
    w = job["warmup"]
    window, median = times[w:], statistics.median(times[w:])
    tokens = rec["world_size"] * job["micro_batch"] * job["spec"]["seq"]
    tps = tokens * len(window) / sum(window)
    rec.update(
        status="ok",
        tokens_per_s=tps,
        mfu=tps * run.flops / (peak * rec["world_size"]) if peak else None,
        step_s_median=median,
        compile_s=sum(times[:w]) - w * median,
        loss=losses[-1],
        losses=losses,
        step_s=times,
    )
    if cuda:
        rec["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if job.get("profile_steps"):
        rec["profile"] = profile_steps(run, job["steps"], job["profile_steps"])
    if job["config"].startswith("zerosched"):
        from zerosched import compiler, runtime

        rec["zerosched"] = dict(vars(compiler.STATS), peak_gathered_bytes=runtime.RUNTIME.peak_gathered_bytes,
                                fallback_gathers=runtime.RUNTIME.fallback_gathers,
                                simulated_peak_bytes=simulated_peak(compiler), memory=job["zerosched_memory"])
    return rec


def simulated_peak(compiler) -> int | None:
    """The most bytes any scheduled graph holds at once as the simulator counts them (the quantity
    that ``memory=`` bounds), over the schedules this process made."""
    peaks = [json.loads(report).get("simulation", {}).get("total", {}).get("peak_total_bytes")
             for _, report in compiler._CACHE.values()]
    return max((p for p in peaks if p is not None), default=None)


def root_cause(e: BaseException) -> BaseException:
    """The error a backend raised, out of dynamo's wrapper (``BackendCompilerFailed`` holds it as
    ``inner_exception``) or an exception chain."""
    while True:
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if not isinstance(inner, Exception):
            return e
        e = inner


def named_minimum(rec: dict) -> int | None:
    """The smallest memory budget that an ``OverBudgetError`` in ``rec`` names, if it failed on one."""
    m = re.search(r"OverBudgetError: .*the smallest memory budget that works is (\d+) bytes", rec.get("error") or "")
    return int(m.group(1)) if m else None


def matched_memory(rows: list[dict], model: str, target: str) -> tuple[int | None, str]:
    """The ``memory=`` at which zerosched's step should peak where ``target`` did on ``model``:
    ``target``'s peak allocation less what zerosched-inductor's step held beyond its schedules'
    simulated peak (master weights, optimizer state, the allocator's working set), as a user
    who wants that peak would set it."""
    by = {r["config"]: r for r in rows if r["model"] == model and r.get("status") == "ok"}
    ref, own = by.get(target), by.get("zerosched-inductor")
    sim = (own or {}).get("zerosched", {}).get("simulated_peak_bytes")
    if ref is None or own is None or sim is None or "peak_allocated_gib" not in ref:
        return None, f"needs {target} and zerosched-inductor run before it on {model}, on CUDA"
    outside = own["peak_allocated_gib"] * 2**30 - sim
    memory = int(ref["peak_allocated_gib"] * 2**30 - outside)
    if memory <= 0:
        return None, f"{target}'s peak is below what the step holds outside its graphs"
    return memory, ""


def profile_steps(run: "Run", first: int, n: int) -> dict:
    """Host time per op over ``n`` steps after the timed ones, from torch.profiler's CPU events
    (an op's total includes what it calls: for an inserted op, the runtime's bookkeeping and the
    collective's launch): zerosched's inserted ops each, and the 12 heaviest ops of any kind, per
    step; ``inserted_host_share`` is the inserted ops' host time over the profiled steps' wall time
    (the profiler's own cost is in both)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    wall = 0.0
    with profile(activities=acts) as prof:
        for s in range(first + 1, first + n + 1):
            dist.barrier()
            t = time.perf_counter()
            run.step(s)
            _sync(run.device)
            wall += time.perf_counter() - t
    rows = {e.key: e for e in prof.key_averages()}

    def row(e) -> dict:
        return {"calls_per_step": e.count / n, "host_us_per_call": e.cpu_time_total / max(e.count, 1),
                "host_ms_per_step": e.cpu_time_total / n / 1e3}

    inserted = {k: row(e) for k, e in sorted(rows.items()) if k.startswith("zerosched::")}
    heaviest = sorted(rows.values(), key=lambda e: -e.self_cpu_time_total)[:12]
    host = sum(r["host_ms_per_step"] for r in inserted.values()) / 1e3
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    return {"steps": n, "step_s": wall / n, "inserted": inserted, "inserted_host_s_per_step": host,
            "inserted_host_share": host * n / wall,
            "heaviest_self": {e.key: {"self_host_ms_per_step": e.self_cpu_time_total / n / 1e3,
                                      "calls_per_step": e.count / n} for e in heaviest}}


def search_micro_batch(job: dict) -> dict:
    """The largest micro-batch (doubling from 1, at most ``max``) whose full training step (forward,
    backward, AdamW with its states) runs unsharded and eagerly without running out of memory and
    peaks below ``headroom`` of the device's memory. Eager keeps more activations than a compiled
    step, which leaves room for the configurations that hold more (DeepSpeed's float32 partitions).
    Each rank searches on its own (a rank out of memory would leave the others waiting in a
    collective); the ranks then take the smallest result."""
    import torch.distributed as dist

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    run = Run({**job, "config": "eager", "micro_batch": 1})
    best, tried = 0, {}
    mb = 1
    while mb <= job["max_micro_batch"]:
        run.job["micro_batch"] = mb
        torch.cuda.reset_peak_memory_stats()
        try:
            run.step(1, collectives=False)
            _sync(run.device)
            peak = torch.cuda.max_memory_reserved()
        except torch.OutOfMemoryError:
            peak = None
        run.opt.zero_grad()
        torch.cuda.empty_cache()
        tried[mb] = None if peak is None else peak / 2**30
        if peak is None or peak > job["headroom"] * total:
            break
        best, mb = mb, mb * 2
    agreed = torch.tensor([best], device=run.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return {"micro_batch": int(agreed.item()), "tried_gib": tried, "total_gib": total / 2**30}


def build_deepcompile_op(job: dict) -> dict:
    """Builds (or loads from torch's extension cache) DeepCompile's C++ op before the DeepCompile
    configurations run, so that their compile time leaves the build out."""
    try:
        from deepspeed.ops.op_builder.dc import DeepCompileBuilder
    except ImportError as e:
        raise Skip(f"deepspeed is not installed ({e})") from None
    t = time.perf_counter()
    DeepCompileBuilder().load()
    return {"status": "ok", "build_s": time.perf_counter() - t}


def worker_main(path: str) -> None:
    """One rank of one job (``--_job FILE``), in the process group that the environment names."""
    import torch.distributed as dist

    import zerosched  # noqa: F401  (registers the ops before any rank compiles)

    with open(path) as f:
        job = json.load(f)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if job["device"] == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
        dist.init_process_group("gloo")
    try:
        rec = {"search": search_micro_batch, "build": build_deepcompile_op, "train": run_job}[job["kind"]](job)
    except Skip as e:
        rec = {"status": "skipped", "error": str(e)}
    except torch.OutOfMemoryError as e:
        rec = {"status": "oom", "error": str(e).splitlines()[0]}
    except Exception as e:  # noqa: BLE001  (the record says what failed; the log has the traceback)
        traceback.print_exc()
        e = root_cause(e)
        lines = str(e).strip().splitlines()
        rec = {"status": "error", "error": f"{type(e).__name__}: {lines[-1] if lines else ''}"}
    path = f"{job['record']}.{dist.get_rank()}"
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)
    # A rank that failed may leave collectives pending on others: leave without waiting for them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# the driver: one process group per job, a time limit each, one JSON line per configuration
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool_dirs() -> list[str]:
    """Where pip put ``ninja``, which torch's extension builder (DeepSpeed's ops) looks for on PATH:
    beside this interpreter, or in the ``bin`` of a ``pip install --target`` directory on sys.path."""
    dirs = [os.path.dirname(sys.executable)]
    dirs += [os.path.join(p, "bin") for p in sys.path if p and os.path.isfile(os.path.join(p, "bin", "ninja"))]
    return dirs


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder parses it: PyTorch also takes
    architecture-specific targets such as ``9.0a`` (GPU images set them), on which DeepSpeed's
    ``int()`` of the minor version fails, so the letter is dropped (DeepCompile's op uses no
    architecture-specific instruction); ``+PTX`` and the separators stay."""
    return re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", value)


def launch(job: dict, args, log: str, timeout: float, index: int) -> dict:
    """Runs ``job`` on every local rank (this machine's ranks under torchrun, else ``--nproc``
    spawned ones) and returns rank 0's record, or a timeout/error record."""
    with tempfile.TemporaryDirectory() as d:
        job = {**job, "record": os.path.join(d, "record.json")}
        path = os.path.join(d, "job.json")
        with open(path, "w") as f:
            json.dump(job, f)
        if "RANK" in os.environ:  # under torchrun: one rank here, the group on a port of its own per job
            ranks = [dict(RANK=os.environ["RANK"], LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))]
            base = dict(WORLD_SIZE=os.environ["WORLD_SIZE"], MASTER_ADDR=os.environ["MASTER_ADDR"],
                        MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + 1 + index),
                        LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", "1"))
        else:
            ranks = [dict(RANK=str(r), LOCAL_RANK=str(r)) for r in range(args.nproc)]
            base = dict(WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                        LOCAL_WORLD_SIZE=str(args.nproc))
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
        env["PATH"] = os.pathsep.join([*_tool_dirs(), env.get("PATH", "")])
        if "TORCH_CUDA_ARCH_LIST" in env:
            env["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(env["TORCH_CUDA_ARCH_LIST"])
        procs = []
        with open(log, "w") as logf:
            for r in ranks:
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--_job", path], env={**env, **base, **r},
                    stdout=logf if r["LOCAL_RANK"] == "0" else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                    start_new_session=True))
            deadline = time.monotonic() + timeout
            timed_out = False
            for i, p in enumerate(procs):
                # Once the first rank is done, the others get 30 s: one that ran out of memory
                # leaves the rest waiting in a collective.
                limit = deadline if i == 0 else min(deadline, time.monotonic() + 30)
                try:
                    p.wait(timeout=max(0.0, limit - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = i == 0
                    break
            for p in procs:  # our own ranks, each in a session of its own with its children
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        if timed_out:
            return {"status": "timeout", "error": f"killed after {timeout:g} s"}
        mine = f"{job['record']}.{ranks[0]['RANK']}"  # the record of this machine's first rank
        if not os.path.exists(mine):
            return {"status": "error", "error": f"rank {ranks[0]['RANK']} wrote no record (exit "
                    f"{procs[0].returncode}); see {log}"}
        with open(mine) as f:
            return json.load(f)


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    lines = ["| model | config | world | micro-batch | tokens/s | MFU | peak alloc GiB | peak reserved GiB "
             "| compile s | loss | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if not r.get("error") else f"{r['status']}: {r['error'][:120]}"
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        lines.append(
            f"| {r['model']} | {r['config']} | {r.get('world_size', '')} | {r.get('micro_batch', '')} "
            f"| {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(mfu, '.1f')}{'%' if mfu is not None else ''} "
            f"| {_fmt(r.get('peak_allocated_gib'), '.2f')} | {_fmt(r.get('peak_reserved_gib'), '.2f')} "
            f"| {_fmt(r.get('compile_s'), '.1f')} | {_fmt(r.get('loss'), '.4f')} | {status} |")
    return "\n".join(lines)


def _budget(text: str | None):
    if text is None:
        return None
    return int(text) if text.isdigit() else text


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="steps before the measured window")
    ap.add_argument("--seq", type=int, help="sequence length for every model (default: the model's)")
    ap.add_argument("--layers", type=int, help="decoder layers for every model (default: the model's)")
    ap.add_argument("--micro-batch", default=None, help="sequences per rank and step, or 'auto' (default on CUDA: "
                    "the largest that fits, by a doubling search per model; on the CPU: 2)")
    ap.add_argument("--max-micro-batch", type=int, default=32)
    ap.add_argument("--headroom", type=float, default=0.8, help="auto: the search's step must peak below this "
                    "fraction of the device's memory")
    ap.add_argument("--profile-steps", type=int, default=0, help="after the timed steps, this many more under "
                    "torch.profiler: host time per op (zerosched's inserted ops and the heaviest others) in the record")
    ap.add_argument("--budget", default=None, help="zerosched.backend budget (bytes or '2GiB'; default: none)")
    ap.add_argument("--zerosched-memory", default="match:fsdp2-compile",
                    help="zerosched.backend memory= for zerosched-memory: bytes, '30GiB', or 'match:CONFIG', the memory "
                         "at which the step peaks where CONFIG did (from CONFIG's and zerosched-inductor's records, "
                         "run before it on the same model)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="parameter and compute dtype (master weights are always float32)")
    ap.add_argument("--tiny", action="store_true", help="the tiny models on the CPU (gloo)")
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if available and not --tiny")
    ap.add_argument("--nproc", type=int, default=None, help="ranks to spawn when not under torchrun (default: "
                    "the GPUs, or 1 on the CPU)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run: a configuration "
                    "that cannot start with 20 s left is skipped, and each is cut off at the deadline")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device dense bf16 peak for MFU "
                    "(default: by device name; none on the CPU)")
    ap.add_argument("--out", default="bench_train.jsonl", help="JSON lines, one per configuration (appended)")
    ap.add_argument("--log-dir", default=None, help="rank 0's output per configuration (default: beside --out)")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 1
    if args.micro_batch is None:
        args.micro_batch = "auto" if args.device == "cuda" else "2"
    if args.micro_batch != "auto" and not args.micro_batch.isdigit():
        ap.error("--micro-batch: a positive integer or 'auto'")
    if args.micro_batch == "auto" and args.device != "cuda":
        ap.error("--micro-batch auto needs CUDA (it catches CUDA out-of-memory errors)")
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must be below --steps")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    start = time.monotonic()
    log_dir = args.log_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "bench_train_logs")
    os.makedirs(log_dir, exist_ok=True)
    leader = os.environ.get("RANK", "0") == "0"
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12  # else the job's, by device name
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    rows: list[dict] = []
    index = 0

    def left() -> float:
        return math.inf if args.deadline is None else args.deadline - (time.monotonic() - start)

    def go(job: dict, name: str) -> dict:
        nonlocal index
        index += 1
        if left() < 20:
            return {"status": "skipped", "error": "no time left before --deadline"}
        t = time.monotonic()
        rec = launch(job, args, os.path.join(log_dir, f"{name}.log"), min(args.timeout, left()), index)
        rec["wall_s"] = time.monotonic() - t
        return rec

    def record(rec: dict) -> None:
        if leader:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    op_built = args.device != "cuda"  # DeepCompile is skipped on the CPU
    for model in args.models:
        spec = dict((TINY if args.tiny else MODELS)[model])
        if args.seq:
            spec["seq"] = args.seq
        if args.layers:
            spec["layers"] = args.layers
        base = dict(model=model, spec=spec, dtype=args.dtype, device=args.device, steps=args.steps,
                    profile_steps=args.profile_steps, warmup=args.warmup, budget=_budget(args.budget),
                    peak_flops=peak, max_micro_batch=args.max_micro_batch, headroom=args.headroom)
        mb, found = (None, {}) if args.micro_batch == "auto" else (int(args.micro_batch), None)
        if mb is None:
            found = go({**base, "kind": "search", "config": "search", "micro_batch": 1}, f"{model}.search")
            print(f"{model}: micro-batch search {json.dumps(found)}", flush=True)
            mb = found.get("micro_batch") or None
        for config in args.configs:
            if "deepcompile" in config and not op_built:
                op_built = True
                rec = {"model": "-", "config": "deepcompile-op-build",
                       **go(dict(kind="build", device=args.device), "deepcompile-op-build")}
                print(f"DeepCompile's op: {json.dumps(rec)}", flush=True)
                record(rec)
            memory, why = (_budget(args.zerosched_memory) if config == "zerosched-memory" else None), ""
            if str(memory).startswith("match:"):
                memory, why = matched_memory(rows, model, memory.split(":", 1)[1])
            if mb is None:
                why = found.get("error") or "none fits"
                rec = {"status": "skipped", "error": f"the micro-batch search: {why}"}
            elif memory is None and config == "zerosched-memory":
                rec = {"status": "skipped", "error": f"--zerosched-memory: {why}"}
            else:
                base["zerosched_memory"] = memory
                rec = go({**base, "kind": "train", "config": config, "micro_batch": mb}, f"{model}.{config}")
                if rec.get("status") == "oom" and mb > 1:  # this configuration holds more: half the batch
                    rec = go({**base, "kind": "train", "config": config, "micro_batch": mb // 2},
                             f"{model}.{config}.half")
                # Below what any schedule needs: again at the smallest the backend names. It names
                # the smallest for one dynamo graph's forward and backward, so a later dynamo graph
                # (after a graph break) may name a larger one.
                named = named_minimum(rec) if config == "zerosched-memory" else None
                for attempt in range(3):
                    if named is None:
                        break
                    base["zerosched_memory"] = named
                    rec = go({**base, "kind": "train", "config": config, "micro_batch": mb},
                             f"{model}.{config}.named{attempt}")
                    rec["memory_asked"] = memory
                    later = named_minimum(rec)
                    named = later if later is not None and later > named else None
            rec = {"model": model, "config": config, "world_size": world, "micro_batch": mb, **rec}
            if found is not None:
                rec["micro_batch_search"] = found
            rows.append(rec)
            record(rec)
            if leader:
                print(table([rec]).splitlines()[-1], flush=True)
    if leader:
        print(table(rows), flush=True)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_job":
        worker_main(sys.argv[2])
    else:
        main()
