"""backend="deepep": our payload rows through deep_ep.Buffer (moe_fp4.ep.deepep).

CPU: the error without deep_ep (it names the package and patches/deepep/build.sh), the argument
checks, and the receiver's layout: each rank's received set from a gloo dispatch, given the form
DeepEP's dispatch returns it in (local ids, weights 0 in other ranks' slots, source index), goes
through ``received_layout`` and must give the gloo backend's tables, rows, FP8 rows and combine
partial sums bit for bit.
GPU (2 GPUs and deep_ep): against the nccl backend on the same routing: the same received tokens,
tables, rows, FP8 operands and combine results (bit-equal: the same arithmetic); mxfp4 within its
documented bound of the sent values; cached dispatch; return_fp8; the SM budget.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch
from _compare import assert_bitwise_equal, case_seed
from test_ep_dist import H, _to, make_world

from moe_fp4.ep import Buffer, DispatchOutput, make_backend
from moe_fp4.ep.backends import AllToAllBackend, local_sums
from moe_fp4.ep.buffer import DispatchHandle
from moe_fp4.ep.deepep import (
    TMA_ROW_BYTES,
    DeepEPBackend,
    DeepEPHandle,
    check_routing,
    check_world,
    partial_sums,
    received_layout,
    wire_bytes,
)

# ------------------------------------------------------------------------------------------------
# CPU: errors and checks
# ------------------------------------------------------------------------------------------------


def test_without_deep_ep_the_error_names_it_and_the_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # (import deep_ep fails, installed or not)
    for make in (lambda: Buffer(8, backend="deepep"), lambda: make_backend(backend="deepep"), DeepEPBackend):
        with pytest.raises(ImportError, match="deep_ep") as err:
            make()
        assert "patches/deepep/build.sh" in str(err.value)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="'deepep'"):
        make_backend(backend="deep_ep")
    for key, bad in (("num_nvl_bytes", -1), ("num_rdma_bytes", 1.5), ("num_nvl_bytes", True)):
        with pytest.raises(ValueError, match=key):
            DeepEPBackend(**{key: bad})
    for world in (2, 4, 8, 16, 32):
        check_world(world)
    for world in (1, 3, 6, 12):
        with pytest.raises(ValueError, match="group: DeepEP"):
            check_world(world)
    check_routing(32, 256, 2)
    with pytest.raises(ValueError, match="at most 32 experts per token"):
        check_routing(33, 256, 2)
    with pytest.raises(ValueError, match="num_experts"):
        check_routing(8, 2 * 129, 2)
    check_routing(8, 16 * 129, 16)  # (internode: not the intranode limit)


@pytest.mark.parametrize("payload,hidden,wire", [("mxfp4", 7168, 3808), ("bf16", 7168, 14336), ("fp8", 7168, 7392),
                                                 ("nvfp4", 7168, 4064), ("mxfp4", 2880, 1536), ("fp8", 128, 160),
                                                 ("bf16", 8160, 16320)])
def test_wire_rows_are_padded_to_deepep_words(payload, hidden, wire):
    from moe_fp4.ep import get_payload

    assert wire_bytes(get_payload(payload).row_bytes(hidden), payload) == wire


def test_rows_wider_than_deepep_stages_raise():
    assert TMA_ROW_BYTES == 16352
    with pytest.raises(ValueError, match="mxfp4"):
        wire_bytes(2 * 8192, "bf16")  # (the message suggests a narrower payload)
    assert wire_bytes(2 * 8192, "bf16", sm90=False) == 2 * 8192


class _RoutingBackend(AllToAllBackend):
    """A world of one whose transfer would route the tokens itself (never reached here)."""

    name = "routing"
    routes_tokens = True

    def dispatch_routed(self, *args, **kwargs):
        raise AssertionError("not reached: the arguments are rejected first")


def test_routing_backend_rejects_sync_free_and_bad_input_before_the_transfer():
    buf = Buffer(4, backend=_RoutingBackend(), payload="bf16")
    x = torch.randn(6, 64)
    idx = torch.randint(0, 4, (6, 2))
    with pytest.raises(ValueError, match="max_recv_tokens: the routing backend has no sync-free dispatch"):
        buf.dispatch(x, idx, max_recv_tokens=8)
    with pytest.raises(ValueError, match="topk_idx"):
        buf.dispatch(x, idx[:5])
    with pytest.raises(ValueError, match="x: hidden size"):
        buf.dispatch(torch.randn(6, 48), idx)


def test_bench_backends_deepep_without_deep_ep_says_how_to_build(monkeypatch, capsys):
    from moe_fp4.ep import bench

    monkeypatch.setitem(sys.modules, "deep_ep", None)
    with pytest.raises(SystemExit):
        bench._parse(["--backend", "nccl", "--backends", "nccl,deepep"])
    assert "patches/deepep/build.sh" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# CPU: the receiver's layout from a received set
# ------------------------------------------------------------------------------------------------


def deepep_form(h: DispatchHandle):
    """A dispatch handle's received set as DeepEP's intranode dispatch gives it: local ids (-1
    elsewhere), weights 0 where the id is -1, the source index as int32 (its recv_src_idx)."""
    weights = None if h.recv_topk_weights is None else torch.where(h.recv_topk_idx >= 0, h.recv_topk_weights, 0.0)
    return h.recv_topk_idx.clone(), weights, h.recv_src_token.to(torch.int32)


def handle_from_received_set(h: DispatchHandle, recv_idx, recv_w, recv_src) -> DeepEPHandle:
    """The DeepEPHandle the deepep backend builds from that received set (DeepEP's own handle left out)."""
    got = received_layout(recv_idx, recv_w, recv_src, h.experts_per_rank, h.expert_alignment, h.tokens_per_expert)
    fields = {f.name: getattr(h, f.name) for f in dataclasses.fields(DispatchHandle)}
    fields.update(recv_topk_idx=got.recv_topk_idx, recv_topk_weights=got.recv_topk_weights,
                  expand_row=got.expand_row, expand_slot=got.expand_slot, row_weights=got.row_weights,
                  split_lens=got.split_lens, split_offsets=got.split_offsets, slot_table=got.slot_table,
                  recv_src_token=got.recv_src_token, gap_rows=got.gap_rows, count_matrix=[], peer_num_tokens=[],
                  direct_cache={})
    return DeepEPHandle(**fields)


def check_tables(h: DispatchHandle, ref: DispatchHandle, what: str) -> None:
    for name in ("slot_table", "expand_row", "expand_slot", "split_lens", "split_offsets", "recv_topk_idx",
                 "recv_src_token", "row_weights", "gap_rows"):
        a, b = getattr(h, name), getattr(ref, name)
        assert (a is None) == (b is None), f"{what}: {name} {a} vs {b}"
        if a is not None:
            assert_bitwise_equal(a, b, f"{what}: {name}")
    assert h.num_rows == ref.num_rows and h.tokens_per_expert == ref.tokens_per_expert, what
    if ref.recv_topk_weights is not None:  # DeepEP's: 0 in the slots of other ranks' experts
        assert_bitwise_equal(h.recv_topk_weights, torch.where(ref.recv_topk_idx >= 0, ref.recv_topk_weights, 0.0),
                             f"{what}: recv_topk_weights")


def case_received_layout(ctx, seed, scenario, payload, alignment, weighted):
    rank, world = ctx.rank, ctx.world_size
    xs, idxs, ws, n_exp = make_world(seed, world, scenario)
    buf = Buffer(n_exp, ctx.group, payload=payload)
    out = buf.dispatch(xs[rank], idxs[rank], ws[rank] if weighted else None, expert_alignment=alignment,
                       return_fp8=True)
    ref = out.handle
    h = handle_from_received_set(ref, *deepep_form(ref))
    what = f"rank {rank}, {scenario}, {payload}, alignment {alignment}"
    check_tables(h, ref, what)
    # the DispatchOutput on that handle: the gloo backend's rows, FP8 rows, FP8 per token and values
    mine = DispatchOutput(out.recv_rows, out.payload, H, h)
    assert_bitwise_equal(mine.rows, out.rows, f"{what}: rows")
    for a, b in zip(mine.to_fp8_blockwise(), out.fp8):
        assert_bitwise_equal(a, b, f"{what}: FP8 expert rows")
    for a, b in zip(mine.recv_to_fp8_blockwise(), DispatchOutput(out.recv_rows, out.payload, H, ref)
                    .recv_to_fp8_blockwise()):
        assert_bitwise_equal(a, b, f"{what}: FP8 per received token")
    # the combine's first sum: the bf16 partials the gloo backend would send back
    g = torch.Generator().manual_seed(seed + rank)
    y = torch.randn(h.num_rows, H, generator=g).to(torch.bfloat16)
    weights = (h.recv_topk_weights, ref.recv_topk_weights) if weighted else (None, None)
    assert_bitwise_equal(partial_sums(y, h, weights[0]), local_sums(y, ref, weights[1]).to(torch.bfloat16),
                         f"{what}: combine partial sums")
    return h.num_rows


@pytest.fixture(scope="module")
def gloo_pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(3, "gloo", timeout_s=60)
    yield p
    p.close()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", ["random", "empty_rank", "duplicates", "no_route", "k_gt_local"])
def test_received_layout_equals_the_gloo_backends(gloo_pool, world, scenario):
    for payload, alignment, weighted in (("bf16", 1, True), ("mxfp4", 8, True), ("nvfp4", 1, False)):
        gloo_pool.run(case_received_layout, case_seed(), scenario, payload, alignment, weighted, ranks=world)


# ------------------------------------------------------------------------------------------------
# GPU: 2 GPUs and deep_ep, against the nccl backend
# ------------------------------------------------------------------------------------------------

_GPU_REASON = "needs 2 GPUs and deep_ep"
_skip_without = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or importlib.util.find_spec("deep_ep") is None,
    reason=_GPU_REASON)


