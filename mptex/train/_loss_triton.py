"""Triton kernels of the training loss's image term (:mod:`mptex.train.fused_loss`).

The eager loss is about 20 element-wise passes over the images (the reference composited over
the background, both images masked by the reference alpha, nvdiffrec's log-sRGB tone map of
each, the difference, its absolute value, the mean) and as many again in its backward, each a
kernel launch. Here the forward is one kernel (per-program partial sums of ``|T(p a) - T(r a)|``,
summed by torch), the backward one kernel writing ``dL/dpred``.

Both perform the eager ops' float32 operations in the same order, per element, so that the
gradient is the one autograd computes, to the bit:

* forward, per element (``a`` the reference alpha, ``b`` the background, ``r`` the reference
  colour, ``p`` the prediction): ``ref = b + (r - b) * a``, ``x = p * a`` and ``y = ref * a``,
  then for each of ``x``, ``y`` (tone-mapped losses): ``c = clamp(x, 0, 65535)`` (NaN kept),
  ``u = log(c + 1)``, ``k = clamp_min(u, 0.0031308)``, ``v = u > 0.0031308 ? pow(k, 1/2.4) *
  1.055 - 0.055 : u * 12.92``; ``|v_x - v_y|`` summed;
* backward, as autograd's derivative formulas compose: ``g = G / n`` (``G`` the incoming
  gradient, ``n`` the element count; torch's CUDA division by a host scalar multiplies by its
  float32 reciprocal, its CPU division divides: ``MEAN_BY_RECIPROCAL``), ``g *= sgn(d)`` (0 for
  a zero or NaN difference), the ``where``'s two branches, ``* 1.055``, ``pow``'s
  ``g * ((1/2.4) * pow(k, 1/2.4 - 1))`` (the exponent ``1/2.4 - 1`` computed in double, then
  rounded to float32, as torch does), ``clamp_min``'s ``u >= 0.0031308`` mask, ``* 12.92``, the
  two branches added, ``/ (c + 1)`` (``log``), ``clamp``'s ``0 <= x <= 65535`` mask, ``* a``.

The float32 constants are Python's doubles rounded to nearest, as torch rounds a Python scalar
for a float32 tensor. Kernels run with ``enable_fp_fusion=False`` (no multiply-add is
contracted; each product and sum rounds as the separate eager kernels do) and, where this Triton
has the option, ``enable_reflect_ftz=False``: libdevice's ``logf`` and ``powf`` then keep
subnormals, as in torch's kernels (built without flush to zero). Divisions are
``tl.math.div_rn`` (``/`` on float32 is an approximate division on CUDA).

``log`` and ``pow`` are libdevice's ``__nv_logf`` and ``__nv_powf`` when compiled: the CUDA math
library's, which torch's ``log`` and ``pow`` kernels call. Triton's CPU interpreter runs no
libdevice code; there (``INTERPRETED``) the two are evaluated in float64 and rounded once to
float32 (correctly rounded but for near-ties), which is how ``tests/test_fused_loss.py`` checks
the kernels' arithmetic against autograd on the CPU, element by element wherever torch's own
``log`` and ``pow`` return the correctly rounded value. A forward loss value is a float32 sum in
another order than torch's ``mean``: it may differ from the eager value in its last bits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["INTERPRETED", "LAUNCH_OPTIONS", "loss_partials", "loss_grad"]

# Elements per program: the forward writes one partial sum per program.
_BLOCK = 1024


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as torch rounds a Python scalar)."""
    return float(np.float32(value))


# nvdiffrec's sRGB curve (render/loss.py) and the log tone map's clamp.
_T0 = tl.constexpr(_f32(0.0031308))
_EXP = tl.constexpr(_f32(1.0 / 2.4))
# pow's backward: the double exponent minus 1, then rounded
_EXP_M1 = tl.constexpr(_f32(1.0 / 2.4 - 1.0))
_SLOPE = tl.constexpr(_f32(12.92))
_GAIN = tl.constexpr(_f32(1.055))
_OFFSET = tl.constexpr(_f32(0.055))
_CLAMP_MAX = tl.constexpr(65535.0)


