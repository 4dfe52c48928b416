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

FP8 experts (``apply(..., experts="moe_fp4")``, CPU, 2 gloo ranks): a gated-SwiGLU MoELayer on
moe_fp4's dispatcher with Megatron's SequentialMLP, then with ``MoeFp4Experts`` holding its weights,
same tokens; output and gradients (tokens, router, expert weights mapped back to Megatron's names)
within the bounds of tests/test_moe_layer.py (0.1 relative for FP8 products, 0.3 when backward keeps
MXFP4); ``MoeFp4Experts`` alone behind Megatron-style rows (its padded path) against SequentialMLP,
GroupedMLP (grouped_gemm's GEMM replaced by a PyTorch one) and TEGroupedMLP (TE's GroupedLinear
replaced by a stand-in with its weights), the weight layouts round-tripped bit for bit; apply/revert
and the refused options.

GPU (``pytest.mark.gpu``, 2 CUDA GPUs, NCCL, megatron-core 0.19.2): a small GPT-MoE from
megatron-core's local (non-TE) layer spec, expert parallel size 2; forward and backward with
moe_fp4's dispatcher against Megatron's alltoall dispatcher on the same weights and inputs, then a
few optimizer steps with each, losses side by side (printed with -s); and a one-layer gated-SwiGLU
GPT-MoE on moe_fp4's dispatcher and FP8 experts against Megatron's dispatcher and experts.
"""

from __future__ import annotations

import importlib.util
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
    """Whether megatron-core is installed (found, not imported: the workers import it)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no "megatron" package at all
        return False


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


def _cpu_layer(seed: int, dtype: torch.dtype, **options):
    """A MoELayer (local spec, SequentialMLP experts); options override the TransformerConfig's."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
                  moe_router_topk=TOPK, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
                  params_dtype=dtype, bf16=dtype == torch.bfloat16)
    config = TransformerConfig(**{**kwargs, **options})
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


# ---------------------------------------------------------------------------------------------
# CPU: moe_fp4's FP8 experts (MoeFp4Experts) against Megatron's experts
# ---------------------------------------------------------------------------------------------

SWIGLU = dict(moe_ffn_hidden_size=128, ffn_hidden_size=128, activation_func=torch.nn.functional.silu)
# relative error bounds (Frobenius) of tests/test_moe_layer.py's BOUNDS, by what the FP8 experts'
# backward keeps: FP8 E4M3 operands in every product; save="mxfp4" also reads the expert input and the
# SwiGLU input through E2M1 in backward
EXPERTS_BOUNDS = {"fp8": 0.1, "recompute": 0.1, "bf16": 0.1, "mxfp4": 0.3}


def _run_layer(layer, x, grad_out):
    """Forward (the layer's own routing and methods) and backward: (out, grad of x, routing map)."""
    x1 = x.clone().requires_grad_()
    probs, routing_map = _route(layer, x1)
    out = _layer_forward(layer, x1, probs, routing_map)
    (out.float() * grad_out).sum().backward()
    return out.detach(), x1.grad, routing_map


def _case_fp8_experts_vs_megatron(ctx, payload, save, seed):
    """One MoELayer (float32 weights) on moe_fp4's dispatcher: Megatron's SequentialMLP, then
    MoeFp4Experts with its weights, same tokens; output and gradients (tokens, router, expert weights
    mapped back to Megatron's names) within EXPERTS_BOUNDS[save]."""
    _init_parallel(ctx)
    layer = _cpu_layer(seed, torch.float32, **SWIGLU)
    torch.manual_seed(seed + 1 + ctx.rank)
    x = torch.randn(40, 2, HIDDEN)
    grad_out = torch.randn(40, 2, HIDDEN)
    megatron_experts = layer.experts

    mc.apply(layer, payload=payload, backend="gloo")
    ref, ref_dx, ref_map = _run_layer(layer, x, grad_out)
    ref_router = layer.router.weight.grad.clone()
    ref_experts = {n: p.grad.clone() for n, p in megatron_experts.named_parameters()}
    layer.zero_grad(set_to_none=True)

    mc.apply(layer, payload=payload, backend="gloo", experts="moe_fp4", save=save)
    experts, dispatcher = layer.experts, layer.token_dispatcher
    assert isinstance(experts, mc.experts_class()) and experts.megatron_experts is megatron_experts
    assert experts.dispatcher is dispatcher and dispatcher.expert_alignment == 128
    # the experts read the dispatch's FP8 (and MXFP4) rows unless backward keeps the decoded values
    assert dispatcher.decode == (save == "bf16" or save == "mxfp4" and payload != "mxfp4")
    seen = []
    hook = experts.register_forward_pre_hook(lambda module, args: seen.append(args[0] is dispatcher.dispatched_rows))
    out, dx, routing_map = _run_layer(layer, x, grad_out)
    hook.remove()
    grads = experts.megatron_state(grads=True)
    assert mc.revert(layer) == [layer]
    assert layer.experts is megatron_experts and seen == [True]

    assert torch.equal(routing_map, ref_map)
    assert out.dtype == x.dtype and out.shape == x.shape
    errors = {"out": _rel(out, ref), "x": _rel(dx, ref_dx), "router": _rel(layer.router.weight.grad, ref_router)}
    assert set(grads) == set(ref_experts)
    errors.update({n: _rel(g, ref_experts[n]) for n, g in grads.items()})
    bad = {n: e for n, e in errors.items() if not e < EXPERTS_BOUNDS[save]}
    assert not bad, f"rank {ctx.rank}: errors at or above {EXPERTS_BOUNDS[save]}: {bad}"
    return round(errors["out"], 4), round(max(errors.values()), 4)


def _fake_gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm's gmm (GroupedMLP's GEMM, a CUDA package): a's rows split by batch_sizes, times b[g]."""
    parts = torch.split(a, [int(n) for n in batch_sizes])
    return torch.cat([p @ (b[g].t() if trans_b else b[g]) for g, p in enumerate(parts)])


class _GroupedLinear(torch.nn.Module):
    """A stand-in for TransformerEngine's GroupedLinear as TEGroupedMLP builds it: weight{g} [out, in]."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
                 tp_comm_buffer_name, pg_collection):
        super().__init__()
        self.num_gemms = num_gemms
        for g in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(w)
            self.register_parameter(f"weight{g}", w)

    def forward(self, x, tokens_per_expert):
        parts = torch.split(x, tokens_per_expert)
        return torch.cat([p @ getattr(self, f"weight{g}").t() for g, p in enumerate(parts)]), None


def _megatron_experts(kind: str, layer):
    """Megatron's experts of ``kind`` with the config and groups of ``layer`` (a SequentialMLP layer):
    its own SequentialMLP, a GroupedMLP (its GEMM, grouped_gemm's, replaced by _fake_gmm) or a
    TEGroupedMLP on _GroupedLinear."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe import experts as megatron_experts
    from megatron.core.transformer.moe import grouped_gemm_util

    if kind == "sequential":
        return layer.experts
    seq = layer.experts
    groups = ProcessGroupCollection(ep=seq.ep_group, expt_tp=seq.tp_group, expt_dp=seq.dp_group)
    if kind == "te_grouped":
        sub = MLPSubmodules(linear_fc1=_GroupedLinear, linear_fc2=_GroupedLinear)
        return megatron_experts.TEGroupedMLP(seq.num_local_experts, layer.config, sub, pg_collection=groups)
    saved = grouped_gemm_util.assert_grouped_gemm_is_available, grouped_gemm_util.ops, megatron_experts.jit_fuser
    try:
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        grouped_gemm_util.ops = type("ops", (), {"gmm": staticmethod(_fake_gmm)})
        megatron_experts.jit_fuser = lambda f: f  # (torch.compile, not needed here)
        return megatron_experts.GroupedMLP(seq.num_local_experts, layer.config, pg_collection=groups)
    finally:
        megatron_experts.jit_fuser = saved[2]
        grouped_gemm_util.assert_grouped_gemm_is_available = saved[0]


def _case_experts_layouts(ctx, kind, seed):
    """MoeFp4Experts alone, on rows as Megatron's dispatchers give them (back to back by expert: the
    padded path): the weights' layout round trip bit for bit, then forward and backward against the
    Megatron experts module (save="bf16": FP8 products only, bound 0.1), weight gradients mapped back."""
    import megatron.core.transformer.moe.grouped_gemm_util as grouped_gemm_util

    _init_parallel(ctx)
    dtype = torch.bfloat16 if kind == "grouped" else torch.float32  # (GroupedMLP: BF16 only)
    layer = _cpu_layer(seed, dtype, **SWIGLU)
    module = _megatron_experts(kind, layer)
    params = dict(module.named_parameters())
    layout = mc.to_megatron_layout(module, *mc.from_megatron_layout(module, 2, HIDDEN, 128))
    assert set(layout) == set(params) and all(torch.equal(layout[n], p) for n, p in params.items())

    experts = mc.experts_class()(module, layer.config, save="bf16")
    assert experts.w1.dtype == dtype and experts.w1.shape == (2, 256, HIDDEN) and experts.w2.shape == (2, HIDDEN, 128)
    torch.manual_seed(seed + 1 + ctx.rank)
    counts = torch.tensor([130, 7] if ctx.rank == 0 else [0, 45])
    rows = torch.randn(int(counts.sum()), HIDDEN, dtype=dtype)
    probs = torch.rand(rows.shape[0])
    grad_out = torch.randn(rows.shape[0], HIDDEN)

    def run(m):
        r, p = rows.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = m(r, counts, p)
        assert bias is None
        (out.float() * grad_out).sum().backward()
        return out.detach(), r.grad, p.grad

    saved_ops = grouped_gemm_util.ops
    grouped_gemm_util.ops = type("ops", (), {"gmm": staticmethod(_fake_gmm)})
    try:
        ref = run(module)
    finally:
        grouped_gemm_util.ops = saved_ops
    got = run(experts)
    assert got[0].dtype == dtype and got[0].shape == rows.shape
    errors = {name: _rel(a, b) for name, a, b in zip(("out", "rows", "probs"), got, ref)}
    grads = experts.megatron_state(grads=True)
    errors.update({n: _rel(grads[n], p.grad) for n, p in params.items()})
    bad = {n: e for n, e in errors.items() if not e < EXPERTS_BOUNDS["bf16"]}
    assert not bad, f"rank {ctx.rank} {kind}: errors at or above {EXPERTS_BOUNDS['bf16']}: {bad}"

    with torch.no_grad():  # restore writes the (trained) weights back into Megatron's layout
        experts.w1.mul_(2)
        experts.w2.add_(1)
    assert experts.restore() is module
    new = dict(module.named_parameters())
    back = mc.to_megatron_layout(module, experts.w1.detach(), experts.w2.detach())
    assert all(torch.equal(new[n], back[n]) for n in new)
    with pytest.raises(NotImplementedError, match="revert"):
        experts.sharded_state_dict()
    return max(errors.values())


def _case_experts_apply_refusals(ctx, seed):
    """apply(experts="moe_fp4") on a GPTModel; bad options and experts it does not compute are refused
    with a ValueError naming them, before any layer changes; apply(experts="megatron") and revert put
    Megatron's experts back with the trained weights."""
    _init_parallel(ctx)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
                               moe_router_topk=TOPK, moe_token_dispatcher_type="allgather",
                               use_cpu_initialization=True, add_bias_linear=False, gated_linear_unit=True,
                               expert_model_parallel_size=ctx.world_size, **SWIGLU)
    torch.manual_seed(seed)
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False), vocab_size=64,
                     max_sequence_length=16)
    layers = mc.find_moe_layers(model)
    originals = [(layer.token_dispatcher, layer.experts) for layer in layers]

    def unchanged():
        return [(layer.token_dispatcher, layer.experts) for layer in layers] == originals

    for options, match in ((dict(experts="te"), "experts: expected one of"),
                           (dict(experts="moe_fp4", save="int4"), "save: expected one of")):
        with pytest.raises(ValueError, match=match):
            mc.apply(model, backend="gloo", **options)
        assert unchanged()
    for field, value, match in (("activation_func", torch.nn.functional.gelu, "gated SwiGLU"),
                                ("gated_linear_unit", False, "gated SwiGLU"),
                                ("glu_linear_offset", 1.0, "glu_linear_offset"),
                                ("activation_func_clamp_value", 7.0, "activation_func_clamp_value"),
                                ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input"),
                                ("add_bias_linear", True, "add_bias_linear"),
                                ("moe_ffn_hidden_size", 64, "moe_ffn_hidden_size must be a multiple of 128")):
        saved = getattr(config, field)
        setattr(config, field, value)
        try:
            with pytest.raises(ValueError, match=match):
                mc.apply(model, backend="gloo", experts="moe_fp4")
        finally:
            setattr(config, field, saved)
        assert unchanged()

    patched = mc.apply(model, payload="fp8", backend="gloo", experts="moe_fp4", save="fp8")
    adapters = [layer.experts for layer in patched]
    assert all(isinstance(a, mc.experts_class()) and a.save == "fp8" for a in adapters)
    assert [a.megatron_experts for a in adapters] == [e for _, e in originals]
    names = {n for n, _ in model.named_parameters()}
    assert "decoder.layers.0.mlp.experts.w1" in names and not any("local_experts" in n for n in names)
    assert getattr(adapters[0].w1, "allreduce", None) is False  # expert parallel: no data-parallel all-reduce
    mc.apply(model, payload="mxfp4", backend="gloo", experts="moe_fp4", save="mxfp4")  # again: the same experts
    assert [layer.experts for layer in layers] == adapters and adapters[0].save == "mxfp4"
    assert not layers[0].token_dispatcher.decode
    with torch.no_grad():
        adapters[0].w1.add_(1.0)  # "training"
    trained = adapters[0].megatron_state()
    mc.apply(model, payload="bf16", backend="gloo")  # Megatron's experts, with the trained weights
    assert [layer.experts for layer in layers] == [e for _, e in originals]
    assert layers[0].token_dispatcher.expert_alignment == 1
    params = dict(layers[0].experts.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in trained.items())
    mc.apply(model, backend="gloo", experts="moe_fp4")
    assert len(mc.revert(model)) == 2 and unchanged()
    assert mc.revert(model) == []
    return True


