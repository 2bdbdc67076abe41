"""Pure-PyTorch multiresolution hash grid: the twin of tiny-cuda-nn's ``GridEncoding``.

What it matches, measured against tinycudann 2.0 (tiny-cuda-nn 6ee3546, torch bindings built
with ``--use_fast_math``) on an NVIDIA H100, three configs x 8192 points x float32 and half
mode (tests/gpu_golden/grid.npz, tests/test_gpu_golden_grid.py):

- Forward, given tcnn's level scales: bit-equal on every level of nvdiffrec's config
  (16 levels, hashed), a coarse dense one and a 2-D Smoothstep one with 4 features, in float32
  and in half mode. The kernel's arithmetic, modelled here: ``pos = fmaf(scale, x, 0.5)``,
  ``frac = pos - floor(pos)``, weights ``((1 * w_0) * w_1) ...`` in float32, then per corner in
  tcnn's order ``result = fma((T)weight, value, result)`` from zero (``kernel_grid`` in
  include/tiny-cuda-nn/encodings/grid.h; ``fma`` of vec.h): ``fmaf`` in float32, and in half
  mode the weight rounded to half and ``__hfma2`` on the half table value (one half rounding
  per corner). Nearest returns the lower corner's value.
- Level scales: ``exp2f(l * log2f(per_level_scale)) * base_resolution - 1`` with one fmaf
  (nvcc contracts it). Under ``--use_fast_math`` tcnn's ``exp2f`` is PTX ``ex2.approx.ftz.f32``,
  measured 0 or +1 float32 ulp above the correctly rounded value on the H100. mptex knows no
  bit-exact CPU model of that instruction: on CUDA the twin runs the instruction itself
  (:func:`grid_geometry`'s ``exp2="cuda-ex2"``, the encoding's default there), on a CPU it
  uses the correctly rounded value (bit-equal levels wherever it coincides; elsewhere up to
  8e-4 apart, measured) or, opted in, ``H100_EX2_TABLE`` (tcnn's measured values for the
  three configs' inputs).
- Parameter gradient: float32 within 4e-7 relative per level (tcnn adds with atomics in any
  order; the twin in a fixed order); half mode within 1.6e-3 (tcnn accumulates the gradient
  table in half with atomics, the twin in float32, unscaled and rounded to half once).

Deterministic where tcnn is (scales, resolutions, table sizes and offsets, cells, hash and
dense indices, wraparound, corner order, weights, forward) it reproduces tcnn bit for bit, and
its own results do not depend on the machine: the level scales come from exact arithmetic
(not the CPU's math library), and the eager ops use no operation whose rounding depends on
ATen's or MKL's CPU dispatch (golden bits checked under ATEN_CPU_CAPABILITY=default, avx2 and
avx512 and MKL_ENABLE_INSTRUCTIONS=AVX2). It runs on any device torch supports.

Layout and speed: indices, weights and features are computed level-major (``[L, N, ...]``),
as tcnn's kernels do one level per block, so that one level's table stays in cache while it is
gathered from and scattered into. Rows of ``F`` features are moved as single complex/float64
elements where ``F * 4`` bytes allows it, which turns the gather and the gradient scatter into
one-dimensional ``index_select``/``scatter_add_`` calls.

On a CPU (float32 points and table, up to 4 dimensions) the op runs in a small C kernel
(:mod:`mptex._native_cpu`, built with the system C compiler on first use) with the same
arithmetic and the same scatter order, so the same bits (tested against golden tensors of the
eager implementation, ``tests/test_grid_torch.py``); the eager ops below run everywhere else,
and without a compiler or with ``MPTEX_NATIVE=0``. Its forward+backward costs about 1.1-1.3x
the bare ``index_select`` + ``scatter_add_`` of the same rows (``docs/cpu-speed.md``).
"""

from __future__ import annotations

import decimal
import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from mptex._native_cpu import (
    grid_backward_native,
    grid_forward_native,
    grid_points,
    grid_supported,
    native_kernels,
)
from mptex._profiler_scope import profiler_scope

__all__ = ["EXP2_MODES", "H100_EX2_TABLE", "GridGeometry", "grid_geometry", "hash_grid_encode"]

# tiny-cuda-nn's hash primes (fast_hash in encodings/grid.h); the first is 1 on purpose
# (memory coherence along x).
HASH_PRIMES = (1, 2654435761, 805459861, 3674653429, 2097192037, 1434869437, 2165219737)
_UINT32 = 0xFFFFFFFF
# tcnn's torch bindings multiply dL/dy by this before a half-precision backward and divide
# the input and parameter gradients by it afterwards (modules.py, `loss_scale`).
TCNN_HALF_LOSS_SCALE = 128.0
INTERPOLATIONS = ("Nearest", "Linear", "Smoothstep")
GRID_TYPES = ("Hash", "Dense")


