"""`python -m moe_fp4 bench moe`: a stack of MoE layers, forward + backward, per policy.

Each block is x = x + MoELayer(rms_norm(x)); attention is omitted (the figures are the MoE part of a
step); the norm keeps its BF16 input and one float32 per token for backward, as fused RMSNorm
kernels do. Per policy ("bf16", "fp8", "fp8-recompute", "mxfp4"), on every rank of a process group (NCCL
on GPUs, gloo on CPU):
  tok/GPU/s    tokens per rank / median step time (forward + backward of the whole stack, ranks
               lined up by a barrier before each step, the slowest rank's time)
  step ms      that median step time
  peak GB      peak memory allocated during a step above the memory held before it (weights, their
               FP8 copies, optimizer-free: no gradients are kept across steps) (GPU; the max over ranks)
  act GB/layer memory each MoE layer holds from its forward to its backward (what autograd saves
               for it: the activation memory each policy buys or spends), averaged over the layers;
               its output, which the block adds to the residual and the layer does not keep, and
               the stack's norms are not counted
With --memory-cap GB: the largest tokens per rank (from --cap-tokens) whose peak stays under the
cap, and its tok/GPU/s, per policy (the paper's memory-cap experiment).
GPU defaults are DeepSeek-V3's MoE shapes (hidden 7168, 256 experts over the ranks, top-8,
intermediate 2048, 2 layers); CPU defaults are tiny and only check the path.

Run under torchrun (one process per GPU), or plainly: the command then starts one process per
visible GPU (NCCL), or 2 CPU processes (gloo) without GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

from moe_fp4.ep.launch import run_distributed
from moe_fp4.moe.layer import POLICIES, MoELayer


class _RMSNorm(torch.autograd.Function):
    """RMS norm keeping its input as given and one float32 per token (the footprint of a fused kernel)."""

    @staticmethod
    def forward(ctx, x):
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, rstd)
        return (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, rstd = ctx.saved_tensors
        n, gf = x.float() * rstd, g.float()
        return (rstd * (gf - n * (gf * n).mean(-1, keepdim=True))).to(x.dtype)


class _Block(torch.nn.Module):
    def __init__(self, layer: MoELayer):
        super().__init__()
        self.moe = layer
        self.held: list[int] | None = None  # when a list: each forward appends what its MoE layer holds

    def forward(self, x):
        h = _RMSNorm.apply(x)
        if self.held is None:
            return x + self.moe(h).to(x.dtype)
        _sync()
        before = torch.cuda.memory_allocated()
        out = x + self.moe(h).to(x.dtype)  # (the layer's output is dropped here: it keeps none of it)
        _sync()
        self.held.append(torch.cuda.memory_allocated() - before - out.numel() * out.element_size())
        return out


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m moe_fp4 bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default=None, help="tokens per rank, comma separated (GPU default 4096,8192,16384; "
                   "CPU 64)")
    p.add_argument("--hidden", type=int, default=None, help="GPU default 7168, CPU 256")
    p.add_argument("--intermediate", type=int, default=None, help="GPU default 2048, CPU 128")
    p.add_argument("--experts", type=int, default=None, help="experts over all ranks (GPU default 256, CPU 8)")
    p.add_argument("--topk", type=int, default=None, help="GPU default 8, CPU 2")
    p.add_argument("--layers", type=int, default=None, help="GPU default 2, CPU 2")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--iters", type=int, default=None, help="timed steps (GPU default 10, CPU 2)")
    p.add_argument("--memory-cap", type=float, default=None, help="GB: also find each policy's largest batch")
    p.add_argument("--cap-tokens", default="4096,8192,12288,16384,24576,32768",
                   help="tokens per rank tried under --memory-cap, ascending")
    p.add_argument("--world", type=int, default=None, help="processes to start when not under torchrun")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    args.backend = "nccl" if gpu else "gloo"
    args.tokens = [int(t) for t in (args.tokens or ("4096,8192,16384" if gpu else "64")).split(",")]
    args.hidden = args.hidden or (7168 if gpu else 256)
    args.intermediate = args.intermediate or (2048 if gpu else 128)
    args.experts = args.experts or (256 if gpu else 8)
    args.topk = args.topk or (8 if gpu else 2)
    args.layers = args.layers or 2
    args.iters = args.iters or (10 if gpu else 2)
    args.policies = args.policies.split(",")
    for pol in args.policies:
        if pol not in POLICIES:
            p.error(f"--policies: unknown policy {pol!r} (expected {', '.join(POLICIES)})")
    return args


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measure(args, policy: str, tokens: int) -> dict:
    """One policy at one batch: median step time (max over ranks), peak and saved memory."""
    import torch.distributed as dist

    dev = _device()
    torch.manual_seed(1234)
    blocks = torch.nn.Sequential(*[_Block(MoELayer(args.hidden, args.intermediate, args.experts, args.topk,
                                                   group=dist.group.WORLD, policy=policy, dtype=torch.bfloat16,
                                                   device=dev)) for _ in range(args.layers)])
    x = torch.randn(tokens, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, args.hidden, device=dev, dtype=torch.bfloat16)
    gpu = dev.type == "cuda"

    def step(record=None):
        for b in blocks:
            if hasattr(b.moe.experts, "_fp8_key"):
                b.moe.experts._fp8_key = None  # the weights' FP8 copies: once per step, as in training
            b.held = record if gpu else None
        y = blocks(x)
        for b in blocks:
            b.held = None
        y.backward(dy)
        x.grad = None
        blocks.zero_grad(set_to_none=True)

    step()
    step()
    saved: list[int] = []
    times = []
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if gpu else 0
    for i in range(args.iters):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        step(saved if i == 0 else None)
        _sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) if gpu else 0
    # (the FP8 weight copies made in a layer's forward replace the previous step's: no net memory)
    act = statistics.mean(saved) if saved else 0
    out = torch.tensor([statistics.median(times), peak, act], dtype=torch.float64)
    out = out.to(dev) if args.backend == "nccl" else out
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    t, peak, act = out.tolist()
    return {"policy": policy, "tokens": tokens, "step_ms": t * 1e3, "tok_s": tokens / t, "peak_gb": peak / 1e9,
            "act_gb_layer": act / 1e9}


def _fits(args, policy, tokens) -> dict | None:
    try:
        r = _measure(args, policy, tokens)
    except torch.OutOfMemoryError:
        r = None
    ok = torch.tensor([0.0 if r is None or r["peak_gb"] > args.memory_cap else 1.0])
    import torch.distributed as dist

    ok = ok.to(_device()) if args.backend == "nccl" else ok
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return r if float(ok) > 0 else None


def _run(args) -> dict:
    rows = [_measure(args, pol, t) for t in args.tokens for pol in args.policies]
    capped = []
    if args.memory_cap is not None:
        for pol in args.policies:
            best = None
            for t in (int(v) for v in args.cap_tokens.split(",")):
                r = _fits(args, pol, t)
                if r is None:
                    break
                best = r
            capped.append((pol, best))
    return {"rows": rows, "capped": capped}


def _print(res, args, world):
    if args.backend == "nccl":
        device = f"{world} x {torch.cuda.get_device_name(0)}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    else:
        device = f"{world} CPU processes (gloo), {os.cpu_count()} cores: the figures only check the path"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# bench moe, {device}, torch {torch.__version__}, {stamp}")
    print(f"{args.layers} MoE layers (attention omitted), hidden {args.hidden}, {args.experts} experts over "
          f"{world} ranks, top-{args.topk}, intermediate {args.intermediate}; medians of {args.iters} steps")
    print("legend: tok/GPU/s = tokens per rank / step time (slowest rank); act GB/layer = memory an MoE layer "
          "keeps from its forward to its backward (its output not counted); peak GB = peak allocated in a step "
          "above the weights (max over ranks)")
    print()
    print("| tokens/rank | policy | step ms | tok/GPU/s | vs bf16 | peak GB | act GB/layer |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    base = {r["tokens"]: r["tok_s"] for r in res["rows"] if r["policy"] == "bf16"}
    for r in res["rows"]:
        rel = f"{r['tok_s'] / base[r['tokens']]:.2f}" if r["tokens"] in base else "-"
        print(f"| {r['tokens']} | {r['policy']} | {r['step_ms']:.1f} | {r['tok_s']:.0f} | {rel} | "
              f"{r['peak_gb']:.2f} | {r['act_gb_layer']:.3f} |")
    if res["capped"]:
        print()
        print(f"Under a memory cap of {args.memory_cap} GB (peak per step): the largest tokens per rank tried")
        print("| policy | tokens/rank | tok/GPU/s | peak GB |")
        print("|---|---:|---:|---:|")
        for pol, r in res["capped"]:
            if r is None:
                print(f"| {pol} | none fits | - | - |")
            else:
                print(f"| {pol} | {r['tokens']} | {r['tok_s']:.0f} | {r['peak_gb']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    res, world, is_root = run_distributed(_run, args, args.backend, args.world)
    if is_root:
        _print(res, args, world)
    return 0


__all__ = ["main"]
