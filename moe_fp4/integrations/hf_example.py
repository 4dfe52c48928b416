"""A small random Mixtral (transformers) made expert-parallel with moe_fp4, forward and backward.

    torchrun --nproc_per_node 2 -m moe_fp4.integrations.hf_example                   # gloo on CPU
    torchrun --nproc_per_node 2 -m moe_fp4.integrations.hf_example --payload bf16
    python -m moe_fp4.integrations.hf_example                                        # one process

Every rank builds the same model from the same seed and keeps an unpatched copy;
``enable_expert_parallel`` keeps the rank's share of the experts and sends the tokens to the experts'
ranks as ``--payload`` rows through moe_fp4's ``Buffer``. Each rank runs its own batch forward (eval),
prints the relative difference of its logits to the unpatched model's (the payload's rounding:
about 3e-4 with bf16, 2e-2 with mxfp4), then one training forward and backward. Under torchrun the
group is gloo on CPU and NCCL when CUDA is present (one GPU per rank).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

from moe_fp4.integrations.hf_transformers import enable_expert_parallel


def tiny_mixtral(seed: int):
    """A 2-layer Mixtral with 8 experts, top-2, hidden size 64 (float32, random weights)."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_local_experts=8,
        num_experts_per_tok=2, router_jitter_noise=0.0, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config).float()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--payload", default="mxfp4", choices=["mxfp4", "bf16", "fp8", "nvfp4"],
                        help="dispatch wire format (fp8 needs a hidden size that is a multiple of 128: not here)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    group, rank, device = None, 0, torch.device("cpu")
    if "WORLD_SIZE" in os.environ:  # under torchrun
        import torch.distributed as dist

        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        group, rank = dist.group.WORLD, dist.get_rank()

    model = tiny_mixtral(args.seed).to(device)
    reference = copy.deepcopy(model)
    patched = enable_expert_parallel(model, group, payload=args.payload)

    g = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batch
    ids = torch.randint(0, 96, (2, 12), generator=g).to(device)
    labels = torch.randint(0, 96, (2, 12), generator=g).to(device)
    model.eval()
    reference.eval()
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, reference(ids).logits
    rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()

    model.train()
    loss = torch.nn.functional.cross_entropy(model(ids).logits.reshape(-1, 96), labels.reshape(-1))
    loss.backward()
    grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    print(f"rank {rank}: {len(patched)} MoE layers expert-parallel ({args.payload}); logits vs unpatched: "
          f"{rel:.1e} relative; loss {loss.item():.4f}; gradients finite: {grads_ok}", flush=True)
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    if not grads_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
