"""Expert-parallel dispatch/combine over NCCL on 2 GPUs: the checks of test_ep_dist.py, plus
DeepSeek-V3-sized rows against the spec and the host-synchronisation budget (one per full dispatch,
none in a cached dispatch or a combine); the symmetric-memory backend against the NCCL path, bit for
bit (rows, FP8 operands, combine over every wire format); the Triton fused MXFP4 -> FP8 gather
against the spec."""

from __future__ import annotations

import warnings

import pytest
import torch
from _compare import assert_bitwise_equal, case_seed
from test_ep_dist import (
    SCENARIOS,
    _to,
    case_autograd,
    case_autograd_aligned,
    case_autograd_sync_free,
    case_errors,
    case_expert_alignment,
    case_payload_rows,
    case_roundtrip_bf16,
    case_sync_free,
    case_sync_free_overflow,
    expected_order,
    make_world,
    spec_rows,
)
from test_ep_local import check_fused_conversion, spec_fp8_of_rows
from test_sync_free_gpu import check_num_sms_same_bits, run_graph_case

from moe_fp4.ep import Buffer, make_backend

pytestmark = pytest.mark.multigpu


@pytest.fixture(scope="module")
def pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(2, "nccl", timeout_s=120)
    yield p
    p.close()



def case_backend_is_nccl(ctx):
    b = Buffer(4, ctx.group)
    assert b.backend.name == "nccl" and b.device == torch.device("cuda", ctx.rank)
    return b.backend.name


def case_large_rows(ctx, seed, payload, hidden, tokens):
    """DeepSeek-V3 hidden size: the received rows equal the spec's bytes (native ops where built)."""
    g = torch.Generator().manual_seed(seed)
    n_exp, k, dev = 32, 8, ctx.device
    xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(ctx.world_size)]
    idxs = [torch.argsort(torch.rand(tokens, n_exp, generator=g), 1)[:, :k] for _ in range(ctx.world_size)]
    buf = Buffer(n_exp, ctx.group, payload=payload)
    out = buf.dispatch(xs[ctx.rank].to(dev), idxs[ctx.rank].to(dev), return_fp8=True)
    order = expected_order(idxs, ctx.rank, n_exp // ctx.world_size)
    per_source = [spec_rows(x.to(dev), payload) for x in xs]
    want = torch.stack([per_source[s][t] for s, t, _ in order])
    assert_bitwise_equal(out.rows, want, f"{payload} rows, hidden {hidden}")
    return len(order)


def case_sync_budget(ctx, seed, payload="bf16", alignment=1):
    """One host sync in a full dispatch; none in a cached dispatch (its rows and, with an alignment,
    its FP8 rows and their zero gap rows) or a combine."""
    g = torch.Generator().manual_seed(seed)
    dev = ctx.device
    x = torch.randn(64, 256, generator=g).to(dev, torch.bfloat16)
    idx = torch.argsort(torch.rand(64, 8, generator=g), 1)[:, :3].to(dev)
    w = torch.rand(64, 3, generator=g).to(dev)
    buf = Buffer(8, ctx.group, payload=payload)
    fp8 = alignment > 1
    warm = buf.dispatch(x, idx, w, expert_alignment=alignment, return_fp8=fp8)  # warm up the allocator, NCCL, kernels
    buf.combine(warm.values(), warm.handle)
    buf.combine(warm.values(), warm.handle, weighted=False)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = buf.dispatch(x, idx, w, expert_alignment=alignment, return_fp8=fp8)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(c.message) for c in caught if "called a synchronizing" in str(c.message)]
    assert len(syncs) <= 1, syncs
    assert out.handle.expert_alignment == alignment
    y = out.values()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = buf.dispatch(x, handle=out.handle, return_fp8=fp8)
        rows = again.rows
        cols = again.to_fp8_cols() if payload == "mxfp4" else None  # splits from the host: no wait
        combined = buf.combine(y, out.handle)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_bitwise_equal(rows, out.rows, "cached dispatch")
    if fp8:
        assert_bitwise_equal(again.fp8[0], out.fp8[0], "cached dispatch, fp8 data")
        assert_bitwise_equal(again.fp8[1], out.fp8[1], "cached dispatch, fp8 scales")
    if cols is not None:
        for a, b in zip(cols, out.to_fp8_cols()):
            assert_bitwise_equal(a, b, "fp8 columns of the cached dispatch")
    return len(syncs), tuple(combined.shape)


