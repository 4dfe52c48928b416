"""The DeepEP-compatible surface (moe_fp4.ep.deep_ep_compat) on gloo groups of 2 and 3 ranks.

Every rank draws the whole world's tokens and routing from a fixed seed (printed by each test and
named in the messages), so each rank builds the single-process reference of what DeepEP's normal
mode returns on it: the received tokens in (source rank, token) order, local expert ids, the
per-expert counts rounded to expert_alignment, and combine's float32 sum over ranks in ascending
order.
"""

from __future__ import annotations

import pytest
import torch
from _compare import assert_bitwise_equal, expect_value_error

from moe_fp4 import formats, ops
from moe_fp4.ep.deep_ep_compat import Buffer, Config, EventOverlap, Handle

SCENARIOS = ("random", "empty_rank", "duplicates", "no_route")
SEED = 3200


# ------------------------------------------------------------------------------------------------
# data and the single-process reference
# ------------------------------------------------------------------------------------------------


def make_world(seed: int, world: int, scenario: str = "random", *, hidden: int = 128, experts_per_rank: int = 3,
               k: int = 3, dyadic: bool = False, min_tokens: int = 4):
    """Per rank: x bfloat16 [T_r, H], topk_idx int64 [T_r, k], topk_weights float32 [T_r, k]; and the
    number of experts."""
    g = torch.Generator().manual_seed(seed)
    num_experts = experts_per_rank * world
    xs, idxs, ws = [], [], []
    for r in range(world):
        t = int(torch.randint(min_tokens, min_tokens + 7, (1,), generator=g))
        if scenario == "empty_rank" and r == 1:
            t = 0
        if dyadic:  # quarters in [-1, 1]: every sum below is exact in float32 and bf16
            x = torch.randint(-4, 5, (t, hidden), generator=g).float() * 0.25
            w = torch.randint(1, 4, (t, k), generator=g).float() * 0.25
        else:
            x = torch.randn(t, hidden, generator=g) * torch.exp(torch.randn(t, 1, generator=g))
            w = torch.rand(t, k, generator=g)
        idx = torch.argsort(torch.rand(t, num_experts, generator=g), dim=1)[:, :k].clone()
        if scenario in ("random", "empty_rank", "no_route"):
            idx[torch.rand(t, k, generator=g) < 0.25] = -1
        if scenario == "no_route" and t:
            idx[: max(1, t // 3)] = -1
        if scenario == "duplicates":
            idx[:, 1] = idx[:, 0]
        xs.append(x.to(torch.bfloat16))
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws, num_experts


def is_local(ids: torch.Tensor, rank: int, ell: int) -> torch.Tensor:
    return (ids >= rank * ell) & (ids < (rank + 1) * ell)


def expected_recv(idxs, ws, rank: int, ell: int):
    """[(source, token)] in DeepEP's receive order, their local ids and weights (0 elsewhere)."""
    order = [(s, t) for s, idx in enumerate(idxs) for t in range(idx.shape[0])
             if bool(is_local(idx[t], rank, ell).any())]
    k = idxs[0].shape[1]
    local_idx = torch.full((len(order), k), -1, dtype=torch.int64)
    local_w = torch.zeros(len(order), k)
    for i, (s, t) in enumerate(order):
        m = is_local(idxs[s][t], rank, ell)
        local_idx[i] = torch.where(m, idxs[s][t] - rank * ell, -1)
        local_w[i] = torch.where(m, ws[s][t], 0.0)
    return order, local_idx, local_w


def expected_counts(idxs, rank: int, ell: int, alignment: int) -> list[int]:
    counts = [sum(int((idx == rank * ell + e).sum()) for idx in idxs) for e in range(ell)]
    return [-(-c // alignment) * alignment for c in counts]


def expert(rank: int, rows: torch.Tensor) -> torch.Tensor:
    """The expert computation of ``rank``, row by row (dyadic factors: exact on dyadic rows)."""
    return (rows.float() * (0.5 * (rank + 1)) + 0.25 * rank).to(torch.bfloat16)


def expected_combine(xs, idxs, rank: int, ell: int, world: int, bias=None) -> torch.Tensor:
    """combine's arithmetic: float32 from the bias, ranks ascending, then bf16."""
    x = xs[rank]
    acc = torch.zeros(x.shape[0], x.shape[1]) if bias is None else bias.float()
    for d in range(world):
        sent = torch.stack([is_local(i, d, ell).any() for i in idxs[rank]]) if x.shape[0] else \
            torch.zeros(0, dtype=torch.bool)
        acc = torch.where(sent.unsqueeze(1), acc + expert(d, x).float(), acc)
    return acc.to(torch.bfloat16)


def rank_inputs(ctx, seed: int):
    """This rank's share of a random world: x, topk_idx, topk_weights, and the number of experts."""
    xs, idxs, ws, n_exp = make_world(seed, ctx.world_size, "random")
    return xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank], n_exp


def layout_args(buf: Buffer, idx: torch.Tensor, num_experts: int) -> dict:
    per_rank, rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, num_experts)
    assert rdma is None and isinstance(event, EventOverlap)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


# ------------------------------------------------------------------------------------------------
# cases (run on every rank of the pool's group)
# ------------------------------------------------------------------------------------------------


def case_layout(ctx, seed):
    rank, world = ctx.rank, ctx.world_size
    buf = Buffer(ctx.group)
    for n, scenario in enumerate(SCENARIOS):
        xs, idxs, ws, n_exp = make_world(seed + n, world, scenario)
        ell = n_exp // world
        idx = idxs[rank]
        per_rank, rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, n_exp)
        want_in = torch.tensor([[bool(is_local(idx[t], d, ell).any()) for d in range(world)]
                                for t in range(idx.shape[0])], dtype=torch.bool).reshape(idx.shape[0], world)
        want_rank = want_in.sum(0).to(torch.int32)
        want_expert = torch.tensor([int((idx == e).sum()) for e in range(n_exp)], dtype=torch.int32)
        what = f"seed {seed + n} {scenario}"
        assert rdma is None
        assert_bitwise_equal(in_rank, want_in, f"is_token_in_rank ({what})")
        assert_bitwise_equal(per_rank, want_rank, f"num_tokens_per_rank ({what})")
        assert_bitwise_equal(per_expert, want_expert, f"num_tokens_per_expert ({what})")


def case_roundtrip(ctx, seed, scenario, dyadic):
    """bf16 dispatch + combine against the reference, bit for bit; the cached dispatch equals the first."""
    rank, world = ctx.rank, ctx.world_size
    xs, idxs, ws, n_exp = make_world(seed, world, scenario, dyadic=dyadic)
    ell = n_exp // world
    what = f"seed {seed} {scenario}"
    buf = Buffer(ctx.group, int(1e9), 0)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank], **layout_args(buf, idxs[rank], n_exp))
    order, want_idx, want_w = expected_recv(idxs, ws, rank, ell)
    want_x = torch.stack([xs[s][t] for s, t in order]) if order else torch.empty(0, xs[0].shape[1],
                                                                                 dtype=torch.bfloat16)
    assert isinstance(handle, Handle) and isinstance(event, EventOverlap)
    event.current_stream_wait()
    assert_bitwise_equal(recv_x, want_x, f"recv_x ({what})")
    assert_bitwise_equal(recv_idx, want_idx, f"recv_topk_idx ({what})")
    assert_bitwise_equal(recv_w, want_w, f"recv_topk_weights ({what})")
    assert counts == expected_counts(idxs, rank, ell, 1), what

    # cached: the same tokens, then new tokens on the same routing
    again = buf.dispatch(xs[rank], handle=handle)
    assert again[1:5] == (None, None, None, None), what
    assert_bitwise_equal(again[0], recv_x, f"cached recv_x ({what})")
    fresh = [(x.float() * -0.5).to(torch.bfloat16) for x in xs]
    cached = buf.dispatch(fresh[rank], handle=handle)[0]
    want_fresh = torch.stack([fresh[s][t] for s, t in order]) if order else want_x
    assert_bitwise_equal(cached, want_fresh, f"cached recv_x of new tokens ({what})")

    # combine: each rank's expert output per received token, summed back without weights
    g = torch.Generator().manual_seed(seed ^ 0xB1A5)
    biases = [(torch.randint(-4, 5, (x.shape[0], x.shape[1]), generator=g).float() * 0.25).to(torch.bfloat16)
              for x in xs]
    y = expert(rank, recv_x)
    out, out_w, _ = buf.combine(y, handle, recv_w, bias=biases[rank])
    want = expected_combine(xs, idxs, rank, ell, world, biases[rank])
    assert_bitwise_equal(out, want, f"combined_x ({what})")
    want_w = torch.where(idxs[rank] >= 0, ws[rank], 0.0)
    assert_bitwise_equal(out_w, want_w, f"combined_topk_weights ({what})")
    if dyadic:  # exact arithmetic: the float64 sum rounds to the same bf16
        exact = biases[rank].double()
        for d in range(world):
            sent = torch.tensor([bool(is_local(i, d, ell).any()) for i in idxs[rank]], dtype=torch.bool)
            exact = exact + torch.where(sent.reshape(-1, 1), expert(d, xs[rank]).double(), 0.0)
        assert_bitwise_equal(out, exact.to(torch.bfloat16), f"combined_x, exact sum ({what})")
    two_bias, _, _ = buf.combine(y, handle, bias=(biases[rank], biases[rank]))
    assert_bitwise_equal(two_bias, expected_combine(xs, idxs, rank, ell, world, biases[rank].float() * 2),
                         f"combined_x with two biases ({what})")
    plain, none_w, _ = buf.combine(y, handle)
    assert none_w is None
    assert_bitwise_equal(plain, expected_combine(xs, idxs, rank, ell, world), f"combined_x, no bias ({what})")
    return len(order)


