"""The model zoo: tiny random-weight configs of transformers architectures with their default
settings, trained through the backend on every rank of a gloo group (see ranks.py) against the
same model unsharded and eager on the whole batch.

Every model of one run (:func:`train_zoo`) trains inside the same pair of rank processes: a
process pair per model would spend most of the time importing transformers.  A failing model
returns its traceback instead of stopping the others; test_zoo.py turns each row into a test.

*Variants* are what users turn on: activation checkpointing (transformers'
``gradient_checkpointing_enable()``, or ``torch.utils.checkpoint`` around each block), bf16
``torch.autocast``, dropout, padding with an ``attention_mask``, and gradient accumulation over
micro-batches.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

import zerosched
from zerosched import runtime
from train_cases import mean_over_ranks

STEPS = 3
LR = 0.1
BATCH = 2  # rows per rank
SEQ = 8
VOCAB = 128

# Shapes only: every other field keeps the config's default (dropout rates, attention
# implementation, use_cache, tie_word_embeddings, rope, activations, router settings).
_DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
# Mixture-of-experts layers loop over the experts hit by default (a graph break on `nonzero`);
# batched_mm is one gather and one bmm for all of them.
_MOE = dict(experts_implementation="batched_mm")


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    family: str
    cls: str  # transformers model class
    config: dict
    moe: bool = False
    inputs: str = "ids"  # ids | pixels
    blocks: str = "model.layers"  # the decoder blocks (torch.utils.checkpoint around each)


ZOO: list[Model] = [
    Model("llama", "Llama", "LlamaForCausalLM", _DEC),
    Model("mistral", "Mistral", "MistralForCausalLM", _DEC),
    Model("qwen2", "Qwen", "Qwen2ForCausalLM", _DEC),
    Model("qwen3", "Qwen", "Qwen3ForCausalLM", {**_DEC, "head_dim": 8}),
    Model("gemma", "Gemma", "GemmaForCausalLM", {**_DEC, "head_dim": 8}),
    Model("gemma2", "Gemma", "Gemma2ForCausalLM", {**_DEC, "head_dim": 8}),
    Model("phi", "Phi", "PhiForCausalLM", _DEC),
    # Phi-3's default padding token (32000) lies outside a tiny vocabulary.
    Model("phi3", "Phi", "Phi3ForCausalLM", {**_DEC, "pad_token_id": 0}),
    Model("gpt2", "GPT-2", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64),
          blocks="transformer.h"),
    Model("gpt_neox", "GPT-NeoX", "GPTNeoXForCausalLM",
          dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
               max_position_embeddings=64), blocks="gpt_neox.layers"),
    Model("falcon", "Falcon", "FalconForCausalLM",
          dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB), blocks="transformer.h"),
    Model("bert", "BERT", "BertForMaskedLM",
          dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
               max_position_embeddings=64), blocks="bert.encoder.layer"),
    Model("roberta", "RoBERTa", "RobertaForMaskedLM",
          dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
               max_position_embeddings=64), blocks="roberta.encoder.layer"),
    Model("deberta_v2", "DeBERTa", "DebertaV2ForMaskedLM",
          dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
               max_position_embeddings=64), blocks="deberta.encoder.layer"),
    Model("t5", "T5", "T5ForConditionalGeneration",
          dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB), blocks="encoder.block"),
    Model("bart", "BART", "BartForConditionalGeneration",
          dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64),
          blocks="model.encoder.layers"),
    Model("mixtral", "Mixtral", "MixtralForCausalLM", {**_DEC, **_MOE, "num_local_experts": 4}, moe=True),
    Model("olmoe", "OLMoE", "OlmoeForCausalLM", {**_DEC, **_MOE, "num_experts": 4, "num_experts_per_tok": 2},
          moe=True),
    Model("qwen2_moe", "Qwen2-MoE", "Qwen2MoeForCausalLM",
          {**_DEC, **_MOE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32}, moe=True),
    Model("deepseek_v3", "DeepSeek-V3", "DeepseekV3ForCausalLM",
          # multi-head latent attention: as many key/value heads as query heads
          {**_DEC, **_MOE, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "n_shared_experts": 1,
           "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
           "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8},
          moe=True),
    Model("vit", "ViT", "ViTForImageClassification",
          dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
               patch_size=8), inputs="pixels", blocks="vit.encoder.layer"),
]
BY_NAME = {m.name: m for m in ZOO}

#: What users turn on (docs/python.md, "The model zoo").
VARIANTS = ("default", "checkpoint", "checkpoint-blocks", "autocast", "dropout", "padding", "accumulate")


#: Every dropout rate of the config in the dropout variant (many configs default to 0).
DROPOUT = 0.1


def _set_dropout(cfg, p: float) -> None:
    for k, v in list(vars(cfg).items()):
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
            setattr(cfg, k, p)


class Checkpointed(torch.nn.Module):
    """A block run under ``torch.utils.checkpoint`` (non-reentrant, as PyTorch recommends)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def build(m: Model, variant: str) -> torch.nn.Module:
    import transformers as tf

    cls = getattr(tf, m.cls)
    cfg = cls.config_class(**m.config)
    _set_dropout(cfg, DROPOUT if variant == "dropout" else 0.0)
    if cfg.is_encoder_decoder and getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = cfg.pad_token_id  # T5's convention, which its config leaves unset
    torch.manual_seed(0)
    model = cls(cfg).train()
    if variant != "dropout":
        for mod in model.modules():  # dropouts built from rates the config does not name
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    if variant == "checkpoint":
        model.gradient_checkpointing_enable()
    if variant == "checkpoint-blocks":
        blocks = model.get_submodule(m.blocks)
        for i in range(len(blocks)):
            blocks[i] = Checkpointed(blocks[i])
    return model


