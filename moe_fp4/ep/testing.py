"""A pool of worker processes joined in a torch.distributed group, for multi-rank tests.

Spawning processes costs seconds each (every worker imports torch), so one pool is started per
test module and runs many cases. Each worker joins the default group (gloo on CPU, NCCL with one GPU
per rank) and also builds sub-groups of the first n ranks for every n from 2 to the world size, so
cases run on 2, 3 and 4 ranks without new processes, plus a two-rank group with a short timeout
for cases that test what happens when a peer never arrives.

    pool = WorkerPool(4)                        # gloo
    results = pool.run(case_fn, seed, ranks=3)  # case_fn(ctx, seed) on ranks 0..2; returns per rank
    pool.close()

A case is a module-level function ``fn(ctx, *args)`` (picklable by name); ``ctx`` is a CaseContext.
An exception in any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.multiprocessing as mp


@dataclass
class CaseContext:
    rank: int
    world_size: int
    group: object  # the process group of the first world_size ranks
    device: torch.device
    backend: str
    short_timeout_group: object  # ranks 0 and 1, collective timeout ``short_timeout_s``
    short_timeout_s: float


def _worker(rank, world, backend, init_file, tasks, results, timeout_s, short_timeout_s, threads):
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        groups = {n: (dist.group.WORLD if n == world else dist.new_group(list(range(n)))) for n in range(2, world + 1)}
        short = dist.new_group([0, 1], timeout=timedelta(seconds=short_timeout_s)) if world >= 2 else None
        results.put((rank, "ready", None))
    except Exception:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, n = task
        if rank >= n:
            results.put((rank, "skip", None))
            continue
        ctx = CaseContext(rank, n, groups[n] if n > 1 else None, device, backend, short if rank < 2 else None,
                          short_timeout_s)
        try:
            results.put((rank, "ok", fn(ctx, *args)))
        except Exception:
            results.put((rank, "error", traceback.format_exc()))
    # Leave without tearing the groups down: a group whose collective timed out can block in its
    # destructor, and the process ends here anyway.
    results.close()
    results.join_thread()
    os._exit(0)


class WorkerPool:
    """``world_size`` spawned workers in one process group (``backend``: "gloo" or "nccl")."""

    def __init__(self, world_size: int, backend: str = "gloo", *, timeout_s: float = 60.0,
                 short_timeout_s: float = 2.0, threads: int = 1, start_timeout_s: float = 120.0):
        if world_size < 2:
            raise ValueError(f"world_size: expected at least 2 ranks, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="moe_fp4_pool_")
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, backend, init_file, self._tasks[r], self._results,
                                              timeout_s, short_timeout_s, threads), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = None
        self._collect(start_timeout_s, "start")

    def _collect(self, timeout_s: float, what: str) -> list:
        got: dict[int, tuple] = {}
        while len(got) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(got))
                self.broken = f"{what}: ranks {missing} did not answer within {timeout_s:.0f} s"
                self.close()
                raise TimeoutError(self.broken) from None
            got[rank] = (status, value)
        errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
        if errors:
            if what == "start":
                self.broken = "workers failed to start"
                self.close()
            raise AssertionError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [got[r][1] for r in range(self.world_size)]

    def run(self, fn, *args, ranks: int | None = None, timeout_s: float = 120.0) -> list:
        """Run ``fn(ctx, *args)`` on ranks 0..ranks-1 (default: all); returns their results."""
        if self.broken:
            raise RuntimeError(f"the worker pool is unusable: {self.broken}")
        n = self.world_size if ranks is None else ranks
        if not 2 <= n <= self.world_size:
            raise ValueError(f"ranks: expected 2..{self.world_size}, got {n}")
        for q in self._tasks:
            q.put((fn, args, n))
        return self._collect(timeout_s, getattr(fn, "__name__", "case"))[:n]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


__all__ = ["WorkerPool", "CaseContext"]