def case_awkward(ctx, seed):
    """A hidden size whose rows need padding on the wire (72 bf16), and a float32 x: bits unchanged."""
    rank, world = ctx.rank, ctx.world_size
    buf = Buffer(ctx.group)
    for hidden, dtype in ((72, torch.bfloat16), (40, torch.float32)):
        xs, idxs, ws, n_exp = make_world(seed + hidden, world, hidden=hidden)
        xs = [x.to(dtype) * 3 for x in xs]
        ell = n_exp // world
        recv_x, _, _, _, handle, _ = buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank],
                                                  **layout_args(buf, idxs[rank], n_exp))
        order, _, _ = expected_recv(idxs, ws, rank, ell)
        want = torch.stack([xs[s][t] for s, t in order])
        assert_bitwise_equal(recv_x, want, f"recv_x H={hidden} {dtype} (seed {seed + hidden})")
        out, _, _ = buf.combine(recv_x, handle)
        want_out = torch.zeros(xs[rank].shape, dtype=torch.float32)
        for d in range(world):
            sent = torch.tensor([bool(is_local(i, d, ell).any()) for i in idxs[rank]], dtype=torch.bool)
            want_out = torch.where(sent.reshape(-1, 1), want_out + xs[rank].float(), want_out)
        assert_bitwise_equal(out, want_out.to(dtype), f"combined_x H={hidden} {dtype} (seed {seed + hidden})")


