"""The sync-free dispatch on a GPU (``Buffer.dispatch(max_recv_tokens=N)``): no host synchronisation
(``torch.cuda.set_sync_debug_mode("error")``), and dispatch, FP8 conversion and combine captured in
one CUDA graph, replayed with new tokens and routing, equal bit for bit on the valid rows to a synced
dispatch of the same inputs. In a world of one here (the local backend, and NCCL); ``run_graph_case``
takes any Buffer, so the multi-GPU tests run it over NCCL and the symm backend."""

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


@pytest.mark.gpu
@pytest.mark.parametrize("payload", ["mxfp4", "fp8", "bf16"])
def test_sync_free_graph_local_backend(payload):
    run_graph_case(Buffer(E, payload=payload, backend=LocalBackend("cuda")), SEED, payload)


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
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        proc = ctx.Process(target=_nccl_world_of_one, args=(os.path.join(d, "init"), errors))
        proc.start()
        proc.join(240)
        if proc.is_alive():
            proc.kill()
            pytest.fail("the NCCL world of one did not finish within 240 s")
    assert errors.empty(), errors.get()
    assert proc.exitcode == 0
