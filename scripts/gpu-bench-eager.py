#!/usr/bin/env python3
"""PyTorch eager on the same exported program and inputs as `zerosched run --executor cuda`.

    gpu-bench-eager.py PROGRAM [--inputs OUT.safetensors] --report OUT.json [--steps 3] [--seed 0]
                       [--device cuda]

Executes the fx-graph v1 document (docs/format.md) op by op on the GPU, graph after graph as
zerosched's executor does: each aten target is called with its decoded arguments (devices
mapped to the GPU: the exporter traced on the meta device), a placeholder takes the value an
earlier graph returned under its name, else a parameter or input drawn here. Those drawn
inputs are written to OUT.safetensors (by parameter or placeholder name, the names
`zerosched run --inputs` reads) so that zerosched runs on the same data. The report holds the
event-timed steps (a warm-up, then --steps) and, per graph, each output's sum and absolute sum
in float64, which scripts/gpu-bench compares with zerosched's.

Standalone on purpose: the GPU machine has torch but not zerosched's extension module, which
`zerosched.rebuild` (the same target lookup) imports.
"""

from __future__ import annotations

import argparse
import gzip
import json
import operator
import os
import struct
import sys
import time

import torch

# Where the program runs (`--device`; the GPU, or the CPU to check this script where there is
# no GPU).
GPU = torch.device("cuda")
SAFETENSORS_DTYPE = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
                     torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                     torch.uint8: "U8", torch.bool: "BOOL"}


def load(path: str) -> dict:
    raw = open(path, "rb").read()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc = json.loads(raw)
    return doc if "graphs" in doc else {"graphs": [doc]}


def target(name: str):
    if name == "operator.getitem":
        return operator.getitem
    ns, _, rest = name.partition(".")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def decode(a, env: dict):
    if isinstance(a, list):
        return [decode(x, env) for x in a]
    if not isinstance(a, dict):
        return a
    if "node" in a:
        return env[a["node"]]
    if "dtype" in a:
        return getattr(torch, a["dtype"])
    if "device" in a:
        return GPU
    if "layout" in a:
        return getattr(torch, a["layout"])
    if "memory_format" in a:
        return getattr(torch, a["memory_format"])
    if "float" in a:
        return float(a["float"])
    if "slice" in a:
        return slice(*decode(a["slice"], env))
    if "sym" in a:
        return int(a["hint"])
    raise ValueError(f"argument {a!r} cannot be decoded")


def shape(val: dict) -> list[int]:
    return [d["hint"] if isinstance(d, dict) else d for d in val["shape"]]


def index_bound(graph: dict, name: str, val: dict) -> int:
    """Integers drawn in [0, n) for the smallest dimension a consumer indexes with them, as
    zerosched's own random inputs are (embedding rows, gather's dimension)."""
    nodes = {n["name"]: n for n in graph["nodes"]}
    bound = None
    for n in graph["nodes"]:
        args = n.get("args", [])
        refs = lambda a: isinstance(a, dict) and a.get("node") == name  # noqa: E731
        dim = None
        if n["target"] == "aten.embedding.default" and len(args) > 1 and refs(args[1]):
            src, dim = args[0], 0
        elif n["target"] == "aten.gather.default" and len(args) > 2 and refs(args[2]):
            src, dim = args[0], args[1]
        if dim is not None and isinstance(src, dict) and src.get("node") in nodes:
            s = shape(nodes[src["node"]]["meta"]["val"])
            d = s[dim % len(s)]
            bound = d if bound is None else min(bound, d)
    return bound or 2


def draw(graph: dict, name: str, val: dict, param: bool, gen: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, val["dtype"])
    sh = shape(val)
    if dtype.is_floating_point:
        lo = 0.1 if param else 1.0
        t = torch.rand(sh, generator=gen, device=GPU, dtype=torch.float32) * (2 * lo) - lo
        return t.to(dtype)
    if dtype == torch.bool:
        return torch.rand(sh, generator=gen, device=GPU) < 0.5
    return torch.randint(0, index_bound(graph, name, val), sh, generator=gen, device=GPU, dtype=dtype)


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors file of `tensors`, one tensor's bytes in host memory at a time, written
    whole or not at all."""
    header, at = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(path + ".tmp", path)


def inputs_of(doc: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter (by name) and every placeholder no earlier graph returns (by name)."""
    gen = torch.Generator(device=GPU)
    gen.manual_seed(seed)
    drawn: dict[str, torch.Tensor] = {}
    returned: set[str] = set()
    for g in doc["graphs"]:
        params = {p["node"]: p["name"] for p in g.get("params", [])}
        for n in g["nodes"]:
            if n["op"] != "placeholder":
                continue
            key = params.get(n["name"], n["name"])
            if key in drawn or (key == n["name"] and n["name"] in returned):
                continue
            drawn[key] = draw(g, n["name"], n["meta"]["val"], n["name"] in params, gen)
        out = next(n for n in g["nodes"] if n["op"] == "output")
        for a in out["args"][0]:
            if isinstance(a, dict) and "node" in a:
                returned.add(a["node"])
    return drawn


def node_refs(a) -> list[str]:
    """The node names an argument reads."""
    if isinstance(a, dict):
        return [a["node"]] if "node" in a else [r for v in a.values() for r in node_refs(v)]
    if isinstance(a, list):
        return [r for v in a for r in node_refs(v)]
    return []