@dataclass(frozen=True)
class GridGeometry:
    """Per-level constants of a grid encoding, as tcnn computes them.

    Attributes:
        n_input_dims: D, the number of input coordinates.
        n_features_per_level: F.
        interpolation: "Nearest", "Linear" or "Smoothstep".
        scales: [L] float32 values ``exp2f(l * log2f(per_level_scale)) * base_resolution - 1``
            as the CUDA kernel evaluates them (one fused multiply-add for the last step; the
            ``exp2f`` as :func:`grid_geometry`'s ``exp2`` says).
        resolutions: [L] ``ceil(scale) + 1`` with the kernel's scale (used for indexing).
        table_sizes: [L] entries per level (host formula: ``min(2^log2_hashmap_size,
            next_multiple(res^D, 8))`` for hash grids).
        offsets: [L + 1] first entry of each level; ``offsets[-1]`` is the number of entries.
        hashed: [L] True where ``res^D`` exceeds the level's table size.
    """

    n_input_dims: int
    n_features_per_level: int
    interpolation: str
    scales: tuple[float, ...]
    resolutions: tuple[int, ...]
    table_sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    hashed: tuple[bool, ...]

    @property
    def n_levels(self) -> int:
        return len(self.scales)

    @property
    def n_entries(self) -> int:
        return self.offsets[-1]

    @property
    def n_params(self) -> int:
        return self.offsets[-1] * self.n_features_per_level

    @property
    def n_output_dims(self) -> int:
        return self.n_levels * self.n_features_per_level


# Level-scale exponentials (``exp2f(level * log2f(per_level_scale))``), see grid_geometry.
EXP2_MODES = ("correctly-rounded", "cuda-ex2", "h100-table")

# tcnn 2.0's level exponentials as measured on an NVIDIA H100 (tinycudann 2.0 from tiny-cuda-nn
# 6ee3546, torch bindings built with --use_fast_math, so exp2f is PTX ex2.approx.ftz.f32):
# float32 bits of the ex2 input -> float32 bits of its result. They are the inputs of the
# three configs of the GPU kit (per_level_scale 1.4472692374403782 over 16 levels, 2.0 over
# 4, 1.5 over 8), each read back from tcnn's float32 outputs as the only float32 scale within
# 4 ulps that reproduces them (tests/gpu_golden/grid.npz). A lookup of these inputs, not an
# emulation of the instruction: other inputs get the correctly rounded value.
H100_EX2_TABLE = {
    0x3F088888: 0x3FB9401F, 0x3F15C01A: 0x3FC00000, 0x3F800000: 0x40000000,
    0x3F888888: 0x40060DBC, 0x3F95C01A: 0x40100000, 0x3FCCCCCC: 0x404202FF,
    0x3FE0A027: 0x40580000, 0x40000000: 0x40800000, 0x40088888: 0x408C64C2,
    0x4015C01A: 0x40A20000, 0x402AAAAA: 0x40CB2FF4, 0x403B3020: 0x40F2FFFE,
    0x40400000: 0x41000000, 0x404CCCCC: 0x4113088C, 0x4060A027: 0x41364000,
    0x406EEEEE: 0x4154CC00, 0x40830817: 0x4188B000, 0x40888888: 0x4199FCB8,
    0x40999999: 0x41DEDC65, 0x40AAAAAA: 0x42214516, 0x40BBBBBB: 0x426966A2,
    0x40CCCCCC: 0x42A8E5A0, 0x40DDDDDD: 0x42F4707C, 0x40EEEEEE: 0x4330E282,
    0x40FFFFFF: 0x437FFFFB,
}  # fmt: skip


def _round_f32(value: Fraction) -> np.float32:
    """The float32 nearest to an exact rational (ties to even; normal range)."""
    guess = np.float32(float(value))
    candidates = [
        np.nextafter(guess, np.float32(-np.inf)),
        guess,
        np.nextafter(guess, np.float32(np.inf)),
    ]
    return min(
        candidates,
        key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.uint32)) & 1),
    )


def _log2f(value: np.float32) -> np.float32:
    """Correctly rounded float32 log2 (tcnn's host ``std::log2(float)``: glibc's log2f, whose
    error is below one ulp; it agrees on the three configs of tests/gpu_golden)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        exact = decimal.Decimal(float(value)).ln() / decimal.Decimal(2).ln()
    return _round_f32(Fraction(exact))


def _exp2f(value: np.float32) -> np.float32:
    """Correctly rounded float32 2^value, computed with 60 decimal digits: the same on every
    machine (numpy's float32 exp2 is a SIMD routine chosen by the CPU's features)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        exact = (decimal.Decimal(float(value)) * decimal.Decimal(2).ln()).exp()
    return _round_f32(Fraction(exact))