def fp8_tokens(x: torch.Tensor, g: torch.Generator):
    """An (e4m3, scales) pair as DeepEP callers make it: amax / 448 scales (not powers of two)."""
    blocks = x.float().reshape(x.shape[0], -1, 128)
    scales = blocks.abs().amax(-1).clamp(min=1e-4) / 448 * (1 + torch.rand(blocks.shape[:2], generator=g) * 0.1)
    data = (blocks / scales.unsqueeze(-1)).reshape(x.shape).to(torch.float8_e4m3fn)
    return data, scales


def case_fp8_tuple(ctx, seed):
    """An (e4m3, scales) x: its bits arrive unchanged (payload bf16, also cached); as bf16 on
    request; through mxfp4 as the spec's MXFP4 -> FP8 conversion of the dequantized tokens."""
    rank, world = ctx.rank, ctx.world_size
    xs, idxs, ws, n_exp = make_world(seed, world, "duplicates")
    ell = n_exp // world
    g = torch.Generator().manual_seed(seed ^ 0xF8)
    pairs = [fp8_tokens(x, g) for x in xs]
    buf = Buffer(ctx.group)
    args = layout_args(buf, idxs[rank], n_exp)
    (data, scales), _, _, counts, handle, _ = buf.dispatch(pairs[rank], topk_idx=idxs[rank], topk_weights=ws[rank],
                                                           **args)
    order, _, _ = expected_recv(idxs, ws, rank, ell)
    want_d = torch.stack([pairs[s][0][t] for s, t in order])
    want_s = torch.stack([pairs[s][1][t] for s, t in order])
    what = f"seed {seed}"
    assert_bitwise_equal(data, want_d, f"recv e4m3 ({what})")
    assert_bitwise_equal(scales, want_s, f"recv scales ({what})")
    (data2, scales2), *_ = buf.dispatch(pairs[rank], handle=handle)
    assert_bitwise_equal(data2, want_d, f"cached recv e4m3 ({what})")
    assert_bitwise_equal(scales2, want_s, f"cached recv scales ({what})")
    as_bf16 = buf.dispatch(pairs[rank], handle=handle, recv_format="bf16")[0]
    want_bf16 = formats.dequantize_fp8_blockwise(want_d, want_s, block=(1, 128), dtype=torch.bfloat16)
    assert_bitwise_equal(as_bf16, want_bf16, f"recv_format='bf16' of a tuple ({what})")

    (m_data, m_scales), *_ = buf.dispatch(pairs[rank], topk_idx=idxs[rank], topk_weights=ws[rank], payload="mxfp4",
                                          **args)
    values = formats.dequantize_fp8_blockwise(want_d, want_s, block=(1, 128))
    d_ref, s_ref, _ = formats.mxfp4_to_fp8_blockwise(*formats.quantize_mxfp4(values))
    assert_bitwise_equal(m_data, d_ref, f"mxfp4 wire -> e4m3 ({what})")
    assert_bitwise_equal(m_scales, s_ref, f"mxfp4 wire -> scales ({what})")

    # and a bf16 x asked for as fp8: the received values quantized to FP8 1x128
    recv_fp8 = buf.dispatch(xs[rank], handle=handle, recv_format="fp8")[0]
    want_x = torch.stack([xs[s][t] for s, t in order])
    ref = ops.quantize_fp8_blockwise(want_x)
    assert_bitwise_equal(recv_fp8[0], ref[0], f"recv_format='fp8' e4m3 ({what})")
    assert_bitwise_equal(recv_fp8[1], ref[1], f"recv_format='fp8' scales ({what})")


