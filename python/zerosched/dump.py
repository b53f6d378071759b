"""Graphs dumped from a real run, each reproducible by the command line (docs/export.md).

``zerosched.backend(..., dump="dir/")``, ``ZEROSCHED_DUMP=dir`` and
``zerosched.deepspeed.install(dump=...)`` write every graph that they schedule, under
``dir/rank<R>/``, as four files named after the graph:

* ``<graph>.json`` -- the fx-graph v1 document exactly as it was scheduled;
* ``<graph>.options.json`` -- the options it was scheduled with;
* ``<graph>.scheduled.json`` -- the scheduled document the run used;
* ``<graph>.report.json`` -- zerosched's report;

and ``replay.sh``, which runs ``zerosched schedule`` on each graph with its options and
compares the output with ``<graph>.scheduled.json`` byte for byte.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from typing import Any

#: The environment variable that turns dumping on for every backend of the process.
ENV = "ZEROSCHED_DUMP"

#: Option keys and the flags of ``zerosched schedule`` that take them.
_FLAGS = {"budget": "--budget", "memory": "--memory", "world_size": "--world-size", "scheduler": "--scheduler"}


def resolve(dump: str | os.PathLike | None) -> "Dumper | None":
    """A dumper into ``dump``, or into ``$ZEROSCHED_DUMP`` when ``dump`` is None; None if neither."""
    root = dump if dump is not None else os.environ.get(ENV) or None
    return None if root is None else Dumper(os.fspath(root))


def _write(path: str, data: bytes) -> None:
    """Whole or not at all: a temporary file beside ``path``, renamed."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _budget(b: Any) -> str:
    if isinstance(b, float) and b.is_integer():
        return str(int(b))
    return str(b)


def command_args(options: dict, graph: str, output: str) -> list[str]:
    """The ``zerosched schedule`` arguments that schedule ``graph`` as ``options`` say.  A cost
    model is read from ``<graph stem>.cost.json``, which :meth:`Dumper.write` writes beside it."""
    unknown = set(options) - set(_FLAGS) - {"cost", "disable"}
    if unknown:
        raise ValueError(f"options {sorted(unknown)} have no `zerosched schedule` flag")
    args = ["schedule", graph]
    for key, flag in _FLAGS.items():
        if options.get(key) is not None:
            args += [flag, _budget(options[key]) if key in ("budget", "memory") else str(options[key])]
    if options.get("cost") is not None:
        args += ["--cost", graph[: -len(".json")] + ".cost.json"]
    for name in options.get("disable", []):
        args += ["--disable", name]
    return args + ["-o", output]


class Dumper:
    """Writes the graphs of this process under ``root/rank<R>/``, the rank of the default
    process group (0 outside a distributed run)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._names: dict[str, list[str]] = {}  # rank directory -> graphs dumped, in order

    def _dir(self) -> str:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        d = os.path.join(self.root, f"rank{rank}")
        os.makedirs(d, exist_ok=True)
        return d

    def compiled(self, doc: dict, options: dict, result: tuple[bytes, str]) -> str:
        """Dumps a graph the backend compiled, with the schedule it got.  A schedule served from
        the backend's cache was made for an identical graph that may have had another name: the
        graph is then scheduled again here, which gives the same schedule under its own name."""
        from . import _core, export

        data = export.dumps_graph(doc).encode()
        if json.loads(result[0]).get("name") != doc.get("name"):
            result = _core.schedule(data, options)
        return self.write(doc.get("name", "graph"), data, options, *result)

    def write(self, name: str, data: bytes, options: dict, scheduled: bytes, report: str) -> str:
        """Dumps one scheduled graph; returns its stem (``dir/rank0/forward_0``).  A name used
        before in this directory gets a suffix (``forward_0-1``): two backends of one process
        both number their graphs from 0."""
        d = self._dir()
        names = self._names.setdefault(d, [])
        stem, n = name, 0
        while stem in names:
            n += 1
            stem = f"{name}-{n}"
        names.append(stem)
        base = os.path.join(d, stem)
        _write(base + ".json", data)
        if options.get("cost") is not None:
            _write(base + ".cost.json", json.dumps(options["cost"], sort_keys=True, indent=1).encode() + b"\n")
        _write(base + ".options.json", json.dumps(options, sort_keys=True, indent=1).encode() + b"\n")
        _write(base + ".scheduled.json", scheduled)
        _write(base + ".report.json", report.encode())
        lines = ["#!/bin/sh", "# Schedules every dumped graph again and compares with what the run used.",
                 'set -e\ncd "$(dirname "$0")"\nZEROSCHED=${ZEROSCHED:-zerosched}']
        for s in names:
            with open(os.path.join(d, s + ".options.json")) as f:
                opts = json.load(f)
            args = command_args(opts, f"{s}.json", f"{s}.replayed.json")
            lines.append(f'"$ZEROSCHED" {shlex.join(args)} >/dev/null && cmp {s}.scheduled.json {s}.replayed.json')
        _write(os.path.join(d, "replay.sh"), ("\n".join(lines) + "\n").encode())
        os.chmod(os.path.join(d, "replay.sh"), 0o755)
        return base
