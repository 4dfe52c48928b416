"""The sync-free dispatch on a GPU (``Buffer.dispatch(max_recv_tokens=N)``): no host synchronisation
(``torch.cuda.set_sync_debug_mode("error")``), and dispatch, FP8 conversion and combine captured in
one CUDA graph, replayed with new tokens and routing, equal bit for bit on the valid rows to a synced
dispatch of the same inputs. In a world of one here (the local backend, and NCCL); ``run_graph_case``
takes any Buffer, so the multi-GPU tests run it over NCCL and the symm backend.

The SM budget (``Buffer(num_sms=...)``) on one GPU: bounded grids give the bits of unbounded ones
(``check_num_sms_same_bits``, which the 2-GPU tests also run), in and out of a CUDA graph."""

import multiprocessing
import os
import tempfile
import traceback

import pytest
import torch

from moe_fp4.ep import Buffer, LocalBackend
from tests._compare import assert_bitwise_equal

SEED = 5150
T, H, K, E, ALIGN = 384, 512, 8, 64, 32


def _inputs(seed: int, device):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * torch.exp(torch.randn(T, 1, generator=g))).to(torch.bfloat16)
    idx = torch.randn(T, E, generator=g).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=g) < 0.1] = -1
    w = torch.rand(T, K, generator=g)
    return x.to(device), idx.to(device), w.to(device)


def _experts(fp8):
    """A row-wise stand-in for the expert GEMMs: the FP8 rows dequantized, as bfloat16."""
    data, scales = fp8
    return (data.float() * scales.repeat_interleave(128, dim=1)).to(torch.bfloat16)


