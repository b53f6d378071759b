"""Any transformers architecture, from a config file or by name, as the exporter's model.

``python -m zerosched.export --config config.json`` or ``--arch NAME [--set key=value ...]``
(docs/export.md).  The model is the architecture's own class with random, seeded weights (or
on the meta device), every dropout 0, and one training step with the head's own loss: the
token ids as labels for language-model heads (causal, masked, sequence-to-sequence), random
class labels for classification heads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import torch

from .export import ExportError

#: Heads tried, in order, for an architecture named by its model type (``bert``): the first
#: whose mapping knows the type.  A class name (``BertForMaskedLM``) or the ``architectures``
#: entry of a config file picks the head itself.
HEADS = (
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
)
#: Heads whose loss takes class labels rather than token ids.
CLASSIFICATION = ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")


@dataclasses.dataclass
class ArchSpec:
    """``config``: a transformers config file; or ``arch``: a model type or a model class name."""

    config: str | None = None
    arch: str | None = None
    sets: tuple[tuple[str, Any], ...] = ()  # config overrides, dotted keys into sub-configs
    seq: int = 16
    batch: int = 2
    dtype: str = "float32"
    attn: str | None = None  # None: the architecture's default
    fake: bool = False
    seed: int = 0


def _tiny(arch: str, **sets: Any) -> ArchSpec:
    return ArchSpec(arch=arch, sets=tuple(sorted(sets.items())))


#: The model-family fixtures (tests/fixtures/families, ``--fixtures``), each exported with the
#: ``core`` and the ``none`` decompositions: tiny shapes of the architectures' own classes.
FAMILY_FIXTURES = {
    # an encoder: BertForMaskedLM (its decoder tied to the word embedding)
    "bert": _tiny("bert", num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                  vocab_size=128, max_position_embeddings=32),
    # an encoder-decoder with tied embeddings: T5ForConditionalGeneration
    "t5": _tiny("t5", num_layers=1, d_model=32, num_heads=2, d_kv=16, d_ff=64, vocab_size=128),
    # parallel residual with a fused QKV projection: GPTNeoXForCausalLM
    "gpt_neox": _tiny("gpt_neox", num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                      vocab_size=128, max_position_embeddings=32),
    # GeLU-tanh MLP with tied embeddings: GemmaForCausalLM
    "gemma": _tiny("gemma", num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16, intermediate_size=64, vocab_size=128, max_position_embeddings=32),
    # mixture of experts with transformers' eager routing (a loop over the experts hit, which
    # breaks the graph): OlmoeForCausalLM
    "olmoe": _tiny("olmoe", num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=32, num_experts=4, num_experts_per_tok=2, vocab_size=128,
                   max_position_embeddings=32, experts_implementation="eager"),
    # a small ViT: ViTForImageClassification on 16x16 images, 8x8 patches
    "vit": _tiny("vit", num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                 image_size=16, patch_size=8),
}
FAMILY_DECOMPOSITIONS = ("core", "none")


def parse_set(item: str) -> tuple[str, Any]:
    """``key=value`` with a JSON value (``4``, ``true``, ``[1,2]``), or a plain string."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ExportError(f"--set {item!r}: expected key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _auto():
    import transformers.models.auto.modeling_auto as auto

    return auto


def _config_and_class(spec: ArchSpec):
    import transformers as tf

    if (spec.config is None) == (spec.arch is None):
        raise ExportError("give one of --config FILE and --arch NAME")
    auto = _auto()
    cls_name = None
    if spec.config is not None:
        try:
            with open(spec.config) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ExportError(f"--config {spec.config}: {e}") from e
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise ExportError(f"--config {spec.config}: not a transformers config (no `model_type`)")
        model_type = raw["model_type"]
        if model_type not in tf.CONFIG_MAPPING:
            raise ExportError(f"--config {spec.config}: unknown model_type {model_type!r}")
        cfg = tf.CONFIG_MAPPING[model_type].from_dict(raw)
        archs = raw.get("architectures") or []
        cls_name = archs[0] if archs else None
    elif spec.arch in tf.CONFIG_MAPPING:
        cfg = tf.CONFIG_MAPPING[spec.arch]()
    else:
        cls = getattr(tf, spec.arch, None)
        if not (isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel)):
            raise ExportError(f"--arch {spec.arch!r}: neither a transformers model type (bert, t5, ...) nor a "
                              "model class (BertForMaskedLM, ...)")
        cfg, cls_name = cls.config_class(), spec.arch
    if cls_name is None:
        for head in HEADS:
            cls_name = getattr(auto, head).get(cfg.model_type)
            if cls_name:
                break
        else:
            raise ExportError(f"model type {cfg.model_type!r} has no head with a training loss "
                              "(name the class with --arch)")
    cls = getattr(tf, cls_name, None)
    if cls is None:
        raise ExportError(f"transformers has no model class {cls_name!r}")
    return cfg, cls


