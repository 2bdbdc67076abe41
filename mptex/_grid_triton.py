"""Triton kernels of the multiresolution grid encoding, the same op as :mod:`mptex._grid_torch`.

The torch twin defines the semantics; these kernels perform the same float operations in the
same order, so that results agree to the bit wherever no atomics are involved:

- positions ``pos = fma(scale_l, x, 0.5)`` with ``tl.fma`` (one float32 rounding, as tcnn's
  ``fmaf`` and the twin's exact emulation), ``frac = pos - floor(pos)``, cells
  ``(uint32)(int64)floor(pos)``;
- corner indices in uint32 arithmetic (multiplications and sums wrap modulo 2^32): hashed
  levels XOR ``c_d * prime_d`` and keep the low ``log2(size)`` bits, dense levels sum
  ``c_d * res^d`` and take ``% size`` (the wraparound at x = 1);
- weights ``((w_0 * w_1) * w_2) ...`` per corner, corners in tcnn's order (dimension 0
  fastest), and per corner one fused multiply-add from a zero result, tcnn 2.0's
  ``result = fma((T)weight, value, result)``: ``tl.fma`` in float32; in half mode the table
  value and the weight are rounded to half and the fma rounds once to half (``_half_fma``, the
  twin's exact emulation, the same on a GPU and under the interpreter); in bfloat16 mode the
  table value is rounded to bfloat16, the fmas are the float32 path's, and the result is
  rounded to bfloat16 once (the twin's bfloat16 mode);
- Nearest reads the lower corner with weight 1.

Rounding to bfloat16 is done on the bits (round to nearest, ties to even, as torch rounds; NaN
stays NaN): Triton's interpreter truncates on ``.to(tl.bfloat16)``, while compiled code rounds
to nearest even, and the bit operations give torch's result in both.

Kernels are launched with ``enable_fp_fusion=False``: Triton otherwise contracts ``a * b + c``
into an fma on a GPU, which changes the rounding of the smoothstep and of ``_half_fma``'s
error terms; the fmas tcnn takes are written out as ``tl.fma``.

Level scales come with the geometry (:func:`mptex._grid_torch.grid_geometry`);
:mod:`mptex._ex2_cuda` evaluates tcnn's ``exp2f`` (PTX ``ex2.approx.ftz.f32``) for it on CUDA.

Accuracy of the gradients. The parameter gradient is scattered with ``tl.atomic_add`` in
float32, in an order the hardware picks. An entry that receives ``k`` contributions
``c_1..c_k`` is a float32 sum whose value, for any order, lies within
``(k - 1) * 2^-24 * sum_i |c_i|`` of the exact sum (each of the ``k - 1`` additions rounds once,
with relative error <= 2^-24 of a partial sum bounded by ``sum |c_i|``); the twin's
``scatter_add_`` obeys the same bound, so the two differ by at most twice it. The input
gradient needs no atomics: each level writes its ``d pos`` and the levels are summed in order,
as in the twin, so it matches the twin to the bit, except for the sign of a zero: a
corner's sum of ``-0.0`` terms (a ``-0.0`` upstream gradient) is ``tl.sum``'s, which gives
``+0.0`` under the interpreter where the twin's in-order sum keeps ``-0.0``. Under Triton's
CPU interpreter the atomics run sequentially too, so there the parameter gradient matches the
twin to float32 summation order only. The bfloat16 mode's backward is the float32 kernels'
on the float32 cast of the bfloat16 ``dL/dy`` (no loss scale), with the table values rounded
to bfloat16 for the input gradient, as in the twin: the same claims hold.

Devices: whatever Triton compiles for (CUDA, ROCm, XPU). CPU tensors run only under the
interpreter, which is selected when ``triton.jit`` decorates the kernels, i.e. when this
module is first imported: ``TRITON_INTERPRET=1`` must be set before that.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mptex._grid_torch import TCNN_HALF_LOSS_SCALE, GridGeometry
from mptex._triton_launch import cdiv, on_operand_device

__all__ = ["hash_grid_encode_triton", "INTERPRETED", "check_device"]

_INTERPOLATION_CODES = {"Nearest": 0, "Linear": 1, "Smoothstep": 2}
# Points per program: the interpreter runs one Python call per program, so it gets large
# blocks; the GPU value is a plain default, not tuned (the kernel is not yet measured on a GPU).
_BLOCK = {"interpreter": 1024, "gpu": 128}


# ----------------------------------------------------------------------------------------
# Device code.


@triton.jit
def _bf16_bits(values):
    """float32 values rounded to the nearest bfloat16 (ties to even, as torch; NaN to the quiet
    NaN 0x7FC0): its 16 bits, in the low half of a uint32."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return tl.where(values != values, 0x7FC0, rounded)


