"""The arithmetic of an FP8 quantisation: the formats, the scale each recipe computes and the
cast (:mod:`mptex.fp8`'s module docstring states the rules; :mod:`mptex.fp8` re-exports the
public names).

Every function is eager PyTorch on device tensors (no host synchronisation) and is the reference
the fused op :mod:`mptex._fp8_fused` reproduces bit for bit.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_MAX",
    "fp8_scale",
    "current_scale",
    "delayed_update",
    "quantize_fp8",
    "rowwise_amax",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_INF = float("inf")


@functools.lru_cache(maxsize=64)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A float32 scalar tensor on ``device``, made once: an operand broadcast in an op costs no
    op of its own, as ``full_like``/``ones_like`` would (never written to)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=16)
def _empty(device: torch.device) -> torch.Tensor:
    """A float32 tensor of no elements on ``device``, made once: the scale and history of a
    quantisation that reads neither, without an allocation op per call (nothing can be written
    to it)."""
    return torch.empty(0, dtype=torch.float32, device=device)


def fp8_scale(
    amax: torch.Tensor, dtype: torch.dtype, margin: int = 0, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """Transformer Engine's scale: ``fp8_max(dtype) / amax / 2**margin`` in f32.

    Where ``amax`` is 0 or the scale is not finite (an ``amax`` of inf or NaN, or so small
    that the quotient overflows), ``previous`` is kept (default 1.0).

    Args:
        amax: f32 tensor (any shape) of largest magnitudes.
        dtype: :data:`E4M3` or :data:`E5M2`.
        margin: integer >= 0.
        previous: the scale to keep, broadcastable to ``amax`` (default 1.0).

    Returns:
        f32 tensor of ``amax``'s shape.
    """
    amax = amax.float()
    unscaled = _fp8_max_over(amax, dtype)
    # amax > 0, amax < inf and a finite scale, as comparisons of the unscaled quotient (3 ops
    # instead of 5): 448 / amax is > 0 and finite exactly where amax is positive and finite
    # and the quotient does not overflow (0 for an inf amax, inf for 0 or a tiny one, NaN for
    # NaN, negative for a negative amax or -0); the division by 2**margin keeps it finite.
    usable = (unscaled > 0) & (unscaled < _INF)
    scale = _with_margin(unscaled, margin)
    keep = _constant(1.0, amax.device) if previous is None else previous.float()
    return torch.where(usable, scale, keep.expand_as(amax))


def _fp8_max_over(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_max(dtype) / amax``, f32, one correctly rounded division (one op).

    Two f32 roundings in all, as Transformer Engine's kernel (the division by 2**margin is exact
    unless it reaches f32's subnormals; by 2**0 it is the identity, so it is left out).
    torch.div of two tensors: one correctly rounded f32 division. (``448.0 / amax`` is
    ``amax.reciprocal() * 448`` in torch, two roundings: one ulp off for about a quarter of
    amaxes.) The numerator is a cached scalar tensor, broadcast."""
    return torch.div(_constant(FP8_MAX[dtype], amax.device), amax)


def _with_margin(unscaled: torch.Tensor, margin: int) -> torch.Tensor:
    """``unscaled / 2**margin`` (no op for margin 0, where it is the identity)."""
    return unscaled / float(2**margin) if margin else unscaled


