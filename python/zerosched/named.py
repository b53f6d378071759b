"""The backend under the name ``"zerosched"``: ``torch.compile(model, backend="zerosched")``,
for tools that take a backend by name (transformers' ``TrainingArguments(torch_compile_backend=
"zerosched")``).

Its options are :func:`zerosched.backend`'s keywords, from three places, later ones winning:
the JSON object in ``$ZEROSCHED_BACKEND_OPTIONS`` (read when a graph is compiled),
:func:`configure`, and ``torch.compile(..., options={...})``, which PyTorch passes to a named
backend as they are.  docs/python.md describes them.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any, Callable

import torch

from zerosched._core import ZeroschedError

NAME = "zerosched"
ENV = "ZEROSCHED_BACKEND_OPTIONS"
KEYS = ("budget", "scheduler", "inner", "cost", "debug", "dump")

_configured: dict[str, Any] = {}
#: One backend per set of options, so that its graphs are numbered across dynamo graphs.
_backends: dict[str, Callable] = {}


def _check(options: Any, where: str) -> dict[str, Any]:
    if not isinstance(options, dict):
        raise ZeroschedError(f"{where}: the backend's options must be an object, not {type(options).__name__}")
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise ZeroschedError(f"{where}: unknown backend option(s) {unknown}; known: {list(KEYS)}")
    return dict(options)


def _from_env() -> dict[str, Any]:
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    try:
        return _check(json.loads(raw), f"${ENV}")
    except json.JSONDecodeError as e:
        raise ZeroschedError(f"${ENV}: not JSON: {e}") from None


def configure(**options: Any) -> None:
    """Default options of the named backend (``budget="2GiB", inner="inductor"``, ...), over
    ``$ZEROSCHED_BACKEND_OPTIONS``; an option given ``None`` is unset.  Checked now."""
    _check(options, "zerosched.configure")
    merged = {**_configured, **options}
    merged = {k: v for k, v in merged.items() if v is not None}
    _resolve(merged)  # refuses bad values now, not at the first compile
    _configured.clear()
    _configured.update(merged)


def current_options() -> dict[str, Any]:
    """The options a graph compiled now without ``torch.compile`` options would get."""
    return {**_from_env(), **_configured}


def _resolve(opts: dict[str, Any]) -> Callable:
    from zerosched.compiler import backend

    key = json.dumps(opts, sort_keys=True, default=repr)
    fn = _backends.get(key)
    if fn is None:
        fn = _backends[key] = backend(**opts)
    return fn


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
                  mode: str | None = None) -> Callable:
    """What dynamo calls for ``backend="zerosched"``."""
    if mode is not None:
        raise ZeroschedError(f"torch.compile(backend={NAME!r}): mode={mode!r} is Inductor's; use options={{...}}")
    opts = {**current_options(), **_check(options or {}, f"torch.compile(backend={NAME!r}, options=...)")}
    return _resolve(opts)(gm, example_inputs)


def register() -> None:
    """Registers :func:`compile_graph` with dynamo (once per process), and the name with
    accelerate where it is installed."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get(NAME) is not compile_graph:
        _COMPILER_FNS.pop(NAME, None)
        register_backend(compile_graph, name=NAME)
    if importlib.util.find_spec("accelerate") is not None:
        _register_with_accelerate()


def _register_with_accelerate() -> None:
    """transformers' ``Trainer`` compiles through accelerate, whose ``TorchDynamoPlugin`` takes
    the backend's name only if its ``DynamoBackend`` enum lists it (it then calls
    ``torch.compile(backend=name.lower())``).  The enum gets a member ``ZEROSCHED``."""
    from accelerate.utils.dataclasses import DynamoBackend

    value = NAME.upper()
    if value in DynamoBackend._value2member_map_:
        return
    member = str.__new__(DynamoBackend, value)
    member._name_, member._value_ = value, value
    DynamoBackend._member_map_[value] = member
    DynamoBackend._value2member_map_[value] = member
    DynamoBackend._member_names_.append(value)
