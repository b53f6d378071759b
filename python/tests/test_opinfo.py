"""Differential tests of the CPU executor against PyTorch eager, on PyTorch's own per-op
sample inputs (OpInfo `op_db`) for every claimed op OpInfo has an entry for: each sample is
traced to an aten graph (make_fx, no decompositions; its tensor constants become placeholders
given their values), written as a one-graph fx-graph v1 document by the exporter's
serialisation, run through `zerosched.run`, and compared with eager with
`torch.testing.assert_close`'s per-dtype tolerances.

At most `CAP` samples per op and dtype, to keep the run in seconds; tolerances are the op's
declared `toleranceOverride`s where it has them, else assert_close's per-dtype defaults. A
sample whose graph holds an op the executor does not claim is refused by name, one of a dtype a
kernel does not compute (integer convolution) or an argument form it refuses (boolean-mask
indices) is refused naming it, and one the exporter cannot write is skipped; these are counted,
not compared. The backward ops, which OpInfo has no entries for, are traced through autograd
of their forward in float64 and compared the same way (`test_backward_op_matches_eager`).
Every sample that runs must match; the documented deviations are the order of equal keys in
`sort` / `topk` indices (checked to select the same keys), bf16 results where torch's kernel
rounds an intermediate to bf16 (checked equal to eager on f32 inputs rounded once, the
executor's rule), the random ops (the executor's rule, checked for the values each may take)
and `empty` (uninitialized in torch; checked for shape and dtype).

`python python/tests/test_opinfo.py` prints the per-op table of docs/exec.md.
"""

import re
import sys
import types
import unittest

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import zerosched
from zerosched.export import ExportError, dumps_graph, graph_to_doc

if "expecttest" not in sys.modules:
    # torch.testing._internal imports expecttest for its TestCase base only; the pinned venv
    # does not ship it, and op_db's samples do not use it.
    try:
        import expecttest  # noqa: F401
    except ImportError:
        _stub = types.ModuleType("expecttest")
        _stub.TestCase = unittest.TestCase
        sys.modules["expecttest"] = _stub

from torch.testing._internal.common_device_type import toleranceOverride  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

CAP = 4
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]

# OpInfo names (with their variant, as `name.variant`) whose aten ops the executor claims: every
# op of the CPU backend's table that OpInfo has an entry for.
OPS = [
    # elementwise arithmetic, comparisons, math, casts
    "add", "sub", "mul", "div.no_rounding_mode", "div.trunc_rounding", "div.floor_rounding",
    "eq", "ne", "le", "lt", "ge", "gt", "bitwise_and", "bitwise_or", "where", "neg", "exp", "cos",
    "sin", "rsqrt", "sqrt", "sigmoid", "tanh", "reciprocal", "log", "pow", "erf", "abs", "minimum",
    "maximum", "clamp", "clamp_min", "clamp_max", "logical_not", "logical_and", "logical_or",
    "logical_xor", "to", "clone", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cosh",
    "sinh", "tan", "expm1", "log1p", "log10", "log2", "ceil", "floor", "round", "trunc", "sign",
    "isnan", "isinf", "atan2", "fmod", "remainder", "bitwise_not", "bitwise_xor",
    # activations
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.hardswish",
    "nn.functional.softplus", "nn.functional.leaky_relu", "nn.functional.elu",
    "nn.functional.hardtanh",
    # views and shapes
    "view", "reshape", "unsqueeze", "squeeze", "squeeze.multiple", "permute", "t", "transpose",
    "expand", "narrow", "flip", "repeat", "diagonal", "roll", "cat", "stack", "unbind", "split", "split_with_sizes", "nn.functional.pad.constant",
    "select", "select_scatter", "slice_scatter", "tril", "triu",
    # reductions and sorting
    "sum", "mean", "any", "cumsum", "cumprod", "argmax", "argmin", "softmax", "log_softmax",
    "topk", "sort", "histc", "amax", "amin", "max.binary", "max.reduction_no_dim",
    "max.reduction_with_dim", "min.binary", "min.reduction_no_dim", "min.reduction_with_dim",
    "prod", "var", "var.unbiased", "std", "std.unbiased", "linalg.vector_norm",
    # linear algebra, indexing, scatter
    "mm", "bmm", "addmm", "baddbmm", "nn.functional.embedding", "__getitem__", "index_put", "index_select",
    "gather", "index_add", "scatter", "scatter_add", "scatter_reduce.sum", "scatter_reduce.prod",
    "scatter_reduce.mean", "scatter_reduce.amax", "scatter_reduce.amin", "masked_fill",
    # factories
    "zeros_like", "ones_like", "new_zeros", "new_ones", "new_full", "full_like", "fill",
    "arange", "zeros", "ones", "empty", "empty_strided", "scalar_tensor",
    # fused nn ops and losses
    "nn.functional.layer_norm", "nn.functional.batch_norm", "nn.functional.group_norm",
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d", "nn.functional.adaptive_avg_pool2d",
    "nn.functional.scaled_dot_product_attention", "nn.functional.nll_loss",
    "nn.functional.mse_loss", "nn.functional.smooth_l1_loss",
    "nn.functional.binary_cross_entropy_with_logits",
    # random ops: the executor's rule, not torch's stream (docs/exec.md)
    "nn.functional.dropout", "bernoulli", "rand_like", "randn_like", "randint_like",
]

