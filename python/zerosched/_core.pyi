"""zerosched's Rust core in-process (see docs/python.md)."""

from typing import Any, TypedDict

__version__: str

class ZeroschedError(Exception):
    """A document, option or schedule zerosched refuses; the message is the command line's."""

class OverBudgetError(ZeroschedError):
    """No schedule fits the budget."""

    needed: int
    """The smallest budget that works, in bytes."""

class ScheduleOptions(TypedDict, total=False):
    budget: int | str | None
    world_size: int
    scheduler: str
    cost: dict[str, Any]
    disable: list[str]
    verify: bool

class CheckOptions(TypedDict, total=False):
    budget: int | str | None
    world_size: int

def schedule(data: bytes, options: ScheduleOptions | None = None) -> tuple[bytes, str]:
    """Schedules an fx-graph v1 graph or program (JSON, gzip JSON or binary).

    Returns the scheduled document as fx-graph v1 JSON (a graph for a graph, a bundle for a
    bundle) and the report JSON of `zerosched schedule --report`.
    """

def check(data: bytes, options: CheckOptions | None = None) -> str:
    """Verifies a document and checks its schedule if it has one; returns the summary JSON."""

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
