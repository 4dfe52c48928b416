"""The MoE layer side of moe_fp4: the experts' FP8 grouped GEMMs (forward, dgrad, wgrad) and the
expert MLPs on them (``Experts``), and the MXFP4 cache of activations saved for backward."""

from moe_fp4.moe.cache import CacheStats, mxfp4_activation_cache
from moe_fp4.moe.experts import SAVE_POLICIES, Experts
from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8, grouped_gemm_fp8_wgrad

__all__ = ["SAVE_POLICIES", "CacheStats", "Experts", "grouped_gemm_fp8", "grouped_gemm_fp8_wgrad",
           "mxfp4_activation_cache"]
