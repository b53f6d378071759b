"""zerosched's schedulers side by side with PyTorch's overlap scheduler, simulated with the same costs.

For each program (unscheduled fx-program JSON, gzip or not), ``zerosched.overlap`` runs
``torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing`` on every graph in
SimpleFSDP's form, with zerosched's cost model answering every runtime it asks for, and lays its
order and buckets onto zerosched's inserted graphs. zerosched's checker checks that schedule and
its simulator prices it; then ``prefetch``, ``jit`` and ``deepcompile`` schedule the same program
at the gathered-parameter budget PyTorch's schedule reached, and at one 10% tighter (where
PyTorch's scheduler is run again with its bytes in flight capped to fit, if it can).

One markdown table: per program, memory and scheduler, the simulated step over its lower bound,
exposed communication, peak gathered and peak device bytes (the simulator's, every value the
step holds), collectives coalescing two or more gathers and two or more gradient reductions,
scheduling time, and the checker's word.

    PYTHONPATH=python python python/bench_overlap.py [PROGRAM ...] [--world-size 8] [--no-bucketing]

With no program named: the fixtures' programs (tests/fixtures, tests/fixtures/families) and the 8-layer Llama-70B and 2-layer
Mixtral-8x7B benchmark programs of benches/data.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys
import time
import traceback
from dataclasses import dataclass

import torch

import zerosched
from zerosched import overlap

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_PROGRAMS = [
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "fixtures").glob("*.program.json")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "fixtures" / "families").glob("*.program.json.gz")),
    "benches/data/llama70b_l8.program.json.gz",
    "benches/data/mixtral8x7b_l2.program.json.gz",
    "benches/data/mixtral8x7b_l24.program.json.gz",
]
SCHEDULERS = ("prefetch", "jit", "deepcompile")
TIGHTER = 0.9
#: per program, a footnote to the table
NOTES: dict[str, str] = {}


@dataclass
class Row:
    program: str
    memory: str
    scheduler: str
    total: dict | None
    seconds: float
    check: str


def load(path: pathlib.Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def _check(document: bytes, limit: dict, world_size: int) -> str:
    try:
        zerosched.check(document, {"world_size": world_size, **limit})
        return "accepted"
    except zerosched.ZeroschedError as e:
        return "refused: " + " ".join(str(e).split())[:160]


def torch_row(name: str, memory: str, program: dict, args: argparse.Namespace, **options) -> Row:
    label = "pytorch"
    try:
        ts = overlap.schedule_program(program, world_size=args.world_size, bucketing=args.bucketing, **options)
    except AssertionError as e:
        if not args.bucketing:
            raise
        # PyTorch's bucketer refuses some graphs (its topological sort with the overlap
        # dependencies finds a cycle): a finding of the table; the row is then unbucketed.
        where = traceback.extract_tb(e.__traceback__)[-1]
        label = "pytorch, unbucketed*"
        NOTES[name] = (f"*{name}: PyTorch's bucketer fails (AssertionError in {where.name}, "
                       f"{pathlib.Path(where.filename).name}:{where.lineno}); PyTorch's rows are its schedule "
                       "without bucketing")
        ts = overlap.schedule_program(program, world_size=args.world_size, bucketing=False, **options)
    sim = json.loads(zerosched.simulate(ts.document, {"world_size": args.world_size}))["simulation"]["total"]
    return Row(name, memory, label, sim, ts.seconds, _check(ts.document, {}, args.world_size))


def zerosched_row(name: str, memory: str, data: bytes, scheduler: str, limit: dict, world_size: int) -> Row:
    t0 = time.perf_counter()
    try:
        out, report = zerosched.schedule(data, {"scheduler": scheduler, "world_size": world_size, **limit})
    except zerosched.OverBudgetError as e:
        return Row(name, memory, scheduler, None, time.perf_counter() - t0, f"no schedule: needs {e.needed:,} B")
    seconds = time.perf_counter() - t0
    return Row(name, memory, scheduler, json.loads(report)["simulation"]["total"], seconds,
               _check(out, limit, world_size))


@dataclass(frozen=True)
class Measure:
    """What the budgets bound: the option zerosched takes, and the simulator's peak it bounds."""

    option: str
    peak: str
    words: str


GATHERED = Measure("budget", "peak_gathered_bytes", "gathered")
DEVICE = Measure("memory", "peak_total_bytes", "device memory")


def device_memory_budget_exists() -> bool:
    """Whether this build's options take `memory` (issue 21 §1: the whole step's live bytes)."""
    empty = b'{"format": "fx-graph", "version": 1, "nodes": [{"name": "output", "op": "output", "args": [[]]}]}'
    try:
        zerosched.schedule(empty, {"memory": "1TiB"})
    except zerosched.ZeroschedError as e:
        return "unknown field `memory`" not in str(e)
    return True


