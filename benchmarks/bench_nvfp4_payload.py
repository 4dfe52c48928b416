"""How fast is the nvfp4 dispatch payload encoded? The native quantizer against the spec and the copy ceiling.

    python benchmarks/bench_nvfp4_payload.py --tokens 4096 16384 32768 --hidden 7168

For BF16 tokens [T, H] -> NVFP4 byte rows [T, H/2 + H/16 + 4] (``ops.quantize_nvfp4_rows``: a pass
for the tensor amax, then the rows), and for comparison the MXFP4 rows of the same tokens
(``ops.quantize_mxfp4_rows``, one pass) and the spec (``formats.quantize_nvfp4`` + row packing, eager,
and with the quantizer under ``torch.compile``). Then the receive side: those rows to FP8 1x128
(``ops.nvfp4_rows_to_fp8_blockwise`` against the spec's decode + quantization, and the MXFP4 rows'
``ops.mxfp4_rows_to_fp8_blockwise`` for comparison). Timing as ``moe_fp4.ops.bench``: median of CUDA-event
times, inputs rotated over sets larger than 3x L2. GB/s counts the bytes the op must move once (BF16 read once,
rows written), so the NVFP4 rows' second read of the input (the amax pass) shows as a lower share of
the copy ceiling, measured in the same run.

With ``--torchao`` (torchao installed), torchao's NVFP4 quantizer on the same tokens for comparison:
``torch.compile`` of the tensor amax, ``per_tensor_amax_to_scale`` and ``nvfp4_quantize`` (its
non-Triton path; the Triton one needs the MSLK package). Its numerics differ from the spec's (it
multiplies by a reciprocal scale and clamps block scales below at E4M3's smallest subnormal), so only
the time and the share of equal packed bytes are reported.
"""

from __future__ import annotations

import argparse
import datetime

import torch

from moe_fp4 import formats, ops
from moe_fp4.ops.bench import _device_line, _median_us, _sets, copy_ceiling_gbs


def _spec_rows(x: torch.Tensor) -> torch.Tensor:
    return formats.pack_nvfp4_rows(*formats.quantize_nvfp4(x))


def _torchao_quantizer():
    """torch.compile of torchao's NVFP4 quantization with a tensor scale from the amax, or None."""
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except Exception as e:  # noqa: BLE001  (torchao missing or incompatible with this torch)
        print(f"torchao: not available ({type(e).__name__}: {e})")
        return None

    def quantize(x):
        scale = per_tensor_amax_to_scale(x.abs().amax())
        return nvfp4_quantize(x, 16, scale)

    return torch.compile(quantize, dynamic=False)


