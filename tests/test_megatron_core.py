"""moe_fp4.integrations.megatron_core against megatron-core's own MoE token dispatchers.

CPU (2 gloo ranks, expert parallel size 2, the installed megatron-core): Megatron's router, its
allgather dispatcher (torch.cuda.current_device() for its gather buffers) and its alltoall dispatcher
(a CUDA stream in its constructor) need CUDA, so a MoELayer's forward cannot run whole here and
Megatron's dispatchers cannot be the reference. These tests build a real MoELayer (local spec,
SequentialMLP experts), compute the router logits with the router's own weight and route with the
router's own ``routing``, then drive the layer with moe_fp4's dispatcher through the MoELayer
methods its forward calls (preprocess, dispatch, routed_experts_compute, combine, postprocess).
The reference runs Megatron's own expert MLP with every expert's weights (gathered over the group)
on the payload-rounded tokens of this rank, summed in float32. Bounds: the output within 2^-7 of its
largest magnitude (two BF16 roundings in the combine, each rank's partial sum and the result, each
at most half a BF16 ulp, 2^-8 relative); gradients (tokens, router weight, expert weights) within
1e-2 relative (Frobenius) with bf16 gradients through both exchanges; the dispatched rows, tokens per
expert and permuted probs (bf16 tokens and payload) equal bit for bit to the rows in the order
Megatron's alltoall dispatcher gives them (each local expert's tokens by source rank, then token).

GPU (``pytest.mark.gpu``, 2 CUDA GPUs, NCCL, megatron-core 0.19.2): a small GPT-MoE from
megatron-core's local (non-TE) layer spec, expert parallel size 2; forward and backward with
moe_fp4's dispatcher against Megatron's alltoall dispatcher on the same weights and inputs, then a
few optimizer steps with each, losses side by side (printed with -s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from moe_fp4.ep.payloads import get_payload
from moe_fp4.integrations import megatron_core as mc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _have_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


needs_megatron = pytest.mark.skipif(not _have_megatron(), reason="needs megatron-core (pip install megatron-core)")


# ---------------------------------------------------------------------------------------------
# without Megatron, and the version check
# ---------------------------------------------------------------------------------------------


def test_imports_without_megatron_and_apply_names_it():
    """The module and the patches entry point import with megatron blocked; apply() then raises an
    ImportError naming megatron-core."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "megatron" or name.startswith("megatron."):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import torch
        from moe_fp4.integrations import megatron_core
        import patches.megatron_core as entry
        assert entry.apply is megatron_core.apply
        try:
            megatron_core.apply(torch.nn.Linear(2, 2))
        except ImportError as e:
            assert "megatron-core" in str(e), e
            print("ok")
        else:
            raise SystemExit("apply did not raise")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.parametrize("version", ["0.16.1", "0.17.0", "0.19.2"])
def test_supported_versions(version):
    mc.check_version(version)


@pytest.mark.parametrize("version", ["0.15.3", "0.20.0", "1.0.0", "dev"])
def test_unsupported_versions_refused(version):
    with pytest.raises(ImportError, match=f"megatron-core {version} is not supported"):
        mc.check_version(version)


def test_routing_to_topk():
    """Each token's experts in ascending order, -1 and weight 0 past its last; weights differentiable."""
    routing_map = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    probs = (torch.rand(4, 4) * routing_map).requires_grad_()
    idx, w = mc.routing_to_topk(routing_map, probs, 2)
    assert idx.tolist() == [[1, 3], [0, -1], [-1, -1], [0, 1]]
    expect = torch.stack([probs[0, [1, 3]], torch.stack([probs[1, 0], probs.new_zeros(())]),
                          probs.new_zeros(2), probs[3, [0, 1]]])
    assert torch.equal(w, expect)
    w.sum().backward()
    assert torch.equal(probs.grad, routing_map.float())


# ---------------------------------------------------------------------------------------------
# CPU: a real MoELayer on 2 gloo ranks
# ---------------------------------------------------------------------------------------------

HIDDEN, EXPERTS, TOPK, FFN = 128, 4, 2, 64


def _quiet():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)


def _init_parallel(ctx):
    _quiet()
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(expert_model_parallel_size=ctx.world_size)
    return ps


def _cpu_layer(seed: int, dtype: torch.dtype):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
                               moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
                               moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                               use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16)
    torch.manual_seed(seed)  # the same router on every rank; each rank's experts differ
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
    return build_module(spec, config=config)


