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
library's, which torch's ``log`` and ``pow`` kernels call, taken from a CUDA toolkit of torch's
CUDA version (:func:`torch_libdevice`; Triton's bundled libdevice may be another release's).
Triton's CPU interpreter runs no libdevice code; there (``INTERPRETED``) the two are evaluated
in float64 and rounded once to float32 (correctly rounded but for near-ties), which is how
``tests/test_fused_loss.py`` checks the kernels' arithmetic against autograd on the CPU, element
by element wherever torch's own ``log`` and ``pow`` return the correctly rounded value. A forward
loss value is a float32 sum in another order than torch's ``mean``: it may differ from the eager
value in its last bits.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mptex._triton_launch import cdiv, on_operand_device

__all__ = ["INTERPRETED", "LAUNCH_OPTIONS", "torch_libdevice", "toolkit_libdevice",
           "loss_partials", "loss_grad", "kd_partials", "kd_grad"]  # fmt: skip

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
# a float32's sign bit, as an int32
_SIGN_BIT = tl.constexpr(-(2**31))


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
        g = g * tl.math.div_rn(count * 0.0 + 1.0, count)  # (finite count)
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


# Where CUDA toolkits are installed when no variable names one.
_SYSTEM_TOOLKITS = ("/usr/local/cuda-{version}", "/usr/local/cuda")


def _toolkit_version(home: Path) -> str | None:
    """``major.minor`` of the CUDA toolkit at ``home``: its ``nvcc --version``, its
    ``version.json``, or its folder's name (``cuda-13.0``); None if none says."""
    nvcc = home / "bin" / "nvcc"
    if nvcc.is_file():
        try:
            out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                                 timeout=60).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            out = ""
        found = re.search(r"release (\d+\.\d+)", out)
        if found:
            return found.group(1)
    try:
        version = json.loads((home / "version.json").read_text())["cuda"]["version"]
        return ".".join(version.split(".")[:2])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = re.fullmatch(r"cuda-(\d+\.\d+)", home.resolve().name)
    return found.group(1) if found else None


@functools.cache
def torch_libdevice() -> tuple[str | None, str]:
    """``(path, "")`` of the libdevice of a CUDA toolkit of torch's CUDA version (major.minor),
    whose ``logf`` and ``powf`` torch's kernels were compiled with, or ``(None, why not)``.

    Triton's own libdevice can be another CUDA release's: Triton 3.6's computes ``powf``
    otherwise than CUDA 13.0's (it uses the hardware's approximate ``exp2``), so the tone map's
    bits would differ from torch's. ``MPTEX_LIBDEVICE`` names the file outright; otherwise
    :func:`toolkit_libdevice` finds one."""
    named = os.environ.get("MPTEX_LIBDEVICE")
    if named:
        if not Path(named).is_file():
            return None, f"MPTEX_LIBDEVICE={named}: no such file"
        return named, ""
    wanted = torch.version.cuda
    if not wanted:
        return None, "a CUDA build of torch (its CUDA version's libdevice)"
    return toolkit_libdevice(".".join(wanted.split(".")[:2]))


