"""The named backend (``backend="zerosched"``) on every rank of a gloo group: from
``torch.compile`` with options, and from transformers' ``Trainer``."""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist

import zerosched
from zerosched import compiler
from train_cases import mean_over_ranks
import zoo_cases

LR = 0.1
STEPS = 3


def _model_and_rows():
    m = zoo_cases.BY_NAME["llama"]
    ref = zoo_cases.build(m, "default")
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(3, zoo_cases.VOCAB, (dist.get_world_size() * zoo_cases.BATCH, zoo_cases.SEQ), generator=g)
    return ref, ids


def _reference(ref: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _param_err(sharded: zerosched.ShardedModel, ref: torch.nn.Module) -> float:
    full = sharded.full_parameters()
    params = dict(ref.named_parameters())
    return max(zoo_cases.param_err(full[e.name], params[e.name].detach()) for e in sharded.entries)


def train_by_name(options: dict, zero: str = "optimizer") -> dict:
    """``torch.compile(model, backend="zerosched", options=options)``, three SGD steps; ``zero``:
    whose ``zero_grad()`` the loop calls, the optimizer's or the compiled model's."""
    rank, b = dist.get_rank(), zoo_cases.BATCH
    ref, ids = _model_and_rows()
    model = copy.deepcopy(ref)
    sharded = zerosched.shard(model)
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    torch._dynamo.reset()
    graphs0 = compiler.STATS.graphs
    out: dict = {"loss": []}
    try:
        compiled = torch.compile(model, backend="zerosched", options=options)
        mine = ids[rank * b : (rank + 1) * b]
        for _ in range(STEPS):
            loss = compiled(input_ids=mine, labels=mine).loss
            loss.backward()
            opt.step()
            (opt if zero == "optimizer" else compiled).zero_grad()
            out["loss"].append(mean_over_ranks(loss.item()))
        out["graphs"] = compiler.STATS.graphs - graphs0
        out["ref_loss"] = _reference(ref, ids)
        out["param_err"] = _param_err(sharded, ref)
        out["gathered_between"] = sharded.gathered()
    finally:
        sharded.close()
        torch._dynamo.reset()
    return out


def train_with_trainer() -> dict:
    """transformers' ``Trainer`` with ``torch_compile_backend="zerosched"``: each rank trains on
    its own in-memory rows (one batch, so every step sees it whole), with an SGD optimizer over
    the shards; no network, no reporting."""
    from transformers import Trainer, TrainingArguments

    rank, b = dist.get_rank(), zoo_cases.BATCH
    ref, ids = _model_and_rows()
    model = copy.deepcopy(ref)
    sharded = zerosched.shard(model)
    rows = [{"input_ids": ids[i], "labels": ids[i]} for i in range(rank * b, (rank + 1) * b)]
    torch._dynamo.reset()
    graphs0 = compiler.STATS.graphs
    out: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(
                output_dir=tmp, torch_compile=True, torch_compile_backend="zerosched", max_steps=STEPS,
                per_device_train_batch_size=b, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                # The gradients lie in the shards: a norm over the model's parameters sees none.
                max_grad_norm=0.0, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                use_cpu=True, dataloader_num_workers=0, seed=0)
            opt = torch.optim.SGD(sharded.parameters(), lr=LR)
            trainer = Trainer(model=model, args=args, train_dataset=rows, optimizers=(opt, None))
            trainer.train()
            out["loss"] = [mean_over_ranks(h["loss"]) for h in trainer.state.log_history if "loss" in h]
        out["graphs"] = compiler.STATS.graphs - graphs0
        out["ref_loss"] = _reference(ref, ids)
        out["param_err"] = _param_err(sharded, ref)
        out["gathered_between"] = sharded.gathered()
    finally:
        sharded.close()
        torch._dynamo.reset()
    return out
