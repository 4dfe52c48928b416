"""`python -m moe_fp4 bench kernels`: time the native conversion kernels against the memory ceiling.

For each op and shape: the median GPU time of one call (CUDA events around each call, a GPU sleep
ahead so the host queues the calls before they run, inputs rotated over sets larger than L2), GB/s
counting the bytes each op must read and write once, and that rate as a share of the measured
device-to-device copy bandwidth (bytes read + written; a 2 GiB copy) and of a copy moving the same
bytes as the op, timed the same way (the ceiling at that size: launch and tail included).
Baselines: the unfused column path (dequantize to BF16 through torch.compile, transpose copy, native
FP8 1x128 quantize) and, with --compile, torch.compile of the spec function.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time

import torch

from moe_fp4 import formats, ops
from moe_fp4.ops import _native, _ops


def device_median_us(fn, nsets: int, reps: int = 60, batch: int = 10) -> float:
    """Median device time of one call fn(i), i the input set: CUDA events around each call, the calls of a
    batch queued by the host during a GPU sleep ahead of them."""
    for i in range(3):
        fn(i % nsets)
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, reps // batch)):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(batch)]
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time: the host queues the whole batch meanwhile
        for k, (start, end) in enumerate(events):
            start.record()
            fn(k % nsets)
            end.record()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) * 1e3 for s, e in events]
    return statistics.median(times)


def _call_us(fn, nsets: int, reps: int = 60, rounds: int = 5) -> float:
    """Wall-clock time per call of fn in a loop of reps calls, synchronised at the end only: the host
    time of the call (and any wait it makes for the device) included; median over rounds."""
    for i in range(3):
        fn(i % nsets)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i % nsets)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def copy_ceiling_gbs(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = device_median_us(lambda i: dst.copy_(src), 1, reps=30)
    return 2 * nbytes / us / 1e3


def same_size_copy_gbs(traffic: int, reps: int) -> float:
    """Rate of a device-to-device copy moving the same bytes (traffic / 2 read, traffic / 2 written),
    timed like the ops (sources rotated past the L2): the ceiling at that size, launch and tail
    included."""
    n = max(16, traffic // 2)
    ns = _sets(n)
    src = [torch.empty(n, dtype=torch.uint8, device="cuda").random_() for _ in range(ns)]
    dst = [torch.empty_like(t) for t in src]
    us = device_median_us(lambda i: dst[i].copy_(src[i]), ns, reps)
    return 2 * n / us / 1e3


def _sets(bytes_per_set: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-3 * l2 // max(1, bytes_per_set)))


def _device_line() -> str:
    p = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = "nvidia-smi unavailable"
    return (f"{p.name}, {p.multi_processor_count} SMs, L2 {p.L2_cache_size >> 20} MiB; nvidia-smi: {smi}; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}")


def run(tokens: list[int], hidden: int, compile_spec: bool, reps: int) -> dict:
    native = _native.module()
    ceiling = copy_ceiling_gbs()
    rows = []

    def add(op, shape, us, nbytes, **extra):
        gbs = nbytes / us / 1e3
        same = same_size_copy_gbs(nbytes, reps)
        rows.append(dict(op=op, shape=shape, us=us, gbs=gbs, pct=100 * gbs / ceiling, pct_same=100 * gbs / same,
                         **extra))
        print(f"{op:34s} {shape:22s} {us:9.1f} us {gbs:8.0f} GB/s {100 * gbs / ceiling:6.1f}% "
              f"({100 * gbs / same:5.1f}% of a same-size copy)  "
              + " ".join(f"{k}={v:.2f}" for k, v in extra.items()), flush=True)

    def bench_shape(t):
        h = hidden
        shape = f"T={t} H={h}"
        n_in = t * h * 2
        ns = _sets(n_in)
        xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(ns)]
        q = [formats.quantize_mxfp4(x) for x in xs]
        fp4_bytes = t * h // 2 + t * h // 32
        fp8_bytes = t * h + t * h // 128 * 4

        # quantize_mxfp4
        us = device_median_us(lambda i: native.quantize_mxfp4(xs[i], True), ns, reps)
        extra = {}
        if compile_spec and t == tokens[0]:
            spec = torch.compile(lambda x: formats.quantize_mxfp4(x), dynamic=False)
            extra["x_compile"] = device_median_us(lambda i: spec(xs[i]), ns, reps) / us
        add("quantize_mxfp4", shape, us, n_in + fp4_bytes, **extra)

        rowbufs = [torch.empty(t, formats.mxfp4_row_bytes(h), dtype=torch.uint8, device="cuda") for _ in range(ns)]
        us = device_median_us(lambda i: native.quantize_mxfp4_rows_into(xs[i], True, rowbufs[i], None), ns, reps)
        add("quantize_mxfp4_rows", shape, us, n_in + fp4_bytes)

        # mxfp4_to_fp8_blockwise
        us = device_median_us(lambda i: native.mxfp4_to_fp8_blockwise(q[i][0], q[i][1], None, None), ns, reps)
        extra = {}
        if compile_spec and t == tokens[0]:
            spec = torch.compile(lambda p, s: formats.mxfp4_to_fp8_blockwise(p, s), dynamic=False)
            extra["x_compile"] = device_median_us(lambda i: spec(*q[i]), ns, reps) / us
        add("mxfp4_to_fp8_blockwise", shape, us, fp4_bytes + fp8_bytes, **extra)
        rb = [formats.pack_mxfp4_rows(*qq) for qq in q]
        us = device_median_us(lambda i: native.mxfp4_rows_to_fp8_blockwise(rb[i], h, None, None), ns, reps)
        add("mxfp4_rows_to_fp8_blockwise (byte rows)", shape, us, fp4_bytes + fp8_bytes)

        # mxfp4_rows_to_fp8_cols, 32 experts of equal length (multiples of 128)
        experts = 32
        lens = torch.full((experts,), t // experts, dtype=torch.int64, device="cuda")
        plan = _ops.column_plan(lens, None, t)  # (groups, two_pass, full_groups) as the public op chooses them
        us = device_median_us(lambda i: native.mxfp4_rows_to_fp8_cols(q[i][0], q[i][1], lens, None, *plan), ns, reps)

        # The unfused sequence at its fastest: one compiled (fused) dequantize to BF16, a transpose
        # copy (padded with zero tokens to a multiple of 128, as the spec quantizes a short group),
        # then the native FP8 1x128 quantizer.
        dequant = torch.compile(lambda p, s: formats.dequantize_mxfp4(p, s, dtype=torch.bfloat16), dynamic=False)
        pad = -t % formats.FP8_GROUP

        def unfused(i):
            v = dequant(q[i][0], q[i][1]).t()
            return native.quantize_fp8_blockwise(torch.nn.functional.pad(v, (0, pad)) if pad else v.contiguous())

        extra = {"x_unfused": device_median_us(unfused, ns, max(10, reps // 3)) / us}
        if compile_spec and t == tokens[0]:
            spec = torch.compile(lambda p, s: formats.mxfp4_rows_to_fp8_cols(p, s, lens), dynamic=False)
            extra["x_compile"] = device_median_us(lambda i: spec(*q[i]), ns, max(10, reps // 3)) / us
        add(f"mxfp4_rows_to_fp8_cols {experts} experts", shape, us, fp4_bytes + fp8_bytes, **extra)
        cuts = torch.sort(torch.randint(0, t + 1, (experts - 1,))).values
        rlens = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([t])])).cuda()
        rplan = _ops.column_plan(rlens, None, t)
        us = device_median_us(lambda i: native.mxfp4_rows_to_fp8_cols(q[i][0], q[i][1], rlens, None, *rplan), ns, reps)
        add(f"mxfp4_rows_to_fp8_cols {experts} ragged", shape, us, fp4_bytes + fp8_bytes)
        # the same cuts rounded down to 32 rows (segments padded as grouped FP8 GEMMs want them): one
        # pass with the host's group table, as the op runs it
        plens = torch.diff(torch.cat([torch.tensor([0]), cuts // 32 * 32, torch.tensor([t])])).cuda()
        launch = _ops.column_launch(plens, None, t)
        us = device_median_us(lambda i: native.mxfp4_rows_to_fp8_cols(q[i][0], q[i][1], plens, None, *launch), ns, reps)
        add(f"mxfp4_rows_to_fp8_cols {experts} experts, 32-row starts", shape, us, fp4_bytes + fp8_bytes)
        # segments at offsets on 32-row boundaries with gaps between them, as a receive buffer whose
        # experts start 32-row aligned: the ragged lengths less 31 rows, each placed at the next
        # multiple of 32 (the rows in the gaps and past the last segment come out zero)
        glens = (rlens - 31).clamp(min=0)
        goffs = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), (glens + 31) // 32 * 32]),
                             0)[:-1]
        launch = _ops.column_launch(glens, goffs, t)
        us = device_median_us(lambda i: native.mxfp4_rows_to_fp8_cols(q[i][0], q[i][1], glens, goffs, *launch), ns,
                              reps)
        add(f"mxfp4_rows_to_fp8_cols {experts} experts at 32-row offsets, gaps", shape, us, fp4_bytes + fp8_bytes)
        # the expert segments of a dispatch's received rows (a world of one: top-8 of 32 experts over
        # t / 8 tokens), as a wgrad operand: back to back (ragged, two passes) against each expert's
        # rows starting on a multiple of 32 (a dispatch's expert_alignment=32, zero rows between: one
        # pass). Bytes: t rows read, every output column written (gap rows included).
        if t % 8 == 0:
            idx = torch.argsort(torch.rand(t // 8, experts, device="cuda"), 1)[:, :8]
            counts = torch.bincount(idx.flatten(), minlength=experts)
            for align in (1, 32):
                padded = (counts + align - 1) // align * align
                dl, do, n_out = counts, torch.cumsum(padded, 0) - padded, int(padded.sum())
                rows = [formats.quantize_mxfp4(torch.randn(n_out, h, device="cuda", dtype=torch.bfloat16))
                        for _ in range(ns)]
                launch = _ops.column_launch(dl, do, n_out)
                us = device_median_us(lambda i, v=rows, dl=dl, do=do, launch=launch: native.mxfp4_rows_to_fp8_cols(
                    v[i][0], v[i][1], dl, do, *launch), ns, reps)
                name = "back to back" if align == 1 else f"expert_alignment={align}"
                nbytes = fp4_bytes + n_out * h + n_out * h // 128 * 4
                add(f"mxfp4_rows_to_fp8_cols dispatch segments, top-8 of {experts}, {name}", shape, us, nbytes)
                # the planned op per call, host time included: splits as host ints, its plan kept (the
                # path of DispatchOutput.to_fp8_cols)
                planned = (dl.tolist(), do.tolist(), {})
                us = _call_us(lambda i, v=rows, p=planned: ops.mxfp4_rows_to_fp8_cols_planned(v[i][0], v[i][1], *p),
                              ns, reps)
                add(f"mxfp4_rows_to_fp8_cols_planned per call, dispatch segments, {name}", shape, us, nbytes)
                del rows
        # the public op per call, host time included (it reads the splits on the host): splits on the
        # device (the read waits for the device each call) against the same splits on the CPU
        for name, ls in ((f"{experts} experts", lens), (f"{experts} experts, 32-row starts", plens)):
            for where, split in (("device", ls), ("host", ls.cpu())):
                us = _call_us(lambda i, split=split: ops.mxfp4_rows_to_fp8_cols(q[i][0], q[i][1], split), ns, reps)
                add(f"mxfp4_rows_to_fp8_cols op per call, {name}, {where} splits", shape, us, fp4_bytes + fp8_bytes)
        # the path the plan did not choose, for the record
        for name, ls, (g, two, full) in ((f"{experts} experts", lens, plan), (f"{experts} ragged", rlens, rplan)):
            us = device_median_us(lambda i, ls=ls, g=g, two=two, full=full: native.mxfp4_rows_to_fp8_cols(
                q[i][0], q[i][1], ls, None, g, not two, full), ns, reps)
            add(f"mxfp4_rows_to_fp8_cols {name}, {'one' if two else 'two'}-pass", shape, us, fp4_bytes + fp8_bytes)

        # MXFP4 -> BF16
        us = device_median_us(lambda i: native.dequantize_mxfp4(q[i][0], q[i][1]), ns, reps)
        extra = {}
        if compile_spec and t == tokens[0]:
            spec = torch.compile(lambda p, s: formats.dequantize_mxfp4(p, s, dtype=torch.bfloat16), dynamic=False)
            extra["x_compile"] = device_median_us(lambda i: spec(*q[i]), ns, reps) / us
        add("dequantize_mxfp4 (bfloat16)", shape, us, fp4_bytes + n_in, **extra)

        # BF16 -> FP8 1x128
        us = device_median_us(lambda i: native.quantize_fp8_blockwise(xs[i]), ns, reps)
        extra = {}
        if compile_spec and t == tokens[0]:
            spec = torch.compile(lambda x: formats.quantize_fp8_blockwise(x, block=(1, 128)), dynamic=False)
            extra["x_compile"] = device_median_us(lambda i: spec(xs[i]), ns, reps) / us
        add("quantize_fp8_blockwise", shape, us, n_in + t * h + t * h // 128 * 4, **extra)

    for t in tokens:
        bench_shape(t)
        torch.cuda.empty_cache()
    return dict(ceiling_gbs=ceiling, rows=rows, device=_device_line(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def markdown(result: dict, command: str) -> str:
    lines = [
        f"Device: {result['device']}",
        f"Date: {result['date']}",
        f"Command: `{command}`",
        f"Copy ceiling (device-to-device copy, bytes read + written): {result['ceiling_gbs']:.0f} GB/s",
        "",
        "| op | shape | µs | GB/s | % of copy | % of same-size copy | vs unfused | vs torch.compile(spec) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        unf = f"{r['x_unfused']:.2f}x" if "x_unfused" in r else ""
        comp = f"{r['x_compile']:.2f}x" if "x_compile" in r else ""
        lines.append(f"| {r['op']} | {r['shape']} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct']:.1f} | "
                     f"{r['pct_same']:.1f} | {unf} | {comp} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_fp4 bench kernels", description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 32768])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the spec")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the results table as Markdown here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench kernels: needs a CUDA GPU")
        return 2
    ops.build()
    result = run(args.tokens, args.hidden, args.compile, args.reps)
    command = "python -m moe_fp4 bench kernels " + " ".join(argv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(result, command.strip()))
    print(markdown(result, command.strip()))
    return 0