def compare(path: str, args: argparse.Namespace) -> list[Row]:
    name = pathlib.Path(path).name.split(".")[0]
    program = load(ROOT / path if not pathlib.Path(path).is_absolute() else pathlib.Path(path))
    data = json.dumps(program).encode()
    m = args.measure
    first = torch_row(name, "", program, args)
    rows = [first]
    reached = first.total[m.peak]
    tight = int(reached * TIGHTER)
    at, below = f"PyTorch's, {_gib(reached)}", f"-10%, {_gib(tight)}"
    first.memory = at
    for s in SCHEDULERS:
        rows.append(zerosched_row(name, at, data, s, {m.option: reached}, args.world_size))
    # PyTorch's scheduler takes no budget in bytes; its cap on bytes in flight bounds what
    # prefetching adds (and with it memory). Halve it until the schedule fits, a few times at
    # most; then the same again with no growth allowed over its unscheduled peak.
    tighter = None
    for growth in ({}, {"max_memory_increase_gb": 0.0, "max_memory_increase_ratio": 0.0}):
        in_flight = first.total["peak_gathered_bytes"] / 2**30
        for _ in range(6):
            in_flight /= 2
            row = torch_row(name, below, program, args, max_in_flight_gb=in_flight, **growth)
            if row.total[m.peak] <= tight:
                row.scheduler += f", in flight ≤ {in_flight:.3g} GB" + (", no growth" if growth else "")
                tighter = row
                break
        if tighter:
            break
    rows.append(tighter or Row(name, below, "pytorch", None, 0.0,
                               "no schedule: no cap on bytes in flight or growth brings it under"))
    for s in SCHEDULERS:
        rows.append(zerosched_row(name, below, data, s, {m.option: tight}, args.world_size))
    return rows


def _gib(b: int) -> str:
    """Bytes in the largest binary unit that leaves at least 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.4g} {unit}"
    return f"{b} B"


def table(rows: list[Row], m: Measure) -> str:
    out = [f"| program | {m.words} budget | scheduler | step ms | step / bound | exposed comm ms | peak gathered "
           "| peak device | buckets (gathers + reductions) | scheduling s | checker |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    last = None
    for r in rows:
        prog = r.program if r.program != last else ""
        last = r.program
        if r.total is None:
            out.append(f"| {prog} | {r.memory} | {r.scheduler} | | | | | | | {r.seconds:.3f} | {r.check} |")
            continue
        t = r.total
        out.append(f"| {prog} | {r.memory} | {r.scheduler} | {t['step_ms']:.3f} | {t['ratio']:.3f} | {t['exposed_comm_ms']:.2f} "
                   f"| {_gib(t['peak_gathered_bytes'])} | {_gib(t['peak_total_bytes'])} | {t['buckets']} + {t['reduce_buckets']} "
                   f"| {r.seconds:.3f} | {r.check} |")
    return "\n".join(out)


def targets(rows: list[Row]) -> list[str]:
    """The issue's targets, per program: prefetch no slower than PyTorch at no more peak device
    memory; within 3% of the lower bound at the 10% tighter budget."""
    lines = []
    for prog in dict.fromkeys(r.program for r in rows):
        mine = [r for r in rows if r.program == prog]
        torch_r, pre, pre_tight = mine[0], mine[1], next(r for r in mine if r.scheduler == "prefetch" and r is not mine[1])
        if pre.total is None:
            lines.append(f"{prog}: prefetch has no schedule at PyTorch's peak")
            continue
        t, p = torch_r.total, pre.total
        faster = p["step_ms"] <= t["step_ms"] * (1 + 1e-9)
        less = p["peak_total_bytes"] <= t["peak_total_bytes"]
        tight = pre_tight.total["ratio"] if pre_tight.total else None
        lines.append(f"{prog}: prefetch {p['step_ms']:.3f} ms vs PyTorch {t['step_ms']:.3f} ms "
                     f"({'no slower' if faster else 'SLOWER'}), peak device {_gib(p['peak_total_bytes'])} vs "
                     f"{_gib(t['peak_total_bytes'])} ({'no more' if less else 'MORE'}); at -10%: "
                     + (f"{tight:.3f} of the bound ({'within' if tight <= 1.03 else 'OVER'} 3%)" if tight
                        else pre_tight.check))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("programs", nargs="*", default=DEFAULT_PROGRAMS)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--no-bucketing", dest="bucketing", action="store_false",
                    help="run PyTorch's scheduler without its overlap-preserving bucketing")
    ap.add_argument("--measure", choices=("auto", "gathered", "memory"), default="auto",
                    help="what the budgets bound: gathered parameter bytes (--budget), or the whole device "
                         "memory (--memory) where this build has it; auto: memory if it has")
    args = ap.parse_args()
    if args.measure == "auto":
        args.measure = "memory" if device_memory_budget_exists() else "gathered"
    args.measure = DEVICE if args.measure == "memory" else GATHERED
    rows = []
    # One fake process group for the run (PyTorch prefixes its log lines once per group made).
    with overlap.fake_process_group(args.world_size):
        for p in args.programs:
            print(f"{p} ...", file=sys.stderr, flush=True)
            rows += compare(p, args)
    print(f"torch {torch.__version__}, zerosched {zerosched.__version__}, world size {args.world_size}, "
          f"PyTorch bucketing {'on' if args.bucketing else 'off'}, budgets bound {args.measure.words}\n")
    print(table(rows, args.measure))
    print()
    for note in NOTES.values():
        print(note)
    print()
    print("\n".join(targets(rows)))


if __name__ == "__main__":
    main()