@needs_megatron
@pytest.mark.parametrize("payload,save", [("bf16", "fp8"), ("bf16", "bf16"), ("fp8", "fp8"), ("fp8", "recompute"),
                                          ("mxfp4", "mxfp4"), ("nvfp4", "mxfp4")])
def test_fp8_experts_vs_megatron_experts(pool, payload, save):
    results = pool.run(_case_fp8_experts_vs_megatron, payload, save, 50)
    print(payload, save, "output error, worst error (relative), per rank:", results)


@needs_megatron
@pytest.mark.parametrize("kind", ["sequential", "grouped", "te_grouped"])
def test_fp8_experts_megatron_layouts(pool, kind):
    results = pool.run(_case_experts_layouts, kind, 60)
    print(kind, "worst error (relative), per rank:", results)


@needs_megatron
def test_fp8_experts_apply_revert_refusals(pool):
    pool.run(_case_experts_apply_refusals, 70)


# ---------------------------------------------------------------------------------------------
# GPU: a small GPT-MoE on 2 GPUs (NCCL), moe_fp4 against Megatron's alltoall dispatcher
# ---------------------------------------------------------------------------------------------

GPT = dict(layers=2, hidden=256, heads=4, ffn=512, moe_ffn=256, experts=4, topk=2, vocab=512, seq=64, batch=2)