def run_graph_case(buf: Buffer, seed: int, payload: str = "mxfp4") -> None:
    dev = buf.device
    x, idx, w = _inputs(seed + buf.rank, dev)  # static inputs of the graph
    n = buf.world_size * T

    def step():
        out = buf.dispatch(x, idx, w, payload=payload, return_fp8=True, expert_alignment=ALIGN, max_recv_tokens=n)
        return out, buf.combine(_experts(out.fp8), out.handle)

    for _ in range(2):  # warm-up: the native build, Triton's compiles, the backend's buffers
        step()
    torch.cuda.synchronize(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out.handle.check()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_res = step()
    for trial in range(3):
        nx, nidx, nw = _inputs(seed + 1000 * (trial + 1) + buf.rank, dev)
        x.copy_(nx)
        idx.copy_(nidx)
        w.copy_(nw)
        graph.replay()
        ref = buf.dispatch(x, idx, w, payload=payload, return_fp8=True, expert_alignment=ALIGN)
        ref_res = buf.combine(_experts(ref.fp8), ref.handle)
        torch.cuda.synchronize(dev)
        g_out.handle.check()
        rows = ref.handle.num_rows
        what = f"replay {trial} ({payload})"
        assert_bitwise_equal(g_out.split_lens, ref.split_lens, f"split_lens, {what}")
        assert_bitwise_equal(g_out.split_offsets, ref.split_offsets, f"split_offsets, {what}")
        assert_bitwise_equal(g_out.fp8[0][:rows], ref.fp8[0], f"fp8 data, {what}")
        assert_bitwise_equal(g_out.fp8[1][:rows], ref.fp8[1], f"fp8 scales, {what}")
        assert_bitwise_equal(g_out.handle.row_weights[:rows], ref.handle.row_weights, f"row weights, {what}")
        assert_bitwise_equal(g_res, ref_res, f"combine, {what}")


def check_num_sms_same_bits(make, x, idx, w, n_free, budgets=(2, 24)) -> None:
    """make(num_sms) -> a Buffer; for each budget the dispatch (full, cached, sync-free; expert rows,
    FP8 expert rows and FP8 per token, every payload) and the combine (every wire, weighted or not)
    equal those of make(None), bit for bit. Also set_num_sms on the unbounded buffer."""
    ref_buf = make(None)
    g = torch.Generator().manual_seed(int(x.shape[0]))
    for payload in ("mxfp4", "fp8", "bf16", "nvfp4"):
        want = ref_buf.dispatch(x, idx, w, payload=payload, return_fp8=True)
        want_tok = ref_buf.dispatch(x, handle=want.handle, payload=payload, return_fp8="tokens")
        want_free = ref_buf.dispatch(x, idx, w, payload=payload, max_recv_tokens=n_free)
        y = torch.randn(want.handle.num_rows, x.shape[1], generator=g).to(x.device, torch.bfloat16)
        combines = {(wire, weighted): ref_buf.combine(y, want.handle, payload=wire, weighted=weighted)
                    for wire in ("bf16", "fp8", "mxfp4") for weighted in (True, False)}
        for budget in budgets:
            for buf, how in ((make(budget), "constructor"), (ref_buf, "set_num_sms")):
                buf.set_num_sms(budget)
                what = f"{payload}, num_sms={budget} ({how})"
                got = buf.dispatch(x, idx, w, payload=payload, return_fp8=True)
                again = buf.dispatch(x, handle=got.handle, payload=payload, return_fp8=True)
                tok = buf.dispatch(x, handle=got.handle, payload=payload, return_fp8="tokens")
                free = buf.dispatch(x, idx, w, payload=payload, max_recv_tokens=n_free)
                free.handle.check()
                for out, kind in ((got, "full"), (again, "cached")):
                    assert_bitwise_equal(out.recv_rows, want.recv_rows, f"received rows, {kind}, {what}")
                    assert_bitwise_equal(out.rows, want.rows, f"expert rows, {kind}, {what}")
                    assert_bitwise_equal(out.fp8[0], want.fp8[0], f"fp8 data, {kind}, {what}")
                    assert_bitwise_equal(out.fp8[1], want.fp8[1], f"fp8 scales, {kind}, {what}")
                assert_bitwise_equal(tok.recv_fp8[0], want_tok.recv_fp8[0], f"fp8 per token, {what}")
                assert_bitwise_equal(tok.recv_fp8[1], want_tok.recv_fp8[1], f"fp8 scales per token, {what}")
                valid = want_free.handle.expand_row >= 0
                assert_bitwise_equal(free.rows[valid], want_free.rows[valid], f"sync-free expert rows, {what}")
                assert_bitwise_equal(free.split_lens, want_free.split_lens, f"sync-free split_lens, {what}")
                for (wire, weighted), ref in combines.items():
                    assert_bitwise_equal(buf.combine(y, got.handle, payload=wire, weighted=weighted), ref,
                                         f"combine over {wire}, weighted={weighted}, {what}")
            ref_buf.set_num_sms(None)


@pytest.mark.gpu
@pytest.mark.parametrize("payload", ["mxfp4", "fp8", "bf16"])
def test_sync_free_graph_local_backend(payload):
    run_graph_case(Buffer(E, payload=payload, backend=LocalBackend("cuda")), SEED, payload)


def _spawn_world_of_one(target, *args) -> None:
    """target(init_file, *args, errors) in a spawned process (its own NCCL process group of one GPU,
    initialised from init_file); fails on a traceback it puts in errors, a nonzero exit or 240 s."""
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        proc = ctx.Process(target=target, args=(os.path.join(d, "init"), *args, errors))
        proc.start()
        proc.join(240)
        if proc.is_alive():
            proc.kill()
            pytest.fail("the NCCL world of one did not finish within 240 s")
    assert errors.empty(), errors.get()
    assert proc.exitcode == 0


def _nccl_world_of_one(init_file: str, errors) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        run_graph_case(Buffer(E, payload="mxfp4"), SEED, "mxfp4")
        dist.destroy_process_group()
    except Exception:
        errors.put(traceback.format_exc())


@pytest.mark.gpu
def test_sync_free_graph_nccl_world_of_one():
    _spawn_world_of_one(_nccl_world_of_one)


@pytest.mark.gpu
def test_num_sms_same_bits_local_backend():
    """A world of one on one GPU (the all-to-all path: the one-pass encode capped by max_blocks, the
    Triton combine and conversion kernels looping over their work)."""
    x, idx, w = _inputs(SEED + 7, "cuda")

    def make(num_sms):
        return Buffer(E, payload="mxfp4", backend=LocalBackend("cuda"), num_sms=num_sms)

    check_num_sms_same_bits(make, x, idx, w, T)


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [2, 24])
def test_num_sms_graph_local_backend(num_sms):
    """The sync-free step under an SM budget, captured in a CUDA graph and replayed with new routing."""
    run_graph_case(Buffer(E, payload="mxfp4", backend=LocalBackend("cuda"), num_sms=num_sms), SEED)