def needs_deepep(test):
    """A 2-GPU test against real DeepEP (selected by -m multigpu; skipped without 2 GPUs and deep_ep)."""
    return pytest.mark.multigpu(_skip_without(test))


_DEEPEP_BUFFERS: dict = {}


def _deepep(ctx, n_exp, num_sms=None) -> Buffer:
    """This worker's deepep Buffer for (n_exp, num_sms), made once and kept: freeing DeepEP's buffer
    is collective (a barrier between the ranks), so a Buffer left to the garbage collector (an
    exception's traceback holds it in a reference cycle) could be freed on one rank while its peer
    waits elsewhere. The workers end with os._exit: nothing is freed then."""
    key = (ctx.world_size, n_exp, num_sms)
    if key not in _DEEPEP_BUFFERS:
        _DEEPEP_BUFFERS[key] = Buffer(n_exp, ctx.group, backend="deepep", num_sms=num_sms)
    buf = _DEEPEP_BUFFERS[key]
    buf.set_num_sms(num_sms)
    return buf


def _pair(ctx, n_exp):
    """(an nccl Buffer, this worker's deepep Buffer) on ctx's group; the calls name their payload."""
    return Buffer(n_exp, ctx.group), _deepep(ctx, n_exp)


def _random_inputs_and_pair(ctx, seed):
    """This rank's share of a random world on its GPU (x, topk_idx, topk_weights), _pair's two
    Buffers, and the number of experts."""
    xs, idxs, ws, n_exp = make_world(seed, ctx.world_size, "random")
    return _to(ctx.device, xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank]), _pair(ctx, n_exp), n_exp


