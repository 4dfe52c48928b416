"""moe_fp4: expert-parallel MoE communication in MXFP4 with FP8 compute on Hopper GPUs.

Submodules:
  formats  the numeric spec (plain PyTorch): element codecs, MX/NVFP4/FP8-blockwise quantization
  ops      native CUDA ops over csrc/, falling back to formats on CPU or without a build
  ep       expert-parallel dispatch/combine with byte-row payloads
  moe      the experts' computation on FP8 grouped GEMMs and the MXFP4 cache of activations saved
           for backward (no router, and no complete MoE layer module)
  recipes  dense-layer recipes (MXFP8, NVFP4, MXFP4, FP8 blockwise), QuantLinear, autocast
"""

__version__ = "0.1.0"

from moe_fp4 import formats  # noqa: E402,F401


def __getattr__(name):
    # Heavier subpackages load on first use so `import moe_fp4` stays cheap.
    if name in ("ops", "ep", "moe", "recipes"):
        import importlib

        return importlib.import_module(f"moe_fp4.{name}")
    if name == "autocast":
        from moe_fp4.recipes import autocast

        return autocast
    raise AttributeError(f"module 'moe_fp4' has no attribute {name!r}")