@pytest.mark.gpu
def test_num_sms_triton_kernels_same_bits():
    """Each Triton kernel of the dispatch and combine with a grid of 2 SMs' programs (looping over
    their work) against its unbounded grid, on shapes with many more items than programs."""
    from moe_fp4 import formats
    from moe_fp4.ep import _triton_combine, _triton_rows

    g = torch.Generator().manual_seed(SEED)
    n, hidden, k = 3001, 7168, 8
    rows = formats.pack_mxfp4_rows(*formats.quantize_mxfp4(torch.randn(n, hidden, generator=g))).cuda()
    slots = torch.randperm(n * k, generator=g).reshape(n, k)
    slots[torch.rand(n, k, generator=g) < 0.3] = -1
    slots = slots.cuda()
    index = torch.randint(0, n, (n,), generator=g).cuda()
    src = torch.randn(n, hidden, generator=g).cuda()
    table = torch.randint(-1, n, (n, k), generator=g).cuda()
    weights = torch.rand(n, k, generator=g).cuda()
    bases = torch.full((2,), rows.data_ptr(), dtype=torch.int64, device="cuda")
    rank_table = torch.randint(-1, n, (n, 2), generator=g).cuda()
    src_rank = torch.randint(0, 2, (n,), generator=g).cuda()
    used = slots[slots >= 0]  # (the scatter's other output rows are not written)
    outs = {}
    for num_sms in (None, 2):
        outs[num_sms] = [
            *(t[used] for t in _triton_rows.mxfp4_rows_to_fp8_scatter(rows, hidden, slots, n * k,
                                                                      num_sms=num_sms)),
            *_triton_rows.mxfp4_rows_to_fp8_gather(rows, hidden, index, num_sms=num_sms),
            _triton_rows.copy_rows(torch.empty_like(rows), index, src_rank, bases, num_sms=num_sms),
            _triton_combine.gather_sum(src, table, weights, torch.float32, num_sms=num_sms),
            _triton_combine.gather_sum(src, table, None, torch.bfloat16, num_sms=num_sms),
            _triton_combine.decode_sum(bases, rank_table, hidden, "mxfp4", num_sms=num_sms),
        ]
    for i, (a, b) in enumerate(zip(outs[None], outs[2])):
        assert_bitwise_equal(b, a, f"output {i} with num_sms=2")


def _world_of_one_num_sms(init_file: str, backend, errors) -> None:
    import torch.distributed as dist

    from moe_fp4.ep import make_backend

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        shared = make_backend(None, backend)
        x, idx, w = _inputs(SEED + 11, "cuda")
        check_num_sms_same_bits(lambda num_sms: Buffer(E, payload="mxfp4", backend=shared, num_sms=num_sms),
                                x, idx, w, T)
        dist.destroy_process_group()
    except Exception:
        errors.put(traceback.format_exc())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "symm"])
def test_num_sms_same_bits_world_of_one(backend):
    """num_sms over an NCCL process group of one GPU, and over the symm backend on it (the push into
    its own rows, the sums over its own buffer)."""
    _spawn_world_of_one(_world_of_one_num_sms, backend)
