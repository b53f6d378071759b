"""The executor's ops that OpInfo has no samples for, against PyTorch on the CPU: the attention
ops of graphs exported on a GPU (flash, memory-efficient, cuDNN; traced with fake tensors, since
they have no CPU kernel, and compared with the math definition), the functional batch-norm
forms AOTAutograd writes, and the rule of the random ops (docs/exec.md): seeded by the node's
name, the same on every rank and in a scheduled graph."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import zerosched
from zerosched.export import dumps_graph, graph_to_doc

aten = torch.ops.aten


def _run(gm, xs, options=None):
    doc = graph_to_doc(gm, kind="inference")
    names = [n["name"] for n in doc["nodes"] if n["op"] == "placeholder"]
    return zerosched.run(dumps_graph(doc).encode(), dict(zip(names, xs)), options)


def _math_attention(q, k, v, causal, bias=None):
    """Outputs and input gradients (of `sum(out * do)`) by the math definition, in float64."""
    q, k, v = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    return out, q, k, v


GPU_FORMS = {
    # forward(q, k, v, causal, p) -> outputs; backward(do, q, k, v, fwd outputs, causal, p) -> grads
    "flash": (
        lambda q, k, v, c, p: aten._scaled_dot_product_flash_attention(q, k, v, p, c),
        lambda do, q, k, v, r, c, p: aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, r[0], r[1], r[2], r[3], r[4], r[5], p, c, r[6], r[7]),
    ),
    "efficient": (
        lambda q, k, v, c, p: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, p, c),
        lambda do, q, k, v, r, c, p: aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, r[0], r[1], r[2], r[3], p, [True, True, True, False], c)[:3],
    ),
    "cudnn": (
        lambda q, k, v, c, p: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, p, c),
        lambda do, q, k, v, r, c, p: aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, r[0], r[1], r[6], r[7], None, r[2], r[3], r[4], r[5], p, c),
    ),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", sorted(GPU_FORMS))
def test_gpu_attention_forms_match_the_math_definition(form, causal):
    fwd, bwd = GPU_FORMS[form]
    torch.manual_seed(0)
    q, k, v, do = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 5, 4)

    def f(q, k, v, do):
        r = fwd(q, k, v, causal, 0.0)
        return (r[0], *bwd(do, q, k, v, r, causal, 0.0))

    gm = make_fx(f, tracing_mode="fake")(q, k, v, do)
    targets = {str(n.target) for n in gm.graph.nodes}
    assert any(form in t and "backward" in t for t in targets), targets
    got = _run(gm, [q, k, v, do])[0][0]
    out, qd, kd, vd = _math_attention(q, k, v, causal)
    want = (out, *torch.autograd.grad(out, (qd, kd, vd), do.double()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.float(), atol=1e-5, rtol=1e-4)


def test_efficient_attention_returns_the_bias_gradient():
    torch.manual_seed(1)
    q, k, v, do = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    bias = torch.randn(1, 1, 4, 4)

    def f(q, k, v, bias, do):
        r = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False)
        return aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, bias, r[0], r[1], r[2], r[3], 0.0, [True, True, True, True], False)

    got = _run(make_fx(f, tracing_mode="fake")(q, k, v, bias, do), [q, k, v, bias, do])[0][0]
    b = bias.double().requires_grad_(True)
    out, qd, kd, vd = _math_attention(q, k, v, False, b)
    want = torch.autograd.grad(out, (qd, kd, vd, b), do.double())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.float(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", sorted(GPU_FORMS))
def test_gpu_attention_dropout_backward_is_the_gradient_of_its_forward(form):
    """With dropout the forward's mask follows the random ops' rule and reaches the backward
    through the RNG state: the backward's gradients are the forward's derivative (central
    differences along a random direction, float64), and about 1 - p of the weights are kept."""
    fwd, bwd = GPU_FORMS[form]
    torch.manual_seed(2)
    shapes = [(1, 2, 6, 8), (1, 2, 7, 8), (1, 2, 7, 4), (1, 2, 6, 4)]
    q, k, v, do = (torch.randn(*s, dtype=torch.float64) for s in shapes)

    def f(q, k, v, do):
        r = fwd(q, k, v, False, 0.4)
        return (r[0], *bwd(do, q, k, v, r, False, 0.4))

    gm = make_fx(f, tracing_mode="fake")(q, k, v, do)
    out, gq, gk, gv = _run(gm, [q, k, v, do])[0][0]
    dirs = [torch.randn_like(t) for t in (q, k, v)]
    eps = 1e-6
    plus = _run(gm, [q + eps * dirs[0], k + eps * dirs[1], v + eps * dirs[2], do])[0][0][0]
    minus = _run(gm, [q - eps * dirs[0], k - eps * dirs[1], v - eps * dirs[2], do])[0][0][0]
    numeric = ((plus - minus) / (2 * eps) * do).sum()
    analytic = sum((g * d).sum() for g, d in zip((gq, gk, gv), dirs))
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)
    plain, *_ = _math_attention(q, k, v, False)
    assert not torch.allclose(out, plain.detach())  # the mask is applied
    # v = the identity reads the kept, rescaled weights back: about 60% nonzero.
    eye, zero = torch.eye(7, dtype=torch.float64).expand(1, 2, 7, 7).contiguous(), torch.zeros(1, 2, 6, 7, dtype=torch.float64)
    weights = _run(make_fx(f, tracing_mode="fake")(q, k, eye, zero), [q, k, eye, zero])[0][0][0]
    kept = (weights != 0).double().mean().item()
    assert 0.4 < kept < 0.8, kept


def test_cpu_flash_attention_dropout_is_refused_naming_the_node():
    q = torch.randn(1, 1, 2, 4)
    gm = make_fx(lambda q: aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.1)[0], tracing_mode="fake")(q)
    with pytest.raises(zerosched.ZeroschedError, match="_scaled_dot_product_flash_attention_for_cpu.*dropout"):
        _run(gm, [q])


BATCH_NORM = {
    "native_batch_norm train": lambda x, w, b, rm, rv: aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5),
    "native_batch_norm eval": lambda x, w, b, rm, rv: aten.native_batch_norm(x, w, b, rm, rv, False, 0.1, 1e-5),
    "_native_batch_norm_legit_functional": lambda x, w, b, rm, rv: aten._native_batch_norm_legit_functional(
        x, w, b, rm, rv, True, 0.1, 1e-5),
    "_native_batch_norm_legit_no_training": lambda x, w, b, rm, rv: aten._native_batch_norm_legit_no_training(
        x, w, b, rm, rv, 0.1, 1e-5),
    "_native_batch_norm_legit.no_stats": lambda x, w, b, rm, rv: aten._native_batch_norm_legit.no_stats(
        x, w, b, True, 0.1, 1e-5),
}


@pytest.mark.parametrize("name", sorted(BATCH_NORM))
def test_batch_norm_forms_match_eager(name):
    torch.manual_seed(0)
    xs = [torch.randn(4, 3, 5, 2, dtype=torch.float64), torch.rand(3, dtype=torch.float64),
          torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64),
          torch.rand(3, dtype=torch.float64) + 0.5]
    f = BATCH_NORM[name]
    gm = make_fx(f)(*[x.clone() for x in xs])
    want = f(*[x.clone() for x in xs])
    got = _run(gm, xs)[0][0]
    for g, w in zip(got, want, strict=True):
        if w.numel() == 0:  # statistics the CPU kernel leaves empty outside training
            assert g.shape == w.shape
            continue
        torch.testing.assert_close(g, w)


def _dropout_program(p):
    """A forward with a parameter and dropout, and its backward, as the exporter writes them."""
    from zerosched.export import capture, decomposition_table, dumps_program, name_graphs

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(p), torch.nn.Linear(8, 2))
    x = torch.randn(4, 6)
    graphs = capture(m, lambda cm: cm(x).sum().backward(), decompositions=decomposition_table("none"))
    name_graphs("drop", graphs)
    return dumps_program([g.to_doc() for g in graphs]).encode()


def test_random_ops_follow_the_rule_on_every_rank_and_schedule():
    data = _dropout_program(0.5)
    assert b"aten.native_dropout.default" in data and b"native_dropout_backward" in data
    plain = zerosched.run(data, None, {"world_size": 2, "seed": 3})
    scheduled, _ = zerosched.schedule(data, {"world_size": 2, "scheduler": "prefetch"})
    sched = zerosched.run(bytes(scheduled), None, {"world_size": 2, "seed": 3})
    fwd = plain[0]
    # Two ranks draw the same mask: with the same inputs (a seed-drawn batch differs per rank,
    # so compare the mask, the dropout's second output, where the forward returns it).
    masks = [[t for t in rank if t is not None and t.dtype == torch.bool] for rank in fwd]
    assert masks[0] and all(torch.equal(a, b) for a, b in zip(masks[0], masks[1], strict=True))
    kept = masks[0][0].float().mean().item()
    assert 0.2 < kept < 0.8, kept
    # The scheduled graphs compute exactly the original's outputs on each rank, but a parameter
    # the forward keeps for the backward comes back as each rank's shard of it, and a gradient
    # as each rank's shard of the rank-order sum (flattened, zero-padded).
    for gi, (g_plain, g_sched) in enumerate(zip(plain, sched, strict=True)):
        for k, (a, b) in enumerate(zip(g_plain[0], g_sched[0], strict=True)):
            assert (a is None) == (b is None)
            if a is None:
                continue
            if a.shape == b.shape:
                assert all(torch.equal(r[k], s[k]) for r, s in zip(g_plain, g_sched))
            else:
                whole = torch.cat([s[k].flatten() for s in g_sched])[:a.numel()]
                full = a if gi == 0 else g_plain[0][k] + g_plain[1][k]
                assert torch.equal(whole, full.flatten())


def test_random_op_values_are_in_range_and_keyed_by_node_name():
    def f(x):
        return (aten.rand_like(x), aten.randn_like(x), aten.bernoulli.p(x, 0.3),
                aten.randint_like(x, 3, 7), aten.native_dropout(x, 0.25, True)[1], aten.randperm(50))

    x = torch.zeros(64, 64)
    gm = make_fx(f)(x)
    rand, randn, bern, randint, mask, perm = _run(gm, [x])[0][0]
    assert sorted(perm.tolist()) == list(range(50)) and perm.tolist() != list(range(50))
    assert 0 <= rand.min() and rand.max() < 1 and abs(rand.mean() - 0.5) < 0.02
    assert abs(randn.mean()) < 0.05 and abs(randn.std() - 1) < 0.05
    assert set(bern.unique().tolist()) <= {0.0, 1.0} and abs(bern.mean() - 0.3) < 0.03
    assert randint.min() >= 3 and randint.max() <= 6
    assert abs(mask.float().mean() - 0.75) < 0.03
    again = _run(gm, [x])[0][0]
    assert all(torch.equal(a, b) for a, b in zip((rand, randn, bern, randint, mask, perm), again))
    assert not torch.equal(rand, randn)  # each node its own stream


DIRECT = {
    # elu's backward from its result (what an in-place elu saves, functionalized)
    "elu_backward is_result": lambda g, x: aten.elu_backward(g, 0.7, 1.5, 0.5, True, aten.elu(x, 0.7, 1.5, 0.5)),
    "leaky_relu_backward is_result": lambda g, x: aten.leaky_relu_backward(g, aten.leaky_relu(x, 0.1), 0.1, True),
    "clamp.Tensor one bound": lambda g, x: aten.clamp.Tensor(x, None, g),
    "pow.Scalar": lambda g, x: aten.pow.Scalar(2.5, x),
    "argmax flat keepdim": lambda g, x: aten.argmax(x, None, True),
    "index_put accumulate": lambda g, x: aten.index_put(x, [torch.tensor([0, 2, 0])], g[:3], True),
    # full slices before the index tensors: x[:, i] and its accumulating put
    "index after a full slice": lambda g, x: aten.index.Tensor(x, [None, torch.tensor([[4, 0], [1, 1]])]),
    "index_put after a full slice": lambda g, x: aten.index_put(x, [None, torch.tensor([3, 0, 3])], g[:, :3], True),
    "_unsafe_index of nearest upsampling": lambda g, x: aten._unsafe_index.Tensor(
        x[None], [None, torch.tensor([[0], [0], [2], [3]]), torch.tensor([0, 1, 1, 4])]),
}


@pytest.mark.parametrize("name", sorted(DIRECT))
def test_direct_calls_match_eager(name):
    torch.manual_seed(0)
    g, x = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    from test_opinfo import _lift_constants

    def f(g, x):
        return (DIRECT[name](g, x),)

    gm = make_fx(f)(g, x)
    got = _run(gm, [g, x, *_lift_constants(gm)])[0][0]
    for a, b in zip(got, f(g, x), strict=True):
        torch.testing.assert_close(a, b)


def test_assert_async_passes_a_true_value_and_names_a_false_one():
    def f(x):
        aten._assert_async.msg(aten.any(x), "x has a nonzero element")
        return (x * 2,)

    gm = make_fx(f)(torch.ones(3))
    assert _run(gm, [torch.ones(3)])[0][0][0].tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(zerosched.ZeroschedError, match="_assert_async.*x has a nonzero element"):
        _run(gm, [torch.zeros(3)])


def _layer_norm_doc(kwargs):
    """A graph calling the composite `aten.layer_norm.default` (which tracing decomposes, so
    a graph holds it only as written: a hand-built or pre-dispatch export) on `x` [4, 5]."""
    t = lambda shape: {"val": {"shape": shape, "dtype": "float32", "stride": [5, 1][-len(shape):]}}
    names = ["x"] + [v["node"] for v in kwargs.values() if isinstance(v, dict)]
    nodes = [{"name": n, "op": "placeholder", "target": n, "args": [], "kwargs": {}, "meta": t([4, 5] if n == "x" else [5])}
             for n in names]
    nodes.append({"name": "ln", "op": "call_function", "target": "aten.layer_norm.default",
                  "args": [{"node": "x"}, [5]], "kwargs": kwargs, "meta": t([4, 5])})
    nodes.append({"name": "output", "op": "output", "target": "output", "args": [[{"node": "ln"}]], "kwargs": {},
                  "meta": {}})
    return names, {"format": "fx-graph", "version": 1, "kind": "inference", "name": "layer_norm", "nodes": nodes}


@pytest.mark.parametrize("kwargs", [{}, {"weight": {"node": "w"}}, {"weight": {"node": "w"}, "bias": {"node": "b"},
                                                                     "eps": 0.1}],
                         ids=["plain", "weight keyword", "weight bias eps keywords"])
def test_composite_layer_norm_matches_eager_with_keyword_arguments(kwargs):
    torch.manual_seed(0)
    names, doc = _layer_norm_doc(kwargs)
    xs = {"x": torch.randn(4, 5), "w": torch.randn(5), "b": torch.randn(5)}
    got = zerosched.run(dumps_graph(doc).encode(), {n: xs[n] for n in names})[0][0][0]
    want = F.layer_norm(xs["x"], (5,), xs["w"] if "weight" in kwargs else None, xs["b"] if "bias" in kwargs else None,
                        kwargs.get("eps", 1e-5))
    torch.testing.assert_close(got, want)