def _symm_buffer(ctx, n_exp, payload):
    from moe_fp4.ep.symmetric import SymmetricMemoryBackend

    return Buffer(n_exp, ctx.group, payload=payload, backend=SymmetricMemoryBackend(ctx.group))


def _check_pushed(buf):
    """A symm backend whose ranks could not map each other's buffers falls back to the NCCL
    all-to-all (with a warning): the symm cases must really have pushed."""
    assert buf.backend.mapped, "the symm backend fell back to the NCCL all-to-all"


def _same_outputs(got, ref, what):
    assert_bitwise_equal(got.recv_rows, ref.recv_rows, f"{what}: received rows")
    assert_bitwise_equal(got.rows, ref.rows, f"{what}: expert rows")
    assert_bitwise_equal(got.fp8[0], ref.fp8[0], f"{what}: fp8 data")
    assert_bitwise_equal(got.fp8[1], ref.fp8[1], f"{what}: fp8 scales")


class _TritonOff:
    """MOE_FP4_EP_TRITON=0 inside the block: the torch reference paths (native conversion + gather,
    combine by torch ops over the spec's decode)."""

    def __enter__(self):
        import os

        self.old = os.environ.get("MOE_FP4_EP_TRITON")
        os.environ["MOE_FP4_EP_TRITON"] = "0"

    def __exit__(self, *exc):
        import os

        if self.old is None:
            os.environ.pop("MOE_FP4_EP_TRITON", None)
        else:
            os.environ["MOE_FP4_EP_TRITON"] = self.old


def case_symm_matches_nccl(ctx, seed, payload, scenario, alignment=1):
    """Dispatch (full and cached) and combine (every wire, weighted or not) over symmetric memory
    and over NCCL with the Triton kernels give the bits of the torch reference paths (with the
    experts' rows at ``alignment``)."""
    xs, idxs, ws, n_exp = make_world(seed, ctx.world_size, scenario)
    x, idx, w = _to(ctx.device, xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank])
    nccl = Buffer(n_exp, ctx.group, payload=payload)
    symm = _symm_buffer(ctx, n_exp, payload)
    assert symm.backend.name == "symm" and symm.backend.usable(x)
    with _TritonOff():
        ref = nccl.dispatch(x, idx, w, return_fp8=True, expert_alignment=alignment)
    _same_outputs(nccl.dispatch(x, idx, w, return_fp8=True, expert_alignment=alignment), ref,
                  f"{payload} NCCL dispatch with Triton")
    got = symm.dispatch(x, idx, w, return_fp8=True, expert_alignment=alignment)
    _check_pushed(symm)
    _same_outputs(got, ref, f"{payload} full dispatch")
    for _ in range(2):  # cached dispatches reuse the staging buffer behind the barriers
        _same_outputs(symm.dispatch(x, handle=got.handle, return_fp8=True), ref, f"{payload} cached dispatch")
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randn(ref.handle.num_rows, x.shape[1], generator=g).to(ctx.device, torch.bfloat16)
    for wire in ("bf16", "fp8", "mxfp4"):
        for weighted in (True, False):
            with _TritonOff():
                want = nccl.combine(y, ref.handle, payload=wire, weighted=weighted)
            what = f"combine over {wire}, weighted={weighted}"
            assert_bitwise_equal(nccl.combine(y, ref.handle, payload=wire, weighted=weighted), want, f"NCCL {what}")
            assert_bitwise_equal(symm.combine(y, got.handle, payload=wire, weighted=weighted), want, f"symm {what}")
    return got.handle.num_rows