def _bench_shape(t: int, h: int, reps: int, ceiling: float, compiled, eager: bool, torchao=None) -> None:
    ns = _sets(t * h * 2)
    xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(ns)]
    assert torch.equal(ops.quantize_nvfp4_rows(xs[0]), _spec_rows(xs[0])), "native rows differ from the spec"
    shape = f"T={t} H={h}"

    def row(name, us, out_bytes, eager_us=None, compiled_us=None):
        gbs = (t * h * 2 + out_bytes) / us / 1e3
        e = f"{eager_us / us:.1f}x" if eager_us else ""
        c = f"{compiled_us / us:.1f}x" if compiled_us else ""
        print(f"| {name} | {shape} | {us:.1f} | {gbs:.0f} | {100 * gbs / ceiling:.1f} | {e} | {c} |", flush=True)

    us = _median_us(lambda i: ops.quantize_nvfp4_rows(xs[i]), ns, reps)
    eager_us = _median_us(lambda i: _spec_rows(xs[i]), ns, reps=10, batch=5) if eager else None
    compiled_us = None
    if compiled is not None:
        assert torch.equal(compiled(xs[0]), _spec_rows(xs[0])), "compiled spec differs from the eager spec"
        compiled_us = _median_us(lambda i: compiled(xs[i]), ns, reps)
    row("nvfp4 rows (ops.quantize_nvfp4_rows)", us, t * formats.nvfp4_row_bytes(h), eager_us, compiled_us)
    us = _median_us(lambda i: ops.quantize_mxfp4_rows(xs[i]), ns, reps)
    row("mxfp4 rows (ops.quantize_mxfp4_rows)", us, t * formats.mxfp4_row_bytes(h))
    # the receive side: the rows to FP8 1x128 (GB/s: rows read, E4M3 and scales written)
    rows = [ops.quantize_nvfp4_rows(x) for x in xs]
    got = ops.nvfp4_rows_to_fp8_blockwise(rows[0], h)
    want = formats.quantize_fp8_blockwise(formats.dequantize_nvfp4_rows(*formats.unpack_nvfp4_rows(rows[0], h)),
                                          block=(1, formats.FP8_GROUP))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want)), \
        "native FP8 conversion differs from the spec"
    moved = t * formats.nvfp4_row_bytes(h) + t * h + t * (h // formats.FP8_GROUP) * 4
    us = _median_us(lambda i: ops.nvfp4_rows_to_fp8_blockwise(rows[i], h), ns, reps)
    spec_us = _median_us(lambda i: formats.quantize_fp8_blockwise(formats.dequantize_nvfp4_rows(
        *formats.unpack_nvfp4_rows(rows[i], h)), block=(1, formats.FP8_GROUP)), ns, reps=5, batch=2) if eager else None
    gbs = moved / us / 1e3
    e = f"{spec_us / us:.1f}x" if spec_us else ""
    print(f"| nvfp4 rows -> FP8 1x128 (ops.nvfp4_rows_to_fp8_blockwise) | {shape} | {us:.1f} | {gbs:.0f} | "
          f"{100 * gbs / ceiling:.1f} | {e} | |", flush=True)
    mx_rows = [ops.quantize_mxfp4_rows(x) for x in xs]
    us = _median_us(lambda i: ops.mxfp4_rows_to_fp8_blockwise(mx_rows[i], h), ns, reps)
    moved = t * formats.mxfp4_row_bytes(h) + t * h + t * (h // formats.FP8_GROUP) * 4
    print(f"| mxfp4 rows -> FP8 1x128 (ops.mxfp4_rows_to_fp8_blockwise) | {shape} | {us:.1f} | "
          f"{moved / us / 1e3:.0f} | {100 * moved / us / 1e3 / ceiling:.1f} | | |", flush=True)
    if torchao is not None:
        _, data = torchao(xs[0])
        ours = formats.unpack_nvfp4_rows(ops.quantize_nvfp4_rows(xs[0]), h)[0]
        same = (data.view(torch.uint8).reshape(ours.shape) == ours).float().mean().item()
        us = _median_us(lambda i: torchao(xs[i]), ns, reps)
        row(f"torchao nvfp4_quantize, compiled ({100 * same:.1f}% of packed bytes equal)", us,
            t * (h // 2 + h // 16))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the spec")
    ap.add_argument("--torchao", action="store_true", help="also time torchao's NVFP4 quantizer")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    ceiling = copy_ceiling_gbs()
    print(f"Device: {_device_line()}")
    print(f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; copy ceiling {ceiling:.0f} GB/s")
    print("| op | shape | µs | GB/s | % of copy | vs spec eager | vs spec compiled |")
    print("|---|---|---:|---:|---:|---:|---:|")
    compiled = None
    if not args.no_compile:  # the quantizer compiled; the row packing (a concatenation) eager
        quantize = torch.compile(formats.quantize_nvfp4, dynamic=False)

        def compiled(x):
            return formats.pack_nvfp4_rows(*quantize(x))
    torchao = _torchao_quantizer() if args.torchao else None
    for t in args.tokens:
        _bench_shape(t, args.hidden, args.reps, ceiling, compiled if t == args.tokens[0] else None,
                     eager=t == args.tokens[0], torchao=torchao)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