def current_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The scale :func:`quantize_fp8` uses with the current recipe's scale, ``fp8_scale(amax)``,
    for an ``amax`` >= 0 or NaN (a max-norm), in 3 ops.

    ``s = fp8_max / amax``, used where ``s < inf`` (divided by ``2**margin``), else 1.
    ``fp8_scale`` gives the same where ``amax`` is finite and ``s`` is, and keeps 1 where
    ``amax`` is 0, tiny (``s`` inf) or NaN, as here; there ``amax * 1 > fp8_max`` is false, so
    ``quantize_fp8`` keeps 1 too. With a finite ``s`` it never overflows: ``amax * s`` is
    ``fp8_max`` within a rounding (``fp8_max / 2**margin`` with a margin), and where it rounds
    above ``fp8_max`` the fallback ``fp8_max / amax`` is ``s`` itself. An inf ``amax`` gives
    ``s = 0``, used as such: ``fp8_scale`` keeps 1 there and ``quantize_fp8`` falls back to
    ``fp8_max / inf = 0``. So the recipe's scale differs from the one used only where ``amax``
    is inf, which the overflow count leaves out (:meth:`ScalingState._count_pending`): ``used``
    stands for both.

    Args:
        amax: f32 scalar, >= 0 or NaN.
        dtype: :data:`E4M3` or :data:`E5M2`.
        margin: integer >= 0.
    """
    unscaled = _fp8_max_over(amax, dtype)
    scale = _with_margin(unscaled, margin)
    return torch.where(unscaled < _INF, scale, _constant(1.0, amax.device))


@torch.no_grad()
def delayed_update(
    amax: torch.Tensor,
    scale: torch.Tensor,
    history: torch.Tensor,
    dtype: torch.dtype,
    margin: int = 0,
    most_recent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delayed recipe after a call whose tensor had ``amax``: ``(next scale, history)``.

    The history keeps finite amaxes only (a skipped step's inf must not pin the scale for
    ``amax_history_len`` calls): ``[amax, history[:-1]]`` where ``amax`` is finite, else
    ``history``. The next scale is ``fp8_scale`` of the history's max (its first entry with
    ``most_recent``), keeping ``scale`` where that is not finite, in 3 ops: the history holds
    finite amaxes >= 0 only, where ``fp8_scale``'s test is that of a finite quotient (it is 0
    only for an inf amax; 0 and tiny amaxes give inf).

    Args:
        amax: f32 scalar, >= 0 or NaN or inf.
        scale: f32 scalar, the scale this call's recipe chose.
        history: ``[H]`` f32, most recent first.
        dtype: :data:`E4M3` or :data:`E5M2`.
        margin: integer >= 0.
        most_recent: reduce the history to its first entry instead of its max.
    """
    finite = amax < _INF  # amax >= 0 or NaN
    shifted = torch.cat([amax.reshape(1), history[:-1]])
    history = torch.where(finite, shifted, history)
    reduced = history[0] if most_recent else history.amax()
    unscaled = _fp8_max_over(reduced, dtype)
    return torch.where(unscaled < _INF, _with_margin(unscaled, margin), scale), history


