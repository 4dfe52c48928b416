"""The local experts of an MoE layer on FP8 grouped GEMMs: G SwiGLU MLPs (gate and up fused, then
down), forward and backward.

Every product runs in FP8 (``grouped_gemm_fp8``: 1x128 activation scales, 128x128 weight scales;
``grouped_gemm_fp8_wgrad`` for the weight gradients, float32). The master weights stay in BF16 or
FP32; their FP8 tiles and the transposed tiles of dgrad are made once per weight version (so once
per optimizer step) by ``ops.quantize_fp8_tiles``.

What the backward needs is saved according to ``save``:
  "mxfp4"     the expert input as MXFP4 rows (the dispatch's own rows when given: nothing quantized
              again) and the SwiGLU input as MXFP4; the wgrad operand of the input comes from
              ``ops.mxfp4_rows_to_fp8_cols`` (FP4RowToFP8Col), which needs the split lengths on the
              host in backward (its output shape depends on them): given as ``host_splits`` (a
              dispatch's counts) they cost nothing, else the backward reads them (one synchronisation);
  "fp8"       the input as FP8 (its columns, or the FP8 rows it came as) and the SwiGLU input as FP8 1x128;
  "bf16"      both in BF16;
  "recompute" the input as FP8 rows only; the gate/up GEMM runs again in backward.
The forward result does not depend on ``save``.

Layout: expert e owns the rows [split_offsets[e], split_offsets[e] + split_lens[e]) of x; rows of no
expert come out zero. The weight gradients contract the tokens in blocks of 128 counted from each
expert's first row, so every expert's rows must start on a multiple of 128 (a dispatch with
``expert_alignment=128``).
"""

from __future__ import annotations

import math

import torch

from moe_fp4 import formats, ops
from moe_fp4.formats._checks import describe
from moe_fp4.moe._triton_swiglu import swiglu as _swiglu
from moe_fp4.moe._triton_swiglu import swiglu_backward as _swiglu_backward
from moe_fp4.moe.grouped_gemm import group_bounds, grouped_gemm_fp8, grouped_gemm_fp8_wgrad

SAVE_POLICIES = ("mxfp4", "fp8", "bf16", "recompute")
ALIGN = formats.FP8_GROUP