def _apply_sets(cfg, sets) -> None:
    for key, value in sets:
        obj, parts = cfg, key.split(".")
        for part in parts[:-1]:
            obj = getattr(obj, part, None)
            if obj is None:
                raise ExportError(f"--set {key}: the config has no sub-config {part!r}")
        field = parts[-1]
        if not hasattr(obj, field) and hasattr(obj, f"_{field}"):
            field = f"_{field}"  # attn_implementation, experts_implementation: kept as properties
        if not hasattr(obj, field):
            raise ExportError(f"--set {key}: {type(obj).__name__} has no field {parts[-1]!r}")
        setattr(obj, field, value)


def _no_dropout(cfg) -> None:
    """Every dropout rate of the config to 0: no RNG ops in the graphs (as the built-in models)."""
    for c in [cfg] + [v for v in vars(cfg).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]:
        for k, v in list(vars(c).items()):
            if ("dropout" in k or "pdrop" in k or k == "drop_path_rate") and isinstance(v, float):
                setattr(c, k, 0.0)


def _head(cls) -> str | None:
    auto = _auto()
    for head in HEADS:
        if cls.__name__ in getattr(auto, head).values():
            return head
    return None


def build(spec: ArchSpec) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], Any], str]:
    """The model (train mode, dropout 0), one training step, and the files' default prefix."""
    from .models import FLASH, _grouped_mm_everywhere, _register_flash

    cfg, cls = _config_and_class(spec)
    _apply_sets(cfg, spec.sets)
    _no_dropout(cfg)
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    if getattr(cfg, "is_encoder_decoder", False) and getattr(cfg, "decoder_start_token_id", None) is None:
        # T5's convention, which its default config leaves unset: the decoder starts at padding.
        cfg.decoder_start_token_id = cfg.pad_token_id
    if spec.attn is not None:
        if spec.attn == "flash":
            _register_flash()
        cfg._attn_implementation = FLASH if spec.attn == "flash" else spec.attn
    torch.manual_seed(spec.seed)
    try:
        if spec.fake:
            with torch.device("meta"):
                model = cls(cfg)
        else:
            model = cls(cfg)
    except (ValueError, TypeError, AttributeError) as e:
        raise ExportError(f"{cls.__name__}: cannot build the model from this config: {e}") from e
    model = model.to(getattr(torch, spec.dtype)).train()
    for m in model.modules():  # dropouts built from rates the config does not name
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    inputs = _inputs(spec, cfg, model, _head(cls) in CLASSIFICATION)

    def step(m: torch.nn.Module) -> None:
        with _grouped_mm_everywhere():
            out = m(**inputs)
            if getattr(out, "loss", None) is None:
                raise ExportError(f"{cls.__name__} returned no loss for labels {sorted(inputs)}")
            out.loss.backward()

    return model, step, cfg.model_type.replace("-", "_")


def _inputs(spec: ArchSpec, cfg, model: torch.nn.Module, classify: bool) -> dict:
    device = "meta" if spec.fake else "cpu"
    g = torch.Generator().manual_seed(spec.seed)

    def ints(high: int, shape) -> torch.Tensor:
        if spec.fake:
            return torch.zeros(shape, dtype=torch.long, device=device)
        return torch.randint(0, high, shape, generator=g)

    name = getattr(model, "main_input_name", "input_ids")
    if name == "pixel_values":
        size = cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0]
        shape = (spec.batch, cfg.num_channels, size, size)
        x = (torch.empty(shape, device=device) if spec.fake else torch.randn(shape, generator=g))
        inputs: dict[str, Any] = {name: x.to(getattr(torch, spec.dtype))}
    elif name == "input_ids":
        vocab = getattr(cfg, "vocab_size", None)
        if not isinstance(vocab, int):
            raise ExportError(f"{type(model).__name__}: the config names no vocab_size for the token ids")
        inputs = {name: ints(vocab, (spec.batch, spec.seq))}
    else:
        raise ExportError(f"{type(model).__name__} takes {name!r}: the exporter makes token ids or pixel values; "
                          "use --module with a factory that makes the batch")
    inputs["labels"] = ints(cfg.num_labels, (spec.batch,)) if classify else inputs[name]
    return inputs