def case_alignment(ctx, seed):
    rank, world = ctx.rank, ctx.world_size
    xs, idxs, ws, n_exp = make_world(seed, world, "duplicates", experts_per_rank=4, k=4)
    ell = n_exp // world
    buf = Buffer(ctx.group)
    args = layout_args(buf, idxs[rank], n_exp)
    first = None
    for alignment in (1, 3, 4, 32):
        recv_x, _, _, counts, _, _ = buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank],
                                                  expert_alignment=alignment, **args)
        want = expected_counts(idxs, rank, ell, alignment)
        assert counts == want, f"seed {seed} alignment {alignment}: {counts} != {want}"
        assert all(c % alignment == 0 for c in counts)
        if first is None:
            first = recv_x
        assert_bitwise_equal(recv_x, first, f"recv_x is not padded (alignment {alignment}, seed {seed})")


def case_mxfp4(ctx, seed):
    """mxfp4 wire: the received values are the spec's MXFP4 round trip of the sender's tokens, within
    the documented bound; FP8 on request is the spec's direct conversion; combine over mxfp4."""
    rank, world = ctx.rank, ctx.world_size
    xs, idxs, ws, n_exp = make_world(seed, world, "random")
    for x in xs:  # a zero block, and a block of tiny values next to a large one
        if x.shape[0] >= 2:
            x[0, :32] = 0
            x[1, 32:64] *= 2.0 ** -30
    ell = n_exp // world
    what = f"seed {seed}"
    buf = Buffer(ctx.group)
    args = layout_args(buf, idxs[rank], n_exp)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank],
                                                               payload="mxfp4", **args)
    order, want_idx, want_w = expected_recv(idxs, ws, rank, ell)
    src = torch.stack([xs[s][t] for s, t in order])
    packed, scales = formats.quantize_mxfp4(src)
    assert recv_x.dtype == torch.bfloat16
    assert_bitwise_equal(recv_x, formats.dequantize_mxfp4(packed, scales, dtype=torch.bfloat16),
                         f"mxfp4 recv_x ({what})")
    err = (recv_x.float() - src.float()).abs().reshape(src.shape[0], -1, 32)
    amax = src.float().abs().reshape(src.shape[0], -1, 32).amax(-1, keepdim=True)
    assert bool((err <= amax / 3).all()), f"{what}: mxfp4 error above amax / 3: {float((err - amax / 3).max())}"
    assert_bitwise_equal(recv_idx, want_idx, f"recv_topk_idx ({what})")
    assert_bitwise_equal(recv_w, want_w, f"recv_topk_weights ({what})")
    assert counts == expected_counts(idxs, rank, ell, 1)
    fp8 = buf.dispatch(xs[rank], handle=handle, payload="mxfp4", recv_format="fp8")[0]
    d_ref, s_ref, _ = formats.mxfp4_to_fp8_blockwise(packed, scales)
    assert_bitwise_equal(fp8[0], d_ref, f"mxfp4 -> fp8 e4m3 ({what})")
    assert_bitwise_equal(fp8[1], s_ref, f"mxfp4 -> fp8 scales ({what})")

    # combine with an mxfp4 wire: each rank's rows decoded, then summed as with bf16
    y = expert(rank, recv_x)
    out, _, _ = buf.combine(y, handle, payload="mxfp4")
    x = xs[rank]
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for d in range(world):
        sent = torch.tensor([bool(is_local(i, d, ell).any()) for i in idxs[rank]], dtype=torch.bool)
        on_d = formats.dequantize_mxfp4(*formats.quantize_mxfp4(x), dtype=torch.bfloat16)  # what rank d received
        y_d = formats.dequantize_mxfp4(*formats.quantize_mxfp4(expert(d, on_d)))
        acc = torch.where(sent.reshape(-1, 1), acc + y_d, acc)
    assert_bitwise_equal(out, acc.to(torch.bfloat16), f"combine over mxfp4 ({what})")


