"""The dispatch's routing tables (moe_fp4.ops.routing): the torch functions against plain Python loops
(CPU), the native counting kernels against the torch functions bit for bit (GPU), and a dispatch
exchange of several ranks simulated on one device (each rank's metadata rows handed to its
destinations by slicing, as the all-to-all does)."""

import pytest
import torch

from moe_fp4.ops import routing

SEED = 20261128
SendLayout_fields = routing.SendLayout._fields
HEADER = [7168, 8, 256, 2, 3, 11]


def _routing(t, k, experts, seed, weights_dtype=torch.float32, kind="uniform"):
    """topk_idx int64 [t, k] and weights; kind: uniform (top-k of random scores), holes (-1 slots),
    one (every slot on expert 0 or -1), dup (repeated ids within a token), bad (ids out of range)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randn(t, experts, generator=g).topk(k, dim=1).indices
    if kind == "holes":
        idx[torch.rand(t, k, generator=g) < 0.3] = -1
    elif kind == "one":
        idx = torch.where(torch.rand(t, k, generator=g) < 0.5, 0, -1)
    elif kind == "dup":
        idx[:, -1] = idx[:, 0]
    elif kind == "bad":
        idx[torch.rand(t, k, generator=g) < 0.1] = experts + 3
        idx[torch.rand(t, k, generator=g) < 0.1] = -5
    w = torch.rand(t, k, generator=g).to(weights_dtype)
    return idx, w


def _loop_send(idx, w, experts, world, width, block=0):
    """The send layout by Python loops over tokens and ranks (block > 0: fixed blocks of that many rows)."""
    t, k = idx.shape
    ell = experts // world
    info = torch.zeros(world, width, dtype=torch.int64)
    info[:, routing.INFO_HEADER:routing.INFO_HEADER + len(HEADER)] = torch.tensor(HEADER)
    rows = [[] for _ in range(world)]
    for tok in range(t):
        for j in range(k):
            e = int(idx[tok, j])
            if e < -1 or e >= experts:
                info[:, routing.INFO_INVALID] += 1
            elif e >= 0:
                info[e // ell, routing.INFO_RANKS + world + e % ell] += 1
                info[e // ell, routing.INFO_RANKS + world + ell + j] += 1
        for r in range(world):
            if any(0 <= int(e) < experts and int(e) // ell == r for e in idx[tok]):
                rows[r].append(tok)
    for r in range(world):
        info[:, routing.INFO_RANKS + r] = len(rows[r])
    rank_table = torch.full((t, world), -1, dtype=torch.int64)
    send_token, meta = [], []
    bits = w.to(torch.float32).view(torch.int32)
    for r in range(world):
        if block:
            info[r, routing.INFO_DROPPED] = max(0, len(rows[r]) - block)
        for tok in rows[r][:block] if block else rows[r]:
            rank_table[tok, r] = len(send_token)
            send_token.append(tok)
            ids = [int(e) % ell if 0 <= int(e) < experts and int(e) // ell == r else -1 for e in idx[tok]]
            meta.append(ids + bits[tok].tolist() + [tok])
        while block and len(send_token) < (r + 1) * block:  # the block's unused rows
            send_token.append(0)
            meta.append([-1] * k + [0] * k + [-1])
    meta = torch.tensor(meta, dtype=torch.int32).view(-1, 2 * k + 1)
    return info, rank_table, torch.tensor(send_token, dtype=torch.int64), meta


def _loop_expand(meta, k, ell, alignment):
    """The expand layout by Python loops: entries by expert, in entry order within one."""
    n = meta.shape[0]
    per = [[] for _ in range(ell)]
    for q in range(n * k):
        e = int(meta[q // k, q % k])
        if 0 <= e < ell:
            per[e].append(q)
    lens = [len(p) for p in per]
    starts, acc = [], 0
    for c in lens:
        starts.append(acc)
        acc += -(-c // alignment) * alignment
    slot_table = torch.full((n, k), -1, dtype=torch.int64)
    expand_row = torch.full((acc,), -1, dtype=torch.int64)
    expand_slot = torch.full((acc,), -1, dtype=torch.int64)
    for e, entries in enumerate(per):
        for i, q in enumerate(entries):
            slot_table[q // k, q % k] = starts[e] + i
            expand_row[starts[e] + i] = q // k
            expand_slot[starts[e] + i] = q % k
    return slot_table, expand_row, expand_slot, torch.tensor(lens), torch.tensor(starts), acc


def _exchange(sends, world):
    """Simulated all-to-all of the ranks' send layouts: the metadata each rank receives, by source."""
    got = []
    for d in range(world):
        blocks = []
        for s in range(world):
            info, rank_table, send_token, meta = sends[s]
            counts = info[0, routing.INFO_RANKS:routing.INFO_RANKS + world].tolist()
            start = sum(counts[:d])
            blocks.append(meta[start:start + counts[d]])
        got.append(torch.cat(blocks))
    return got


