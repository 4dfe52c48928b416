"""Single-process checks of the EP layer: layout, payload codecs against the spec, a world of one."""

from __future__ import annotations

import threading

import pytest
import torch
from _compare import assert_bitwise_equal

from moe_fp4 import formats
from moe_fp4.ep import Buffer, dispatch_layout, get_payload, make_backend, send_order
from moe_fp4.ep.backends import AllToAllBackend, LocalBackend
from moe_fp4.ep.symmetric import SymmetricMemoryBackend


def random_routing(t, k, num_experts, *, allow_dups=True):
    idx = torch.randint(-1, num_experts, (t, k))
    if not allow_dups:
        idx = torch.argsort(torch.rand(t, num_experts), 1)[:, :k]
    return idx


@pytest.mark.parametrize("world,experts,k", [(1, 4, 2), (2, 8, 3), (3, 6, 5), (4, 16, 8), (4, 4, 6)])
def test_layout_matches_brute_force(world, experts, k):
    t = 23
    idx = random_routing(t, k, experts)
    idx[0] = -1
    idx[1] = idx[1, 0].clamp(min=0)  # one token with its expert repeated k times
    lay = dispatch_layout(idx, experts, world)
    ell = experts // world
    in_rank = torch.zeros(t, world, dtype=torch.bool)
    per_expert = torch.zeros(experts, dtype=torch.int64)
    slots = torch.zeros(world, k, dtype=torch.int64)
    for i in range(t):
        for j in range(k):
            e = int(idx[i, j])
            if e >= 0:
                in_rank[i, e // ell] = True
                per_expert[e] += 1
                slots[e // ell, j] += 1
    assert torch.equal(lay.is_token_in_rank, in_rank)
    assert torch.equal(lay.num_tokens_per_rank, in_rank.sum(0))
    assert torch.equal(lay.num_tokens_per_expert, per_expert)
    assert torch.equal(lay.num_slots_per_rank, slots)
    assert int(lay.invalid) == 0
    n_send = int(in_rank.sum())
    tok, rank = send_order(lay, n_send)
    want = [(i, r) for r in range(world) for i in range(t) if in_rank[i, r]]
    assert list(zip(tok.tolist(), rank.tolist())) == want


def test_layout_counts_invalid_ids():
    idx = torch.tensor([[0, 9], [-3, 1], [2, -1]])
    lay = dispatch_layout(idx, 4, 2)
    assert int(lay.invalid) == 2
    assert lay.num_tokens_per_expert.tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("bad,what", [
    (lambda: dispatch_layout(torch.zeros(3, 2), 4, 2), "topk_idx"),
    (lambda: dispatch_layout(torch.zeros(3, dtype=torch.long), 4, 2), "topk_idx"),
    (lambda: dispatch_layout(torch.zeros(3, 2, dtype=torch.long), 5, 2), "num_experts"),
    (lambda: dispatch_layout(torch.zeros(3, 2, dtype=torch.long), 4, 0), "world_size"),
])
def test_layout_errors(bad, what):
    with pytest.raises(ValueError, match=what):
        bad()


def special_input(t, h):
    x = torch.randn(t, h) * torch.exp(2 * torch.randn(t, 1))
    x[0, :32] = 0
    x[1, 3] = float("nan")
    x[2, 70] = float("-inf")
    x[3, 10] = 1e-30
    x[4] = 448.0 * 6
    return x


def spec_rows(x, name):
    if name == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    if name == "fp8":
        d, s = formats.quantize_fp8_blockwise(x, block=(1, 128))
        return torch.cat((d.view(torch.uint8), s.view(torch.uint8)), 1)
    if name == "mxfp4":
        return formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    p, s, gs = formats.quantize_nvfp4(x)
    return torch.cat((p, s.view(torch.uint8), gs.reshape(1, 1).expand(x.shape[0], 1).contiguous().view(torch.uint8)), 1)


ROW_BYTES = {"bf16": lambda h: 2 * h, "fp8": lambda h: h + h // 32, "mxfp4": lambda h: h // 2 + h // 32,
             "nvfp4": lambda h: h // 2 + h // 16 + 4}


@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_rows_equal_spec(name, dtype):
    codec = get_payload(name)
    h = 256
    x = special_input(9, h).to(dtype)
    rows = codec.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (9, ROW_BYTES[name](h)) == (9, codec.row_bytes(h))
    assert_bitwise_equal(rows, spec_rows(x, name), f"{name} rows")
    values = codec.decode(rows, h)
    if name == "bf16":
        ref = x.to(torch.bfloat16).float()
    elif name == "fp8":
        ref = formats.dequantize_fp8_blockwise(*formats.quantize_fp8_blockwise(x, block=(1, 128)), block=(1, 128))
    elif name == "mxfp4":
        ref = formats.dequantize_mxfp4(*formats.quantize_mxfp4(x))
    else:
        ref = formats.dequantize_nvfp4(*formats.quantize_nvfp4(x))
    assert_bitwise_equal(values, ref, f"{name} decode")
    data, scales = codec.to_fp8_blockwise(rows, h)
    if name == "mxfp4":
        d_ref, s_ref, _ = formats.mxfp4_to_fp8_blockwise(*formats.quantize_mxfp4(x))
    elif name == "fp8":  # the payload is the FP8 operand itself
        d_ref, s_ref = formats.quantize_fp8_blockwise(x, block=(1, 128))
    else:
        d_ref, s_ref = formats.quantize_fp8_blockwise(ref, block=(1, 128))
    assert_bitwise_equal(data, d_ref, f"{name} -> fp8 data")
    assert_bitwise_equal(scales, s_ref, f"{name} -> fp8 scales")
    empty = codec.encode(x[:0])
    assert empty.shape == (0, codec.row_bytes(h))
    assert codec.decode(empty, h).shape == (0, h)


def test_deepseek_row_sizes():
    h = 7168
    assert get_payload("mxfp4").row_bytes(h) == 3808 == h // 2 + h // 32
    assert get_payload("fp8").row_bytes(h) == 7392
    assert get_payload("bf16").row_bytes(h) == 14336
    assert get_payload("nvfp4").row_bytes(h) == 4036


def test_nvfp4_decode_of_rows_from_several_senders():
    codec = get_payload("nvfp4")
    a, b = torch.randn(5, 64), torch.randn(4, 64) * 100
    rows = torch.cat((codec.encode(a), codec.encode(b)))[torch.tensor([0, 5, 1, 6, 2, 7, 3, 8, 4])]
    got = codec.decode(rows, 64)
    ref = torch.cat((formats.dequantize_nvfp4(*formats.quantize_nvfp4(a)),
                     formats.dequantize_nvfp4(*formats.quantize_nvfp4(b))))[torch.tensor([0, 5, 1, 6, 2, 7, 3, 8, 4])]
    assert_bitwise_equal(got, ref, "nvfp4 decode")


@pytest.mark.parametrize("name,h,what", [("mxfp4", 48, "32"), ("fp8", 96, "128"), ("nvfp4", 40, "32"),
                                         ("bf16", 33, "32")])
def test_codec_hidden_errors(name, h, what):
    with pytest.raises(ValueError, match=what):
        get_payload(name).encode(torch.randn(3, h))


def test_codec_input_errors():
    codec = get_payload("mxfp4")
    with pytest.raises(ValueError, match="x"):
        codec.encode(torch.ones(3, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows"):
        codec.decode(torch.zeros(3, 64, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="rows"):
        codec.decode(torch.zeros(3, 36), 64)
    with pytest.raises(ValueError, match="payload"):
        get_payload("fp4")
    with pytest.raises(ValueError, match="scale_rounding"):
        get_payload("mxfp4").__class__(scale_rounding="nearest")


def test_world_of_one_dispatch_combine():
    buf = Buffer(6, payload="bf16")
    assert isinstance(buf.backend, LocalBackend)
    x = torch.randn(17, 128)
    idx = random_routing(17, 4, 6)
    w = torch.rand(17, 4)
    out = buf.dispatch(x, idx, w, return_fp8=True)
    assert out.tokens_per_expert == [int((idx == e).sum()) for e in range(6)]
    order = [(t, j) for e in range(6) for t, j in (idx == e).nonzero().tolist()]
    assert_bitwise_equal(out.values(), torch.stack([x[t] for t, _ in order]).to(torch.bfloat16), "rows")
    y = out.values() * 3
    got = buf.combine(y, out.handle)
    ref = torch.zeros(17, 128)
    for t in range(17):
        for j in range(4):
            if idx[t, j] >= 0:
                ref[t] = ref[t] + (x[t].to(torch.bfloat16) * 3).float() * w[t, j]
    assert_bitwise_equal(got, ref.to(torch.bfloat16), "combine")



@pytest.mark.parametrize("alignment", [2, 32])
def test_world_of_one_expert_alignment(alignment):
    """A world of one with expert_alignment: every expert starts on a multiple of it, the rows are
    the back-to-back rows at those starts, the rows between are zero and combine ignores them."""
    torch.manual_seed(20261128 + alignment)
    buf = Buffer(6, payload="mxfp4")
    x = torch.randn(23, 128)
    idx = random_routing(23, 4, 6)
    w = torch.rand(23, 4)
    ref = buf.dispatch(x, idx, w, return_fp8=True)
    got = buf.dispatch(x, idx, w, return_fp8=True, expert_alignment=alignment)
    lens = ref.tokens_per_expert
    padded = [-(-c // alignment) * alignment for c in lens]
    starts = [sum(padded[:e]) for e in range(6)]
    assert got.split_offsets.tolist() == starts and got.split_lens.tolist() == lens
    assert got.handle.num_rows == sum(padded) == got.rows.shape[0] == got.fp8[0].shape[0]
    dst = torch.tensor([starts[e] + i for e, c in enumerate(lens) for i in range(c)])
    gap = torch.ones(sum(padded), dtype=torch.bool)
    gap[dst] = False
    assert_bitwise_equal(got.rows[dst], ref.rows, "rows")
    assert int(got.rows[gap].count_nonzero()) == 0
    for out in (ref, got):  # rows of 68 bytes (H = 128) at a 128-byte row stride (CUDA's allocator
        # also starts the buffer on a 128-byte line; the CPU's on 64 bytes)
        assert out.rows.shape[1] == 68 and out.rows.stride() == (128, 1)
    assert_bitwise_equal(got.fp8[0][dst], ref.fp8[0], "fp8 data")
    assert_bitwise_equal(got.fp8[1][dst], ref.fp8[1], "fp8 scales")
    y = torch.full((sum(padded), 128), float("inf"))
    y[dst] = ref.values().float() * 3
    assert_bitwise_equal(buf.combine(y, got.handle), buf.combine(ref.values().float() * 3, ref.handle), "combine")
    if sum(padded) != sum(lens):
        with pytest.raises(ValueError, match="y: expected"):
            buf.combine(ref.values(), got.handle)  # the back-to-back row count
    x96 = torch.randn(5, 96)  # an mxfp4 hidden size the column operand does not take
    with pytest.raises(ValueError, match="to_fp8_cols: needs a hidden size that is a multiple of 128, got 96"):
        buf.dispatch(x96, idx[:5], expert_alignment=alignment).to_fp8_cols()

def test_make_backend_choices():
    assert isinstance(make_backend(None, None), LocalBackend)
    assert isinstance(make_backend(None, "local"), LocalBackend)
    with pytest.raises(ValueError, match="backend"):
        make_backend(None, "nccl")
    with pytest.raises(ValueError, match="backend"):
        make_backend(None, "mpi")
    with pytest.raises(ValueError, match="num_experts"):
        Buffer(0)


def test_gather_rows_any_width_and_slices():
    from moe_fp4.ep.payloads import gather_rows

    rows = torch.randint(0, 256, (11, 3808), dtype=torch.uint8)
    idx = torch.randint(0, 11, (20,))
    for view in (rows, rows[:, 3584:], rows[:, 1:6], rows[:, :4036 - 3808 + 100]):
        assert torch.equal(gather_rows(view, idx), view[idx])
    b = torch.randn(11, 96).to(torch.bfloat16)
    got = gather_rows(b, idx)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), b[idx].view(torch.int16))


@pytest.mark.parametrize("wire", ["fp8", "mxfp4"])
def test_combine_with_a_quantized_wire(wire):
    """The partial sums travel in the given payload: out = bf16(decode(encode(partial)))."""
    buf = Buffer(4, payload="bf16")
    x = torch.randn(13, 256)
    idx = random_routing(13, 3, 4)
    w = torch.rand(13, 3)
    out = buf.dispatch(x, idx, w)
    assert not hasattr(out, "num_recv_tokens_per_expert_list")  # DeepEP's name: moe_fp4.ep.deep_ep_compat
    y = out.values() * 2
    partial = torch.zeros(13, 256)
    for j in range(3):
        sel = idx[:, j] >= 0
        partial[sel] = partial[sel] + (x[sel].to(torch.bfloat16) * 2).float() * w[sel, j:j + 1]
    codec = get_payload(wire)
    routed = (idx >= 0).any(1)
    ref = torch.zeros(13, 256)
    ref[routed] = ref[routed] + codec.decode(codec.encode(partial[routed]), 256)  # sums start from +0
    assert_bitwise_equal(buf.combine(y, out.handle, payload=wire), ref.to(torch.bfloat16), f"combine over {wire}")


def test_gather_rows_into_a_slice():
    from moe_fp4.ep.payloads import gather_rows

    rows = torch.randint(0, 256, (9, 544), dtype=torch.uint8)
    idx = torch.tensor([4, 0, 8])
    dest = torch.zeros(7, 544, dtype=torch.uint8)
    gather_rows(rows, idx, out=dest[2:5])
    assert torch.equal(dest[2:5], rows[idx]) and not dest[:2].any() and not dest[5:].any()


# ------------------------------------------------------------------------------------------------
# Triton row kernels of the dispatch path, in Triton's CPU interpreter where Triton is installed
# (the GPU runs are in test_ep_gpu.py)
# ------------------------------------------------------------------------------------------------


def mxfp4_rows_with_specials(n: int, hidden: int, g: torch.Generator) -> torch.Tensor:
    """uint8 MXFP4 byte rows [n, H/2 + H/32]: the spec's encoding of values spread over many
    binades, plus rows of random codes with random scale bytes (0, 255 = NaN, wide spreads inside a
    128-group so that elements fall into E4M3's subnormals and below), negative zeros, all-zero rows."""
    spread = torch.exp(3 * torch.randn(n, hidden // 32, generator=g)).repeat_interleave(32, 1)
    x = torch.randn(n, hidden, generator=g) * spread
    rows = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x))
    q = max(1, n // 4)
    h2 = hidden // 2
    rows[:q, :h2] = torch.randint(0, 256, (q, h2), generator=g, dtype=torch.uint8)
    rows[:q, h2:] = torch.randint(0, 256, (q, hidden // 32), generator=g, dtype=torch.uint8)
    rows[q:2 * q, h2:] = torch.randint(110, 140, (q, hidden // 32), generator=g, dtype=torch.uint8)
    rows[q:2 * q, :h2] = torch.randint(0, 256, (q, h2), generator=g, dtype=torch.uint8)
    if n > 2 * q + 2:
        rows[2 * q, :h2] = 0x88  # negative zeros
        rows[2 * q + 1] = 0
        rows[2 * q + 2, h2] = 255  # one NaN block
    return rows


def spec_fp8_of_rows(rows: torch.Tensor, hidden: int, index: torch.Tensor):
    data, scales, _ = formats.mxfp4_to_fp8_blockwise(*formats.unpack_mxfp4_rows(rows, hidden))
    return data[index], scales[index]


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


# the checks that run under the Triton interpreter, all in one process (its start and the kernels'
# first runs take seconds): the first test to ask runs them all, each test reads its own result
_INTERPRETED = ("check_fused_gather_conversion", "check_copy_rows_and_peer_sums",
                "check_direct_path_in_a_world_of_one", "check_push_path_in_a_world_of_one",
                "check_num_sms_kernels_same_bits")
_interpreted_results: dict[str, str] = {}
_RUNNER = """
import json, traceback
import test_ep_local as t
out = {}
for name in %r:
    try:
        getattr(t, name)()
        out[name] = ""
    except BaseException:
        out[name] = traceback.format_exc()[-3000:]
print("\\n@results " + json.dumps(out))
"""


def _interpreted(check: str) -> None:
    """Run ``check`` (a function of this module, listed in _INTERPRETED) in a fresh process under
    TRITON_INTERPRET=1: Triton decides between compiling and interpreting when it is imported."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    if not _has_triton() or torch.cuda.is_available():
        pytest.skip("needs Triton without a GPU (the interpreter); GPU runs are in test_ep_gpu.py")
    if not _interpreted_results:
        here = pathlib.Path(__file__).resolve().parent
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]))
        res = subprocess.run([sys.executable, "-c", _RUNNER % (list(_INTERPRETED),)], env=env,
                             capture_output=True, text=True, timeout=300)
        found = [ln for ln in res.stdout.splitlines() if ln.startswith("@results ")]
        if found:
            _interpreted_results.update(json.loads(found[-1][len("@results "):]))
        else:  # the process died: every check reports its output
            _interpreted_results.update(dict.fromkeys(_INTERPRETED, res.stdout[-3000:] + res.stderr[-3000:]))
    assert not _interpreted_results[check], _interpreted_results[check]


def test_fused_gather_conversion_matches_spec_interpreted():
    _interpreted("check_fused_gather_conversion")


def test_copy_rows_and_peer_sums_interpreted():
    _interpreted("check_copy_rows_and_peer_sums")


def test_num_sms_kernels_same_bits_interpreted():
    _interpreted("check_num_sms_kernels_same_bits")


def check_num_sms_kernels_same_bits():
    """Every Triton kernel of the dispatch and combine under an SM budget of one SM (16 programs on
    the interpreter's 64 warps per SM, so each loops over its 40+ work items) gives the bits of its
    unbounded grid (one program per item)."""
    from moe_fp4.ep import _triton_combine as tc
    from moe_fp4.ep import _triton_rows as tr
    from moe_fp4.ep import sms

    assert sms.max_programs(1, "cpu") == 16 and sms.grid(45, 16) == 16 and sms.grid(45, None) == 45
    tc._BF16_STORE_OK[torch.device("cpu")] = False
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    n, hidden, k = 45, 256, 3
    rows = mxfp4_rows_with_specials(n, hidden, g)
    slots = torch.randperm(n * k, generator=g).reshape(n, k)
    slots[torch.rand(n, k, generator=g) < 0.3] = -1
    index = torch.randint(0, n, (n + 7,), generator=g)
    src = torch.randn(n, hidden, generator=g)
    table = torch.randint(-1, n, (n, k), generator=g)
    weights = torch.rand(n, k, generator=g)
    bases = torch.tensor([rows.data_ptr()] * 2, dtype=torch.int64)
    rank_table = torch.randint(-1, n, (n, 2), generator=g)
    src_rank = torch.randint(0, 2, (n + 7,), generator=g)
    used = slots[slots >= 0]  # (the scatter's other output rows are not written)
    outs = {}
    for num_sms in (None, 1):
        outs[num_sms] = [
            *(t[used] for t in tr.mxfp4_rows_to_fp8_scatter(rows, hidden, slots, n * k, num_sms=num_sms)),
            *tr.mxfp4_rows_to_fp8_gather(rows, hidden, index, num_sms=num_sms),
            tr.copy_rows(torch.zeros(n + 7, rows.shape[1], dtype=torch.uint8), index, src_rank, bases,
                         num_sms=num_sms),
            tc.gather_sum(src, table, weights, torch.float32, num_sms=num_sms),
            tc.gather_sum(src, table, None, torch.bfloat16, num_sms=num_sms),
            tc.decode_sum(bases, rank_table, hidden, "mxfp4", num_sms=num_sms),
        ]
    for i, (a, b) in enumerate(zip(outs[None], outs[1])):
        assert_bitwise_equal(b, a, f"output {i} with num_sms=1")


@pytest.mark.parametrize("bad", [0, -2, 1.5, "24", True])
def test_num_sms_rejects_bad_values(bad):
    """num_sms: None or a positive int, in the constructor and in set_num_sms (the value is kept)."""
    with pytest.raises(ValueError, match=r"num_sms: expected None \(no bound\) or a positive int"):
        Buffer(4, num_sms=bad)
    buf = Buffer(4, num_sms=24)
    with pytest.raises(ValueError, match=r"num_sms: expected None \(no bound\) or a positive int"):
        buf.set_num_sms(bad)
    assert buf.num_sms == 24
    buf.set_num_sms(None)
    assert buf.num_sms is None


def test_num_sms_same_bits_world_of_one():
    """A world of one on CPU (the spec and torch paths: num_sms bounds nothing there, but every path
    takes it): the outputs equal the unbounded buffer's; the SM budget's block counts."""
    from moe_fp4.ep import sms

    assert sms.max_blocks(None, 8, "cpu") is None and sms.max_blocks(24, 8, "cpu") == 192
    assert sms.max_blocks(1, 256, "cpu") == 1  # (never below one block)
    x, idx, w = torch.randn(37, 256), random_routing(37, 3, 4), torch.rand(37, 3)
    ref_buf, buf = Buffer(4), Buffer(4, num_sms=2)
    for payload in ("mxfp4", "fp8", "bf16", "nvfp4"):
        ref = ref_buf.dispatch(x, idx, w, payload=payload, return_fp8=True)
        got = buf.dispatch(x, idx, w, payload=payload, return_fp8=True)
        assert_bitwise_equal(got.rows, ref.rows, f"{payload} rows")
        assert_bitwise_equal(got.fp8[0], ref.fp8[0], f"{payload} fp8")
        y = ref.values().to(torch.bfloat16)
        assert_bitwise_equal(buf.combine(y, got.handle), ref_buf.combine(y, ref.handle), f"{payload} combine")


def test_deep_ep_compat_forwards_num_sms():
    """deep_ep_compat.Buffer.set_num_sms (class-level, even, as DeepEP's) is the SM budget of the
    underlying moe_fp4 Buffer at each call."""
    from moe_fp4.ep import deep_ep_compat as de

    saved = de.Buffer.num_sms
    try:
        b = de.Buffer()
        inner = b._inner(4)
        assert inner.num_sms == 20  # DeepEP's default
        de.Buffer.set_num_sms(24)
        assert b._inner(4).num_sms == 24
        with pytest.raises(ValueError, match="new_num_sms: expected a positive even int"):
            de.Buffer.set_num_sms(23)
    finally:
        de.Buffer.num_sms = saved


def check_fused_gather_conversion():
    from moe_fp4.ep import _triton_rows as tr

    for hidden in (128, 384):
        _check_fused_gather_conversion(tr, hidden)


def check_fused_conversion(tr, hidden, device="cpu", n=24, k=3):
    """The Triton gather and scatter conversions of MXFP4 rows with special values (on ``device``)
    against the spec's conversion of the same rows."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    rows = mxfp4_rows_with_specials(n, hidden, g).to(device)
    index = torch.randint(0, n, (n + n // 2,), generator=g).to(device)
    data, scales = tr.mxfp4_rows_to_fp8_gather(rows, hidden, index)
    want_d, want_s = spec_fp8_of_rows(rows, hidden, index)
    assert_bitwise_equal(data, want_d, "fp8 data")
    assert_bitwise_equal(scales, want_s, "fp32 scales")
    # scatter form: each row converted once, written to its output rows (a random map)
    n_out = (n * k * 2) // 3
    slot = torch.full((n * k,), -1, dtype=torch.int64)
    used = torch.randperm(n * k, generator=g)[:n_out]
    slot[used] = torch.arange(n_out)
    slot = slot.reshape(n, k)
    token_of_row = torch.empty(n_out, dtype=torch.int64)
    token_of_row[slot[slot >= 0]] = torch.arange(n).unsqueeze(1).expand(n, k)[slot >= 0]
    slot, token_of_row = slot.to(device), token_of_row.to(device)
    want_d, want_s = spec_fp8_of_rows(rows, hidden, token_of_row)
    got_d, got_s = tr.mxfp4_rows_to_fp8_scatter(rows, hidden, slot, n_out)
    assert_bitwise_equal(got_d, want_d, "scattered fp8 data")
    assert_bitwise_equal(got_s, want_s, "scattered fp32 scales")
    got_d, got_s = get_payload("mxfp4").expand_fp8_blockwise(rows, hidden, slot, n_out, token_of_row)
    assert_bitwise_equal(got_d, want_d, "payload fp8 data")
    return rows, index


def _check_fused_gather_conversion(tr, hidden):
    rows, index = check_fused_conversion(tr, hidden)
    for bad, what in (((rows[:, 1:], hidden, index), "rows"), ((rows, hidden, index.to(torch.int32)), "index")):
        with pytest.raises(ValueError, match=what):
            tr.mxfp4_rows_to_fp8_gather(*bad)


def check_copy_rows_and_peer_sums():
    """The kernels read rows through a table of buffer addresses (peers' buffers on GPUs; here two
    local tensors)."""
    from moe_fp4.ep import _triton_combine as tc
    from moe_fp4.ep import _triton_rows as tr

    tc._BF16_STORE_OK[torch.device("cpu")] = False  # the interpreter's bf16 store: let torch round
    a = torch.randint(0, 256, (10, 96), dtype=torch.uint8)
    b = torch.randint(0, 256, (7, 96), dtype=torch.uint8)
    bases = torch.tensor([a.data_ptr(), b.data_ptr()], dtype=torch.int64)
    idx, rank = torch.tensor([3, 0, 6, 9, 2]), torch.tensor([0, 1, 1, 0, 1])
    want = torch.stack([(a, b)[r][i] for i, r in zip(idx.tolist(), rank.tolist())])
    out = tr.copy_rows(torch.empty(5, 96, dtype=torch.uint8), idx, rank, bases)
    assert torch.equal(out, want)
    # many rows from three buffers
    big = [torch.randint(0, 256, (700, 40), dtype=torch.uint8) for _ in range(3)]
    idx3, rank3 = torch.randint(0, 700, (2500,)), torch.randint(0, 3, (2500,))
    want3 = torch.stack([big[r][i] for i, r in zip(idx3.tolist(), rank3.tolist())])
    got3 = tr.copy_rows(torch.zeros(2500, 40, dtype=torch.uint8), idx3, rank3,
                        torch.tensor([b_.data_ptr() for b_ in big], dtype=torch.int64))
    assert torch.equal(got3, want3)
    odd = tr.copy_rows(torch.empty(5, 17, dtype=torch.uint8), idx, rank,
                       torch.tensor([a.data_ptr(), b.data_ptr()], dtype=torch.int64))
    assert torch.equal(odd, torch.stack([(a, b)[r].reshape(-1)[i * 17:(i + 1) * 17]
                                         for i, r in zip(idx.tolist(), rank.tolist())]))
    pa, pb = torch.randn(6, 48).to(torch.bfloat16), torch.randn(4, 48).to(torch.bfloat16)
    table = torch.tensor([[0, 3], [-1, 1], [5, -1], [-1, -1]])
    got = tc.gather_sum_peers(torch.tensor([pa.data_ptr(), pb.data_ptr()], dtype=torch.int64), table, 48)
    want = torch.zeros(4, 48)
    for t in range(4):
        for r, src in enumerate((pa, pb)):
            if table[t, r] >= 0:
                want[t] = want[t] + src[table[t, r]].float()
    assert_bitwise_equal(got, want.to(torch.bfloat16), "sums over peer buffers")


class _OneRankDirect(SymmetricMemoryBackend):
    """The symm backend's payload exchange in a world of one on CPU: the staging buffer is a plain
    tensor, barriers are recorded (no NCCL group: SymmetricMemoryBackend.__init__ is not run)."""

    side_stream = None

    def __init__(self):
        self.name, self.rank, self.world_size, self.device = "symm", 0, 1, torch.device("cpu")
        self.mapped, self._handle = True, "fake"
        self.capacity, self.barriers, self._keep = 0, [], []

    def all_to_all(self, out, inp, out_splits, in_splits):
        out.copy_(inp)

    def peer_rows(self, rank, rows, width):
        return self.staging(rows, width)

    def usable(self, t):
        return True

    def ensure_capacity(self, nbytes):
        if nbytes > self.capacity:
            self._keep.append(torch.zeros(max(nbytes, 1), dtype=torch.uint8))
            self.bases = torch.tensor([self._keep[-1].data_ptr()], dtype=torch.int64)
            self.capacity = nbytes

    def staging(self, rows, width):
        return self._keep[-1][: rows * width].view(rows, width)

    def barrier(self, channel):
        self.barriers.append(channel)


def check_direct_path_in_a_world_of_one():
    """The symm backend's push dispatch and combine_sums (partials through the staging buffer, sums
    over the buffers) of float32 tokens give the all-to-all path's bits, also under an SM budget of
    one SM (the copy-out and every Triton kernel then loop over their work)."""
    from moe_fp4.ep import _triton_combine

    _triton_combine._BF16_STORE_OK[torch.device("cpu")] = False
    for payload in ("mxfp4", "bf16", "fp8", "nvfp4"):
        x = torch.randn(29, 256) * 3
        idx = random_routing(29, 3, 4)
        w = torch.rand(29, 3)
        ref = Buffer(4, payload=payload).dispatch(x, idx, w, return_fp8=True)
        for num_sms in (None, 1):
            backend = _OneRankDirect()
            buf = Buffer(4, payload=payload, backend=backend, num_sms=num_sms)
            got = buf.dispatch(x, idx, w, return_fp8=True)
            what = f"{payload}, num_sms={num_sms}"
            assert_bitwise_equal(got.recv_rows, ref.recv_rows, f"{what}: received rows")
            assert_bitwise_equal(got.fp8[0], ref.fp8[0], f"{what}: fp8")
            assert_bitwise_equal(got.fp8[1], ref.fp8[1], f"{what}: fp8 scales")
            assert backend.barriers == [0, 1], backend.barriers
            y = (ref.values() * 2).to(torch.bfloat16)
            for wire in ("bf16", "fp8", "mxfp4", "nvfp4"):
                for weighted in (True, False):
                    backend.barriers.clear()
                    want = Buffer(4).combine(y, ref.handle, payload=wire, weighted=weighted)
                    have = buf.combine(y, got.handle, payload=wire, weighted=weighted)
                    assert_bitwise_equal(have, want, f"combine over {wire}, weighted={weighted}, {what}")
                    assert backend.barriers == [0, 1], (wire, backend.barriers)


def test_direct_path_in_a_world_of_one_interpreted():
    _interpreted("check_direct_path_in_a_world_of_one")


def check_push_path_in_a_world_of_one():
    """The push dispatch (each row stored straight into its receiver's rows, behind two barriers)
    gives the all-to-all path's bits for every payload, full and cached, with the FP8 expert rows
    converted from them; a combine over the same buffer afterwards gives the all-to-all path's sums.
    (float32 tokens and rows that land in peers' buffers: test_push_rows_land_in_peer_buffers.)"""
    from moe_fp4.ep import _triton_combine

    _triton_combine._BF16_STORE_OK[torch.device("cpu")] = False
    for payload in ("mxfp4", "bf16", "fp8", "nvfp4"):
        x = (torch.randn(23, 256) * 3).to(torch.bfloat16)
        idx = random_routing(23, 3, 4)
        idx[5] = -1  # a token sent nowhere
        w = torch.rand(23, 3)
        ref = Buffer(4, payload=payload).dispatch(x, idx, w, return_fp8=True)
        backend = _OneRankDirect()
        buf = Buffer(4, payload=payload, backend=backend)
        got = buf.dispatch(x, idx, w, return_fp8=True)
        again = buf.dispatch(x, handle=got.handle, return_fp8=True)
        for out, what in ((got, "full"), (again, "cached")):
            assert_bitwise_equal(out.recv_rows, ref.recv_rows, f"{payload} {what}: received rows")
            assert_bitwise_equal(out.fp8[0], ref.fp8[0], f"{payload} {what}: fp8")
            assert_bitwise_equal(out.fp8[1], ref.fp8[1], f"{payload} {what}: fp8 scales")
        assert backend.barriers == [0, 1, 0, 1], backend.barriers
        if payload == "mxfp4":  # (the combine's wire does not depend on the dispatch payload)
            y = (ref.values() * 2).to(torch.bfloat16)
            assert_bitwise_equal(buf.combine(y, again.handle), Buffer(4).combine(y, ref.handle),
                                 "combine after the push")


def test_push_path_in_a_world_of_one_interpreted():
    _interpreted("check_push_path_in_a_world_of_one")


class _ThreadWorld:
    """Ranks as threads of one process: a barrier, one mailbox and one buffer per rank."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.sync = threading.Barrier(world_size, timeout=60)
        self.mail = [None] * world_size
        self.buffers = [None] * world_size


class _ThreadRank(AllToAllBackend):
    """all_to_all between the threads of a _ThreadWorld (the reference path)."""

    name = "threads"

    def __init__(self, world, rank):
        self.world, self.rank, self.world_size = world, rank, world.world_size

    def all_to_all(self, out, inp, out_splits, in_splits):
        w = self.world_size
        self.world.mail[self.rank] = inp.split(in_splits or [inp.shape[0] // w] * w)
        self.world.sync.wait()
        out.copy_(torch.cat([self.world.mail[s][self.rank] for s in range(w)]))
        self.world.sync.wait()  # every rank has read its blocks before the mailboxes change


class _ThreadRankDirect(SymmetricMemoryBackend):
    """The symm backend's push dispatch between threads: peer_rows hands out the other ranks'
    buffers (pre-filled with 0x5A), so each rank's rows really land in its receivers' buffers."""

    side_stream = None
    all_to_all = _ThreadRank.all_to_all

    def __init__(self, world, rank):
        self.world, self.rank, self.world_size, self.device = world, rank, world.world_size, torch.device("cpu")
        self.name, self.mapped, self._handle = "symm", True, "fake"
        self.capacity, self.barriers = 0, []

    def usable(self, t):
        return True

    def ensure_capacity(self, nbytes):
        if nbytes > self.capacity:  # collective, as the symmetric-memory allocation
            self.world.buffers[self.rank] = torch.full((nbytes,), 0x5A, dtype=torch.uint8)
            self.capacity = nbytes
            self.world.sync.wait()

    def staging(self, rows, width):
        return self.world.buffers[self.rank][: rows * width].view(rows, width)

    def peer_rows(self, rank, rows, width):
        return self.world.buffers[rank][: rows * width].view(rows, width)

    def barrier(self, channel):
        self.barriers.append(channel)
        self.world.sync.wait()


def _run_threads(world_size, fn, *args):
    """fn(world, rank, *args) on world_size threads; returns their results, re-raises the first error."""
    world = _ThreadWorld(world_size)
    results, errors = [None] * world_size, []

    def body(rank):
        try:
            results[rank] = fn(world, rank, *args)
        except BaseException as e:  # a failing rank releases the others' barriers
            errors.append(e)
            world.sync.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


def _push_rank(world, rank, payload, xs, idxs, ws, n_exp):
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    ref = Buffer(n_exp, payload=payload, backend=_ThreadRank(world, rank)).dispatch(x, idx, w)
    backend = _ThreadRankDirect(world, rank)
    buf = Buffer(n_exp, payload=payload, backend=backend)
    got = buf.dispatch(x, idx, w)
    again = buf.dispatch(x, handle=got.handle)  # overwrites the buffers: got's rows must be a copy
    return ref.recv_rows, got.recv_rows, again.recv_rows, backend.barriers


@pytest.mark.parametrize("payload", ["mxfp4", "bf16", "fp8", "nvfp4"])
def test_push_rows_land_in_peer_buffers(payload):
    """The push dispatch in a world of three threads (batches of 23, 0 and 17 tokens): each rank
    stores its rows into the other ranks' buffers, each receiver copies them out; the received rows
    equal the all-to-all path's, full and cached, float32 and bfloat16 tokens."""
    n_exp, k, tokens = 6, 3, (23, 0, 17)
    for dtype in (torch.float32, torch.bfloat16):
        xs = [(torch.randn(t, 256) * 3).to(dtype) for t in tokens]
        idxs = [random_routing(t, k, n_exp) for t in tokens]
        ws = [torch.rand(t, k) for t in tokens]
        for rank, (ref, got, again, barriers) in enumerate(_run_threads(3, _push_rank, payload, xs, idxs, ws, n_exp)):
            assert ref.shape[0] > 0, f"rank {rank} received no rows"
            assert_bitwise_equal(got, ref, f"rank {rank}, {payload} {dtype}: received rows")
            assert_bitwise_equal(again, ref, f"rank {rank}, {payload} {dtype}: received rows, cached")
            assert barriers == [0, 1, 0, 1], barriers


class _FakeSymmHandle:
    """torch symmetric memory's rendezvous handle for a world of one, on CPU: barriers are recorded."""

    def __init__(self, buf):
        self.buffer_ptrs, self.barriers = [buf.data_ptr()], []

    def barrier(self, channel, timeout_ms=None):
        self.barriers.append(channel)


def test_symm_backend_allocates_on_first_use_when_no_row_moves():
    """SymmetricMemoryBackend (its allocation over a fake symmetric-memory module, a world of one):
    a push dispatch in which no token goes anywhere still gets a buffer for its barriers."""
    from types import SimpleNamespace

    from moe_fp4.ep.symmetric import SymmetricMemoryBackend, push_rows

    backend = SymmetricMemoryBackend.__new__(SymmetricMemoryBackend)  # (its __init__ needs NCCL)
    backend.__dict__.update(rank=0, world_size=1, device=torch.device("cpu"), group="world", capacity=0, _keep=[],
                            _buffer=None, _handle=None, _peer_views={}, timeout_ms=1000, mapped=True)
    backend._symm = SimpleNamespace(empty=lambda size, dtype, device: torch.empty(size, dtype=dtype, device=device),
                                    rendezvous=lambda buf, group: _FakeSymmHandle(buf))
    x = torch.randn(6, 64)
    handle = Buffer(2).dispatch(x, torch.full((6, 2), -1)).handle
    codec = get_payload("mxfp4")
    recv = push_rows(backend, x, codec, handle)
    assert recv.shape == (0, codec.row_bytes(64)) and backend.capacity > 0
    assert backend._handle.barriers == [0, 1]


class _FakePeerHandle(_FakeSymmHandle):
    """A rendezvous handle of a world of two whose peer view works or raises."""

    def __init__(self, buf, views_work):
        super().__init__(buf)
        self.buffer_ptrs, self.views_work = [buf.data_ptr()] * 2, views_work

    def get_buffer(self, rank, shape, dtype, offset):
        if not self.views_work:
            raise RuntimeError("peer views refused (test)")
        return torch.zeros(shape, dtype=dtype)


def _fake_first_allocation(monkeypatch, mine, others):
    """A SymmetricMemoryBackend of rank 0 of 2 on the CPU whose first allocation's all-reduce meets
    a peer that can (others) or cannot map its peers' buffers."""
    from types import SimpleNamespace

    import moe_fp4.ep.symmetric as symmetric

    def all_reduce(t, op, group):
        assert op == "min"
        t.copy_(torch.minimum(t, torch.tensor([int(others)], dtype=t.dtype)))

    monkeypatch.setattr(symmetric, "dist", SimpleNamespace(all_reduce=all_reduce, ReduceOp=SimpleNamespace(MIN="min"),
                                                           group=SimpleNamespace(WORLD="world")))
    backend = symmetric.SymmetricMemoryBackend.__new__(symmetric.SymmetricMemoryBackend)
    backend.__dict__.update(rank=0, world_size=2, device=torch.device("cpu"), group="world", capacity=0, _keep=[],
                            _buffer=None, _handle=None, _peer_views={}, timeout_ms=1000, mapped=True)
    backend._symm = SimpleNamespace(empty=lambda size, dtype, device: torch.empty(size, dtype=dtype, device=device),
                                    rendezvous=lambda buf, group: _FakePeerHandle(buf, mine))
    return backend


@pytest.mark.parametrize("mine, others, mapped", [(True, True, True), (False, True, False), (True, False, False)])
def test_symm_backend_pushes_only_if_every_rank_can(monkeypatch, mine, others, mapped):
    """At its first allocation the backend asks every rank (an all-reduce of 'can map the peers'
    buffers') and pushes only if all can, else every rank moves its payloads through the NCCL
    all-to-all; a warning names whether this rank or another could not."""
    import warnings

    backend = _fake_first_allocation(monkeypatch, mine, others)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.ensure_capacity(100)
        backend.ensure_capacity(1 << 22)  # a later growth asks nobody again
    assert backend.mapped is mapped
    messages = [str(c.message) for c in caught if "NCCL all-to-all" in str(c.message)]
    if mapped:
        assert not messages
    else:
        assert len(messages) == 1 and ("this rank cannot" if not mine else "another rank cannot") in messages[0]


def test_symm_backend_falls_back_to_the_all_to_all(monkeypatch):
    """Once the ranks agreed they cannot map each other's buffers, the symm backend's dispatch and
    combine are the all-to-all path's (here in a world of one, all_to_all a copy)."""
    backend = _fake_first_allocation(monkeypatch, False, True)
    backend.mapped, backend.world_size = False, 1  # (as after test_symm_backend_pushes_only_if_every_rank_can)
    backend.all_to_all = lambda out, inp, out_splits, in_splits: out.copy_(inp)
    backend.usable = lambda t: True
    x, idx, w = torch.randn(9, 64), random_routing(9, 2, 4), torch.rand(9, 2)
    ref = Buffer(4).dispatch(x, idx, w)
    buf = Buffer(4, backend=backend)
    got = buf.dispatch(x, idx, w)
    assert_bitwise_equal(got.recv_rows, ref.recv_rows, "dispatch through the all-to-all")
    y = ref.values().to(torch.bfloat16)
    assert_bitwise_equal(buf.combine(y, got.handle), Buffer(4).combine(y, ref.handle), "combine")


# ------------------------------------------------------------------------------------------------
# Multi-destination row ops (the push dispatch's kernels; their spec fallback here, native on GPU in
# tests/test_kernels_gpu.py)
# ------------------------------------------------------------------------------------------------


def _destination_rows(t, caps):
    cols = []
    for cap in caps:
        col = torch.full((t,), -1, dtype=torch.int64)
        n = min(t, cap)
        col[torch.randperm(t)[:n]] = torch.randperm(cap)[:n]
        col[torch.rand(t) < 0.3] = -1
        col[torch.randint(0, t, (2,))] = cap  # past the end: skipped
        cols.append(col)
    return torch.stack(cols, 1)


def _assert_rows_landed(dests, rows, want):
    """Row t of want sits at row rows[t, d] of dests[d] wherever that is in range; every other row of
    every destination still holds the 0x5A fill."""
    for d, dest in enumerate(dests):
        keep = (rows[:, d] >= 0) & (rows[:, d] < dest.shape[0])
        assert_bitwise_equal(dest[rows[keep, d]], want[keep], f"destination {d}")
        untouched = torch.ones(dest.shape[0], dtype=torch.bool)
        untouched[rows[keep, d]] = False
        assert bool((dest[untouched] == 0x5A).all()), f"destination {d}: rows written that no token maps to"


@pytest.mark.parametrize("rounding", ["up", "down"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_mxfp4_rows_multi_matches_spec(dtype, rounding):
    from moe_fp4 import ops

    x = (torch.randn(40, 96) * torch.exp2(torch.randint(-20, 20, (40, 1)).float())).to(dtype)
    x[3, 5] = float("nan")
    x[4, :32] = 0.0
    want = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(x, scale_rounding=rounding))
    caps = [40, 45, 38]
    rows = _destination_rows(40, caps)
    dests = [torch.full((c, want.shape[1]), 0x5A, dtype=torch.uint8) for c in caps]
    ops.quantize_mxfp4_rows_multi(x, dests, rows, scale_rounding=rounding)
    _assert_rows_landed(dests, rows, want)


def test_quantize_fp8_blockwise_rows_multi_matches_spec():
    from moe_fp4 import ops

    x = (torch.randn(30, 256) * torch.exp2(torch.randint(-20, 20, (30, 1)).float())).to(torch.bfloat16)
    x[2, 7] = float("inf")
    data, scales = formats.quantize_fp8_blockwise(x, block=(1, formats.FP8_GROUP))
    want = torch.cat((data.view(torch.uint8), scales.view(torch.uint8)), dim=1)
    caps = [30, 33]
    rows = _destination_rows(30, caps)
    dests = [torch.full((c, want.shape[1]), 0x5A, dtype=torch.uint8) for c in caps]
    ops.quantize_fp8_blockwise_rows_multi(x, dests, rows)
    _assert_rows_landed(dests, rows, want)
    with pytest.raises(ValueError, match="dests"):
        ops.quantize_fp8_blockwise_rows_multi(x, [d[:, :-4] for d in dests], rows)
    with pytest.raises(ValueError, match="x"):
        ops.quantize_fp8_blockwise_rows_multi(x[:, :96], dests, rows)


def test_scatter_rows_and_errors():
    from moe_fp4 import ops

    src = torch.randint(0, 256, (30, 20), dtype=torch.uint8)
    caps = [30, 31]
    rows = _destination_rows(30, caps)
    dests = [torch.full((c, 20), 0x5A, dtype=torch.uint8) for c in caps]
    ops.scatter_rows(src, dests, rows)
    _assert_rows_landed(dests, rows, src)
    bad = [
        ((src, [], rows[:, :0]), "dests"),
        ((src, dests * 5, rows), "dests"),
        ((src, [dests[0][:, :10], dests[1]], rows), "dests"),
        ((src, [dests[0].t(), dests[1]], rows), "dests"),
        ((src, [torch.zeros(60, 20, dtype=torch.uint8)[::2], dests[1]], rows), "dests"),  # rows apart
        ((src[:1], [torch.zeros(1, 40, dtype=torch.uint8)[:, ::2]], rows[:1, :1]), "dests"),  # strided bytes
        ((src, dests, rows[:29]), "dest_rows"),
        ((src, dests, rows.to(torch.int32)), "dest_rows"),
        ((src, dests, rows.t().contiguous().t()), "dest_rows"),
        ((src.float(), dests, rows), "src"),
    ]
    for args, what in bad:
        with pytest.raises(ValueError, match=what):
            ops.scatter_rows(*args)
    x, one = torch.randn(30, 64), rows[:, :1].contiguous()
    with pytest.raises(ValueError, match="dests"):
        ops.quantize_mxfp4_rows_multi(x, [torch.zeros(30, 20, dtype=torch.uint8)], one)
    fits = [torch.zeros(30, 34, dtype=torch.uint8)]
    for kwargs, what in (({"scale_rounding": "nearest"}, "scale_rounding"), ({"max_blocks": 0}, "max_blocks"),
                         ({"max_blocks": 2.0}, "max_blocks")):
        with pytest.raises(ValueError, match=what):
            ops.quantize_mxfp4_rows_multi(x, fits, one, **kwargs)



def test_dispatch_bench_report_marks_gpu_goals_and_cpu_noise():
    """The dispatch benchmark's report: a spread column, a legend naming every column group, goals
    marked as GPU goals (verdicts on CUDA only) and a noise note on CPU."""
    from moe_fp4.ep import bench

    def row(fmt, us, spread):
        return dict(tokens=512, fmt=fmt, backend="gloo", row_bytes=100, wire_mb=1.0, a2a_us=us, a2a_gbs=1.0,
                    layout_us=2 * us, free_us=2 * us, disp_us=us, gbs=1.0, link=0.9, comb_us=us, e2e_us=us,
                    tok_us=us, spread=spread)

    rows = [row("bf16", 100.0, 0.1), row("fp8", 60.0, 0.2), row("mxfp4", 30.0, 1.5)]
    rows[2]["link"] = 0.5  # below the 85% goal
    table = bench.format_table(rows)
    head = table.splitlines()[0]
    assert head.endswith("| spread |") and table.splitlines()[-1].endswith("| 150% |")
    for column in ("row B", "a2a us", "full us", "free us", "dispatch us", "combine us", "e2e us", "tok us", "spread"):
        assert column in head and column in bench.LEGEND
    cpu = bench.goals(rows, "cpu")
    assert cpu[0].startswith("GPU goals (not judged on CPU") and not any("met" in line for line in cpu)
    gpu = bench.goals(rows, "cuda")
    assert gpu[0] == "GPU goals:" and any(": met" in line for line in gpu) and any("NOT met" in line for line in gpu)
    assert "noise-dominated" in bench.noise_note(rows, "cpu") and "150%" in bench.noise_note(rows, "cpu")
    assert "150%" in bench.noise_note(rows, "cuda")
    assert bench.noise_note([row("bf16", 100.0, 0.1)], "cuda") is None


def test_row_weights_with_grad_matches_the_weighted_combine():
    """An expert layer that weights its rows itself (row_weights_with_grad, then an unweighted combine)
    gives the weighted combine's output and the same gradients of the expert rows and of the top-k
    weights (float32 rounding apart), with expert alignment (gap rows weigh 0) and -1 slots."""
    from moe_fp4.ep import combine_with_grad, dispatch_with_grad, row_weights_with_grad

    seed = 3141  # (fixed: the routing and values of this test)
    gen = torch.Generator().manual_seed(seed)
    t, h, e, k = 40, 64, 6, 3
    x = torch.randn(t, h, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    idx[::5, -1] = -1
    w0 = torch.rand(t, k, generator=gen)
    dz = torch.randn(t, h, generator=gen)
    buf = Buffer(e, payload="bf16")
    runs = []
    for inside in (False, True):
        w = w0.clone().requires_grad_()
        _, out = dispatch_with_grad(buf, x, idx, w, expert_alignment=8)
        y = (torch.randn(out.handle.num_rows, h, generator=torch.Generator().manual_seed(seed + 1))
             .requires_grad_())
        if inside:
            rw = row_weights_with_grad(buf, out.handle, w)
            assert bool((rw[out.handle.expand_row < 0] == 0).all())
            z = combine_with_grad(buf, y * rw.unsqueeze(1), out.handle, weighted=False)
        else:
            z = combine_with_grad(buf, y, out.handle, w)
        z.float().backward(dz)
        runs.append((z.detach().float(), y.grad, w.grad))
    for a, b in zip(*runs):
        assert torch.allclose(a, b, rtol=2 ** -7, atol=1e-5), float((a - b).abs().max())
    with pytest.raises(ValueError, match="topk_weights"):
        row_weights_with_grad(buf, out.handle, w0[:, :2])
    no_weights = buf.dispatch(x, idx).handle
    with pytest.raises(ValueError, match="handle"):
        row_weights_with_grad(buf, no_weights, w0)