# Ops whose values come from torch's generator: checked for shape, dtype and the values each
# can take, not against eager's draws.
RANDOM = {"nn.functional.dropout", "bernoulli", "rand_like", "randn_like", "randint_like"}
# Ops whose result torch leaves uninitialized: checked for shape and dtype only.
UNINITIALIZED = {"empty", "empty_strided"}
# A typed refusal of an argument form the kernel does not compute (attention dropout,
# transposed convolution, boolean-mask indices, ...): counted, not compared.
REFUSED_ARGUMENT = re.compile(r"not supported|not implemented|only\b|\(only")

_BY_NAME = {o.name + (f".{o.variant_test_name}" if o.variant_test_name else ""): o for o in op_db}


def _case(op, sample):
    """(traced graph module, input tensors, eager outputs) of one sample."""
    args = (sample.input, *sample.args)
    leaves, spec = pytree.tree_flatten((args, sample.kwargs))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = [leaves[i] for i in slots]

    def f(*ts):  # extra arguments (lifted constants) are ignored
        ls = list(leaves)
        for i, t in zip(slots, ts):
            ls[i] = t
        a, kw = pytree.tree_unflatten(ls, spec)
        out = op.op(*a, **kw)
        return tuple(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor))

    want = f(*tensors)
    gm = make_fx(f)(*tensors)
    return gm, tensors + _lift_constants(gm), want, f


def _lift_constants(gm):
    """The trace's tensor constants (an index list a sample spells as a literal) made into
    placeholders after the others, and their values: the executor draws every input a run does
    not give, and a constant is not an input one can give."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = phs[-1] if phs else None
    values = []
    for n in list(gm.graph.nodes):
        if n.op != "get_attr" or not isinstance(getattr(gm, n.target), torch.Tensor):
            continue
        at = gm.graph.inserting_after(anchor) if anchor is not None else gm.graph.inserting_before(next(iter(gm.graph.nodes)))
        with at:
            ph = gm.graph.placeholder(f"{n.name}_value")
        ph.meta = dict(n.meta)
        n.replace_all_uses_with(ph)
        gm.graph.erase_node(n)
        values.append(getattr(gm, n.target))
        anchor = ph
    gm.recompile()
    return values


def _in_f32(f, tensors, dtype):
    """Eager outputs computed on float32 copies of the bf16 inputs, rounded once to bf16."""
    up = [t.float() if t.dtype == dtype else t for t in tensors]
    return tuple(o.to(dtype) if o.is_floating_point() else o for o in f(*up))


def _tolerance(op, dtype):
    """The loosest tolerance the op's OpInfo declares for `dtype` (its `toleranceOverride`
    decorators), else None for assert_close's per-dtype defaults."""
    found = []
    for info in op.decorators:
        for dec in getattr(info, "decorators", [info]):
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                found.append(dec.d[dtype])
    if not found:
        return None
    return max(t.atol for t in found), max(t.rtol for t in found)