@pytest.mark.parametrize("block", [0, 9, 40])
@pytest.mark.parametrize("kind", ["uniform", "holes", "one", "dup", "bad"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_send_layout_torch_matches_loops(kind, world, block):
    experts, k, t = 12, 3, 37
    idx, w = _routing(t, k, experts, SEED + world, kind=kind)
    width = routing.info_width(world, experts // world, 8)
    got = routing.send_layout_torch(idx, w, experts, world, HEADER, width, block)
    info, rank_table, send_token, meta = _loop_send(idx, w, experts, world, width, block)
    n_send = send_token.numel()
    assert torch.equal(got.info, info)
    assert torch.equal(got.rank_table, rank_table)
    assert torch.equal(got.send_token[:n_send], send_token)
    assert torch.equal(got.meta[:n_send], meta)


@pytest.mark.parametrize("alignment", [1, 4, 32])
@pytest.mark.parametrize("kind", ["uniform", "holes", "one", "dup"])
def test_expand_layout_torch_matches_loops(kind, alignment):
    experts, k, t, world = 16, 4, 29, 2
    ell = experts // world
    sends = []
    for s in range(world):
        idx, w = _routing(t + s, k, experts, SEED + 10 * s, kind=kind)
        sends.append(routing.send_layout_torch(idx, w, experts, world, HEADER, routing.info_width(world, ell, 8)))
    for meta in _exchange(sends, world):
        slot_table, expand_row, expand_slot, lens, starts, rows = _loop_expand(meta, k, ell, alignment)
        n_gap = rows - int(lens.sum())
        got = routing.expand_layout_torch(meta, k, ell, alignment, rows, n_gap, True)
        assert torch.equal(got.slot_table, slot_table)
        assert torch.equal(got.expand_row, expand_row)
        assert torch.equal(got.expand_slot, expand_slot)
        assert torch.equal(got.split_lens, lens)
        assert torch.equal(got.split_offsets, starts)
        bits = meta[:, k:2 * k].contiguous().view(torch.float32)
        expect_w = torch.where(expand_row >= 0, bits[expand_row.clamp(min=0), expand_slot.clamp(min=0)], 0.0)
        assert torch.equal(got.row_weights, expect_w)
        gaps = (expand_row < 0).nonzero().view(-1)
        assert (got.gap_rows is None and gaps.numel() == 0) or torch.equal(got.gap_rows, gaps)
        assert torch.equal(got.recv_topk_idx, meta[:, :k].long())
        assert torch.equal(got.recv_src_token, meta[:, 2 * k].long())
        assert int(got.rows_needed) == rows
        bound = ell * (alignment - 1)  # a gap list of a fixed size: the gaps, then R
        if bound:
            padded = routing.expand_layout_torch(meta, k, ell, alignment, rows, bound, True).gap_rows
            assert torch.equal(padded, torch.cat([gaps, torch.full((bound - gaps.numel(),), rows)]))


def test_expand_layout_torch_drops_rows_past_capacity():
    """Rows at or past num_rows are not written and their slots get -1 (the sync-free bound)."""
    k, ell = 2, 3
    meta = torch.tensor([[0, 1, 0, 0, 5], [1, 1, 0, 0, 6], [2, 0, 0, 0, 7]], dtype=torch.int32)
    full = routing.expand_layout_torch(meta, k, ell, 1, 6, 0, False)
    cut = routing.expand_layout_torch(meta, k, ell, 1, 4, 0, False)
    assert torch.equal(cut.expand_row, full.expand_row[:4])
    assert torch.equal(cut.slot_table, torch.where(full.slot_table < 4, full.slot_table, -1))


def _native_or_skip():
    from moe_fp4 import ops

    if not ops.native_available():
        pytest.fail("the native extension is not available on this GPU machine")


def _assert_send_equal(got, ref):
    n_send = int(ref.info[0, routing.INFO_RANKS:routing.INFO_RANKS + ref.rank_table.shape[1]].sum())
    assert torch.equal(got.info.cpu(), ref.info.cpu())
    assert torch.equal(got.rank_table.cpu(), ref.rank_table.cpu())
    assert torch.equal(got.send_token[:n_send].cpu(), ref.send_token[:n_send].cpu())
    assert torch.equal(got.meta[:n_send].cpu(), ref.meta[:n_send].cpu())


def _assert_expand_equal(got, ref):
    for name in routing.ExpandLayout._fields:
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,experts,world,kind,idx_dtype,w_dtype", [
    (16384, 8, 256, 2, "uniform", torch.int64, torch.float32),
    (8192, 8, 256, 8, "uniform", torch.int64, torch.bfloat16),
    (5000, 6, 64, 4, "holes", torch.int32, torch.float16),
    (3000, 4, 33, 3, "bad", torch.int64, torch.float32),
    (2049, 8, 256, 64, "dup", torch.int64, torch.float32),
    (1500, 2, 8, 1, "one", torch.int64, None),
    (0, 8, 256, 2, "uniform", torch.int64, torch.float32),
    (1, 1, 2, 2, "uniform", torch.int32, torch.float32),
])
def test_native_send_layout_equals_torch(t, k, experts, world, kind, idx_dtype, w_dtype):
    _native_or_skip()
    idx, w = _routing(t, k, experts, SEED + t, weights_dtype=w_dtype or torch.float32, kind=kind)
    idx, w = idx.to(idx_dtype).cuda(), (w.cuda() if w_dtype is not None else None)
    width = routing.info_width(world, experts // world, 128)
    got = routing.send_layout(idx, w, experts, world, HEADER, width)
    ref = routing.send_layout_torch(idx, w, experts, world, HEADER, width)
    _assert_send_equal(got, ref)
    for block in (t, t // 3 + 1):  # fixed blocks: every row is defined (and some tokens dropped in the second)
        got = routing.send_layout(idx, w, experts, world, HEADER, width, block)
        ref = routing.send_layout_torch(idx, w, experts, world, HEADER, width, block)
        for name in SendLayout_fields:
            assert torch.equal(getattr(got, name).cpu(), getattr(ref, name).cpu()), (block, name)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,experts,world,alignment,kind,weights", [
    (16384, 8, 256, 2, 1, "uniform", True),
    (16384, 8, 256, 2, 32, "uniform", True),
    (4096, 8, 256, 8, 128, "holes", True),
    (3000, 6, 2048, 2, 32, "dup", False),
    (1000, 4, 16, 4, 1, "one", True),
    (7, 2, 4, 2, 8, "uniform", True),
    (0, 8, 256, 2, 32, "uniform", True),
])
def test_native_expand_layout_equals_torch(t, k, experts, world, alignment, kind, weights):
    """Each simulated rank's received metadata expanded by the kernels and by torch."""
    _native_or_skip()
    ell = experts // world
    width = routing.info_width(world, ell, 128)
    sends = []
    for s in range(world):
        idx, w = _routing(t + 3 * s, k, experts, SEED + s, kind=kind)
        sends.append(routing.send_layout(idx.cuda(), w.cuda() if weights else None, experts, world, HEADER, width))
    for meta in _exchange(sends, world):
        lens = torch.bincount(meta[:, :k].long().clamp(min=-1).reshape(-1) + 1, minlength=ell + 1)[1:].cpu()
        rows = int(((lens + alignment - 1) // alignment * alignment).sum())
        n_gap = rows - int(lens.sum())
        got = routing.expand_layout(meta, k, ell, alignment, rows, n_gap, weights)
        ref = routing.expand_layout_torch(meta, k, ell, alignment, rows, n_gap, weights)
        _assert_expand_equal(got, ref)
        # a capacity below the rows: the same rows where they fit, -1 slots past it
        cap = rows // 2
        got = routing.expand_layout(meta, k, ell, alignment, cap, 0, weights)
        ref = routing.expand_layout_torch(meta, k, ell, alignment, cap, 0, weights)
        for name in ("slot_table", "expand_row", "expand_slot", "split_lens", "split_offsets", "recv_topk_idx",
                     "rows_needed"):
            assert torch.equal(getattr(got, name).cpu(), getattr(ref, name).cpu()), name
        # a capacity above the rows (the sync-free outputs): rows past the experts' are marked empty
        got = routing.expand_layout(meta, k, ell, alignment, rows + 50, n_gap, weights)
        ref = routing.expand_layout_torch(meta, k, ell, alignment, rows + 50, n_gap, weights)
        _assert_expand_equal(got, ref)
        bound = ell * (alignment - 1)  # a gap list of a fixed size, padded with the capacity
        for size in (rows + 50, cap):
            got = routing.expand_layout(meta, k, ell, alignment, size, bound, weights)
            ref = routing.expand_layout_torch(meta, k, ell, alignment, size, bound, weights)
            assert (got.gap_rows is None) == (ref.gap_rows is None)
            if bound:
                assert torch.equal(got.gap_rows.cpu(), ref.gap_rows.cpu())


@pytest.mark.gpu
def test_native_layout_no_host_sync():
    """Both layouts on CUDA run without a host synchronisation."""
    _native_or_skip()
    idx, w = _routing(4096, 8, 256, SEED, kind="uniform")
    idx, w = idx.cuda(), w.cuda()
    width = routing.info_width(2, 128, 128)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sent = routing.send_layout(idx, w, 256, 2, HEADER, width)
        routing.expand_layout(sent.meta[:4096], 8, 128, 32, 40000, 100, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