def case_worst_tokens(ctx, seed):
    """num_worst_tokens: DeepEP's shapes (padding rows, ids -1, empty list); combine takes the padded x."""
    rank, world = ctx.rank, ctx.world_size
    xs, idxs, ws, n_exp = make_world(seed, world, "random")
    ell = n_exp // world
    worst = sum(x.shape[0] for x in xs)
    buf = Buffer(ctx.group)
    args = layout_args(buf, idxs[rank], n_exp)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank],
                                                               num_worst_tokens=worst, **args)
    order, want_idx, want_w = expected_recv(idxs, ws, rank, ell)
    n = len(order)
    what = f"seed {seed}"
    assert recv_x.shape[0] == worst and recv_idx.shape[0] == worst and recv_w.shape[0] == worst, what
    assert counts == [], what
    assert_bitwise_equal(recv_x[:n], torch.stack([xs[s][t] for s, t in order]), f"recv_x ({what})")
    assert_bitwise_equal(recv_idx[:n], want_idx, f"recv_topk_idx ({what})")
    assert bool((recv_idx[n:] == -1).all()), what
    assert_bitwise_equal(recv_w[:n], want_w, f"recv_topk_weights ({what})")
    assert buf.dispatch(xs[rank], handle=handle)[0].shape[0] == worst
    out, _, _ = buf.combine(expert(rank, recv_x), handle)
    assert_bitwise_equal(out, expected_combine(xs, idxs, rank, ell, world), f"combine of padded x ({what})")
    # too small a bound raises on each rank that received more
    if n > 1:
        expect_value_error(lambda: buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank],
                                                 num_worst_tokens=1, **args), "num_worst_tokens")
    else:
        buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank], num_worst_tokens=1, **args)


