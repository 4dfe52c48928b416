"""`python -m moe_fp4 payload`: bytes per token and per batch of each all-to-all payload format.

The sizes are measured on tensors that the spec actually produces (a sample of random tokens is
quantized in every format and the bytes of the resulting tensors are counted), not taken from a
formula alone.
"""

from __future__ import annotations

import argparse

import torch

from moe_fp4.formats.fp8_blockwise import quantize_fp8_blockwise
from moe_fp4.formats.mx import quantize_mxfp4, quantize_mxfp8
from moe_fp4.formats.nvfp4 import pack_nvfp4_rows, quantize_nvfp4
from moe_fp4.formats.packing import pack_mxfp4_rows

PAYLOAD_FORMATS = ("bf16", "fp8", "mxfp8", "mxfp4", "nvfp4")


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_payload_bytes(hidden: int, sample_tokens: int = 16) -> dict[str, dict[str, float]]:
    """Quantize ``sample_tokens`` random BF16 tokens of size ``hidden`` in every payload format.

    Returns {format: {"per_token": bytes per token row, "per_message": bytes sent once per message}}.
    The nvfp4 row is the dispatch's (``pack_nvfp4_rows``): it carries the sender's 4-byte tensor scale,
    so that rows of several senders decode together.
    """
    if hidden <= 0 or hidden % 128:
        raise ValueError(f"hidden: expected a positive multiple of 128, got {hidden}")
    x = torch.randn(sample_tokens, hidden).to(torch.bfloat16)
    out: dict[str, dict[str, float]] = {}
    out["bf16"] = {"per_token": _nbytes(x) / sample_tokens, "per_message": 0}
    out["fp8"] = {"per_token": _nbytes(*quantize_fp8_blockwise(x)) / sample_tokens, "per_message": 0}
    out["mxfp8"] = {"per_token": _nbytes(*quantize_mxfp8(x)) / sample_tokens, "per_message": 0}
    out["mxfp4"] = {"per_token": _nbytes(pack_mxfp4_rows(*quantize_mxfp4(x))) / sample_tokens, "per_message": 0}
    out["nvfp4"] = {"per_token": _nbytes(pack_nvfp4_rows(*quantize_nvfp4(x))) / sample_tokens, "per_message": 0}
    return out


def payload_table(hidden: int, tokens: int, topk: int) -> str:
    sizes = measure_payload_bytes(hidden)
    bf16, fp8 = sizes["bf16"]["per_token"], sizes["fp8"]["per_token"]
    lines = [
        f"hidden {hidden}, {tokens} tokens, top-{topk}: a batch sends each token to at most {topk} ranks,",
        "so the batch column is tokens x top-k x bytes per token (+ per-message scales).",
        "",
        f"{'format':<8} {'B/token':>9} {'B/element':>10} {'MiB/batch':>10} {'vs bf16':>8} {'vs fp8':>8}",
    ]
    for name in PAYLOAD_FORMATS:
        per_tok = sizes[name]["per_token"]
        batch = tokens * topk * per_tok + sizes[name]["per_message"]
        lines.append(f"{name:<8} {per_tok:>9.0f} {per_tok / hidden:>10.4f} {batch / 2**20:>10.2f} "
                     f"{per_tok / bf16:>8.3f} {per_tok / fp8:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_fp4 payload", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (a multiple of 128)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--topk", type=int, default=8, help="experts per token")
    args = ap.parse_args(argv)
    for name in ("tokens", "topk"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name}: expected a positive integer")
    try:
        print(payload_table(args.hidden, args.tokens, args.topk))
    except ValueError as e:
        ap.error(str(e))
    return 0
