"""Running a function on every rank of a process group, as the benchmarks do: under torchrun (the
launcher's environment) or, started plainly, in one spawned process per GPU (NCCL) or per requested
CPU process (gloo), with a file rendezvous. Rank 0's return value comes back to the caller."""

from __future__ import annotations

import os
import tempfile

import torch


def run_distributed(run, args, backend: str, world: int | None = None) -> tuple[object, int, bool]:
    """(rank 0's ``run(args)``, world size, whether this process is rank 0 or the launcher).

    run: a module-level function (it is pickled into the spawned processes); backend: "nccl" or
    "gloo"; world: processes to spawn when not under torchrun (default: the visible GPUs for NCCL,
    2 for gloo). Under torchrun every rank runs ``run`` and gets its own result."""
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            result = run(args)
            return result, dist.get_world_size(), dist.get_rank() == 0
        finally:
            dist.destroy_process_group()
    import torch.multiprocessing as mp

    world = world or (torch.cuda.device_count() if backend == "nccl" else 2)
    if world < 1:
        raise ValueError(f"world: no process to run (backend {backend!r}, {world} processes)")
    with tempfile.TemporaryDirectory() as d:
        result_file = os.path.join(d, "result.pt")
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), backend, run, args, result_file), nprocs=world,
                 join=True)
        return torch.load(result_file, weights_only=False), world, True


def _worker(rank, world, init_file, backend, run, args, result_file):
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = run(args)
        if rank == 0:
            torch.save(result, result_file)
    finally:
        dist.destroy_process_group()


__all__ = ["run_distributed"]
