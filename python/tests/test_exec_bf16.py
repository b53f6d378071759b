"""The CPU executor's bf16 arithmetic against PyTorch's on the CPU.

The executor computes a bf16 op in f32 and rounds the result once to bf16, to nearest with
ties to even (exec/core/src/host.rs). These tests trace small bf16 functions to aten graphs
(make_fx), export them with the project's exporter, run them with `zerosched run` on inputs
given in a safetensors file, and compare every output with torch's eager result:

- elementwise arithmetic and casts: bitwise, including inputs whose exact results fall on or
  just past a bf16 rounding midpoint, where truncating would give another value;
- transcendental functions (exp, rsqrt, sigmoid): within one bf16 ulp (torch's vectorized f32
  kernels and Rust's libm may differ in the last f32 bit, which can move a bf16 result that
  lies near a midpoint by one ulp);
- reductions and matrix products: within one bf16 ulp of the largest magnitude among the
  output's elements (both accumulate in f32, in different orders);
- the MoE routing ops (sort, histc, the three layouts of _grouped_mm): bitwise.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file
from torch.fx.experimental.proxy_tensor import make_fx

from test_core import cli
from zerosched import export


def executor_outputs(fn, inputs: list[torch.Tensor], tmp: pathlib.Path, name: str) -> list[torch.Tensor]:
    """Runs `fn`'s aten graph with `zerosched run` on `inputs`; returns its outputs."""
    gm = make_fx(fn)(*inputs)
    doc = export.graph_to_doc(gm, name=name)
    graph = tmp / f"{name}.json"
    graph.write_text(json.dumps(doc))
    placeholders = [n["name"] for n in doc["nodes"] if n["op"] == "placeholder"]
    save_file({p: t.contiguous() for p, t in zip(placeholders, inputs)}, str(tmp / "in.safetensors"))
    out = tmp / "out.json"
    r = cli("run", str(graph), "--inputs", str(tmp / "in.safetensors"), "--outputs", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    outs = json.loads(out.read_text())["graphs"][0]["outputs"]
    return [
        torch.tensor([float(v) for v in o["values"]], dtype=torch.float64)
        .reshape(o["shape"])
        .to(getattr(torch, o["dtype"]))
        for o in outs
    ]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bf16 representable steps between same-signed elements."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return int((ia - ib).abs().max())


def truncated(x32: torch.Tensor) -> torch.Tensor:
    """bf16 by dropping the low 16 bits of an f32 (what round-to-nearest must not do)."""
    bits = x32.view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


def random_bf16(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) * 4 - 2).to(torch.bfloat16)


def midpoint_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """x, y in bf16 whose exact sum lies on a bf16 midpoint (a tie: to even) or past it: 1 plus
    1.5, 1.75 and 2.5 steps of 2^-7, and their negatives."""
    step = 2.0**-7
    xs = [1.0, 1.0, 1.0, -1.0, -1.0, 1.0]
    ys = [1.5 * step, 1.75 * step, 2.5 * step, -1.5 * step, -1.75 * step, 0.5 * step]
    return torch.tensor(xs, dtype=torch.bfloat16), torch.tensor(ys, dtype=torch.bfloat16)


def elementwise(x, y):
    return x + y, x - y, x * y, x / y, (x.float() * 3.0).to(torch.bfloat16), x * 0.1


def test_elementwise_bf16_is_bitwise_torch(tmp_path):
    mx, my = midpoint_pairs()
    x = torch.cat([mx, random_bf16(256, seed=1)])
    y = torch.cat([my, random_bf16(256, seed=2)])
    got = executor_outputs(elementwise, [x, y], tmp_path, "bf16_elementwise_midpoints")
    want = elementwise(x, y)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), (g - w).abs().max()
    # The midpoints pin the rounding: truncating the f32 sums would give other values.
    exact = mx.float() + my.float()
    assert not torch.equal(truncated(exact).view(torch.int16), got[0][: len(mx)].view(torch.int16))
    assert torch.equal(exact.to(torch.bfloat16).view(torch.int16), got[0][: len(mx)].view(torch.int16))


def transcendental(x):
    return x.exp(), (x * x + 0.25).rsqrt(), x.sigmoid(), x.tanh()


def test_transcendental_bf16_within_one_ulp_of_torch(tmp_path):
    x = random_bf16(4096, seed=3)
    got = executor_outputs(transcendental, [x], tmp_path, "bf16_transcendental")
    for g, w in zip(got, transcendental(x)):
        assert g.dtype == torch.bfloat16
        assert ulps_apart(g, w) <= 1


def reductions(x, w):
    return x @ w, x.sum(dim=-1), torch.softmax(x, dim=-1), x.mean(dim=0)


@pytest.mark.parametrize("k", [8, 64, 512])
def test_reductions_bf16_within_one_ulp_of_the_largest(tmp_path, k):
    x = random_bf16(16, k, seed=4)
    w = random_bf16(k, 24, seed=5)
    got = executor_outputs(reductions, [x, w], tmp_path, f"bf16_reductions_k{k}")
    for g, want in zip(got, reductions(x, w)):
        assert g.dtype == want.dtype == torch.bfloat16
        scale = want.float().abs().max()
        ulp = 2.0 ** (torch.floor(torch.log2(scale)) - 7)
        assert (g.float() - want.float()).abs().max() <= ulp


def routing(x, keys, counts_src, a2, b3, a3, b2, offs):
    """The MoE routing ops: sort (stable ties), histc, and the three grouped-product layouts."""
    v, i = torch.sort(keys, stable=True)
    dv, di = torch.sort(keys, descending=True, stable=True)
    return (
        v,
        i,
        dv,
        di,
        torch.sort(x)[0],
        torch.histc(counts_src, 4, 0, 3),
        torch._grouped_mm(a2, b3, offs),
        torch._grouped_mm(a3, b2, offs),
        torch._grouped_mm(a2.t().contiguous(), a2, offs),
    )


def test_routing_ops_match_torch(tmp_path):
    """sort, histc and _grouped_mm as torch computes them on the CPU: bitwise. The offsets
    include an empty group and end at the full size (torch leaves rows past the last offset
    uninitialized, so no comparison can cover them)."""
    g = torch.Generator().manual_seed(6)
    x = random_bf16(64, seed=7)
    keys = torch.randint(0, 4, (64,), generator=g)
    # Integer-valued floats, the range's ends, outside values.
    counts_src = torch.tensor([0.0, 1, 2, 3, 3, 2.5, 0.75, -1, 4, 2.999])
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32)
    a2 = random_bf16(64, 16, seed=8)
    b3 = random_bf16(4, 16, 8, seed=9)
    a3 = random_bf16(4, 8, 16, seed=10)
    b2 = random_bf16(16, 64, seed=11)
    inputs = [x, keys, counts_src, a2, b3, a3, b2, offs]
    got = executor_outputs(routing, inputs, tmp_path, "bf16_routing_sort_histc_grouped_mm")
    want = routing(*inputs)
    assert len(got) == len(want)
    for k, (gv, w) in enumerate(zip(got, want)):
        assert gv.dtype == w.dtype, k
        assert gv.shape == w.shape, k
        assert torch.equal(gv, w), (k, gv, w)