def case_symm_large(ctx, seed):
    """DeepSeek-V3 rows (hidden 7168, top-8 of 32 experts) over symmetric memory: equal to NCCL's,
    and the fused FP8 expert rows equal to the spec's conversion of the gathered rows."""
    g = torch.Generator().manual_seed(seed)
    n_exp, k, dev, tokens, hidden = 32, 8, ctx.device, 300 + 17 * ctx.rank, 7168
    x = torch.randn(tokens, hidden, generator=g).to(dev, torch.bfloat16)
    idx = torch.argsort(torch.rand(tokens, n_exp, generator=g), 1)[:, :k].to(dev)
    w = torch.rand(tokens, k, generator=g).to(dev)
    ref = Buffer(n_exp, ctx.group, payload="mxfp4").dispatch(x, idx, w, return_fp8=True)
    symm = _symm_buffer(ctx, n_exp, "mxfp4")
    got = symm.dispatch(x, idx, w, return_fp8=True)
    _check_pushed(symm)
    _same_outputs(got, ref, "mxfp4 hidden 7168")
    for _ in range(2):  # cached: the peers' rows land in this rank's buffer again behind the barriers
        _same_outputs(symm.dispatch(x, handle=got.handle, return_fp8=True), ref, "mxfp4 hidden 7168, cached")
    bf16_ref = Buffer(n_exp, ctx.group, payload="bf16").dispatch(x, handle=ref.handle)
    bf16 = symm.dispatch(x, handle=got.handle, payload="bf16")
    assert_bitwise_equal(bf16.recv_rows, bf16_ref.recv_rows, "bf16 rows hidden 7168")
    want_d, want_s = spec_fp8_of_rows(got.recv_rows, hidden, got.handle.expand_row)
    assert_bitwise_equal(got.fp8[0], want_d, "fused fp8 data vs spec")
    assert_bitwise_equal(got.fp8[1], want_s, "fused fp8 scales vs spec")
    # per received token (own rows converted inside the push, peers' rows as they land)
    n_recv = got.handle.num_recv_tokens
    tok_d, tok_s = spec_fp8_of_rows(got.recv_rows, hidden, torch.arange(n_recv, device=dev))
    for i in range(2):  # the second time with the handle's cached plan
        what = f"call {i}"
        tok = symm.dispatch(x, handle=got.handle, return_fp8="tokens")
        assert tok.fp8 is None
        assert_bitwise_equal(tok.recv_rows, got.recv_rows, f"received rows, {what}")
        assert_bitwise_equal(tok.recv_fp8[0], tok_d, f"per-token fp8 data, {what}")
        assert_bitwise_equal(tok.recv_fp8[1], tok_s, f"per-token fp8 scales, {what}")
        _same_outputs(symm.dispatch(x, handle=got.handle, return_fp8=True), ref, f"expert rows, {what}")
    # a dispatch and a combine right after the others reuse the buffer behind the barriers
    _same_outputs(symm.dispatch(x, handle=got.handle, return_fp8=True), ref, "push after the others")
    y = torch.randn(got.handle.num_rows, hidden, generator=g).to(dev, torch.bfloat16)
    want = Buffer(n_exp, ctx.group).combine(y, ref.handle)
    assert_bitwise_equal(symm.combine(y, got.handle), want, "combine hidden 7168")
    return got.handle.num_rows


def case_symm_sync_budget(ctx, seed):
    """No host synchronisation in a cached dispatch or a combine over symmetric memory."""
    g = torch.Generator().manual_seed(seed)
    dev = ctx.device
    x = torch.randn(64, 256, generator=g).to(dev, torch.bfloat16)
    idx = torch.argsort(torch.rand(64, 8, generator=g), 1)[:, :3].to(dev)
    w = torch.rand(64, 3, generator=g).to(dev)
    buf = _symm_buffer(ctx, 8, "mxfp4")
    out = buf.dispatch(x, idx, w, return_fp8=True)  # warm up: staging allocation, kernels, index plan
    _check_pushed(buf)
    y = out.values()
    buf.combine(y, out.handle)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = buf.dispatch(x, handle=out.handle, return_fp8=True)
        combined = buf.combine(y, out.handle)
        tokens = buf.dispatch(x, handle=out.handle, return_fp8="tokens")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_bitwise_equal(again.rows, out.rows, "cached dispatch")
    assert_bitwise_equal(tokens.recv_rows, out.recv_rows, "cached dispatch, FP8 per token")
    return tuple(combined.shape)