def _same_output(out, ref, what: str) -> None:
    check_tables(out.handle, ref.handle, what)
    assert_bitwise_equal(out.recv_rows, ref.recv_rows, f"{what}: received rows")
    assert_bitwise_equal(out.rows, ref.rows, f"{what}: expert rows")
    assert out.handle.send_counts == ref.handle.send_counts, what
    assert out.handle.recv_counts == ref.handle.recv_counts, what  # (read from DeepEP's handle)
    assert_bitwise_equal(out.handle.send_token, ref.handle.send_token, f"{what}: send_token")
    assert_bitwise_equal(out.handle.rank_table, ref.handle.rank_table, f"{what}: rank_table")


def case_against_nccl(ctx, seed, scenario, payload, alignment, hidden=H):
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    xs, idxs, ws, n_exp = make_world(seed, world, scenario)
    if hidden != H:  # (every rank draws every rank's tokens)
        xs = [torch.randn(t.shape[0], hidden, generator=torch.Generator().manual_seed(seed + r)) for r, t in
              enumerate(xs)]
    x, idx, w = _to(dev, xs[rank], idxs[rank], ws[rank])
    x = x.to(torch.bfloat16)
    nccl, deepep = _pair(ctx, n_exp)
    ref = nccl.dispatch(x, idx, w, payload=payload, expert_alignment=alignment, return_fp8=True)
    out = deepep.dispatch(x, idx, w, payload=payload, expert_alignment=alignment, return_fp8=True)
    what = f"rank {rank}, {scenario}, {payload}, alignment {alignment}, hidden {hidden}"
    _same_output(out, ref, what)
    for a, b in zip(out.fp8, ref.fp8):
        assert_bitwise_equal(a, b, f"{what}: FP8 expert rows")
    if payload == "mxfp4":  # the documented bound: |recv - x| <= the block's scale < amax / 3 (per 32 values)
        h = out.handle
        sources = [s for s, n in enumerate(h.recv_counts) for _ in range(n)]
        sent = [xs[s][t].to(torch.bfloat16).float() for s, t in zip(sources, h.recv_src_token.tolist())]
        rows = h.expand_row >= 0  # (not the gap rows)
        if sent and bool(rows.any()):
            want = torch.stack(sent).to(dev)[h.expand_row[rows]]
            got = out.values(torch.float32)[rows]
            amax = want.abs().view(-1, hidden // 32, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(want.shape)
            assert bool(((got - want).abs() <= amax / 3).all()), f"{what}: mxfp4 error past amax / 3"
    # combine: the same bits as the nccl backend's (weighted, unweighted)
    y = torch.randn(ref.handle.num_rows, hidden, generator=torch.Generator().manual_seed(seed + rank)).to(
        dev, torch.bfloat16)
    for weighted in (True, False):
        assert_bitwise_equal(deepep.combine(y, out.handle, weighted=weighted),
                             nccl.combine(y, ref.handle, weighted=weighted), f"{what}: combine, weighted={weighted}")
    return out.handle.num_rows


def case_cached_and_return_fp8(ctx, seed):
    rank, dev = ctx.rank, ctx.device
    (x, idx, w), (nccl, deepep), _ = _random_inputs_and_pair(ctx, seed)
    ref = nccl.dispatch(x, idx, w, payload="bf16", expert_alignment=4)
    out = deepep.dispatch(x, idx, w, payload="bf16", expert_alignment=4)
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed ^ rank)).to(dev, torch.bfloat16)
    for payload in ("bf16", "mxfp4", "fp8", "nvfp4"):  # a cached dispatch may change the payload
        for return_fp8 in (False, True, "tokens"):
            got = deepep.dispatch(x2, handle=out.handle, payload=payload, return_fp8=return_fp8)
            want = nccl.dispatch(x2, handle=ref.handle, payload=payload, return_fp8=return_fp8)
            what = f"rank {rank}, cached {payload}, return_fp8={return_fp8}"
            assert_bitwise_equal(got.recv_rows, want.recv_rows, f"{what}: received rows")
            assert_bitwise_equal(got.rows, want.rows, f"{what}: expert rows")
            for a, b in ((got.fp8, want.fp8), (got.recv_fp8, want.recv_fp8)):
                assert (a is None) == (b is None), what
                for p, q in zip(a or (), b or ()):
                    assert_bitwise_equal(p, q, f"{what}: FP8")
    return out.handle.num_rows