@triton.jit
def _log(x, INTERP: tl.constexpr):
    if INTERP:
        return tl.log(x.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.log(x)


@triton.jit
def _pow(x, e: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:
        return tl.exp2(tl.log2(x.to(tl.float64)) * e).to(tl.float32)
    else:
        return libdevice.pow(x, tl.full(x.shape, e, tl.float32))


@triton.jit
def _masked(p_ptr, rgba_ptr, bg_ptr, offs, mask):
    """``x = p * a`` and ``y = (b + (r - b) * a) * a`` of the elements ``offs``, and ``a``."""
    pix = offs // 3
    ch = offs - pix * 3
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bg_ptr + offs, mask=mask, other=0.0)
    r = tl.load(rgba_ptr + pix * 4 + ch, mask=mask, other=0.0)
    a = tl.load(rgba_ptr + pix * 4 + 3, mask=mask, other=0.0)
    ref = b + (r - b) * a
    return p * a, ref * a, a


@triton.jit
def _tone_parts(x, INTERP: tl.constexpr):
    """The log-sRGB tone map's intermediates: ``c + 1``, ``u``, ``k`` and the mapped value."""
    c = tl.where(x != x, x, tl.minimum(tl.maximum(x, 0.0), _CLAMP_MAX))
    c1 = c + 1.0
    u = _log(c1, INTERP)
    k = tl.where(u != u, u, tl.maximum(u, _T0))
    mapped = _pow(k, _EXP, INTERP) * _GAIN - _OFFSET
    v = tl.where(u > _T0, mapped, u * _SLOPE)
    return c1, u, k, v


@triton.jit
def _differences(p_ptr, rgba_ptr, bg_ptr, offs, mask, TONEMAP: tl.constexpr,
                 INTERP: tl.constexpr):  # fmt: skip
    """``d = T(x) - T(y)`` of the elements ``offs`` (``T`` the tone map, or the identity), with
    ``x``, ``a`` and ``x``'s tone-map intermediates (``x`` itself for each without it)."""
    x, y, a = _masked(p_ptr, rgba_ptr, bg_ptr, offs, mask)
    if TONEMAP:
        c1, u, k, vx = _tone_parts(x, INTERP)
        _, _, _, vy = _tone_parts(y, INTERP)
    else:
        c1, u, k, vx, vy = x, x, x, x, y
    return vx - vy, x, a, c1, u, k


@triton.jit
def _partials_kernel(p_ptr, rgba_ptr, bg_ptr, out_ptr, n, TONEMAP: tl.constexpr,
                     INTERP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d, _, _, _, _, _ = _differences(p_ptr, rgba_ptr, bg_ptr, offs, mask, TONEMAP, INTERP)
    tl.store(out_ptr + pid, tl.sum(tl.where(mask, tl.abs(d), 0.0), axis=0))


@triton.jit
def _grad_kernel(p_ptr, rgba_ptr, bg_ptr, g_ptr, out_ptr, n, TONEMAP: tl.constexpr,
                 MEAN_BY_RECIPROCAL: tl.constexpr, INTERP: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d, x, a, c1, u, k = _differences(p_ptr, rgba_ptr, bg_ptr, offs, mask, TONEMAP, INTERP)
    g = tl.load(g_ptr).to(tl.float32)
    count = n.to(tl.float32)
    if MEAN_BY_RECIPROCAL:
        g = g * tl.math.div_rn(count * 0.0 + 1.0, count)
    else:
        g = tl.math.div_rn(g, count)
    sign = (d > 0.0).to(tl.float32) - (d < 0.0).to(tl.float32)
    gd = g * sign
    if TONEMAP:
        above = u > _T0
        g_mapped = tl.where(above, gd, 0.0)
        g_linear = tl.where(above, 0.0, gd)
        g_pow = g_mapped * _GAIN
        g_k = g_pow * (_pow(k, _EXP_M1, INTERP) * _EXP)
        g_u = tl.where(u >= _T0, g_k, 0.0) + g_linear * _SLOPE
        g_c = tl.math.div_rn(g_u, c1)
        gx = tl.where((x >= 0.0) & (x <= _CLAMP_MAX), g_c, 0.0)
    else:
        gx = gd
    gp = gx * a
    tl.store(out_ptr + offs, gp.to(out_ptr.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_grad_kernel, InterpretedFunction)


INTERPRETED = _interpreted()


def _launch_options() -> dict[str, bool] | None:
    """The compile options the kernels need on a GPU, or None where this Triton cannot keep
    libdevice from flushing subnormals to zero (no ``enable_reflect_ftz`` option)."""
    if INTERPRETED:
        return {}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return None
    fields = {field.name for field in dataclasses.fields(CUDAOptions)}
    if "enable_reflect_ftz" not in fields:
        return None
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False}


LAUNCH_OPTIONS = _launch_options()


def _check(pred: torch.Tensor, rgba: torch.Tensor, background: torch.Tensor) -> None:
    if LAUNCH_OPTIONS is None:
        raise RuntimeError(
            "the fused loss needs a Triton whose CUDA backend has the enable_reflect_ftz option"
        )
    if pred.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the fused loss's kernels need GPU tensors (or Triton's interpreter)")
    shape = tuple(pred.shape)
    if not shape or shape[-1] != 3:
        raise ValueError(f"pred: expected [..., 3], got {list(shape)}")
    if tuple(rgba.shape) != shape[:-1] + (4,) or tuple(background.shape) != shape:
        raise ValueError(
            f"rgba, background: expected {list(shape[:-1]) + [4]} and {list(shape)}, got "
            f"{list(rgba.shape)} and {list(background.shape)}"
        )
    if rgba.dtype != torch.float32 or background.dtype != torch.float32:
        raise ValueError(
            f"rgba, background: expected float32, got {rgba.dtype} and {background.dtype}"
        )


def loss_partials(pred, rgba, background, tonemap: bool) -> torch.Tensor:
    """``[programs]`` float32: each program's sum of ``|T(p a) - T(r a)|`` (``T`` the identity
    without ``tonemap``) over its ``_BLOCK`` elements of ``pred`` (``[..., 3]``, any float
    dtype), ``rgba`` (``[..., 4]`` float32) and ``background`` (``[..., 3]`` float32)."""
    _check(pred, rgba, background)
    pred, rgba, background = pred.contiguous(), rgba.contiguous(), background.contiguous()
    n = pred.numel()
    programs = max(triton.cdiv(n, _BLOCK), 1)
    out = torch.empty(programs, dtype=torch.float32, device=pred.device)
    _partials_kernel[(programs,)](pred, rgba, background, out, n, TONEMAP=tonemap,
                                  INTERP=INTERPRETED, BLOCK=_BLOCK,
                                  **LAUNCH_OPTIONS)  # fmt: skip
    return out


def loss_grad(pred, rgba, background, grad, tonemap: bool, mean_by_reciprocal: bool):
    """``dL/dpred`` (``pred``'s shape and dtype) of ``L = grad * mean|T(p a) - T(r a)|``:
    ``grad`` a float32 scalar tensor on ``pred``'s device; ``mean_by_reciprocal`` as torch's
    division of the mean's backward on that device (module docstring)."""
    _check(pred, rgba, background)
    pred, rgba, background = pred.contiguous(), rgba.contiguous(), background.contiguous()
    n = pred.numel()
    out = torch.empty_like(pred)
    if n:
        _grad_kernel[(triton.cdiv(n, _BLOCK),)](
            pred, rgba, background, grad.detach().float().contiguous(), out, n,
            TONEMAP=tonemap, MEAN_BY_RECIPROCAL=mean_by_reciprocal, INTERP=INTERPRETED,
            BLOCK=_BLOCK, **LAUNCH_OPTIONS,
        )  # fmt: skip
    return out