def case_symm_push_agreement(ctx, seed):
    """A rank that cannot map its peers' buffers makes every rank move its payloads through the NCCL
    all-to-all (decided together at the first allocation, so no rank pushes into a peer that does
    not): warnings name who failed; the rows and the combine equal the NCCL path's."""
    import warnings

    xs, idxs, ws, n_exp = make_world(seed, ctx.world_size, "random")
    x, idx, w = _to(ctx.device, xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank])
    symm = _symm_buffer(ctx, n_exp, "mxfp4")
    if ctx.rank == ctx.world_size - 1:
        def no_views(*args, **kwargs):
            raise RuntimeError("peer views refused (test)")

        symm.backend.peer_rows = no_views
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = symm.dispatch(x, idx, w, return_fp8=True)
    assert symm.backend.mapped is False, "a rank still pushes after a peer could not"
    want = "this rank cannot" if ctx.rank == ctx.world_size - 1 else "another rank cannot"
    assert any(want in str(c.message) and "NCCL all-to-all" in str(c.message) for c in caught), \
        [str(c.message) for c in caught]
    with _TritonOff():
        ref = Buffer(n_exp, ctx.group, payload="mxfp4").dispatch(x, idx, w, return_fp8=True)
    _same_outputs(got, ref, "NCCL after the agreement")
    _same_outputs(symm.dispatch(x, handle=got.handle, return_fp8=True), ref, "cached, NCCL after the agreement")
    y = got.values()
    assert_bitwise_equal(symm.combine(y, got.handle), Buffer(n_exp, ctx.group).combine(y, ref.handle),
                         "combine, NCCL after the agreement")
    return True


def test_push_destination_on_another_gpu_raises():
    """A destination tensor of another GPU (not a peer buffer mapped on this one) is refused."""
    from moe_fp4 import ops

    x = torch.randn(4, 64, device="cuda:0", dtype=torch.bfloat16)
    rows = torch.zeros(4, 1, dtype=torch.int64, device="cuda:0")
    with pytest.raises(ValueError, match=r"dests\[0\]: expected device cuda:0, got cuda:1"):
        ops.quantize_mxfp4_rows_multi(x, [torch.empty(4, 34, dtype=torch.uint8, device="cuda:1")], rows)


def test_symm_push_falls_back_on_every_rank_together(pool):
    pool.run(case_symm_push_agreement, case_seed())


@pytest.mark.parametrize("payload", ["mxfp4", "fp8", "bf16", "nvfp4"])
def test_symm_matches_nccl(pool, payload):
    pool.run(case_symm_matches_nccl, case_seed(), payload, "random")


@pytest.mark.parametrize("scenario", ["empty_rank", "duplicates", "no_route", "k_gt_local"])
def test_symm_matches_nccl_ragged(pool, scenario):
    pool.run(case_symm_matches_nccl, case_seed(), "mxfp4", scenario)


@pytest.mark.parametrize("payload,alignment", [("mxfp4", 32), ("bf16", 16)])
def test_symm_matches_nccl_aligned(pool, payload, alignment):
    pool.run(case_symm_matches_nccl, case_seed(), payload, "duplicates", alignment)


def test_symm_deepseek_rows(pool):
    pool.run(case_symm_large, case_seed())


def test_symm_sync_budget(pool):
    pool.run(case_symm_sync_budget, case_seed())


def case_num_sms(ctx, seed, backend, scenario):
    """Buffer(num_sms=2 / 24) gives the bits of the unbounded buffer (dispatch full, cached and
    sync-free, FP8 rows and tokens, combine over every wire) on 2 GPUs."""
    g = torch.Generator().manual_seed(seed + ctx.rank)
    n_exp, k, hidden = 16, 4, 512
    # many more tokens than 2 SMs' programs, so the bounded kernels loop
    tokens = 0 if scenario == "empty_rank" and ctx.rank == 1 else 600 + 37 * ctx.rank
    x = torch.randn(tokens, hidden, generator=g).to(ctx.device, torch.bfloat16)
    idx = torch.argsort(torch.rand(tokens, n_exp, generator=g), 1)[:, :k]
    idx[torch.rand(tokens, k, generator=g) < 0.2] = -1
    idx, w = idx.to(ctx.device), torch.rand(tokens, k, generator=g).to(ctx.device)
    n_free = ctx.world_size * 700

    shared = make_backend(ctx.group, backend)  # (one symmetric-memory allocation for the three buffers)

    def make(num_sms):
        return Buffer(n_exp, ctx.group, payload="mxfp4", backend=shared, num_sms=num_sms)

    check_num_sms_same_bits(make, x, idx, w, n_free)
    return True


