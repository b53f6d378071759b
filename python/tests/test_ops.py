"""The zerosched ops' schemas: aliasing and writes exactly as docs/format.md's inserted ops, and
side effects that keep them through dead-code elimination."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch._library.utils import is_impure

from zerosched import export, ops

# (op, positional args in a graph) -> (aliases, mutates) as the exporter reads them from the schema
EXPECTED = {
    "allgather": (1, [], []),
    "allgather_bucket": (1, [], []),
    "wait": (1, [0], []),
    "release": (1, [], [0]),
    "reduce_grad": (2, [], []),
    "end_backward": (1, [0], []),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_schema_alias_annotations(name):
    n_args, aliases, mutates = EXPECTED[name]
    op = getattr(ops, name)
    assert export.schema_aliases_mutates(op, n_args) == (aliases, mutates)
    assert is_impure(op), f"{name} must be kept by dead-code elimination and kept in order"


def test_fake_kernels_give_shapes_without_a_runtime():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        shard = torch.empty(6, 4)
        full = ops.allgather(shard, dtype=torch.bfloat16)
        assert full.shape == (6, 4) and full.dtype == torch.bfloat16
        assert ops.wait(full).untyped_storage()._cdata == full.untyped_storage()._cdata
        a, b = ops.allgather_bucket([shard, torch.empty(3)])
        assert (a.shape, b.shape) == ((6, 4), (3,))
        assert ops.reduce_grad(full, shard, sharded=True, world_size=5).shape == (5,)  # ceil(24 / 5)
        assert ops.reduce_grad(full, shard, sharded=False, world_size=5).shape == (6, 4)


def test_dead_code_elimination_keeps_releases_and_end_backward():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    full = g.call_function(ops.allgather, (x,))
    w = g.call_function(ops.wait, (full,))
    use = g.call_function(torch.ops.aten.mul.Tensor, (w, 2))
    g.call_function(ops.release, (w,), {"after": [use]})
    red = g.call_function(ops.reduce_grad, (use, x), {"sharded": True, "world_size": 2})
    end = g.call_function(ops.end_backward, ([red],))
    g.call_function(operator.getitem, (end, 0))
    g.output(None)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [ops.allgather, ops.wait, torch.ops.aten.mul.Tensor, ops.release, ops.reduce_grad,
                       ops.end_backward]
