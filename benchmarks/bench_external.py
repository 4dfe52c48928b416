"""The native quantizers against torchao's on the same GPU, inputs and timing method.

    python benchmarks/bench_external.py --tokens 4096 32768 --hidden 7168 --out DIR

Pairs (same input, same output format unless said):
  * BF16 -> MXFP4 rows (E2M1 + UE8M0 per 32, scale rounded up): ``moe_fp4.ops.quantize_mxfp4`` vs
    ``torch.compile`` of torchao's ``to_mx(..., float4_e2m1fn_x2, 32, RCEIL)``; the outputs are also
    compared bit for bit (RCEIL is our "up" rule).
  * BF16 -> FP8 E4M3 1x128: ``moe_fp4.ops.quantize_fp8_blockwise`` (power-of-two scales) vs torchao's
    Triton ``triton_fp8_blockwise_act_quant_lhs`` (scales amax/448, not powers of two: same traffic,
    different numbers, so no bitwise comparison).
  * For scale, torchao's Triton BF16 -> MXFP8 kernels along rows (dim0) and along columns (dim1,
    transposing): the same kind of work with a larger output.
Timing: ``moe_fp4.ops.bench`` (median of CUDA-event times, inputs rotated over sets larger than 3x
L2), GB/s counting each op's bytes read and written once, against the copy ceiling measured in the
same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import warnings
from pathlib import Path

import torch

from moe_fp4 import ops
from moe_fp4.ops.bench import _device_line, _median_us, _sets, copy_ceiling_gbs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_external.py needs a CUDA GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao
        from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_act_quant_lhs
        from torchao.prototype.mx_formats.kernels import triton_to_mxfp8_dim0, triton_to_mxfp8_dim1
        from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    ceiling = copy_ceiling_gbs()
    rows = []

    def add(op, impl, shape, us, nbytes, note=""):
        gbs = nbytes / us / 1e3
        rows.append(dict(op=op, impl=impl, shape=shape, us=us, gbs=gbs, pct=100 * gbs / ceiling, note=note))
        print(f"{op:24s} {impl:40s} {shape:16s} {us:9.1f} us {gbs:7.0f} GB/s {100 * gbs / ceiling:5.1f}% {note}",
              flush=True)

    tao_fp4 = torch.compile(lambda x: to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL),
                            dynamic=False)
    h = args.hidden

    def bench_shape(t):
        shape = f"T={t} H={h}"
        n_in = t * h * 2
        ns = _sets(n_in)
        xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16) * 2.0 ** (i % 7 - 3) for i in range(ns)]

        fp4_bytes = t * h // 2 + t * h // 32
        packed, scales = ops.quantize_mxfp4(xs[0])
        ref_scales, ref_packed = tao_fp4(xs[0])
        same = torch.equal(packed, ref_packed.view(torch.uint8)) and torch.equal(scales, ref_scales.view(torch.uint8))
        note = "bitwise equal to torchao" if same else "DIFFERS from torchao"
        add("BF16 -> MXFP4", "moe_fp4.ops.quantize_mxfp4", shape,
            _median_us(lambda i: ops.quantize_mxfp4(xs[i]), ns, args.reps), n_in + fp4_bytes, note)
        add("BF16 -> MXFP4", "torchao to_mx RCEIL, torch.compile", shape,
            _median_us(lambda i: tao_fp4(xs[i]), ns, args.reps), n_in + fp4_bytes)

        fp8_bytes = t * h + t * h // 128 * 4
        add("BF16 -> FP8 1x128", "moe_fp4.ops.quantize_fp8_blockwise", shape,
            _median_us(lambda i: ops.quantize_fp8_blockwise(xs[i]), ns, args.reps), n_in + fp8_bytes)
        add("BF16 -> FP8 1x128", "torchao triton_fp8_blockwise_act_quant_lhs", shape,
            _median_us(lambda i: triton_fp8_blockwise_act_quant_lhs(xs[i], 128), ns, args.reps), n_in + fp8_bytes,
            "scales amax/448")

        mxfp8_bytes = t * h + t * h // 32
        for op, impl, fn, note in (("BF16 -> MXFP8 rows", "torchao triton_to_mxfp8_dim0", triton_to_mxfp8_dim0, ""),
                                   ("BF16 -> MXFP8 columns", "torchao triton_to_mxfp8_dim1", triton_to_mxfp8_dim1,
                                    "transposing")):
            try:
                fn(xs[0], 32, "rceil")
            except (AssertionError, RuntimeError) as e:  # torchao gates these kernels by torch/GPU version
                print(f"{impl}: not available here ({type(e).__name__}: {e})", flush=True)
                continue
            add(op, impl, shape, _median_us(lambda i, fn=fn: fn(xs[i], 32, "rceil"), ns, args.reps),
                n_in + mxfp8_bytes, note)

    for t in args.tokens:
        bench_shape(t)
        torch.cuda.empty_cache()

    result = dict(ceiling_gbs=ceiling, rows=rows, device=_device_line(), torchao=torchao.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    lines = [f"Device: {result['device']}; torchao {result['torchao']}. Date: {result['date']}. "
             f"Copy ceiling {ceiling:.0f} GB/s (read + write).", "",
             "| op | implementation | shape | µs | GB/s | % of copy | note |", "|---|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['op']} | {r['impl']} | {r['shape']} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct']:.1f} "
              f"| {r['note']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "external.md").write_text(text)
        (args.out / "external.json").write_text(json.dumps(result, indent=1))
    return 0 if all("DIFFERS" not in r["note"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
