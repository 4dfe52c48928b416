"""Activation memory and step time: BF16 saved activations vs the MXFP4 cache vs recomputation.

A stack of transformer MLP blocks (hidden H, 4H inner, GELU, residual) in BF16, one forward and
backward step. Reports the peak memory above the weights and inputs, the median step time, and the
gradient error of the cache against the BF16 step.

    python benchmarks/bench_activation_cache.py --hidden 4096 --tokens 8192 --layers 4
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.utils.checkpoint import checkpoint

from moe_fp4.moe import mxfp4_activation_cache


class Block(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def step(model, x, mode: str):
    if mode == "mxfp4 cache":
        with mxfp4_activation_cache():
            y = model(x)
    elif mode == "recompute":
        y = x
        for blk in model:
            y = checkpoint(blk, y, use_reentrant=False)
    else:
        y = model(x)
    y.float().square().mean().backward()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_activation_cache: needs a CUDA GPU")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)]).to(dev, torch.bfloat16)
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    grads = {}
    for mode in ("bf16 saved", "mxfp4 cache", "recompute"):
        for _ in range(2):  # warm-up
            model.zero_grad(set_to_none=True)
            step(model, x * 1.0, mode)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, x * 1.0, mode)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads[mode] = [p.grad.float().clone() for p in model.parameters()]
        times = []
        for _ in range(args.iters):
            model.zero_grad(set_to_none=True)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(model, x * 1.0, mode)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        rows.append((mode, peak / 2**30, statistics.median(times)))
    ref = grads["bf16 saved"]
    print(f"device: {torch.cuda.get_device_name()}; hidden {args.hidden}, tokens {args.tokens}, "
          f"{args.layers} MLP blocks (4H inner), BF16")
    print(f"{'mode':<12} {'peak GiB':>9} {'x bf16':>7} {'step ms':>8} {'grad rel err':>13}")
    for mode, gib, ms in rows:
        err = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads[mode], ref))
        print(f"{mode:<12} {gib:>9.2f} {gib / rows[0][1]:>7.2f} {ms:>8.2f} {err:>13.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
