"""The SM budget of the dispatch and combine kernels: ``Buffer(num_sms=N)`` / ``Buffer.set_num_sms``
(DeepEP's ``Buffer.set_num_sms``), so that expert compute on other streams finds free SMs.

num_sms = N bounds the grid of every kernel the payload exchange launches to the warps that N SMs
hold (``warps_per_sm``: 64 on Hopper): a kernel of 4-warp programs launches at most 16 N of them, one
of 256-thread blocks at most 8 N. A kernel with more work than that loops over it (each program takes
work items p, p + grid, p + 2 grid, ...), so the bits do not depend on N. The hardware's block
scheduler may still place those warps on more than N SMs, beside other work. None (the default): no
bound, each kernel sizes its grid by its work (what the results in benchmarks/ measured).

Not bounded: NCCL's own kernels (the all-to-all of the nccl backend and of the count exchange), the
layout kernels of ``ops.routing``, torch's copies and fills, and the native kernels that take no grid
cap (the mxfp4 -> FP8 conversion of received rows, ``ops.mxfp4_rows_expand_fp8_blockwise``, and the
encode of combine partials for the fp8/mxfp4 wires).
"""

from __future__ import annotations

import torch

NATIVE_WARPS = 8  # warps per thread block of the native multi-destination kernels (256 threads)
TRITON_WARPS = 4  # warps per program of the ep Triton kernels (their num_warps)
_HOPPER_WARPS_PER_SM = 64  # the resident warps of an SM where no device says (the CPU interpreter)
_WARPS_PER_SM: dict = {}


def check_num_sms(num_sms, name: str = "num_sms") -> int | None:
    """num_sms, checked: None or a positive int (ValueError naming ``name`` otherwise)."""
    if num_sms is None:
        return None
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{name}: expected None (no bound) or a positive int (SMs), got {num_sms!r}")
    return num_sms


def warps_per_sm(device) -> int:
    """The warps one SM of ``device`` holds (its threads per SM / 32; 64 off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _HOPPER_WARPS_PER_SM
    if device not in _WARPS_PER_SM:
        props = torch.cuda.get_device_properties(device)
        _WARPS_PER_SM[device] = getattr(props, "max_threads_per_multi_processor", 32 * _HOPPER_WARPS_PER_SM) // 32
    return _WARPS_PER_SM[device]


def max_blocks(num_sms: int | None, warps_per_block: int, device) -> int | None:
    """The most thread blocks of ``warps_per_block`` warps a kernel on ``device`` may launch under
    num_sms (None: no bound)."""
    if num_sms is None:
        return None
    return max(1, num_sms * warps_per_sm(device) // warps_per_block)


def max_programs(num_sms: int | None, device, num_warps: int = TRITON_WARPS) -> int | None:
    """max_blocks for a Triton kernel of ``num_warps`` warps per program."""
    return max_blocks(num_sms, num_warps, device)


def grid(work: int, limit: int | None) -> int:
    """The programs of a persistent-style launch over ``work`` items: all of them, or ``limit``."""
    return max(1, work if limit is None else min(work, limit))


__all__ = ["check_num_sms", "grid", "max_blocks", "max_programs", "warps_per_sm"]