def _level_exponentials(inputs: list[np.float32], exp2: str) -> list[np.float32]:
    """``exp2f`` of the level inputs as tcnn's kernels evaluate it, by ``exp2`` mode."""
    if exp2 == "cuda-ex2":
        from mptex._ex2_cuda import ex2_approx_cuda  # imports triton: only here

        return [np.float32(v) for v in ex2_approx_cuda([float(v) for v in inputs])]
    out = []
    for value in inputs:
        bits = int(value.view(np.uint32))
        if exp2 == "h100-table" and bits in H100_EX2_TABLE:
            out.append(np.uint32(H100_EX2_TABLE[bits]).view(np.float32))
        elif bits == 0:
            out.append(np.float32(1.0))  # 2^0, which ex2.approx returns exactly
        else:
            out.append(_exp2f(value))
    return out


def grid_geometry(
    n_input_dims: int,
    n_levels: int,
    n_features_per_level: int,
    log2_hashmap_size: int,
    base_resolution: int,
    per_level_scale: float,
    interpolation: str = "Linear",
    grid_type: str = "Hash",
    exp2: str = "correctly-rounded",
) -> GridGeometry:
    """Compute tcnn's per-level constants (see :class:`GridGeometry`).

    ``per_level_scale`` goes through float32 and ``log2f`` exactly as tcnn's JSON config does,
    which is what makes nvdiffrec's 16 -> 4096 config give resolution 65 at level 5. The level
    input ``level * log2f(per_level_scale)`` is a float32 product; its ``exp2f`` is what
    ``exp2`` says:

    * ``"correctly-rounded"``: the float32 nearest to the exact power (the host's value, and
      tcnn's on the GPU within its instruction's error). tcnn's kernels are built with
      ``--use_fast_math``, so their ``exp2f`` is PTX ``ex2.approx.ftz.f32``, which on an H100
      was measured 0 to +1 float32 ulps from this value (+1 at 8 of nvdiffrec's 16 levels and
      1 of the 8 levels of per_level_scale 1.5; CUDA's math documentation bounds exp2f at 2 ulps).
      No bit-exact model of that instruction is known to mptex, so on a CPU this is the mode;
      a 1-ulp scale moves positions by up to ``x * ulp(scale)`` and the level's outputs by up
      to ~1e-3 for table values of order 1 (8e-4 measured on nvdiffrec's finest level).
    * ``"cuda-ex2"``: the instruction itself, run once on the current CUDA device (a Triton
      kernel with inline PTX): tcnn's scales on that device.
    * ``"h100-table"``: ``H100_EX2_TABLE``, tcnn's results measured on an H100 for the inputs
      of the three configs of tests/gpu_golden (nvdiffrec's, per_level_scale 2.0 and 1.5);
      other inputs fall back to the correctly rounded value. A lookup, not an emulation.
    """
    if exp2 not in EXP2_MODES:
        raise ValueError(f"exp2 must be one of {EXP2_MODES}, got {exp2!r}")
    # Tested by name below (grid_type == "Hash", the interpolation in the kernels): an unknown
    # name would silently select the dense grid or linear interpolation.
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    if grid_type not in GRID_TYPES:
        raise ValueError(f"grid_type must be one of {GRID_TYPES}, got {grid_type!r}")
    log2_scale = _log2f(np.float32(per_level_scale))
    base = np.float32(base_resolution)
    inputs = [np.float32(np.float32(level) * log2_scale) for level in range(n_levels)]
    host_pows = _level_exponentials(inputs, "correctly-rounded")
    kernel_pows = host_pows if exp2 == "correctly-rounded" else _level_exponentials(inputs, exp2)
    scales, resolutions, table_sizes, offsets, hashed = [], [], [], [0], []
    for level in range(n_levels):
        # Host (offset table): two roundings. Device (kernel): nvcc contracts to one fmaf.
        host_scale = np.float32(host_pows[level] * base) - np.float32(1.0)
        kernel_scale = _fma_f32(torch.tensor(kernel_pows[level]), torch.tensor(base), -1.0).item()
        host_res = int(math.ceil(float(host_scale))) + 1
        dense_size = host_res**n_input_dims
        max_params = np.iinfo(np.uint32).max // 2
        if float(host_res) ** n_input_dims > max_params:
            dense_size = max_params
        size = -(-dense_size // 8) * 8  # next multiple of 8, for aligned accesses
        if grid_type == "Hash":
            size = min(size, 1 << log2_hashmap_size)
        kernel_res = int(math.ceil(float(kernel_scale))) + 1
        scales.append(kernel_scale)
        resolutions.append(kernel_res)
        table_sizes.append(size)
        offsets.append(offsets[-1] + size)
        hashed.append(grid_type == "Hash" and kernel_res**n_input_dims > size)
    return GridGeometry(
        n_input_dims=n_input_dims,
        n_features_per_level=n_features_per_level,
        interpolation=interpolation,
        scales=tuple(scales),
        resolutions=tuple(resolutions),
        table_sizes=tuple(table_sizes),
        offsets=tuple(offsets),
        hashed=tuple(hashed),
    )


# ----------------------------------------------------------------------------------------
# Positions: one float32 rounding of scale * x + 0.5, as fmaf.


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c, nonnegative_product=False):
    """Exactly rounded float32 ``a * b + c`` for float32 tensors (broadcasting), like fmaf.

    ``c`` is a float or a float32 tensor. The product is exact in float64 (24 + 24 bits) and
    the float64 sum ``s`` is rounded once. Rounding ``s`` to float32 is then correct unless
    ``s`` sits exactly on a float32 midpoint (or in float32's subnormal range), where the first
    rounding may have decided the tie; those rare elements take the exact error of the sum
    (TwoSum) into account, rounding to odd. With ``c = 0.5`` and a product known to be >= 0,
    ``s`` is exact unless the product is below 2^-6 (the sum then spans at most 53 bits), which
    narrows the suspects further. No host synchronisation: the correction is selected per
    element on the tensors' device.
    """
    product = a.double() * b.double()
    addend = c.double() if isinstance(c, torch.Tensor) else c
    total = product + addend
    low_bits = total.view(torch.int64) & 0x1FFFFFFF  # the 29 bits float32 drops
    if nonnegative_product and c == 0.5:
        suspect = (low_bits == 0x10000000) & (product < 2.0**-6)
    else:
        suspect = (low_bits == 0x10000000) | (total.abs() < 2.0**-125)
    # The correction is computed everywhere and kept where suspect: selecting the suspects
    # first would read back whether there are any, a host synchronisation per call on a GPU
    # (the torch grid calls this once per corner).
    b_virtual = total - product
    error = (product - (total - b_virtual)) + (addend - b_virtual)
    towards = torch.where(error > 0, math.inf, -math.inf).to(total.dtype)
    even = (total.view(torch.int64) & 1) == 0
    fix = suspect & (error != 0) & even
    total = torch.where(fix, torch.nextafter(total, towards), total)
    return total.float()


