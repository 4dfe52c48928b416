"""QuantLinear throughput per recipe against nn.Linear in BF16, the FP8 blockwise GEMM alone, and the
one-pass FP8 operand quantizers.

Question: what does each recipe cost per linear layer on this GPU? The MX / NVFP4 recipes are
emulated (spec quantize -> dequantize -> BF16 GEMM), so they measure the price of emulation, not
of FP4/FP8 hardware. The blockwise FP8 recipe runs real FP8 GEMMs (torch._scaled_mm): QuantLinear
takes FP8LinearFunction there (each tensor quantized once by a native kernel writing both FP8
copies); the row "per-GEMM quantization" runs QuantLinearFunction instead (each GEMM quantizes its
operands, the same bits), for comparison. Each recipe runs with its quantizers compiled
(``quantizer="compiled"``: the spec's functions through torch.compile, what "auto" does on CUDA) and,
unless --no-eager, eager (``quantizer="eager"``: the plain-PyTorch spec, about 150 kernels per
operand). The GEMM-only rows show what the FP8 tensor cores give once the operands are quantized;
the quantizer rows compare the one-pass quantizers with a device copy of the same bytes.

Timing: CUDA events, median of --reps after --warmup calls; forward and forward+backward of a
layer with BF16 input [M, K] and weight [N, K]; TFLOP/s counts 2*M*N*K per GEMM (3 GEMMs for
forward+backward). Peaks for the share column: H100/H200 SXM dense 989 TFLOP/s BF16, 1979 FP8.

Usage: python benchmarks/bench_quantlinear.py --out DIR [--shapes 4096x4096x4096,8192x8192x8192]
       python benchmarks/bench_quantlinear.py --out DIR --probe-layouts   (raw torch._scaled_mm, unpadded)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_fp4.formats import dequantize_fp8_blockwise, quantize_fp8_blockwise  # noqa: E402
from moe_fp4.recipes import (  # noqa: E402
    FP8BlockwiseRecipe,
    MXFP4Recipe,
    MXFP8Recipe,
    NVFP4Recipe,
    QuantLinear,
    fp8_blockwise_scaled_mm,
    scaled_mm_status,
)
from moe_fp4.recipes.compiled import compiled_status  # noqa: E402

PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H100/H200 SXM dense


GENERIC_FP8 = "FP8 blockwise (torch._scaled_mm, per-GEMM quantization)"


def cases(eager: bool = True):
    """Row label -> recipe (None: nn.Linear). "compiled": ``quantizer="compiled"`` (NVFP4 too, though
    "auto" keeps it eager; a kind whose first use differs from the eager spec falls back, and the JSON's
    ``compiled_status`` says so); "eager": the plain-PyTorch spec."""
    out = {"nn.Linear bf16": None}
    for quantizer in ("compiled", "eager") if eager else ("compiled",):
        g = {"gemm_dtype": "bfloat16", "quantizer": quantizer}
        out.update({
            f"MXFP8 (emulated, {quantizer})": MXFP8Recipe(**g),
            f"NVFP4 all techniques (emulated, {quantizer})": NVFP4Recipe(**g),
            f"MXFP4 (emulated, {quantizer})": MXFP4Recipe(**g),
            f"FP8 blockwise (emulated, {quantizer})": FP8BlockwiseRecipe(backend="emulate", **g),
            f"FP8 blockwise (torch._scaled_mm, {quantizer})": FP8BlockwiseRecipe(backend="scaled_mm", **g),
        })
    # QuantLinearFunction's per-GEMM operand quantization instead of FP8LinearFunction's one-pass
    # quantizers (the same bits; what the real FP8 layer ran before them), for comparison
    out[GENERIC_FP8] = FP8BlockwiseRecipe(backend="scaled_mm", gemm_dtype="bfloat16", quantizer="compiled")
    return out


DEVICE = "cuda"


def timed(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over reps CUDA-event-timed calls (wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def profile_table(fn, rows: int = 15) -> str:
    """torch.profiler table of one call of fn (after the timed calls, so nothing compiles), the
    operators sorted by their own GPU time (CPU time off a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)


