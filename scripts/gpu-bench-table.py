#!/usr/bin/env python3
"""The markdown table of scripts/gpu-bench from its rows file (tab-separated: kind, program,
scheduler, status, then the report paths, or the reason a row was refused).

    gpu-bench-table.py ROWS DEVICE_TXT > bench.md
"""

from __future__ import annotations

import json
import math
import re
import sys

GIB = 1 << 30


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "-"


def reason(text: str) -> str:
    """A refusal in one cell: the executor's list of missing ops as the distinct ops and a
    count of nodes."""
    missing = re.findall(r"`([^`]+)` \(node `", text)
    if missing:
        ops = sorted(set(missing))
        return f"ops {', '.join(ops)} ({len(missing)} nodes)"
    return text.replace("|", "\\|")


def replay_row(name: str, sched: str, status: str, rest: list[str]) -> str:
    if status != "ok":
        return f"| {name} | {sched} | refused: {reason(rest[0] if rest else '?')} | | | | | | |"
    r = load(rest[0])
    c, s = r["cuda"], r["simulator"]
    return (f"| {name} | {sched} | {c['measured_step_ms']:.3f} | {s['step_ms']:.3f} | "
            f"{ratio(c['measured_step_ms'], s['step_ms'])} | {c['exposed_comm_ms']:.3f} | {s['exposed_comm_ms']:.3f} | "
            f"{c['pool_peak_requested'] / GIB:.3f} | {s['peak_total_bytes'] / GIB:.3f} |")


def finite(x) -> bool:
    # zerosched's JSON writes a non-finite sum as null.
    return x is not None and math.isfinite(x)


def checksum_error(zs: list, eager: list) -> float:
    """The largest difference of an output's sum or absolute sum, relative to eager's absolute
    sum, over every output both have; sums that are non-finite on both sides (a mask of -inf)
    agree, on one side only they are an infinite error."""
    worst = 0.0
    for gz, ge in zip(zs, eager):
        for z, e in zip(gz or [], ge or []):
            if z is None or e is None:
                continue
            scale = max(abs(e[1]), 1e-30) if finite(e[1]) else 1.0
            for a, b in zip(z, e):
                if finite(a) and finite(b):
                    worst = max(worst, abs(a - b) / scale)
                elif finite(a) or finite(b):
                    worst = math.inf
    return worst


def numeric_row(name: str, status: str, rest: list[str]) -> str:
    eager = load(rest[-1]) if len(rest) > 1 or status == "ok" else None
    eager_ms = f"{eager['measured_step_ms']:.3f}" if eager else "-"
    if status != "ok":
        return f"| {name} | refused: {reason(rest[0])} | {eager_ms} | | |"
    z = load(rest[0])
    zs_ms = z["cuda"]["measured_step_ms"]
    return (f"| {name} | {zs_ms:.3f} | {eager_ms} | {ratio(eager['measured_step_ms'], zs_ms)} | "
            f"{checksum_error(z['checksums'], eager['graphs']):.2e} |")


def main(rows_path: str, device_path: str) -> int:
    with open(device_path) as f:
        device = f.read().strip().splitlines()
    replay, numeric = [], []
    with open(rows_path) as f:
        for line in f:
            kind, name, sched, status, *rest = line.rstrip("\n").split("\t")
            if kind == "replay":
                replay.append(replay_row(name, sched, status, rest))
            else:
                numeric.append(numeric_row(name, status, rest))
    print("# zerosched on the GPU: replay and numeric mode\n")
    print("\n".join(f"    {d}" for d in device))
    print("\n## Replay (`zerosched run --executor cuda --replay`)\n")
    print("Step times in ms (events, median of 2 steps after a warm-up), peaks in GiB per rank.\n")
    print("| program | scheduler | measured step | simulated step | measured/simulated | exposed comm | "
          "simulated exposed | pool peak | simulated peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(replay))
    print("\n## Numeric mode against PyTorch eager (same exported graph, same inputs, one GPU)\n")
    print("Step times in ms; speed = eager / zerosched; error = largest checksum difference "
          "(an output's sum or absolute sum) relative to eager's absolute sum.\n")
    print("| program | zerosched step | eager step | speed | error |")
    print("|---|---|---|---|---|")
    print("\n".join(numeric))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