def _hfma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded half ``a * b + c`` (``fma.rn.f16``, tcnn's ``__hfma2``) of half values
    held in float32 tensors; returns float32 holding the half result.

    ``a * b`` is exact in float32 (11 + 11 significant bits, exponents within float32's normal
    range); the float32 sum is made round-to-odd with its exact error (TwoSum), so that the
    final rounding to half (13 bits fewer) is the single correct rounding of the exact value.
    """
    product = a * b
    total = product + c
    b_virtual = total - product
    error = (product - (total - b_virtual)) + (c - b_virtual)
    even = (total.view(torch.int32) & 1) == 0
    fix = (error != 0) & even
    # No "if fix.any()" first: that read would synchronise the host with a GPU on every call.
    towards = torch.where(error > 0, math.inf, -math.inf).to(total.dtype)
    total = torch.where(fix, torch.nextafter(total, towards), total)
    return total.to(torch.float16).to(torch.float32)


# Devices without float64 (Apple's MPS): the exact fmaf emulation runs on the CPU for them.
NO_FLOAT64_DEVICES = {"mps"}


def _positions(x: torch.Tensor, scales: torch.Tensor, in_unit_cube: bool = False) -> torch.Tensor:
    """pos: [D, L, N] = fma(scale_l, x, 0.5) in x's dtype (one rounding for float32)."""
    scale = scales.view(1, -1, 1)
    coords = x.t().unsqueeze(1)  # [D, 1, N]
    if x.dtype == torch.float32 and x.device.type in NO_FLOAT64_DEVICES:
        exact = _fma_f32(scale.cpu(), coords.cpu(), 0.5, nonnegative_product=in_unit_cube)
        return exact.to(x.device)
    if x.dtype == torch.float32:
        return _fma_f32(scale, coords, 0.5, nonnegative_product=in_unit_cube)
    return torch.addcmul(torch.full_like(coords, 0.5), scale, coords)


# ----------------------------------------------------------------------------------------
# Everything below is level-major, [L, C, n] with C = 2^D corners and the points innermost:
# each elementwise op runs over long contiguous rows instead of broadcasting over a size-2
# innermost dimension (~50x slower in eager PyTorch on a CPU), and the gather and the gradient
# scatter visit one level's table at a time (cache reuse, as tcnn's kernels do per level).


def _combine_corners(parts: torch.Tensor, op) -> torch.Tensor:
    """[D, L, 2, n] per-dimension parts -> [L, 2^D, n] corners, dimension 0 fastest.

    Corner ``c`` takes part ``(c >> d) & 1`` of dimension ``d``: tcnn's corner order and, for
    weights, tcnn's multiplication order ``((w_0 * w_1) * w_2) ...``.
    """
    out = parts[0]
    for dim in range(1, parts.shape[0]):
        out = op(out.unsqueeze(1), parts[dim].unsqueeze(2)).flatten(1, 2)
    return out


@dataclass(frozen=True)
class _LevelGroup:
    """A contiguous run of levels indexed the same way (all dense or all hashed), with its
    constants as [Lg, 1, 1] tensors on one device."""

    start: int
    stop: int
    hashed: bool
    sizes: torch.Tensor
    offsets: torch.Tensor
    multipliers: torch.Tensor  # [D, Lg, 1, 1]: hash primes, or dense strides res^d


@functools.lru_cache(maxsize=64)
def _level_groups(geometry: GridGeometry, device: torch.device) -> tuple[_LevelGroup, ...]:
    # Resolutions grow with the level (per_level_scale >= 1), so the dense levels are a
    # prefix and the hashed levels the rest.
    dims, groups = geometry.n_input_dims, []
    boundary = sum(1 for hashed in geometry.hashed if not hashed)
    if geometry.hashed != (False,) * boundary + (True,) * (geometry.n_levels - boundary):
        raise ValueError(
            f"geometry: hashed levels must follow the dense ones (per_level_scale >= 1), "
            f"got hashed={geometry.hashed}"
        )
    for start, stop, hashed in ((0, boundary, False), (boundary, geometry.n_levels, True)):
        if start == stop:
            continue
        levels = range(start, stop)
        if hashed:
            multipliers = (
                torch.tensor(HASH_PRIMES[:dims]).view(dims, 1, 1).expand(dims, len(levels), 1)
            )
        else:
            res = torch.tensor([geometry.resolutions[l] for l in levels])
            multipliers = (res.view(1, -1) ** torch.arange(dims).view(-1, 1)).view(dims, -1, 1)
        groups.append(
            _LevelGroup(
                start=start,
                stop=stop,
                hashed=hashed,
                sizes=_per_level([geometry.table_sizes[l] for l in levels], device),
                offsets=_per_level([geometry.offsets[l] for l in levels], device),
                multipliers=multipliers.unsqueeze(-1).contiguous().to(device),
            )
        )
    return tuple(groups)


def _per_level(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device).view(-1, 1, 1)


def _corner_rows(cells: torch.Tensor, group: _LevelGroup, in_unit_cube: bool, out: torch.Tensor):
    """Table rows (entry indices, level offsets included) of the 2^D corners of each cell.

    Args:
        cells: [D, Lg, n] int64 lower corners of the group's levels, as uint32 values.
        in_unit_cube: all inputs are in [0, 1], so cells are in [0, res) and no uint32
            arithmetic can wrap; the general path spells out tcnn's uint32 wraparound.
        out: [Lg, 2^D, n] int64, receives the rows.
    """
    corner = torch.stack((cells, cells + 1), dim=2)  # [D, Lg, 2, n]
    if not in_unit_cube:
        corner &= _UINT32
    parts = corner * group.multipliers
    if group.hashed:
        # Hashed tables are powers of two, so `% size` is a mask, and masks distribute over
        # XOR; the mask also keeps the low 32 bits of the product, tcnn's uint32 multiply.
        local = _combine_corners(parts & (group.sizes - 1), torch.bitwise_xor)
    elif in_unit_cube:
        # index <= res + res^2 + ... + res^D < 2 * size: tcnn's `% size` (the wraparound at
        # x = 1) is at most one subtraction.
        local = _combine_corners(parts, torch.add)
        local = torch.where(local >= group.sizes, local - group.sizes, local)
    else:
        local = (_combine_corners(parts & _UINT32, torch.add) & _UINT32) % group.sizes
    torch.add(local, group.offsets, out=out)


def _axis_weights(frac: torch.Tensor, interpolation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[D, L, n] fractions -> (weights [D, L, 2, n] of bits 0/1, d weight_1 / d frac)."""
    if interpolation == "Smoothstep":
        weight_one = frac * frac * (3.0 - 2.0 * frac)
        derivative = 6.0 * frac * (1.0 - frac)
    else:
        weight_one = frac
        derivative = torch.ones_like(frac)
    return torch.stack((1.0 - weight_one, weight_one), dim=2), derivative


# ----------------------------------------------------------------------------------------
# Rows of F features move as "row elements": one complex number per 2 features (F even), so
# the gather, the weighting and the gradient scatter are one-dimensional ops with no size-2
# innermost dimension (a complex times a real weight is exact: (a + bi) * w = aw + bwi).


# Devices whose complex64 gather/scatter kernels the twin relies on; elsewhere rows stay real
# [E, F] (slower: index_add_ on rows of F values).
COMPLEX_DEVICES = {"cpu", "cuda"}


def _row_view(table: torch.Tensor, n_features: int) -> torch.Tensor:
    """[E * F] -> [E] (F = 2, complex), [E, F / 2] (complex), [E] (F = 1) or [E, F] (real)."""
    complex_ok = table.device.type in COMPLEX_DEVICES and table.dtype in (
        torch.float32,
        torch.float64,
    )
    if n_features % 2 == 0 and complex_ok:
        rows = torch.view_as_complex(table.view(-1, n_features // 2, 2))
        return rows.squeeze(1) if n_features == 2 else rows
    return table.view(-1, n_features).squeeze(1) if n_features == 1 else table.view(-1, n_features)


def _real_rows(elements: torch.Tensor, n_features: int) -> torch.Tensor:
    """Row elements [L, C, n, (k)] -> real values [L, C, n, F]."""
    if elements.is_complex():
        return torch.view_as_real(elements).reshape(*elements.shape[:3], n_features)
    return elements if elements.dim() == 4 else elements.unsqueeze(-1)


def _weighted(elements: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Row elements [L, C, n, (k)] times weights [L, C, n]."""
    return elements * (weights.unsqueeze(-1) if elements.dim() == 4 else weights)


def _scatter_rows(grad: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, n_features: int):
    """Add row elements values (M of them, any shape) into the flat table grad [E * F] at rows
    [M] int64."""
    grad_rows = _row_view(grad, n_features)
    values = values.reshape(rows.shape[0], *grad_rows.shape[1:])
    if grad_rows.dim() == 1:
        grad_rows.scatter_add_(0, rows, values)
    else:
        grad_rows.index_add_(0, rows, values)


# ----------------------------------------------------------------------------------------
# The op.


# Points are processed in chunks so that the [D or C, L, chunk] temporaries stay in cache:
# eager PyTorch on a CPU is bound by memory traffic here, not arithmetic.
# On a GPU there is no cache to fit and every chunk costs ~50 kernel launches, so chunks are
# large there (2^18 points: ~400 MB of rows and weights for nvdiffrec's 16 levels).
CHUNK_POINTS = {"cpu": 16384, "other": 1 << 18}


def _chunk_size(device: torch.device) -> int:
    return CHUNK_POINTS["cpu" if device.type == "cpu" else "other"]


class _Lookup:
    """Rows and weights of one chunk of points, [L, C, n], plus what dL/dx needs."""

    def __init__(self, x: torch.Tensor, geometry: GridGeometry, scales: torch.Tensor, in_unit_cube):
        n_levels, n_points = geometry.n_levels, x.shape[0]
        pos = _positions(x, scales, in_unit_cube)  # [D, L, n]
        floor = torch.floor(pos)
        frac = pos - floor  # exact: pos and floor(pos) are floats of adjacent binades at most
        cells = floor.to(torch.int64)  # (uint32_t)(int)floorf(pos), masked where it matters
        nearest = geometry.interpolation == "Nearest"
        n_corners = 2**geometry.n_input_dims
        rows = torch.empty(n_levels, n_corners, n_points, dtype=torch.int64, device=x.device)
        for group in _level_groups(geometry, x.device):
            levels = slice(group.start, group.stop)
            _corner_rows(cells[:, levels], group, in_unit_cube, out=rows[levels])
        self.n_dims = geometry.n_input_dims
        # Nearest reads the lower corner only.
        self.rows = rows[:, :1].contiguous() if nearest else rows
        if nearest:
            self.weights = torch.ones(n_levels, 1, n_points, dtype=x.dtype, device=x.device)
            self.axis_weights = self.derivative = None
        else:
            self.axis_weights, self.derivative = _axis_weights(frac, geometry.interpolation)
            self.weights = _combine_corners(self.axis_weights, torch.mul)  # [L, C, n]


def _interpolate(elements, weights, n_features: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Row elements [L, C, n, (k)] (values already in the table dtype), weights [L, C, n]
    -> [L, n, F] in out_dtype.

    tcnn's kernel (``kernel_grid`` in encodings/grid.h) starts from a zero result and takes one
    fused multiply-add per corner, in corner order: ``result = fma((T)weight, value, result)``.
    In float32 that is ``fmaf`` (one rounding per corner); in half mode the float32 weight is
    rounded to half and ``__hfma2`` adds in half (one half rounding per corner). Nearest returns
    the lower corner's value itself (no fma: a -0 stays -0).
    """
    values = _real_rows(elements, n_features)  # [L, C, n, F]
    if weights.shape[1] == 1:  # Nearest
        return values[:, 0].to(out_dtype)
    w = weights.unsqueeze(-1)
    acc = torch.zeros_like(values[:, 0])
    if out_dtype == torch.float16:
        w = w.to(torch.float16).to(values.dtype)
        for corner in range(values.shape[1]):
            acc = _hfma(w[:, corner], values[:, corner], acc)
        return acc.to(torch.float16)
    if values.dtype == torch.float64:  # float64 twin: plain float64 arithmetic
        for corner in range(values.shape[1]):
            acc = acc + w[:, corner] * values[:, corner]
        return acc.to(out_dtype)
    for corner in range(values.shape[1]):
        acc = _fma_f32(w[:, corner], values[:, corner], acc)
    return acc.to(out_dtype)


def _table_dtype(out_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the table is read in: half (tcnn's half mode) or bfloat16 for those outputs."""
    return out_dtype if out_dtype in (torch.float16, torch.bfloat16) else None


def _gather_features(params, lookup: _Lookup, geometry: GridGeometry, table_dtype):
    """[L, C, n, (k)] row elements at the lookup's rows (rounded to ``table_dtype``, the half
    or bfloat16 modes' table, unless None)."""
    n_levels, n_corners, n_points = lookup.rows.shape
    n_features = geometry.n_features_per_level
    table = _row_view(params, n_features)
    elements = table.index_select(0, lookup.rows.view(-1))
    if table_dtype is not None:
        # Half (bfloat16) mode reads a half (bfloat16) copy of the table; rounding each
        # gathered entry is the same as rounding the table first.
        real = torch.view_as_real(elements) if elements.is_complex() else elements
        real.copy_(real.to(table_dtype))
    return elements.view(n_levels, n_corners, n_points, *table.shape[1:])


class _HashGridFunction(torch.autograd.Function):
    """The encoding as one autograd node. The forward keeps each chunk's lookup (rows, weights:
    12 bytes per point, level and corner) for the backward instead of recomputing it, which on a
    CPU costs about as much again as the forward."""

    @staticmethod
    def forward(ctx, x, params, geometry: GridGeometry, out_dtype: torch.dtype):
        with profiler_scope("mptex.grid.forward"):
            return _HashGridFunction._forward(ctx, x, params, geometry, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with profiler_scope("mptex.grid.backward"):
            return _HashGridFunction._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, x, params, geometry: GridGeometry, out_dtype: torch.dtype):
        n_points, n_levels = x.shape[0], geometry.n_levels
        n_features = geometry.n_features_per_level
        half = out_dtype == torch.float16
        ctx.native = _native(x, params, geometry, out_dtype)
        if ctx.native is not None:
            ctx.geometry, ctx.out_dtype = geometry, out_dtype
            xs = grid_points(x)
            ctx.save_for_backward(x, params, xs)
            return grid_forward_native(ctx.native, geometry, x, params, half, xs)
        scales = torch.tensor(geometry.scales, dtype=x.dtype, device=x.device)
        in_unit_cube = n_points == 0 or bool(((x >= 0) & (x <= 1)).all())
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        out = torch.empty(n_points, n_levels, n_features, dtype=out_dtype, device=x.device)
        lookups = []
        chunk = _chunk_size(x.device)
        for start in range(0, n_points, chunk):
            end = min(start + chunk, n_points)
            lookup = _Lookup(x[start:end], geometry, scales, in_unit_cube)
            features = _gather_features(params, lookup, geometry, _table_dtype(out_dtype))
            out[start:end] = _interpolate(
                features, lookup.weights, n_features, out_dtype
            ).transpose(0, 1)
            if keep:
                lookups.append((start, end, lookup))
        ctx.geometry, ctx.out_dtype, ctx.lookups, ctx.scales = geometry, out_dtype, lookups, scales
        ctx.save_for_backward(x, params)
        return out.view(n_points, n_levels * n_features)

    @staticmethod
    def _backward(ctx, grad_out):
        geometry, half = ctx.geometry, ctx.out_dtype == torch.float16
        x, params, *xs = ctx.saved_tensors  # xs: the C kernel's layout of x (native only)
        n_points, n_levels = x.shape[0], geometry.n_levels
        n_features = geometry.n_features_per_level
        if half:
            # tcnn's bindings run the half backward on dL/dy * 128 (overflowing where it does).
            grad_out = grad_out.to(torch.float16) * TCNN_HALF_LOSS_SCALE
        grad_out = grad_out.to(x.dtype).view(n_points, n_levels, n_features)
        want_x, want_params = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.native is not None:
            chunk = _chunk_size(x.device)
            grad_params, grad_x = grid_backward_native(
                ctx.native, geometry, x, params, half, grad_out, chunk, want_x, xs[0]
            )  # the half table comes back unscaled
            grad_params = grad_params if want_params else None
        else:
            grad_x, grad_params = _backward_eager(ctx, x, params, grad_out, want_x, want_params)
        if want_params and half and ctx.native is None:
            # tcnn's gradient table is half; it is unscaled in half and then reaches the f32
            # master through the cast.
            grad_params = (grad_params.to(torch.float16) / TCNN_HALF_LOSS_SCALE).to(x.dtype)
        if want_x and half:
            grad_x = grad_x / TCNN_HALF_LOSS_SCALE
        return grad_x, grad_params, None, None


def _native(x: torch.Tensor, params: torch.Tensor, geometry: GridGeometry, out_dtype):
    """The C kernel (mptex._native_cpu) where it computes this op: float32 points and table on
    the CPU, a geometry it takes, a C compiler; else None (the eager ops below)."""
    if not (
        x.device.type == "cpu"
        and x.dtype == params.dtype == torch.float32
        and out_dtype in (torch.float32, torch.float16)
        and grid_supported(geometry)
    ):
        return None
    _level_groups(geometry, x.device)  # the eager op's check of the geometry (ValueError)
    return native_kernels()


def _backward_eager(ctx, x, params, grad_out, want_x: bool, want_params: bool):
    """dL/dx and dL/dparams (before the half mode's unscaling) from the kept lookups."""
    geometry, table_dtype = ctx.geometry, _table_dtype(ctx.out_dtype)
    n_features = geometry.n_features_per_level
    grad_x = x.new_empty(x.shape) if want_x else None
    grad_params = params.new_zeros(params.shape) if want_params else None
    for start, end, lookup in ctx.lookups:
        grad = grad_out[start:end].transpose(0, 1).contiguous()  # [L, n, F]
        if want_params:
            grad_elements = _row_view(grad.view(-1), n_features)
            grad_elements = grad_elements.view(
                grad.shape[0], 1, grad.shape[1], *grad_elements.shape[1:]
            )
            contributions = _weighted(grad_elements, lookup.weights)  # [L, C, n, (k)]
            _scatter_rows(grad_params, lookup.rows.view(-1), contributions, n_features)
        if want_x:
            features = _real_rows(
                _gather_features(params, lookup, geometry, table_dtype), n_features
            )
            grad_x[start:end] = _input_gradient(grad, features, lookup, ctx.scales)
    return grad_x, grad_params


def _sum_in_order(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum along ``dim`` slice by slice with elementwise adds: the same rounding whatever the
    tensor's shape, so a point's result does not depend on the batch or chunk it is in."""
    out = values.select(dim, 0)
    for index in range(1, values.shape[dim]):
        out = out + values.select(dim, index)
    return out


def _input_gradient(grad, features, lookup: _Lookup, scales: torch.Tensor) -> torch.Tensor:
    """dL/dx: [n, D] from dL/dy [L, n, F] and the corner values [L, C, n, F]."""
    if lookup.axis_weights is None:  # Nearest: piecewise constant, zero derivative
        return grad.new_zeros(grad.shape[1], lookup.n_dims)
    dims = lookup.n_dims
    # g_c = sum_f dL/dy_f * value_{c,f}: the loss change per unit of corner weight.
    corner_grad = _sum_in_order(features * grad.unsqueeze(1), -1)  # [L, C, n]
    sign = torch.tensor([-1.0, 1.0], dtype=grad.dtype, device=grad.device).view(2, 1)
    columns = []
    for dim in range(dims):
        # d weight_c / d frac_dim = (-1 or +1 by bit dim of c) * the other axes' weights.
        axis_weights = lookup.axis_weights.clone()
        axis_weights[dim] = sign
        d_weights = _combine_corners(axis_weights, torch.mul)  # [L, C, n]
        d_frac = _sum_in_order(d_weights * corner_grad, 1)  # [L, n]
        d_pos = d_frac * lookup.derivative[dim] * scales.view(-1, 1)
        columns.append(_sum_in_order(d_pos, 0))
    return torch.stack(columns, dim=-1)


def hash_grid_encode(
    x: torch.Tensor, params: torch.Tensor, geometry: GridGeometry, out_dtype: torch.dtype
) -> torch.Tensor:
    """Encode points with a multiresolution grid, tcnn's ``GridEncoding`` in pure PyTorch.

    Args:
        x: [N, D] float32 (or float64 with float64 params), nominally in [0, 1]; values outside
            are not clamped and index the table as tcnn's uint32 arithmetic does.
        params: [n_params] flat table in tcnn's layout: entry ``i`` of level ``l``, feature
            ``f`` at ``(offsets[l] + i) * F + f``.
        geometry: the level constants, from :func:`grid_geometry`.
        out_dtype: float32 (or float64), or float16 for tcnn's half mode (half table values,
            half accumulation, half output, backward with tcnn's fixed loss scale of 128), or
            bfloat16 for mptex's bfloat16 mode, which tcnn does not have: bfloat16 table values,
            float32 weights and sums (the float32 path's), bfloat16 output; the backward is the
            float32 path's on the bfloat16 ``dL/dy`` (no loss scale: bfloat16 has float32's
            exponent range), the parameter gradient float32, summed in float32.

    Returns:
        [N, L * F] in ``out_dtype``, level-major (features of level 0 first).

    Raises:
        ValueError: ``x`` is not [N, D], ``params`` does not hold ``geometry.n_params``
            values (the C kernel would read past them) or is not float32 or float64 (the
            master table; ``out_dtype`` is the compute dtype).
    """
    if x.dim() != 2 or x.shape[1] != geometry.n_input_dims:
        raise ValueError(f"x: expected shape [N, {geometry.n_input_dims}], got {list(x.shape)}")
    if params.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"params: expected float32 or float64 (the master table; out_dtype sets the compute "
            f"dtype), got {params.dtype}"
        )
    if params.numel() != geometry.n_params:
        raise ValueError(
            f"params: expected {geometry.n_params} values (geometry.n_params), got {params.numel()}"
        )
    return _HashGridFunction.apply(x, params, geometry, out_dtype)
