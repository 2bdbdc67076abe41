"""One op for an FP8 quantisation: amax, scale, cast and the delayed recipe's history update.

:class:`mptex.fp8.ScalingState` quantises a tensor with the scale its recipe chooses (module
docstring of :mod:`mptex.fp8`). Written with eager PyTorch ops that is ~15 ops per tensor for
the delayed recipe (the amax, the scale's test and fallback, the multiply, the cast, the
reciprocal, the history's shift, its reduction and the next scale), each a kernel launch on a
GPU and a pass or a dispatch on a CPU; an FP8 iteration of the texture quantises 18 tensors. The
op ``mptex::fp8_quantize`` does it in one call:

* CPU: a C loop (:mod:`mptex._native_cpu`): one pass for the amax, one for the cast;
* CUDA: two Triton kernels (:mod:`mptex._fp8_triton`): block amaxes, then the scale (every
  block computes it from them) and the cast, the first block also writing the scalars and the
  history; the padded and transposed layouts below come from the cast's own stores.

:func:`fp8_quantize_reference` is its twin in eager PyTorch (the functions of
:mod:`mptex._fp8_scaling`, the arithmetic the op must reproduce bit for bit;
``tests/test_fp8_fused.py`` compares them), and it runs where neither kernel can (no C
compiler, ``MPTEX_NATIVE=0``, another device or dtype).

Arguments (the op's and the twin's):

* ``x``: float32, the tensor to quantise; ``[M, K]`` (any strides) for the row-wise recipe.
* ``scale``: f32 scalar, the delayed recipe's scale (ignored by the others).
* ``history``: ``[H]`` f32, the delayed recipe's amax history, most recent first.
* ``fp8_format``: 0 E4M3, 1 E5M2.
* ``recipe``: 0 delayed, 1 current, 2 row-wise (:data:`RECIPE_CODES`).
* ``margin``: ``scale = fp8_max / amax / 2**margin``.
* ``most_recent``: the delayed recipe reduces its history to its first entry instead of its max.
* ``record``: the delayed recipe updates its history and computes the next scale; the row-wise
  recipe returns its per-tensor statistics.
* ``q_dtype``: the quantised tensor's dtype: the FP8 format's own, or float32 / float64 holding
  the same values (what an emulated GEMM converts the FP8 operand to, without a conversion op).
* ``q_pad`` (default 0): ``x`` a ``[M, K]`` matrix: q row-major with its rows padded with zeros
  to a multiple of ``q_pad`` columns, the layout ``torch._scaled_mm`` takes an operand in (its
  reduced dimension a multiple of 16, contiguous), so that a GEMM needs no copy of it.
* ``t_pad`` (default 0): ``x`` a ``[M, K]`` matrix: the op also returns ``x``'s transpose
  quantised, row-major, its rows padded with zeros to a multiple of ``t_pad`` columns (1: not
  padded): the operand of a GEMM that reduces over ``x``'s rows (a weight gradient's, which
  reduces over the batch), in ``torch._scaled_mm``'s layout. Per tensor it has the same scale,
  so its codes are those of ``q``; row-wise it is quantised row-wise itself (one scale per
  column of ``x``, the scales a GEMM reducing over the rows needs), as a call on ``x.t()``
  that does not record would. Either way one call serves both GEMMs the tensor enters.

Returns ``(q, scale_inv, amax, used, next_scale, next_history, q_t, t_scale_inv)``:

* ``q``: ``fp8(x * used)`` in ``q_dtype``, laid out as ``x`` (``torch.empty_like``), or with
  ``q_pad`` ``[M, K rounded up to a multiple of q_pad]`` row-major, the added columns zero;
* ``scale_inv = 1 / used``, ``amax`` (largest ``|x|``, NaN if ``x`` holds one), ``used`` (the
  scale the cast used): f32 scalars, ``[M, 1]`` for the row-wise recipe;
* ``next_scale``: delayed: the next call's scale when recording, else ``scale``; current:
  ``used``; row-wise: ``[M, 1]`` each row's recipe scale (``fp8_scale`` of its amax);
* ``next_history``: delayed and recording: ``[H]``, the history after this call; row-wise and
  recording: ``[2]``, the call's per-tensor statistics, the largest row ``amax`` (NaN if a row's
  is NaN) and the smallest ``used`` (``(0, 1)`` for a matrix without rows, as for a zero
  tensor), so that recording a call takes no reduction of its own; else ``[0]``;
* ``q_t``: with ``t_pad``, ``[K, M rounded up to a multiple of t_pad]`` row-major in
  ``q_dtype``, the added columns zero (per tensor ``q_t[k, m] = q[m, k]``); else empty;
* ``t_scale_inv``: row-wise with ``t_pad``, ``[K, 1]`` f32, the transpose's rows'
  ``scale_inv``; else empty (per tensor the transpose's is ``scale_inv``).
"""

from __future__ import annotations