def _gpt_model(seed: int, **options):
    """The GPT-MoE of GPT on this rank's GPU; options override the TransformerConfig's."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=GPT["layers"], hidden_size=GPT["hidden"], num_attention_heads=GPT["heads"],
                  ffn_hidden_size=GPT["ffn"], moe_ffn_hidden_size=GPT["moe_ffn"], num_moe_experts=GPT["experts"],
                  moe_router_topk=GPT["topk"], moe_token_dispatcher_type="alltoall",
                  moe_router_load_balancing_type="none", moe_router_dtype="fp32", add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    config = TransformerConfig(**{**kwargs, **options})
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=GPT["experts"], moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=GPT["vocab"], max_sequence_length=GPT["seq"]).cuda()


def _gpt_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, GPT["vocab"], (GPT["batch"], GPT["seq"] + 1), generator=g).cuda()
    position_ids = torch.arange(GPT["seq"], device="cuda").expand(GPT["batch"], -1)
    return tokens[:, :-1], position_ids, tokens[:, 1:]


def _gpt_loss(model, rank: int, step: int):
    tokens, position_ids, labels = _gpt_batch(rank, step)
    return model(tokens, position_ids, None, labels=labels).float().mean()  # causal mask: None


def _round_experts_input(model, payload):
    """Forward pre-hooks on every MoE layer's experts: they see the dispatched rows rounded as
    ``payload`` rounds them (straight-through gradient), the reference for moe_fp4's dispatcher.
    Row-wise payloads only (bf16, fp8, mxfp4): rounding after the exchange equals rounding before."""
    codec = get_payload(payload)
    assert codec.rowwise

    def hook(module, args):
        rows, *rest = args
        rounded = codec.decode(codec.encode(rows.detach()), rows.shape[1]).to(rows.dtype) if rows.shape[0] else rows
        return (rows + (rounded - rows).detach(), *rest)

    return [layer.experts.register_forward_pre_hook(hook) for layer in mc.find_moe_layers(model)]


def _record_routing(model, store: list):
    def hook(module, args, output):
        store.append(output[1].detach().clone())  # routing_map [T, E]

    return [layer.router.register_forward_hook(hook) for layer in mc.find_moe_layers(model)]


def _grads(model) -> dict:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _group_errors(grads: dict, ref: dict) -> dict:
    """Relative Frobenius error of the gradients of the experts, the routers and the rest."""
    groups: dict[str, list] = {"experts": [], "router": [], "dense": []}
    for n in ref:
        key = "experts" if ".experts." in n else "router" if ".router." in n else "dense"
        groups[key].append(n)
    return {k: _rel(torch.cat([grads[n].flatten() for n in ns]), torch.cat([ref[n].flatten() for n in ns]))
            for k, ns in groups.items() if ns}


def _loss_backward(model, rank: int):
    """The loss of step 0's batch, its backward, and the routing_map of every MoE layer: (loss, routing)."""
    routing: list = []
    hooks = _record_routing(model, routing)
    loss = _gpt_loss(model, rank, 0)
    loss.backward()
    for h in hooks:
        h.remove()
    return loss, routing


