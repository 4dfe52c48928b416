"""moe_fp4 inside existing trainers (installed with the package; each module imports its framework
only when it is imported itself).

  hf_transformers     Hugging Face transformers 5.x MoE models: ``enable_expert_parallel(model, group,
                      payload)`` and ``register_ep_implementations()`` (transformers' own
                      ``DistributedConfig(ep_implementation="moe_fp4")``)
  hf_transformers_ep  the ``EPImplementation`` classes (loaded on first use by hf_transformers)
  hf_example          a runnable example: ``torchrun --nproc_per_node 2 -m moe_fp4.integrations.hf_example``
"""