def _route(layer, x):
    """The router's own weight and routing (its gating would move the weight to CUDA)."""
    logits = torch.nn.functional.linear(x.float(), layer.router.weight.float())
    return layer.router.routing(logits)


def _layer_forward(layer, tokens, probs, routing_map):
    """MoELayer.forward after routing, through the layer's own methods (no shared experts)."""
    hidden, p = layer.preprocess(tokens, probs, routing_map)
    hidden, p = layer.dispatch(hidden, p)
    out, bias = layer.routed_experts_compute(hidden, p)
    assert bias is None
    return layer.postprocess(layer.combine(out), None)


def _payload_round(x: torch.Tensor, payload: str) -> torch.Tensor:
    codec = get_payload(payload)
    flat = x.detach().reshape(-1, x.shape[-1])
    return codec.decode(codec.encode(flat), flat.shape[1]).to(x.dtype).view(x.shape)


def _all_experts(layer, group):
    """Every expert's weights on this rank (gathered over the EP group), expert e at index e: dicts of
    leaf tensors that a local Megatron MLP runs with (``torch.func.functional_call``)."""
    import torch.distributed as dist

    local = [{n: p.detach().clone() for n, p in e.named_parameters()} for e in layer.experts.local_experts]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return [{n: p.requires_grad_() for n, p in state.items()} for states in gathered for state in states]


def _reference_forward(mlp, experts, tokens, probs, routing_map):
    """sum over each token's experts of Megatron's MLP(token, per_token_scale=prob) with that expert's
    weights, in float32."""
    flat = tokens.reshape(-1, tokens.shape[-1])
    out = torch.zeros(flat.shape, dtype=torch.float32)
    for e, params in enumerate(experts):
        rows = routing_map[:, e].nonzero().squeeze(1)
        y, _ = torch.func.functional_call(mlp, params, (flat[rows], probs[rows, e]))
        out = out.index_add(0, rows, y.float())
    return out.view(tokens.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _case_layer_vs_reference(ctx, payload, seed):
    import torch.distributed as dist

    _init_parallel(ctx)
    layer = _cpu_layer(seed, torch.float32)
    torch.manual_seed(seed + 1 + ctx.rank)  # each rank its own tokens
    x = torch.randn(6, 2, HIDDEN)
    grad_out = torch.randn(6, 2, HIDDEN)

    # reference: all experts on this rank, on the payload-rounded tokens (straight-through gradient)
    experts = _all_experts(layer, ctx.group)
    xr = x.clone().requires_grad_()
    probs, ref_map = _route(layer, xr)
    rounded = xr + (_payload_round(x, payload) - x)
    ref = _reference_forward(layer.experts.local_experts[0], experts, rounded, probs, ref_map)
    (ref * grad_out).sum().backward()
    ref_router = layer.router.weight.grad.clone()
    layer.zero_grad(set_to_none=True)
    first = EXPERTS // ctx.world_size * ctx.rank
    ref_experts = {}
    for e, params in enumerate(experts):  # an expert's gradient: the sum over every rank's tokens
        for n, p in params.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=ctx.group)
            if first <= e < first + EXPERTS // ctx.world_size:
                ref_experts[f"experts.local_experts.{e - first}.{n}"] = g

    mc.apply(layer, payload=payload, backend="gloo")
    assert type(layer.token_dispatcher).__name__ == "MoeFp4TokenDispatcher"
    x1 = x.clone().requires_grad_()
    probs, routing_map = _route(layer, x1)
    out = _layer_forward(layer, x1, probs, routing_map)
    (out.float() * grad_out).sum().backward()
    mc.revert(layer)

    assert torch.equal(routing_map, ref_map)
    assert out.dtype == x.dtype and out.shape == x.shape
    scale = ref.abs().max().item()
    err = (out.float() - ref.detach()).abs().max().item()
    assert err <= 2.0 ** -7 * scale, f"rank {ctx.rank}: output error {err:.3g} above {2.0 ** -7 * scale:.3g}"
    errors = {"x": _rel(x1.grad, xr.grad), "router": _rel(layer.router.weight.grad, ref_router)}
    for n, p in layer.named_parameters():
        if n.startswith("experts."):
            errors[n] = _rel(p.grad, ref_experts[n])
    bad = {n: e for n, e in errors.items() if e > 1e-2}
    assert not bad, f"rank {ctx.rank}: gradient errors above 1e-2: {bad}"
    return round(err / scale, 6), round(max(errors.values()), 6)