def bench_layer(recipe, m, n, k, warmup, reps, profile_out: list | None = None, generic: bool = False):
    """(forward ms, forward+backward ms) of one layer; ``generic``: QuantLinearFunction even where
    QuantLinear would take FP8LinearFunction."""
    if generic:
        from moe_fp4.recipes import fp8_linear

        applies = fp8_linear.applies
        fp8_linear.applies = lambda *a: False
        try:
            return bench_layer(recipe, m, n, k, warmup, reps, profile_out)
        finally:
            fp8_linear.applies = applies
    if recipe is None:
        layer = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16)
    else:
        layer = QuantLinear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16, recipe=recipe)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        x.grad = None
        layer.weight.grad = None
        layer(x).backward(g)

    times = timed(fwd, warmup, reps), timed(fwd_bwd, warmup, reps)
    if profile_out is not None:
        profile_out.append(profile_table(fwd_bwd))
    return times


def bench_gemm_only(m, n, k, warmup, reps):
    """BF16 matmul vs the blockwise FP8 GEMM on pre-quantized operands (fprop and wgrad layouts)."""
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    out = {"bf16 matmul": timed(lambda: torch.matmul(x, w.t()), warmup, reps)}
    xa, sx = quantize_fp8_blockwise(x, block=(1, 128))
    wb, sw = quantize_fp8_blockwise(w, block=(128, 128))
    wr, swr = quantize_fp8_blockwise(w, block=(1, 128))
    for label, args in (("fp8 1x128 x 128x128 (fprop/dgrad)", (xa, sx, (1, 128), wb, sw, (128, 128))),
                        ("fp8 1x128 x 1x128 (wgrad)", (xa, sx, (1, 128), wr, swr, (1, 128)))):
        try:
            out[label] = timed(lambda a=args: fp8_blockwise_scaled_mm(*a), warmup, reps)
        except Exception as err:  # noqa: BLE001 - report whatever the GEMM raised
            out[label] = f"refused: {' '.join(str(err).split())[:300] or type(err).__name__}"
    one = torch.ones((), device=x.device)
    try:  # the plain FP8 GEMM (one scale per tensor): the tensor cores' FP8 rate, for reference
        out["fp8 tensorwise (reference)"] = timed(
            lambda: torch._scaled_mm(xa, wb.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), warmup, reps)
    except Exception as err:  # noqa: BLE001
        out["fp8 tensorwise (reference)"] = f"refused: {' '.join(str(err).split())[:200] or type(err).__name__}"
    return out


