"""The MoE layer side of moe_fp4: the experts' FP8 grouped GEMMs (forward, dgrad, wgrad), the expert
MLPs on them (``Experts``), the MoE layer (``MoELayer``: router, dispatch, experts, combine) and the
MXFP4 cache of activations saved for backward."""

from moe_fp4.moe.cache import CacheStats, mxfp4_activation_cache
from moe_fp4.moe.experts import SAVE_POLICIES, Experts
from moe_fp4.moe.grouped_gemm import grouped_gemm_fp8, grouped_gemm_fp8_wgrad
from moe_fp4.moe.layer import POLICIES, BF16Experts, MoELayer, Router, SharedExpert

__all__ = ["POLICIES", "SAVE_POLICIES", "BF16Experts", "CacheStats", "Experts", "MoELayer", "Router", "SharedExpert",
           "grouped_gemm_fp8", "grouped_gemm_fp8_wgrad", "mxfp4_activation_cache"]