def batches(m: Model, variant: str, world: int, micro: int) -> list[list[dict]]:
    """Per step, ``micro`` whole batches (every rank's rows) of inputs with labels."""
    g = torch.Generator().manual_seed(1234)
    rows = world * BATCH
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(micro):
            if m.inputs == "pixels":
                step.append({"pixel_values": torch.randn(rows, 3, 16, 16, generator=g),
                             "labels": torch.randint(0, 2, (rows,), generator=g)})
                continue
            ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)  # no special tokens (RoBERTa's padding is 1)
            b = {"input_ids": ids, "labels": ids.clone()}
            if variant == "padding":
                # The last row of each rank's slice is padded by 3 tokens: every rank holds as
                # many labelled tokens, so the mean over ranks is the whole batch's mean.
                mask = torch.ones(rows, SEQ, dtype=torch.long)
                mask[BATCH - 1 :: BATCH, SEQ - 3 :] = 0
                b["attention_mask"] = mask
                b["labels"][mask == 0] = -100
            step.append(b)
        out.append(step)
    return out


#: Parameters whose exact gradient is zero (a key projection's bias: softmax ignores a shift
#: shared by all keys) move by rounding noise alone; their error is taken relative to this
#: magnitude at least (the weights are initialised with a standard deviation of 0.02).
ERR_FLOOR = 1e-2


def param_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(ERR_FLOOR))


def _mine(batch: dict, rank: int) -> dict:
    return {k: v[rank * BATCH : (rank + 1) * BATCH] for k, v in batch.items()}


def _autocast(variant: str):
    import contextlib

    return torch.autocast("cpu", dtype=torch.bfloat16) if variant == "autocast" else contextlib.nullcontext()


def train_one(name: str, variant: str, inner: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = BY_NAME[name]
    micro = 2 if variant == "accumulate" else 1
    ref = build(m, variant)
    model = copy.deepcopy(ref)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    sharded = zerosched.shard(model)
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=zerosched.backend(inner=inner, debug=True))
    out: dict = {"loss": [], "ref_loss": [], "gathered_between": [], "bytes_between": [], "model_grads": []}
    t0 = time.perf_counter()
    try:
        for step in batches(m, variant, world, micro):
            total = 0.0
            for b in step:
                with _autocast(variant):
                    loss = compiled(**_mine(b, rank)).loss / micro
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            out["loss"].append(mean_over_ranks(total))
            total = 0.0
            for b in step:
                with _autocast(variant):
                    loss = ref(**b).loss / micro
                loss.backward()
                total += loss.item()
            opt_ref.step()
            opt_ref.zero_grad()
            out["ref_loss"].append(total)
            out["gathered_between"].append(sharded.gathered())
            out["bytes_between"].append(runtime.RUNTIME.gathered_bytes)
            out["model_grads"].append(
                [e.name for e in sharded.entries if not e.persistent and e.param.grad is not None])
        full = sharded.full_parameters()
        ref_params = dict(ref.named_parameters())
        out["param_err"] = {e.name: param_err(full[e.name], ref_params[e.name].detach()) for e in sharded.entries}
        out["moved"] = max(float((ref_params[e.name].detach() - initial[e.name]).abs().max()) for e in sharded.entries)
        out["finite"] = all(math.isfinite(x) for x in out["loss"])
    finally:
        sharded.close()
        torch._dynamo.reset()
    out["seconds"] = time.perf_counter() - t0
    return out


def train_zoo(rows: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], dict]:
    """Every (model, variant, inner) row in this pair of rank processes; a row that raises
    returns ``{"error": traceback}``."""
    import transformers

    transformers.logging.set_verbosity_error()  # a warning logged in a compiled frame is a graph break
    results = {}
    for row in rows:
        try:
            results[row] = train_one(*row)
        except Exception:
            results[row] = {"error": traceback.format_exc()}
        # A rank that failed must not leave the other waiting in a collective of the next row.
        dist.barrier()
    return results