def toolkit_libdevice(release: str) -> tuple[str | None, str]:
    """``(path, "")`` of the libdevice of a CUDA toolkit of ``release`` (``major.minor``) among
    those at ``CUDA_HOME``, ``CUDA_PATH``, ``nvcc``'s on the ``PATH``,
    ``/usr/local/cuda-<release>`` and ``/usr/local/cuda``, in that order, or ``(None, why
    not)``. :func:`torch_libdevice` asks it for torch's release; the GPU kit's packer, for the
    GPU machines'."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    homes += [str(Path(nvcc).resolve().parents[1]) if nvcc else None,
              *(home.format(version=release) for home in _SYSTEM_TOOLKITS)]  # fmt: skip
    seen = []
    for home in dict.fromkeys(h for h in homes if h):
        path = Path(home) / "nvvm" / "libdevice" / "libdevice.10.bc"
        if path.is_file():
            version = _toolkit_version(Path(home))
            if version == release:
                return str(path), ""
            seen.append(f"{home} ({version or 'version unknown'})")
    found = f"; found {', '.join(seen)}" if seen else ""
    return None, (f"the libdevice of a CUDA {release} toolkit, torch's (set CUDA_HOME or "
                  f"MPTEX_LIBDEVICE){found}")  # fmt: skip


def _options(tonemap: bool) -> dict:
    """The kernels' compile options; with ``tonemap`` (``log`` and ``pow``), torch's libdevice."""
    if INTERPRETED or not tonemap:
        return LAUNCH_OPTIONS
    path, why = torch_libdevice()
    if path is None:
        raise RuntimeError(f"the fused logl1 loss needs {why}")
    return {**LAUNCH_OPTIONS, "extern_libs": (("libdevice", path),)}


def _check_runnable(device: torch.device) -> None:
    """``RuntimeError`` where the kernels cannot run on ``device`` with this Triton."""
    if LAUNCH_OPTIONS is None:
        raise RuntimeError(
            "the fused loss needs a Triton whose CUDA backend has the enable_reflect_ftz option"
        )
    if device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the fused loss's kernels need GPU tensors (or Triton's interpreter)")


def _check(pred: torch.Tensor, rgba: torch.Tensor, background: torch.Tensor) -> None:
    _check_runnable(pred.device)
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


@on_operand_device
def loss_partials(pred, rgba, background, tonemap: bool) -> torch.Tensor:
    """``[programs]`` float32: each program's sum of ``|T(p a) - T(r a)|`` (``T`` the identity
    without ``tonemap``) over its ``_BLOCK`` elements of ``pred`` (``[..., 3]``, any float
    dtype), ``rgba`` (``[..., 4]`` float32) and ``background`` (``[..., 3]`` float32)."""
    _check(pred, rgba, background)
    pred, rgba, background = pred.contiguous(), rgba.contiguous(), background.contiguous()
    n = pred.numel()
    programs = max(cdiv(n, _BLOCK), 1)
    out = torch.empty(programs, dtype=torch.float32, device=pred.device)
    _partials_kernel[(programs,)](pred, rgba, background, out, n, TONEMAP=tonemap,
                                  INTERP=INTERPRETED, BLOCK=_BLOCK,
                                  **_options(tonemap))  # fmt: skip
    return out


@on_operand_device
def loss_grad(pred, rgba, background, grad, tonemap: bool, mean_by_reciprocal: bool):
    """``dL/dpred`` (``pred``'s shape and dtype) of ``L = grad * mean|T(p a) - T(r a)|``:
    ``grad`` a float32 scalar tensor on ``pred``'s device; ``mean_by_reciprocal`` as torch's
    division of the mean's backward on that device (module docstring)."""
    _check(pred, rgba, background)
    pred, rgba, background = pred.contiguous(), rgba.contiguous(), background.contiguous()
    n = pred.numel()
    out = torch.empty_like(pred)
    if n:
        _grad_kernel[(cdiv(n, _BLOCK),)](
            pred, rgba, background, grad.detach().float().contiguous(), out, n,
            TONEMAP=tonemap, MEAN_BY_RECIPROCAL=mean_by_reciprocal, INTERP=INTERPRETED,
            BLOCK=_BLOCK, **_options(tonemap),
        )  # fmt: skip
    return out


# ------------------------------------------------------------------- the smoothness term
@triton.jit
def _kd_differences(tj_ptr, t_ptr, offs, n, C: tl.constexpr):
    """``d = tex_jitter - tex`` of the elements ``offs`` of two ``[N, C]`` tensors, and whether
    each is one of the first three channels (kd) within the ``n`` elements."""
    kd = (offs < n) & (offs % C < 3)
    tj = tl.load(tj_ptr + offs, mask=kd, other=0.0)
    t = tl.load(t_ptr + offs, mask=kd, other=0.0)
    return tj - t, kd


@triton.jit
def _kd_partials_kernel(tj_ptr, t_ptr, out_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    d, kd = _kd_differences(tj_ptr, t_ptr, offs, n, C)
    tl.store(out_ptr + pid, tl.sum(tl.where(kd, tl.abs(d), 0.0), axis=0))


@triton.jit
def _kd_grad_kernel(tj_ptr, t_ptr, g_ptr, gtj_ptr, gt_ptr, n, pixels, C: tl.constexpr,
                    MEAN_BY_RECIPROCAL: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    d, kd = _kd_differences(tj_ptr, t_ptr, offs, n, C)
    g = tl.load(g_ptr).to(tl.float32)
    count = pixels.to(tl.float32)
    one = count * 0.0 + 1.0  # (finite count)
    three = one * 3.0
    if MEAN_BY_RECIPROCAL:  # kd = (sum(per point) / pixels), per point = sum(|d|) / 3
        g = (g * tl.math.div_rn(one, count)) * tl.math.div_rn(one, three)
    else:
        g = tl.math.div_rn(tl.math.div_rn(g, count), three)
    sign = (d > 0.0).to(tl.float32) - (d < 0.0).to(tl.float32)
    gd = g * sign
    # autograd negates with torch's neg, a flip of the sign bit (zeros and NaNs included); so
    # does this. Triton before 3.8 compiles a float's unary minus to 0 - x: +0 for +0.
    neg_gd = (gd.to(tl.int32, bitcast=True) ^ _SIGN_BIT).to(tl.float32, bitcast=True)
    inside = offs < n
    tl.store(gtj_ptr + offs, tl.where(kd, gd, 0.0), mask=inside)
    tl.store(gt_ptr + offs, tl.where(kd, neg_gd, 0.0), mask=inside)


def _check_kd(tex: torch.Tensor, tex_jitter: torch.Tensor) -> None:
    _check_runnable(tex.device)
    if tex.ndim != 2 or tex.shape[1] < 3 or tex_jitter.shape != tex.shape:
        raise ValueError(
            f"tex, tex_jitter: expected two [N, C >= 3] of one shape, got {list(tex.shape)} and "
            f"{list(tex_jitter.shape)}"
        )
    if tex.dtype != torch.float32 or tex_jitter.dtype != torch.float32:
        raise ValueError(f"tex, tex_jitter: expected float32, got {tex.dtype}, {tex_jitter.dtype}")


@on_operand_device
def kd_partials(tex: torch.Tensor, tex_jitter: torch.Tensor) -> torch.Tensor:
    """``[programs]`` float32: each program's sum of ``|tex_jitter[:, :3] - tex[:, :3]|`` over its
    ``_BLOCK`` elements of the two ``[N, C]`` float32 tensors."""
    _check_kd(tex, tex_jitter)
    tex, tex_jitter = tex.contiguous(), tex_jitter.contiguous()
    n = tex.numel()
    programs = max(cdiv(n, _BLOCK), 1)
    out = torch.empty(programs, dtype=torch.float32, device=tex.device)
    _kd_partials_kernel[(programs,)](tex_jitter, tex, out, n, C=tex.shape[1], BLOCK=_BLOCK,
                                     **LAUNCH_OPTIONS)  # fmt: skip
    return out


@on_operand_device
def kd_grad(tex, tex_jitter, grad, pixels: int, mean_by_reciprocal: bool):
    """``(dL/dtex_jitter, dL/dtex)`` of ``L = grad * sum_i(sum_c<3 |tj - t| / 3) / pixels``, as
    autograd composes it (module docstring of :mod:`mptex.train.fused_loss`)."""
    _check_kd(tex, tex_jitter)
    tex, tex_jitter = tex.contiguous(), tex_jitter.contiguous()
    n = tex.numel()
    grad_jitter, grad_tex = torch.empty_like(tex_jitter), torch.empty_like(tex)
    if n:
        _kd_grad_kernel[(cdiv(n, _BLOCK),)](
            tex_jitter, tex, grad.detach().float().contiguous(), grad_jitter, grad_tex, n, pixels,
            C=tex.shape[1], MEAN_BY_RECIPROCAL=mean_by_reciprocal, BLOCK=_BLOCK,
            **LAUNCH_OPTIONS,
        )  # fmt: skip
    return grad_jitter, grad_tex
