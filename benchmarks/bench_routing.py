"""How long do the dispatch's routing tables take on one GPU: the native counting kernels
(moe_fp4.ops.routing.send_layout / expand_layout) against their torch reference (the sort-based
tables of the earlier dispatch), at DeepSeek-V3 routing (top-8 of 256 experts) over W ranks.

The receive side is timed on rank 0's metadata of a simulated exchange (every rank's tokens routed
at random, rank 0's blocks gathered by slicing). Times are CUDA-event medians of one call, host work
included (each call starts on an idle GPU: the host's launch work counts where the GPU waits for it).

    python benchmarks/bench_routing.py [--tokens 4096 16384] [--world 2 8] [--iters 30]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moe_fp4.ops import routing

EXPERTS, TOPK = 256, 8


def _time(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _row(t: int, w: int, alignment: int, iters: int) -> str:
    ell = EXPERTS // w
    width = routing.info_width(w, ell, 128)
    sends = []
    for _ in range(w):
        idx = torch.randn(t, EXPERTS, device="cuda").topk(TOPK, dim=1).indices
        wts = torch.rand(t, TOPK, device="cuda")
        sends.append((idx, wts, routing.send_layout(idx, wts, EXPERTS, w, [0], width)))
    blocks = []  # rank 0's received metadata: each source's first block
    for *_, s in sends:
        blocks.append(s.meta[:int(s.info[0, routing.INFO_RANKS])])
    meta = torch.cat(blocks)
    lens = torch.bincount(meta[:, :TOPK].long().reshape(-1) + 1, minlength=ell + 1)[1:]
    rows = int(((lens + alignment - 1) // alignment * alignment).sum())
    gap = rows - int(lens.sum())
    idx, wts, _ = sends[0]
    send_native = _time(lambda: routing.send_layout(idx, wts, EXPERTS, w, [0], width), iters)
    send_torch = _time(lambda: routing.send_layout_torch(idx, wts, EXPERTS, w, [0], width), iters)
    exp_native = _time(lambda: routing.expand_layout(meta, TOPK, ell, alignment, rows, gap, True), iters)
    exp_torch = _time(lambda: routing.expand_layout_torch(meta, TOPK, ell, alignment, rows, gap, True), iters)
    return (f"| {t} | {w} | {meta.shape[0]} | {send_native:.0f} | {send_torch:.0f} | {exp_native:.0f} | "
            f"{exp_torch:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--world", type=int, nargs="+", default=[2, 8])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--alignment", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; medians of {args.iters} calls")
    print("| tokens/rank | ranks | recv tokens | send native us | send torch us | expand native us | "
          "expand torch us |")
    print("|---|---|---|---|---|---|---|")
    for t in args.tokens:
        for w in args.world:
            print(_row(t, w, args.alignment, args.iters))


if __name__ == "__main__":
    main()