def case_errors_and_num_sms(ctx, seed):
    rank = ctx.rank
    (x, idx, w), (nccl, deepep), n_exp = _random_inputs_and_pair(ctx, seed)
    assert deepep.backend.name == "deepep" and deepep.device == torch.device("cuda", rank)
    out = deepep.dispatch(x, idx, w, payload="mxfp4", return_fp8=True)
    y = out.values(torch.bfloat16)
    for fn, words in ((lambda: deepep.combine(y, out.handle, payload="mxfp4"), "bf16 partial sums"),
                      (lambda: deepep.dispatch(x, idx, w, max_recv_tokens=64), "no sync-free dispatch"),
                      (lambda: deepep.dispatch(x, handle=nccl.dispatch(x, idx, w).handle), "its own dispatch")):
        with pytest.raises(ValueError, match=words):
            fn()
    deepep.set_num_sms(21)
    with pytest.raises(ValueError, match="even SM count"):
        deepep.dispatch(x, idx, w, payload="mxfp4")
    # an SM budget: DeepEP's kernels with 24 SMs, ours bounded the same: the same bits
    budget = _deepep(ctx, n_exp, 24)
    small = budget.dispatch(x, idx, w, payload="mxfp4", return_fp8=True)
    _same_output(small, out, f"rank {rank}, num_sms=24")
    for a, b in zip(small.fp8, out.fp8):
        assert_bitwise_equal(a, b, "FP8 expert rows, num_sms=24")
    assert small.handle.deepep_num_sms == 24 and out.handle.deepep_num_sms == 20
    budget.set_num_sms(None)  # the handle keeps its SM count for its cached dispatch and combine
    assert_bitwise_equal(budget.dispatch(x, handle=small.handle, payload="mxfp4").rows, out.rows,
                         "cached after set_num_sms")
    assert_bitwise_equal(budget.combine(y, small.handle), deepep.combine(y, out.handle), "combine, num_sms=24")
    return True


@pytest.fixture(scope="module")
def nccl_pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(2, "nccl", timeout_s=120)
    yield p
    p.close()


@needs_deepep
@pytest.mark.parametrize("scenario", ["random", "empty_rank", "duplicates", "no_route", "k_gt_local"])
@pytest.mark.parametrize("payload,alignment", [("bf16", 1), ("bf16", 32), ("mxfp4", 1), ("mxfp4", 32), ("fp8", 8),
                                               ("nvfp4", 1)])
def test_deepep_equals_nccl(nccl_pool, scenario, payload, alignment):
    nccl_pool.run(case_against_nccl, case_seed(), scenario, payload, alignment)


@needs_deepep
@pytest.mark.parametrize("payload,hidden", [("mxfp4", 7168), ("bf16", 7168), ("nvfp4", 2048)])
def test_deepep_equals_nccl_at_model_hidden_sizes(nccl_pool, payload, hidden):
    nccl_pool.run(case_against_nccl, case_seed(), "random", payload, 1, hidden)


@needs_deepep
def test_deepep_cached_dispatch_and_return_fp8(nccl_pool):
    nccl_pool.run(case_cached_and_return_fp8, case_seed())


@needs_deepep
def test_deepep_errors_and_num_sms(nccl_pool):
    nccl_pool.run(case_errors_and_num_sms, case_seed())
