"""Recipe ablation: a small GPT trained on the Python standard library's source bytes, one run per
recipe and seed, same steps and same data order in every run.

Question: how far does each dense-layer recipe's loss land from BF16's after the same training, and
is that distance larger than the seed-to-seed noise? Configurations: bf16, mxfp8_up (MXFP8, scales
rounded up), mxfp8_floor (OCP floor), nvfp4_all (2-D weights, RHT on wgrad, stochastic gradients,
last block in BF16), nvfp4_none (none of those), mxfp4 (RHT, stochastic gradients, last block in
BF16), fp8_blockwise (real FP8 GEMMs through torch._scaled_mm on sm_90). Every configuration runs
for every seed; a seed fixes the initial weights and the stochastic-rounding seed, and the batches are
the same in all runs, so "recipe minus BF16 at the same seed" is a paired difference.

Final loss: the held-out eval loss (the last 5% of the bytes, ``--eval-batches`` fixed batches) after
the last step; the mean training loss of the last 10% of steps is reported beside it.

Data: byte-level tokens (vocabulary 256) of the .py files of this Python's standard library, in
sorted path order; the last 5% of the bytes are held out.

Usage:
  python benchmarks/ablation.py --out DIR --steps N [--seeds 0,1,2] [--jobs 7] [--runs bf16,mxfp8_up]
                                [--deadline SECONDS]
      trains; with --jobs > 1 the configurations run in that many concurrent processes (one
      process per configuration, all seeds in turn: each process compiles only its own recipe's
      quantizers, and the GPU is far from busy with one launch-bound process), each writing
      DIR/<configuration>/runs.json; then the report. A run that would end after --deadline seconds
      is stopped and left out (the report says which runs exist).
  python benchmarks/ablation.py --out DIR --step-times [--runs ...]
      seconds per training step of each configuration, compiled and eager quantizers (first step,
      which compiles, timed apart), and a torch.profiler table of one step of each kind.
  python benchmarks/ablation.py --out DIR --report-only   the report from DIR/seed_*/runs.json
Writes DIR/ablation.json (curves, losses, timings), DIR/ablation.md (table) and DIR/ablation.png.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import subprocess
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
from moe_fp4.recipes.compiled import compiled_status  # noqa: E402

VOCAB = 256
CONFIGS = ("bf16", "mxfp8_up", "mxfp8_floor", "nvfp4_all", "nvfp4_none", "mxfp4", "fp8_blockwise")


def recipes(gemm_dtype: str, quantizer: str = "auto") -> dict[str, object]:
    """Configuration name -> recipe (None: BF16)."""
    g = {"gemm_dtype": gemm_dtype, "quantizer": quantizer}
    return {
        "bf16": None,
        "mxfp8_up": MXFP8Recipe(scale_rounding="up", **g),
        "mxfp8_floor": MXFP8Recipe(scale_rounding="down", **g),
        "nvfp4_all": NVFP4Recipe(**g),
        "nvfp4_none": NVFP4Recipe(weight_2d=False, wgrad_rht=False, stochastic_rounding=False,
                                  bf16_last_blocks=0, **g),
        "mxfp4": MXFP4Recipe(**g),
        "fp8_blockwise": FP8BlockwiseRecipe(backend="auto", **g),
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


def build(recipe, args, seed: int, device):
    torch.manual_seed(args.init_seed + seed)
    model = GPT(args.d_model, args.layers, args.heads, args.seq).to(device)
    report = None
    if recipe is not None:
        report = convert_linears(model, dataclasses.replace(recipe, seed=seed))
    return model, report


# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------


def eval_loss(model, eval_data, args, device) -> float:
    gen = torch.Generator(device="cpu").manual_seed(4321)  # the same held-out batches for every run
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for _ in range(args.eval_batches):
            starts = torch.randint(0, eval_data.numel() - args.seq - 1, (args.batch,), generator=gen).to(device)
            total += loss_of(model, *batch_at(eval_data, starts, args.seq))
    return float(total) / args.eval_batches


class DeadlineReached(Exception):
    pass


def train(name, recipe, args, train_data, eval_data, steps, seed, device):
    model, report = build(recipe, args, seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    data_gen = torch.Generator(device="cpu").manual_seed(args.data_seed)  # same data order in every run
    evals_at = sorted({steps // 2, (3 * steps) // 4, steps})
    losses, evals = [], {}
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        starts = torch.randint(0, train_data.numel() - args.seq - 1, (args.batch,), generator=data_gen).to(device)
        tokens, targets = batch_at(train_data, starts, args.seq)
        loss = loss_of(model, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
        if args.deadline_at and step % 25 == 0 and step < steps and time.time() > args.deadline_at:
            raise DeadlineReached(f"{name} seed {seed}: deadline reached at step {step} of {steps}")
        if step in evals_at and step != steps:
            evals[step] = eval_loss(model, eval_data, args, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    evals[steps] = eval_loss(model, eval_data, args, device)
    losses = [float(v) for v in torch.stack(losses).cpu()]
    tail = max(1, steps // 10)
    return {
        "name": name, "seed": seed, "recipe": repr(recipe), "steps": steps, "seconds": seconds,
        "s_per_step": seconds / steps, "train_losses": losses, "final_train": sum(losses[-tail:]) / tail,
        "eval": evals[steps], "evals": {str(k): v for k, v in sorted(evals.items())},
        "quantized_layers": len(report.quantized) if report else 0,
        "bf16_layers": len(report.kept_bf16) if report else None,
        "finite": all(math.isfinite(v) for v in losses),
    }


# ------------------------------------------------------------------------------------------------
# step times and profile
# ------------------------------------------------------------------------------------------------


def step_times(args, train_data, device, out: Path) -> dict:
    """Per configuration and quantizer: first step (compiles) and the median of ``args.time_steps``
    further steps, in seconds; plus a torch.profiler summary of one step of nvfp4_all each way."""
    starts = torch.arange(args.batch, device=device) * 997
    tokens, targets = batch_at(train_data, starts, args.seq)
    results, lines = {}, ["| configuration | quantizer | first step s (compiles) | median step s | vs BF16 |",
                          "|---|---|---|---|---|"]
    names = [n for n in CONFIGS if n in args.runs]
    for quantizer in ("auto", "eager"):
        for name in names:
            rec = recipes(args.gemm_dtype, quantizer)[name]
            if rec is None and quantizer == "eager":
                continue
            model, _ = build(rec, args, 0, device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            times = []
            for _ in range(args.time_steps + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = loss_of(model, tokens, targets)
                opt.zero_grad()
                loss.backward()
                opt.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times[2:])
            label = "compiled" if quantizer == "auto" and rec is not None else ("eager" if rec else "—")
            results[f"{name}/{label}"] = {"first_s": times[0], "median_s": med}
            base = results.get("bf16/—", {}).get("median_s")
            lines.append(f"| {name} | {label} | {times[0]:.2f} | {med:.4f} | "
                         f"{med / base:.1f}x |" if base else f"| {name} | {label} | {times[0]:.2f} | {med:.4f} | — |")
            print(lines[-1], flush=True)
    prof_lines = []
    for quantizer in ("auto", "eager"):
        model, _ = build(recipes(args.gemm_dtype, quantizer)["nvfp4_all"], args, 0, device)
        for _ in range(2):
            loss_of(model, tokens, targets).backward()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loss_of(model, tokens, targets).backward()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        cuda_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        prof_lines.append(f"### nvfp4_all, forward+backward, quantizer {quantizer}: {kernels} GPU kernels, "
                          f"{cuda_us / 1e3:.1f} ms of GPU time\n")
        prof_lines.append("```\n" + events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
                          + "\n```\n")
    text = "\n".join(lines) + "\n\n" + "\n".join(prof_lines)
    (out / "step_times.md").write_text(text)
    (out / "step_times.json").write_text(json.dumps({"step_times": results, "compiled": compiled_status()}, indent=1))
    print(text, flush=True)
    return results


def gradient_errors(args, train_data, device, batches: int = 4) -> dict[str, float]:
    """One-step fidelity: ||g_recipe - g_fp32|| / ||g_fp32|| over all parameters, the same weights and
    batches for every recipe (float32 GEMMs, no torch.autocast), mean over ``batches`` batches."""
    torch.manual_seed(args.init_seed)
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


def _mean_sd(values):
    values = list(values)
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def summarize(runs: list[dict]) -> list[dict]:
    """Per configuration: eval and train loss mean / sd / min / max over seeds, and the paired
    relative difference from BF16 at the same seed (mean and sd over seeds)."""
    by = {}
    for r in runs:
        by.setdefault(r["name"], {})[r["seed"]] = r
    base = by.get("bf16", {})
    rows = []
    for name in [n for n in CONFIGS if n in by]:
        seeds = sorted(by[name])
        ev = [by[name][s]["eval"] for s in seeds]
        tr = [by[name][s]["final_train"] for s in seeds]
        paired = [100 * (by[name][s]["eval"] / base[s]["eval"] - 1) for s in seeds if s in base]
        paired_t = [100 * (by[name][s]["final_train"] / base[s]["final_train"] - 1) for s in seeds if s in base]
        rows.append({
            "name": name, "seeds": seeds, "eval": ev, "eval_mean_sd": _mean_sd(ev), "train_mean_sd": _mean_sd(tr),
            "eval_vs_bf16_pct": paired, "eval_vs_bf16_mean_sd": _mean_sd(paired),
            "train_vs_bf16_mean_sd": _mean_sd(paired_t),
            "s_per_step": statistics.fmean(by[name][s]["s_per_step"] for s in seeds),
            "finite": all(by[name][s]["finite"] for s in seeds),
        })
    return rows


def write_report(runs, meta, out: Path):
    rows = summarize(runs)
    (out / "ablation.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1))
    n = max((len(r["seeds"]) for r in rows), default=0)
    lines = [f"| run | held-out eval loss, mean ± sd ({n} seeds) | eval vs BF16, paired by seed: mean ± sd "
             f"| per-seed eval vs BF16 | train loss (last 10%) vs BF16 | s/step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        m, sd = r["eval_mean_sd"]
        pm, psd = r["eval_vs_bf16_mean_sd"]
        tm, tsd = r["train_vs_bf16_mean_sd"]
        per = ", ".join(f"{v:+.2f}%" for v in r["eval_vs_bf16_pct"])
        rel = "—" if r["name"] == "bf16" else f"{pm:+.2f}% ± {psd:.2f}"
        rel_t = "—" if r["name"] == "bf16" else f"{tm:+.2f}% ± {tsd:.2f}"
        note = ("" if r["finite"] else " (NaN)") + ("" if len(r["seeds"]) == n else f" ({len(r['seeds'])} seeds)")
        lines.append(f"| {r['name']}{note} | {m:.4f} ± {sd:.4f} | {rel} | "
                     f"{per if r['name'] != 'bf16' else '—'} | {rel_t} | {r['s_per_step']:.4f} |")
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

    by = {}
    for r in runs:
        by.setdefault(r["name"], {})[r["seed"]] = r
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    names = [r["name"] for r in rows]
    colors = {name: f"C{i}" for i, name in enumerate(CONFIGS)}
    base = next((r for r in rows if r["name"] == "bf16"), None)
    if base is not None and len(base["eval"]) > 1:  # BF16's own seed-to-seed spread, as a band
        sd = 100 * base["eval_mean_sd"][1] / base["eval_mean_sd"][0]
        axes[0].axhspan(-sd, sd, color="0.85", label="BF16 seed-to-seed sd")
    for i, r in enumerate(rows):  # panel 1: paired difference from BF16 per seed, mean ± sd
        if r["name"] == "bf16" or not r["eval_vs_bf16_pct"]:
            continue
        vals = r["eval_vs_bf16_pct"]
        axes[0].scatter([i] * len(vals), vals, color=colors[r["name"]], s=18, alpha=0.7)
        m, sd = r["eval_vs_bf16_mean_sd"]
        axes[0].errorbar([i], [m], yerr=[0.0 if math.isnan(sd) else sd], color=colors[r["name"]], capsize=4,
                         fmt="o", ms=7)
    axes[0].axhline(0.0, color="k", lw=0.6)
    axes[0].set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("held-out eval loss vs BF16 at the same seed (%)")
    axes[0].set_title("final eval loss vs BF16: seeds (dots), mean ± sd", fontsize=9)
    axes[0].legend(fontsize=8)
    for name in names:  # panel 2: training curves, mean over seeds, second half
        curves = [by[name][s]["train_losses"] for s in sorted(by[name])]
        mean = [statistics.fmean(v) for v in zip(*curves)]
        smooth = moving_mean(mean, max(1, len(mean) // 25))
        half = len(smooth) // 3
        style = "--" if name == "bf16" else "-"
        axes[1].plot(range(half, len(smooth)), smooth[half:], style, color=colors[name], label=name, lw=1.2)
        if name != "bf16" and "bf16" in by:  # panel 3: paired difference from BF16, mean over seeds
            diffs = [[a - b for a, b in zip(by[name][s]["train_losses"], by["bf16"][s]["train_losses"])]
                     for s in sorted(by[name]) if s in by["bf16"]]
            if diffs:
                d = moving_mean([statistics.fmean(v) for v in zip(*diffs)], max(1, len(mean) // 10))
                axes[2].plot(d, color=colors[name], label=name, lw=1.2)
    axes[1].set_title("training loss, seed mean, last 2/3 (4% moving mean)", fontsize=9)
    axes[2].set_title("training loss minus BF16's, same seed and batches (seed mean, 10% moving mean)", fontsize=9)
    axes[2].axhline(0.0, color="k", lw=0.6)
    for ax in axes[1:]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].set_ylabel("cross-entropy (nats / byte)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"small GPT on stdlib bytes: {meta['model']}, {meta['steps']} steps, {meta['device']}, "
                 f"{meta['date_utc']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=110)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seed indices")
    p.add_argument("--jobs", type=int, default=1, help="concurrent processes (one per configuration)")
    p.add_argument("--deadline", type=float, default=0.0, help="seconds from now after which no run goes on")
    p.add_argument("--deadline-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--init-seed", type=int, default=1234, help="initial weights use init_seed + seed")
    p.add_argument("--data-seed", type=int, default=99)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--gemm-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quantizer", default="auto", choices=("auto", "compiled", "eager"))
    p.add_argument("--runs", default=",".join(CONFIGS), help="comma-separated subset of the configurations")
    p.add_argument("--time-steps", type=int, default=5, help="steps timed per configuration (--step-times)")
    p.add_argument("--step-times", action="store_true")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-report", action="store_true", help="only DIR/runs.json (the workers of --jobs)")
    p.add_argument("--grad-error-only", action="store_true",
                   help="only the one-step gradient error of each recipe against float32 (no training)")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = set(args.runs) - set(CONFIGS)
    if unknown:
        p.error(f"--runs: unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    if args.deadline and not args.deadline_at:
        args.deadline_at = time.time() + args.deadline
    return args


def meta_of(args, device, root, nfiles, nbytes, argv) -> dict:
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": sys.version.split()[0], "stdlib": root, "files": nfiles,
        "bytes": nbytes, "steps": args.steps, "seeds": args.seed_list, "jobs": args.jobs,
        "model": f"{args.layers} layers, d={args.d_model}, {args.heads} heads, seq {args.seq}, batch {args.batch}",
        "tokens_per_step": args.batch * args.seq, "lr": args.lr, "gemm_dtype": args.gemm_dtype,
        "quantizer": args.quantizer, "eval_batches": args.eval_batches,
        "command": "python benchmarks/ablation.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }


_RUN_KEYS = ("device", "torch", "python", "stdlib", "files", "bytes", "steps", "model", "tokens_per_step", "lr",
             "gemm_dtype", "quantizer", "eval_batches")


def describe_runs_read(meta: dict, runs: list[dict]) -> None:
    """For --report-only: the run fields of ``meta`` (device, steps, model, dates, seeds, ...) taken from
    the metadata of the files read, joined with " / " where they differ, instead of this process's."""
    parts = meta.get("workers", [])
    for key in _RUN_KEYS:
        values = list(dict.fromkeys(str(m[key]) for m in parts if key in m))
        if values:
            meta[key] = next(m[key] for m in parts if key in m) if len(values) == 1 else " / ".join(values)
    dates = sorted({m["date_utc"] for m in parts if "date_utc" in m})
    if dates:
        meta["report_date_utc"] = meta["date_utc"]
        meta["date_utc"] = " and ".join(dates)
    meta["seeds"] = sorted({r["seed"] for r in runs})


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data, root, nfiles = stdlib_bytes()
    meta = meta_of(args, device, root, nfiles, int(data.numel()), argv)

    if args.report_only or (args.jobs > 1 and len(args.runs) > 1):
        if not args.report_only:  # one process per configuration, then the report from their files
            base = [a for a in (sys.argv[1:] if argv is None else argv)]
            procs = []
            for name in args.runs:
                cmd = [sys.executable, __file__, *base, "--runs", name, "--jobs", "1", "--no-report",
                       "--deadline-at", str(args.deadline_at), "--out", str(args.out / name)]
                procs.append(subprocess.Popen(cmd))
                if len(procs) >= args.jobs:
                    procs.pop(0).wait()
            for proc in procs:
                proc.wait()
        runs = []
        for f in sorted(args.out.glob("*/runs.json")):
            part = json.loads(f.read_text())
            runs += part["runs"]
            meta.setdefault("workers", []).append(part["meta"])
        if args.report_only:  # describe the runs read, not this process
            describe_runs_read(meta, runs)
        write_report(runs, meta, args.out)
        return 0

    data = data.to(device)
    split = int(data.numel() * 0.95)
    train_data, eval_data = data[:split], data[split:]
    print(f"data: {nfiles} files under {root}, {data.numel()} bytes ({split} train)", flush=True)
    if args.grad_error_only:
        errs = gradient_errors(args, train_data, device)
        lines = ["| recipe | relative gradient error vs float32 (mean of 4 batches) |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in errs.items()]
        (args.out / "gradient_error.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        return 0
    if args.step_times:
        step_times(args, train_data, device, args.out)
        return 0

    runs = []
    configs = recipes(args.gemm_dtype, args.quantizer)
    stopped = False
    for seed in args.seed_list:
        if stopped:
            break
        for name in [n for n in CONFIGS if n in args.runs]:
            try:
                r = train(name, configs[name], args, train_data, eval_data, args.steps, seed, device)
            except DeadlineReached as err:
                print(f"stopped: {err}", flush=True)
                meta.setdefault("stopped", []).append(str(err))
                (args.out / "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}))
                stopped = True
                break
            print(f"seed {seed} {name}: eval {r['eval']:.4f} train {r['final_train']:.4f} "
                  f"({r['seconds']:.1f} s, {r['s_per_step']:.4f} s/step)", flush=True)
            runs.append(r)
            meta["scaled_mm_status"] = {k: (v if v is True else str(v)) for k, v in scaled_mm_status().items()}
            meta["compiled_status"] = {k: (v if v is True else str(v)) for k, v in compiled_status().items()}
            (args.out / "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    if not args.no_report:
        write_report(runs, meta, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
