"""A user's own module as the exporter's model: ``--module package.module:factory``.

The factory takes no arguments and returns ``(model, example_batch)`` or ``(model, step_fn)``.
A batch is passed to the model as keywords (a dict), positionally (a tuple or list) or as the
one argument (anything else); the loss is the output itself when it is a scalar tensor, or its
``loss`` (attribute or key).  ``step_fn(compiled_model)`` runs the forward and the backward
itself.  docs/export.md describes it.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from .export import ExportError


def load(ref: str) -> Callable[[], Any]:
    """``package.module:factory`` to the factory (the current directory is importable)."""
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise ExportError(f"--module {ref!r}: expected package.module:factory")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ExportError(f"--module {ref!r}: cannot import {mod_name!r}: {e}") from e
    obj: Any = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ExportError(f"--module {ref!r}: {mod_name} has no {attr!r}")
    if not callable(obj):
        raise ExportError(f"--module {ref!r}: {attr} is not callable")
    return obj


def _loss(out: Any, where: str) -> torch.Tensor:
    loss = out
    if not isinstance(out, torch.Tensor):
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.dtype.is_floating_point):
        raise ExportError(f"{where}: the model returned {type(out).__name__}, not a scalar loss or an output "
                          "with a `loss`; return (model, step_fn) to say how the step runs")
    return loss


def build(ref: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], Any], str]:
    """The factory's model, one training step, and the files' default prefix (its name)."""
    made = load(ref)()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ExportError(f"--module {ref!r}: the factory must return (model, example_batch) or (model, step_fn), "
                          f"not {type(made).__name__}")
    model, second = made
    if callable(second) and not isinstance(second, (torch.Tensor, torch.nn.Module)):
        step = second
    else:
        batch = second

        def step(m: torch.nn.Module) -> None:
            if isinstance(batch, dict):
                out = m(**batch)
            elif isinstance(batch, (tuple, list)):
                out = m(*batch)
            else:
                out = m(batch)
            _loss(out, f"--module {ref!r}").backward()

    return model, step, ref.rpartition(":")[2].replace(".", "_")