@pytest.mark.parametrize("backend", [None, "symm"])
@pytest.mark.parametrize("scenario", ["random", "empty_rank"])
def test_num_sms_same_bits_2gpu(pool, backend, scenario):
    pool.run(case_num_sms, case_seed(), backend, scenario)


@pytest.mark.parametrize("hidden", [7168, 128, 2048])
def test_fused_conversion_matches_spec_gpu(hidden):
    """Triton gather and scatter (expansion) conversions against the spec, on the GPU."""
    from moe_fp4.ep import _triton_rows

    rows, index = check_fused_conversion(_triton_rows, hidden, "cuda", n=257, k=8)
    want_d, _ = spec_fp8_of_rows(rows, hidden, index)
    # a strided view of wider rows (the row stride is a kernel argument)
    wide = torch.zeros(257, rows.shape[1] + 64, dtype=torch.uint8, device="cuda")
    wide[:, :rows.shape[1]] = rows
    d2, _ = _triton_rows.mxfp4_rows_to_fp8_gather(wide[:, :rows.shape[1]], hidden, index)
    assert_bitwise_equal(d2, want_d, "fp8 data from strided rows")


def test_backend_is_nccl(pool):
    assert pool.run(case_backend_is_nccl) == ["nccl", "nccl"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_roundtrip_bf16_nccl(pool, scenario):
    pool.run(case_roundtrip_bf16, case_seed(), scenario)


@pytest.mark.parametrize("payload", ["mxfp4", "fp8", "nvfp4", "bf16"])
def test_received_rows_equal_spec_nccl(pool, payload):
    pool.run(case_payload_rows, case_seed(), payload)


@pytest.mark.parametrize("payload", ["mxfp4", "fp8", "bf16"])
def test_deepseek_rows_equal_spec_nccl(pool, payload):
    pool.run(case_large_rows, case_seed(), payload, 7168, 128)


@pytest.mark.parametrize("backward_payload", ["bf16", "fp8"])
def test_autograd_nccl(pool, backward_payload):
    pool.run(case_autograd, case_seed(), backward_payload)


def test_errors_nccl(pool):
    pool.run(case_errors, case_seed())


@pytest.mark.parametrize("payload,alignment", [("mxfp4", 32), ("mxfp4", 128), ("bf16", 8), ("fp8", 16)])
def test_expert_alignment_nccl(pool, payload, alignment):
    pool.run(case_expert_alignment, case_seed(), payload, alignment)


def test_autograd_with_expert_alignment_nccl(pool):
    pool.run(case_autograd_aligned, case_seed(), 32)


def test_sync_budget_with_expert_alignment_nccl(pool):
    res = pool.run(case_sync_budget, case_seed(), "mxfp4", 32)
    assert all(r[0] == 1 for r in res), res


def test_sync_budget_nccl(pool):
    res = pool.run(case_sync_budget, case_seed())
    assert all(r[0] == 1 for r in res), res


def case_sync_free_graph(ctx, backend):
    run_graph_case(Buffer(64, ctx.group, payload="mxfp4", backend=backend), 5150)


@pytest.mark.parametrize("backend", [None, "symm"])
@pytest.mark.parametrize("payload,alignment", [("mxfp4", 1), ("mxfp4", 32), ("bf16", 8), ("fp8", 1)])
def test_sync_free_equals_synced_gpu(pool, backend, payload, alignment):
    """The sync-free dispatch's valid rows, tables and combine equal the synced dispatch's (NCCL, symm)."""
    pool.run(case_sync_free, 7300 + alignment, payload, alignment, backend)


@pytest.mark.parametrize("backend", [None, "symm"])
def test_sync_free_overflow_gpu(pool, backend):
    pool.run(case_sync_free_overflow, 9400, backend)


@pytest.mark.parametrize("backend", [None, "symm"])
def test_sync_free_graph_gpu(pool, backend):
    """Dispatch, FP8 conversion and combine in one CUDA graph on 2 GPUs, replayed with new routing."""
    pool.run(case_sync_free_graph, backend)


def test_autograd_sync_free_gpu(pool):
    pool.run(case_autograd_sync_free, 9600)