def _megatron_reference(model, payload, rank: int):
    """Megatron's own layers with the experts' input rounded as ``payload`` rounds it: (loss, gradients,
    routing) of _loss_backward; the model's gradients are cleared afterwards."""
    hooks = _round_experts_input(model, payload)
    loss, routing = _loss_backward(model, rank)
    grads = _grads(model)
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return loss, grads, routing


def _case_gpt_forward_backward(ctx, payload, backend, seed):
    _init_parallel(ctx)
    model = _gpt_model(seed)
    ref_loss, ref_grads, ref_routing = _megatron_reference(model, payload, ctx.rank)

    mc.apply(model, payload=payload, backend=backend)
    loss, routing = _loss_backward(model, ctx.rank)
    grads = _grads(model)
    mc.revert(model)

    flips = [int((a != b).any(dim=1).sum()) for a, b in zip(routing, ref_routing)]
    assert not any(flips), (f"rank {ctx.rank}: tokens that took other experts per MoE layer {flips} (a near-tie "
                            "that the combine's rounding flips; pick another seed)")
    assert set(grads) == set(ref_grads)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    errors = _group_errors(grads, ref_grads)
    assert loss_err < 1e-3, f"rank {ctx.rank}: loss {loss.item()} vs {ref_loss.item()}"
    bad = {k: e for k, e in errors.items() if e > 2e-2}
    assert not bad, f"rank {ctx.rank}: gradient errors above 2e-2: {bad}"
    return loss.item(), ref_loss.item(), errors


