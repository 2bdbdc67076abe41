"""Triton kernels of ``mptex::fp8_quantize`` on CUDA: the C kernel's arithmetic, bit for bit.

The contract is :mod:`mptex._fp8_fused`'s module docstring; the arithmetic is that of the C
kernel ``mptex_fp8_quantize`` (:mod:`mptex._native_cpu`, "FP8 quantisation") and of its eager
twin :func:`mptex._fp8_fused.fp8_quantize_reference`. Nothing here synchronises with the host:
the grids depend on shapes only, every scalar stays on the device.

Launches:

* per-tensor recipes (0 delayed, 1 current): two kernels over ``P = min(blocks, 512)``
  programs, each looping over the blocks ``pid, pid + P, ...`` of ``_BLOCK`` elements:

  1. ``_amax_partials_kernel``: each program writes the largest ``|x|`` bit pattern of its
     blocks (one int32 partial);
  2. ``_scale_cast_kernel``: every program reduces the ``P`` partials (cheap) to the amax,
     computes the scale as the C code does and casts its blocks; program 0 also writes
     ``scale_inv``, ``amax``, ``used``, ``next_scale`` and (delayed, recording) the history;

  a tensor of at most ``_ONE_PROGRAM_BLOCKS`` blocks (a layer's weight) is one launch of
  ``_scale_cast_kernel`` with one program that takes the amax of its blocks itself
  (``OWN_AMAX``) before the cast: on a GPU a launch costs the host more than reading a few
  thousand values twice costs the device. With ``q_pad`` or ``t_pad`` (a ``[M, K]`` matrix)
  ``_scale_cast_kernel`` casts in tiles of rows (``LAID_OUT``): each tile's codes are stored
  into q's padded rows and, with ``t_pad``, into the transpose, whose stores the compiler lays
  out along q_t's contiguous rows; the tiles cover the padded columns of both, stored as zeros;

* row-wise recipe (2): ``_rowwise_kernel``, one program per block of rows, each looping over
  the columns twice (amax: ``OWN_AMAX``, then cast), any strides of ``x`` and ``q`` (a
  transposed ``x``; ``q`` row-major with its rows padded, ``q_pad``, the padding written as
  zeros by the same stores). Few long rows (a weight gradient's operands: 3 to 32 rows of a million
  columns) would leave all but one SM idle that way; there the columns are split into up to
  ``_MAX_PROGRAMS`` chunks over two kernels, as the per-tensor recipes split a tensor:

  1. ``_row_partials_kernel``: each program writes, for each of its rows, the largest ``|x|``
     bit pattern of its chunk of columns (``[rows, chunks]`` int32);
  2. ``_rowwise_kernel`` over (blocks of rows, chunks): each program reduces its rows' partials
     to their amaxes, computes the rows' scales and casts its chunk; the programs of chunk 0
     write the rows' ``scale_inv``, ``amax``, ``used`` and ``next_scale``.

  A recording call's per-tensor statistics (the largest row amax, the smallest used scale)
  come from the same launch where one block of rows holds the matrix (a layer's weight): its
  program writes them. Otherwise each block of rows writes its pair and
  ``_row_statistics_kernel`` (one program) reduces the pairs: one launch instead of the two
  reductions a caller would otherwise make.

  With ``t_pad`` (``x.t()`` quantised row-wise too) and rows that fit one tile (``q_cols <=
  _MAX_COLS``: a layer's activations, gradients, weights), ``_rowwise_both_kernel`` does both
  from the same loads of ``x``: each program casts its blocks of rows and keeps the largest
  ``|x|`` of each column over them. A matrix of at most ``_ONE_PROGRAM_BLOCKS`` blocks of rows
  is one program, which then casts ``x.t()`` itself (one launch for both); a taller one stores
  the column maxima as ``x.t()``'s partials (one per program) and ``_rowwise_kernel`` casts
  ``x.t()`` from them, its program (0, 0) also reducing the first launch's statistics pairs
  when recording: two launches where the two quantisations apart take four.

Arithmetic, and why it matches the C kernel on any GPU:

* the amax is a max over ``bits(x) & 0x7fffffff`` in int32: for non-negative floats the integer
  order is the float order, and a NaN's bits exceed every other value's, so the max is exact,
  order-free and NaN-propagating without float max semantics; a NaN amax is written as the C
  kernel's ``NAN`` (``0x7fc00000``);
* the float32 divisions (``fp8_max / amax``, ``1 / used``, ``/ 2**margin``) are
  ``tl.math.div_rn``, IEEE round to nearest (``/`` on float32 lowers to an approximate division
  on CUDA); the products (``amax * scale``, ``x * used``) are single multiplies feeding a
  comparison or a bitcast, so no multiply-add can be contracted (and ``enable_fp_fusion=False``
  is passed anyway);
* the cast to FP8 is ``fp8_from_f32`` in uint32 operations on the bits (round to nearest even;
  E4M3 saturates at 448, infinity included; E5M2 overflows to infinity; NaN becomes
  ``sign | 0x7f``), not ``tl.cast``, whose rounding and saturation depend on the hardware and
  Triton's version; float32 / float64 values of the codes are built from the bits too
  (``fp8_to_f32``: a NaN code gives torch's NaN, its sign and significand bits kept);
* the history's shift keeps finite amaxes only and its max is the same integer max of
  ``|h|`` as the C kernel's ``fp8_amax``;
* NaNs are those of an x86-64 CPU (the C kernel's and the twin's there): a GPU's arithmetic
  returns a canonical NaN whatever its inputs, so where ``x * used`` or ``1 / used`` is NaN the
  result is selected explicitly: ``used``'s NaN (quieted), else ``x``'s, else the default NaN
  ``0xffc00000`` of ``inf * 0`` (an FP8 NaN code takes its sign: ``inf * 0`` gives ``0xff``).

CPU tensors run only under Triton's interpreter (``TRITON_INTERPRET=1`` before this module is
first imported), which is how ``tests/test_fp8_triton.py`` runs these kernels without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mptex._fp8_scaling import _Q_KINDS, _check, _outputs, _q_cols
from mptex._triton_launch import cdiv, on_operand_device

__all__ = ["fp8_quantize_triton", "INTERPRETED"]

# Elements per block of the per-tensor kernels, and their program cap: a few programs per SM of
# an H100 (132 SMs), each looping over its blocks, so that the second kernel's reduction of the
# partials stays a single masked load of at most _MAX_PROGRAMS values.
_BLOCK = 1024
_MAX_PROGRAMS = 512
_ONE_PROGRAM_BLOCKS = 16
_HISTORY_BLOCK = 1024
# Row-wise tile: up to _ROW_TILE elements, _MAX_COLS columns at a time (rows are short, K = 32
# to 128 typically; longer rows loop).
_ROW_TILE = 4096
_MAX_COLS = 128
# Long rows: tiles of up to _LONG_ROWS rows (the rest of _ROW_TILE in columns), at least
# _TILES_PER_CHUNK column tiles per program, and a row's partials reduced _PARTIALS_BLOCK at a
# time.
_LONG_ROWS = 32
_TILES_PER_CHUNK = 16
_PARTIALS_BLOCK = 64
# The row-wise statistics' pairs reduced this many at a time (one per block of rows).
_STATISTICS_BLOCK = 1024

_F32_INF_BITS = tl.constexpr(0x7F800000)
_F32_NAN_BITS = tl.constexpr(0x7FC00000)  # the C kernel's NAN (quiet, no payload)
_F32_DEFAULT_NAN_BITS = tl.constexpr(-0x400000)  # 0xffc00000: x86's NaN of an invalid operation
_F64_NAN_BITS = tl.constexpr(0x7FF8000000000000)  # (double)NAN


@triton.jit
def _f32(bits):
    """The float32 whose bits are the int32 constant ``bits`` (a scalar)."""
    return tl.full((), bits, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _abs_bits(x):
    """``bits(|x|)`` as int32: ordered as ``|x|``, NaNs above infinity."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax_of(max_bits):
    """The float32 amax from the max of :func:`_abs_bits`: NaN (``0x7fc00000``) if any was."""
    bits = tl.where(max_bits > _F32_INF_BITS, _F32_NAN_BITS, max_bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _with_margin(unscaled, HAS_MARGIN: tl.constexpr, DIVISOR_BITS: tl.constexpr):
    """``unscaled / 2**margin`` correctly rounded (the C kernel leaves it out for margin 0)."""
    if HAS_MARGIN:
        return tl.math.div_rn(unscaled, _f32(DIVISOR_BITS))
    else:
        return unscaled


@triton.jit
def _fp8_code(y, E5M2: tl.constexpr):
    """The C kernel's ``fp8_from_f32`` on uint32 bits: the FP8 code (``sign | r``, uint32)."""
    MBITS: tl.constexpr = 2 if E5M2 else 3
    BIAS: tl.constexpr = 15 if E5M2 else 7
    RMAX: tl.constexpr = 0x7C if E5M2 else 0x7E  # E5M2: infinity; E4M3: 448
    SHIFT: tl.constexpr = 23 - MBITS
    SUB: tl.constexpr = 151 - BIAS - MBITS
    b = y.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    e = a >> 23
    # Normal in the format (or above its range): round the significand to MBITS bits, ties to
    # even (add half - 1 plus the kept bit's parity), and rebias. No lane overflows uint32 (a
    # is at most 0x7fffffff); the lanes below the range wrap and are not selected.
    odd = (a >> SHIFT) & 1
    r_normal = ((a + ((1 << (SHIFT - 1)) - 1) + odd) >> SHIFT) - ((127 - BIAS) << MBITS)
    # The format's subnormals: the significand in units of the smallest subnormal, shifted by
    # s = SUB - max(e, 1) in [24 - MBITS, 31] there; s is kept in [1, 31] in the other lanes
    # too, so that no shift reaches 32 bits (undefined in LLVM) in any lane.
    m = (a & 0x7FFFFF) | tl.where(e != 0, 0x800000, 0).to(tl.uint32)
    e1 = tl.maximum(e, 1)
    s = tl.minimum(tl.where(e1 < SUB, SUB - e1, 31), 31)
    one = tl.full(s.shape, 1, tl.uint32)
    rem = m & ((one << s) - 1)
    half = one << (s - 1)
    r_sub = m >> s
    r_sub += ((rem > half) | ((rem == half) & ((r_sub & 1) != 0))).to(tl.uint32)
    r = tl.where(e >= 128 - BIAS, r_normal, r_sub)
    r = tl.minimum(r, RMAX)
    r = tl.where(a > _F32_INF_BITS, 0x7F, r)
    return sign | r


@triton.jit
def _code_value(code, E5M2: tl.constexpr, Q_KIND: tl.constexpr):
    """The C kernel's ``fp8_to_f32`` of a code, built on the bits: float32 (Q_KIND 1) or its
    float64 conversion (Q_KIND 2).

    An FP8 normal is a float32 normal (rebias the exponent, shift the significand); an FP8
    subnormal ``m * 2^-(BIAS - 1 + MBITS)`` is ``float(m)`` (an exact integer conversion) with
    its exponent lowered, never a float32 subnormal, so no flush to zero can touch it. A NaN
    code is torch's quiet NaN: its sign, the quiet bit and its significand bits on top (as a
    float64, the float32 NaN's payload widened, as a CPU's conversion keeps it); the float64
    of any other value is its exact conversion."""
    MBITS: tl.constexpr = 2 if E5M2 else 3
    BIAS: tl.constexpr = 15 if E5M2 else 7
    c = (code & 0x7F).to(tl.int32)
    e = c >> MBITS
    m = c & ((1 << MBITS) - 1)
    normal = ((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))
    sub_bits = m.to(tl.float32).to(tl.int32, bitcast=True) - ((BIAS - 1 + MBITS) << 23)
    bits = tl.where(e != 0, normal, tl.where(m != 0, sub_bits, 0))
    if E5M2:
        is_nan = (e == 31) & (m != 0)
        bits = tl.where(e == 31, _F32_INF_BITS, bits)
    else:
        is_nan = c == 0x7F
    sign = code & 0x80  # the sign goes on as a bit: a float negation of 0 or NaN may not flip it
    if Q_KIND == 1:
        bits = tl.where(is_nan, _F32_NAN_BITS | (m << (23 - MBITS)), bits)
        return (bits | (sign.to(tl.int32) << 24)).to(tl.float32, bitcast=True)
    else:
        wide = bits.to(tl.float32, bitcast=True).to(tl.float64).to(tl.int64, bitcast=True)
        wide = tl.where(is_nan, _F64_NAN_BITS | (m.to(tl.int64) << (52 - MBITS)), wide)
        return (wide | (sign.to(tl.int64) << 56)).to(tl.float64, bitcast=True)


@triton.jit
def _x86_product(x, used):
    """``x * used`` with the NaN an x86-64 CPU gives (the C kernel's and the twin's): ``used``'s
    NaN if it is one, else ``x``'s, else (``inf * 0``) the default NaN ``0xffc00000``. A GPU
    returns a canonical NaN of its own, whose sign would become the FP8 NaN code's sign."""
    y = x * used
    nan = tl.where(used != used, used, tl.where(x != x, x, _f32(_F32_DEFAULT_NAN_BITS)))
    return tl.where(y != y, nan, y)


@triton.jit
def _x86_reciprocal(used):
    """``1 / used`` correctly rounded; a NaN ``used`` gives its own NaN, quieted (x86)."""
    quiet = (used.to(tl.int32, bitcast=True) | 0x400000).to(tl.float32, bitcast=True)
    return tl.where(used != used, quiet, tl.math.div_rn(tl.full(used.shape, 1.0, tl.float32), used))


@triton.jit
def _q_value(code, E5M2: tl.constexpr, Q_KIND: tl.constexpr):
    """What q holds for a code: the code itself (Q_KIND 0, uint8), its value in float32 (1) or
    float64 (2)."""
    if Q_KIND == 0:
        return code.to(tl.uint8)
    else:
        return _code_value(code, E5M2, Q_KIND)


@triton.jit
def _store_q(q_ptrs, x, used, mask, E5M2: tl.constexpr, Q_KIND: tl.constexpr):
    """Store ``fp8(x * used)``: the code (Q_KIND 0), its value in float32 (1) or float64 (2)."""
    code = _fp8_code(_x86_product(x, used), E5M2)
    tl.store(q_ptrs, _q_value(code, E5M2, Q_KIND), mask=mask)


@triton.jit(do_not_specialize=["n_blocks"])
def _amax_partials_kernel(x_ptr, partial_ptr, n, n_blocks, BLOCK: tl.constexpr):
    """partial[pid] = max of ``bits(|x|)`` over the blocks pid, pid + P, ... (0 if none)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    # An int64 block index: offsets past 2**31 elements do not wrap.
    for blk in range(pid.to(tl.int64), n_blocks, step):
        offs = blk * BLOCK + lanes
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.store(partial_ptr + pid, tl.max(acc, axis=0))


@triton.jit(do_not_specialize=["n_blocks", "n_partials", "rows", "row_tiles"])
def _scale_cast_kernel(
    x_ptr,
    q_ptr,
    q_t_ptr,
    partial_ptr,
    scale_ptr,
    history_ptr,
    scale_inv_ptr,
    amax_ptr,
    used_ptr,
    next_scale_ptr,
    next_history_ptr,
    n,
    n_blocks,
    n_partials,
    hlen,
    rows,
    cols,
    q_cols,
    t_cols,
    row_tiles,
    E5M2: tl.constexpr,
    FMAX: tl.constexpr,
    HAS_MARGIN: tl.constexpr,
    DIVISOR_BITS: tl.constexpr,
    CURRENT: tl.constexpr,
    RECORD: tl.constexpr,
    MOST_RECENT: tl.constexpr,
    Q_KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTIALS: tl.constexpr,
    HISTORY_BLOCK: tl.constexpr,
    OWN_AMAX: tl.constexpr,
    LAID_OUT: tl.constexpr,
    HAS_T: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """The scale (every program, from the ``n_partials`` partials; with ``OWN_AMAX`` the one
    program's own pass over all blocks), the cast, and program 0's scalars and history: the C
    kernel's per-tensor arm. The cast: this program's blocks of the contiguous ``x``, q laid
    out as it; or, ``LAID_OUT``, the contiguous ``[rows, cols]`` ``x`` in tiles of ROWS x COLS,
    the row tiles ``pid, pid + P, ...``: q row-major with rows ``q_cols`` wide and, with
    ``HAS_T``, ``q_t`` (``[cols, t_cols]`` row-major, the transpose) from the same codes, the
    padding (columns of q past ``cols``, of q_t past ``rows``) stored as zeros by the same
    stores (the row tiles cover q_t's padded columns too). Rows, cols, q_cols, t_cols and
    row_tiles are read only when ``LAID_OUT``."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    if OWN_AMAX:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for blk in range(0, n_blocks):
            offs = blk * BLOCK + lanes
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
            acc = tl.maximum(acc, _abs_bits(x))
        amax = _amax_of(tl.max(acc, axis=0))
    else:
        idx = tl.arange(0, PARTIALS)
        partials = tl.load(partial_ptr + idx, mask=idx < n_partials, other=0)
        amax = _amax_of(tl.max(partials, axis=0))
    fmax = tl.full((), FMAX, tl.float32)
    inf = _f32(_F32_INF_BITS)
    unscaled = tl.math.div_rn(fmax, amax)
    if CURRENT:
        used = tl.where(unscaled < inf, _with_margin(unscaled, HAS_MARGIN, DIVISOR_BITS), 1.0)
        next_scale = used
    else:
        scale = tl.load(scale_ptr)
        used = tl.where(amax * scale > fmax, unscaled, scale)
        next_scale = scale
    if pid == 0:
        if RECORD:
            # Finite amaxes only enter the history (a NaN or inf leaves it as it was); its max
            # is the C kernel's fp8_amax, of |h|, NaN-propagating.
            finite = amax < inf
            top = tl.load(history_ptr, mask=hlen > 0, other=0.0)
            first = tl.where(finite, amax, top)
            running = tl.zeros([HISTORY_BLOCK], dtype=tl.int32)
            for start in range(0, hlen, HISTORY_BLOCK):
                i = start + tl.arange(0, HISTORY_BLOCK)
                inside = i < hlen
                current = tl.load(history_ptr + i, mask=inside, other=0.0)
                previous = tl.load(history_ptr + i - 1, mask=inside & (i > 0), other=0.0)
                shifted = tl.where(i == 0, amax, previous)
                entry = tl.where(finite, shifted, current)
                tl.store(next_history_ptr + i, entry, mask=inside)
                running = tl.maximum(running, tl.where(inside, _abs_bits(entry), 0))
            if MOST_RECENT:
                reduced = first
            else:
                reduced = _amax_of(tl.max(running, axis=0))
            u = tl.math.div_rn(fmax, reduced)
            next_scale = tl.where(u < inf, _with_margin(u, HAS_MARGIN, DIVISOR_BITS), next_scale)
        tl.store(scale_inv_ptr, _x86_reciprocal(used))
        tl.store(amax_ptr, amax)
        tl.store(used_ptr, used)
        tl.store(next_scale_ptr, next_scale)
    if LAID_OUT:
        r_lanes = tl.arange(0, ROWS)
        k_lanes = tl.arange(0, COLS)
        for tile in range(pid.to(tl.int64), row_tiles, tl.num_programs(0)):
            r = tile * ROWS + r_lanes
            for c0 in range(0, q_cols, COLS):
                k = (c0 + k_lanes).to(tl.int64)  # k * t_cols may pass 2**31
                inside = (r < rows)[:, None] & (k < cols)[None, :]
                x = tl.load(x_ptr + r[:, None] * cols + k[None, :], mask=inside, other=0.0)
                code = _fp8_code(_x86_product(x, used), E5M2)
                value = _q_value(tl.where(inside, code, 0), E5M2, Q_KIND)  # padding: +0
                q_mask = (r < rows)[:, None] & (k < q_cols)[None, :]
                tl.store(q_ptr + r[:, None] * q_cols + k[None, :], value, mask=q_mask)
                if HAS_T:
                    t_mask = (r < t_cols)[:, None] & (k < cols)[None, :]
                    tl.store(q_t_ptr + k[None, :] * t_cols + r[:, None], value, mask=t_mask)
    else:
        for blk in range(pid.to(tl.int64), n_blocks, tl.num_programs(0)):
            offs = blk * BLOCK + lanes
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask, other=0.0)
            _store_q(q_ptr + offs, x, used, mask, E5M2, Q_KIND)


@triton.jit
def _row_tile(x_rows, t, k_lanes, row_in, cols, stride_xc, COLS: tl.constexpr):
    """Column tile ``t`` (int64) of the rows: ``(x, k, mask)``, 0 outside the matrix."""
    k = t * COLS + k_lanes
    mask = row_in[:, None] & (k < cols)[None, :]
    x = tl.load(x_rows + k[None, :] * stride_xc, mask=mask, other=0.0)
    return x, k, mask


@triton.jit
def _chunk_amax_bits(x_rows, first, tiles, row_in, cols, stride_xc, ROWS: tl.constexpr,
                     COLS: tl.constexpr):  # fmt: skip
    """Per row, the max of :func:`_abs_bits` over the column tiles ``first`` onwards, ``tiles``
    of them (0 if none)."""
    k_lanes = tl.arange(0, COLS)
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for t in range(first, first + tiles):
        x, _, _ = _row_tile(x_rows, t, k_lanes, row_in, cols, stride_xc, COLS)
        acc = tl.maximum(acc, _abs_bits(x))
    return tl.max(acc, axis=1)


@triton.jit
def _row_scales(
    amax, FMAX: tl.constexpr, HAS_MARGIN: tl.constexpr, DIVISOR_BITS: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """The rows' recipe scales and the scales their casts use, from their amaxes: the C
    kernel's ``fp8_row_scale``."""
    fmax = tl.full((ROWS,), FMAX, tl.float32)
    inf = _f32(_F32_INF_BITS)
    unscaled = tl.math.div_rn(fmax, amax)
    usable = (unscaled > 0.0) & (unscaled < inf)
    row_scale = tl.where(usable, _with_margin(unscaled, HAS_MARGIN, DIVISOR_BITS), 1.0)
    used = tl.where(amax * row_scale > fmax, unscaled, row_scale)
    return row_scale, used


@triton.jit(do_not_specialize=["chunks", "tiles_per_chunk"])
def _row_partials_kernel(
    x_ptr,
    partial_ptr,
    rows,
    cols,
    stride_xr,
    stride_xc,
    chunks,
    tiles_per_chunk,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """partial[r, c] = max of ``bits(|x[r, k]|)`` over chunk c's columns (0 if none): the
    column tiles ``c * tiles_per_chunk`` onwards, ``tiles_per_chunk`` of them."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1)
    row_in = r < rows
    r64 = r.to(tl.int64)
    first = c.to(tl.int64) * tiles_per_chunk
    bits = _chunk_amax_bits(x_ptr + r64[:, None] * stride_xr, first, tiles_per_chunk, row_in,
                            cols, stride_xc, ROWS, COLS)  # fmt: skip
    tl.store(partial_ptr + r64 * chunks + c, bits, mask=row_in)


@triton.jit(do_not_specialize=["chunks", "tiles_per_chunk", "n_pairs"])
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    partial_ptr,
    scale_inv_ptr,
    amax_ptr,
    used_ptr,
    next_scale_ptr,
    stats_ptr,
    rows,
    cols,
    q_cols,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    chunks,
    tiles_per_chunk,
    pairs_ptr,
    n_pairs,
    E5M2: tl.constexpr,
    FMAX: tl.constexpr,
    HAS_MARGIN: tl.constexpr,
    DIVISOR_BITS: tl.constexpr,
    Q_KIND: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr,
    OWN_AMAX: tl.constexpr,
    STATS: tl.constexpr,
    PAIRS_BLOCK: tl.constexpr,
):
    """ROWS rows: their amaxes (with ``OWN_AMAX``, one chunk holding the whole rows: this
    program's own pass over them; else from the partials), their scales (the C kernel's
    row-wise arm; stored by chunk 0's programs) and the cast of chunk ``program_id(1)``'s
    columns (q's rows are ``q_cols`` wide, the columns past ``cols`` written as zeros: ``x``
    loads 0 there). ``STATS`` (recording): 1, one block of rows, whose program stores the
    per-tensor statistics as floats; 2, each chunk-0 program stores its rows' as an int32 pair
    (:func:`_row_statistics_kernel` reduces them); 3, not its own rows' but another launch's:
    program (0, 0) reduces the ``n_pairs`` pairs at ``pairs_ptr`` into ``stats_ptr`` (the
    launch that casts ``x.t()`` after :func:`_rowwise_both_kernel` cast ``x``); 0, none."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1)
    row_in = r < rows
    r64 = r.to(tl.int64)
    x_rows = x_ptr + r64[:, None] * stride_xr
    first = c.to(tl.int64) * tiles_per_chunk
    if OWN_AMAX:
        bits = _chunk_amax_bits(x_rows, first, tiles_per_chunk, row_in, cols, stride_xc, ROWS,
                                COLS)  # fmt: skip
    else:
        acc = tl.zeros([ROWS, PARTIALS_BLOCK], dtype=tl.int32)
        for c0 in range(0, chunks, PARTIALS_BLOCK):
            idx = c0 + tl.arange(0, PARTIALS_BLOCK)
            mask = row_in[:, None] & (idx < chunks)[None, :]
            part = tl.load(partial_ptr + r64[:, None] * chunks + idx[None, :], mask=mask, other=0)
            acc = tl.maximum(acc, part)
        bits = tl.max(acc, axis=1)
    amax = _amax_of(bits)
    row_scale, used = _row_scales(amax, FMAX, HAS_MARGIN, DIVISOR_BITS, ROWS)
    if c == 0:
        _store_rows(amax_ptr, used_ptr, next_scale_ptr, scale_inv_ptr, r, row_in, amax, used,
                    row_scale)  # fmt: skip
        if STATS == 1 or STATS == 2:
            top, low = _rows_statistics(amax, used, row_in, 0, _F32_INF_BITS)
            _store_statistics(stats_ptr, top, low, tl.program_id(0), STATS)
        if STATS == 3:
            if tl.program_id(0) == 0:
                _reduce_pairs(pairs_ptr, stats_ptr, n_pairs, PAIRS_BLOCK)
    q_rows = q_ptr + r64[:, None] * stride_qr
    k_lanes = tl.arange(0, COLS)
    for t in range(first, first + tiles_per_chunk):
        x, k, _ = _row_tile(x_rows, t, k_lanes, row_in, cols, stride_xc, COLS)
        inside = row_in[:, None] & (k < q_cols)[None, :]
        _store_q(q_rows + k[None, :] * stride_qc, x, used[:, None], inside, E5M2, Q_KIND)


@triton.jit
def _store_rows(amax_ptr, used_ptr, next_scale_ptr, scale_inv_ptr, r, row_in, amax, used,
                row_scale):  # fmt: skip
    """The rows' outputs: ``amax``, ``used``, ``next_scale`` (the recipe scale) and
    ``scale_inv = 1 / used`` at the rows ``r`` inside the matrix."""
    tl.store(amax_ptr + r, amax, mask=row_in)
    tl.store(used_ptr + r, used, mask=row_in)
    tl.store(next_scale_ptr + r, row_scale, mask=row_in)
    tl.store(scale_inv_ptr + r, _x86_reciprocal(used), mask=row_in)


@triton.jit
def _rows_statistics(amax, used, row_in, top, low):
    """``(top, low)``: the running largest row amax and smallest used scale, as int32 bits,
    with these rows'. Both are >= 0 (the amax's NaN is 0x7fc00000, above infinity; used is
    never NaN), where the integer order is the float order, so the max and min are exact and
    order-free."""
    top = tl.maximum(top, tl.max(tl.where(row_in, amax.to(tl.int32, bitcast=True), 0), axis=0))
    low = tl.minimum(low, tl.min(tl.where(row_in, used.to(tl.int32, bitcast=True),
                                          _F32_INF_BITS), axis=0))  # fmt: skip
    return top, low


@triton.jit
def _store_statistics(stats_ptr, top, low, index, STATS: tl.constexpr):
    """STATS 1: the per-tensor statistics as floats; 2: the int32 pair ``index``."""
    if STATS == 1:
        tl.store(stats_ptr, top.to(tl.float32, bitcast=True))
        tl.store(stats_ptr + 1, low.to(tl.float32, bitcast=True))
    else:
        pair = stats_ptr.to(tl.pointer_type(tl.int32)) + 2 * index
        tl.store(pair, top)
        tl.store(pair + 1, low)


@triton.jit(do_not_specialize=["n"])
def _row_statistics_kernel(pairs_ptr, stats_ptr, n, BLOCK: tl.constexpr):
    """stats = (max of the pairs' first ints, min of their second) as float32: the per-tensor
    statistics from :func:`_rowwise_kernel`'s ``n`` int32 pairs (one program)."""
    _reduce_pairs(pairs_ptr, stats_ptr, n, BLOCK)


@triton.jit
def _reduce_pairs(pairs_ptr, stats_ptr, n, BLOCK: tl.constexpr):
    """:func:`_row_statistics_kernel`'s reduction, in the calling program."""
    top = tl.zeros([BLOCK], dtype=tl.int32)
    low = tl.full([BLOCK], _F32_INF_BITS, tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < n
        top = tl.maximum(top, tl.load(pairs_ptr + 2 * i, mask=inside, other=0))
        low = tl.minimum(low, tl.load(pairs_ptr + 2 * i + 1, mask=inside, other=_F32_INF_BITS))
    tl.store(stats_ptr, tl.max(top, axis=0).to(tl.float32, bitcast=True))
    tl.store(stats_ptr + 1, tl.min(low, axis=0).to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["rows", "row_blocks", "t_row_blocks"])
def _rowwise_both_kernel(
    x_ptr,
    q_ptr,
    q_t_ptr,
    col_partial_ptr,
    scale_inv_ptr,
    amax_ptr,
    used_ptr,
    next_scale_ptr,
    stats_ptr,
    t_scale_inv_ptr,
    rows,
    cols,
    q_cols,
    t_cols,
    row_blocks,
    t_row_blocks,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    E5M2: tl.constexpr,
    FMAX: tl.constexpr,
    HAS_MARGIN: tl.constexpr,
    DIVISOR_BITS: tl.constexpr,
    Q_KIND: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STATS: tl.constexpr,
    CAST_T: tl.constexpr,
):
    """The row-wise recipe on a ``[rows, cols]`` x whose rows fit one tile (``q_cols <=
    COLS``), with the column maxima that ``x.t()``'s row-wise quantisation needs, from the same
    loads. Program ``pid`` of P takes the blocks of ROWS rows ``pid, pid + P, ...``: their
    amaxes and scales (stored), their cast into q (``q_cols`` wide, the padding zeros: x loads
    0 there) and, over all its blocks, the largest ``bits(|x|)`` of each column. ``STATS`` as
    :func:`_rowwise_kernel`'s (1: one program, as floats; 2: an int32 pair per program). Then
    either the column maxima are stored as ``x.t()``'s partials (``[cols, P]`` int32, for
    :func:`_rowwise_kernel` to cast ``x.t()`` from), or, ``CAST_T`` (one program), the columns'
    scales are computed here (:func:`_row_scales`, as for rows) and ``x.t()`` is cast into
    ``q_t`` (``[cols, t_cols]`` row-major, columns past ``rows`` zero) with ``t_scale_inv``
    ``[cols]``: the whole quantisation both ways in one launch."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    r_lanes = tl.arange(0, ROWS)
    k = tl.arange(0, COLS).to(tl.int64)  # offsets past 2**31 do not wrap
    col_in = k < cols
    column_bits = tl.zeros([COLS], dtype=tl.int32)
    top = tl.full((), 0, tl.int32)
    low = tl.full((), _F32_INF_BITS, tl.int32)
    for blk in range(pid.to(tl.int64), row_blocks, programs):
        r = blk * ROWS + r_lanes
        row_in = r < rows
        inside = row_in[:, None] & col_in[None, :]
        x = tl.load(x_ptr + r[:, None] * stride_xr + k[None, :] * stride_xc, mask=inside,
                    other=0.0)  # fmt: skip
        x_bits = _abs_bits(x)
        column_bits = tl.maximum(column_bits, tl.max(x_bits, axis=0))
        amax = _amax_of(tl.max(x_bits, axis=1))
        row_scale, used = _row_scales(amax, FMAX, HAS_MARGIN, DIVISOR_BITS, ROWS)
        _store_rows(amax_ptr, used_ptr, next_scale_ptr, scale_inv_ptr, r, row_in, amax, used,
                    row_scale)  # fmt: skip
        if STATS != 0:
            top, low = _rows_statistics(amax, used, row_in, top, low)
        q_mask = row_in[:, None] & (k < q_cols)[None, :]
        q_ptrs = q_ptr + r[:, None] * stride_qr + k[None, :] * stride_qc
        _store_q(q_ptrs, x, used[:, None], q_mask, E5M2, Q_KIND)
    if STATS != 0:
        _store_statistics(stats_ptr, top, low, pid, STATS)
    if CAST_T:
        t_amax = _amax_of(column_bits)
        _, t_used = _row_scales(t_amax, FMAX, HAS_MARGIN, DIVISOR_BITS, COLS)
        tl.store(t_scale_inv_ptr + k, _x86_reciprocal(t_used), mask=col_in)
        for blk in range(0, t_row_blocks):
            r = blk * ROWS + r_lanes
            inside = (r < rows)[:, None] & col_in[None, :]
            x = tl.load(x_ptr + r[:, None] * stride_xr + k[None, :] * stride_xc, mask=inside,
                        other=0.0)  # fmt: skip
            t_mask = (r < t_cols)[:, None] & col_in[None, :]
            _store_q(q_t_ptr + k[None, :] * t_cols + r[:, None], x, t_used[None, :], t_mask,
                     E5M2, Q_KIND)  # fmt: skip
    else:
        tl.store(col_partial_ptr + k * programs + pid, column_bits, mask=col_in)


def _rowwise_both(x, q, scalars, stats, q_t, t_scale_inv, consts: dict) -> None:
    """The row-wise recipe on ``x`` and on ``x.t()`` (:func:`_rowwise_both_kernel`), for an
    ``x`` whose rows fit one tile: a matrix of at most ``_ONE_PROGRAM_BLOCKS`` blocks of rows (a
    layer's weight) in one launch; a taller one in two, the second :func:`_rowwise_kernel`
    casting ``x.t()`` from the first's column maxima (one partial per program of the first)
    and, when recording, reducing the first's statistics pairs, where the two quantisations
    apart take four."""
    rows, cols = x.shape
    q_cols, t_cols = q.shape[1], q_t.shape[1]
    block_cols = min(max(_next_pow2(q_cols), 16), _MAX_COLS)
    block_rows = _ROW_TILE // block_cols
    row_blocks = cdiv(rows, block_rows)
    one = row_blocks <= _ONE_PROGRAM_BLOCKS
    programs = 1 if one else min(row_blocks, _MAX_PROGRAMS)
    mode, pairs = 0, stats
    if stats.numel():
        mode = 1 if programs == 1 else 2
    if mode == 2:
        pairs = torch.empty(programs, 2, dtype=torch.int32, device=x.device)
    partials = torch.empty(0 if one else cols * programs, dtype=torch.int32, device=x.device)
    _rowwise_both_kernel[(programs,)](
        x, q, q_t, partials, *scalars, pairs if mode else scalars[0], t_scale_inv, rows, cols,
        q_cols, t_cols, row_blocks, cdiv(t_cols, block_rows), *x.stride(), *q.stride(),
        ROWS=block_rows, COLS=block_cols, STATS=mode, CAST_T=one, enable_fp_fusion=False,
        **consts,
    )  # fmt: skip
    if not one:
        # x.t() row-wise: its rows' amaxes from the partials, its columns in `programs` chunks
        long_rows = min(max(_next_pow2(cols), 2), _LONG_ROWS)
        tile_cols = _ROW_TILE // long_rows
        tiles_per_chunk = cdiv(cdiv(t_cols, tile_cols), programs)
        # x.t()'s rows' amax, used and recipe scales: written, not returned (one buffer)
        scratch = [torch.empty(cols, 1, dtype=torch.float32, device=x.device)] * 3
        # and, recording, x's statistics from the first launch's pairs (STATS 3)
        _rowwise_kernel[(cdiv(cols, long_rows), programs)](
            x.t(), q_t, partials, t_scale_inv, *scratch, stats if mode else scratch[0], cols,
            rows, t_cols, *x.t().stride(), *q_t.stride(), programs, tiles_per_chunk, pairs,
            programs, ROWS=long_rows, COLS=tile_cols, PARTIALS_BLOCK=_PARTIALS_BLOCK,
            OWN_AMAX=False, STATS=3 if mode else 0, PAIRS_BLOCK=_STATISTICS_BLOCK,
            enable_fp_fusion=False, **consts,
        )  # fmt: skip


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_rowwise_kernel, InterpretedFunction)


INTERPRETED = _interpreted()


def _divisor_bits(margin: int) -> int:
    """The bits of the C kernel's ``ldexpf(1.0f, margin)``: 2**margin in float32 (inf above
    2**127, subnormal below 2**-126, 0 below 2**-149)."""
    if margin > 127:
        return 0x7F800000
    if margin >= -126:
        return (margin + 127) << 23
    return 1 << (margin + 149) if margin >= -149 else 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _rowwise(x, q, scalars, stats, consts: dict) -> None:
    """The row-wise recipe's launches (module docstring): one kernel over blocks of rows, or,
    for few long rows, the columns in chunks of whole tiles over two; with ``stats`` (``[2]``,
    recording) the per-tensor statistics too, stored by the one program of a single block of
    rows, else reduced from each block's by one more launch."""
    rows, cols = x.shape
    q_cols = q.shape[1]  # cols, or padded (the tiles cover q's columns; x is read to cols)
    if not rows:
        if stats.numel():  # a zero tensor's statistics (no kernel runs)
            stats.fill_(1.0)
            stats[0].fill_(0.0)
        return
    block_cols = min(max(_next_pow2(q_cols), 16), _MAX_COLS)
    block_rows = _ROW_TILE // block_cols
    long_rows = min(max(_next_pow2(rows), 2), _LONG_ROWS)  # the long-row tile
    col_tiles = cdiv(q_cols, _ROW_TILE // long_rows)
    chunks = min(cdiv(col_tiles, _TILES_PER_CHUNK),
                 _MAX_PROGRAMS // cdiv(rows, long_rows))  # fmt: skip
    partials = scalars[0]  # unread in one chunk
    if chunks > 1:
        block_rows, block_cols = long_rows, _ROW_TILE // long_rows
        tiles_per_chunk = cdiv(col_tiles, chunks)
        chunks = cdiv(col_tiles, tiles_per_chunk)  # none left empty
        partials = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
        grid = (cdiv(rows, block_rows), chunks)
        _row_partials_kernel[grid](x, partials, rows, cols, *x.stride(), chunks, tiles_per_chunk,
                                   ROWS=block_rows, COLS=block_cols,
                                   enable_fp_fusion=False)  # fmt: skip
    else:
        chunks, tiles_per_chunk = 1, cdiv(q_cols, block_cols)
    row_blocks = cdiv(rows, block_rows)
    mode, pairs = 0, stats
    if stats.numel():
        mode = 1 if row_blocks == 1 else 2
    if mode == 2:
        pairs = torch.empty(row_blocks, 2, dtype=torch.int32, device=x.device)
    _rowwise_kernel[(row_blocks, chunks)](
        x,
        q,
        partials,
        *scalars,
        pairs if mode else scalars[0],  # unread without statistics
        rows,
        cols,
        q_cols,
        *x.stride(),
        *q.stride(),
        chunks,
        tiles_per_chunk,
        scalars[0],  # no pairs to reduce (STATS 3 only)
        0,
        ROWS=block_rows,
        COLS=block_cols,
        PARTIALS_BLOCK=_PARTIALS_BLOCK,
        OWN_AMAX=chunks == 1,
        STATS=mode,
        PAIRS_BLOCK=_STATISTICS_BLOCK,
        enable_fp_fusion=False,
        **consts,
    )
    if mode == 2:
        _row_statistics_kernel[(1,)](pairs, stats, row_blocks, BLOCK=_STATISTICS_BLOCK,
                                     enable_fp_fusion=False)  # fmt: skip


@on_operand_device
def fp8_quantize_triton(
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
    """``mptex::fp8_quantize`` (:mod:`mptex._fp8_fused`'s module docstring) with the Triton
    kernels: ``(q, scale_inv, amax, used, next_scale, next_history, q_t, t_scale_inv)``, the C
    kernel's bits.

    ``x`` is float32 on a device Triton compiles for (or on the CPU under the interpreter).
    No host synchronisation: launch sizes depend on shapes only."""
    dtype = _check(x, fp8_format, recipe, q_dtype, q_pad, t_pad)
    x = x.detach()
    q_kind = _Q_KINDS.get(q_dtype, 0)
    consts = dict(
        E5M2=bool(fp8_format),
        FMAX=57344.0 if fp8_format else 448.0,
        HAS_MARGIN=margin != 0,
        DIVISOR_BITS=_divisor_bits(margin),
        Q_KIND=q_kind,
    )
    if recipe == 2:
        rows, cols = x.shape
        both = t_pad and rows and cols and _q_cols(cols, q_pad) <= _MAX_COLS  # rows fit a tile
        outputs = _outputs(x, history, recipe, record, q_dtype, q_pad, t_pad if both else 0)
        q, (scale_inv, amax, used, next_scale), next_history, q_t, t_scale_inv = outputs
        scalars = (scale_inv, amax, used, next_scale)
        if both:
            _rowwise_both(x, q, scalars, next_history, q_t, t_scale_inv, consts)
        else:
            _rowwise(x, q, scalars, next_history, consts)
        if t_pad and not both:  # x.t() quantised row-wise, as its own call would be
            t_args = (scale, history, fp8_format, 2, margin, False, False, q_dtype, t_pad)
            q_t, t_scale_inv = fp8_quantize_triton(x.t(), *t_args)[:2]
    else:
        # The per-tensor kernels read x linearly; q is laid out as x (empty_like), so a
        # non-contiguous x is quantised as its contiguous copy and q copied into x's layout.
        # With q_pad or t_pad, q (and q_t) are written in their padded layouts by the cast.
        flat = x.contiguous()
        outputs = _outputs(flat, history, recipe, record, q_dtype, q_pad, t_pad)
        q, (scale_inv, amax, used, next_scale), next_history, q_t, t_scale_inv = outputs
        n = flat.numel()
        n_blocks = cdiv(n, _BLOCK)
        own_amax = n_blocks <= _ONE_PROGRAM_BLOCKS
        # The partials' reduction reads one value per program of the first launch.
        partial_programs = 1 if own_amax else min(n_blocks, _MAX_PROGRAMS)
        programs, laid_out = partial_programs, bool(q_pad or t_pad)
        layout, block_cols = (0, 0, 0, 0, 0), 16  # (unread without LAID_OUT)
        if laid_out:
            rows, cols = flat.shape
            t_cols = q_t.shape[1] if t_pad else 0  # a stride of q_t; unread without it
            block_cols = min(max(_next_pow2(q.shape[1]), 16), _MAX_COLS)
            row_tiles = cdiv(max(rows, t_cols), _ROW_TILE // block_cols)
            layout = (rows, cols, q.shape[1], t_cols, row_tiles)
            if not own_amax:
                programs = min(max(row_tiles, 1), _MAX_PROGRAMS)
        partials = amax  # unread with own_amax
        if not own_amax:
            partials = torch.empty(partial_programs, dtype=torch.int32, device=x.device)
            _amax_partials_kernel[(partial_programs,)](
                flat, partials, n, n_blocks, BLOCK=_BLOCK, enable_fp_fusion=False
            )
        delayed = recipe == 0
        scale = scale.detach().float().contiguous() if delayed else amax  # amax: unread
        history = history.detach().float().contiguous() if delayed and record else amax
        history = history if history.numel() else amax  # an unread (masked) pointer
        _scale_cast_kernel[(programs,)](
            flat, q, q_t if t_pad else q, partials, scale, history, scale_inv, amax, used,
            next_scale, next_history if next_history.numel() else amax, n, n_blocks,
            partial_programs, next_history.numel(), *layout,
            CURRENT=recipe == 1,
            RECORD=delayed and record,
            MOST_RECENT=bool(most_recent),
            BLOCK=_BLOCK,
            PARTIALS=_next_pow2(_MAX_PROGRAMS),
            HISTORY_BLOCK=_HISTORY_BLOCK,
            OWN_AMAX=own_amax,
            LAID_OUT=laid_out,
            HAS_T=bool(t_pad),
            ROWS=_ROW_TILE // block_cols,
            COLS=block_cols,
            enable_fp_fusion=False,
            **consts,
        )  # fmt: skip
        if flat is not x and not q_pad:
            q = torch.empty_like(x, dtype=q.dtype).copy_(q)
    if q_kind == 0:
        q, q_t = q.view(dtype), q_t.view(dtype)
    return q, scale_inv, amax, used, next_scale, next_history, q_t, t_scale_inv