def quantize_fp8(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` in ``dtype`` with a per-tensor scale, never overflowing.

    Args:
        x: any shape, any float dtype (converted to f32 first: exact from f16/bf16).
        scale: f32 scalar tensor, the recipe's scale (> 0).
        dtype: :data:`E4M3` or :data:`E5M2`.
        amax: ``x``'s largest magnitude when already computed (f32 scalar).

    Returns:
        ``(q, scale_inv, amax, used)``: ``q`` in ``dtype`` (``fp8(x * used)``), the f32
        ``scale_inv = 1 / used`` that ``q`` is multiplied by, ``x``'s f32 ``amax`` and the scale
        ``used``: ``scale`` unless ``amax * scale > fp8_max``, then ``fp8_max / amax`` (an
        overflow avoided; 0 when ``amax`` is inf, which turns the infs into NaN). All scalars
        stay on ``x``'s device: no host synchronisation.
    """
    x = x.float()
    if amax is None:
        amax = _amax(x)
    current = _fp8_max_over(amax, dtype)  # fp8_scale's quotient, one rounding
    used = torch.where(amax * scale > FP8_MAX[dtype], current, scale.float())
    return _cast(x, used, dtype, amax)


def _cast(
    x: torch.Tensor, used: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8`'s result for the scale ``used`` (``x`` f32)."""
    q = _to_fp8(x * used, dtype)
    return q, torch.reciprocal(used), amax, used


def _to_fp8(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` (f32) cast to ``dtype``, rounding to nearest even; E4M3 saturates at +-448,
    infinities included, E5M2 overflows to infinity, a NaN stays NaN.

    What mptex's quantisation kernels (the C kernel, the Triton kernels) do. torch's own cast
    to ``float8_e4m3fn`` saturates from torch 2.13 on and returns NaN past 464 before (torch
    2.11, the GPU machines' build), so the E4M3 values are clamped first: the same bits under
    every torch. Only a tensor (a row, row-wise) holding a NaN gets this far out of range: its
    NaN amax does not bound the scale used."""
    if dtype == E4M3:
        y = torch.clamp(y, -FP8_MAX[E4M3], FP8_MAX[E4M3])  # a NaN passes through
    return y.to(dtype)


def _amax(x: torch.Tensor) -> torch.Tensor:
    # The infinity norm is max |x| in one reduction (the same value: the max is exact; NaN
    # propagates), where abs().amax() is two.
    if not x.numel():
        return x.new_zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(x.detach(), _INF).float()


def rowwise_amax(x: torch.Tensor) -> torch.Tensor:
    """``[M, 1]`` f32: each row's largest ``|x|`` (NaN where the row holds a NaN; 0 for an
    empty row).

    Args:
        x: ``[M, K]`` any float dtype.
    """
    if x.ndim != 2:
        raise ValueError(f"x: expected a [M, K] matrix, got shape {list(x.shape)}")
    if not x.shape[1]:
        return x.new_zeros((x.shape[0], 1), dtype=torch.float32)
    return torch.linalg.vector_norm(x.detach().float(), _INF, dim=1, keepdim=True)


# The arguments and outputs of the fused op mptex::fp8_quantize (mptex._fp8_fused's contract),
# shared by its kernels (mptex._fp8_fused's C, mptex._fp8_triton's Triton).
_FORMATS = (E4M3, E5M2)
_Q_KINDS = {torch.float32: 1, torch.float64: 2}  # 0: the FP8 codes themselves


def _check(x, fp8_format, recipe, q_dtype, q_pad: int = 0, t_pad: int = 0) -> torch.dtype:
    if fp8_format not in (0, 1):
        raise ValueError(f"fp8_format: expected 0 (E4M3) or 1 (E5M2), got {fp8_format}")
    if recipe not in (0, 1, 2):
        raise ValueError(f"recipe: expected 0 (delayed), 1 (current) or 2 (rowwise), got {recipe}")
    dtype = _FORMATS[fp8_format]
    if q_dtype != dtype and q_dtype not in _Q_KINDS:
        raise ValueError(
            f"q_dtype: expected {dtype}, torch.float32 or torch.float64, got {q_dtype}"
        )
    if recipe == 2 and x.ndim != 2:
        raise ValueError(f"x: the rowwise recipe takes a [M, K] matrix, got shape {list(x.shape)}")
    if q_pad < 0 or (q_pad and x.ndim != 2):
        raise ValueError(f"q_pad: expected 0, or > 0 with a [M, K] matrix x, got {q_pad} with "
                         f"x of shape {list(x.shape)}")  # fmt: skip
    if t_pad < 0 or (t_pad and x.ndim != 2):
        raise ValueError(f"t_pad: expected 0, or > 0 with a [M, K] matrix x, got {t_pad} with "
                         f"x of shape {list(x.shape)}")  # fmt: skip
    return dtype


def _q_cols(cols: int, q_pad: int) -> int:
    """The width of q's rows: ``cols``, or with ``q_pad`` rounded up to a multiple of it."""
    return -(-cols // q_pad) * q_pad if q_pad else cols


def _rowwise_statistics(amax: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """``[2]`` f32, a row-wise quantisation's per-tensor statistics: the largest row ``amax``
    (NaN if a row's is NaN) and the smallest scale a row used; ``(0, 1)`` for a matrix without
    rows, what a zero tensor gets (its amax 0, the scale 1 kept).

    Args:
        amax, used: ``[M, 1]`` f32, :func:`quantize_fp8`'s for the rows.
    """
    if not amax.numel():
        return torch.tensor([0.0, 1.0], device=amax.device)
    return torch.stack([amax.amax(), used.amin()])


def _outputs(x, history, recipe, record, q_dtype, q_pad=0, t_pad=0):
    """The op's outputs, allocated: q laid out as x (with ``q_pad``: row-major, its rows
    ``_q_cols`` wide, the padding left to the kernel), the scalars (or [M, 1] row values), the
    history (delayed, recording) or the row-wise statistics (recording), q_t (with ``t_pad``:
    ``[K, _q_cols(M, t_pad)]`` row-major, else empty) and t_scale_inv (row-wise with ``t_pad``:
    ``[K, 1]``, else empty)."""
    q_storage = torch.uint8 if q_dtype not in _Q_KINDS else q_dtype
    if q_pad:
        q = torch.empty(x.shape[0], _q_cols(x.shape[1], q_pad), dtype=q_storage, device=x.device)
    else:
        q = torch.empty_like(x, dtype=q_storage)
    shape = (x.shape[0], 1) if recipe == 2 else ()
    scalars = [torch.empty(shape, dtype=torch.float32, device=x.device) for _ in range(4)]
    size = 0
    if record and recipe == 0:
        size = history.shape[0]
    elif record and recipe == 2:
        size = 2
    next_history = torch.empty(size, dtype=torch.float32, device=x.device)
    t_shape = (x.shape[1], _q_cols(x.shape[0], t_pad)) if t_pad else (0,)
    q_t = torch.empty(t_shape, dtype=q_storage, device=x.device)
    t_rows = (x.shape[1], 1) if t_pad and recipe == 2 else (0,)
    t_scale_inv = torch.empty(t_rows, dtype=torch.float32, device=x.device)
    return q, scalars, next_history, q_t, t_scale_inv