def _case_gpt_fp8_experts(ctx, payload, save, backend, seed):
    """A one-layer GPT-MoE with gated SwiGLU experts (one layer: the MoE layer's input, so its routing,
    is the same in both runs): moe_fp4's dispatcher and FP8 experts (``experts="moe_fp4"``) against
    Megatron's alltoall dispatcher and SequentialMLP whose inputs are rounded as the payload rounds
    them. Loss within 1e-2 relative; gradients (experts' mapped back to Megatron's names, routers,
    the rest) within EXPERTS_BOUNDS[save]."""
    _init_parallel(ctx)
    model = _gpt_model(seed, num_layers=1, gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    ref_loss, ref_grads, ref_routing = _megatron_reference(model, payload, ctx.rank)

    layers = mc.apply(model, payload=payload, backend=backend, experts="moe_fp4", save=save)
    loss, routing = _loss_backward(model, ctx.rank)
    names = {id(m): n for n, m in model.named_modules()}
    grads = {n: g for n, g in _grads(model).items() if not n.endswith((".experts.w1", ".experts.w2"))}
    for layer in layers:
        prefix = names[id(layer.experts)]
        grads.update({f"{prefix}.{n}": g.float() for n, g in layer.experts.megatron_state(grads=True).items()})
    mc.revert(model)

    assert all(torch.equal(a, b) for a, b in zip(routing, ref_routing))
    assert set(grads) == set(ref_grads)
    loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    errors = _group_errors(grads, ref_grads)
    assert loss_err < 1e-2, f"rank {ctx.rank}: loss {loss.item()} vs {ref_loss.item()}"
    bad = {k: e for k, e in errors.items() if not e < EXPERTS_BOUNDS[save]}
    assert not bad, f"rank {ctx.rank}: gradient errors at or above {EXPERTS_BOUNDS[save]}: {bad}"
    return loss.item(), ref_loss.item(), errors


def _case_gpt_moe_layer_output(ctx, payload, backend, seed):
    """The first MoE layer alone, on the same input and routing: moe_fp4's dispatcher against
    Megatron's alltoall dispatcher whose tokens are rounded as the payload rounds them (every payload:
    the rounding is this rank's whole batch, as the dispatch encodes it). Bound: three BF16 roundings
    (Megatron's BF16 sum of the expert outputs; moe_fp4's partial sums and result), 3 * 2^-8 of the
    largest magnitude."""
    _init_parallel(ctx)
    model = _gpt_model(seed)
    layer = mc.find_moe_layers(model)[0]
    captured = []
    h = layer.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach().clone()))
    with torch.no_grad():
        _gpt_loss(model, ctx.rank, 0)
    h.remove()
    x = captured[0]  # [S, B, H] bf16

    def run(tokens):
        probs, routing_map = layer.route(x)
        hidden, p = layer.preprocess(tokens, probs, routing_map)
        hidden, p = layer.dispatch(hidden, p)
        out, _ = layer.routed_experts_compute(hidden, p)
        return layer.postprocess(layer.combine(out), None)

    with torch.no_grad():
        ref = run(_payload_round(x, payload)).float()
        mc.apply(layer, payload=payload, backend=backend)
        out = run(x).float()
        mc.revert(layer)
    scale = ref.abs().max().item()
    err = (out - ref).abs().max().item()
    assert err <= 3 * 2.0 ** -8 * scale, f"rank {ctx.rank}: error {err:.3g}, largest |out| {scale:.3g}"
    return err / scale


