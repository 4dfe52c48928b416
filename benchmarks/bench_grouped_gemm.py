"""How fast is the FP8 grouped GEMM of the experts (1x128 activation scales, 128x128 weight scales,
``moe_fp4.moe.grouped_gemm_fp8``) against torch's grouped GEMMs on the same GPU: FP8 with rowwise
scales (``torch._scaled_grouped_mm``, a coarser scaling than ours) and BF16 (``torch._grouped_mm``).
DeepSeek-V3 expert shapes: gate+up (N 4096, K 7168) and down (N 7168, K 2048), G groups of R rows.
CUDA-event medians; TFLOP/s = 2 M N K / time.

    python benchmarks/bench_grouped_gemm.py [--groups 16] [--rows 2048] [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moe_fp4 import formats
from moe_fp4.moe import grouped_gemm_fp8


def _time(fn, iters):
    for _ in range(3):
        fn()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def _row(n: int, k: int, g: int, r: int, iters: int) -> str:
    m = g * r
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(g, n, k, device="cuda") * 0.02
    a, a_s = formats.quantize_fp8_blockwise(x)
    wq, w_s = formats.quantize_fp8_blockwise(w, block=(128, 128))
    offs = torch.arange(g, device="cuda") * r
    lens = torch.full((g,), r, device="cuda")
    flop = 2 * m * n * k
    ours = _time(lambda: grouped_gemm_fp8(a, a_s, wq, w_s, offs, lens, validate=False), iters)
    ends = ((torch.arange(g, device="cuda") + 1) * r).to(torch.int32)
    cells = []
    try:
        xr, wr = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        sa, sb = torch.ones(m, device="cuda"), torch.ones(g, n, device="cuda")
        t = _time(lambda: torch._scaled_grouped_mm(xr, wr.transpose(-2, -1), sa, sb, offs=ends,
                                                   out_dtype=torch.bfloat16), iters)
        cells.append(f"{t:.0f} | {flop / t / 1e6:.0f}")
    except Exception as e:  # noqa: BLE001 (reported in the table)
        cells.append(f"unavailable ({type(e).__name__}) | -")
    try:
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        t = _time(lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=ends, out_dtype=torch.bfloat16), iters)
        cells.append(f"{t:.0f} | {flop / t / 1e6:.0f}")
    except Exception as e:  # noqa: BLE001
        cells.append(f"unavailable ({type(e).__name__}) | -")
    return f"| ({n}, {k}) | {ours:.0f} | {flop / ours / 1e6:.0f} | {cells[0]} | {cells[1]} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    g, r = args.groups, args.rows
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {g} groups of {r} rows, "
          f"medians of {args.iters}")
    print("| shape (N, K) | moe_fp4 FP8 1x128/128x128 us | TFLOP/s | torch FP8 rowwise us | TFLOP/s | "
          "torch BF16 us | TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, k in ((4096, 7168), (7168, 2048)):
        print(_row(n, k, g, r, args.iters))


if __name__ == "__main__":
    main()
