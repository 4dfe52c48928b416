"""The MoE layer side of moe_fp4: the MXFP4 cache of activations saved for backward, and the
experts' FP8 grouped GEMM (its reference in torch; the native Hopper kernel is measured against it)."""

from moe_fp4.moe.cache import CacheStats, mxfp4_activation_cache
from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8

__all__ = ["CacheStats", "grouped_gemm_fp8", "mxfp4_activation_cache"]