def _train(model, ctx, steps: int) -> list[float]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_group()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = _gpt_loss(model, ctx.rank, step)
        loss.backward()
        for n, p in model.named_parameters():  # dense weights are replicated: average over data parallel
            if p.grad is not None and ".experts." not in n:
                dist.all_reduce(p.grad, group=dp)
                p.grad /= dist.get_world_size(dp)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _case_gpt_training(ctx, payload, backend, seed, steps):
    _init_parallel(ctx)
    model = _gpt_model(seed)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = _train(model, ctx, steps)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    mc.apply(model, payload=payload, backend=backend)
    mine = _train(model, ctx, steps)
    mc.revert(model)
    return ref, mine


@pytest.fixture(scope="module")
def nccl_pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(2, backend="nccl")
    yield p
    p.close()


GPU_CASES = [("bf16", "nccl"), ("fp8", "nccl"), ("mxfp4", "nccl"), ("mxfp4", "symm")]


@needs_megatron
@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("payload,backend", GPU_CASES)
def test_gpt_moe_forward_backward_vs_alltoall(nccl_pool, payload, backend):
    """Loss within 1e-3 relative and gradients (experts, routers, the rest) within 2e-2 of Megatron's
    alltoall dispatcher whose experts see the payload-rounded rows (no routing flip allowed)."""
    results = nccl_pool.run(_case_gpt_forward_backward, payload, backend, 7)
    print(payload, backend, "loss (moe_fp4, megatron), gradient errors, per rank:", results)