def _case_hooks_rows(ctx, seed):
    """The dispatcher hooks one by one (bf16 tokens, bf16 payload): the rows, tokens per expert and
    permuted probs Megatron's alltoall dispatcher gives: each local expert's tokens by source rank,
    then source token, with their probs, bit for bit."""
    import torch.distributed as dist

    _init_parallel(ctx)
    layer = _cpu_layer(seed, torch.bfloat16)
    torch.manual_seed(seed + 1 + ctx.rank)
    x = torch.randn(5 + ctx.rank, 2, HIDDEN, dtype=torch.bfloat16)
    probs, routing_map = _route(layer, x)
    (mine,) = mc.apply(layer, payload="bf16", backend="gloo")
    d = mine.token_dispatcher
    h, p = d.dispatch_preprocess(x, routing_map, probs)
    h, p = d.token_dispatch(h, p)
    rows, counts, row_probs = d.dispatch_postprocess(h, p)
    mc.revert(layer)

    every = [None] * ctx.world_size
    dist.all_gather_object(every, (x.reshape(-1, HIDDEN), routing_map, probs.detach()), group=ctx.group)
    local = range(EXPERTS // ctx.world_size * ctx.rank, EXPERTS // ctx.world_size * (ctx.rank + 1))
    want_rows = torch.cat([xs[m[:, e]] for e in local for xs, m, _ in every])
    want_probs = torch.cat([ps[m[:, e], e] for e in local for _, m, ps in every])
    want_counts = [sum(int(m[:, e].sum()) for _, m, _ in every) for e in local]
    assert counts.dtype == torch.int64 and counts.device.type == "cpu" and counts.tolist() == want_counts
    assert rows.dtype == x.dtype and torch.equal(rows, want_rows)
    assert row_probs.dtype == probs.dtype and torch.equal(row_probs, want_probs)
    return rows.shape[0]


def _case_apply_revert(ctx, seed):
    """apply/revert on a GPTModel of two MoE layers; options the dispatcher does not do are refused."""
    _init_parallel(ctx)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
                               moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
                               moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
                               add_bias_linear=False)
    torch.manual_seed(seed)
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False), vocab_size=64,
                     max_sequence_length=16)
    originals = [layer.token_dispatcher for layer in mc.find_moe_layers(model)]
    assert len(originals) == 2
    patched = mc.apply([model], payload="mxfp4", backend="gloo")
    dispatchers = [layer.token_dispatcher for layer in patched]
    assert all(isinstance(d, mc.dispatcher_class()) for d in dispatchers)
    assert dispatchers[0].buffer is dispatchers[1].buffer  # one EP group: one Buffer
    mc.apply(model, payload="bf16", backend="gloo")  # again: replaced, Megatron's kept
    assert mc.find_moe_layers(model)[0].token_dispatcher.payload.name == "bf16"
    assert len(mc.revert(model)) == 2
    assert [layer.token_dispatcher for layer in mc.find_moe_layers(model)] == originals
    assert mc.revert(model) == []

    with pytest.raises(ValueError, match="no megatron-core MoELayer"):
        mc.apply(torch.nn.Linear(2, 2))
    layer = mc.find_moe_layers(model)[0]
    layer.config.moe_expert_capacity_factor = 1.0
    with pytest.raises(ValueError, match="moe_expert_capacity_factor"):
        mc.apply(layer, backend="gloo")
    layer.config.moe_expert_capacity_factor = None
    assert layer.token_dispatcher is originals[0]
    with pytest.raises(ValueError, match="payload"):
        mc.apply(layer, payload="int3", backend="gloo")
    return True


@pytest.fixture(scope="module")
def pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(2, threads=1)
    yield p
    p.close()


@needs_megatron
@pytest.mark.parametrize("payload", ["bf16", "fp8", "mxfp4", "nvfp4"])
def test_layer_vs_reference(pool, payload):
    results = pool.run(_case_layer_vs_reference, payload, 20)
    print(payload, "output error / max|out|, worst gradient error, per rank:", results)


@needs_megatron
def test_hooks_rows_in_alltoall_order(pool):
    rows = pool.run(_case_hooks_rows, 30)
    assert sum(rows) == (5 + 6) * 2 * TOPK


@needs_megatron
def test_apply_revert_gpt_model(pool):
    pool.run(_case_apply_revert, 40)