import torch

from mptex import _fp8_scaling as _fp8
from mptex._backends import has_triton
from mptex._fp8_scaling import _Q_KINDS, _check, _outputs, _q_cols, _rowwise_statistics
from mptex._native_cpu import _ptr, native_kernels

__all__ = ["RECIPE_CODES", "fp8_quantize_reference", "fp8_quantize", "op_available"]

RECIPE_CODES = {"delayed": 0, "current": 1, "rowwise": 2}


def fp8_quantize_reference(
    x: torch.Tensor,
    scale: torch.Tensor,
    history: torch.Tensor,
    fp8_format: int,
    recipe: int,
    margin: int,
    most_recent: bool,
    record: bool,
    q_dtype: torch.dtype,
    q_pad: int = 0,
    t_pad: int = 0,
) -> tuple[torch.Tensor, ...]:
    """The op in eager PyTorch (module docstring): the arithmetic of :mod:`mptex.fp8`. Its
    outputs may be its inputs (``next_scale`` is ``scale`` where the delayed recipe does not
    record)."""
    dtype = _check(x, fp8_format, recipe, q_dtype, q_pad, t_pad)
    x = x.detach().float()
    empty = x.new_empty(0)
    if recipe == 2:
        amax = _fp8.rowwise_amax(x)
        row_scale = _fp8.fp8_scale(amax, dtype, margin)
        q, scale_inv, amax, used = _fp8.quantize_fp8(x, row_scale, dtype, amax)
        statistics = _rowwise_statistics(amax, used) if record else empty
        q, q_t = _laid_out(q.to(q_dtype), q_pad, 0)
        t_scale_inv = empty
        if t_pad:  # x.t() quantised row-wise, as its own call that does not record
            t_args = (scale, history, fp8_format, 2, margin, False, False, q_dtype, t_pad)
            q_t, t_scale_inv = fp8_quantize_reference(x.t(), *t_args)[:2]
        return q, scale_inv, amax, used, row_scale, statistics, q_t, t_scale_inv
    amax = _fp8._amax(x)
    if recipe == 1:
        used = _fp8.current_scale(amax, dtype, margin)
        q, scale_inv, amax, used = _fp8._cast(x, used, dtype, amax)
        next_scale, next_history = used, empty
    else:
        q, scale_inv, amax, used = _fp8.quantize_fp8(x, scale, dtype, amax)
        next_scale, next_history = scale, empty
        if record:
            next_scale, next_history = _fp8.delayed_update(amax, scale, history, dtype, margin,
                                                           most_recent)  # fmt: skip
    q, q_t = _laid_out(q.to(q_dtype), q_pad, t_pad)
    return q, scale_inv, amax, used, next_scale, next_history, q_t, empty


def _padded(q: torch.Tensor, pad: int) -> torch.Tensor:
    """``q`` row-major, zero columns up to a multiple of ``pad`` (a copy)."""
    padded = q.new_zeros(q.shape[0], _q_cols(q.shape[1], pad))
    padded[:, : q.shape[1]] = q
    return padded