def bench_operand_quantizers(m, n, k, warmup, reps):
    """The one-pass FP8 operand quantizers of the real FP8 layer (BF16 x [M, K], W [N, K]) against a
    device copy moving the same bytes (read + write): (label, ms, GB/s, copy GB/s)."""
    from moe_fp4 import ops

    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for label, fn, moved in (
        ("x -> x, x^T (1x128 each)", lambda: ops.quantize_fp8_rows_cols(x), m * k * (2 + 2 + 8 / 128)),
        ("W -> W, W^T (128x128)", lambda: ops.quantize_fp8_tiles(w), n * k * (2 + 2)),
        ("x -> x (1x128, rows only)", lambda: ops.quantize_fp8_blockwise(x), m * k * (2 + 1 + 4 / 128)),
    ):
        ms = timed(fn, warmup, reps)
        half = int(moved // 2)
        src, dst = (torch.empty(half, dtype=torch.uint8, device=DEVICE) for _ in range(2))
        copy_ms = timed(lambda d=dst, s_=src: d.copy_(s_), warmup, reps)
        rows.append((label, ms, moved / ms / 1e6, 2 * half / copy_ms / 1e6))
    return rows


def probe_layouts() -> list[str]:
    """Raw ``torch._scaled_mm`` (no padding) for each scale layout and K/128 % 4, against
    dequantize-then-matmul: which layouts this torch / cuBLAS computes right without padding."""
    lines = ["| layout | M x N x K | K/128 % 4 | result |", "|---|---|---|---|"]
    for kb in (4, 5, 6, 7):
        k = 128 * kb
        a = torch.randn(256, k, device=DEVICE)
        b = torch.randn(384, k, device=DEVICE)
        da, sa = quantize_fp8_blockwise(a, block=(1, 128))
        ref_a = dequantize_fp8_blockwise(da, sa, block=(1, 128))
        for block in ((1, 128), (128, 128)):
            db, sb = quantize_fp8_blockwise(b, block=block)
            ref = ref_a @ dequantize_fp8_blockwise(db, sb, block=block).t()
            scale_b = sb.t().contiguous() if block == (1, 128) else sb.contiguous().t()
            try:
                out = torch._scaled_mm(da, db.t(), scale_a=sa.t().contiguous().t(), scale_b=scale_b,
                                       out_dtype=torch.bfloat16)
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                res = f"max error {err:.2e} of the largest value ({'right' if err < 2.0 ** -7 else 'WRONG'})"
            except Exception as err:  # noqa: BLE001 - report whatever the GEMM raised
                res = "refused: " + (" ".join(str(err).split())[:160] or type(err).__name__)
            lines.append(f"| 1x128 x {block[0]}x{block[1]} | 256x384x{k} | {kb % 4} | {res} |")
    return lines


def check_real_vs_emulated(r=512, c=384, length=640):
    """max |real - emulated| / max |emulated| of ``A @ B^T`` (A [r, L], B [c, L]) for the operand
    blocks of each GEMM: the same quantized operands, so only accumulation and the BF16 output differ."""
    torch.manual_seed(0)
    a = torch.randn(r, length, device=DEVICE)
    b = torch.randn(c, length, device=DEVICE)
    real, emu = FP8BlockwiseRecipe(backend="scaled_mm"), FP8BlockwiseRecipe(backend="emulate")
    res = {}
    for gemm in ("fprop", "dgrad", "wgrad"):
        try:
            e = emu.gemm_nt(a, b, gemm=gemm)
            res[gemm] = float((real.gemm_nt(a, b, gemm=gemm) - e).abs().max() / e.abs().max())
        except Exception as err:  # noqa: BLE001 - report whatever the GEMM raised
            res[gemm] = f"error: {' '.join(str(err).split())[:300] or type(err).__name__}"
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default="4096x4096x4096,8192x8192x8192", help="MxNxK list")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cpu", action="store_true", help="smoke run on the CPU (no real FP8 GEMM there)")
    p.add_argument("--no-eager", action="store_true", help="skip the eager-quantizer rows")
    p.add_argument("--probe-layouts", action="store_true", help="only the raw torch._scaled_mm layout probe")
    p.add_argument("--profile", action="store_true",
                   help="a torch.profiler table of one forward+backward of every row (bench_quantlinear_profile.md)")
    p.add_argument("--only", default="", help="comma-separated substrings: keep the recipe rows whose label "
                   "contains one of them (nn.Linear bf16 always runs)")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu for a smoke run)", flush=True)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe_layouts:
        text = "\n".join(probe_layouts()) + "\n"
        (args.out / "scaled_mm_layouts.md").write_text(text)
        print(text, flush=True)
        return 0
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "command": "python benchmarks/bench_quantlinear.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    results = {"meta": meta, "real_vs_emulated_rel_err": check_real_vs_emulated(), "layers": [], "gemm_only": []}
    print("real vs emulated FP8 blockwise:", results["real_vs_emulated_rel_err"], flush=True)
    lines = ["| M x N x K | recipe | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | vs nn.Linear bf16 (fwd+bwd) |",
             "|---|---|---|---|---|---|"]
    profiles: list[str] = []
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        flops = 2.0 * m * n * k
        base = None
        keep = [w for w in args.only.split(",") if w]
        for label, rec in cases(not args.no_eager).items():
            if rec is not None and keep and not any(w in label for w in keep):
                continue
            try:
                prof = [] if args.profile else None
                f, fb = bench_layer(rec, m, n, k, args.warmup, args.reps, prof, generic=label == GENERIC_FP8)
                if prof:
                    profiles.append(f"### {shape} {label}: one forward+backward\n\n```\n{prof[0]}\n```\n")
            except Exception as err:  # noqa: BLE001 - report whatever the layer raised
                msg = " ".join(str(err).split())[:300] or type(err).__name__
                print(f"{shape} {label} failed: {msg}", flush=True)
                lines.append(f"| {shape} | {label} | failed: {msg[:80]} | | | |")
                continue
            finally:
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            base = fb if rec is None else base
            ratio = f"{base / fb:.3f}x speed" if base else "—"
            lines.append(f"| {shape} | {label} | {f:.2f} | {fb:.2f} | {3 * flops / fb / 1e9:.0f} | {ratio} |")
            results["layers"].append({"shape": shape, "recipe": label, "fwd_ms": f, "fwd_bwd_ms": fb})
            print(lines[-1], flush=True)
        if DEVICE == "cuda":
            for label, ms, gbs, copy_gbs in bench_operand_quantizers(m, n, k, args.warmup + 2, max(args.reps, 10)):
                results.setdefault("quantizers", []).append(
                    {"shape": shape, "op": label, "ms": ms, "gb_s": gbs, "copy_gb_s": copy_gbs})
        g = bench_gemm_only(m, n, k, args.warmup + 2, max(args.reps, 10))
        results["gemm_only"].append({"shape": shape, **g})
        print(shape, g, flush=True)
    gl = ["| M x N x K | GEMM | ms | TFLOP/s | share of dense peak | vs bf16 matmul |", "|---|---|---|---|---|---|"]
    for row in results["gemm_only"]:
        m, n, k = (int(v) for v in row["shape"].split("x"))
        flops = 2.0 * m * n * k
        for label, ms in row.items():
            if label == "shape":
                continue
            if isinstance(ms, str):
                gl.append(f"| {row['shape']} | {label} | {ms} | | | |")
                continue
            peak = PEAK_TFLOPS["bf16" if label.startswith("bf16") else "fp8"]
            tf = flops / ms / 1e9
            gl.append(f"| {row['shape']} | {label} | {ms:.3f} | {tf:.0f} | {100 * tf / peak:.0f}% of {peak:.0f} | "
                      f"{row['bf16 matmul'] / ms:.2f}x |")
    results["scaled_mm_status"] = {k: (v if v is True else str(v)) for k, v in scaled_mm_status().items()}
    results["compiled_status"] = {k: (v if v is True else str(v)) for k, v in compiled_status().items()}
    ql = ["| M x N x K | operand quantizer | us | GB/s | share of a same-size copy |", "|---|---|---|---|---|"]
    for row in results.get("quantizers", []):
        ql.append(f"| {row['shape']} | {row['op']} | {1e3 * row['ms']:.1f} | {row['gb_s']:.0f} | "
                  f"{100 * row['gb_s'] / row['copy_gb_s']:.0f}% of {row['copy_gb_s']:.0f} |")
    text = "\n".join(lines) + "\n\n" + "\n".join(gl) + "\n"
    if len(ql) > 2:
        text += "\n" + "\n".join(ql) + "\n"
    (args.out / "bench_quantlinear.md").write_text(text)
    if profiles:
        (args.out / "bench_quantlinear_profile.md").write_text("\n".join(profiles))
    (args.out / "bench_quantlinear.json").write_text(json.dumps(results, indent=1))
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
