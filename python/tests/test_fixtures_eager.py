"""The model-family fixtures (tests/fixtures/families: BERT, T5, GPT-NeoX, Gemma, OLMoE, ViT,
each exported with `--decompositions none` and `core`) on the executor against PyTorch eager
running the same exported graph on the same inputs (issue 20 §3).

Each graph runs alone: the executor draws its inputs (seeded, as `zerosched run` does) and,
through a copy of the graph whose output also returns every placeholder, hands them back; an
fx interpreter then runs the document's own nodes through the aten overloads they name, on
those inputs, in eager mode. Every output must agree within the bound of its dtype, relative to
the output's largest finite magnitude (docs/exec.md): the two sum in different orders. NaN and
infinities (masks) must be at the same places.
"""

from __future__ import annotations

import copy
import gzip
import json
import pathlib

import pytest
import torch

import zerosched
from zerosched.rebuild import torch_target

FAMILIES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "families"
PROGRAMS = sorted(FAMILIES.glob("*.program.json.gz"))

# |executor - eager| <= BOUND[dtype] * max(1, max |eager|), per output.
BOUND = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _load(path: pathlib.Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def _decode(a, env: dict):
    """One fx-graph v1 argument as the Python value eager mode takes."""
    if isinstance(a, list):
        return [_decode(x, env) for x in a]
    if not isinstance(a, dict):
        return a
    if "node" in a:
        return env[a["node"]]
    if "dtype" in a:
        return getattr(torch, a["dtype"])
    if "float" in a:
        return float(a["float"])
    if "device" in a:
        return torch.device("cpu")  # eager runs on the CPU, whatever device exported it
    if "layout" in a:
        return getattr(torch, a["layout"])
    if "memory_format" in a:
        return getattr(torch, a["memory_format"])
    if "sym" in a:
        return a["hint"]
    raise AssertionError(f"argument {a!r} has no eager value")


def eager(graph: dict, inputs: dict[str, torch.Tensor]) -> list:
    """The graph's outputs, its nodes run one by one in eager mode."""
    env: dict = {}
    for n in graph["nodes"]:
        if n["op"] in ("placeholder", "get_attr"):
            env[n["name"]] = inputs[n["name"]]
        elif n["op"] == "call_function":
            target = torch_target(n["target"])
            assert target is not None, f"`{n['name']}`: no eager op for `{n['target']}`"
            env[n["name"]] = target(*_decode(n["args"], env), **{k: _decode(v, env) for k, v in n["kwargs"].items()})
        elif n["op"] == "output":
            return _decode(n["args"][0], env)
        else:
            raise AssertionError(f"`{n['name']}`: node op `{n['op']}`")
    raise AssertionError("the graph has no output")


def _returning_inputs(graph: dict) -> tuple[bytes, list[str]]:
    """A one-graph document of `graph` whose output also returns every placeholder and
    attribute (a tensor constant, which the executor draws as it draws inputs)."""
    doc = copy.deepcopy(graph)
    doc.update(format="fx-graph", version=1)
    names = [n["name"] for n in doc["nodes"] if n["op"] in ("placeholder", "get_attr")]
    out = doc["nodes"][-1]
    assert out["op"] == "output"
    out["args"][0] = list(out["args"][0]) + [{"node": p} for p in names]
    return json.dumps(doc).encode(), names


def _within(got: torch.Tensor, want: torch.Tensor, where: str) -> float:
    """The difference relative to the bound (at most 1 passes)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (where, got.shape, want.shape, got.dtype, want.dtype)
    if not want.is_floating_point():
        assert torch.equal(got, want), where
        return 0.0
    g, w = got.double(), want.double()
    assert torch.equal(g.isnan(), w.isnan()), f"{where}: NaN at different places"
    assert torch.equal(g.isinf(), w.isinf()) and torch.equal(g[g.isinf()], w[w.isinf()]), \
        f"{where}: infinities at different places"
    special = w.isnan() | w.isinf()
    diff = (g - w).abs().masked_fill(special, 0)
    scale = max(1.0, w.masked_fill(special, 0).abs().max().item()) if w.numel() else 1.0
    worst = diff.max().item() / (BOUND[want.dtype] * scale) if w.numel() else 0.0
    assert worst <= 1, f"{where}: max |difference| {diff.max().item():.3g} over the bound {BOUND[want.dtype] * scale:.3g}"
    return worst


def graphs():
    for path in PROGRAMS:
        for i, g in enumerate(_load(path)["graphs"]):
            yield pytest.param(path, i, id=g.get("name") or f"{path.name}:{i}")


@pytest.mark.parametrize("path,index", list(graphs()))
def test_family_graph_matches_eager(path, index):
    graph = _load(path)["graphs"][index]
    data, names = _returning_inputs(graph)
    got = zerosched.run(data, None, {"seed": 1})[0][0]
    n_out = len(got) - len(names)
    inputs = dict(zip(names, got[n_out:], strict=True))
    want = eager(graph, inputs)
    assert len(want) == n_out
    for k, (g, w) in enumerate(zip(got[:n_out], want, strict=True)):
        assert (g is None) == (w is None), k
        if w is not None:
            _within(g, w, f"{graph['name']} output {k}")
