"""Expert-parallel dispatch/combine on real multi-process groups (gloo, 2, 3 and 4 ranks).

One pool of 4 spawned workers runs every case; a case on n ranks uses the group of ranks 0..n-1.
Every rank draws the whole world's tokens and routing from the case's seed, so each rank can build
the single-process reference for its own tokens. The case functions (``case_*``) also run over NCCL
in test_ep_gpu.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from _compare import assert_bitwise_equal, case_seed, expect_value_error

from moe_fp4 import formats
from moe_fp4.ep import Buffer, combine_with_grad, dispatch_with_grad
from moe_fp4.ep.backends import TorchDistributedBackend

H = 128  # a multiple of 128 so that every payload (fp8 too) applies
SCENARIOS = ("random", "empty_rank", "one_expert", "k_gt_local", "duplicates", "no_route")


# ------------------------------------------------------------------------------------------------
# data: the whole world's tokens and routing, the same on every rank
# ------------------------------------------------------------------------------------------------


def make_world(seed: int, world: int, scenario: str = "random", *, experts_per_rank: int = 3, k: int = 3,
               dyadic: bool = False):
    """Per rank: x float32 [T_r, H], topk_idx int64 [T_r, k], topk_weights float32 [T_r, k]; and the
    number of experts. Values are drawn fresh from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    num_experts = experts_per_rank * world
    if scenario == "k_gt_local":
        k = experts_per_rank + 2  # more slots than one rank has experts
    xs, idxs, ws = [], [], []
    for r in range(world):
        t = int(torch.randint(5, 12, (1,), generator=g))
        if scenario == "empty_rank" and r == 1:
            t = 0
        if dyadic:  # small dyadic values: every sum below is exact in bf16 and fp8
            x = torch.randint(-2, 3, (t, H), generator=g).float() * 0.5
            w = torch.randint(1, 3, (t, k), generator=g).float() * 0.5
        else:
            x = torch.randn(t, H, generator=g) * torch.exp(torch.randn(t, 1, generator=g))
            w = torch.rand(t, k, generator=g)
        scores = torch.rand(t, num_experts, generator=g)
        idx = torch.argsort(scores, dim=1)[:, :k].clone()  # distinct experts per token
        if scenario in ("random", "empty_rank", "k_gt_local", "no_route"):
            idx[torch.rand(t, k, generator=g) < 0.2] = -1
        if scenario == "no_route" and t:
            idx[: max(1, t // 3)] = -1
        if scenario == "one_expert":
            idx[:] = -1
            idx[:, 0] = num_experts - 1
        if scenario == "duplicates" and k >= 2:
            idx[:, 1] = idx[:, 0]
            idx[::2, 2 % k] = idx[::2, 0]
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws, num_experts


def expert_params(seed: int, num_experts: int):
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    a = torch.randn(num_experts, H, generator=g)
    b = torch.randn(num_experts, H, generator=g) * 0.1
    return a, b


def apply_expert(kind: str, params, expert_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Row-independent experts (the same bits whatever batch a row is in): bf16 [n, H] -> bf16."""
    if kind == "identity":
        return rows.to(torch.bfloat16)
    a, b = (p.to(rows.device) for p in params)
    if kind == "dyadic":
        a = torch.where(a > 0, 1.0, -1.0)
        b = torch.zeros_like(b)
        return (rows.float() * a[expert_ids] + b[expert_ids]).to(torch.bfloat16)
    return torch.relu(rows.float() * a[expert_ids] + b[expert_ids]).to(torch.bfloat16)


def run_local_experts(kind, params, out, rank, experts_per_rank, values):
    """Apply each local expert to its ragged segment of the dispatch output."""
    y = torch.empty_like(values, dtype=torch.bfloat16)
    start = 0
    for e, n in enumerate(out.tokens_per_expert):
        ids = torch.full((n,), rank * experts_per_rank + e, dtype=torch.int64, device=values.device)
        y[start:start + n] = apply_expert(kind, params, ids, values[start:start + n])
        start += n
    return y


def reference_moe(kind, params, x, idx, w, world, experts_per_rank, *, weighted=True):
    """The single-process MoE of one rank's tokens with combine's documented rounding: per rank, the
    float32 sum over the token's slots there (ascending), rounded to bf16 (the wire), then the
    float32 sum over ranks (ascending), rounded to bf16."""
    t, k = idx.shape
    xb = x.to(torch.bfloat16)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for r in range(world):
        lo, hi = r * experts_per_rank, (r + 1) * experts_per_rank
        on_r = (idx >= lo) & (idx < hi)
        partial = torch.zeros_like(out)
        for j in range(k):
            sel = on_r[:, j]
            y = apply_expert(kind, params, idx[sel, j], xb[sel]).float()
            partial[sel] = partial[sel] + (y * w[sel, j:j + 1] if weighted else y)
        routed = on_r.any(dim=1)
        out[routed] = out[routed] + partial[routed].to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def spec_rows(x: torch.Tensor, payload: str) -> torch.Tensor:
    """The byte rows the spec defines for one sender's batch x [T, H]."""
    if payload == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    if payload == "fp8":
        d, s = formats.quantize_fp8_blockwise(x, block=(1, 128))
        return torch.cat((d.view(torch.uint8), s.view(torch.uint8)), dim=1)
    if payload == "mxfp4":
        return formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    if payload == "nvfp4":
        p, s, gs = formats.quantize_nvfp4(x)
        return torch.cat((p, s.view(torch.uint8), gs.reshape(1, 1).expand(x.shape[0], 1).contiguous().view(
            torch.uint8)), dim=1)
    raise AssertionError(payload)


def expected_order(idxs, rank, experts_per_rank):
    """(source rank, token, slot) of each dispatch output row: grouped by local expert, then by
    source rank, token, slot."""
    order = []
    for e in range(rank * experts_per_rank, (rank + 1) * experts_per_rank):
        for s, idx in enumerate(idxs):
            for t, j in (idx == e).nonzero().tolist():
                order.append((s, t, j))
    return order


def with_specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Zero block, huge and tiny magnitudes, a NaN and an Inf in some rows."""
    x = x.clone()
    if x.shape[0] >= 4:
        x[0, :32] = 0.0
        x[1, 5] = float("nan")
        x[2, 40] = float("inf")
        x[3] *= 2.0 ** (seed % 40 - 20)
    return x


# ------------------------------------------------------------------------------------------------
# cases (run on every rank)
# ------------------------------------------------------------------------------------------------


def _to(dev, *ts):
    return [t.to(dev) for t in ts]


def case_roundtrip_bf16(ctx, seed, scenario):
    """bf16 dispatch, experts, combine == the single-process MoE, bit for bit."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world, scenario)
    ell = n_exp // world
    x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
    buf = Buffer(n_exp, ctx.group, payload="bf16")
    out = buf.dispatch(x, idx, w)
    # layout facts: per-expert counts over the whole world, ragged splits without padding
    want = [sum(int((i == e).sum()) for i in idxs) for e in range(rank * ell, (rank + 1) * ell)]
    assert out.tokens_per_expert == want, (out.tokens_per_expert, want)
    assert out.split_lens.tolist() == want
    assert out.split_offsets.tolist() == [sum(want[:e]) for e in range(ell)]
    order = expected_order(idxs, rank, ell)
    values = out.values()
    assert values.shape == (len(order), H)
    if order:
        ref_rows = torch.stack([xs[s][t] for s, t, _ in order]).to(dev, torch.bfloat16)
        assert_bitwise_equal(values, ref_rows, "received bf16 rows")
        ref_w = torch.tensor([ws[s][t, j] for s, t, j in order], device=dev)
        assert_bitwise_equal(out.row_weights, ref_w, "row weights")
    params = expert_params(seed, n_exp)
    for kind in ("identity", "affine"):
        y = run_local_experts(kind, params, out, rank, ell, values)
        got = buf.combine(y, out.handle)
        ref = reference_moe(kind, _to(dev, *params), x, idx, w, world, ell)
        assert_bitwise_equal(got, ref, f"combine ({kind} experts)")
        # weights: applied by combine; weighted=False sums what the caller gives
        unweighted = buf.combine(y, out.handle, weighted=False)
        assert_bitwise_equal(unweighted, reference_moe(kind, _to(dev, *params), x, idx, w, world, ell,
                                                       weighted=False), "combine, weighted=False")
        caller_weighted = y.float() * out.row_weights.unsqueeze(1)
        assert_bitwise_equal(buf.combine(caller_weighted, out.handle, weighted=False), got,
                             "combine of caller-weighted rows")
    # a cached-handle dispatch of other tokens reuses the layout
    x2 = torch.randn_like(x)
    again = buf.dispatch(x2, handle=out.handle)
    fresh = buf.dispatch(x2, idx, w)
    assert_bitwise_equal(again.rows, fresh.rows, "cached-handle dispatch rows")
    return len(order)


def case_payload_rows(ctx, seed, payload):
    """Received rows equal the spec's bytes for every payload and routing scenario; the FP8 output
    equals the spec's conversion."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    for n, scenario in enumerate(SCENARIOS):
        xs, idxs, ws, n_exp = make_world(seed + n, world, scenario)
        xs = [with_specials(x, seed + r) for r, x in enumerate(xs)]
        ell = n_exp // world
        x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
        buf = Buffer(n_exp, ctx.group, payload=payload)
        out = buf.dispatch(x, idx, w, return_fp8=True)
        order = expected_order(idxs, rank, ell)
        per_source = [spec_rows(xs[s].to(dev), payload) for s in range(world)]
        assert out.rows.shape[0] == len(order), scenario
        if order:
            want = torch.stack([per_source[s][t] for s, t, _ in order])
            assert_bitwise_equal(out.rows, want, f"{payload} rows ({scenario})")
        data, scales = out.fp8
        assert data.shape == (len(order), H) and scales.shape == (len(order), H // 128)
        if order and payload == "mxfp4":
            packed, sc = formats.unpack_mxfp4_rows(out.rows, H)
            d_ref, s_ref, _ = formats.mxfp4_to_fp8_blockwise(packed, sc)
            assert_bitwise_equal(data, d_ref, "mxfp4 -> fp8 data")
            assert_bitwise_equal(scales, s_ref, "mxfp4 -> fp8 scales")
        if order and payload == "fp8":
            src = torch.stack([xs[s][t] for s, t, _ in order]).to(dev)
            d_ref, s_ref = formats.quantize_fp8_blockwise(src, block=(1, 128))
            assert_bitwise_equal(data, d_ref, "fp8 data")
            assert_bitwise_equal(scales, s_ref, "fp8 scales")
        # one FP8 row per received token: expanding it by the handle gives the expert rows above
        tok = buf.dispatch(x, handle=out.handle, return_fp8="tokens")
        assert tok.fp8 is None and tok.recv_fp8[0].shape == (out.handle.num_recv_tokens, H)
        assert_bitwise_equal(tok.recv_fp8[0][out.handle.expand_row], data, f"{payload} per-token fp8 data ({scenario})")
        assert_bitwise_equal(tok.recv_fp8[1][out.handle.expand_row], scales, f"{payload} per-token fp8 scales")
        # received top-k ids: local ids on this rank, -1 elsewhere, in (source rank, token) order
        recv = [(s, t) for s, i in enumerate(idxs) for t in range(i.shape[0])
                if bool(((i[t] >= rank * ell) & (i[t] < (rank + 1) * ell)).any())]
        assert out.recv_topk_idx.shape[0] == len(recv)
        for row, (s, t) in enumerate(recv):
            ids = idxs[s][t]
            local = torch.where((ids >= rank * ell) & (ids < (rank + 1) * ell), ids - rank * ell, -1)
            assert out.recv_topk_idx[row].tolist() == local.tolist(), (scenario, row)
            assert_bitwise_equal(out.recv_topk_weights[row].cpu(), ws[s][t], "recv weights")
    return None


def case_autograd(ctx, seed, backward_payload):
    """Gradients of x and of the top-k weights through dispatch -> experts -> combine equal the
    single-process autograd reference (dyadic data: every sum is exact)."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world, "duplicates" if seed % 2 else "random", dyadic=True)
    ell = n_exp // world
    params = expert_params(seed, n_exp)
    gs = [torch.randint(-2, 3, (x.shape[0], H), generator=torch.Generator().manual_seed(seed + 7 + r)).float()
          * 0.5 for r, x in enumerate(xs)]
    x = xs[rank].to(dev, torch.bfloat16).requires_grad_(True)
    w = ws[rank].to(dev).requires_grad_(True)
    idx = idxs[rank].to(dev)
    buf = Buffer(n_exp, ctx.group, payload="bf16")
    values, out = dispatch_with_grad(buf, x, idx, w, backward_payload=backward_payload)
    y = torch.empty(values.shape, dtype=torch.bfloat16, device=dev)
    start = 0
    pieces = []
    for e, n in enumerate(out.tokens_per_expert):
        ids = torch.full((n,), rank * ell + e, dtype=torch.int64, device=dev)
        pieces.append(apply_expert("dyadic", params, ids, values[start:start + n]))
        start += n
    y = torch.cat(pieces) if pieces else y
    got = combine_with_grad(buf, y, out.handle, w, backward_payload=backward_payload)
    got.backward(gs[rank].to(dev, torch.bfloat16))

    # single-process reference: plain MoE of the rank's tokens
    xr = xs[rank].to(dev, torch.bfloat16).requires_grad_(True)
    wr = ws[rank].to(dev).requires_grad_(True)
    acc = torch.zeros(xr.shape, dtype=torch.float32, device=dev)
    for j in range(idx.shape[1]):
        sel = idx[:, j] >= 0
        contrib = apply_expert("dyadic", params, idx[sel, j], xr[sel]).float() * wr[sel, j:j + 1]
        acc = acc.index_add(0, sel.nonzero().reshape(-1), contrib)
    ref = acc.to(torch.bfloat16)
    ref.backward(gs[rank].to(dev, torch.bfloat16))
    assert_bitwise_equal(got, ref, "forward")
    assert_bitwise_equal(x.grad, xr.grad, f"grad x ({backward_payload})")
    assert_bitwise_equal(w.grad, wr.grad, f"grad topk_weights ({backward_payload})")
    return None


def case_autograd_sync_free(ctx, seed):
    """Forward and gradients (x, top-k weights) through a sync-free dispatch and combine equal the
    synced ones bit for bit; y's rows past the experts' rows hold NaN and are ignored."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world, "random", dyadic=True)
    ell = n_exp // world
    params = expert_params(seed, n_exp)
    g = torch.randint(-2, 3, (xs[rank].shape[0], H), generator=torch.Generator().manual_seed(seed + rank)).float()
    buf = Buffer(n_exp, ctx.group, payload="bf16")

    def run(**bounds):
        x = xs[rank].to(dev, torch.bfloat16).requires_grad_(True)
        w = ws[rank].to(dev).requires_grad_(True)
        values, out = dispatch_with_grad(buf, x, idxs[rank].to(dev), w, expert_alignment=4, **bounds)
        y = torch.full(values.shape, float("nan"), dtype=torch.bfloat16, device=dev)
        for e, (lo, n) in enumerate(zip(out.split_offsets.tolist(), out.split_lens.tolist())):
            ids = torch.full((n,), rank * ell + e, dtype=torch.int64, device=dev)
            y[lo:lo + n] = apply_expert("dyadic", params, ids, values[lo:lo + n])
        got = combine_with_grad(buf, y, out.handle, w)
        got.backward(g.to(dev, torch.bfloat16))
        return got, x.grad, w.grad

    synced = run()
    free = run(max_recv_tokens=world * (max(t.shape[0] for t in xs) + 1))
    for name, a, b in zip(("forward", "grad x", "grad topk_weights"), free, synced):
        assert_bitwise_equal(a, b, f"{name} (sync-free)")
    return None


def case_errors(ctx, seed):
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world)
    x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
    buf = Buffer(n_exp, ctx.group, payload="mxfp4")
    # experts that do not split over the world
    expect_value_error(lambda: Buffer(n_exp + 1, ctx.group), "num_experts")
    # an id out of range on the last rank only: every rank raises
    bad = idx.clone()
    if rank == world - 1 and bad.numel():
        bad[0, 0] = n_exp
    expect_value_error(lambda: buf.dispatch(x, bad, w), "topk_idx", "out of range")
    neg = idx.clone()
    if rank == 0 and neg.numel():
        neg[-1, -1] = -2
    expect_value_error(lambda: buf.dispatch(x, neg, w), "topk_idx")
    # hidden not a multiple of 32 (128 for fp8), on every rank
    expect_value_error(lambda: buf.dispatch(x[:, :48], idx, w), "x", "32")
    expect_value_error(lambda: buf.dispatch(x[:, :96], idx, w, payload="fp8"), "x", "128")
    # ranks that disagree on the hidden size
    xh = x[:, :96] if rank == 0 else x
    expect_value_error(lambda: buf.dispatch(xh, idx, w), "hidden")
    # ranks that disagree on k
    kk = idx[:, :2] if rank == 1 else idx
    wk = w[:, :2] if rank == 1 else w
    expect_value_error(lambda: buf.dispatch(x, kk, wk), "num_topk")
    # dtype and device mismatches: the offending rank names the argument, the others abandon too
    xi = x.to(torch.int32) if rank == 0 else x
    expect_value_error(lambda: buf.dispatch(xi, idx, w), "x" if rank == 0 else "rejected")
    idf = idx.float() if rank == world - 1 else idx
    expect_value_error(lambda: buf.dispatch(x, idf, w), "topk_idx" if rank == world - 1 else "rejected")
    xm = x.to("meta") if rank == 0 else x
    expect_value_error(lambda: buf.dispatch(xm, idx, w), "x" if rank == 0 else "rejected")
    wd = w.to(torch.int64) if rank == 0 else w
    expect_value_error(lambda: buf.dispatch(x, idx, wd), "topk_weights" if rank == 0 else "rejected")
    # after all that the group still works
    out = buf.dispatch(x, idx, w)
    # combine and cached dispatch: handle, row count and world-size mismatches
    y = out.values()
    expect_value_error(lambda: buf.combine(torch.cat((y, y.new_zeros(1, H))), out.handle), "y")
    expect_value_error(lambda: buf.combine(y, object()), "handle")
    expect_value_error(lambda: buf.dispatch(torch.cat((x, x.new_zeros(1, H))), handle=out.handle), "x")
    other = Buffer(n_exp * 2, ctx.group)
    expect_value_error(lambda: other.combine(y, out.handle), "handle", "world size")
    local = Buffer(n_exp, backend="local")
    expect_value_error(lambda: local.combine(y, out.handle), "handle")
    if dev.type == "cpu":
        expect_value_error(lambda: Buffer(n_exp, ctx.group, backend="nccl"), "backend")
    nw = Buffer(n_exp, ctx.group).dispatch(x, idx)
    expect_value_error(lambda: buf.combine(nw.values(), nw.handle), "weighted")
    return None


def case_bad_input_on_one_rank(ctx, seed, entry, bad_rank):
    """Bad input on rank ``bad_rank`` only, for each check in front of a collective of ``entry``:
    every rank raises ValueError (the bad rank naming the argument, the others naming the rank or
    the disagreement) within seconds, and the group still works afterwards. Returns the slowest
    failing call in seconds."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world)
    x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
    buf = Buffer(n_exp, ctx.group, payload="mxfp4")
    out = buf.dispatch(x, idx, w)
    y = out.values()
    me = rank == bad_rank

    def one(good, bad, word):
        """Run ``bad`` on bad_rank and ``good`` elsewhere: ValueError everywhere, fast."""
        t0 = time.monotonic()
        expect_value_error(bad if me else good, word if me else "")
        return time.monotonic() - t0

    cases = {
        "dispatch": [
            (lambda: buf.dispatch(x, idx, w, return_fp8="cols"), "return_fp8"),
            (lambda: buf.dispatch(x, idx, w, expert_alignment=0), "expert_alignment"),
            (lambda: buf.dispatch(x, idx, w, payload="int3"), "payload"),
            (lambda: buf.dispatch(x, idx[:-1] if idx.shape[0] else idx[:, :1], w), "topk_idx"),
        ],
        "sync_free": [
            (lambda: buf.dispatch(x, idx, w, max_recv_tokens=world * 16 + 1), "max_recv_tokens"),
            (lambda: buf.dispatch(x, idx, w, max_recv_tokens=world * 32), "max_recv_tokens"),  # sizes disagree
            (lambda: buf.dispatch(x, None, w, max_recv_tokens=world * 16), "topk_idx"),
        ],
        "cached_dispatch": [
            (lambda: buf.dispatch(torch.cat((x, x[:1])), handle=out.handle), "x"),
            (lambda: buf.dispatch(x.to(torch.int32), handle=out.handle), "x"),
            (lambda: buf.dispatch(x[:, :64], handle=out.handle), "hidden"),  # sizes disagree
            (lambda: buf.dispatch(x, handle=object()), "handle"),
        ],
        "combine": [
            (lambda: buf.combine(torch.cat((y, y[:1])), out.handle), "y"),
            (lambda: buf.combine(y[:, :64], out.handle), "hidden"),  # sizes disagree
            (lambda: buf.combine(y.to(torch.int64), out.handle), "y"),
            (lambda: buf.combine(y, object()), "handle"),
            (lambda: buf.combine(y, out.handle, payload="int3"), "payload"),
        ],
        "autograd": [
            (lambda: dispatch_with_grad(buf, x.requires_grad_(), idx, w, backward_payload="int3"),
             "backward_payload"),
            (lambda: combine_with_grad(buf, y.requires_grad_(), out.handle, w[:, :1]), "topk_weights"),
            (lambda: combine_with_grad(buf, y, out.handle, w, backward_payload="int3"), "backward_payload"),
            (lambda: combine_with_grad(buf, torch.cat((y, y[:1])), out.handle, w), "y"),
        ],
    }
    good = {
        "dispatch": lambda: buf.dispatch(x, idx, w),
        "sync_free": lambda: buf.dispatch(x, idx, w, max_recv_tokens=world * 16),
        "cached_dispatch": lambda: buf.dispatch(x, handle=out.handle),
        "combine": lambda: buf.combine(y, out.handle),
        "autograd": None,
    }
    good_autograd = [
        lambda: dispatch_with_grad(buf, x, idx, w),
        lambda: combine_with_grad(buf, y, out.handle, w),
        lambda: combine_with_grad(buf, y, out.handle, w),
        lambda: combine_with_grad(buf, y, out.handle, w),
    ]
    slowest = 0.0
    for i, (bad, word) in enumerate(cases[entry]):
        ok = good_autograd[i] if entry == "autograd" else good[entry]
        slowest = max(slowest, one(ok, bad, word))
        # the group still works: a full dispatch and combine
        again = buf.dispatch(x, idx, w)
        assert_bitwise_equal(buf.combine(again.values(), again.handle), buf.combine(y, out.handle), "after")
    return slowest


def case_sync_free(ctx, seed, payload, alignment, backend=None):
    """A sync-free dispatch (max_recv_tokens) holds the synced dispatch's bits on its valid rows: the
    expert rows and their FP8, the tables, the received tokens per source block, the combine (with
    NaN in y's rows past the experts'), a cached dispatch on its handle; check() passes."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    for n, scenario in enumerate(SCENARIOS):
        xs, idxs, ws, n_exp = make_world(seed + n, world, scenario)
        x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
        buf = Buffer(n_exp, ctx.group, payload=payload, backend=backend)
        ref = buf.dispatch(x, idx, w, return_fp8=True, expert_alignment=alignment)
        block = max(t.shape[0] for t in xs) + 1
        free = buf.dispatch(x, idx, w, return_fp8=True, expert_alignment=alignment, max_recv_tokens=world * block)
        free.handle.check()
        h, hr = free.handle, ref.handle
        rows = hr.num_rows
        assert h.sync_free and h.tokens_per_expert is None and h.num_rows >= rows
        what = f"{payload}, {scenario}, alignment {alignment}"
        for name in ("split_lens", "split_offsets"):
            assert_bitwise_equal(getattr(h, name), getattr(hr, name), f"{name} ({what})")
        # received token i of source s sits at row s * block + (i - first of s) of a sync-free dispatch
        padded = torch.cat([torch.arange(c) + s * block for s, c in enumerate(hr.recv_counts)]).to(dev)
        want_row = torch.where(hr.expand_row >= 0, padded[hr.expand_row.clamp(min=0)], -1) if padded.numel() \
            else hr.expand_row
        assert_bitwise_equal(h.expand_row[:rows], want_row, f"expand_row ({what})")
        for name in ("expand_slot", "row_weights"):
            assert_bitwise_equal(getattr(h, name)[:rows], getattr(hr, name), f"{name} ({what})")
        assert bool((h.expand_row[rows:] == -1).all()), what
        assert_bitwise_equal(free.rows[:rows], ref.rows, f"rows ({what})")
        assert_bitwise_equal(free.fp8[0][:rows], ref.fp8[0], f"fp8 data ({what})")
        assert_bitwise_equal(free.fp8[1][:rows], ref.fp8[1], f"fp8 scales ({what})")
        assert free.fp8[0].shape[0] == h.num_rows and free.rows.shape[0] == h.num_rows
        start = 0
        for s, count in enumerate(hr.recv_counts):  # the received tokens sit at the start of each source's block
            got = slice(s * block, s * block + count)
            want = slice(start, start + count)
            assert_bitwise_equal(free.recv_rows[got], ref.recv_rows[want], f"received rows from {s} ({what})")
            assert_bitwise_equal(h.recv_topk_idx[got], hr.recv_topk_idx[want], f"received ids ({what})")
            assert bool((h.recv_topk_idx[s * block + count:(s + 1) * block] == -1).all()), what
            start += count
        y = torch.randn(rows, H, generator=torch.Generator().manual_seed(seed)).to(dev, torch.bfloat16)
        y_free = torch.full((h.num_rows, H), float("nan"), dtype=torch.bfloat16, device=dev)
        y_free[:rows] = y
        for lo, c in zip(hr.split_offsets.tolist(), hr.split_lens.tolist()):  # gaps: NaN too
            y_free[lo + c:lo + -(-c // alignment) * alignment] = float("nan")
            y[lo + c:lo + -(-c // alignment) * alignment] = float("nan")
        assert_bitwise_equal(buf.combine(y_free, h), buf.combine(y, hr), f"combine ({what})")
        x2 = torch.randn_like(x)
        assert_bitwise_equal(buf.dispatch(x2, handle=h).rows[:rows], buf.dispatch(x2, handle=hr).rows,
                             f"cached rows ({what})")
    return None


def case_sync_free_overflow(ctx, seed, backend=None):
    """Tokens past a block, rows past the capacity and bad input on one rank are reported by
    check() (ValueError naming the bound); the rank with bad input raises at the dispatch."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world, "random")
    ell = n_exp // world
    x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
    buf = Buffer(n_exp, ctx.group, payload="mxfp4", backend=backend)
    routed = [[int(((i >= d * ell) & (i < (d + 1) * ell)).any(dim=1).sum()) for d in range(world)] for i in idxs]
    block = 2
    out = buf.dispatch(x, idx, w, max_recv_tokens=world * block)
    overflow = any(c > block for c in routed[rank]) or any(routed[s][rank] > block for s in range(world))
    if overflow:
        expect_value_error(out.handle.check, "max_recv_tokens")
    else:
        out.handle.check()
    # rows: a capacity of one row below what the experts here need
    need = sum(int(((i >= rank * ell) & (i < (rank + 1) * ell)).sum()) for i in idxs)
    big = world * (max(t.shape[0] for t in xs) + 1)
    out = buf.dispatch(x, idx, w, max_recv_tokens=big, max_recv_rows=max(need - 1, 0))
    if need:
        expect_value_error(out.handle.check, "max_recv_rows")
    else:
        out.handle.check()
    # bad input on the last rank: it raises at once (after the transfers), the others at check()
    bad = idx[:-1] if rank == world - 1 else idx
    if rank == world - 1:
        expect_value_error(lambda: buf.dispatch(x, bad, w, max_recv_tokens=big), "topk_idx")
    else:
        out = buf.dispatch(x, bad, w, max_recv_tokens=big)
        expect_value_error(out.handle.check, "rejected")
    # argument checks (every rank, before any transfer)
    expect_value_error(lambda: buf.dispatch(x, idx, w, max_recv_tokens=world * block + 1), "max_recv_tokens")
    expect_value_error(lambda: buf.dispatch(x, idx, w, max_recv_tokens=0), "max_recv_tokens")
    expect_value_error(lambda: buf.dispatch(x, handle=out.handle, max_recv_tokens=big), "max_recv_tokens")
    expect_value_error(lambda: buf.dispatch(x, idx, w, max_recv_tokens=big, max_recv_rows=-1), "max_recv_rows")
    # the group still works
    buf.dispatch(x, idx, w).handle.check()
    return None


def _aligned_rows(lens: list[int], alignment: int) -> tuple[list[int], list[int], int]:
    """(aligned starts, where each back-to-back row lands, rows in all) of an aligned layout."""
    padded = [-(-c // alignment) * alignment for c in lens]
    starts = [sum(padded[:e]) for e in range(len(lens))]
    dst = [starts[e] + i for e, c in enumerate(lens) for i in range(c)]
    return starts, dst, sum(padded)


def case_expert_alignment(ctx, seed, payload, alignment):
    """Each local expert's rows start on a multiple of expert_alignment: rows, values, FP8 rows,
    weights and the tables equal the back-to-back layout's at the shifted rows, the rows between are
    zero (their FP8 rows the conversion of a zero row), and combine ignores them, whatever y holds
    there."""
    from moe_fp4.ops._ops import column_plan

    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    for n, scenario in enumerate(("random", "one_expert", "empty_rank", "duplicates", "no_route")):
        xs, idxs, ws, n_exp = make_world(seed + n, world, scenario, experts_per_rank=4)
        x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
        buf = Buffer(n_exp, ctx.group, payload=payload)
        ref = buf.dispatch(x, idx, w, return_fp8=True)
        got = buf.dispatch(x, idx, w, return_fp8=True, expert_alignment=alignment)
        lens = ref.tokens_per_expert
        assert got.tokens_per_expert == lens and got.split_lens.tolist() == lens, scenario
        starts, dst_list, n_out = _aligned_rows(lens, alignment)
        assert got.split_offsets.tolist() == starts, (scenario, got.split_offsets.tolist(), starts)
        h = got.handle
        assert h.num_rows == n_out and got.rows.shape[0] == n_out and h.expert_alignment == alignment
        dst = torch.tensor(dst_list, dtype=torch.int64, device=dev)
        gap = torch.ones(n_out, dtype=torch.bool, device=dev)
        gap[dst] = False
        want_gaps = gap.nonzero().reshape(-1)
        if want_gaps.numel():
            assert_bitwise_equal(h.gap_rows, want_gaps, f"gap rows ({scenario})")
        else:
            assert h.gap_rows is None, scenario
        what = f"{payload}, alignment {alignment}, {scenario}"
        assert_bitwise_equal(got.rows[dst], ref.rows, f"expert rows ({what})")
        for out in (ref, got):  # each row on a 128-byte line
            assert out.rows.stride(0) % 128 == 0 and (not out.rows.is_cuda or out.rows.data_ptr() % 128 == 0), what
        assert int(got.rows[gap].count_nonzero()) == 0, f"gap rows not zero ({what})"
        assert_bitwise_equal(got.values()[dst], ref.values(), f"values ({what})")
        for mine, theirs, name in ((got.fp8[0], ref.fp8[0], "fp8 data"), (got.fp8[1], ref.fp8[1], "fp8 scales")):
            assert_bitwise_equal(mine[dst], theirs, f"{name} ({what})")
        # the FP8 rows are the conversion of the rows, gap rows included
        want_d, want_s = buf.payload.to_fp8_blockwise(got.rows, H)
        assert_bitwise_equal(got.fp8[0], want_d, f"fp8 data of the rows ({what})")
        assert_bitwise_equal(got.fp8[1], want_s, f"fp8 scales of the rows ({what})")
        assert_bitwise_equal(h.row_weights[dst], ref.row_weights, f"row weights ({what})")
        assert not bool(h.row_weights[gap].any()), what
        assert_bitwise_equal(h.expand_row[dst], ref.handle.expand_row, f"expand_row ({what})")
        assert bool((h.expand_row[gap] == -1).all()) and bool((h.expand_slot[gap] == -1).all()), what
        # every slot names the shifted row
        sl = ref.handle.slot_table
        assert_bitwise_equal(h.slot_table, torch.where(sl >= 0, dst[sl.clamp(min=0)] if dst.numel() else sl, -1),
                             f"slot table ({what})")
        # combine: gap rows of y are never read (huge values and NaN there change nothing)
        g = torch.Generator().manual_seed(seed + 100 + n)
        y_ref = torch.randn(ref.handle.num_rows, H, generator=g).to(dev)
        y = torch.full((n_out, H), float("nan"), device=dev)
        y[dst] = y_ref
        for weighted in (True, False):
            want = buf.combine(y_ref, ref.handle, weighted=weighted)
            assert_bitwise_equal(buf.combine(y, h, weighted=weighted), want, f"combine, weighted={weighted} ({what})")
        # a cached dispatch keeps the layout; another alignment with the handle is refused
        x2 = torch.randn(x.shape, generator=g).to(dev)
        again = buf.dispatch(x2, handle=h)
        assert_bitwise_equal(again.rows[dst], buf.dispatch(x2, handle=ref.handle).rows, f"cached dispatch ({what})")
        assert int(again.rows[gap].count_nonzero()) == 0, what
        expect_value_error(lambda b=buf, t=x2, hd=h: b.dispatch(t, handle=hd, expert_alignment=alignment + 1),
                            "expert_alignment", str(alignment))
        # with a multiple of 32 the column conversion of the rows takes the one-pass kernel
        if payload == "mxfp4" and alignment % 32 == 0 and sum(lens):
            assert column_plan(got.split_lens, got.split_offsets, n_out)[1] is False, what
        # the wgrad operand: the spec's column conversion of the rows; the back-to-back layout's
        # columns at the shifted rows, zero columns for the gap rows, the same scales
        if payload == "mxfp4":
            cd, cs, cg = got.to_fp8_cols()
            packed, sc = formats.unpack_mxfp4_rows(got.rows, H)
            sd, ss, sg = formats.mxfp4_rows_to_fp8_cols(packed, sc, got.split_lens, got.split_offsets)
            for a, b, name in ((cd, sd, "data"), (cs, ss, "scales"), (cg, sg, "group offsets")):
                assert_bitwise_equal(a, b, f"fp8 columns, {name} ({what})")
            rd, rs, rg = ref.to_fp8_cols()
            assert_bitwise_equal(cd[:, dst], rd, f"fp8 columns at the shifted rows ({what})")
            assert not bool(cd[:, gap].view(torch.uint8).any()), what
            assert_bitwise_equal(cs, rs, f"fp8 column scales ({what})")
            assert_bitwise_equal(cg, rg, f"group offsets ({what})")
        else:
            expect_value_error(got.to_fp8_cols, "to_fp8_cols", "mxfp4")
    for bad in (0, -32, 2.0, True, "32"):
        expect_value_error(lambda a=bad: buf.dispatch(x, idx, w, expert_alignment=a), "expert_alignment",
                            "positive int")
    return None


def case_autograd_aligned(ctx, seed, alignment):
    """Gradients of x and of the top-k weights through an aligned dispatch -> experts -> combine
    equal those of the back-to-back layout, bit for bit (dyadic data; junk in y's gap rows)."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world, "duplicates" if seed % 2 else "random", dyadic=True)
    gs = [torch.randint(-2, 3, (x.shape[0], H), generator=torch.Generator().manual_seed(seed + 7 + r)).float()
          * 0.5 for r, x in enumerate(xs)]
    results = []
    for a in (1, alignment):
        x = xs[rank].to(dev, torch.bfloat16).requires_grad_(True)
        w = ws[rank].to(dev).requires_grad_(True)
        buf = Buffer(n_exp, ctx.group, payload="bf16")
        values, out = dispatch_with_grad(buf, x, idxs[rank].to(dev), w, expert_alignment=a)
        junk = torch.zeros(values.shape, dtype=torch.bfloat16, device=dev)
        if out.handle.gap_rows is not None:
            junk[out.handle.gap_rows] = 1024.0
        y = values * 1.5 + junk  # the gap rows' junk must not reach the output or the gradients
        got = combine_with_grad(buf, y, out.handle, w)
        got.backward(gs[rank].to(dev, torch.bfloat16))
        results.append((got.detach(), x.grad, w.grad))
    for name, a, b in zip(("output", "grad x", "grad topk_weights"), results[0], results[1]):
        assert_bitwise_equal(b, a, f"{name}, alignment {alignment}")
    return None


def case_gather_path(ctx, seed):
    """Rows wider than the one-pass encode takes (or more ranks than it stores to) are encoded, then
    gathered by destination: the same received rows, synced and sync-free."""
    from moe_fp4.ep import backends as backends_module

    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    for n, scenario in enumerate(("random", "empty_rank")):
        xs, idxs, ws, n_exp = make_world(seed + n, world, scenario)
        x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
        buf = Buffer(n_exp, ctx.group, payload="mxfp4")
        n_free = world * (max(t.shape[0] for t in xs) + 1)
        one_pass = [buf.dispatch(x, idx, w), buf.dispatch(x, idx, w, max_recv_tokens=n_free)]
        saved, backends_module.PUSH_ROW_BYTES = backends_module.PUSH_ROW_BYTES, 0
        try:
            gathered = [buf.dispatch(x, idx, w), buf.dispatch(x, idx, w, max_recv_tokens=n_free)]
        finally:
            backends_module.PUSH_ROW_BYTES = saved
        for a, b in zip(one_pass, gathered):
            assert_bitwise_equal(b.rows, a.rows, f"gathered rows ({scenario})")
    return None


def case_direct_plan(ctx, seed, scenario):
    """The handle's batch sizes, count matrix and source token indices, and the direct backend's
    index plan (where each rank reads its rows and combine partials in the peers' buffers); the
    caller checks them across ranks."""
    from moe_fp4.ep.symmetric import direct_plan

    xs, idxs, ws, n_exp = make_world(seed, ctx.world_size, scenario)
    x, idx, w = _to(ctx.device, xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank])
    h = Buffer(n_exp, ctx.group, payload="mxfp4").dispatch(x, idx, w).handle
    plan = direct_plan(h)
    return dict(tokens=h.peer_num_tokens, counts=h.count_matrix, send=h.send_counts, recv=h.recv_counts,
                src_token=h.recv_src_token.tolist(), send_token=h.send_token.tolist(),
                recv_rank=plan["recv_rank"].tolist(),
                peer_table=plan["peer_rank_table"].tolist(), send_rank=plan["send_rank"].tolist(),
                send_peer_row=plan["send_peer_row"].tolist(), n=x.shape[0])


def check_direct_plan(res):
    """Every rank's view of the direct plan agrees with the other ranks' handles."""
    world = len(res)
    for me, r in enumerate(res):
        assert r["tokens"] == [q["n"] for q in res]
        assert r["counts"] == [q["send"] for q in res]
        assert [r["counts"][s][me] for s in range(world)] == r["recv"]
    for s, r in enumerate(res):
        # rank s's token t sent to rank d: read back on d at peer_table[t][d], by source s, as token t
        for t, row in enumerate(r["peer_table"]):
            for d, p in enumerate(row):
                if p >= 0:
                    assert res[d]["recv_rank"][p] == s and res[d]["src_token"][p] == t, (s, t, d, p)
        for i, (d, p) in enumerate(zip(r["send_rank"], r["send_peer_row"])):
            assert res[d]["recv_rank"][p] == s and res[d]["src_token"][p] == r["send_token"][i]
    for r in res:
        for s, t in zip(r["recv_rank"], r["src_token"]):
            assert t in res[s]["send_token"]


def case_timeout(ctx, seed):
    """Rank 0 dispatches on a group with a short timeout; rank 1 never joins: rank 0 gets an error
    (not a hang) within about the timeout."""
    import torch.distributed as dist

    xs, idxs, ws, n_exp = make_world(seed, 2)
    if ctx.rank == 0:
        buf = Buffer(n_exp, ctx.short_timeout_group, payload="mxfp4")
        x, idx, w = _to(ctx.device, xs[0], idxs[0], ws[0])
        t0 = time.monotonic()
        try:
            buf.dispatch(x, idx, w)
        except ValueError:
            raise
        except Exception as e:  # gloo reports the timeout as RuntimeError / DistBackendError
            elapsed = time.monotonic() - t0
            assert elapsed < ctx.short_timeout_s + 20, elapsed
            dist.barrier(ctx.group)
            return f"{type(e).__name__} after {elapsed:.1f} s"
        raise AssertionError("dispatch returned although rank 1 never joined")
    dist.barrier(ctx.group)  # rank 1 stays alive without joining until rank 0 has given up
    return None


# ------------------------------------------------------------------------------------------------
# pytest
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(4, "gloo", timeout_s=60, short_timeout_s=2)
    yield p
    p.close()



def test_backend_follows_group(pool):
    def_name = pool.run(case_backend_name, ranks=2)
    assert def_name == ["gloo", "gloo"]


def case_backend_name(ctx):
    b = Buffer(6, ctx.group)
    assert isinstance(b.backend, TorchDistributedBackend) and b.device.type == "cpu"
    return b.backend.name


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_roundtrip_bf16_matches_single_process_moe(pool, world, scenario):
    seed = case_seed()
    rows = pool.run(case_roundtrip_bf16, seed, scenario, ranks=world)
    assert sum(rows) > 0, f"seed {seed}: no rows were dispatched"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("payload", ["mxfp4", "fp8", "nvfp4", "bf16"])
def test_received_rows_equal_spec(pool, world, payload):
    pool.run(case_payload_rows, case_seed(), payload, ranks=world)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backward_payload", ["bf16", "fp8"])
def test_autograd_matches_single_process(pool, world, backward_payload):
    pool.run(case_autograd, case_seed(), backward_payload, ranks=world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("payload,alignment", [("mxfp4", 1), ("mxfp4", 8), ("bf16", 4), ("fp8", 1), ("nvfp4", 2)])
def test_sync_free_dispatch_equals_synced(pool, world, payload, alignment):
    pool.run(case_sync_free, 7100 + 13 * world + alignment, payload, alignment, ranks=world)


@pytest.mark.parametrize("world", [2, 3])
def test_autograd_sync_free_equals_synced(pool, world):
    pool.run(case_autograd_sync_free, 9500 + world, ranks=world)


@pytest.mark.parametrize("world", [2, 3])
def test_gather_path_equals_one_pass_encode(pool, world):
    pool.run(case_gather_path, 9300 + world, ranks=world)


@pytest.mark.parametrize("world", [2, 3])
def test_sync_free_overflow_and_errors_are_reported(pool, world):
    pool.run(case_sync_free_overflow, 9100 + world, ranks=world)


@pytest.mark.parametrize("world", [2, 3])
def test_errors_raise_value_error_on_every_rank(pool, world):
    pool.run(case_errors, case_seed(), ranks=world)


@pytest.mark.parametrize("entry", ["dispatch", "sync_free", "cached_dispatch", "combine", "autograd"])
@pytest.mark.parametrize("world,bad_rank", [(2, 1), (3, 0)])
def test_bad_input_on_one_rank_raises_on_every_rank(pool, entry, world, bad_rank):
    slowest = pool.run(case_bad_input_on_one_rank, case_seed(), entry, bad_rank, ranks=world, timeout_s=60)
    assert max(slowest) < 5.0, f"a failing call took {max(slowest):.1f} s"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("payload,alignment", [("mxfp4", 32), ("mxfp4", 128), ("bf16", 8), ("fp8", 16),
                                               ("nvfp4", 32), ("mxfp4", 1)])
def test_expert_alignment(pool, world, payload, alignment):
    pool.run(case_expert_alignment, case_seed(), payload, alignment, ranks=world)


@pytest.mark.parametrize("world", [2, 3])
def test_autograd_with_expert_alignment(pool, world):
    pool.run(case_autograd_aligned, case_seed(), 32, ranks=world)



@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("scenario", ["random", "empty_rank"])
def test_direct_plan_indexes_agree_across_ranks(pool, world, scenario):
    check_direct_plan(pool.run(case_direct_plan, case_seed(), scenario, ranks=world))


def test_symm_backend_needs_nccl(pool):
    assert pool.run(case_symm_needs_nccl, ranks=2) == [None, None]


def case_symm_needs_nccl(ctx):
    expect_value_error(lambda: Buffer(6, ctx.group, backend="symm"), "backend", "NCCL")
    return None


def test_missing_peer_times_out_with_an_error(pool):
    # last: the short-timeout group is left broken
    res = pool.run(case_timeout, case_seed(), ranks=2, timeout_s=60)
    assert res[0] and "after" in res[0]
