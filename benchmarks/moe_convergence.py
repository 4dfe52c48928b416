"""MoE convergence per policy: a small MoE language model trained on the byte stream of the Python
standard library's sources, expert parallel over every process of the group, once per policy and
seed, the same batches in every run.

Question: how far does each MoE policy's loss land from BF16's ("bf16", "fp8", "fp8-recompute",
"mxfp4" of moe_fp4.moe.MoELayer), and is that larger than the seed-to-seed noise?

Model: pre-norm transformer, causal attention (BF16 autocast on GPU) and one MoELayer per block
(softmax top-k router with renormalisation, SwiGLU experts split over the ranks); embeddings, norms,
attention, router and head replicated (their gradients averaged over the ranks), experts sharded.
Each rank draws its own batches from one generator per step (the same in every run). Data: the
.py files of this Python's standard library in sorted order, the last 5% of the bytes held out.

Usage:
  python benchmarks/moe_convergence.py --out DIR [--steps 2000] [--seeds 0,1,2] [--policies ...]
      under torchrun (one process per GPU), or plainly: one process per visible GPU (NCCL) or 2 CPU
      processes (gloo). Writes DIR/convergence.json (curves and final losses), DIR/convergence.md
      (table: final eval loss per policy, mean and sd over seeds, paired difference to bf16) and
      DIR/convergence.png (loss curves) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_fp4.ep.launch import run_distributed  # noqa: E402
from moe_fp4.moe import POLICIES, MoELayer  # noqa: E402

VOCAB = 256


def stdlib_bytes() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return torch.frombuffer(bytearray(b"\n".join(p.read_bytes() for p in files)), dtype=torch.uint8)


class Block(nn.Module):
    def __init__(self, args, policy, group, device):
        super().__init__()
        d = args.d_model
        self.heads = args.heads
        self.norm1, self.norm2 = nn.LayerNorm(d, device=device), nn.LayerNorm(d, device=device)
        self.qkv = nn.Linear(d, 3 * d, device=device)
        self.proj = nn.Linear(d, d, device=device)
        self.moe = MoELayer(d, args.intermediate, args.experts, args.topk, group=group, policy=policy,
                            dtype=torch.float32, device=device)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.norm2(x).float()).to(x.dtype)


class MoELM(nn.Module):
    def __init__(self, args, policy, group, device):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, args.d_model, device=device)
        self.pos = nn.Embedding(args.seq, args.d_model, device=device)
        self.blocks = nn.ModuleList(Block(args, policy, group, device) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.d_model, device=device)
        self.head = nn.Linear(args.d_model, VOCAB, bias=False, device=device)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _is_expert(name: str) -> bool:
    return ".moe.experts." in name


def build(args, policy, seed, group, device):
    """The same replicated weights on every rank (seeded), each rank's own experts (seed + rank)."""
    torch.manual_seed(seed)
    model = MoELM(args, policy, group, device)
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(10_000 + seed)
        for name, p in model.named_parameters():
            if _is_expert(name):
                continue  # (MoELayer's own init, drawn after the seed; differs per rank as it should)
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif name.endswith("bias"):
                p.zero_()
        rank = dist.get_rank(group)
        torch.manual_seed(seed * 1000 + rank)
        for blk in model.blocks:
            blk.moe.experts.reset_parameters()  # (the same draws for every policy)
    return model


def loss_of(model, tokens, targets):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=tokens.is_cuda):
        logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def batches(data, step, rank, args, device, eval_=False):
    gen = torch.Generator().manual_seed((987_654 if eval_ else 123_456) + step * 1009 + rank)
    starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
    idx = starts.unsqueeze(1) + torch.arange(args.seq + 1)
    chunk = data[idx].long().to(device)
    return chunk[:, :-1], chunk[:, 1:]


def average_replicated_grads(model, world):
    for name, p in model.named_parameters():
        if p.grad is not None and not _is_expert(name):
            dist.all_reduce(p.grad)
            p.grad /= world


def train_one(args, policy, seed, train_data, eval_data, group, device) -> dict:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = build(args, policy, seed, group, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    curve = []
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = loss_of(model, *batches(train_data, step, rank, args, device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_replicated_grads(model, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        curve.append(float(mean) / world)
    model.eval()
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for i in range(args.eval_batches):
            total += loss_of(model, *batches(eval_data, i, rank, args, device, eval_=True))
    dist.all_reduce(total)
    return {"policy": policy, "seed": seed, "curve": curve, "eval_loss": float(total) / world / args.eval_batches,
            "seconds": time.time() - t0}


def report(runs, args, out: Path, device_line: str):
    by = {}
    for r in runs:
        by.setdefault(r["policy"], {})[r["seed"]] = r["eval_loss"]
    lines = [f"# MoE convergence per policy ({device_line})", "",
             f"{args.layers} layers, d {args.d_model}, {args.experts} experts, top-{args.topk}, intermediate "
             f"{args.intermediate}, seq {args.seq}, batch {args.batch} per rank, {args.steps} steps, lr {args.lr}",
             "", "| policy | eval loss mean | sd | minus bf16 (paired mean) | seeds |", "|---|---:|---:|---:|---:|"]
    base = by.get("bf16", {})
    for pol, seeds in by.items():
        vals = list(seeds.values())
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        diffs = [seeds[s] - base[s] for s in seeds if s in base]
        diff = f"{statistics.mean(diffs):+.4f}" if diffs else "-"
        lines.append(f"| {pol} | {statistics.mean(vals):.4f} | {sd:.4f} | {diff} | {len(vals)} |")
    (out / "convergence.md").write_text("\n".join(lines) + "\n")
    (out / "convergence.json").write_text(json.dumps({"args": vars(args), "runs": runs}))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in runs:
        w = max(1, len(r["curve"]) // 50)
        c = torch.tensor(r["curve"]).unfold(0, w, w).mean(1) if len(r["curve"]) >= w else torch.tensor(r["curve"])
        ax.plot([(i + 1) * w for i in range(len(c))], c.tolist(), label=f"{r['policy']} s{r['seed']}", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (mean over ranks)")
    ax.legend(fontsize=6, ncol=2)
    fig.savefig(out / "convergence.png", dpi=120)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--world", type=int, default=None)
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.policies = args.policies.split(",")
    return args


def run(args) -> list[dict]:
    """Every seed and policy on this process group (rank 0 also writes the report)."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    data = stdlib_bytes()
    cut = int(data.numel() * 0.95)
    train_data, eval_data = data[:cut], data[cut:]
    group = dist.group.WORLD
    runs = []
    for seed in args.seeds:
        for pol in args.policies:
            r = train_one(args, pol, seed, train_data, eval_data, group, device)
            if dist.get_rank() == 0:
                print(f"{pol} seed {seed}: eval {r['eval_loss']:.4f}, last train {r['curve'][-1]:.4f}, "
                      f"{r['seconds']:.0f} s", flush=True)
            runs.append(r)
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name(0) if gpu else "CPU"
        report(runs, args, out, f"{dist.get_world_size()} x {name}, torch {torch.__version__}")
    return runs


def main(argv=None) -> int:
    args = parse(argv)
    run_distributed(run, args, "nccl" if torch.cuda.is_available() else "gloo", args.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