def case_errors(ctx, seed):
    """Bad arguments raise ValueError naming them, on every rank (all ranks pass the same bad call)."""
    x, idx, w, n_exp = rank_inputs(ctx, seed)
    buf = Buffer(ctx.group)
    args = layout_args(buf, idx, n_exp)
    _, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **args)

    def dispatch(**over):
        kw = dict(topk_idx=idx, topk_weights=w, **args)
        kw.update(over)
        xx = kw.pop("x", x)
        return buf.dispatch(xx, **kw)

    expect_value_error(lambda: dispatch(payload="fp4"), "payload")
    expect_value_error(lambda: dispatch(recv_format="fp16"), "recv_format")
    expect_value_error(lambda: dispatch(expert_alignment=0), "expert_alignment")
    expect_value_error(lambda: dispatch(num_worst_tokens=-1), "num_worst_tokens")
    expect_value_error(lambda: dispatch(num_tokens_per_rank=None), "num_tokens_per_rank")
    expect_value_error(lambda: dispatch(is_token_in_rank=args["is_token_in_rank"][:, :1]), "is_token_in_rank")
    expect_value_error(lambda: dispatch(num_tokens_per_expert=args["num_tokens_per_expert"].long()),
                        "num_tokens_per_expert")
    expect_value_error(lambda: dispatch(topk_idx=None), "topk_idx")
    expect_value_error(lambda: dispatch(topk_idx=torch.full_like(idx, n_exp)), "topk_idx")
    expect_value_error(lambda: dispatch(x=x.double()), "x")
    expect_value_error(lambda: dispatch(x=x.t().contiguous().t()), "x", "contiguous")
    expect_value_error(lambda: dispatch(x=(x, x)), "x", "float8_e4m3fn")
    expect_value_error(lambda: dispatch(x=x[:, :100].contiguous(), payload="mxfp4"), "x", "32")
    expect_value_error(lambda: buf.dispatch(x, handle=handle, topk_idx=idx), "topk_idx", "handle")
    expect_value_error(lambda: buf.dispatch(x, handle=(1, 2)), "handle")
    expect_value_error(lambda: buf.dispatch(torch.cat((x, x)), handle=handle), "x", "tokens")
    n = handle.num_rows
    y = torch.zeros(n, x.shape[1], dtype=torch.bfloat16)
    expect_value_error(lambda: buf.combine(torch.zeros(n + 1, x.shape[1], dtype=torch.bfloat16), handle), "x")
    expect_value_error(lambda: buf.combine(y, "handle"), "handle")
    expect_value_error(lambda: buf.combine(y, handle, torch.zeros(n, 3, dtype=torch.float64)), "topk_weights")
    expect_value_error(lambda: buf.combine(y, handle, bias=torch.zeros(1, 1, dtype=torch.bfloat16)), "bias")
    expect_value_error(lambda: buf.combine(y, handle, payload="int8"), "payload")
    # local calls (no collective)
    expect_value_error(lambda: buf.get_dispatch_layout(idx, n_exp + 1), "num_experts")
    expect_value_error(lambda: buf.get_dispatch_layout(idx.float(), n_exp), "topk_idx")
    expect_value_error(lambda: buf.get_dispatch_layout(idx, n_exp, previous_event=1), "previous_event")
    expect_value_error(lambda: Buffer(ctx.group, low_latency_mode=True), "low_latency_mode")
    expect_value_error(lambda: Buffer.set_num_sms(3), "new_num_sms")
    expect_value_error(lambda: buf.destroy(), "explicitly_destroy")
    # the buffer still works after all of that
    again = buf.dispatch(x, handle=handle)[0]
    assert again.shape[0] == handle.num_rows


def case_bad_on_one_rank(ctx, seed, bad_rank):
    """A bad argument on one rank makes every rank raise ValueError (dispatch, cached dispatch, combine)."""
    x, idx, w, n_exp = rank_inputs(ctx, seed)
    buf = Buffer(ctx.group)
    args = layout_args(buf, idx, n_exp)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **args)
    bad = ctx.rank == bad_rank
    words = ("payload",) if bad else ("rejected",)
    expect_value_error(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, payload="fp4" if bad else "bf16",
                                             **args), *words)
    expect_value_error(lambda: buf.dispatch(x, handle=handle, payload="fp4" if bad else "bf16"), *words)
    expect_value_error(lambda: buf.combine(recv_x, handle, payload="fp4" if bad else "bf16"), *words)
    out, _, _ = buf.combine(recv_x, handle)  # and the group still works
    return out.shape[0]


