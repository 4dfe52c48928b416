"""Recipe ablation: a small GPT trained on the Python standard library's source bytes, one run per
recipe, same seed, same steps, same data order.

Question: how far does each dense-layer recipe's loss land from BF16's after the same training?
Runs: bf16, mxfp8_up (MXFP8, scales rounded up), mxfp8_floor (OCP floor), nvfp4_all (2-D weights,
RHT on wgrad, stochastic gradients, last block in BF16), nvfp4_none (none of those), mxfp4 (RHT,
stochastic gradients, last block in BF16), fp8_blockwise (real FP8 GEMMs through torch._scaled_mm
on sm_90), plus bf16_seed2 (BF16 with another seed: the run-to-run noise to read the others by).

Data: byte-level tokens (vocabulary 256) of the .py files of this Python's standard library, in
sorted path order; the last 5% of the bytes are held out for the eval loss.

Usage: python benchmarks/ablation.py --out DIR [--steps N | --time-budget SECONDS]
Writes DIR/ablation.json (curves, losses, timings), DIR/ablation.md (table) and DIR/ablation.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_fp4.recipes import (  # noqa: E402
    FP8BlockwiseRecipe,
    MXFP4Recipe,
    MXFP8Recipe,
    NVFP4Recipe,
    convert_linears,
    scaled_mm_status,
)

VOCAB = 256


def recipes(gemm_dtype: str) -> dict[str, object]:
    """Run name -> recipe (None: BF16)."""
    g = {"gemm_dtype": gemm_dtype}
    return {
        "bf16": None,
        "mxfp8_up": MXFP8Recipe(scale_rounding="up", **g),
        "mxfp8_floor": MXFP8Recipe(scale_rounding="down", **g),
        "nvfp4_all": NVFP4Recipe(**g),
        "nvfp4_none": NVFP4Recipe(weight_2d=False, wgrad_rht=False, stochastic_rounding=False,
                                  bf16_last_blocks=0, **g),
        "mxfp4": MXFP4Recipe(**g),
        "fp8_blockwise": FP8BlockwiseRecipe(backend="auto", **g),
        "bf16_seed2": None,
    }


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------


def stdlib_bytes() -> tuple[torch.Tensor, str, int]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    blob = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), str(root), len(files)


def batch_at(data: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts.unsqueeze(1) + torch.arange(seq + 1, device=starts.device)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


# ------------------------------------------------------------------------------------------------
# model: pre-norm GPT; attention products, softmax, norms, embeddings and the head stay BF16
# ------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.norm(x))


def loss_of(model, tokens, targets):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=tokens.is_cuda):
        logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------


def train(name, recipe, args, train_data, eval_data, steps, seed, device):
    torch.manual_seed(seed)
    model = GPT(args.d_model, args.layers, args.heads, args.seq).to(device)
    report = convert_linears(model, recipe) if recipe is not None else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    data_gen = torch.Generator(device="cpu").manual_seed(args.data_seed)  # same data order in every run
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(0, train_data.numel() - args.seq - 1, (args.batch,), generator=data_gen).to(device)
        tokens, targets = batch_at(train_data, starts, args.seq)
        loss = loss_of(model, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
    losses = [float(v) for v in torch.stack(losses).cpu()]
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    eval_gen = torch.Generator(device="cpu").manual_seed(4321)
    with torch.no_grad():
        ev = []
        for _ in range(args.eval_batches):
            starts = torch.randint(0, eval_data.numel() - args.seq - 1, (args.batch,), generator=eval_gen).to(device)
            ev.append(float(loss_of(model, *batch_at(eval_data, starts, args.seq))))
    tail = max(1, steps // 10)
    return {
        "name": name, "recipe": repr(recipe), "steps": steps, "seconds": seconds, "s_per_step": seconds / steps,
        "train_losses": losses, "final_train": sum(losses[-tail:]) / tail, "eval": sum(ev) / len(ev),
        "quantized_layers": len(report.quantized) if report else 0,
        "bf16_layers": len(report.kept_bf16) if report else None,
        "finite": all(math.isfinite(v) for v in losses),
    }


def step_time(recipe, args, train_data, device, n=4):
    """Seconds per training step of ``recipe`` (after two warm-up steps)."""
    torch.manual_seed(0)
    model = GPT(args.d_model, args.layers, args.heads, args.seq).to(device)
    if recipe is not None:
        convert_linears(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    starts = torch.arange(args.batch, device=device) * 997
    tokens, targets = batch_at(train_data, starts, args.seq)
    times = []
    for i in range(n + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_of(model, tokens, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gradient_errors(args, train_data, device, batches: int = 4) -> dict[str, float]:
    """One-step fidelity: ||g_recipe - g_fp32|| / ||g_fp32|| over all parameters, the same weights and
    batches for every recipe (float32 GEMMs, no torch.autocast), mean over ``batches`` batches."""
    torch.manual_seed(args.seed)
    base = GPT(args.d_model, args.layers, args.heads, args.seq).to(device)
    gen = torch.Generator(device="cpu").manual_seed(args.data_seed)
    data = [batch_at(train_data, torch.randint(0, train_data.numel() - args.seq - 1, (args.batch,),
                                               generator=gen).to(device), args.seq) for _ in range(batches)]

    def grad(model, tokens, targets):
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref = [grad(base, *b) for b in data]
    out = {}
    for name, rec in recipes("float32").items():
        if rec is None:
            continue
        model = copy.deepcopy(base)
        convert_linears(model, rec)
        errs = [float((grad(model, *b) - r).norm() / r.norm()) for b, r in zip(data, ref)]
        out[name] = sum(errs) / len(errs)
    return out


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def write_report(results, meta, out: Path):
    (out / "ablation.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    base = next((r for r in results if r["name"] == "bf16"), None)
    lines = ["| run | final train loss (mean of last 10% steps) | vs BF16 | held-out eval loss | vs BF16 | s/step |",
             "|---|---|---|---|---|---|"]
    for r in results:
        rel_t = rel_e = "—"
        if base is not None:
            rel_t = f"{100 * (r['final_train'] / base['final_train'] - 1):+.2f}%"
            rel_e = f"{100 * (r['eval'] / base['eval'] - 1):+.2f}%"
        lines.append(f"| {r['name']} | {r['final_train']:.4f} | {rel_t} | {r['eval']:.4f} | {rel_e} | "
                     f"{r['s_per_step']:.3f} |")
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    def moving_mean(ys, k):
        c = [0.0]
        for v in ys:
            c.append(c[-1] + v)
        return [(c[i + 1] - c[max(0, i + 1 - k)]) / (i + 1 - max(0, i + 1 - k)) for i in range(len(ys))]

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    base_curve = base["train_losses"] if base is not None else None
    for r in results:
        ys = r["train_losses"]
        smooth = moving_mean(ys, max(1, len(ys) // 25))
        style = "--" if r["name"].startswith("bf16") else "-"
        axes[0].plot(smooth, style, label=r["name"], lw=1.2)
        half = len(smooth) // 2
        axes[1].plot(range(half, len(smooth)), smooth[half:], style, label=r["name"], lw=1.2)
        if base_curve is not None and len(base_curve) == len(ys):
            # same batches in every run: the per-step difference cancels most of the batch noise
            diff = moving_mean([a - b for a, b in zip(ys, base_curve)], max(1, len(ys) // 10))
            axes[2].plot(diff, style, label=r["name"], lw=1.2)
    axes[0].set_title("training loss (moving mean over 4% of the steps)")
    axes[1].set_title("second half, zoomed")
    axes[2].set_title("loss minus BF16's, same batch (moving mean over 10%)")
    axes[2].axhline(0.0, color="k", lw=0.6)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats / byte)")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"small GPT on stdlib bytes: {meta['model']}, {meta['steps']} steps, {meta['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=180.0, help="seconds for all runs when --steps is not given")
    p.add_argument("--min-steps", type=int, default=60)
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-seed", type=int, default=99)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--gemm-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--runs", default=None, help="comma-separated subset of the run names")
    p.add_argument("--grad-error-only", action="store_true",
                   help="only the one-step gradient error of each recipe against float32 (no training)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    data, root, nfiles = stdlib_bytes()
    data = data.to(device)
    split = int(data.numel() * 0.95)
    train_data, eval_data = data[:split], data[split:]
    runs = recipes(args.gemm_dtype)
    if args.runs:
        runs = {k: v for k, v in runs.items() if k in args.runs.split(",")}
    print(f"data: {nfiles} files under {root}, {data.numel()} bytes ({split} train)", flush=True)
    if args.grad_error_only:
        errs = gradient_errors(args, train_data, device)
        lines = ["| recipe | relative gradient error vs float32 (mean of 4 batches) |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in errs.items()]
        (args.out / "gradient_error.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        return 0

    steps = args.steps
    timings = {}
    if steps is None:
        for name, rec in runs.items():
            if name != "bf16_seed2":
                timings[name] = step_time(rec, args, train_data, device)
        timings.setdefault("bf16_seed2", timings.get("bf16", 0.0))
        per_step_all = sum(timings[n] for n in runs) * 1.12  # plus evals, warm-up and jitter
        steps = int(min(args.max_steps, max(args.min_steps, args.time_budget / per_step_all)))
        print(f"step times (s): { {k: round(v, 4) for k, v in timings.items()} } -> {steps} steps", flush=True)

    meta = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": sys.version.split()[0], "stdlib": root, "files": nfiles,
        "bytes": int(data.numel()), "steps": steps, "calibrated_step_s": timings,
        "model": f"{args.layers} layers, d={args.d_model}, {args.heads} heads, seq {args.seq}, batch {args.batch}",
        "tokens_per_step": args.batch * args.seq, "lr": args.lr, "gemm_dtype": args.gemm_dtype,
        "command": "python benchmarks/ablation.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    results = []
    for name, rec in runs.items():
        seed = args.seed + (1 if name == "bf16_seed2" else 0)
        r = train(name, rec, args, train_data, eval_data, steps, seed, device)
        print(f"{name}: train {r['final_train']:.4f} eval {r['eval']:.4f} ({r['seconds']:.1f} s)", flush=True)
        results.append(r)
        meta["scaled_mm_status"] = {k: (v if v is True else str(v)) for k, v in scaled_mm_status().items()}
        write_report(results, meta, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