def last_uses(g: dict) -> list[list[str]]:
    """Per node of `g`, the values whose last reader it is (dropped after it runs, as the
    executor frees them, so that eager holds what the program needs and no more)."""
    last: dict[str, int] = {}
    for i, n in enumerate(g["nodes"]):
        for r in node_refs(n.get("args", [])) + node_refs(n.get("kwargs", {})):
            last[r] = i
    per: list[list[str]] = [[] for _ in g["nodes"]]
    for name, i in last.items():
        per[i].append(name)
    return per


class Links:
    """Values graphs return for later graphs, linked as the executor links them
    (docs/format.md): a backward graph's placeholders read its `forward`'s outputs; in a
    document without any `forward`, the latest graph that returned the name."""

    def __init__(self, doc: dict):
        self.paired = any("forward" in g for g in doc["graphs"])
        self.carried: dict[tuple[str, str], torch.Tensor] = {}
        self.latest: dict[str, str] = {}

    def take(self, g: dict, name: str):
        src = g.get("forward")
        if src is None:
            if self.paired:
                return None
            src = self.latest.get(name, "")
        return self.carried.pop((src, name), None)

    def carry(self, g: dict, name: str, v: torch.Tensor) -> None:
        label = g.get("name", "")
        self.carried[(label, name)] = v
        if not self.paired:
            old = self.latest.get(name)
            if old is not None and old != label:
                self.carried.pop((old, name), None)
            self.latest[name] = label


def run_step(doc: dict, inputs: dict[str, torch.Tensor], drops: list[list[list[str]]]) -> list[list]:
    """One step: every graph in order (`drops`: each graph's `last_uses`, computed once outside
    the timed steps); returns each graph's outputs."""
    links = Links(doc)
    outs = []
    for g, graph_drops in zip(doc["graphs"], drops):
        params = {p["node"]: p["name"] for p in g.get("params", [])}
        env: dict = {}
        result = []
        for n, dropped in zip(g["nodes"], graph_drops):
            name = n["name"]
            if n["op"] == "placeholder":
                linked = links.take(g, name)
                env[name] = inputs[params[name]] if name in params else (
                    linked if linked is not None else inputs.get(name))
            elif n["op"] == "get_attr":
                env[name] = inputs[name]
            elif n["op"] == "output":
                result = decode(n["args"][0], env)
            else:
                env[name] = target(n["target"])(*decode(n.get("args", []), env), **decode_kwargs(n, env))
            for d in dropped:
                env.pop(d, None)
        for a, v in zip(next(n for n in g["nodes"] if n["op"] == "output")["args"][0], result):
            if isinstance(a, dict) and "node" in a:
                links.carry(g, a["node"], v)
        outs.append(result)
    return outs


# The outputs of an attention kernel that are its dropout generator's seed and offset, by index:
# state, not data (each implementation draws its own; without dropout nothing reads them).
RNG_STATE = {"aten._scaled_dot_product_flash_attention.default": {6, 7},
             "aten._scaled_dot_product_efficient_attention.default": {2, 3}}


def rng_state_outputs(g: dict) -> list[bool]:
    """Per output of `g`: whether it is an attention's generator state, which no checksum
    compares."""
    nodes = {n["name"]: n for n in g["nodes"]}

    def is_state(a) -> bool:
        n = nodes.get(a.get("node")) if isinstance(a, dict) else None
        if n is None or n.get("target") != "operator.getitem":
            return False
        src, index = n["args"][0], n["args"][1]
        return index in RNG_STATE.get(nodes.get(src.get("node"), {}).get("target"), set())
    out = next(n for n in g["nodes"] if n["op"] == "output")["args"][0]
    return [is_state(a) for a in out]


def timed_ms(step) -> float:
    """Milliseconds of `step()`: CUDA events around it on the GPU, the wall clock on the CPU.
    Its result is kept as `run_step.last`; the previous step's is not held through this one."""
    run_step.last = None
    if GPU.type != "cuda":
        t0 = time.perf_counter()
        run_step.last = step()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run_step.last = step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def decode_kwargs(n: dict, env: dict) -> dict:
    return {k: decode(v, env) for k, v in n.get("kwargs", {}).items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("--inputs", help="write the inputs drawn here to this safetensors file")
    ap.add_argument("--report", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    global GPU
    GPU = torch.device(a.device)
    doc = load(a.program)
    with torch.no_grad():
        inputs = inputs_of(doc, a.seed)
        drops = [last_uses(g) for g in doc["graphs"]]
        times = []
        for _ in range(a.steps + 1):
            times.append(timed_ms(lambda: run_step(doc, inputs, drops)))
        outs = run_step.last
        sums = [[[float(t.double().sum()), float(t.double().abs().sum())]
                 if isinstance(t, torch.Tensor) and not rng_state else None
                 for t, rng_state in zip(graph, rng_state_outputs(g))] for graph, g in zip(outs, doc["graphs"])]
        del outs
        if a.inputs:
            write_safetensors(a.inputs, inputs)
    steps = sorted(times[1:])
    device = torch.cuda.get_device_name() if GPU.type == "cuda" else "cpu"
    report = {"device": device, "torch": torch.__version__, "step_ms": times,
              "measured_step_ms": steps[len(steps) // 2], "graphs": sums}
    with open(a.report, "w") as f:
        json.dump(report, f)
    print(f"eager: {report['measured_step_ms']:.3f} ms per step on {report['device']} "
          f"(median of {len(steps)} after a warm-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
