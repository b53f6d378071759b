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

import torch
from torch._higher_order_ops.effects import EffectType

from zerosched import runtime

_lib = torch.library.Library("zerosched", "DEF")

SCHEMAS = {
    "allgather": "allgather(Tensor shard, *, str param, ScalarType? dtype=None) -> Tensor",
    "allgather_bucket": "allgather_bucket(Tensor[] shards, *, str[] params, ScalarType? dtype=None) -> Tensor[]",
    "wait": "wait(Tensor(a) gathered, *, str param) -> Tensor(a)",
    "release": "release(Tensor(a!) value, *, str param, Tensor[] after) -> ()",
    "reduce_grad": "reduce_grad(Tensor grad, *, str param, bool sharded) -> Tensor",
    "end_backward": "end_backward(Tensor(a)[] reduced) -> Tensor(a)[]",
}


def _define(name: str, eager, fake) -> None:
    _lib.define(SCHEMAS[name])
    _lib.impl(name, eager, "CompositeExplicitAutograd")
    torch.library.register_fake(f"zerosched::{name}", fake, lib=_lib)
    _lib._register_effectful_op(f"zerosched::{name}", EffectType.ORDERED)


# The placeholder a gather reads is the model's parameter: full shape, storage freed.  The
# eager kernels reach the shard through the runtime by name.


def _allgather(shard: torch.Tensor, *, param: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    return runtime.gather([param], dtype)[0]


def _allgather_fake(shard, *, param, dtype=None):
    return torch.empty_like(shard, dtype=dtype or shard.dtype, memory_format=torch.contiguous_format)


def _allgather_bucket(shards: list[torch.Tensor], *, params: list[str], dtype: torch.dtype | None = None):
    if len(shards) != len(params):
        raise runtime.ZeroschedError(f"allgather_bucket: {len(shards)} shards for {len(params)} parameters")
    return runtime.gather(list(params), dtype)


def _allgather_bucket_fake(shards, *, params, dtype=None):
    return [_allgather_fake(s, param=p, dtype=dtype) for s, p in zip(shards, params)]


def _wait(gathered: torch.Tensor, *, param: str) -> torch.Tensor:
    runtime.wait(param)
    return gathered.detach()  # shares the storage; not an autograd view of a list element


def _wait_fake(gathered, *, param):
    return gathered.view(gathered.shape)


def _release(value: torch.Tensor, *, param: str, after: list[torch.Tensor]) -> None:
    runtime.release(param, value)


def _release_fake(value, *, param, after):
    return None


def _reduce_grad(grad: torch.Tensor, *, param: str, sharded: bool) -> torch.Tensor:
    return runtime.reduce_grad(param, grad)


def _reduce_grad_fake(grad, *, param, sharded):
    e = runtime.RUNTIME.entry(param)
    return torch.empty_like(grad) if e.persistent else grad.new_empty(e.chunk)


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
