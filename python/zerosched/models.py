"""Models the exporter builds from transformers configs (random, seeded weights; no downloads)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

MODELS = ("llama", "qwen2-moe", "gpt2", "mixtral")

#: Small defaults shared by every model (the fixture shape).
SMALL = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, experts=4, top_k=2,
             seq=16, batch=2, dtype="float32")


@dataclasses.dataclass
class ModelSpec:
    model: str
    layers: int = SMALL["layers"]
    hidden: int = SMALL["hidden"]
    heads: int = SMALL["heads"]
    kv_heads: int = SMALL["kv_heads"]
    intermediate: int = SMALL["intermediate"]
    vocab: int = SMALL["vocab"]
    experts: int = SMALL["experts"]
    top_k: int = SMALL["top_k"]
    seq: int = SMALL["seq"]
    batch: int = SMALL["batch"]
    dtype: str = SMALL["dtype"]
    attn: str | None = None  # sdpa | eager | flash; None: sdpa, or flash with fake
    experts_impl: str = "grouped_mm"
    fake: bool = False
    seed: int = 0

    def attn_impl(self) -> str:
        return self.attn or ("flash" if self.fake else "sdpa")


# --------------------------------------------------------------------------------------------
# "flash": a causal attention that is one fused aten op in fw and bw (as on a GPU)
# --------------------------------------------------------------------------------------------

FLASH = "zerosched_fused_sdpa"  # must not contain "flash": transformers treats those as hub kernels


def _flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``aten._scaled_dot_product_flash_attention`` (causal, no padding mask).

    On the meta device ``F.scaled_dot_product_attention`` picks the math backend and the graph
    gets [B, H, S, S] score tensors; a GPU run would use the fused kernel.  Calling the fused
    op directly keeps the exported graph's shapes and memory what they are on a GPU.  It has
    a meta kernel and a backward formula, but no CPU kernel: use it with ``--fake``.
    """
    from transformers.integrations.sdpa_attention import repeat_kv

    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, True, False, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def _register_flash() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(FLASH, _flash_attention_forward)


@contextlib.contextmanager
def _grouped_mm_everywhere():
    """Let transformers' grouped_mm experts use ``torch._grouped_mm`` for every dtype.

    transformers 5.20.2 falls back to its custom op ``transformers::grouped_mm_fallback``
    whenever dynamo traces a non-bfloat16 model (an inductor limitation).  That op's autograd
    formula loops over ``offs.tolist()``, which AOTAutograd cannot trace (data-dependent), so
    a float32 MoE training graph breaks and loses its experts.  We never run inductor: the
    exported graphs only need ``aten._grouped_mm``, which has CPU (fp32/bf16) and meta
    kernels and a backward formula in torch 2.11.
    """
    try:
        from transformers.integrations import moe
    except ImportError:  # pragma: no cover
        yield
        return
    saved = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *a, **k: True
    try:
        yield
    finally:
        moe._can_use_grouped_mm = saved


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


def make_config(spec: ModelSpec):
    return _make_config(spec)