def _laid_out(q: torch.Tensor, q_pad: int, t_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, q_t)`` from the quantised tensor: ``q`` padded with ``q_pad``, its transpose with
    ``t_pad`` (empty without it)."""
    padded = _padded(q, q_pad) if q_pad else q
    return padded, (_padded(q.t(), t_pad) if t_pad else q.new_empty(0))


# The op is defined with torch.library's low-level registration (a schema, then a kernel per
# dispatch key) rather than ``torch.library.custom_op``, which wraps every call in Python layers
# (an autograd wrapper, a redispatch, a dynamo guard): 26-31 us per call in the training loop
# on a CPU, and an FP8 iteration makes up to 36 calls, all on the host's critical path on a GPU
# (docs/benchmarks.md, "Training-loop overhead").
_LIB = torch.library.Library("mptex", "DEF")
_LIB.define(
    "fp8_quantize(Tensor x, Tensor scale, Tensor history, int fp8_format, int recipe, "
    "int margin, bool most_recent, bool record, ScalarType q_dtype, int q_pad=0, int t_pad=0) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _twin(*args) -> tuple[torch.Tensor, ...]:
    """The op's value on a device without a kernel: the twin's outputs, copied (an op returns
    none of its inputs)."""
    return tuple(t.clone() for t in fp8_quantize_reference(*args))


def _cpu(x, scale, history, fp8_format, recipe, margin, most_recent, record, q_dtype, q_pad=0,
         t_pad=0):  # fmt: skip
    lib = native_kernels()
    dtype = _check(x, fp8_format, recipe, q_dtype, q_pad, t_pad)
    args = (x, scale, history, fp8_format, recipe, margin, most_recent, record, q_dtype, q_pad,
            t_pad)  # fmt: skip
    if lib is None or x.dtype != torch.float32 or (recipe != 2 and not x.is_contiguous()):
        return _twin(*args)
    # The per-tensor arm writes q as x lies; its padded and transposed layouts are copies here
    # (a CPU's GEMMs take any layout: these layouts serve a GPU's torch._scaled_mm).
    laid_out = recipe != 2 and (q_pad or t_pad)
    outputs = _outputs(x, history, recipe, record, q_dtype, 0 if laid_out else q_pad)
    q, (scale_inv, amax, used, next_scale), next_history, q_t, t_scale_inv = outputs
    if recipe == 2:
        rows, cols = x.shape
        stride_r, stride_c = x.stride()
        q_stride_r, q_stride_c = q.stride()
        if q.shape[1] > cols:
            q[:, cols:] = 0  # the padding (the C kernel writes the first cols)
    else:
        rows, cols, stride_r, stride_c = 1, x.numel(), 0, 1
        q_stride_r, q_stride_c = 0, 1
    scale = scale.detach().float().contiguous()
    history = history.detach().float().contiguous()
    status = lib.mptex_fp8_quantize(
        _ptr(x), rows, cols, stride_r, stride_c, fp8_format, recipe, margin, int(most_recent),
        int(record), _ptr(scale), _ptr(history), history.numel() if recipe == 0 and record else 0,
        _ptr(q), _Q_KINDS.get(q_dtype, 0), q_stride_r, q_stride_c,
        _ptr(scale_inv), _ptr(amax), _ptr(used), _ptr(next_scale), _ptr(next_history),
    )  # fmt: skip
    if status:
        raise ValueError(f"x: the C kernel takes one row for a per-tensor recipe, got {rows}")
    if q_dtype not in _Q_KINDS:
        q, q_t = q.view(dtype), q_t.view(dtype)
    if laid_out:
        q, q_t = _laid_out(q.view(x.shape), q_pad, t_pad)
    if recipe == 2 and t_pad:  # x.t() quantised row-wise, as its own call that does not record
        t_args = (scale, history, fp8_format, 2, margin, False, False, q_dtype, t_pad)
        q_t, t_scale_inv = _cpu(x.t(), *t_args)[:2]
    return q, scale_inv, amax, used, next_scale, next_history, q_t, t_scale_inv


def _cuda(x, scale, history, fp8_format, recipe, margin, most_recent, record, q_dtype, q_pad=0,
          t_pad=0):  # fmt: skip
    _check(x, fp8_format, recipe, q_dtype, q_pad, t_pad)
    args = (x, scale, history, fp8_format, recipe, margin, most_recent, record, q_dtype, q_pad,
            t_pad)  # fmt: skip
    if not has_triton() or x.dtype != torch.float32:
        return _twin(*args)
    from mptex._fp8_triton import fp8_quantize_triton

    return fp8_quantize_triton(*args)


def _fake(x, scale, history, fp8_format, recipe, margin, most_recent, record, q_dtype, q_pad=0,
          t_pad=0):  # fmt: skip
    outputs = _outputs(x, history, recipe, record, q_dtype, q_pad, t_pad)
    q, scalars, next_history, q_t, t_scale_inv = outputs
    if q_dtype not in _Q_KINDS:
        q, q_t = q.view(q_dtype), q_t.view(q_dtype)
    return (q, *scalars, next_history, q_t, t_scale_inv)


# The twin on any device without a kernel of its own; the C kernel on the CPU; Triton on CUDA.
_LIB.impl("fp8_quantize", _twin, "CompositeExplicitAutograd")
_LIB.impl("fp8_quantize", _cpu, "CPU")
_LIB.impl("fp8_quantize", _cuda, "CUDA")
torch.library.register_fake("mptex::fp8_quantize", _fake, lib=_LIB)


def op_available(x: torch.Tensor) -> bool:
    """Whether ``mptex::fp8_quantize`` has a kernel for ``x`` (float32 on the CPU with the C
    kernel built, or on CUDA with Triton); else :func:`fp8_quantize` runs the twin."""
    if x.dtype != torch.float32:
        return False
    if x.device.type == "cpu":
        return native_kernels() is not None
    return x.device.type == "cuda" and has_triton()


def fp8_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    history: torch.Tensor,
    fp8_format: int,
    recipe: int,
    margin: int,
    most_recent: bool,
    record: bool,
    q_dtype: torch.dtype,
    q_pad: int = 0,
    t_pad: int = 0,
) -> tuple[torch.Tensor, ...]:
    """The quantisation (module docstring): the op where it has a kernel for ``x``, else
    :func:`fp8_quantize_reference`; the same values either way."""
    x = x.detach()
    args = (x, scale, history, fp8_format, recipe, margin, most_recent, record, q_dtype, q_pad,
            t_pad)  # fmt: skip
    if op_available(x) and (recipe == 2 or x.is_contiguous()):
        return torch.ops.mptex.fp8_quantize(*args)
    return fp8_quantize_reference(*args)
