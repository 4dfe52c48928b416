"""Where does torch.compile of the spec's NVFP4 quantizer leave the eager spec's bits?

Compiles ``moe_fp4.formats.quantize_nvfp4`` (1x16 blocks, nearest rounding) and compares each output
(tensor scale, block scales, packed elements) with the eager spec on bf16-valued operands of the
sizes the recipes meet in training. For every differing block it prints the block's inputs and both
results, so the stage that differs (tensor amax, block scale, element rounding) can be read off.

  python benchmarks/probe_compiled_nvfp4.py [--shapes 8192x1024,1024x8192,256x8192] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_fp4.formats import quantize_nvfp4  # noqa: E402
from moe_fp4.formats.elements import E2M1, E4M3, decode_elements  # noqa: E402
from moe_fp4.formats.packing import unpack_fp4  # noqa: E402


def probe(shape, device, compiled) -> int:
    t = (torch.nn.functional.gelu(torch.randn(*shape, device=device)) * 0.3).to(torch.bfloat16).float()
    pc, sc, gc = compiled(t)
    pe, se, ge = quantize_nvfp4(t)
    bad_g = not torch.equal(gc.view(torch.int32), ge.view(torch.int32))
    s_bad = (sc.view(torch.uint8) != se.view(torch.uint8))
    ce, cc = unpack_fp4(pe), unpack_fp4(pc)
    e_bad = (ce != cc)
    blocks_bad = e_bad.reshape(*e_bad.shape[:-1], -1, 16).any(-1) | s_bad
    n = int(blocks_bad.sum())
    print(f"shape {shape}: tensor scale {'DIFFERS' if bad_g else 'same'} "
          f"(compiled {gc.item()!r} eager {ge.item()!r}); block scales differ in {int(s_bad.sum())} of "
          f"{s_bad.numel()} blocks; elements differ in {int(e_bad.sum())} of {e_bad.numel()}; blocks with any "
          f"difference: {n}", flush=True)
    idx = blocks_bad.reshape(-1).nonzero().flatten()[:6].tolist()
    xb = t.reshape(-1, 16)
    for b in idx:
        ecodes = ce.reshape(-1, 16)[b]
        ccodes = cc.reshape(-1, 16)[b]
        es, cs = int(se.view(torch.uint8).reshape(-1)[b]), int(sc.view(torch.uint8).reshape(-1)[b])
        d_e = float(decode_elements(torch.tensor([es], dtype=torch.uint8), E4M3)[0]) * float(ge)
        print(f"  block {b}: amax {float(xb[b].abs().max())!r} scale code eager {es:#04x} compiled {cs:#04x} "
              f"(d eager {d_e!r})", flush=True)
        for j in (ecodes != ccodes).nonzero().flatten()[:4].tolist():
            x = float(xb[b, j])
            print(f"    x {x!r} (bits {torch.tensor([x]).view(torch.int32).item():#010x}) x/d {x / d_e!r} "
                  f"eager code {int(ecodes[j])} ({float(decode_elements(ecodes[j:j+1], E2M1)[0])}) "
                  f"compiled code {int(ccodes[j])} ({float(decode_elements(ccodes[j:j+1], E2M1)[0])})", flush=True)
    return n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192x1024,1024x8192,256x8192,256x384")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    compiled = torch.compile(quantize_nvfp4, dynamic=False)
    total = 0
    for s in args.shapes.split(","):
        shape = tuple(int(v) for v in s.split("x"))
        for _ in range(args.repeats):
            total += probe(shape, torch.device(args.device), compiled)
    print(f"blocks differing in all: {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
