"""A small driver that runs every native op once on small, awkward inputs and compares each result
with the spec. Meant for compute-sanitizer (memcheck, racecheck, initcheck):

    compute-sanitizer --tool memcheck python -m moe_fp4.ops.selfcheck

Exits 0 when every result matches the spec bit for bit.
"""

from __future__ import annotations

import sys

import torch

from moe_fp4 import formats, ops


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).cpu()


def _same(name: str, got, want) -> bool:
    ok = got.shape == want.shape and got.dtype == want.dtype and bool((_bits(got) == _bits(want)).all())
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return ok


def _same_cols(name: str, p, s, lens, offs=None) -> bool:
    """The column op against the spec: data, scales and group offsets."""
    want = formats.mxfp4_rows_to_fp8_cols(p, s, lens, offs)
    got = ops.mxfp4_rows_to_fp8_cols(p, s, lens, offs)
    return all([_same(f"mxfp4_rows_to_fp8_cols {name} {what}", g, w)
                for g, w, what in zip(got, want, ("data", "scales", "goffs"))])


def run(device: str = "cuda") -> bool:
    ok = True
    lens = torch.tensor([130, 0, 1, 77, 5], dtype=torch.int64, device=device)
    n = int(lens.sum()) + 3
    offs = torch.tensor([0, 130, 138, 139, 131], dtype=torch.int64, device=device)
    for h in (256, 384):
        x = torch.randn(n, h, device=device, dtype=torch.bfloat16) * 4
        x[0, :32] = float("nan")
        x[1, 5] = float("inf")
        x[2, :64] = 0
        for r in ("up", "down"):
            p, s = ops.quantize_mxfp4(x, scale_rounding=r)
            pr, sr = formats.quantize_mxfp4(x, scale_rounding=r)
            ok &= _same(f"quantize_mxfp4 h={h} {r}", p, pr) & _same("  scales", s, sr)
        rows = ops.quantize_mxfp4_rows(x)
        ok &= _same(f"quantize_mxfp4_rows h={h}", rows, formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x)))
        out = torch.zeros(n + 4, rows.shape[1], dtype=torch.uint8, device=device)
        perm = torch.randperm(n + 4, device=device)[:n]
        ops.quantize_mxfp4_rows(x, out=out, row_index=perm)
        ok &= _same("  at row_index", out[perm], rows)
        p, s = formats.quantize_mxfp4(x)
        want = formats.mxfp4_to_fp8_blockwise(p, s)
        for got, w, what in zip(ops.mxfp4_to_fp8_blockwise(p, s), want, ("data", "scales", "underflow")):
            ok &= _same(f"mxfp4_to_fp8_blockwise h={h} {what}", got, w)
        got = ops.mxfp4_rows_to_fp8_blockwise(rows, h, lens, offs)
        want = ops._ops._spec_fp8_rows(p, s, lens, offs)
        ok &= _same(f"mxfp4_rows_to_fp8_blockwise h={h} (splits) data", got[0], want[0])
        ok &= _same_cols(f"h={h}", p, s, lens, offs)
        ok &= _same_cols(f"h={h} back to back", p, s, lens)
        # segments starting on 16-row boundaries: the one-pass column path (those above take two passes)
        lens32 = torch.tensor([64, 0, 48, 80, 7], dtype=torch.int64, device=device)
        assert not ops._ops.column_plan(lens32, None, 199)[1] and ops._ops.column_plan(lens, offs, n)[1]
        ok &= _same_cols(f"h={h} one pass", p[:199], s[:199], lens32)
        # starts on 32-row boundaries: the one pass with the host's group table (rows loaded early)
        lens_t = torch.tensor([64, 0, 32, 96, 7], dtype=torch.int64, device=device)
        ok &= _same_cols(f"h={h} one pass, group table", p[:199], s[:199], lens_t)
        # offsets on 32-row boundaries with gaps (one pass: the last group's zero rows, the zero pass's windows)
        offs32 = torch.tensor([128, 0, 64, 0, 192], dtype=torch.int64, device=device)
        lens_g = torch.tensor([33, 0, 50, 20, 7], dtype=torch.int64, device=device)
        assert not ops._ops.column_plan(lens_g, offs32, 210)[1]
        ok &= _same_cols(f"h={h} one pass, offsets with gaps", p[:210], s[:210], lens_g, offs32)
        # the same splits and ragged ones with offsets given on the host (copied to the device without waiting)
        ok &= _same_cols(f"h={h} host splits, one pass", p[:199], s[:199], lens_t.cpu())
        ok &= _same_cols(f"h={h} host splits, two passes", p, s, lens.cpu(), offs.cpu())
        p[1, :4] = 0x88
        bad = s.clone()
        bad[0, 0], bad[1, 1], bad[2, :] = 0xFF, 254, 0
        ok &= _same(f"dequantize_mxfp4 h={h}", ops.dequantize_mxfp4(p, bad),
                    formats.dequantize_mxfp4(p, bad, dtype=torch.bfloat16))
        bad[3, 2] = 252  # the two-pass scale kernel's exact fallback for the top scale bytes
        ok &= _same_cols(f"h={h} top scale bytes", p, bad, lens)
        q, qs = ops.quantize_fp8_blockwise(x)
        qr, qsr = formats.quantize_fp8_blockwise(x, block=(1, 128))
        ok &= _same(f"quantize_fp8_blockwise h={h}", q, qr) & _same("  scales", qs, qsr)
        for dtype in (torch.bfloat16, torch.float32):  # n rows: a partial last 128-row tile
            xd = x.to(dtype)
            xt = torch.nn.functional.pad(xd.t(), (0, -n % 128))
            want = (*formats.quantize_fp8_blockwise(xd, block=(1, 128)),
                    *formats.quantize_fp8_blockwise(xt, block=(1, 128)))
            for got, w, what in zip(ops.quantize_fp8_rows_cols(xd), want, ("data", "scales", "data_t", "scales_t")):
                ok &= _same(f"quantize_fp8_rows_cols h={h} {dtype} {what}", got, w)
            wd, ws = formats.quantize_fp8_blockwise(xd[:128], block=(128, 128))
            for got, w, what in zip(ops.quantize_fp8_tiles(xd[:128]), (wd, ws, wd.t()), ("data", "scales", "data_t")):
                ok &= _same(f"quantize_fp8_tiles h={h} {dtype} {what}", got, w)
            stack = torch.stack((xd[:128], xd[-128:]))  # two weights: each one's transpose stored on its own
            got_t = ops.quantize_fp8_tiles(stack)[2]
            for e in range(2):
                want_t = formats.quantize_fp8_blockwise(stack[e].t().contiguous(), block=(128, 128))[0]
                ok &= _same(f"quantize_fp8_tiles stack h={h} {dtype} data_t[{e}]", got_t[e], want_t)
        # the dispatch's receive side: each row written to its slots' rows (-1 and out-of-range skipped)
        r = n + 4 + n  # rows perm (n of the first n + 4), then n + 4 + t for the second slot of row t
        second = torch.arange(n, device=device) + n + 4
        slots = torch.stack((perm, second, torch.full_like(perm, -1)), dim=1)
        slots[0, 2], slots[1, 2] = r, -7
        data, scales, _ = formats.mxfp4_to_fp8_blockwise(*formats.unpack_mxfp4_rows(rows, h))
        token = torch.full((r,), -1, dtype=torch.int64, device=device)
        token[perm], token[second] = torch.arange(n, device=device), torch.arange(n, device=device)
        named = token >= 0
        got = ops.mxfp4_rows_expand_fp8_blockwise(rows, h, slots, r)
        ok &= _same(f"mxfp4_rows_expand_fp8_blockwise h={h} data", got[0][named], data[token[named]])
        ok &= _same("  scales", got[1][named], scales[token[named]])
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            ok &= _same(f"quantize_nvfp4_rows h={h} {dtype}", ops.quantize_nvfp4_rows(x.to(dtype)),
                        formats.pack_nvfp4_rows(*formats.quantize_nvfp4(x.to(dtype))))
    if device != "cpu":
        torch.cuda.synchronize()
    return ok


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        print("selfcheck: needs a CUDA GPU")
        return 2
    ops.build()
    return 0 if run() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
