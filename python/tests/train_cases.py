"""Training runs executed on every rank of a gloo process group (see ranks.py).

Each rank trains a sharded model through ``zerosched.backend`` on its slice of the batch; the
reference is the same model, unsharded and eager, on the whole batch (the mean over ranks of
equal-size slices is the whole batch's mean loss, and the averaged gradients its gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerosched
from zerosched import compiler, models, runtime

STEPS = 5
LR = 0.2

SPECS = {
    "llama": models.ModelSpec(model="llama"),
    # float32 experts: transformers' batched_mm (index + bmm); grouped_mm has bfloat16-only fake kernels.
    "qwen2-moe": models.ModelSpec(model="qwen2-moe", experts_impl="batched_mm"),
    "gpt2": models.ModelSpec(model="gpt2"),
    # transformers' default experts: a loop over the experts hit, found with `nonzero`, which
    # breaks the graph; the decoder then runs eagerly around compiled pieces.
    "qwen2-moe-eager": models.ModelSpec(model="qwen2-moe", experts_impl="eager"),
}


#: A cost model under which the scheduler coalesces gathers into buckets at these tiny sizes:
#: slow compute to hide behind, a large per-collective latency.
BUCKETING_COST = {
    "peak_flops": 1e9,
    "peak_flops_fp32": 1e6,
    "mem_bandwidth": 1e9,
    "launch_ms": 1.0,
    "collective": {"kind": "alpha_beta", "alpha_ms": 5.0, "beta_bytes_per_s": 1e9},
}


def batches(spec: models.ModelSpec, world: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, spec.vocab, (world * spec.batch, spec.seq), generator=g) for _ in range(steps)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of ``b``."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    """Backward and one optimizer step; returns the loss."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def mean_over_ranks(x: float) -> float:
    # NCCL reduces GPU tensors only.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train(name: str, inner: str, budget: int, cost: dict | None = None, persistence_threshold: int = 0,
          steps: int = STEPS, device: str = "cpu", per_block: bool = False) -> dict:
    """Trains ``name`` through the backend and its reference side by side; returns what the test
    asserts on.  ``per_block``: each decoder block is compiled on its own and the rest of the
    model runs eagerly, as ``torch.compile`` is applied per block with FSDP2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = SPECS[name]
    ref = models.build(spec)[0].to(device)
    model = models.build(spec)[0].to(device)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    sharded = zerosched.shard(model, persistence_threshold=persistence_threshold)
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    torch._dynamo.reset()
    runtime.RUNTIME.peak_gathered_bytes = 0
    buckets0 = runtime.RUNTIME.coalesced_gathers
    backend = zerosched.backend(budget=budget, inner=inner, cost=cost, debug=True)
    graphs0 = compiler.STATS.graphs
    if per_block:
        for block in model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h:
            block.compile(backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    out: dict = {"loss": [], "ref_loss": [], "gathered_between": [], "bytes_between": [], "model_grads": [],
                 "fallback_after_forward": [], "fallback_between": [], "waits": [], "in_flight_between": []}
    b = spec.batch
    try:
        for ids in batches(spec, world, steps):
            ids = ids.to(device)
            mine = ids[rank * b : (rank + 1) * b]
            loss = compiled(input_ids=mine, labels=mine).loss
            out["fallback_after_forward"].append(sorted(runtime.RUNTIME.fallback))
            waits0 = runtime.RUNTIME.backward_waits
            out["loss"].append(mean_over_ranks(step(loss, opt)))
            out["waits"].append(runtime.RUNTIME.backward_waits - waits0)
            out["in_flight_between"].append(len(runtime.RUNTIME.reductions) + len(runtime.RUNTIME.queued))
            out["ref_loss"].append(step(ref(input_ids=ids, labels=ids).loss, opt_ref))

            out["gathered_between"].append(sharded.gathered())
            out["bytes_between"].append(runtime.RUNTIME.gathered_bytes)
            out["fallback_between"].append(sorted(runtime.RUNTIME.fallback))
            out["model_grads"].append(
                [e.name for e in sharded.entries if not e.persistent and e.param.grad is not None]
            )
        full = sharded.full_parameters()
        out["param_err"] = {n: rel_err(full[n], p.detach()) for n, p in ref.named_parameters()}
        out["moved"] = min(rel_err(p.detach(), initial[n]) for n, p in ref.named_parameters())
        out["peak"] = runtime.RUNTIME.peak_gathered_bytes
        out["buckets"] = runtime.RUNTIME.coalesced_gathers - buckets0
        out["persistent"] = sum(e.persistent for e in sharded.entries)
        out["params"] = len(sharded.entries)
        out["graphs"] = compiler.STATS.graphs - graphs0
    finally:
        sharded.close()
        torch._dynamo.reset()
    return out