def _fp8_tiles(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FP8 128x128 tiles of the stacked weights w [G, N, K] and of each w_g^T, in one pass: (data
    [G, N, K], scales [G, N/128, K/128], data_t [G, K, N], scales_t [G, K/128, N/128]). Each expert's
    transpose is contiguous: the dgrad GEMM (DeepGEMM's included) reads each tile row from one place."""
    data, scales, data_t = ops.quantize_fp8_tiles(w.detach())
    return data, scales, data_t, scales.transpose(1, 2).contiguous()


def _cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 columns of a BF16 [M, K]: (data [K, Mp], scales [K, Mp/128]), blocks from row 0."""
    return ops.quantize_fp8_rows_cols(x)[2:]


def _check_host_splits(host_splits, g: int) -> None:
    if not (isinstance(host_splits, (tuple, list)) and len(host_splits) == 2
            and all(isinstance(v, (list, tuple)) and len(v) == g and all(type(i) is int for i in v)
                    for v in host_splits)):
        raise ValueError(f"host_splits: expected (split_lens, split_offsets), two lists of {g} ints, got "
                         f"{repr(host_splits)[:120]}")


class _ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, offs, lens, weights, x_fp8, x_mxfp4, save, row_weights, host_splits):
        w1_8, w1_s, w1_t, w1_ts, w2_8, w2_s, w2_t, w2_ts = weights
        x_cols = None
        if x_fp8 is None:
            if save == "fp8":
                x8, xs, *x_cols = ops.quantize_fp8_rows_cols(x)
            else:
                x8, xs = ops.quantize_fp8_blockwise(x)
        else:
            x8, xs = x_fp8
        y1 = grouped_gemm_fp8(x8, xs, w1_8, w1_s, offs, lens, validate=False, tile_aligned=True)
        h = _swiglu(y1, row_weights)
        h8, hs = ops.quantize_fp8_blockwise(h)
        y = grouped_gemm_fp8(h8, hs, w2_8, w2_s, offs, lens, validate=False, tile_aligned=True)

        if save == "mxfp4":
            packed, scales = x_mxfp4 if x_mxfp4 is not None else ops.quantize_mxfp4(x)
            saved_x = (packed, scales)
            saved_y1 = ops.quantize_mxfp4(y1)
        elif save == "fp8":
            saved_x = tuple(x_cols) if x_cols is not None else (x8, xs)
            saved_y1 = ops.quantize_fp8_blockwise(y1)
        elif save == "bf16":
            saved_x = (x.to(torch.bfloat16),)
            saved_y1 = (y1,)
        else:
            saved_x = (x8, xs)
            saved_y1 = ()
        ctx.save_for_backward(offs, lens, row_weights, *weights, *saved_x, *saved_y1)
        ctx.layout = (len(saved_x), len(saved_y1), x_cols is not None)
        ctx.save, ctx.x_dtype, ctx.hidden = save, x.dtype, x.shape[1]
        ctx.host_splits = host_splits
        ctx.w_dtypes = (w1.dtype, w2.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        offs, lens, row_weights, w1_8, w1_s, w1_t, w1_ts, w2_8, w2_s, w2_t, w2_ts, *rest = ctx.saved_tensors
        n_x, n_y1, x_as_cols = ctx.layout
        saved_x, saved_y1 = rest[:n_x], rest[n_x:n_x + n_y1]
        save = ctx.save

        # the SwiGLU input, as the forward saw it (bf16, recompute) or through its saved format
        if save == "mxfp4":
            y1 = ops.dequantize_mxfp4(*saved_y1, torch.bfloat16)
        elif save == "fp8":
            y1 = formats.dequantize_fp8_blockwise(*saved_y1, dtype=torch.bfloat16)
        elif save == "bf16":
            y1 = saved_y1[0]
        else:
            y1 = grouped_gemm_fp8(saved_x[0], saved_x[1], w1_8, w1_s, offs, lens, validate=False,
                                  tile_aligned=True)

        dy8, dys, dy_t, dy_ts = ops.quantize_fp8_rows_cols(dy.to(torch.bfloat16))
        h_t, h_ts = _cols(_swiglu(y1, row_weights))
        dw2 = grouped_gemm_fp8_wgrad(dy_t, dy_ts, h_t, h_ts, offs, lens, out_dtype=ctx.w_dtypes[1], validate=False)
        dh = grouped_gemm_fp8(dy8, dys, w2_t, w2_ts, offs, lens, validate=False, tile_aligned=True)
        dy1, d_row_weights = _swiglu_backward(dh, y1, row_weights)
        del dh, y1
        d8, ds, d_t, d_ts = ops.quantize_fp8_rows_cols(dy1)
        dx = grouped_gemm_fp8(d8, ds, w1_t, w1_ts, offs, lens, validate=False, tile_aligned=True) \
            if ctx.needs_input_grad[0] else None

        # the wgrad operand of the input: its FP8 columns
        x_base = None
        if save == "mxfp4":
            # (splits from the host, when given: the op copies them over without waiting for the device)
            host = ctx.host_splits
            col_lens, col_offs = (lens, offs) if host is None else (torch.tensor(host[0]), torch.tensor(host[1]))
            x_t, x_ts, goff = ops.mxfp4_rows_to_fp8_cols(saved_x[0], saved_x[1], col_lens, col_offs)
            x_base = goff[:-1]
        elif save == "bf16":
            x_t, x_ts = _cols(saved_x[0])
        elif x_as_cols:
            x_t, x_ts = saved_x
        else:
            x_t, x_ts = _cols(formats.dequantize_fp8_blockwise(saved_x[0], saved_x[1], dtype=torch.bfloat16))
        dw1 = grouped_gemm_fp8_wgrad(d_t, d_ts, x_t, x_ts, offs, lens, b_scale_offsets=x_base,
                                     out_dtype=ctx.w_dtypes[0], validate=False)
        if dx is not None:
            dx = dx.to(ctx.x_dtype)
        return (dx, dw1, dw2, None, None, None, None, None, None, d_row_weights, None)


class Experts(torch.nn.Module):
    """G local SwiGLU experts: y[r] = (silu(x[r] @ gate_e^T) * (x[r] @ up_e^T)) @ down_e^T for the
    rows r of expert e, every product in FP8.

    num_experts (G), hidden (H), intermediate (I): H and I multiples of 128.
    save: what backward keeps ("mxfp4", "fp8", "bf16", "recompute"; module docstring).
    dtype: the master weights' dtype (bfloat16 or float32); their gradients come in it, computed
      in float32.
    Parameters: w1 [G, 2I, H] (rows [0, I) the gate, [I, 2I) the up projection), w2 [G, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, save: str = "mxfp4",
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        for name, v, mult in (("num_experts", num_experts, 1), ("hidden", hidden, ALIGN),
                              ("intermediate", intermediate, ALIGN)):
            if not isinstance(v, int) or v <= 0 or v % mult:
                raise ValueError(f"{name}: expected a positive int multiple of {mult}, got {v!r}")
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
        self.save = save
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.w1 = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device))
        self.w2 = torch.nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype, device=device))
        self._fp8_key = None
        self._fp8 = None
        self.reset_parameters()

    @property
    def save(self) -> str:
        return self._save

    @save.setter
    def save(self, value: str) -> None:
        if value not in SAVE_POLICIES:
            raise ValueError(f"save: expected one of {SAVE_POLICIES}, got {value!r}")
        self._save = value

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w1.normal_(0.0, 1.0 / math.sqrt(self.hidden))
            self.w2.normal_(0.0, 1.0 / math.sqrt(self.intermediate))

    def fp8_weights(self) -> tuple[torch.Tensor, ...]:
        """The FP8 tiles of w1 and w2 and their transposes (``_fp8_tiles``), remade only when a weight
        changed (its version counter: an optimizer step, a load)."""
        key = (self.w1._version, self.w1.data_ptr(), self.w2._version, self.w2.data_ptr(), self.w1.device)
        if self._fp8_key != key:
            # (the stale tiles go first, so the module never holds two versions; an autograd graph
            # not yet run backward keeps its own; the key too, should the making fail)
            self._fp8 = self._fp8_key = None
            self._fp8 = (*_fp8_tiles(self.w1), *_fp8_tiles(self.w2))
            self._fp8_key = key
        return self._fp8

    def forward(self, x: torch.Tensor, split_offsets: torch.Tensor, split_lens: torch.Tensor, *,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                x_mxfp4: tuple[torch.Tensor, torch.Tensor] | None = None, validate: bool = True,
                row_weights: torch.Tensor | None = None,
                host_splits: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """bfloat16 [M, H]: each expert's MLP on its rows of x (rows of no expert: zero).

        x: bfloat16/float32 [M, H], the expert rows (the gradient of the input flows to it);
        split_offsets, split_lens: int64 [G] on x's device, every offset a multiple of 128, each
          expert's rows at or after the previous expert's (a dispatch's expert-order layout);
        x_fp8: (float8_e4m3fn [M, H], float32 [M, H/128]), the FP8 1x128 of x when the caller has it
          (``DispatchOutput.to_fp8_blockwise()``): the GEMMs take it instead of quantizing x;
        x_mxfp4: (uint8 [M, H/2], uint8 [M, H/32]), the MXFP4 of x when the caller has it (the
          dispatch's rows, ``formats.unpack_mxfp4_rows``): what save="mxfp4" keeps;
        validate: check the splits on the host (one synchronisation); False for sync-free callers
          (invalid splits then give an unspecified result);
        row_weights: float32 [M], a weight per row applied to the SwiGLU output (before the down
          projection): the routing weights (``moe_fp4.ep.row_weights_with_grad``), differentiable;
        host_splits: (split_lens, split_offsets) as lists of G host ints, the same splits
          (``DispatchOutput.host_splits``): save="mxfp4"'s backward then needs no synchronisation.
          Checked against the device splits when validate is True; with validate False, host splits
          that differ give an unspecified result (the backward may read past the scales it made)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden \
                or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"x: expected a bfloat16/float32 tensor [M, {self.hidden}], got {describe(x)}")
        g = self.num_experts
        for name, t in (("split_offsets", split_offsets), ("split_lens", split_lens)):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32) \
                    or tuple(t.shape) != (g,) or t.device != x.device:
                raise ValueError(f"{name}: expected an int64 tensor [{g}] on {x.device}, "
                                 f"got {describe(t, device=True)}")
        m = x.shape[0]
        if x_fp8 is not None:
            _check_pair(x_fp8, "x_fp8", ((m, self.hidden), torch.float8_e4m3fn),
                        ((m, self.hidden // ALIGN), torch.float32), x.device)
        if x_mxfp4 is not None:
            _check_pair(x_mxfp4, "x_mxfp4", ((m, self.hidden // 2), torch.uint8),
                        ((m, self.hidden // 32), torch.uint8), x.device)
        if host_splits is not None:
            _check_host_splits(host_splits, g)
        if validate:  # (one host read of the splits: the GEMMs below then skip theirs)
            bounds = group_bounds(split_offsets, split_lens, m)
            if host_splits is not None:
                for e, ((o, end), c, ho) in enumerate(zip(bounds, *host_splits)):
                    if (c, ho) != (end - o, o):
                        raise ValueError(f"host_splits: expected the same splits as split_lens and split_offsets; "
                                         f"expert {e}: {c} rows at {ho} on the host, {end - o} at {o} on the device")
            for e, (o, end) in enumerate(bounds):
                if end > o and o % ALIGN:
                    raise ValueError(f"split_offsets: expert {e} starts at row {o}; every expert's rows must "
                                     f"start on a multiple of {ALIGN} (dispatch with expert_alignment={ALIGN})")
                if e and o < bounds[e - 1][1]:
                    raise ValueError(f"split_offsets: expert {e} starts at row {o}, before expert {e - 1} ends "
                                     f"(row {bounds[e - 1][1]}); experts' rows must follow in expert order")
        if row_weights is not None and (not isinstance(row_weights, torch.Tensor) or row_weights.dtype != torch.float32
                                        or tuple(row_weights.shape) != (m,) or row_weights.device != x.device):
            raise ValueError(f"row_weights: expected a float32 tensor [{m}] on {x.device}, "
                             f"got {describe(row_weights, device=True)}")
        return _ExpertsFunction.apply(x, self.w1, self.w2, split_offsets, split_lens, self.fp8_weights(), x_fp8,
                                      x_mxfp4, self.save, row_weights,
                                      None if host_splits is None else tuple(list(v) for v in host_splits))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"save={self.save!r}, dtype={self.w1.dtype}")


def _check_pair(pair, name, want_data, want_scales, device):
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2
    if ok:
        for t, (shape, dtype) in zip(pair, (want_data, want_scales)):
            ok = ok and isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype \
                and t.device == device
    if not ok:
        raise ValueError(f"{name}: expected ({want_data[1]} {want_data[0]}, {want_scales[1]} {want_scales[0]}) "
                         f"on {device}")


__all__ = ["SAVE_POLICIES", "Experts"]
