"""zerosched's Rust core in-process (see docs/python.md)."""

from typing import Any, TypedDict

__version__: str

class ZeroschedError(Exception):
    """A document, option or schedule zerosched refuses; the message is the command line's."""

class OverBudgetError(ZeroschedError):
    """No schedule fits the budget."""

    needed: int
    """The smallest budget that works for the whole program, in bytes."""

    kind: str
    """Which budget ``needed`` is for: ``"budget"`` (gathered bytes) or ``"memory"``."""

class ScheduleOptions(TypedDict, total=False):
    budget: int | str | None
    memory: int | str | None
    world_size: int
    scheduler: str
    cost: dict[str, Any]
    disable: list[str]
    verify: bool

class CheckOptions(TypedDict, total=False):
    budget: int | str | None
    memory: int | str | None
    cost: dict[str, Any]
    world_size: int

def schedule(data: bytes, options: ScheduleOptions | None = None) -> tuple[bytes, str]:
    """Schedules an fx-graph v1 graph or program (JSON, gzip JSON or binary).

    Returns the scheduled document as fx-graph v1 JSON (a graph for a graph, a bundle for a
    bundle) and the report JSON of `zerosched schedule --report`.
    """

def check(data: bytes, options: CheckOptions | None = None) -> str:
    """Verifies a document and checks its schedule if it has one; returns the summary JSON."""

class CostOptions(TypedDict, total=False):
    world_size: int
    cost: dict[str, Any]

def simulate(data: bytes, options: CostOptions | None = None) -> str:
    """Simulates a document as it stands (scheduled or not); returns JSON
    `{"world_size": N, "simulation": ...}`, the simulation as `zerosched simulate --report`
    writes it."""

def compute_costs(data: bytes, options: CostOptions | None = None) -> str:
    """Each node's compute-stream time in ms, as the simulator prices it: JSON, one
    `{"graph": name, "ms": {node: ms}}` per graph in program order."""

def collective_ms(kind: str, nbytes: int, options: CostOptions | None = None) -> float:
    """Time of one `all_gather`, `reduce_scatter` or `all_reduce` of `nbytes` (the full
    message), ms."""

class RunOptions(TypedDict, total=False):
    world_size: int
    seed: int

def run(
    data: bytes, inputs: bytes, options: RunOptions | None = None
) -> list[list[list[tuple[str, list[int], bytes] | None]]]:
    """Runs a document on the CPU executor (`zerosched.run` wraps it with tensors).

    `inputs` is a safetensors document (empty: every input drawn from the seed). Returns per
    graph, per rank, each output as (dtype name, shape, little-endian elements: floating
    dtypes in their own width, integers as int64, bool as one byte), or None.
    """