@triton.jit
def _to_bf16(values):
    """float32 -> bfloat16, rounded to nearest even (the interpreter's cast truncates)."""
    return _bf16_bits(values).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _table_value(values, HALF: tl.constexpr, BF16: tl.constexpr):
    """float32 table values as the mode reads them: rounded to half (tcnn's half mode) or to
    bfloat16, and back to float32; unchanged in float32 mode."""
    if HALF:
        values = values.to(tl.float16).to(tl.float32)
    if BF16:
        values = (_bf16_bits(values) << 16).to(tl.float32, bitcast=True)
    return values


@triton.jit
def _axis(
    x_ptr, points, mask, dim: tl.constexpr, N_DIMS: tl.constexpr, scale, INTERP: tl.constexpr
):
    """One input dimension of a block of points at one level: (cell as uint32, weight of bit 0,
    weight of bit 1, d weight_1 / d frac)."""
    x = tl.load(x_ptr + points * N_DIMS + dim, mask=mask, other=0.0)
    pos = tl.fma(scale, x, 0.5)
    floor = tl.floor(pos)
    frac = pos - floor  # exact
    # The twin casts floor to int64 and keeps the low 32 bits: tcnn's (uint32_t)(int)floorf.
    cell = floor.to(tl.int64).to(tl.uint32)
    if INTERP == 2:  # Smoothstep, in the twin's order of operations
        weight_one = frac * frac * (3.0 - 2.0 * frac)
        derivative = 6.0 * frac * (1.0 - frac)
    else:
        weight_one = frac
        derivative = tl.full(frac.shape, 1.0, tl.float32)
    return cell, 1.0 - weight_one, weight_one, derivative


@triton.jit
def _corner_row(
    c0, c1, c2, c3, corner: tl.constexpr, N_DIMS: tl.constexpr, hashed, size, offset, s1, s2, s3
):
    """Table row (level offset included, int64) of corner ``corner`` of cells (c0..c3)."""
    # Corner bit d selects cell + 1 along dimension d; uint32 + 1 wraps as tcnn's does.
    k0 = c0 + (corner & 1)
    k1 = c1 + ((corner >> 1) & 1)
    hash_index = k0 ^ (k1 * 2654435761)
    dense_index = k0 + k1 * s1
    if N_DIMS > 2:
        k2 = c2 + ((corner >> 2) & 1)
        hash_index = hash_index ^ (k2 * 805459861)
        dense_index = dense_index + k2 * s2
    if N_DIMS > 3:
        k3 = c3 + ((corner >> 3) & 1)
        hash_index = hash_index ^ (k3 * 3674653429)
        dense_index = dense_index + k3 * s3
    # Hashed tables are powers of two: `% size` is the mask the twin applies.
    local = tl.where(hashed != 0, hash_index & (size - 1), dense_index % size)
    return offset + local.to(tl.int64)


@triton.jit
def _corner_weight(
    w00, w01, w10, w11, w20, w21, w30, w31, corner: tl.constexpr, N_DIMS: tl.constexpr
):
    """((w_0 * w_1) * w_2) * w_3 for the corner's bits, tcnn's multiplication order."""
    weight = w01 if (corner & 1) else w00
    weight = weight * (w11 if ((corner >> 1) & 1) else w10)
    if N_DIMS > 2:
        weight = weight * (w21 if ((corner >> 2) & 1) else w20)
    if N_DIMS > 3:
        weight = weight * (w31 if ((corner >> 3) & 1) else w30)
    return weight


@triton.jit
def _weight_without(
    w00,
    w01,
    w10,
    w11,
    w20,
    w21,
    w30,
    w31,
    corner: tl.constexpr,
    skip: tl.constexpr,
    N_DIMS: tl.constexpr,
):
    """d weight_corner / d frac_skip: the other axes' weights multiplied in tcnn's order, with
    the sign of the corner's bit along ``skip`` (the twin multiplies by -1 or +1, which is
    exact, in the same position)."""
    weight = tl.full(w00.shape, 1.0, tl.float32)
    for dim in tl.static_range(N_DIMS):
        if dim != skip:
            if dim == 0:
                factor = w01 if (corner & 1) else w00
            elif dim == 1:
                factor = w11 if ((corner >> 1) & 1) else w10
            elif dim == 2:
                factor = w21 if ((corner >> 2) & 1) else w20
            else:
                factor = w31 if ((corner >> 3) & 1) else w30
            weight = weight * factor  # 1 * factor is exact: the twin's first factor
    if ((corner >> skip) & 1) == 0:
        # A multiply, as the twin's: Triton before 3.8 compiles a float's unary minus to 0 - x,
        # which gives +0 where the twin's product gives -0 (a point on a cell's face).
        weight = weight * -1.0
    return weight


