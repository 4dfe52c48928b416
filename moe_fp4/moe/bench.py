"""`python -m moe_fp4 bench gemm`: the experts' FP8 grouped GEMMs and the expert MLP, against torch
and DeepGEMM on the same GPU in the same run.

DeepSeek-V3 expert shapes (hidden 7168, intermediate 2048: gate+up N 4096 x K 7168, down N 7168 x
K 2048); G experts over M rows, every expert's rows starting on a multiple of 128 (a dispatch with
expert_alignment 128); splits "uniform" (M/G each) or "skewed" (lengths drawn from a Zipf-like law,
the same total). Per GEMM:
  fprop   y = x @ w_g^T (FP8 1x128 rows x FP8 128x128 tiles, BF16 out): ``grouped_gemm_fp8``
  dgrad   dx = dy @ w_g (the same kernel on the transposed tiles)
  wgrad   dw_g = dy_g^T x_g (FP8 columns, one scale per 128 tokens of each column; float32 sums,
          BF16 out as torch's): ``grouped_gemm_fp8_wgrad``; wgrad-f32: the same with float32 out
          (beside DeepGEMM's k-grouped wgrad, which writes float32)
Columns: moe_fp4 (``grouped_gemm_fp8``: DeepGEMM where installed, else the Triton kernel); Triton (the
Triton rows kernel alone, fprop and dgrad); torch FP8 rowwise (``torch._scaled_grouped_mm``, one
scale per row of each operand: a coarser scaling than ours, the fastest FP8 grouped GEMM in torch on
Hopper; 128x128/1x128 block scales have none there); torch BF16 (``torch._grouped_mm``, BF16 out,
wgrad included: it takes no float32 output for BF16 operands); DeepGEMM
(``m_grouped_fp8_gemm_nt_contiguous`` and, for wgrad, ``k_grouped_fp8_gemm_nt_contiguous``, the
same scaling as ours) when ``deep_gemm`` imports and a small call of it succeeds in a child
process. TFLOP/s = 2 x (rows of the groups) x N x K / time; times are CUDA-event medians of one call
each, the calls queued by the host during a GPU sleep ahead of them (the kernel benchmark's method: as in
a training step, the host's work in a call overlaps the device's work on the calls before it; the host
time of a call shows only where it exceeds the device time).
Then the expert MLP (``Experts``) forward + backward per save policy against the same MLP on BF16
grouped GEMMs (torch._grouped_mm forward, dgrad and wgrad), and the FP8 ceiling of this GPU: one
dense ``torch._scaled_mm`` of 8192^3 with rowwise scales.
GPU goals: fprop >= 0.9 x torch FP8 rowwise; dgrad and wgrad >= 0.8 x; Experts fwd+bwd >= 1.5 x BF16.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import sys

import torch

from moe_fp4 import ops
from moe_fp4.moe import _deep_gemm, _triton_grouped_gemm
from moe_fp4.moe.experts import SAVE_POLICIES, Experts, _fp8_tiles
from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8, grouped_gemm_fp8_wgrad
from moe_fp4.ops.bench import device_median_us

HIDDEN, INTER = 7168, 2048
GOALS = {"fprop": 0.9, "dgrad": 0.8, "wgrad": 0.8}


def _median_us(fn, iters: int) -> float:
    return device_median_us(lambda i: fn(), 1, reps=iters, batch=iters)


def split_lengths(m: int, g: int, kind: str, seed: int = 0) -> list[int]:
    """G lengths, each a multiple of 128, summing to m (m a multiple of 128 x G for "uniform")."""
    if kind == "uniform":
        return [m // g] * g
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, g + 1, dtype=torch.float64) ** 1.1
    weights = weights[torch.randperm(g, generator=gen)]
    blocks = (weights / weights.sum() * (m // 128)).floor().long()
    blocks[int(weights.argmax())] += m // 128 - int(blocks.sum())
    return [int(b) * 128 for b in blocks]


def _try(fn, iters):
    try:
        return _median_us(fn, iters), ""
    except Exception as e:  # noqa: BLE001 (an unavailable comparison is reported in the table)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


_DEEP_GEMM_PROBE = """
import torch, deep_gemm
m, n, k = 256, 256, 256
a = (torch.zeros(m, k, device="cuda").to(torch.float8_e4m3fn), torch.ones(m, k // 128, device="cuda"))
b = (torch.zeros(2, n, k, device="cuda").to(torch.float8_e4m3fn), torch.ones(2, n // 128, k // 128, device="cuda"))
d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, torch.arange(m, device="cuda", dtype=torch.int32) // 128)
torch.cuda.synchronize()
"""


def _probe_deep_gemm(notes: set):
    """deep_gemm when it imports and a small grouped GEMM runs in a child process (a crash there
    must not end the benchmark), else None with the reason in notes (and grouped_gemm_fp8 kept off
    it for this run)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("deep_gemm") is None:
        return None
    res = subprocess.run([sys.executable, "-c", _DEEP_GEMM_PROBE], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1][:120]
        notes.add(f"DeepGEMM: its grouped GEMM fails on a small probe call (exit code {res.returncode}: {tail}); "
                  "not compared")
        _deep_gemm.disable()
        return None
    import deep_gemm

    return deep_gemm


def _gemm_rows(m, g, kind, iters, dg, seed=0):
    """Table rows for one split: fprop, dgrad, wgrad of both projections."""
    lens = split_lengths(m, g, kind, seed)
    out, notes = [], set()
    for proj, n, k in (("gate+up", 2 * INTER, HIDDEN), ("down", HIDDEN, INTER)):
        for op, shape, flop, cells, errs in _projection(m, g, lens, n, k, iters, dg, seed):
            out.append((kind, g, m, proj, op, shape, flop, cells))
            notes |= errs
        torch.cuda.empty_cache()
    return out, notes


def _projection(m, g, lens, n, k, iters, dg, seed):
    """(op, (N, K) of the op, flop, [moe_fp4, its Triton kernel, torch FP8 rowwise, torch BF16, DeepGEMM]
    us, notes) of
    the three GEMMs of one projection y = x @ w_g^T, w [G, n, k]."""
    dev = "cuda"
    offs = [sum(lens[:e]) for e in range(g)]
    offs_t = torch.tensor(offs, device=dev)
    lens_t = torch.tensor(lens, device=dev)
    ends32 = torch.tensor([o + c for o, c in zip(offs, lens)], device=dev, dtype=torch.int32)
    m_index = torch.repeat_interleave(torch.arange(g, device=dev, dtype=torch.int32), lens_t)
    torch.manual_seed(seed)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16) * 0.02
    w8, ws, w8t, wst = _fp8_tiles(w)
    x8, xs, xt, xts = ops.quantize_fp8_rows_cols(x)
    d8, ds, dt, dts = ops.quantize_fp8_rows_cols(dy)
    ours = {
        "fprop": lambda: grouped_gemm_fp8(x8, xs, w8, ws, offs_t, lens_t, validate=False, tile_aligned=True),
        "dgrad": lambda: grouped_gemm_fp8(d8, ds, w8t, wst, offs_t, lens_t, validate=False, tile_aligned=True),
        # (BF16 out, as torch's rows below: the same bytes written; float32 out is its own row)
        "wgrad": lambda: grouped_gemm_fp8_wgrad(dt, dts, xt, xts, offs_t, lens_t, out_dtype=torch.bfloat16,
                                                validate=False),
        "wgrad-f32": lambda: grouped_gemm_fp8_wgrad(dt, dts, xt, xts, offs_t, lens_t, validate=False),
    }
    triton = {
        "fprop": lambda: _triton_grouped_gemm.grouped_rows(x8, xs, w8, ws, offs_t, lens_t),
        "dgrad": lambda: _triton_grouped_gemm.grouped_rows(d8, ds, w8t, wst, offs_t, lens_t),
    }
    # torch: FP8 rowwise and BF16 on the same data (scales of one: the time does not depend on them)
    f8 = torch.float8_e4m3fn
    xr, dyr, wr = x.to(f8), dy.to(f8), w.to(f8)
    wt = w.transpose(1, 2).contiguous()
    wtr = wt.to(f8)
    xtb, dytb = x.t().contiguous(), dy.t().contiguous()
    xtr, dytr = xtb.to(f8), dytb.to(f8)

    def one(*size):
        return torch.ones(*size, device=dev)

    rowwise = {
        "fprop": lambda: torch._scaled_grouped_mm(xr, wr.transpose(-2, -1), one(m), one(g, n), offs=ends32,
                                                  out_dtype=torch.bfloat16),
        "dgrad": lambda: torch._scaled_grouped_mm(dyr, wtr.transpose(-2, -1), one(m), one(g, k), offs=ends32,
                                                  out_dtype=torch.bfloat16),
        "wgrad": lambda: torch._scaled_grouped_mm(dytr, xtr.t(), one(g * n), one(g * k), offs=ends32,
                                                  out_dtype=torch.bfloat16),
    }
    bf16 = {
        "fprop": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends32, out_dtype=torch.bfloat16),
        "dgrad": lambda: torch._grouped_mm(dy, wt.transpose(-2, -1), offs=ends32, out_dtype=torch.bfloat16),
        "wgrad": lambda: torch._grouped_mm(dytb, xtb.t(), offs=ends32, out_dtype=torch.bfloat16),
    }
    deep, notes = {}, set()
    if dg is not None:
        d_out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        dx_out = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
        w8t_c = w8t.contiguous()
        deep["fprop"] = lambda: dg.m_grouped_fp8_gemm_nt_contiguous((x8, xs), (w8, ws), d_out, m_index)
        deep["dgrad"] = lambda: dg.m_grouped_fp8_gemm_nt_contiguous((d8, ds), (w8t_c, wst), dx_out, m_index)
        try:  # per group, K-major blocks of dy^T [n, k_g] and x^T [k, k_g] back to back
            a_buf = torch.cat([dt[:, o:o + c].contiguous().flatten() for o, c in zip(offs, lens)])
            b_buf = torch.cat([xt[:, o:o + c].contiguous().flatten() for o, c in zip(offs, lens)])
            a_sf = torch.cat([dts[:, o // 128:(o + c) // 128].t() for o, c in zip(offs, lens)]).contiguous()
            b_sf = torch.cat([xts[:, o // 128:(o + c) // 128].t() for o, c in zip(offs, lens)]).contiguous()
            w_out = torch.zeros(g, n, k, device=dev, dtype=torch.float32)
            ks_t = torch.tensor(lens, device=dev, dtype=torch.int32)
            deep["wgrad-f32"] = lambda: dg.k_grouped_fp8_gemm_nt_contiguous(
                (a_buf, a_sf.t()), (b_buf, b_sf.t()), w_out, lens, ks_t, w_out, recipe=(1, 1, 128),
                compiled_dims="mn")
        except Exception as e:  # noqa: BLE001
            notes.add(f"DeepGEMM wgrad operands: {type(e).__name__}: {e}")
    rows = []
    for op in ("fprop", "dgrad", "wgrad", "wgrad-f32"):
        cells = []
        for table, name in ((ours, "moe_fp4"), (triton, "Triton kernel"), (rowwise, "torch FP8 rowwise"),
                            (bf16, "torch BF16"), (deep, "DeepGEMM")):
            t, err = _try(table[op], iters) if op in table else (None, "")
            if err:
                notes.add(f"{name} {op}: {err}")
            cells.append(t)
        rows.append((op, (n, k) if op != "dgrad" else (k, n), 2 * m * n * k, cells, notes))
    return rows


def _bf16_experts(x, w1, w2, ends):
    """The same SwiGLU MLP on BF16 grouped GEMMs (torch._grouped_mm), forward and backward."""

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w1, w2):
            y1 = torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)
            gate, up = y1.chunk(2, dim=-1)
            h = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()
            ctx.save_for_backward(x, w1, w2, y1)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends)

        @staticmethod
        def backward(ctx, dy):
            x, w1, w2, y1 = ctx.saved_tensors
            gate, up = y1.float().chunk(2, dim=-1)
            sig = torch.sigmoid(gate)
            h = (gate * sig * up).bfloat16()
            dw2 = torch._grouped_mm(dy.t(), h, offs=ends)
            dh = torch._grouped_mm(dy, w2, offs=ends).float()
            dy1 = torch.cat((dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig), dim=-1).bfloat16()
            dw1 = torch._grouped_mm(dy1.t(), x, offs=ends)
            dx = torch._grouped_mm(dy1, w1, offs=ends)
            return dx, dw1, dw2

    return F.apply(x, w1, w2)


def _bf16_row(x, dy, g, ends, iters):
    dev = x.device
    w1 = (torch.randn(g, 2 * INTER, HIDDEN, device=dev) * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(g, HIDDEN, INTER, device=dev) * 0.02).bfloat16().requires_grad_()

    def step():
        x.grad = w1.grad = w2.grad = None  # (each step's gradients are new: no accumulation pass)
        _bf16_experts(x, w1, w2, ends).backward(dy)

    torch.cuda.reset_peak_memory_stats()
    t, err = _try(step, iters)
    return ("torch BF16 grouped", t, t, err, torch.cuda.max_memory_allocated())


def _experts_rows(m, g, iters):
    """(name, us with the FP8 weight tiles remade, us with them kept, error, peak bytes) per MLP."""
    dev = "cuda"
    lens = split_lengths(m, g, "uniform")
    offs_t = torch.tensor([sum(lens[:e]) for e in range(g)], device=dev)
    lens_t = torch.tensor(lens, device=dev)
    host = (lens, [sum(lens[:e]) for e in range(g)])  # (as a dispatch gives them: no wait in backward)
    ends = torch.cumsum(lens_t, 0).to(torch.int32)
    x = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16)
    rows = [_bf16_row(x, dy, g, ends, iters)]
    module = Experts(g, HIDDEN, INTER, device=dev)
    x_fp8 = ops.quantize_fp8_blockwise(x.detach())
    x_mx = ops.quantize_mxfp4(x.detach())
    for save in SAVE_POLICIES:
        module.save = save

        def step(remake, save=save):
            x.grad = module.w1.grad = module.w2.grad = None
            if remake:
                module._fp8_key = None  # the weights' FP8 tiles are made once per weight version: count them
            y = module(x, offs_t, lens_t, x_fp8=x_fp8, x_mxfp4=x_mx if save == "mxfp4" else None, validate=False,
                       host_splits=host)
            y.backward(dy)

        torch.cuda.reset_peak_memory_stats()
        t, err = _try(lambda: step(True), iters)
        kept, err2 = _try(lambda: step(False), iters)
        rows.append((f"moe_fp4 Experts save={save}", t, kept, err or err2, torch.cuda.max_memory_allocated()))
    return rows


def _ceiling(iters):
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    t = _median_us(lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16), iters)
    return 2 * n ** 3 / t / 1e6


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m moe_fp4 bench gemm", description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="8x8192,32x32768",
                   help="experts x rows, comma separated (default 8x8192,32x32768; '' skips the GEMM table)")
    p.add_argument("--splits", default="uniform,skewed")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--experts-case", default="32x32768", help="experts x rows of the MLP comparison ('' skips it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    faulthandler.enable()  # (a crash inside a compared library still names where it happened)
    if not torch.cuda.is_available():
        print("bench gemm: needs a CUDA GPU (the FP8 grouped GEMMs run on the tensor cores)", file=sys.stderr)
        return 2
    notes: set[str] = set()
    dg = _probe_deep_gemm(notes)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ceiling = _ceiling(args.iters)
    print(f"# bench gemm, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"DeepGEMM {'v' + getattr(dg, '__version__', '?') if dg else 'not compared'}, {stamp}")
    print(f"FP8 ceiling (dense torch._scaled_mm 8192^3, rowwise): {ceiling:.0f} TFLOP/s; medians of {args.iters}")
    print()
    cases = [c for c in args.cases.split(",") if c]  # ('' skips the GEMM table)
    if cases:
        print(f"moe_fp4 column: grouped_gemm_fp8 on {'DeepGEMM' if _deep_gemm.module() else 'its Triton kernel'} "
              "(fprop, dgrad), its Triton kernel (wgrad); Triton column: the Triton rows kernel alone")
        print()
        print("| split | G x M | GEMM | op | N x K | moe_fp4 us | TFLOP/s | % ceiling | Triton us | TFLOP/s | "
              "torch FP8 rowwise us | TFLOP/s | ours / rowwise | torch BF16 us | TFLOP/s | DeepGEMM us | TFLOP/s |")
        print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = {op: [] for op in GOALS}
    for case in cases:
        g, m = (int(v) for v in case.split("x"))
        for kind in args.splits.split(","):
            rows, n = _gemm_rows(m, g, kind, args.iters, dg)
            notes |= n
            for kind_, g_, m_, proj, op, shape, flop, cells in rows:
                fmt = [(f"{t:.0f}", f"{flop / t / 1e6:.0f}") if t else ("-", "-") for t in cells]
                ours, rw = cells[0], cells[2]
                ratio = f"{rw / ours:.2f}" if ours and rw else "-"
                if ours and rw:
                    ratios[op].append(rw / ours)
                share = f"{flop / ours / 1e6 / ceiling * 100:.0f}%" if ours else "-"
                print(f"| {kind_} | {g_} x {m_} | {proj} | {op} | {shape[0]} x {shape[1]} | {fmt[0][0]} | "
                      f"{fmt[0][1]} | {share} | {fmt[1][0]} | {fmt[1][1]} | {fmt[2][0]} | {fmt[2][1]} | {ratio} | "
                      f"{fmt[3][0]} | {fmt[3][1]} | {fmt[4][0]} | {fmt[4][1]} |", flush=True)
    print()
    for op, goal in GOALS.items():
        if ratios[op]:
            worst = min(ratios[op])
            print(f"GPU goal {op} >= {goal} x torch FP8 rowwise: worst {worst:.2f} "
                  f"({'met' if worst >= goal else 'NOT met'})")
    if args.experts_case:
        g, m = (int(v) for v in args.experts_case.split("x"))
        print()
        print(f"Expert MLP forward + backward, G {g}, M {m}, H {HIDDEN}, I {INTER}, uniform splits, input "
              "given as FP8 (and MXFP4) rows, gradients new each step; FP8 weight tiles remade in the step "
              "(the first micro-batch after an optimizer step) or kept (the micro-batches after it)")
        print("| MLP | tiles remade: fwd+bwd us | vs BF16 | tiles kept: fwd+bwd us | vs BF16 | peak memory GB (both) |")
        print("|---|---:|---:|---:|---:|---:|")
        rows = _experts_rows(m, g, args.iters)
        base = rows[0][1]
        speedups = {}
        for name, t, kept, err, peak in rows:
            if err:
                notes.add(f"{name}: {err}")
            cells = []
            for v in (t, kept):
                cells += [f"{v:.0f}", f"{base / v:.2f}"] if v and base else ["-", "-"]
            speedups[name] = [base / v for v in (t, kept) if v and base]
            mem = f"{peak / 1e9:.1f}" if peak else "-"
            print(f"| {name} | {' | '.join(cells)} | {mem} |")
        default = speedups.get("moe_fp4 Experts save=mxfp4")
        if default and len(default) == 2:
            print(f"GPU goal Experts (save=mxfp4) fwd+bwd >= 1.5 x BF16: tiles remade {default[0]:.2f}, kept "
                  f"{default[1]:.2f} ({'met' if min(default) >= 1.5 else 'NOT met'})")
        else:
            print("GPU goal Experts (save=mxfp4) fwd+bwd >= 1.5 x BF16: NOT met (not measured: see the notes)")
    for n in sorted(notes):
        print(f"note: {n}")
    return 0


__all__ = ["main", "split_lengths"]