@needs_megatron
@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("payload,save,backend", [("fp8", "fp8", "nccl"), ("mxfp4", "mxfp4", "nccl"),
                                                  ("mxfp4", "mxfp4", "symm")])
def test_gpt_moe_fp8_experts_vs_megatron(nccl_pool, payload, save, backend):
    results = nccl_pool.run(_case_gpt_fp8_experts, payload, save, backend, 7)
    print(payload, save, backend, "loss (moe_fp4 experts, megatron), gradient errors, per rank:", results)


@needs_megatron
@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("payload", ["bf16", "fp8", "mxfp4", "nvfp4"])
def test_gpt_moe_layer_output_vs_alltoall(nccl_pool, payload):
    results = nccl_pool.run(_case_gpt_moe_layer_output, payload, "nccl", 7)
    print(payload, "first MoE layer output error / largest |out|, per rank:", results)


@needs_megatron
@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("payload,bound", [("bf16", 1e-2), ("mxfp4", 5e-2)])
def test_gpt_moe_training_losses_side_by_side(nccl_pool, payload, bound):
    """Five AdamW steps from the same weights on the same batches: Megatron's alltoall dispatcher and
    moe_fp4's; each step's loss within ``bound`` relative (bf16: summation order; mxfp4: MXFP4's error
    on the experts' inputs, unrounded in the reference)."""
    steps = 5
    results = nccl_pool.run(_case_gpt_training, payload, "nccl", 7, steps)
    for rank, (ref, mine) in enumerate(results):
        print(f"{payload} rank {rank}: step, megatron alltoall loss, moe_fp4 loss")
        for step, (a, b) in enumerate(zip(ref, mine)):
            print(f"  {step} {a:.5f} {b:.5f}")
        worst = max(abs(a - b) / abs(a) for a, b in zip(ref, mine))
        assert worst < bound, f"rank {rank}: losses differ by {worst:.3g} relative (bound {bound})"