@triton.jit
def _level_setup(
    x_ptr,
    scales_ptr,
    hashed_ptr,
    sizes_ptr,
    offsets_ptr,
    strides_ptr,
    n_points,
    N_DIMS: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    level = tl.program_id(1)
    # int64: points * n_outputs passes 2^31 beyond 2^26 points at nvdiffrec's 32 outputs.
    points = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = points < n_points
    scale = tl.load(scales_ptr + level)
    c0, w00, w01, d0 = _axis(x_ptr, points, mask, 0, N_DIMS, scale, INTERP)
    c1, w10, w11, d1 = _axis(x_ptr, points, mask, 1, N_DIMS, scale, INTERP)
    if N_DIMS > 2:
        c2, w20, w21, d2 = _axis(x_ptr, points, mask, 2, N_DIMS, scale, INTERP)
    else:
        c2, w20, w21, d2 = c1, w10, w11, d1  # unused
    if N_DIMS > 3:
        c3, w30, w31, d3 = _axis(x_ptr, points, mask, 3, N_DIMS, scale, INTERP)
    else:
        c3, w30, w31, d3 = c1, w10, w11, d1  # unused
    hashed = tl.load(hashed_ptr + level)
    size = tl.load(sizes_ptr + level).to(tl.uint32)
    offset = tl.load(offsets_ptr + level)
    s1 = tl.load(strides_ptr + level * 4 + 1).to(tl.uint32)
    s2 = tl.load(strides_ptr + level * 4 + 2).to(tl.uint32)
    s3 = tl.load(strides_ptr + level * 4 + 3).to(tl.uint32)
    return (
        level,
        points,
        mask,
        scale,
        c0,
        c1,
        c2,
        c3,
        w00,
        w01,
        w10,
        w11,
        w20,
        w21,
        w30,
        w31,
        d0,
        d1,
        d2,
        d3,
        hashed,
        size,
        offset,
        s1,
        s2,
        s3,
    )


@triton.jit(do_not_specialize=["n_points"])
def _forward_kernel(
    x_ptr,
    params_ptr,
    out_ptr,
    scales_ptr,
    hashed_ptr,
    sizes_ptr,
    offsets_ptr,
    strides_ptr,
    n_points,
    n_levels,
    N_DIMS: tl.constexpr,
    N_FEATURES: tl.constexpr,
    INTERP: tl.constexpr,
    HALF: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    (
        level,
        points,
        mask,
        scale,
        c0,
        c1,
        c2,
        c3,
        w00,
        w01,
        w10,
        w11,
        w20,
        w21,
        w30,
        w31,
        d0,
        d1,
        d2,
        d3,
        hashed,
        size,
        offset,
        s1,
        s2,
        s3,
    ) = _level_setup(
        x_ptr,
        scales_ptr,
        hashed_ptr,
        sizes_ptr,
        offsets_ptr,
        strides_ptr,
        n_points,
        N_DIMS,
        INTERP,
        BLOCK,
    )
    features = tl.arange(0, N_FEATURES)
    tile_mask = mask[:, None]
    row = _corner_row(c0, c1, c2, c3, 0, N_DIMS, hashed, size, offset, s1, s2, s3)
    values = tl.load(
        params_ptr + row[:, None] * N_FEATURES + features[None, :], mask=tile_mask, other=0.0
    )
    values = _table_value(values, HALF, BF16)
    if INTERP == 0:
        # Nearest: the lower corner, weight 1 (value * 1 is exact).
        acc = values
        if HALF:
            acc = acc.to(tl.float16)
    else:
        # tcnn: result = fma((T)weight, value, result) per corner from a zero result.
        acc = tl.zeros_like(values)
        for corner in tl.static_range(0, 2**N_DIMS):
            if corner > 0:
                row = _corner_row(c0, c1, c2, c3, corner, N_DIMS, hashed, size, offset, s1, s2, s3)
                values = tl.load(
                    params_ptr + row[:, None] * N_FEATURES + features[None, :],
                    mask=tile_mask,
                    other=0.0,
                )
                values = _table_value(values, HALF, BF16)
            weight = _corner_weight(w00, w01, w10, w11, w20, w21, w30, w31, corner, N_DIMS)
            if HALF:
                weight = weight.to(tl.float16).to(tl.float32)
                acc = _half_fma(weight[:, None], values, acc)
            else:
                acc = tl.fma(weight[:, None], values, acc)
        if HALF:
            acc = acc.to(tl.float16)
    if BF16:
        acc = _to_bf16(acc)  # the float32 sum, rounded once
    out_offsets = points[:, None] * (n_levels * N_FEATURES) + level * N_FEATURES + features[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit
def _half_fma(w, v, acc):
    """Half ``w * v + acc`` rounded once (tcnn's ``__hfma2``), on half values held in float32,
    as the twin's ``_hfma``: the product is exact in float32, the sum made round-to-odd with
    its exact error (TwoSum), then rounded to half (returned in float32)."""
    p = w * v
    s = p + acc
    b = s - p
    err = (p - (s - b)) + (acc - b)
    bits = s.to(tl.int32, bitcast=True)
    # one step away from s towards the exact value: +1 on the bits where the magnitude grows
    step = tl.where((err > 0) == (s > 0), 1, -1)
    bits = tl.where((err != 0) & ((bits & 1) == 0), bits + step, bits)
    return bits.to(tl.float32, bitcast=True).to(tl.float16).to(tl.float32)


@triton.jit
def _column(tile, features, index: tl.constexpr):
    """Column ``index`` of a [BLOCK, F] tile (a sum of one value and zeros: exact)."""
    return tl.sum(tl.where(features[None, :] == index, tile, 0.0), axis=1)


@triton.jit(do_not_specialize=["n_points"])
def _backward_kernel(
    x_ptr,
    params_ptr,
    grad_out_ptr,
    grad_params_ptr,
    d_pos_ptr,
    scales_ptr,
    hashed_ptr,
    sizes_ptr,
    offsets_ptr,
    strides_ptr,
    n_points,
    n_levels,
    N_DIMS: tl.constexpr,
    N_FEATURES: tl.constexpr,
    INTERP: tl.constexpr,
    HALF: tl.constexpr,
    BF16: tl.constexpr,
    WANT_PARAMS: tl.constexpr,
    WANT_X: tl.constexpr,
    BLOCK: tl.constexpr,
):
    (
        level,
        points,
        mask,
        scale,
        c0,
        c1,
        c2,
        c3,
        w00,
        w01,
        w10,
        w11,
        w20,
        w21,
        w30,
        w31,
        d0,
        d1,
        d2,
        d3,
        hashed,
        size,
        offset,
        s1,
        s2,
        s3,
    ) = _level_setup(
        x_ptr,
        scales_ptr,
        hashed_ptr,
        sizes_ptr,
        offsets_ptr,
        strides_ptr,
        n_points,
        N_DIMS,
        INTERP,
        BLOCK,
    )
    features = tl.arange(0, N_FEATURES)
    tile_mask = mask[:, None]
    grad_offsets = (
        points[:, None] * (n_levels * N_FEATURES) + level * N_FEATURES + features[None, :]
    )
    grad = tl.load(grad_out_ptr + grad_offsets, mask=tile_mask, other=0.0)  # [BLOCK, F] f32
    n_corners: tl.constexpr = 1 if INTERP == 0 else 2**N_DIMS
    zero = tl.zeros([BLOCK], tl.float32)
    dfrac0, dfrac1, dfrac2, dfrac3 = zero, zero, zero, zero
    for corner in tl.static_range(n_corners):
        row = _corner_row(c0, c1, c2, c3, corner, N_DIMS, hashed, size, offset, s1, s2, s3)
        entries = row[:, None] * N_FEATURES + features[None, :]
        if WANT_PARAMS:
            if INTERP == 0:
                contribution = grad
            else:
                weight = _corner_weight(w00, w01, w10, w11, w20, w21, w30, w31, corner, N_DIMS)
                contribution = grad * weight[:, None]
            tl.atomic_add(grad_params_ptr + entries, contribution, mask=tile_mask, sem="relaxed")
        if WANT_X and INTERP != 0:
            values = _table_value(
                tl.load(params_ptr + entries, mask=tile_mask, other=0.0), HALF, BF16
            )
            products = values * grad
            # g_c = sum_f value_f * dL/dy_f, features in order (the twin's _sum_in_order).
            corner_grad = _column(products, features, 0)
            for feature in tl.static_range(1, N_FEATURES):
                corner_grad = corner_grad + _column(products, features, feature)
            term0 = (
                _weight_without(w00, w01, w10, w11, w20, w21, w30, w31, corner, 0, N_DIMS)
                * corner_grad
            )
            term1 = (
                _weight_without(w00, w01, w10, w11, w20, w21, w30, w31, corner, 1, N_DIMS)
                * corner_grad
            )
            if corner == 0:
                dfrac0, dfrac1 = term0, term1
            else:
                dfrac0, dfrac1 = dfrac0 + term0, dfrac1 + term1
            if N_DIMS > 2:
                term2 = (
                    _weight_without(w00, w01, w10, w11, w20, w21, w30, w31, corner, 2, N_DIMS)
                    * corner_grad
                )
                dfrac2 = term2 if corner == 0 else dfrac2 + term2
            if N_DIMS > 3:
                term3 = (
                    _weight_without(w00, w01, w10, w11, w20, w21, w30, w31, corner, 3, N_DIMS)
                    * corner_grad
                )
                dfrac3 = term3 if corner == 0 else dfrac3 + term3
    if WANT_X and INTERP != 0:
        # d pos of this level, [L, N, D]; the levels are summed in order on the host.
        base = d_pos_ptr + (level * n_points + points) * N_DIMS
        tl.store(base + 0, dfrac0 * d0 * scale, mask=mask)
        tl.store(base + 1, dfrac1 * d1 * scale, mask=mask)
        if N_DIMS > 2:
            tl.store(base + 2, dfrac2 * d2 * scale, mask=mask)
        if N_DIMS > 3:
            tl.store(base + 3, dfrac3 * d3 * scale, mask=mask)


# ----------------------------------------------------------------------------------------
# Host code.


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_forward_kernel, InterpretedFunction)


INTERPRETED = _interpreted()


def check_device(device: torch.device) -> None:
    """Raise ``RuntimeError`` if the kernels cannot run on tensors of ``device``."""
    if device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "backend 'triton' needs GPU tensors (CUDA, ROCm or XPU), params are on the CPU; "
            "CPU tensors work only under Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported (slow, for testing), or use backend='torch'"
        )


@functools.lru_cache(maxsize=64)
def _level_constants(geometry: GridGeometry, device: torch.device) -> tuple[torch.Tensor, ...]:
    """scales [L] f32, hashed [L] int32, sizes [L] int64, offsets [L] int64, dense strides
    [L, 4] int64 (``res^d mod 2^32``: tcnn's uint32 ``stride *= res``)."""
    hashed = geometry.hashed
    boundary = sum(1 for h in hashed if not h)
    if hashed != (False,) * boundary + (True,) * (geometry.n_levels - boundary):
        # The twin refuses this geometry; so do the kernels, to keep one semantics.
        raise ValueError(
            f"geometry: hashed levels must follow the dense ones (per_level_scale >= 1), "
            f"got hashed={hashed}"
        )
    strides = [[res**d & 0xFFFFFFFF for d in range(4)] for res in geometry.resolutions]
    return (
        torch.tensor(geometry.scales, dtype=torch.float32, device=device),
        torch.tensor(hashed, dtype=torch.int32, device=device),
        torch.tensor(geometry.table_sizes, dtype=torch.int64, device=device),
        torch.tensor(geometry.offsets[:-1], dtype=torch.int64, device=device),
        torch.tensor(strides, dtype=torch.int64, device=device),
    )


def _launch_config(device: torch.device, n_points: int, n_levels: int):
    block = _BLOCK["interpreter" if INTERPRETED else "gpu"]
    return (cdiv(n_points, block), n_levels), block


class _TritonGridFunction(torch.autograd.Function):
    """The encoding as one autograd node; the backward recomputes positions and rows."""

    @staticmethod
    @on_operand_device
    def forward(ctx, x, params, geometry: GridGeometry, out_dtype: torch.dtype):
        n_points, n_levels = x.shape[0], geometry.n_levels
        out = torch.empty(n_points, geometry.n_output_dims, dtype=out_dtype, device=x.device)
        if n_points:
            grid, block = _launch_config(x.device, n_points, n_levels)
            _forward_kernel[grid](
                x,
                params,
                out,
                *_level_constants(geometry, x.device),
                n_points,
                n_levels,
                N_DIMS=geometry.n_input_dims,
                N_FEATURES=geometry.n_features_per_level,
                INTERP=_INTERPOLATION_CODES[geometry.interpolation],
                HALF=out_dtype == torch.float16,
                BF16=out_dtype == torch.bfloat16,
                BLOCK=block,
                enable_fp_fusion=False,
            )
        ctx.geometry, ctx.out_dtype = geometry, out_dtype
        ctx.save_for_backward(x, params)
        return out

    @staticmethod
    @on_operand_device
    def backward(ctx, grad_out):
        geometry, half = ctx.geometry, ctx.out_dtype == torch.float16
        x, params = ctx.saved_tensors
        n_points, n_levels, n_dims = x.shape[0], geometry.n_levels, geometry.n_input_dims
        want_x, want_params = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if half:
            # tcnn's bindings run the half backward on dL/dy * 128 (the twin's same operations).
            grad_out = grad_out.to(torch.float16) * TCNN_HALF_LOSS_SCALE
        # bfloat16: the float32 backward on the cast dL/dy, no loss scale (float32's range).
        grad_out = grad_out.to(torch.float32).contiguous()
        nearest = geometry.interpolation == "Nearest"
        grad_params = torch.zeros_like(params) if want_params else None
        want_d_pos = want_x and not nearest
        d_pos = x.new_empty(n_levels, n_points, n_dims) if want_d_pos else None
        if n_points and (want_params or want_d_pos):
            grid, block = _launch_config(x.device, n_points, n_levels)
            _backward_kernel[grid](
                x,
                params,
                grad_out,
                grad_params if want_params else params,  # unused pointer when not wanted
                d_pos if want_d_pos else x,
                *_level_constants(geometry, x.device),
                n_points,
                n_levels,
                N_DIMS=n_dims,
                N_FEATURES=geometry.n_features_per_level,
                INTERP=_INTERPOLATION_CODES[geometry.interpolation],
                HALF=half,
                BF16=ctx.out_dtype == torch.bfloat16,
                WANT_PARAMS=want_params,
                WANT_X=want_d_pos,
                BLOCK=block,
                enable_fp_fusion=False,
            )
        grad_x = None
        if want_x:
            if want_d_pos and n_levels:
                grad_x = d_pos[0]
                for level in range(1, n_levels):  # in order, as the twin sums levels
                    grad_x = grad_x + d_pos[level]
            else:  # Nearest: piecewise constant, zero derivative
                grad_x = torch.zeros_like(x)
            if half:
                grad_x = grad_x / TCNN_HALF_LOSS_SCALE
        if want_params and half:
            # tcnn's gradient table is half; unscaled in half, then cast to the f32 master.
            grad_params = (grad_params.to(torch.float16) / TCNN_HALF_LOSS_SCALE).to(params.dtype)
        return grad_x, grad_params, None, None


def hash_grid_encode_triton(
    x: torch.Tensor, params: torch.Tensor, geometry: GridGeometry, out_dtype: torch.dtype
) -> torch.Tensor:
    """Encode points with Triton kernels; the same contract as
    :func:`mptex._grid_torch.hash_grid_encode` for float32 tensors (float32, half and bfloat16
    modes; no float64).

    Args:
        x: [N, D] float32, contiguous, nominally in [0, 1] (not clamped: uint32 wraparound).
        params: [n_params] float32 flat table in tcnn's layout, contiguous, on x's device.
        geometry: the level constants, from :func:`mptex._grid_torch.grid_geometry`.
        out_dtype: float32, float16 for tcnn's half mode, or bfloat16 for the twin's bfloat16
            mode (bfloat16 table values, float32 weights and sums, bfloat16 output; backward
            the float32 one on the bfloat16 ``dL/dy``, float32 parameter gradient).

    Returns:
        [N, L * F] in ``out_dtype``, level-major.

    Raises:
        RuntimeError: for CPU tensors outside the interpreter, or float64 tensors (the twin,
            ``backend="torch"``, is the float64 path, e.g. for gradcheck).
    """
    if x.dtype != torch.float32 or params.dtype != torch.float32:
        raise RuntimeError(
            f"backend 'triton' computes in float32 (x: {x.dtype}, params: {params.dtype}); "
            "use backend='torch' for float64"
        )
    check_device(x.device)
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"out_dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {out_dtype}"
        )
    return _TritonGridFunction.apply(x.contiguous(), params.contiguous(), geometry, out_dtype)
