"""The MoE layer side of moe_fp4. Now: the MXFP4 cache of activations saved for backward."""

from moe_fp4.moe.cache import CacheStats, mxfp4_activation_cache

__all__ = ["CacheStats", "mxfp4_activation_cache"]