def _make_config(spec: ModelSpec):
    import transformers as tf

    attn = spec.attn_impl()
    if attn == "flash":
        _register_flash()
        attn = FLASH
    common = dict(vocab_size=spec.vocab, use_cache=False, attn_implementation=attn, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=None)
    max_pos = max(spec.seq, 64)
    if spec.model == "llama":
        return tf.LlamaConfig(
            num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
            max_position_embeddings=max_pos, attention_dropout=0.0, **common)
    if spec.model == "mixtral":
        return tf.MixtralConfig(
            num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
            num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, max_position_embeddings=max_pos,
            output_router_logits=False, attention_dropout=0.0, experts_implementation=spec.experts_impl,
            **common)
    if spec.model == "qwen2-moe":
        return tf.Qwen2MoeConfig(
            num_hidden_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
            moe_intermediate_size=spec.intermediate, shared_expert_intermediate_size=spec.intermediate,
            num_experts=spec.experts, num_experts_per_tok=spec.top_k, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=max_pos, output_router_logits=False, attention_dropout=0.0,
            experts_implementation=spec.experts_impl, **common)
    if spec.model == "gpt2":
        common["tie_word_embeddings"] = True
        return tf.GPT2Config(
            n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, n_inner=spec.intermediate,
            n_positions=max_pos, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    raise ValueError(f"unknown model {spec.model!r}; expected one of {MODELS}")


def model_class(name: str):
    import transformers as tf

    return {"llama": tf.LlamaForCausalLM, "mixtral": tf.MixtralForCausalLM, "qwen2-moe": tf.Qwen2MoeForCausalLM,
            "gpt2": tf.GPT2LMHeadModel}[name]


def build(spec: ModelSpec) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], Any]]:
    """The model (train mode, dropout 0) and one training step: causal-LM loss from the
    model's own ``labels`` path (labels = input_ids, shifted inside the model), then backward."""
    dtype = getattr(torch, spec.dtype)
    cfg = make_config(spec)
    cls = model_class(spec.model)
    torch.manual_seed(spec.seed)
    if spec.fake:
        with torch.device("meta"):
            model = cls(cfg)
    else:
        model = cls(cfg)
    model = model.to(dtype).train()
    # GPT2LMHeadModel's name maps to no loss type; the fallback logs a warning, and a logging
    # call inside the compiled frame is a graph break.  Same loss (ForCausalLMLoss), no break.
    model.loss_type = "ForCausalLM"
    if spec.model == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2 embedding must be tied to lm_head"
    device = "meta" if spec.fake else "cpu"
    if spec.fake:
        ids = torch.zeros((spec.batch, spec.seq), dtype=torch.long, device=device)
    else:
        g = torch.Generator().manual_seed(spec.seed)
        ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=g)

    def step(m: torch.nn.Module) -> None:
        with _grouped_mm_everywhere():
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()

    return model, step


# --------------------------------------------------------------------------------------------
# fixture and benchmark sets
# --------------------------------------------------------------------------------------------


def file_prefix(model: str) -> str:
    return model.replace("-", "_")


def fixture_specs() -> list[tuple[ModelSpec, str]]:
    """The checked-in fixtures (tests/fixtures): the small shape of :data:`SMALL`.

    The MoE fixture is bfloat16 because ``aten._grouped_mm`` (the experts) has bfloat16-only
    fake/meta kernels; ``qwen2_moe_batched`` is the float32 variant through transformers'
    ``batched_mm`` experts (index + bmm).
    """
    return [
        (ModelSpec(model="llama"), "llama"),
        (ModelSpec(model="qwen2-moe", dtype="bfloat16"), "qwen2_moe"),
        (ModelSpec(model="qwen2-moe", experts_impl="batched_mm"), "qwen2_moe_batched"),
        (ModelSpec(model="gpt2"), "gpt2"),
    ]


LLAMA70B = dict(model="llama", hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256, seq=4096,
                batch=1, dtype="bfloat16", fake=True)
MIXTRAL8X7B = dict(model="mixtral", hidden=4096, intermediate=14336, heads=32, kv_heads=8, experts=8, top_k=2,
                   vocab=32000, seq=4096, batch=1, dtype="bfloat16", fake=True)


def bench_specs() -> list[tuple[ModelSpec, str]]:
    return [
        (ModelSpec(layers=8, **LLAMA70B), "llama70b_l8"),
        (ModelSpec(layers=80, **LLAMA70B), "llama70b_l80"),
        (ModelSpec(layers=2, **MIXTRAL8X7B), "mixtral8x7b_l2"),
        (ModelSpec(layers=24, **MIXTRAL8X7B), "mixtral8x7b_l24"),
    ]


def fixture_specs_by_prefix() -> list[tuple[str, ModelSpec]]:
    return [(prefix, spec) for spec, prefix in fixture_specs()]