def _dim(op, sample):
    """The dimension `sort` / `topk` order along."""
    at = 0 if op.name == "sort" else 1
    d = sample.args[at] if len(sample.args) > at else sample.kwargs.get("dim", -1)
    return d if isinstance(d, int) else -1


def _same_keys(op, sample, got, want):
    """Indices of `sort` / `topk` may order equal keys otherwise (the executor sorts stably,
    torch's CPU sort does not): they must select the same keys."""
    x, d = sample.input, _dim(op, sample)
    if x.dim() == 0:
        assert got.tolist() == want.tolist()
        return
    torch.testing.assert_close(torch.take_along_dim(x, got, d), torch.take_along_dim(x, want, d),
                               equal_nan=True)


def _random_values(name, sample, g, w, targets):
    """What the executor's draws must satisfy, where eager's draws are not the reference."""
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    v = g.double()
    if name == "rand_like" and "aten.randn_like.default" in targets:
        name = "randn_like"  # OpInfo's `rand_like` entry calls randn_like
    if name == "bernoulli":
        assert set(v.unique().tolist()) <= {0.0, 1.0}
    elif name == "rand_like":
        assert bool(((v >= 0) & (v < 1)).all())
    elif name == "randn_like":
        assert bool(v.isfinite().all())
    elif name == "randint_like":
        ints = [a for a in sample.args if isinstance(a, int)]
        lo, hi = (0, ints[0]) if len(ints) == 1 else (ints[0], ints[1])
        assert bool(((v >= lo) & (v < hi)).all()), (lo, hi, v)
    elif name == "nn.functional.dropout":
        x = sample.input.double()
        p = sample.kwargs.get("p", sample.args[0] if sample.args else 0.5)
        if not sample.kwargs.get("training", True) or p == 0:
            torch.testing.assert_close(g, w)
        elif p == 1:
            assert not bool(v.any())
        else:
            kept = torch.isclose(v, x / (1 - p), rtol=1e-2, atol=1e-6, equal_nan=True)
            assert bool((kept | (v == 0)).all())


def _check(op, sample):
    """'pass', 'tie order' (sort/topk indices differing only among equal keys), 'bf16 rounded
    once' (equal to eager computed in f32 and rounded, where torch's bf16 kernel is not),
    'random' (a random op's draws checked for what they may be), 'uninitialized' (shape and
    dtype), 'refused', 'refused dtype', 'refused argument', 'skipped', or raises on a
    mismatch."""
    try:
        gm, tensors, want, f = _case(op, sample)
        doc = graph_to_doc(gm, kind="inference")
    except (ExportError, RuntimeError, TypeError, ValueError):
        return "skipped"
    if not want:
        return "skipped"
    names = [n["name"] for n in doc["nodes"] if n["op"] == "placeholder"]
    try:
        got = zerosched.run(dumps_graph(doc).encode(), dict(zip(names, tensors)))[0][0]
    except zerosched.ZeroschedError as e:
        if "does not implement" in str(e):
            return "refused"
        if re.search(r"of a (I64|Bool) tensor", str(e)):
            return "refused dtype"
        if REFUSED_ARGUMENT.search(str(e)):
            return "refused argument"
        raise
    assert len(got) == len(want)
    if op.name in RANDOM or op.name in UNINITIALIZED:
        for g, w in zip(got, want):
            if op.name in RANDOM:
                _random_values(op.name, sample, g, w, {str(n.target) for n in gm.graph.nodes})
            assert g.shape == w.shape and g.dtype == w.dtype
        return "random" if op.name in RANDOM else "uninitialized"
    tol = _tolerance(op, sample.input.dtype if isinstance(sample.input, torch.Tensor) else None)
    kw = {} if tol is None else {"atol": tol[0], "rtol": tol[1]}
    result = "pass"
    for k, (g, w) in enumerate(zip(got, want)):
        if op.name in ("sort", "topk") and k == 1 and not torch.equal(g, w):
            _same_keys(op, sample, g, w)
            result = "tie order"
            continue
        try:
            torch.testing.assert_close(g, w, equal_nan=True, **kw)
        except AssertionError:
            if g.dtype != torch.bfloat16:
                raise
            # torch's bf16 kernel rounded an intermediate (log_softmax: max + log(sum)); the
            # executor computes in f32 and rounds once, which this reference does too.
            w32 = _in_f32(f, tensors, torch.bfloat16)[k]
            torch.testing.assert_close(g, w32, equal_nan=True, msg=lambda m: f"{op.name} {sample}: {m}")
            result = "bf16 rounded once"
    return result


