"""zerosched's ZeRO-3 ops, registered with ``torch.library`` under the ``zerosched`` namespace.

They are the inserted ops of docs/format.md as PyTorch runs them.  Each has an eager
implementation (the runtime, ``zerosched.runtime``) and a fake one (shapes only), and its
schema says exactly which outputs alias which inputs and what it writes:

* ``allgather`` / ``allgather_bucket`` return new buffers (no alias); a bucket is one
  coalesced collective;
* ``wait`` returns its input (``Tensor(a) -> Tensor(a)``): the full parameter, now complete;
* ``release`` writes its input (``Tensor(a!)``: it frees the storage) and reads ``after``,
  every real use of that storage, so nothing can run it before a use;
* ``reduce_grad`` returns a new buffer (the reduced gradient slice);
* ``end_backward`` returns its inputs (``Tensor(a)[] -> Tensor(a)[]``).

All of them are registered as ordered side effects (``torch.library``'s effects): FX dead-code
elimination keeps them although ``release`` and ``end_backward`` have no used output, and
Inductor keeps them in program order relative to each other (its ``EffectfulKernel``).
"""

from __future__ import annotations

import math

import torch
from torch._higher_order_ops.effects import EffectType

from zerosched import runtime

_lib = torch.library.Library("zerosched", "DEF")

SCHEMAS = {
    "allgather": "allgather(Tensor param, *, ScalarType? dtype=None) -> Tensor",
    "allgather_bucket": "allgather_bucket(Tensor[] params, *, ScalarType? dtype=None) -> Tensor[]",
    "wait": "wait(Tensor(a) gathered) -> Tensor(a)",
    "release": "release(Tensor(a!) value, *, Tensor[] after) -> ()",
    "reduce_grad": "reduce_grad(Tensor grad, Tensor param, *, bool sharded, int world_size) -> Tensor",
    "end_backward": "end_backward(Tensor(a)[] reduced) -> Tensor(a)[]",
}


def _define(name: str, eager, fake) -> None:
    _lib.define(SCHEMAS[name])
    _lib.impl(name, eager, "CompositeExplicitAutograd")
    torch.library.register_fake(f"zerosched::{name}", fake, lib=_lib)
    _lib._register_effectful_op(f"zerosched::{name}", EffectType.ORDERED)


# No op names its parameter: a compiled graph runs for every set of parameters of its shapes
# (each decoder block's).  The runtime finds the parameter from the tensors the op receives: a
# gather's and a reduction's ``param`` is the model's parameter (full shape, storage freed),
# the graph input the parameter was passed as; a wait and a release receive the gathered buffer.


def _allgather(param: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return runtime.gather([param], dtype)[0]


def _allgather_fake(param, *, dtype=None):
    return torch.empty_like(param, dtype=dtype or param.dtype, memory_format=torch.contiguous_format)


def _allgather_bucket(params: list[torch.Tensor], *, dtype: torch.dtype | None = None):
    return runtime.gather(list(params), dtype)


def _allgather_bucket_fake(params, *, dtype=None):
    return [_allgather_fake(p, dtype=dtype) for p in params]


def _wait(gathered: torch.Tensor) -> torch.Tensor:
    runtime.wait(gathered)
    return gathered.detach()  # shares the storage; not an autograd view of a list element


def _wait_fake(gathered):
    return gathered.view(gathered.shape)


def _release(value: torch.Tensor, *, after: list[torch.Tensor]) -> None:
    runtime.release(value)


def _release_fake(value, *, after):
    return None


def _reduce_grad(grad: torch.Tensor, param: torch.Tensor, *, sharded: bool, world_size: int) -> torch.Tensor:
    return runtime.reduce_grad(param, grad)


def _reduce_grad_fake(grad, param, *, sharded, world_size):
    # The graph's arguments size the slice (fake tensors reach no runtime entry): a persistent
    # parameter's gradient is all-reduced whole, a sharded one's reduce-scattered to a chunk.
    return grad.new_empty(math.ceil(grad.numel() / world_size)) if sharded else torch.empty_like(grad)


def _end_backward(reduced: list[torch.Tensor]) -> list[torch.Tensor]:
    runtime.end_backward()
    return [r.detach() for r in reduced]


def _end_backward_fake(reduced):
    return [r.view(r.shape) for r in reduced]


_define("allgather", _allgather, _allgather_fake)
_define("allgather_bucket", _allgather_bucket, _allgather_bucket_fake)
_define("wait", _wait, _wait_fake)
_define("release", _release, _release_fake)
_define("reduce_grad", _reduce_grad, _reduce_grad_fake)
_define("end_backward", _end_backward, _end_backward_fake)

allgather = torch.ops.zerosched.allgather.default
allgather_bucket = torch.ops.zerosched.allgather_bucket.default
wait = torch.ops.zerosched.wait.default
release = torch.ops.zerosched.release.default
reduce_grad = torch.ops.zerosched.reduce_grad.default
end_backward = torch.ops.zerosched.end_backward.default
