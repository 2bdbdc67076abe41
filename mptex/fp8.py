"""FP8 GEMMs for the MLP: per-tensor scaled E4M3/E5M2 operands, f32 accumulation, and the
scaling recipes that choose the scales.

Formats (OCP FP8, torch's dtypes): **E4M3** (``torch.float8_e4m3fn``: largest 448, smallest
normal 2^-6, smallest subnormal 2^-9, 3 fraction bits, no infinity) for the forward operands,
weights and activations; **E5M2** (``torch.float8_e5m2``: largest 57344, smallest subnormal
2^-16, 2 fraction bits) for the gradients: Transformer Engine's ``HYBRID`` format.

A tensor ``x`` is quantised with a per-tensor f32 ``scale``: ``q = fp8(x * scale)`` (one f32
multiply, one cast, round to nearest even), and it stands for ``q * scale_inv`` with
``scale_inv = 1 / scale`` (f32). A GEMM of two quantised operands is
``(q_a @ q_b) * (scale_inv_a * scale_inv_b)`` accumulated in f32: :func:`scaled_mm`.

Scale, as Transformer Engine computes it: ``scale = fp8_max / amax / 2**margin`` in f32, where
``amax`` is the largest ``|x|``; an ``amax`` of 0 or a non-finite scale keeps the previous
scale (1 at the start). The recipe says which ``amax``:

* ``current``: this tensor's own ``amax`` (Transformer Engine's ``Float8CurrentScaling``);
* ``rowwise``: one scale per row of each GEMM operand, from that row's own ``amax``
  (:func:`quantize_fp8_rowwise`, :func:`scaled_mm_rowwise`; section *Row-wise scaling* below);
* ``delayed``: the largest (``amax_compute_algo="max"``) or the most recent
  (``"most_recent"``) entry of the last ``amax_history_len`` amaxes seen before this call:
  Transformer Engine's ``DelayedScaling``, whose defaults (margin 0, ``fp8_format=HYBRID``,
  ``amax_history_len=1024``, ``amax_compute_algo="max"``) are :class:`ScalingRecipe`'s. One
  history entry per training forward of the layer (per backward for the gradient): the
  training loop evaluates the texture once per iteration, the points and the smoothness term's
  jittered copies together (``train.kd_smooth_joint``), so 1024 entries are 1024 iterations;
  with two evaluations per iteration, as nvdiffrec's, 512. Forwards without autograd
  (validation, export) use the scale and record nothing.

Overflow: a delayed scale can be too large for this call's tensor (``amax * scale > fp8_max``).
torch's casts do not agree on what then happens (torch 2.13 on a CPU saturates
``float8_e4m3fn`` at 448, infinity included; other builds return NaN; ``float8_e5m2`` rounds to
infinity), and none of it may reach the weights. So every call computes its own ``amax`` first
and, where the recipe's scale would overflow, quantises with ``fp8_max / amax`` instead (the
current scale) and counts an *overflow*. A non-finite ``amax`` (an inf or NaN in the tensor)
becomes NaN in the quantised tensor (an inf is multiplied by the scale 0), so the GEMM's result
is NaN and :class:`~mptex.PrecisionStepper` skips the step as it skips any non-finite
gradient; such an ``amax`` is counted (``nonfinite``) and not recorded in the history.
The other values of a tensor holding a NaN can still be out of range; mptex's casts (its C and
Triton kernels, and the eager code through a clamp first) saturate E4M3 at 448 on every torch
build, so the kernels and their eager twin give the same bits there too.

GEMM backends (:func:`scaled_mm`): on CUDA devices with FP8 tensor cores (compute capability
8.9 and later: Ada, Hopper, Blackwell) ``torch._scaled_mm``; everywhere else an emulation that
takes the same float8 tensors and scales, converts them to f32 (exact), multiplies in f32 and
applies ``scale_inv_a * scale_inv_b`` to the f32 result. Products of two FP8 values are exact
in f32 (at most 8 significant bits), so the two backends differ only in the order of the f32
accumulation (tested against a float64 reference in ``tests/test_fp8.py``; the GPU kit compares
them on a GPU). A third backend, ``triton`` (:mod:`mptex._fp8_mm_triton`), runs the same
GEMMs in Triton kernels written for the MLP's tall, thin shapes: the FP8 codes are read where
they lie through their strides and padded with masks, so no operand is copied or transposed
first (``torch._scaled_mm`` wants a row-major ``a``, a column-major ``b`` and K, N multiples of
16), the weight gradient's long reduction is split over the GPU in a deterministic order, and a
bias is added in the epilogue. It accumulates on the FP8 tensor cores too (compute capability
8.9 and later), and runs on a CPU under Triton's interpreter, where each code's float32 value is
multiplied in IEEE float32; ``auto`` does not choose it (it is selected by name, as
``texture.fp8_gemm``).

Row-wise scaling (recipe ``rowwise``): one scale per row of the activations and of the output
gradients and one per output channel of the weights, each the current scale of that row
(``fp8_max / amax_row / 2**margin``; a zero row keeps 1, and stays zero). It is the fine-grained
recipe of the DeepSeek-V3 report (section 3.3: 1x128 activation tiles, 128x128 weight blocks)
and of the OCP MX formats (one scale per 32 values) for a layer whose reduction is no longer than
a tile (mptex's hidden width is 32): a few large activations no longer set the scale of every
other row. The scales must sit on the indices a GEMM does not reduce over, so each operand is
quantised along the axis it is reduced over: in ``Y = X W^T`` rows of ``X`` and of ``W`` (output
channels); in ``dX = dY W`` rows of ``dY`` and columns of ``W`` (input channels); in
``dW = dY^T X`` columns of ``dY`` and of ``X`` (the batch is reduced). ``X``, ``W`` and ``dY``
are therefore each quantised twice, as Transformer Engine's MXFP8 recipe keeps a row-wise and a
column-wise copy.

:func:`scaled_mm_rowwise` is ``torch._scaled_mm`` with ``scale_a [M, 1]`` and ``scale_b
[1, N]`` float32 (CUDA, compute capability 8.9 and later; ``b`` must be E4M3, ``a`` E4M3 or
E5M2). torch's CUTLASS kernel for it (``aten/src/ATen/native/cuda/RowwiseScaledMM.cu``) applies
the scales to the float32 accumulator in its epilogue as ``scale_b[j] * (scale_a[i] * acc)``:
two float32 roundings, the row scale first, then casts to the output dtype (float32 here, which
it allows without a bias). For some shapes it runs the transposed product, where the order of the
two multiplications swaps; the two orders differ by at most one float32 rounding of the result.
The emulation sums the FP8 products in float64, where the sum is exact while every partial sum
fits 53 bits (always for E4M3 x E4M3 up to K = 2^16: the products are multiples of 2^-18 below
2^17.62; E5M2 x E4M3 products span 2^-25 to 2^24.62, so long sums of very different magnitudes can
round, at 2^-53 relative), rounds it once to float32 and then multiplies by ``scale_a[i]`` and by
``scale_b[j]`` in float32, in that order. The tensor core's own accumulation is not an exact sum,
so the two backends differ in the accumulator; the GPU kit measures by how much.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from mptex._backends import has_triton
from mptex._fp8_fused import RECIPE_CODES, fp8_quantize
from mptex._fp8_scaling import (
    _INF,
    E4M3,
    E5M2,
    FP8_MAX,
    _empty,
    fp8_scale,
    quantize_fp8,
    rowwise_amax,
)

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_MAX",
    "RECIPES",
    "AMAX_COMPUTE_ALGOS",
    "GEMM_BACKENDS",
    "ScalingRecipe",
    "ScalingState",
    "fp8_scale",
    "quantize_fp8",
    "dequantize_fp8",
    "has_fp8_tensor_cores",
    "resolve_gemm_backend",
    "triton_gemm_problem",
    "scaled_mm",
    "rowwise_amax",
    "quantize_fp8_rowwise",
    "scaled_mm_rowwise",
    "fp8_linear",
    "quantization_error",
    "rowwise_spread",
    "statistics",
]

RECIPES = ("delayed", "current", "rowwise")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
GEMM_BACKENDS = ("auto", "scaled_mm", "emulated", "triton")
# torch._scaled_mm's CUDA kernels take a row-major a [M, K] and a column-major b [K, N] with K
# and N multiples of 16 (torch's _scaled_mm_out_cuda checks mat1.size(1) and both sizes of
# mat2); a's rows need no padding: with K % 16 == 0 every row starts 16-byte aligned, and the
# row-wise CUTLASS kernel pads its row scales itself.
_SCALED_MM_ALIGN = 16
# Recorded calls whose statistics (overflows, non-finite amaxes) wait to be counted: counted
# together when read or when this many are waiting (one reduction instead of a few ops each).
_PENDING_CALLS = 256


@dataclass(frozen=True)
class ScalingRecipe:
    """How the per-tensor scales are chosen (module docstring).

    Args:
        recipe: ``"delayed"`` (an amax history, Transformer Engine's default recipe) or
            ``"current"`` (each tensor's own amax).
        margin: ``scale = fp8_max / amax / 2**margin`` (Transformer Engine: 0).
        amax_history_len: entries of the delayed recipe's history (Transformer Engine: 1024).
        amax_compute_algo: ``"max"`` of the history (Transformer Engine's default) or
            ``"most_recent"``.
    """

    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"


@torch.no_grad()
def quantization_error(original: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """``[2]`` f32: ``||q - x||_2 / ||x||_2`` (0 for a zero ``x``) and the fraction of the
    non-zero elements of ``x`` that became exactly 0 (underflow).

    The norms are taken in float64 (float32 on MPS, which has none): float32's own sums of
    squares overflow for values beyond ~1e19 (the ratio read inf / inf = NaN) and underflow to
    0 below ~1e-19 (the ratio read 0 whatever the error)."""
    wide = torch.float32 if original.device.type == "mps" else torch.float64
    x, q = original.detach().float(), quantized.detach().float()
    # The reductions cast inside themselves (dtype=): no widened copy of x, and no more ops
    # in the loop's statistics iterations than float32 reductions took (one cast at the end).
    norm = torch.linalg.vector_norm(x, dtype=wide)
    error = torch.linalg.vector_norm(q - x, dtype=wide)
    relative = torch.where(norm > 0, error / norm, torch.zeros_like(norm))
    nonzero = x != 0
    flushed = (nonzero & (q == 0)).sum(dtype=wide) / nonzero.sum(dtype=wide).clamp(min=1)
    return torch.stack([relative, flushed]).float()


@torch.no_grad()
def rowwise_spread(
    x: torch.Tensor, used: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[2]`` f32: what one scale per row bought over one scale per tensor for ``x``.

    ``[0]``: the spread of the row scales, ``log2(max / min)`` of ``used`` over the rows with a
    finite, non-zero ``amax`` (0 with fewer than two such rows): how many binades apart the rows
    sit. ``[1]``: the fraction of ``x``'s non-zero elements that would have become exactly 0 had
    the whole tensor been quantised with one current scale (``fp8_scale`` of the largest finite
    row ``amax``), the underflow the row scales avoided (compare ``underflow_frac``, the row-wise
    quantisation's own).

    Args:
        x: ``[M, K]`` the tensor that was quantised row-wise.
        used, amax: ``[M, 1]`` f32, :func:`quantize_fp8_rowwise`'s.
        dtype: :data:`E4M3` or :data:`E5M2`.
    """
    if not x.shape[0]:  # no rows: no spread, nothing flushed
        return torch.zeros(2, dtype=torch.float32, device=x.device)
    live = (amax > 0) & (amax < _INF)
    big = torch.where(live, used, torch.zeros_like(used)).amax()
    small = torch.where(live, used, torch.full_like(used, _INF)).amin()
    # log2(big) - log2(small): the quotient overflows float32 to inf for row scales more than
    # 128 binades apart (amaxes of 1e-26 and 1e16 in one tensor)
    spread = torch.where(live.sum() > 1, torch.log2(big) - torch.log2(small), torch.zeros_like(big))
    tensor_amax = torch.where(live, amax, torch.zeros_like(amax)).amax()
    q, scale_inv, _, _ = quantize_fp8(x, fp8_scale(tensor_amax, dtype), dtype, tensor_amax)
    flushed = quantization_error(x, dequantize_fp8(q, scale_inv))[1]
    return torch.stack([spread.float(), flushed])


def quantize_fp8_rowwise(
    x: torch.Tensor, dtype: torch.dtype, margin: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` in ``dtype`` with one current scale per row (module docstring, *Row-wise scaling*).

    Row ``i`` has ``scale_i = fp8_scale(amax_i)`` (``fp8_max / amax_i / 2**margin``, 1 where the
    row is zero or ``amax_i`` is not finite) and is quantised as :func:`quantize_fp8` quantises
    a tensor: ``q[i, k] = fp8(x[i, k] * used_i)``, one f32 multiply and one cast. A row holding an
    inf gets ``used_i = 0`` and turns into NaN (``inf * 0``), a row holding a NaN keeps it: the
    per-tensor arms' rule, per row.

    Args:
        x: ``[M, K]`` any float dtype (converted to f32 first).
        dtype: :data:`E4M3` or :data:`E5M2`.
        margin: integer >= 0.

    Returns:
        ``(q, scale_inv, amax, used)``: ``q`` ``[M, K]`` in ``dtype``; ``scale_inv = 1 / used``,
        ``amax`` and ``used``, each ``[M, 1]`` f32.
    """
    amax = rowwise_amax(x)
    return quantize_fp8(x, fp8_scale(amax, dtype, margin), dtype, amax)


def _rowwise_operand(
    x: torch.Tensor, dtype: torch.dtype, margin: int, q_dtype: torch.dtype, rowwise: bool = True,
    pad: int = 0,
):  # fmt: skip
    """``(q, scale_inv)`` of :func:`quantize_fp8_rowwise` (or, without ``rowwise``, of
    :func:`quantize_fp8` with :func:`fp8_scale` of ``x``'s amax: one current scale for the
    tensor), ``q`` in ``q_dtype`` (the FP8 dtype, or float32/float64 holding its values), as one
    ``mptex::fp8_quantize`` where it has a kernel: the recipes that read no scale or history.
    With ``pad`` (row-wise): ``q`` row-major, its rows zero-padded to a multiple of ``pad``."""
    empty = _empty(x.device)
    recipe = RECIPE_CODES["rowwise" if rowwise else "current"]
    q, scale_inv, *_ = fp8_quantize(x, empty, empty, int(dtype == E5M2), recipe, margin, False,
                                    False, q_dtype, pad)  # fmt: skip
    return q, scale_inv


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``q * scale_inv`` in f32 (what a quantised tensor stands for)."""
    return q.float() * scale_inv


class _Kept:
    """A quantisation kept for :attr:`ScalingState.reuse`: the op's ``outputs`` for ``tensor``
    and what recording derived from them (``derived``: the collected statistics), with what
    identifies the tensor's contents."""

    def __init__(self, tensor: torch.Tensor, form: tuple, outputs: tuple, derived: dict) -> None:
        self.tensor, self.form, self.outputs, self.derived = tensor, form, outputs, derived
        self.version, self.pointer = tensor._version, tensor.data_ptr()

    def serves(self, x: torch.Tensor, form: tuple) -> bool:
        """Whether ``x`` is the kept tensor itself, unchanged (same object, storage and version
        counter: not modified in place nor given new data since), quantised in the same
        ``form`` (the op's layout arguments)."""
        return (self.tensor is x and self.version == x._version
                and self.pointer == x.data_ptr() and self.form == form)  # fmt: skip


class _Count:
    """A float32 count of :class:`ScalingState` that includes the calls still waiting to be
    counted (``_pending``): reading or setting it counts them first."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, state, owner=None):
        if state is None:
            return self
        state._count_pending()
        return getattr(state, self.attr)

    def __set__(self, state, value: torch.Tensor) -> None:
        state._count_pending()
        setattr(state, self.attr, value)


class ScalingState:
    """The scale of one tensor role of one layer (input, weight or gradient) under a recipe,
    with its statistics; every value a device tensor (no host synchronisation).

    Attributes:
        scale: f32 scalar, the scale the next call uses (delayed recipe; 1.0 at the start).
        history: ``[amax_history_len]`` f32, most recent first (delayed recipe).
        last_amax, last_scale: the last call's ``amax`` and the scale it used.
        overflows: calls whose recipe scale would have overflowed (``amax * scale > fp8_max``)
            and used ``fp8_max / amax``.
        nonfinite: calls whose tensor held an inf or NaN.
        calls: recorded calls.
        last_error: with ``collect`` set, the last recorded call's
            :func:`~mptex.quantize.quantization_error` (relative error, underflow fraction).
        last_rowwise: ``rowwise`` recipe with ``collect`` set: the last recorded call's
            :func:`rowwise_spread` (row scales' spread in binades, underflow with one scale).
        collect: compute ``last_error`` on recorded calls (a few extra reductions; the
            precision monitor sets it on its sampled iterations).
        reuse: for a weight's state (:class:`~mptex.mlp.FP8Linear` sets it): under the
            ``current`` and ``rowwise`` recipes, whose quantisation is a function of the tensor
            alone, a recorded call on the very tensor of the previous recorded call, unchanged
            since (same object, storage and version counter), returns that call's outputs and
            records them again instead of quantising again: two training forwards per iteration
            (``train.kd_smooth_joint=false``) quantise each weight once. Counts and statistics
            are those of two calls.
            :meth:`end_reuse` (each backward through the layer) ends it; the ``delayed`` recipe,
            whose scale moves with every call, never reuses.
    """

    def __init__(self, dtype: torch.dtype, recipe: ScalingRecipe, device: torch.device | None):
        self.dtype, self.recipe = dtype, recipe
        zeros = dict(dtype=torch.float32, device=device)
        self.scale = torch.ones((), **zeros)
        self.history = torch.zeros(recipe.amax_history_len, **zeros)
        self.last_amax = torch.zeros((), **zeros)
        self.last_scale = torch.ones((), **zeros)
        # (amax, recipe scale, used scale) of recorded calls not yet counted (_count_pending).
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._overflows = torch.zeros((), **zeros)
        self._nonfinite = torch.zeros((), **zeros)
        self._calls = torch.zeros((), **zeros)
        self.last_error = torch.zeros(2, **zeros)
        self.last_rowwise = torch.zeros(2, **zeros)
        self.collect = False
        self.reuse = False
        self._reused: _Kept | None = None

    # (A state dict without last_rowwise, saved before it existed, loads: missing names keep
    # their initial values.)
    _TENSORS = (
        "scale", "history", "last_amax", "last_scale", "overflows", "nonfinite", "calls",
        "last_error", "last_rowwise",
    )  # fmt: skip

    def _count_pending(self) -> None:
        """Add the waiting calls to the counters: a call overflowed when its amax was finite
        and the scale it used is not the recipe's; it was non-finite when its amax was not."""
        if not self._pending:
            return
        with torch.no_grad():
            amax, scale, used = (torch.stack(c) for c in zip(*self._pending, strict=True))
            finite = amax < _INF  # amax >= 0 or NaN
            # float32 counts, as the old per-call "+= 1.0" (exact below 2**24 calls).
            self._overflows = self._overflows + (finite & (used != scale)).sum().float()
            self._nonfinite = self._nonfinite + (~finite).sum().float()
            self._calls = self._calls + float(len(self._pending))
        self._pending.clear()

    overflows = _Count("recorded calls whose recipe scale would have overflowed")
    nonfinite = _Count("recorded calls whose tensor held an inf or NaN")
    calls = _Count("recorded calls")

    def quantize(
        self, x: torch.Tensor, record: bool, q_dtype: torch.dtype | None = None, pad: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, scale_inv, used)`` of ``x`` under the recipe; with ``record`` the history, the
        next scale and the statistics are updated. For the ``rowwise`` recipe ``x`` is
        ``[M, K]`` and ``scale_inv``, ``used`` are ``[M, 1]`` (:func:`quantize_fp8_rowwise`);
        with ``pad`` (``x`` a ``[M, K]`` matrix) ``q`` is row-major, its rows zero-padded to a
        multiple of ``pad`` columns. ``q`` is in ``q_dtype``: the state's FP8 dtype (default),
        or float32 / float64 holding its values. One ``mptex::fp8_quantize`` op where it has a
        kernel (:mod:`mptex._fp8_fused`), else the same arithmetic in eager ops."""
        q, scale_inv, used, _, _ = self._quantize(x, record, q_dtype, pad, 0)
        return q, scale_inv, used

    def quantize_both(
        self, x: torch.Tensor, record: bool, pad: int, t_pad: int,
        q_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(q, q_t, scale_inv, t_scale_inv)`` of a ``[M, K]`` ``x``, recorded as
        :meth:`quantize` records, for the two GEMMs ``x`` enters, one reducing over its columns
        and one over its rows, from one quantisation op: ``q`` as :meth:`quantize` makes it
        (rows padded to a multiple of ``pad``) and ``q_t``, ``[K, M]`` row-major, its rows
        zero-padded to a multiple of ``t_pad``. Per tensor, ``q_t`` holds ``q``'s codes
        transposed and ``t_scale_inv`` is ``scale_inv``; row-wise, ``q_t`` is ``x.t()``
        quantised row-wise (one scale per column of ``x``, ``t_scale_inv`` ``[K, 1]``), not
        recorded. ``t_pad`` 0 (no second GEMM to serve): :meth:`quantize`'s call, ``q_t`` and
        ``t_scale_inv`` None."""
        q, scale_inv, _, q_t, t_scale_inv = self._quantize(x, record, q_dtype, pad, t_pad)
        if not t_pad:
            return q, None, scale_inv, None
        return q, q_t, scale_inv, t_scale_inv if t_scale_inv.numel() else scale_inv

    def _quantize(self, x, record, q_dtype, pad, t_pad):
        """:meth:`quantize` and :meth:`quantize_both`: ``(q, scale_inv, used, q_t,
        t_scale_inv)``."""
        recipe = self.recipe
        code = RECIPE_CODES[recipe.recipe]
        delayed_record = record and code == 0
        reusable = self.reuse and record and code != 0
        kept = self._reused if reusable else None
        form = (q_dtype, pad, t_pad)
        if kept is not None and kept.serves(x, form):
            outputs, memo = kept.outputs, kept.derived
        else:
            outputs = fp8_quantize(
                x, self.scale, self.history, int(self.dtype == E5M2), code, recipe.margin,
                recipe.amax_compute_algo == "most_recent", record, q_dtype or self.dtype, pad,
                t_pad,
            )  # fmt: skip
            memo = {}  # what recording derives from the outputs, kept with them when reusable
            if reusable:
                self._reused = _Kept(x, form, outputs, memo)
        q, scale_inv, amax, used, scale, history, q_t, t_scale_inv = outputs
        if not record:
            return q, scale_inv, used, q_t, t_scale_inv
        if code == 2:
            # The statistics are per tensor: the largest row amax and the smallest row scale,
            # which the op returns in place of a history (no reduction of its own here). A
            # row's scale differs from its recipe's only where its amax is inf (fp8_max /
            # amax_i is the recipe's scale itself wherever it is finite), so with every row
            # finite the smallest recipe scale is the smallest used one, and with a row that is
            # not, the call counts as non-finite, not as an overflow: the used scale stands for
            # both.
            smallest = history[1]
            self._record(history[0], smallest, smallest)
            if self.collect:
                if "collected" not in memo:
                    x = x.detach()
                    values = dequantize_fp8(q[:, : x.shape[1]], scale_inv)  # padding left out
                    memo["collected"] = (quantization_error(x, values),
                                         rowwise_spread(x, used, amax, self.dtype))  # fmt: skip
                self.last_error, self.last_rowwise = memo["collected"]
            return q, scale_inv, used, q_t, t_scale_inv
        self._record(amax, self.scale if code == 0 else used, used)
        if delayed_record:
            self.scale, self.history = scale, history
        if self.collect:
            if "collected" not in memo:
                values = q[:, : x.shape[1]] if pad else q  # padding left out
                memo["collected"] = quantization_error(x, dequantize_fp8(values, scale_inv))
            self.last_error = memo["collected"]
        return q, scale_inv, used, q_t, t_scale_inv

    def end_reuse(self) -> None:
        """Forget the forward's outputs kept for :attr:`reuse`; each backward through the layer
        calls it, as the next training forward comes after an optimizer step. (A backward takes
        what it needs of them from its forward's saved tensors.)"""
        self._reused = None

    def _record(self, amax: torch.Tensor, scale: torch.Tensor, used: torch.Tensor) -> None:
        # amax and used are new tensors that nothing writes to later: kept without copies. (No
        # torch.no_grad() here: a list append costs less than entering it, on every call;
        # _count_pending enters it when it computes.)
        self._pending.append((amax, scale, used))
        if len(self._pending) >= _PENDING_CALLS:
            self._count_pending()
        self.last_amax, self.last_scale = amax, used

    def snapshot(self) -> dict[str, Any]:
        """The state as it is now, for :meth:`restore`, without a copy on the device: every
        update of a :class:`ScalingState` makes new tensors and never writes to the ones it
        holds, so keeping the references keeps the values."""
        kept = dict(self.__dict__)
        kept["_pending"] = list(self._pending)
        return kept

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Back to a :meth:`snapshot`: what the calls since recorded is forgotten (a training
        loop that drops a queued forward and backward undoes their recording)."""
        self.__dict__.clear()
        self.__dict__.update(snapshot)
        self._pending = list(snapshot["_pending"])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).clone() for name in self._TENSORS}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._count_pending()
        self._reused = None
        for name in self._TENSORS:
            if name in state:
                old = getattr(self, name)
                value = state[name].to(device=old.device, dtype=old.dtype)
                if value.shape != old.shape:
                    raise ValueError(
                        f"state_dict: fp8 scaling state {name!r} has shape {list(value.shape)}, "
                        f"expected {list(old.shape)} (another amax_history_len?)"
                    )
                setattr(self, name, value)

    def to(self, device: torch.device) -> ScalingState:
        self._count_pending()
        self._reused = None
        for name in self._TENSORS:
            setattr(self, name, getattr(self, name).to(device))
        return self


def has_fp8_tensor_cores(device: torch.device | str, rowwise: bool = False) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on ``device``'s tensor cores: a CUDA device of
    compute capability 8.9 or later (Ada, Hopper, Blackwell) and a torch that has it.

    With ``rowwise``, whether its row-wise path returns float32 there (what
    :func:`scaled_mm_rowwise` asks for): torch sends row-wise scales to cuBLAS, which has a
    float32 result, on compute capability 9.x with CUDA 12.9 or later, and elsewhere to a
    CUTLASS kernel that returns bfloat16 only."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    capability = torch.cuda.get_device_capability(device)
    if not rowwise:
        return capability >= (8, 9)
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return capability[0] == 9 and cuda >= (12, 9)


@functools.cache
def _triton_gemm_problem(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why the ``triton`` GEMM backend cannot run on a device of this type and compute
    capability, or None."""
    from mptex._backends import backend_problem

    problem = backend_problem("triton")
    if problem is not None:
        return problem
    from mptex._fp8_mm_triton import INTERPRETED

    if INTERPRETED:
        return None if device_type == "cpu" else "Triton's interpreter runs CPU tensors only"
    if device_type != "cuda":
        return (f"{device_type} tensors need Triton's interpreter (TRITON_INTERPRET=1 before "
                "triton is first imported)")  # fmt: skip
    if capability < (8, 9):
        return f"compute capability {capability} has no FP8 tensor cores (8.9 or later)"
    return None


def triton_gemm_problem(device: torch.device | str) -> str | None:
    """Why :func:`scaled_mm`'s ``triton`` backend cannot run on ``device``, or None when it can:
    a CUDA device with FP8 tensor cores (compute capability 8.9 or later), or CPU tensors under
    Triton's interpreter."""
    device = torch.device(device)
    capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    elif device.type == "cuda":
        return "torch.cuda.is_available() is False"
    return _triton_gemm_problem(device.type, capability)


def resolve_gemm_backend(backend: str, device: torch.device | str, rowwise: bool = False) -> str:
    """``"scaled_mm"``, ``"emulated"`` or ``"triton"`` for ``backend`` (``"auto"``:
    ``scaled_mm`` where :func:`has_fp8_tensor_cores` for the GEMM's scaling, per tensor or
    ``rowwise``, else ``emulated``). ``ValueError`` for an unknown name, or ``scaled_mm`` or
    ``triton`` where it cannot run."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend: expected one of {GEMM_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "scaled_mm" if has_fp8_tensor_cores(device, rowwise) else "emulated"
    if backend == "triton":
        problem = triton_gemm_problem(device)
        if problem is not None:
            raise ValueError(f"backend: 'triton' cannot run on {device}: {problem}")
        return backend
    if backend == "scaled_mm" and not has_fp8_tensor_cores(device, rowwise):
        needs = ("compute capability 9.x and CUDA 12.9 or later for the row-wise path's "
                 "float32 result" if rowwise else "compute capability 8.9 or later")  # fmt: skip
        raise ValueError(
            f"backend: 'scaled_mm' needs a CUDA device with FP8 tensor cores ({needs}), "
            f"got {device}"
        )
    return backend


def _gemm_operand(x: torch.Tensor, rows: int, cols: int, column_major: bool) -> torch.Tensor:
    """``x`` zero-padded to ``[rows, cols]`` in the layout asked for: ``x`` itself where it is
    that already, else one copy (into zeros where it is padded: one Triton launch where Triton
    runs on ``x``'s device, :mod:`mptex._fp8_layout_triton`, else zeros and a copy)."""
    if x.shape == (rows, cols):
        if column_major:
            return x if x.t().is_contiguous() else x.t().contiguous().t()
        return x.contiguous()
    if _padded_copy_runs(x):
        from mptex._fp8_layout_triton import padded_copy

        return padded_copy(x, rows, cols, column_major)
    out = x.new_zeros((cols, rows) if column_major else (rows, cols))
    out = out.t() if column_major else out
    out[: x.shape[0], : x.shape[1]] = x
    return out


def _padded_copy_runs(x: torch.Tensor) -> bool:
    """Whether the padded copy's Triton kernel runs on ``x``: a one-byte (FP8) operand on
    CUDA with Triton, or on the CPU under Triton's interpreter (as the other Triton kernels'
    CPU counts are taken)."""
    if x.element_size() != 1 or not has_triton():
        return False
    if x.device.type == "cuda":
        return True
    return x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _round_up(n: int) -> int:
    return -(-max(n, 1) // _SCALED_MM_ALIGN) * _SCALED_MM_ALIGN


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_inv_a: torch.Tensor,
    scale_inv_b: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """``(a @ b) * (scale_inv_a * scale_inv_b)`` of FP8 matrices, f32 accumulation, f32 result.

    Args:
        a: ``[M, K]`` E4M3 or E5M2.
        b: ``[K, N]`` E4M3 or E5M2 (not both E5M2: the tensor cores have no E5M2 x E5M2).
        scale_inv_a, scale_inv_b: f32 scalars, what ``a`` and ``b`` are multiplied by.
        backend: ``"auto"``, ``"scaled_mm"`` (``torch._scaled_mm``; K and N padded with zeros
            to multiples of 16 and the operands laid out as cuBLASLt wants, ``b`` column-major),
            ``"emulated"`` (the operands in f32, ``torch.mm``, the scales applied after) or
            ``"triton"`` (:mod:`mptex._fp8_mm_triton`: any strides, no copies).

    Returns:
        ``[M, N]`` float32.
    """
    if a.dtype not in FP8_MAX or b.dtype not in FP8_MAX or a.dtype == b.dtype == E5M2:
        raise ValueError(
            f"a, b: expected E4M3/E5M2 operands (not both E5M2), got {a.dtype} and {b.dtype}"
        )
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"a, b: expected [M, K] and [K, N], got {list(a.shape)} and {list(b.shape)}"
        )
    resolved = resolve_gemm_backend(backend, a.device)
    if resolved == "emulated":
        return _emulated_mm(a.float(), b.float(), scale_inv_a, scale_inv_b)
    if resolved == "triton":
        return _triton_mm(a, b, scale_inv_a, scale_inv_b)
    return _scaled_mm_padded(a, b, scale_inv_a, scale_inv_b)


def _triton_mm(a, b, scale_a, scale_b, bias=None, rowwise=False) -> torch.Tensor:
    from mptex._fp8_mm_triton import fp8_mm_triton

    return fp8_mm_triton(a, b, scale_a, scale_b, bias, rowwise)


def _emulated_mm(a, b, scale_inv_a, scale_inv_b) -> torch.Tensor:
    """:func:`scaled_mm`'s emulation on the FP8 operands already converted to f32."""
    return torch.mm(a, b) * (scale_inv_a * scale_inv_b)


def _scaled_mm_padded(a, b, scale_a, scale_b, rowwise: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` on any shapes: ``a`` row-major and ``b`` column-major, K and N
    zero-padded to multiples of 16 (zero products add nothing to the sums; the padded columns
    are cut from the f32 result), each operand copied at most once. Scales per tensor, or with
    ``rowwise`` ``[M, 1]`` and ``[1, N]`` (the padded columns get the scale 1)."""
    (m, k), n = a.shape, b.shape[1]
    if m == 0:
        return a.new_zeros(0, n, dtype=torch.float32)
    kp, np_ = _round_up(k), _round_up(n)
    if rowwise and np_ != n:
        padded = torch.ones(1, np_, dtype=torch.float32, device=a.device)
        padded[:, :n] = scale_b
        scale_b = padded
    out = torch._scaled_mm(
        _gemm_operand(a, m, kp, column_major=False), _gemm_operand(b, kp, np_, column_major=True),
        scale_a=scale_a.float().contiguous(), scale_b=scale_b.float().contiguous(),
        out_dtype=torch.float32,
    )  # fmt: skip
    return out if np_ == n else out[:, :n]


def scaled_mm_rowwise(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """``out[i, j] = (acc[i, j] * scale_a[i]) * scale_b[j]`` with ``acc = a @ b`` of FP8
    matrices: row-wise scaled, f32 result (module docstring, *Row-wise scaling*).

    Args:
        a: ``[M, K]`` E4M3 or E5M2.
        b: ``[K, N]`` E4M3 (torch's row-wise kernel takes no E5M2 ``b``).
        scale_a: ``[M, 1]`` f32, what row ``i`` of ``a`` is multiplied by.
        scale_b: ``[1, N]`` f32, what column ``j`` of ``b`` is multiplied by.
        backend: ``"auto"`` (``scaled_mm`` where :func:`has_fp8_tensor_cores` with
            ``rowwise``), ``"scaled_mm"`` (``torch._scaled_mm``'s row-wise path, K and N padded
            with zeros and ``scale_b`` with ones to multiples of 16, ``b`` column-major),
            ``"emulated"`` (the products summed in float64, rounded once to f32, then
            ``* scale_a[i]`` and ``* scale_b[j]`` in f32, in that order: the CUTLASS epilogue's)
            or ``"triton"`` (:mod:`mptex._fp8_mm_triton`, the same epilogue).

    Returns:
        ``[M, N]`` float32.
    """
    if a.dtype not in FP8_MAX or b.dtype != E4M3:
        raise ValueError(
            f"a, b: expected an E4M3/E5M2 a and an E4M3 b, got {a.dtype} and {b.dtype}"
        )
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"a, b: expected [M, K] and [K, N], got {list(a.shape)} and {list(b.shape)}"
        )
    (m, _), n = a.shape, b.shape[1]
    if scale_a.shape != (m, 1) or scale_b.shape != (1, n):
        raise ValueError(
            f"scale_a, scale_b: expected [{m}, 1] and [1, {n}], got {list(scale_a.shape)} and "
            f"{list(scale_b.shape)}"
        )
    scale_a, scale_b = scale_a.float(), scale_b.float()
    resolved = resolve_gemm_backend(backend, a.device, rowwise=True)
    if resolved == "emulated":
        return _rowwise_emulated(a.double(), b.double(), scale_a, scale_b)
    if resolved == "triton":
        return _triton_mm(a, b, scale_a, scale_b, rowwise=True)
    return _scaled_mm_padded(a, b, scale_a, scale_b, rowwise=True)


def _rowwise_emulated(a, b, scale_a, scale_b) -> torch.Tensor:
    """:func:`scaled_mm_rowwise`'s emulation on the FP8 operands' values in float64: float64
    holds every FP8 product exactly and, for the sums here, every partial sum."""
    acc = torch.mm(a, b).float()
    return acc * scale_a * scale_b  # left to right: the row scale first


class _FP8RowwiseLinear(torch.autograd.Function):
    """The three GEMMs of a linear layer with row-wise scales, each operand quantised along
    the axis its GEMM reduces over (module docstring, *Row-wise scaling*). A tensor that
    enters two GEMMs is quantised both ways by one op call (``quantize_both``): the input and
    the weight in the forward (the backward keeps the column-wise copies), the output gradient
    in the backward. The emulation gets the operands' values in float64 from the quantisation
    itself (no conversion op), and quantises the input column-wise in the backward from the
    saved input instead (its float64 copy would take twice the float32 input's memory)."""

    @staticmethod
    def forward(ctx, x, weight, bias, states, backend, record):
        x_state, w_state, grad_state = states
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        resolved = resolve_gemm_backend(backend, x.device, rowwise=True)
        emulated = resolved == "emulated"
        q_dtype = torch.float64 if emulated else None
        # torch._scaled_mm takes both operands with the reduced dimension contiguous and a
        # multiple of 16: the operands come from the op laid out so, no copy.
        pad = _SCALED_MM_ALIGN if resolved == "scaled_mm" else 0
        t_pad = pad or 1
        # Column-wise copies where a backward needs them: X per input channel for dW (not in
        # the emulation: it keeps the input), W per input channel for dX.
        needs_x_grad, needs_w_grad = _backward_needs(ctx, record)
        x_t_pad = t_pad if needs_w_grad and not emulated else 0
        x_q, x_t, x_inv, x_t_inv = x_state.quantize_both(x2, record, pad, x_t_pad, q_dtype)
        w_t_pad = t_pad if needs_x_grad else 0
        w_q, w_t, w_inv, w_t_inv = w_state.quantize_both(weight, record, pad, w_t_pad, q_dtype)
        if resolved == "triton":  # the bias added in the GEMM's epilogue
            out = _triton_mm(x_q, w_q.t(), x_inv, w_inv.t(), bias, rowwise=True)
        else:
            out = _rowwise_gemm(x_q, w_q.t(), x_inv, w_inv.t(), resolved)
            if bias is not None:
                out = out + bias.float()
        keep_x = x2.detach() if needs_w_grad and emulated else None
        ctx.save_for_backward(x_t, x_t_inv, w_t, w_t_inv, keep_x)
        ctx.grad_state, ctx.w_state, ctx.resolved, ctx.shape = grad_state, w_state, resolved, shape
        ctx.margin, ctx.pads = x_state.recipe.margin, (pad, t_pad)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x_t, x_t_inv, w_t, w_t_inv, x2 = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        grad2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        emulated, (pad, t_pad) = ctx.resolved == "emulated", ctx.pads
        ctx.w_state.end_reuse()
        wide = torch.float64 if emulated else None
        needs_x_grad, needs_w_grad, needs_b_grad = ctx.needs_input_grad[:3]
        # dX = dY W reduces over the output channels: dY per sample, W per input channel (w_t).
        # dW = dY^T X reduces over the batch: dY per output channel, X per input channel (x_t).
        g_t_pad = t_pad if needs_w_grad else 0
        g_q, g_t, g_inv, g_t_inv = ctx.grad_state.quantize_both(grad2, True, pad, g_t_pad, wide)
        if needs_x_grad:
            grad_x = _rowwise_gemm(g_q, w_t.t(), g_inv, w_t_inv.t(), ctx.resolved)
            grad_x = grad_x.to(x_dtype).reshape(ctx.shape)
        if needs_w_grad:
            if x2 is not None:  # the emulation: X per input channel from the saved input
                x_t, x_t_inv = _rowwise_operand(x2.t(), E4M3, ctx.margin, wide, pad=t_pad)
            grad_w = _rowwise_gemm(g_t, x_t.t(), g_t_inv, x_t_inv.t(), ctx.resolved)
            grad_w = grad_w.to(w_dtype)
        if needs_b_grad:
            grad_b = grad2.float().sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _rowwise_gemm(a, b, scale_a, scale_b, resolved: str) -> torch.Tensor:
    """:func:`scaled_mm_rowwise` on a layer's own FP8 operands with the backend already
    resolved (no checks on the hot path), or its emulation on their float64 values."""
    if resolved == "triton":
        return _triton_mm(a, b, scale_a, scale_b, rowwise=True)
    if resolved == "emulated":
        return _rowwise_emulated(a, b, scale_a.float(), scale_b.float())
    return _scaled_mm_padded(a, b, scale_a.float(), scale_b.float(), rowwise=True)


# A per-tensor layer's GEMM on its own quantised operands, by resolved backend (the emulation's
# operands are the codes' float32 values, which the quantisation made).
_LAYER_GEMMS = {"emulated": _emulated_mm, "scaled_mm": _scaled_mm_padded, "triton": _triton_mm}


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, states, backend, record):
        x_state, w_state, grad_state = states
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # The emulation takes each FP8 operand's values in f32 (exact), made by the
        # quantisation itself, and keeps the forward's for the backward's GEMMs.
        resolved = resolve_gemm_backend(backend, x.device)
        emulated = resolved == "emulated"
        q_dtype = torch.float32 if emulated else None
        # On torch._scaled_mm, its layouts from the quantisation itself (rows padded to a
        # multiple of 16), and the transposes the backward's GEMMs take (x's for dW, the
        # weight's for dX) from the same op calls: the backward keeps them instead.
        pad = _SCALED_MM_ALIGN if resolved == "scaled_mm" else 0
        needs_x_grad, needs_w_grad = _backward_needs(ctx, record) if pad else (False, False)
        x_t_pad, w_t_pad = (pad if needs_w_grad else 0), (pad if needs_x_grad else 0)
        x_q, x_t, x_inv, _ = x_state.quantize_both(x2, record, pad, x_t_pad, q_dtype)
        w_q, w_t, w_inv, _ = w_state.quantize_both(weight, record, pad, w_t_pad, q_dtype)
        if resolved == "triton":  # the bias added in the GEMM's epilogue
            out = _triton_mm(x_q, w_q.t(), x_inv, w_inv, bias)
        else:
            # The layer's own quantised operands: scaled_mm's checks and backend resolution are
            # skipped (each costs the host a few µs per GEMM, six GEMMs per iteration here).
            out = _LAYER_GEMMS[resolved](x_q, w_q.t(), x_inv, w_inv)
            if bias is not None:
                out = out + bias.float()
        if pad:
            x_q, w_q = x_t, w_t  # no copy left: each operand is in its GEMM's layout
        ctx.save_for_backward(x_q, w_q, x_inv, w_inv)
        ctx.grad_state, ctx.w_state, ctx.shape = grad_state, w_state, shape
        ctx.resolved = resolved
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x_q, w_q, x_inv, w_inv = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        ctx.w_state.end_reuse()
        grad2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.resolved == "scaled_mm":
            return _scaled_mm_backward(ctx, grad2, x_q, w_q, x_inv, w_inv)
        emulated = ctx.resolved == "emulated"
        q_dtype = torch.float32 if emulated else None
        g_q, g_inv, _ = ctx.grad_state.quantize(grad2, True, q_dtype)
        gemm = _LAYER_GEMMS[ctx.resolved]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = gemm(g_q, w_q, g_inv, w_inv).to(x_dtype).reshape(ctx.shape)
        if ctx.needs_input_grad[1]:
            # The weight gradient's reduction runs over the batch: a [out, N] x [N, in] GEMM.
            # scaled_mm lays out (and pads) the transposed operand in its one copy, Triton reads
            # it through its strides; the emulation's mm takes it contiguous.
            g_t = g_q.t().contiguous() if emulated else g_q.t()
            grad_w = gemm(g_t, x_q, g_inv, x_inv).to(w_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad2.float().sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _backward_needs(ctx, record: bool) -> tuple[bool, bool]:
    """Whether a backward can follow that needs ``dL/dx``, and one that needs ``dL/dW``: the
    layer's forward makes the transposes those GEMMs take only then (``record`` is False in a
    forward under ``torch.no_grad()``, where ``ctx.needs_input_grad`` still says what requires
    grad)."""
    needs_x_grad, needs_w_grad = ctx.needs_input_grad[:2]
    return record and needs_x_grad, record and needs_w_grad


def _scaled_mm_backward(ctx, grad2, x_t, w_t, x_inv, w_inv):
    """:class:`_FP8Linear`'s backward on ``torch._scaled_mm`` from the forward's transposes:
    ``dY`` quantised once into both layouts, ``dX = dY W`` as ``dY [M, N] x (W^T)^T`` and
    ``dW = dY^T X`` as ``(dY^T) [N, M] x (X^T)^T``, each ``b`` the column-major view of a
    row-major transpose; the same zero-padded reductions, so the same sums, as the operands
    padded by copies."""
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    needs_x_grad, needs_w_grad, needs_b_grad = ctx.needs_input_grad[:3]
    grad_x = grad_w = grad_b = None
    pad = _SCALED_MM_ALIGN
    g_t_pad = pad if needs_w_grad else 0
    g_q, g_t, g_inv, _ = ctx.grad_state.quantize_both(grad2, True, pad, g_t_pad)
    if needs_x_grad:
        grad_x = _scaled_mm_padded(g_q, w_t.t(), g_inv, w_inv)
        grad_x = grad_x.to(x_dtype).reshape(ctx.shape)
    if needs_w_grad:
        grad_w = _scaled_mm_padded(g_t, x_t.t(), g_inv, x_inv).to(w_dtype)
    if needs_b_grad:
        grad_b = grad2.float().sum(0).to(b_dtype)
    return grad_x, grad_w, grad_b, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    states: tuple[ScalingState, ScalingState, ScalingState],
    backend: str = "auto",
) -> torch.Tensor:
    """``F.linear`` with FP8 GEMMs (Transformer Engine's ``HYBRID`` format).

    Forward: ``x`` and ``weight`` quantised to E4M3 with their states' scales, one
    :func:`scaled_mm`, f32 output (plus ``bias`` in f32). Backward: ``dL/dy`` quantised to E5M2
    with the gradient state's scale; ``dL/dx = g @ W`` and ``dL/dW = g^T @ x`` as E5M2 x E4M3
    :func:`scaled_mm` from the saved quantised operands, f32 accumulation, returned in ``x``'s
    and ``weight``'s dtypes (the f32 master weight gets an f32 gradient); ``dL/dbias`` in f32
    from the unquantised ``dL/dy``.

    With the ``rowwise`` recipe (the states' recipe) every GEMM is a :func:`scaled_mm_rowwise`
    with scales per non-reduced index (module docstring, *Row-wise scaling*); the gradient
    state sees ``dL/dy`` per sample, as it enters ``dL/dx``.

    Args:
        x: ``[..., in]`` any float dtype.
        weight: ``[out, in]`` (the f32 master).
        bias: ``[out]`` or None.
        states: the :class:`ScalingState` of the input, the weight and the output gradient.
        backend: :func:`scaled_mm`'s.

    Returns:
        ``[..., out]`` float32.
    """
    # Only training forwards (autograd recording) move the delayed recipe's history.
    record = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if states[0].recipe.recipe == "rowwise":
        return _FP8RowwiseLinear.apply(x, weight, bias, states, backend, record)
    return _FP8Linear.apply(x, weight, bias, states, backend, record)


def statistics(state: ScalingState) -> dict[str, torch.Tensor]:
    """The state's statistics as device scalars: ``amax``, ``scale`` (the last call's),
    ``overflows``, ``nonfinite`` (counts so far) and, where collected, ``rel_error`` and
    ``underflow_frac`` (the last collected call's), for the ``rowwise`` recipe also
    ``scale_spread`` and ``tensor_underflow_frac`` (:func:`rowwise_spread`)."""
    stats = {
        "amax": state.last_amax,
        "scale": state.last_scale,
        "overflows": state.overflows,
        "nonfinite": state.nonfinite,
    }
    if state.collect:
        stats.update(rel_error=state.last_error[0], underflow_frac=state.last_error[1])
        if state.recipe.recipe == "rowwise":
            stats.update(scale_spread=state.last_rowwise[0],
                         tensor_underflow_frac=state.last_rowwise[1])  # fmt: skip
    return stats