def _samples(op, dtype):
    if dtype not in op.supported_dtypes("cpu"):
        return []
    out = []
    for s in op.sample_inputs("cpu", dtype, requires_grad=False):
        out.append(s)
        if len(out) == CAP:
            break
    return out


def results(name):
    op = _BY_NAME[name]
    counts = {}
    for dtype in DTYPES:
        for s in _samples(op, dtype):
            r = _check(op, s)
            counts[r] = counts.get(r, 0) + 1
    return counts


@pytest.mark.parametrize("name", OPS)
def test_op_matches_eager(name):
    counts = results(name)
    ran = sum(counts.get(k, 0) for k in RAN)
    assert ran > 0, f"{name}: no sample ran ({counts})"


def test_unclaimed_op_is_refused_by_name():
    gm = make_fx(lambda x: (torch.ops.aten.digamma.default(x),))(torch.rand(3) + 1)
    doc = graph_to_doc(gm, kind="inference")
    with pytest.raises(zerosched.ZeroschedError, match=r"aten\.digamma\.default.*digamma"):
        zerosched.run(dumps_graph(doc).encode(), {})


# The outcomes that ran and were checked, then those counted only; the table's columns.
RAN = ("pass", "tie order", "bf16 rounded once", "random", "uninitialized")
COLUMNS = {
    "pass": "passed", "tie order": "ties ordered otherwise", "bf16 rounded once": "bf16 rounded once",
    "random": "random: checked", "uninitialized": "uninitialized: shape", "refused": "refused: op",
    "refused dtype": "refused: dtype", "refused argument": "refused: argument", "skipped": "not exportable",
}

