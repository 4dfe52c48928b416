"""moe_fp4.integrations.hf_transformers on a tiny random Mixtral (transformers) over 2 gloo ranks.

Every rank builds the same model from the case's seed, keeps an unpatched copy as the reference and
draws the whole world's token ids, so it can check its own results:
  * per MoE layer, the patched experts' output against the reference experts (all E of them) run on
    the same input, the same routing, and the input rounded as the payload rounds it (BF16, or MXFP4
    through the payload's own codec). What remains is the combine's BF16 rounding: of each rank's
    partial sum and of the final sum, so |out - ref| <= 2 u S elementwise, u = 2^-8 (BF16's unit
    roundoff, 8 significant bits) and S = sum_j |w_j y_j| (the magnitudes of the token's weighted
    expert outputs), plus float32 reordering noise;
  * the logits against the unpatched model's, and against an "emulated" unpatched model whose experts
    see their input rounded as the payload rounds it (straight-through gradient); the tolerances are
    at the assertions, with the errors measured over repeated runs;
  * in training mode, backward: finite gradients for every parameter (the router's too), and the
    local experts' weight gradients against the emulated model's for the same experts, summed over
    both ranks' tokens (the gradients travel as BF16).
Every case runs on the fixed seed SEED (named in every failure message): a routing with no near-tie
that the payload's rounding flips, so every comparison runs (a flipped near-tie sends a token to
another expert, and the logits and gradients then differ by far more than rounding; seeds 0 to 11
flip 0 to 3 of the 48 tokens against float32 with mxfp4, and none of them against the emulated
model; SEED flips none). The same checks run with moe_fp4 registered in transformers' expert-parallel
registry and the model distributed by transformers' own plan application (EP over 2 ranks with
FSDP2, on CPU/gloo), and the EPImplementation is also built directly on one experts module to check
ranks that receive no rows or hold no tokens, and the argument checks.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_fp4.ep import get_payload  # noqa: E402
from moe_fp4.integrations.hf_transformers import (  # noqa: E402
    enable_expert_parallel,
    find_experts_modules,
    has_ep_implementation_api,
    register_ep_implementations,
)

# transformers' EPImplementation interface is not in every 5.x release (enable_expert_parallel needs none)
needs_ep_api = pytest.mark.skipif(not has_ep_implementation_api(),
                                  reason="this transformers has no transformers.distributed.expert_parallel")
if has_ep_implementation_api():
    from moe_fp4.integrations.hf_transformers_ep import EP_IMPLEMENTATIONS, MoeFp4BF16EP, MoeFp4EP, MoeFp4FP8EP  # noqa: E402

WORLD = 2
U_BF16 = 2.0 ** -8
SEED = 4  # no routing flips with either payload, on either path (see the module docstring)
SEQ, BATCH = 12, 2


def make_model(seed: int, experts_implementation: str = "eager"):
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=8,
        num_experts_per_tok=2, router_jitter_noise=0.0, tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config).float()
    return model, config


def world_inputs(seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    ids = [torch.randint(0, 96, (BATCH, SEQ), generator=g) for _ in range(WORLD)]
    labels = [torch.randint(0, 96, (BATCH, SEQ), generator=g) for _ in range(WORLD)]
    return ids, labels


def round_like_payload(x: torch.Tensor, payload: str) -> torch.Tensor:
    """x float32 [T, H] as the dispatch delivers it (decoded to float32)."""
    codec = get_payload(payload)
    return codec.decode(codec.encode(x), x.shape[1], dtype=torch.float32)


def emulate_payload(model: torch.nn.Module, payload: str) -> None:
    """Make ``model``'s experts see their input rounded as the payload rounds it, with a
    straight-through gradient (as the patched dispatch passes gradients)."""
    for _, m in find_experts_modules(model):
        def forward(x, idx, w, orig=m.forward):
            return orig(x + (round_like_payload(x.detach(), payload) - x).detach(), idx, w)
        m.forward = forward


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_layers(seen: dict, ref_experts: dict, payload: str, out: dict) -> None:
    """Per MoE layer: the patched experts' output y against the reference experts (all E) on the same
    routing and the payload-rounded input, elementwise within the combine's BF16 bound (module
    docstring). seen: name -> ((x float32 [T, H], idx int64 [T, k], w float32 [T, k]), y float32
    [T, H]) from a forward hook; appends the worst error/bound and the relative error to ``out``."""
    assert sorted(seen) == sorted(ref_experts)
    for name, ((x, idx, w), y) in seen.items():
        assert y.dtype == torch.float32 and y.shape == x.shape
        if x.shape[0] == 0:  # a rank without tokens
            continue
        full = ref_experts[name]
        xq = round_like_payload(x, payload)
        with torch.no_grad():
            expect = full(xq, idx, w)
            per_slot = [full(xq, idx[:, j:j + 1], w[:, j:j + 1]).abs() for j in range(idx.shape[1])]
        s = torch.stack(per_slot).sum(0)
        bound = 2 * U_BF16 * s * (1 + 2.0 ** -6) + 2.0 ** -20 * s.amax() + 1e-30
        err = (y - expect).abs()
        assert torch.all(err <= bound), f"{name}: worst error / bound {(err / bound).max().item():.3f}"
        out["bound_ratio"].append((err / bound).max().item())
        out["block"].append(rel(y, expect))
        # a wrong expert, weight or token would be far outside that bound
        with torch.no_grad():
            assert rel(y, full(x, idx, w)) < (0.01 if payload == "bf16" else 0.5)


def record_routing(model: torch.nn.Module, names) -> dict:
    """name -> top_k_index int64 [T, k] of the last call of each named experts module of ``model``."""
    got = {}
    for n in names:
        model.get_submodule(n).register_forward_hook(lambda mod, args, out, n=n: got.__setitem__(n, args[1].detach()))
    return got


def count_flipped_tokens(ctx, routings: list) -> int:
    """Tokens, over all ranks, whose set of top-k experts differs between the routings (each a dict
    name -> top_k_index int64 [T, k] of one model on this rank's batch) in some layer. The rounding of
    an earlier layer's MoE output can flip a near-tie of two router logits; that token then takes
    another expert, and the logits and gradients differ by far more than rounding."""
    flipped = torch.zeros(routings[0][next(iter(routings[0]))].shape[0], dtype=torch.bool)
    for other in routings[1:]:
        for n, idx in routings[0].items():
            flipped |= (idx.sort(-1).values != other[n].sort(-1).values).any(-1).cpu()
    count = torch.tensor([int(flipped.sum())], device=ctx.device)
    torch.distributed.all_reduce(count, group=ctx.group)
    return int(count.item())


def eval_forward(ctx, model, ref, emu, ref_experts, seen, mine, payload):
    """One eval forward of the patched, reference and emulated models on this rank's ids: the
    per-layer checks (check_layers, on the inputs/outputs ``seen`` by the patched experts' hooks)
    and the routing flips against both, and the relative logit errors (patched vs reference,
    patched vs emulated, emulated vs reference). Returns the results dict."""
    out = {"block": [], "bound_ratio": []}
    for m in (model, ref, emu):
        m.eval()
    ref_routing, emu_routing = record_routing(ref, ref_experts), record_routing(emu, ref_experts)
    with torch.no_grad():
        logits = model(mine).logits
        ref_logits = ref(mine).logits
        emu_logits = emu(mine).logits
    routing = {n: args[1] for n, (args, _) in seen.items()}
    out["flipped_emu"] = count_flipped_tokens(ctx, [routing, dict(emu_routing)])
    out["flipped_ref"] = count_flipped_tokens(ctx, [routing, dict(ref_routing)])
    check_layers(seen, ref_experts, payload, out)
    out["logits"] = rel(logits, ref_logits)
    out["logits_emu"] = rel(logits, emu_logits)
    out["emu_vs_ref"] = rel(emu_logits, ref_logits)
    return out


def case_model(ctx, seed: int, payload: str):
    """Forward (eval) and backward (train) checks on one rank; returns measured errors."""
    model, _ = make_model(seed)
    model.to(ctx.device)
    ref = copy.deepcopy(model)
    emu = copy.deepcopy(model)  # the unpatched model with the payload's rounding of the expert inputs
    emulate_payload(emu, payload)
    patched = enable_expert_parallel(model, ctx.group, payload=payload)
    ref_experts = dict(find_experts_modules(ref))
    assert sorted(patched) == sorted(ref_experts) and len(patched) == 2
    for name, m in find_experts_modules(model):
        assert m.num_experts == 4 and m.gate_up_proj.shape[0] == 4 and m.down_proj.shape[0] == 4
        full = ref_experts[name]
        lo = 4 * ctx.rank
        assert torch.equal(m.gate_up_proj, full.gate_up_proj[lo:lo + 4])
        assert torch.equal(m.down_proj, full.down_proj[lo:lo + 4])

    seen = {}
    for name, m in find_experts_modules(model):
        m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(
            name, (tuple(a.detach() for a in args), out.detach())))

    ids, labels = world_inputs(seed)
    ids = [i.to(ctx.device) for i in ids]
    labels = [lab.to(ctx.device) for lab in labels]
    mine = ids[ctx.rank]
    # ---- forward, eval --------------------------------------------------------------------------
    out = eval_forward(ctx, model, ref, emu, ref_experts, seen, mine, payload)

    # ---- backward, train ------------------------------------------------------------------------
    model.train()
    emu.train()
    loss = torch.nn.functional.cross_entropy(model(mine).logits.reshape(-1, 96), labels[ctx.rank].reshape(-1))
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n}: no gradient"
        assert torch.isfinite(p.grad).all(), f"{n}: non-finite gradient"
    emu_loss = sum(torch.nn.functional.cross_entropy(emu(i).logits.reshape(-1, 96), lab.reshape(-1))
                   for i, lab in zip(ids, labels))
    emu_loss.backward()
    out["grad"] = []
    emu_experts = dict(find_experts_modules(emu))
    for name, m in find_experts_modules(model):
        full = emu_experts[name]
        lo = 4 * ctx.rank
        for pname in ("gate_up_proj", "down_proj"):
            g, g_ref = getattr(m, pname).grad, getattr(full, pname).grad[lo:lo + 4]
            assert g.abs().sum() > 0
            out["grad"].append(rel(g, g_ref))
    router = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(router) == 2 and all(g.abs().sum() > 0 for g in router)
    return out


@pytest.fixture(scope="module")
def pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(WORLD, "gloo", timeout_s=60)
    yield p
    p.close()


@pytest.fixture(scope="module")
def nccl_pool():
    from moe_fp4.ep.testing import WorkerPool

    p = WorkerPool(WORLD, "nccl", timeout_s=120)
    yield p
    p.close()


@pytest.mark.parametrize("payload", ["bf16", "mxfp4"])
def test_patched_mixtral_matches_unpatched(pool, payload):
    check_patched_mixtral(pool, payload)


@pytest.mark.multigpu
@pytest.mark.parametrize("payload", ["bf16", "mxfp4"])
def test_patched_mixtral_matches_unpatched_nccl(nccl_pool, payload):
    """The same checks with the model on 2 GPUs and the dispatch over NCCL (native MXFP4 kernels)."""
    check_patched_mixtral(nccl_pool, payload)


def check_patched_mixtral(pool, payload):
    results = pool.run(case_model, SEED, payload)
    print(f"seed {SEED}, {payload}: {results}")
    assert_within_tolerances(results, payload)


def assert_within_tolerances(results: list, payload: str) -> None:
    """The documented bounds (moe_fp4/integrations/README.md), on every rank; measured at SEED in the comments
    (seeds 0 to 11 without a flip in brackets)."""
    for rank, r in enumerate(results):
        where = f"seed {SEED}, rank {rank}, {payload}"
        assert max(r["bound_ratio"]) <= 1.0, where  # checked elementwise in the case; measured 0.77 to 0.81
        assert r["flipped_emu"] == 0, f"{where}: {r['flipped_emu']} tokens routed unlike the emulated model"
        assert r["flipped_ref"] == 0, f"{where}: {r['flipped_ref']} tokens routed unlike float32"
        if payload == "bf16":
            # what differs from float32 is the BF16 rounding of the MoE inputs (dispatch) and outputs
            # (combine) at 2 layers: 3.1e-4 to 3.3e-4 (2.8e-4 to 3.3e-4)
            assert r["logits"] < 1e-3, f"{where}: logits {r['logits']:.2e} from float32"
            assert r["logits_emu"] < 1e-3, f"{where}: logits {r['logits_emu']:.2e} from the emulated model"
            # BF16 gradients through dispatch and combine: 1.9e-3 to 2.0e-3 (1.8e-3 to 2.9e-3)
            assert max(r["grad"]) < 5e-3, f"{where}: gradients {max(r['grad']):.2e} from the emulated model"
        else:
            # Against the emulated model only the combine's BF16 rounding differs, but a perturbation
            # that moves a layer-2 input across an E2M1 rounding boundary changes that element by a
            # whole MXFP4 step: 2.1e-4 to 2.3e-4 (1.8e-4 to 7.5e-4)
            assert r["logits_emu"] < 2e-3, f"{where}: logits {r['logits_emu']:.2e} from the emulated model"
            # Against float32: MXFP4's own error (the emulated model's, 1.7e-2 (1.5e-2 to 1.8e-2)) plus
            # the above
            assert abs(r["logits"] - r["emu_vs_ref"]) < 2e-3, f"{where}: logits {r['logits']:.2e} from float32"
            assert r["logits"] < 3e-2, f"{where}: logits {r['logits']:.2e} from float32"
            # gradients: BF16 on the wire plus the MXFP4 roundings that the BF16 combine moves:
            # 1.8e-3 (1.6e-3 to 9.5e-3)
            assert max(r["grad"]) < 1.5e-2, f"{where}: gradients {max(r['grad']):.2e} from the emulated model"


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="model"):
        enable_expert_parallel(torch.nn.Sequential(torch.nn.Linear(64, 64)))
    model, _ = make_model(SEED)
    with pytest.raises(ValueError, match="payload"):
        enable_expert_parallel(model, payload="fp8")  # hidden 64 is not a multiple of 128
    with pytest.raises(ValueError, match="payload"):
        enable_expert_parallel(model, payload="int3")
    for _, m in find_experts_modules(model):  # left as it was
        assert m.num_experts == 8 and m.gate_up_proj.shape[0] == 8 and not hasattr(m, "_moe_fp4_ep")


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_world_of_one_keeps_every_expert(experts_implementation):
    """Without torch.distributed the group is a world of one: all 8 experts stay, the outputs match
    (with transformers' eager experts loop and with its grouped_mm experts): every MoE layer within
    the BF16 payload's bound of the reference experts on the same routing and input (check_layers),
    and the logits within 1e-3 of the unpatched model's, on the same routing."""
    seed = SEED
    model, _ = make_model(seed, experts_implementation)
    ref = copy.deepcopy(model)
    enable_expert_parallel(model, payload="bf16")
    for _, m in find_experts_modules(model):
        assert m.num_experts == 8
    with pytest.raises(ValueError, match="already"):
        enable_expert_parallel(model, payload="bf16")
    ref_experts = dict(find_experts_modules(ref))
    seen = {}
    for n, m in find_experts_modules(model):
        m.register_forward_hook(lambda mod, args, out, n=n: seen.__setitem__(
            n, (tuple(a.detach() for a in args), out.detach())))
    ref_routing = record_routing(ref, ref_experts)
    ids = world_inputs(seed)[0][0]
    with torch.no_grad():
        err = rel(model(ids).logits, ref(ids).logits)
    check_layers(seen, ref_experts, "bf16", {"block": [], "bound_ratio": []})
    flipped = [n for n, (args, _) in seen.items()
               if not torch.equal(args[1].sort(-1).values, ref_routing[n].sort(-1).values)]
    assert not flipped, f"seed {seed}: routing flipped in {flipped}"
    assert err < 1e-3, f"seed {seed}: logits, relative error {err:.2e}"


# ---- transformers' own expert-parallel plan with moe_fp4 registered as its EPImplementation ------


def case_plan(ctx, seed: int, name: str, payload: str):
    """The unpatched model distributed by transformers' plan application (what from_pretrained runs
    after building the model): DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation=name),
    i.e. experts sharded by the grouped_gemm rule, the ep_dispatch_experts rule building one
    ``EP_IMPLEMENTATIONS[name]`` per experts module, every other parameter under FSDP2. The same
    checks as case_model; FSDP averages the gradients over the 2 ranks, so the emulated model's loss
    is the mean of both ranks' losses."""
    from transformers.distributed import DistributedConfig

    register_ep_implementations()
    model, _ = make_model(seed)
    ref = copy.deepcopy(model)
    emu = copy.deepcopy(model)
    emulate_payload(emu, payload)
    ref_experts = dict(find_experts_modules(ref))
    config, _, meshes = transformers.PreTrainedModel.prepare_distribute_model(
        DistributedConfig(ep_size=WORLD, fsdp_size=WORLD, ep_implementation=name))
    model = transformers.PreTrainedModel.maybe_distribute_model(model, config, meshes)
    lo = 4 * ctx.rank
    seen = {}
    for n, full in ref_experts.items():
        m = model.get_submodule(n)
        assert m.num_experts == 4
        assert torch.equal(m.gate_up_proj.to_local(), full.gate_up_proj[lo:lo + 4])
        assert torch.equal(m.down_proj.to_local(), full.down_proj[lo:lo + 4])
        m.register_forward_hook(lambda mod, args, out, n=n: seen.__setitem__(
            n, (tuple(a.detach() for a in args), out.detach())))

    ids, labels = world_inputs(seed)
    mine = ids[ctx.rank]
    out = eval_forward(ctx, model, ref, emu, ref_experts, seen, mine, payload)
    for (_, y) in seen.values():  # the combine's BF16 sums (transformers' own exchange is float32)
        assert torch.equal(y, y.bfloat16().float())

    model.train()
    emu.train()
    loss = torch.nn.functional.cross_entropy(model(mine).logits.reshape(-1, 96), labels[ctx.rank].reshape(-1))
    loss.backward()
    emu_loss = sum(torch.nn.functional.cross_entropy(emu(i).logits.reshape(-1, 96), lab.reshape(-1))
                   for i, lab in zip(ids, labels)) / WORLD
    emu_loss.backward()
    emu_params = dict(emu.named_parameters())
    out["grad"] = []
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n}: no gradient"
        g = p.grad.to_local()
        assert torch.isfinite(g).all(), f"{n}: non-finite gradient"
        if ".experts." in n:  # this rank's experts, whole
            g_ref = emu_params[n].grad[lo:lo + 4]
            assert g.abs().sum() > 0
            out["grad"].append(rel(g, g_ref))
        elif n.endswith("mlp.gate.weight"):  # the router, through the combine's weight gradient
            out["grad"].append(rel(p.grad.full_tensor(), emu_params[n].grad))
    assert len(out["grad"]) == 6
    return out


@needs_ep_api
@pytest.mark.parametrize("name,payload", [("moe_fp4_bf16", "bf16"), ("moe_fp4", "mxfp4")])
def test_transformers_plan_with_moe_fp4_matches_unpatched(pool, name, payload):
    """Same tolerances as the enable_expert_parallel path (measured here: logits 3e-4 bf16 and 1.6e-2
    to 2.2e-2 mxfp4 against float32, 2e-4 to 6e-4 against the emulated model; gradients 1.2e-3 to
    2.3e-3 bf16, up to 9e-3 mxfp4 where an input crosses an E2M1 rounding boundary)."""
    results = pool.run(case_plan, SEED, name, payload)
    print(f"seed {SEED}, {name}: {results}")
    assert_within_tolerances(results, payload)


def case_plan_with_tp(ctx, seed: int):
    """tp_size=2 through the plan application: MoeFp4EP refuses the TP mesh with a ValueError."""
    from transformers.distributed import DistributedConfig

    register_ep_implementations()
    model, _ = make_model(seed)
    config, _, meshes = transformers.PreTrainedModel.prepare_distribute_model(
        DistributedConfig(tp_size=WORLD, ep_size=WORLD, ep_implementation="moe_fp4"))
    with pytest.raises(ValueError, match="tp_mesh: MoeFp4EP needs a tensor-parallel mesh of size 1"):
        transformers.PreTrainedModel.maybe_distribute_model(model, config, meshes)


@needs_ep_api
def test_transformers_plan_with_tensor_parallel_raises(pool):
    pool.run(case_plan_with_tp, SEED)


def case_direct(ctx, seed: int):
    """MoeFp4BF16EP built directly on one experts module with a gloo DeviceMesh, on routings that
    leave a rank without rows, then without tokens; the argument checks."""
    from torch.distributed.device_mesh import init_device_mesh

    from moe_fp4.integrations.hf_transformers import _keep_local_experts

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("tp", "ep"))
    ep_mesh, tp_mesh = mesh["ep"], mesh["tp"]
    model, _ = make_model(seed)
    full = model.model.layers[0].mlp.experts
    experts = copy.deepcopy(full)
    _keep_local_experts(experts, 4 * ctx.rank, 4)
    with pytest.raises(ValueError, match="tp_mesh"):
        MoeFp4EP(experts, ep_mesh, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",)))
    with pytest.raises(ValueError, match="payload"):
        MoeFp4FP8EP(experts, ep_mesh, tp_mesh)  # hidden 64 is not a multiple of 128
    impl = MoeFp4BF16EP(experts, ep_mesh, tp_mesh)

    g = torch.Generator().manual_seed(seed + 2)
    out = {"block": [], "bound_ratio": [], "grad": []}
    # 1: every token of both ranks picks two of rank 0's experts: rank 1 receives no rows;
    # 2: rank 1 holds no tokens, rank 0's pick any expert
    for routing in ("rank 0 experts", "no tokens on rank 1"):
        tokens = [16, 0 if routing == "no tokens on rank 1" else 10]
        high = 4 if routing == "rank 0 experts" else 8
        xs = [torch.randn(t, 64, generator=g) for t in tokens]
        idxs = [torch.rand(t, high, generator=g).argsort(-1)[:, :2] for t in tokens]  # 2 distinct experts
        ws = [torch.rand(t, 2, generator=g).softmax(-1) for t in tokens]
        dys = [torch.randn(t, 64, generator=g) for t in tokens]
        x, w = xs[ctx.rank].clone().requires_grad_(), ws[ctx.rank].clone().requires_grad_()
        experts.zero_grad()
        y = impl(x, idxs[ctx.rank], w)
        check_layers({"experts": ((x.detach(), idxs[ctx.rank], w.detach()), y.detach())}, {"experts": full},
                     "bf16", out)
        (y * dys[ctx.rank]).sum().backward()
        # the reference: all 8 experts on both ranks' tokens, the input rounded to BF16 (straight through)
        full.zero_grad()
        x_ref = [xi.clone().requires_grad_() for xi in xs]
        w_ref = [wi.clone().requires_grad_() for wi in ws]
        for xi, ii, wi, dy in zip(x_ref, idxs, w_ref, dys):
            if xi.shape[0] == 0:
                continue
            xq = xi + (xi.detach().bfloat16().float() - xi).detach()
            (full(xq, ii, wi) * dy).sum().backward()
        if tokens[ctx.rank]:
            out["grad"] += [rel(x.grad, x_ref[ctx.rank].grad), rel(w.grad, w_ref[ctx.rank].grad)]
        else:
            assert x.grad.shape == (0, 64) and w.grad.shape == (0, 2)
        for pname in ("gate_up_proj", "down_proj"):
            gp = getattr(experts, pname).grad
            assert gp is not None and torch.isfinite(gp).all()
            if routing == "rank 0 experts" and ctx.rank == 1:
                assert torch.equal(gp, torch.zeros_like(gp))  # connected, no rows
            else:
                out["grad"].append(rel(gp, getattr(full, pname).grad[4 * ctx.rank:4 * ctx.rank + 4]))
    return out


@needs_ep_api
def test_ep_implementation_direct_empty_ranks(pool):
    """A rank that receives no rows, or holds no tokens, still joins every exchange (forward and
    backward) and gets zero, not missing, expert gradients; outputs within the combine's BF16 bound;
    input, routing-weight and expert gradients within BF16 gradient exchange error (measured 2e-3)."""
    results = pool.run(case_direct, SEED)
    for r in results:
        assert max(r["bound_ratio"]) <= 1.0
        assert r["grad"] and max(r["grad"]) < 1e-2


@needs_ep_api
def test_register_ep_implementations():
    from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

    names = register_ep_implementations()
    assert names == ["moe_fp4", "moe_fp4_bf16", "moe_fp4_fp8", "moe_fp4_nvfp4"]
    assert register_ep_implementations() == names  # again: nothing changes
    registry = EPImplementationInterface()
    for name in names:
        assert registry[name] is EP_IMPLEMENTATIONS[name] and issubclass(registry[name], EPImplementation)
        assert registry[name].payload == (name.removeprefix("moe_fp4_") if name != "moe_fp4" else "mxfp4")
    EPImplementationInterface.register("moe_fp4_bf16", MoeFp4EP)
    try:
        with pytest.raises(ValueError, match="ep_implementation"):
            register_ep_implementations()
    finally:
        EPImplementationInterface.register("moe_fp4_bf16", MoeFp4BF16EP)


def test_without_the_ep_interface_only_the_ep_implementation_path_is_refused(monkeypatch):
    # On a transformers release without transformers.distributed.expert_parallel the EPImplementation
    # names raise a clear ImportError, while enable_expert_parallel keeps working.
    import moe_fp4.integrations.hf_transformers as H

    monkeypatch.setattr(H, "has_ep_implementation_api", lambda: False)
    with pytest.raises(ImportError, match="transformers.distributed.expert_parallel"):
        H.register_ep_implementations()
    with pytest.raises(ImportError, match="enable_expert_parallel"):
        H.MoeFp4EP  # noqa: B018
    with pytest.raises(AttributeError):
        H.no_such_name  # noqa: B018
    assert callable(H.enable_expert_parallel)
