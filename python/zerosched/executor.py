"""`zerosched.run`: a graph or program on zerosched's CPU executor, in-process (docs/python.md).

Inputs travel to Rust as one safetensors document written here (the format is a length, a
JSON header and the raw little-endian elements), so the package needs nothing beyond torch.
"""

import json
import struct

import torch

from zerosched import _core

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}

_TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def _safetensors(inputs):
    header, chunks, offset = {}, [], 0
    for name in sorted(inputs):
        t = inputs[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"input `{name}` is a {type(t).__name__}, not a tensor")
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"input `{name}`: dtype {t.dtype} is not supported")
        flat = t.detach().to("cpu").contiguous().reshape(-1).clone()
        data = bytes(flat.view(torch.uint8).untyped_storage()) if flat.numel() else b""
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def _tensor(out):
    if out is None:
        return None
    dtype_name, shape, data = out
    dtype = _TORCH_DTYPES[dtype_name]
    held = torch.int64 if not dtype.is_floating_point and dtype != torch.bool else dtype
    held = torch.uint8 if dtype == torch.bool else held
    flat = torch.frombuffer(bytearray(data), dtype=held) if data else torch.empty(0, dtype=held)
    return flat.reshape(shape).to(dtype)


def run(data, inputs=None, options=None):
    """Runs an fx-graph v1 graph or program (JSON, gzip JSON or binary) on the CPU executor.

    `inputs` maps placeholder or parameter names to tensors (each must have its graph's shape
    and dtype); every other input is drawn from `options["seed"]` as `zerosched run` draws it.
    `options`: `world_size` (ranks, default 1) and `seed` (default 0). Returns, for each graph
    in order, for each rank, the graph's outputs as tensors (None for an output that is not a
    tensor). Refusals raise `zerosched.ZeroschedError`, naming every unsupported op and node.
    """
    blob = _safetensors(inputs) if inputs else b""
    return [[[_tensor(o) for o in rank] for rank in graph]
            for graph in _core.run(data, blob, options)]
