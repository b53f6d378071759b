"""A pool of processes joined in one process group (gloo, or NCCL with a GPU each), reused
across test cases.

``Ranks.run(fn, *args)`` runs the module-level function ``fn`` on every rank and returns the
results in rank order; an exception on any rank is raised here with that rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

# A cold Inductor compile of a training step takes about 4 minutes on 2 idle cores, and has
# taken over 10 on loaded ones.
TIMEOUT_S = 1200


def _worker(rank: int, world: int, backend: str, store: str, jobs, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share a small machine
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Ranks:
    def __init__(self, world: int = 2, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        fd, self.store = tempfile.mkstemp(prefix="zerosched-store-")
        os.close(fd)
        os.remove(self.store)
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, backend, self.store, self.jobs[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any) -> list[Any]:
        for q in self.jobs:
            q.put((fn, args))
        out: list[Any] = [None] * self.world
        errors = []
        for _ in range(self.world):
            rank, ok, value = self.results.get(timeout=TIMEOUT_S)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return out

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(self.store):
            os.remove(self.store)