if __name__ == "__main__":
    print("| OpInfo op | samples tried | " + " | ".join(COLUMNS.values()) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for name in OPS:
        c = results(name)
        print(f"| `{name}` | {sum(c.values())} | " + " | ".join(str(c.get(k, 0)) for k in COLUMNS) + " |")


def _grad_case(fn, *shapes):
    """fn's input gradients, traced through autograd to the backward ops AOTAutograd leaves."""
    torch.manual_seed(0)
    xs = [torch.randn(*s, dtype=torch.float64) for s in shapes]

    def f(*ts):
        ts = [t.detach().requires_grad_(True) for t in ts]
        out = fn(*ts)
        g = torch.ones_like(out)
        return tuple(torch.autograd.grad(out, ts, g))

    return f, xs, make_fx(f)(*xs)


# The backward ops OpInfo has no entries for, each through autograd of its forward (float64).
BACKWARD = {
    "gelu_backward": lambda x: torch.nn.functional.gelu(x),
    "gelu_backward tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu_backward": torch.nn.functional.silu,
    "threshold_backward": lambda x: torch.relu(x) * x,
    "_softmax_backward_data": lambda x: torch.softmax(x, -1) * x,
    "_log_softmax_backward_data": lambda x: torch.log_softmax(x, 0) * x,
    "native_layer_norm_backward": lambda x, w, b: torch.nn.functional.layer_norm(x, (5,), w, b) * x,
    "select_backward": lambda x: x.select(1, 2) * 3,
    "slice_backward": lambda x: x[:, 1:4:2] * 3,
    # 4 input channels in 2 groups, stride and padding.
    "convolution_backward": lambda x, w, b: torch.nn.functional.conv2d(x, w, b, stride=2, padding=1, groups=2),
    "hardswish_backward": lambda x: F.hardswish(x * 4) * x,
    "softplus_backward": lambda x: F.softplus(x * 8, beta=2, threshold=5) * x,
    "leaky_relu_backward": lambda x: F.leaky_relu(x, 0.2) * x,
    "elu_backward": lambda x: F.elu(x, alpha=0.7) * x,
    "hardtanh_backward": lambda x: F.hardtanh(x * 2, -0.5, 1.0) * x,
    "sigmoid_backward": lambda x: torch.sigmoid(x) * x,
    "tanh_backward": lambda x: torch.tanh(x) * x,
    "mse_loss_backward": lambda x, t: F.mse_loss(x, t),
    "mse_loss_backward none": lambda x, t: F.mse_loss(x, t, reduction="none") * x,
    "smooth_l1_loss_backward": lambda x, t: F.smooth_l1_loss(x * 2, t, beta=0.5, reduction="sum"),
    "max_pool2d_with_indices_backward": lambda x: F.max_pool2d(x, 3, stride=2, padding=1) * 2,
    "max_pool2d_with_indices_backward dilated ceil": lambda x: F.max_pool2d(x, 2, stride=2, dilation=2, ceil_mode=True),
    "avg_pool2d_backward": lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False) * x[..., :4, :4],
    "avg_pool2d_backward ceil divisor": lambda x: F.avg_pool2d(x, 2, ceil_mode=True, divisor_override=3),
    "_adaptive_avg_pool2d_backward": lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
    "native_batch_norm_backward": lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True) * x,
    "native_group_norm_backward": lambda x, w, b: F.group_norm(x, 2, w, b) * x,
}
SHAPES = {
    "native_layer_norm_backward": [(3, 5), (5,), (5,)],
    "convolution_backward": [(2, 4, 7, 7), (6, 2, 3, 3), (6,)],
    "mse_loss_backward": [(4, 5), (4, 5)],
    "mse_loss_backward none": [(4, 5), (5,)],
    "smooth_l1_loss_backward": [(4, 5), (4, 5)],
    "max_pool2d_with_indices_backward": [(2, 3, 7, 7)],
    "max_pool2d_with_indices_backward dilated ceil": [(1, 2, 7, 6)],
    "avg_pool2d_backward": [(2, 3, 7, 7)],
    "avg_pool2d_backward ceil divisor": [(3, 5, 5)],
    "_adaptive_avg_pool2d_backward": [(2, 3, 7, 5)],
    "native_batch_norm_backward": [(4, 3, 2, 2), (3,), (3,)],
    "native_group_norm_backward": [(3, 4, 5), (4,), (4,)],
}


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_op_matches_eager(name):
    f, xs, gm = _grad_case(BACKWARD[name], *SHAPES.get(name, [(4, 5)]))
    op = name.split()[0]
    assert any(op in str(n.target) for n in gm.graph.nodes), gm.graph
    doc = graph_to_doc(gm, kind="inference")
    names = [n["name"] for n in doc["nodes"] if n["op"] == "placeholder"]
    got = zerosched.run(dumps_graph(doc).encode(), dict(zip(names, xs)))[0][0]
    for g, w in zip(got, f(*xs), strict=True):
        torch.testing.assert_close(g, w)


def test_nll_loss_and_embedding_backward_match_eager():
    torch.manual_seed(0)
    logits, table = torch.randn(6, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    target = torch.tensor([0, 4, -100, 2, 2, 1])
    idx = torch.tensor([[1, 6, 1], [0, 3, 1]])
    weight = torch.rand(5, dtype=torch.float64)

    def f(x, t, tab, i, weight):
        x, tab = x.detach().requires_grad_(True), tab.detach().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(x, t, weight=weight, ignore_index=-100)
        loss = loss + torch.nn.functional.embedding(i, tab, padding_idx=3).sum()
        return (loss, *torch.autograd.grad(loss, (x, tab)))

    args = [logits, target, table, idx, weight]
    gm = make_fx(f)(*args)
    targets = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.nll_loss_backward.default", "aten.embedding_dense_backward.default"} <= targets
    doc = graph_to_doc(gm, kind="inference")
    names = [n["name"] for n in doc["nodes"] if n["op"] == "placeholder"]
    got = zerosched.run(dumps_graph(doc).encode(), dict(zip(names, args)))[0][0]
    for g, w in zip(got, f(*args), strict=True):
        torch.testing.assert_close(g, w)