# ------------------------------------------------------------------------------------------------
# pytest
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(3, "gloo", timeout_s=30, short_timeout_s=2)
    yield p
    p.close()


def run(pool, fn, seed, *args, world):
    print(f"{fn.__name__}: seed {seed}, {world} ranks")
    return pool.run(fn, seed, *args, ranks=world, timeout_s=60)


# Checks of one case on 2 and 3 ranks: (the case, its seed base; the seed is base + world).
CHECKS = {
    "layout_matches_hand_counts": (case_layout, SEED),
    "padded_rows_and_float32_keep_their_bits": (case_awkward, SEED + 200),
    "fp8_tuple_input": (case_fp8_tuple, SEED + 300),
    "expert_alignment_pads_the_counts": (case_alignment, SEED + 400),
    "mxfp4_payload_within_documented_error": (case_mxfp4, SEED + 500),
    "num_worst_tokens_shapes": (case_worst_tokens, SEED + 600),
    "bad_input_raises_value_error_naming_it": (case_errors, SEED + 700),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("check", CHECKS)
def test_check_on_every_rank(pool, check, world):
    case, seed_base = CHECKS[check]
    run(pool, case, seed_base + world, world=world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario,dyadic", [("random", False), ("empty_rank", False), ("duplicates", True),
                                             ("no_route", True)])
def test_dispatch_combine_match_reference(pool, world, scenario, dyadic):
    seed = SEED + 100 + 10 * world + SCENARIOS.index(scenario)
    received = run(pool, case_roundtrip, seed, scenario, dyadic, world=world)
    assert sum(received) > 0, f"seed {seed}: no token was dispatched"


@pytest.mark.parametrize("world,bad_rank", [(2, 1), (3, 0)])
def test_bad_input_on_one_rank_raises_on_every_rank(pool, world, bad_rank):
    run(pool, case_bad_on_one_rank, SEED + 800 + world, bad_rank, world=world)


def test_world_of_one_without_a_group():
    """Without torch.distributed: a world of one, where dispatch and combine are copies."""
    seed = SEED + 900
    print(f"seed {seed}")
    xs, idxs, ws, n_exp = make_world(seed, 1, "random")
    buf = Buffer(None)
    xs[0].requires_grad_()  # (as DeepEP's, the outputs carry no autograd history)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(xs[0], topk_idx=idxs[0], topk_weights=ws[0],
                                                               **layout_args(buf, idxs[0], n_exp))
    order, want_idx, _ = expected_recv(idxs, ws, 0, n_exp)
    assert_bitwise_equal(recv_x, xs[0][[t for _, t in order]], f"recv_x (seed {seed})")
    assert_bitwise_equal(recv_idx, want_idx, f"recv_topk_idx (seed {seed})")
    assert not recv_x.requires_grad
    out, out_w, _ = buf.combine(recv_x.requires_grad_(), handle, recv_w)
    assert not out.requires_grad
    # the arguments DeepEP tunes with are accepted; events are empty without CUDA
    event = Buffer.capture()
    config = Buffer.get_dispatch_config(2)
    assert isinstance(config, Config) and config.get_nvl_buffer_size_hint(2 * 128, 2) == 0
    again, _, _, _, _, event = buf.dispatch(xs[0], handle=handle, config=config, previous_event=event,
                                            async_finish=True, allocate_on_comm_stream=True)
    with event:
        assert_bitwise_equal(again, recv_x.detach(), f"cached recv_x (seed {seed})")
    out2, _, event = buf.combine(recv_x, handle, recv_w, config=Buffer.get_combine_config(2), async_finish=True)
    event.current_stream_wait()
    assert_bitwise_equal(out2, out, f"combined_x with async_finish (seed {seed})")
    routed = (idxs[0] >= 0).any(1, keepdim=True)
    assert_bitwise_equal(out, torch.where(routed, xs[0].detach(), 0).to(torch.bfloat16), f"combined_x (seed {seed})")
    assert_bitwise_equal(out_w, torch.where(idxs[0] >= 0, ws[0], 0.0), f"combined weights (seed {seed})")
