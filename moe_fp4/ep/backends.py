"""All-to-all backends: move uint8 rows between ranks.

``TorchDistributedBackend`` wraps ``torch.distributed.all_to_all_single`` (input/output split sizes
in rows); its device follows the process group: NCCL carries CUDA tensors, gloo CPU tensors.
``LocalBackend`` is the world of one process (no process group), where an all-to-all is a copy.

A gloo collective returns to its caller before gloo's worker thread has let go of the work and of
the tensors in it. A tensor whose last Python reference goes first is then freed by that thread,
which must take the GIL to do it; if the interpreter is shutting down by then, the thread is killed
inside C++ and the process aborts ("terminate called without an active exception"). So the backend
keeps its Python references until the worker has let go (microseconds: the work is complete).
"""

from __future__ import annotations

import atexit
import time

import torch

try:
    import torch.distributed as dist
except Exception:  # torch built without distributed support
    dist = None


class AllToAllBackend:
    """Interface: ``rank``, ``world_size``, ``device`` and ``all_to_all``."""

    name = "backend"
    rank = 0
    world_size = 1
    device = torch.device("cpu")

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None,
                   in_splits: list[int] | None) -> None:
        """out [sum(out_splits), ...] <- inp [sum(in_splits), ...]: rank r's block of inp goes to
        rank r, and block s of out comes from rank s. None splits mean equal blocks."""
        raise NotImplementedError


class LocalBackend(AllToAllBackend):
    """A single process: rank 0 of a world of one. all_to_all copies."""

    name = "local"

    def __init__(self, device: torch.device | str = "cpu"):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors get it
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def all_to_all(self, out, inp, out_splits, in_splits):
        if out.shape != inp.shape:
            raise ValueError(f"out: expected shape {tuple(inp.shape)}, got {tuple(out.shape)}")
        out.copy_(inp)


class TorchDistributedBackend(AllToAllBackend):
    """``all_to_all_single`` over a torch.distributed process group.

    group: the process group (None: the default group); device: where the tensors must live
    (default: the current CUDA device for NCCL, CPU for gloo and others)."""

    def __init__(self, group=None, device: torch.device | str | None = None):
        if dist is None or not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised; call init_process_group or use "
                             "LocalBackend")
        self.group = group
        self.name = str(dist.get_backend(group))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if self.name == "nccl"
                      else torch.device("cpu"))
        self.device = torch.device(device)
        self._peers = [r if group is None else dist.get_global_rank(group, r) for r in range(self.world_size)]

    def all_to_all(self, out, inp, out_splits, in_splits):
        if out.device.type != "cpu" or not _CAN_COUNT_USES:  # (NCCL: the watchdog owns the work's tensors)
            dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                   group=self.group)
            return
        held = [(out, out._use_count()), (inp, inp._use_count())]
        try:
            dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                   group=self.group)
        finally:
            wait_until_released(held)


# Tensor._use_count: the references to a tensor from C++ (a collective's work) and from its Python object
_CAN_COUNT_USES = hasattr(torch.Tensor, "_use_count")
RELEASE_WAIT_S = 5.0  # the longest a collective's tensors are waited for before they are kept until exit
_unreleased: list[list[tuple[torch.Tensor, int]]] = []  # kept until exit: their work outlived RELEASE_WAIT_S


def wait_until_released(held: list[tuple[torch.Tensor, int]], timeout_s: float = RELEASE_WAIT_S) -> bool:
    """Wait until every tensor of ``held`` (tensor, use count before the collective) is back at its count,
    i.e. the process group's worker threads have dropped the work that held it; sleeping, so that
    other threads run. Returns False (and keeps the tensors until exit) if that takes over timeout_s."""
    deadline = None
    while any(t._use_count() > n for t, n in held):
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout_s
        elif now > deadline:
            _unreleased.append(held)
            return False
        time.sleep(0)
    return True


@atexit.register
def _release_at_exit() -> None:
    # (atexit runs before the interpreter starts shutting down: the worker threads can still finish)
    pending = _unreleased[:]
    _unreleased.clear()
    for held in pending:
        wait_until_released(held)


def make_backend(group=None, backend=None) -> AllToAllBackend:
    """The backend for ``group``: an AllToAllBackend given as ``backend`` wins; the strings "nccl"/
    "gloo" check the group's backend; "symm" is the symmetric-memory backend over an NCCL group
    (moe_fp4.ep.symmetric); None follows the group (a LocalBackend when torch.distributed
    is not initialised and no group is given)."""
    if isinstance(backend, AllToAllBackend):
        return backend
    if backend not in (None, "nccl", "gloo", "local", "symm"):
        raise ValueError(f"backend: expected None, 'nccl', 'gloo', 'local', 'symm' or an AllToAllBackend, "
                         f"got {backend!r}")
    if backend == "local" or (group is None and (dist is None or not dist.is_initialized())):
        if backend not in (None, "local"):
            raise ValueError(f"backend: {backend!r} needs an initialised torch.distributed process group")
        return LocalBackend()
    if backend == "symm":
        from moe_fp4.ep.symmetric import SymmetricMemoryBackend

        return SymmetricMemoryBackend(group)
    b = TorchDistributedBackend(group)
    if backend is not None and b.name != backend:
        raise ValueError(f"backend: asked for {backend!r} but the process group uses {b.name!r}")
    return b


__all__ = ["AllToAllBackend", "LocalBackend", "TorchDistributedBackend", "make_backend"]
