"""FP8 GEMMs in Triton for the texture MLP's shapes: :func:`mptex.fp8.scaled_mm`'s ``triton``
backend.

The MLP's GEMMs are tall and thin: ``[M, K] @ [K, N]`` with M the covered pixels (up to a
million in a batch of four 512 x 512 views; 350,000 on the built-in scene) and K, N the layer
widths (3 to 64), and the weight gradient's ``[N_out, M] @ [M, N_in]``, whose reduction runs
over those rows. ``torch._scaled_mm``
takes a row-major ``a`` and a column-major ``b`` with K and N multiples of 16, so each of these
GEMMs first copies (and zero-pads) one or both of its operands, and the weight gradient's
``a`` and ``b`` are both transposed copies. The kernels here read the FP8 codes where they lie,
through their strides, and pad with masks: no copy, one launch per GEMM (two for the weight
gradient), the bias added in the epilogue.

Kernels:

* ``_mm_kernel``: a grid of ``BLOCK_M x BLOCK_N`` output tiles, each looping over K in steps
  of ``BLOCK_K``, accumulating in float32; its epilogue scales (per tensor:
  ``acc * (scale_a * scale_b)``, as :func:`mptex.fp8.scaled_mm`'s emulation; row-wise:
  ``(acc * scale_a[i]) * scale_b[j]``, the CUTLASS epilogue's order), adds the bias and stores
  float32. With ``SPLIT`` it is the first half of a split-K GEMM instead: program ``s`` of the
  third grid axis sums the K range ``[s * k_chunk, (s + 1) * k_chunk)`` and stores its raw
  partial tile in ``partials[s]``;
* ``_split_sum_kernel``: the second half: each output element sums its partials in a fixed
  order (deterministic: no atomics; the same result on every run) and applies the same
  epilogue.

The split-K form is taken when the output has few tiles and K is long (the weight gradient):
one tile looping over all the rows would leave every SM but one idle.

Arithmetic. On a GPU with FP8 tensor cores (compute capability 8.9 or later) the operands go to
``tl.dot`` as FP8 (``FP8_DOT``); the tensor cores multiply exactly and accumulate with the
precision the hardware has (on Hopper, fewer than float32's bits within a block of products),
the running sum promoted to float32 after every ``BLOCK_K`` (at most 128) products, as
``torch._scaled_mm`` does by default (Triton's own default on Hopper never promotes); the GPU
kit's ``fp8`` stage bounds both's error against a float64 reference. Elsewhere (Triton's CPU
interpreter, whose FP8 ``tl.dot`` is not exact) each code is first turned into its float32
value on the bits (``_code_value``, the quantisation kernels' own conversion) and ``tl.dot``
multiplies in IEEE float32: exact products (an FP8 product has at most 8 significant bits)
summed in float32, in an order of the kernel's own.
Either way the result is the exact product of the scaled FP8 values up to the accumulation's
rounding, as ``torch._scaled_mm``'s is; the epilogue's multiplies and the bias's add are
separate roundings (launched with ``enable_fp_fusion=False``: no multiply-add contraction).

CPU tensors run only under Triton's interpreter (``TRITON_INTERPRET=1`` before this module is
first imported): how ``tests/test_fp8_mm_triton.py`` runs these kernels without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mptex._fp8_scaling import E5M2
from mptex._fp8_triton import _code_value
from mptex._triton_launch import cdiv, on_operand_device

__all__ = ["fp8_mm_triton", "INTERPRETED", "split_k_chunks"]

# Output tiles of the one-pass kernel: rows of BLOCK_M, columns of up to _MAX_BLOCK_N; K in
# steps of at least 32 (an FP8 tensor-core instruction's K on Hopper).
_BLOCK_M = 128
_MAX_BLOCK_N = 64
_MIN_BLOCK = 16
_MIN_BLOCK_K = 32
_SPLIT_MIN_BLOCK_M = 64
_MAX_BLOCK_K = 128
# Split-K: taken when the output has at most _SPLIT_MAX_TILES tiles and K exceeds
# _SPLIT_MIN_K; each program sums _K_CHUNK of K (a multiple of the split kernel's BLOCK_K: 171
# programs for the 350,000 covered points of a 512 x 512 batch of four, more than an H100's 132
# SMs), and at most _MAX_SPLITS programs run (the chunk grows beyond that). The partials are
# summed _SUM_BLOCK outputs by _SPLIT_TILE partials at a time.
_SPLIT_MAX_TILES = 16
_SPLIT_MIN_K = 8192
_K_CHUNK = 2048
_MAX_SPLITS = 1024
_SUM_BLOCK = 64
_SPLIT_TILE = 64


@triton.jit
def _fp8(codes, E5M2: tl.constexpr):
    """A tile of FP8 codes (uint8) as the tensor cores take it."""
    if E5M2:
        return codes.to(tl.float8e5, bitcast=True)
    else:
        return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _epilogue(acc, rm, rn, M, N, sa_ptr, sb_ptr, bias_ptr, ROWWISE: tl.constexpr,
              HAS_BIAS: tl.constexpr):  # fmt: skip
    """``acc`` scaled (per tensor or row-wise) and biased, in the eager ops' order; ``rm``,
    ``rn``: the outputs' row and column indices, shaped to broadcast with ``acc``."""
    if ROWWISE:
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=1.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=1.0)
        out = (acc * sa) * sb
    else:
        out = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)
    return out


@triton.jit
def _mm_kernel(
    a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, k_chunk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    A_E5M2: tl.constexpr, B_E5M2: tl.constexpr, FP8_DOT: tl.constexpr,
    SPLIT: tl.constexpr, ROWWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    # 64-bit offsets: an operand or a result of more than 2^31 elements stays addressable.
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        kk = (k + rk).to(tl.int64)
        a_mask = (rm[:, None] < M) & (kk[None, :] < k_end)
        b_mask = (kk[:, None] < k_end) & (rn[None, :] < N)
        a = tl.load(a_ptr + rm64[:, None] * stride_am + kk[None, :] * stride_ak, mask=a_mask,
                    other=0)  # fmt: skip
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn64[None, :] * stride_bn, mask=b_mask,
                    other=0)  # fmt: skip
        if FP8_DOT:
            # Each BLOCK_K step's products are summed in the tensor cores' reduced-precision
            # accumulator, then added to `acc` in float32 (Triton's default on Hopper would
            # keep the whole K loop in the reduced accumulator): torch._scaled_mm's accuracy.
            acc = tl.dot(_fp8(a, A_E5M2), _fp8(b, B_E5M2), acc, max_num_imprecise_acc=BLOCK_K)
        else:  # each code's float32 value, exact products in IEEE float32
            acc = tl.dot(_code_value(a, A_E5M2, 1), _code_value(b, B_E5M2, 1), acc,
                         input_precision="ieee")  # fmt: skip
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offsets = rm64[:, None] * N + rn64[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_s.to(tl.int64) * M * N + offsets, acc, mask=mask)
    else:
        out = _epilogue(acc, rm[:, None], rn[None, :], M, N, sa_ptr, sb_ptr, bias_ptr, ROWWISE,
                        HAS_BIAS)  # fmt: skip
        tl.store(out_ptr + offsets, out, mask=mask)


@triton.jit(do_not_specialize=["splits"])
def _split_sum_kernel(
    partial_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, splits,
    BLOCK: tl.constexpr, SPLIT_TILE: tl.constexpr, ROWWISE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    rs = tl.arange(0, SPLIT_TILE)
    # Row j of the tile sums the partials j, j + SPLIT_TILE, ... in that order, then the rows
    # are summed by tl.sum's fixed tree: the same order on every run, and the loads of a tile
    # are issued together instead of one dependent load per partial.
    tile = tl.zeros((SPLIT_TILE, BLOCK), dtype=tl.float32)
    for s in range(0, splits, SPLIT_TILE):
        rows = s + rs
        tile += tl.load(partial_ptr + rows[:, None] * (M * N) + offs[None, :],
                        mask=(rows[:, None] < splits) & mask[None, :], other=0.0)  # fmt: skip
    acc = tl.sum(tile, axis=0)
    out = _epilogue(acc, offs // N, offs % N, M, N, sa_ptr, sb_ptr, bias_ptr, ROWWISE, HAS_BIAS)
    tl.store(out_ptr + offs, out, mask=mask)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_mm_kernel, InterpretedFunction)


INTERPRETED = _interpreted()


def _block(n: int, low: int, high: int) -> int:
    return min(max(1 << max(n - 1, 0).bit_length(), low), high)


def split_k_chunks(m: int, n: int, k: int) -> int:
    """How many K chunks the GEMM ``[m, k] @ [k, n]`` is split into (1: one pass)."""
    tiles = cdiv(m, _BLOCK_M) * cdiv(n, _MAX_BLOCK_N)
    if k <= _SPLIT_MIN_K or tiles > _SPLIT_MAX_TILES:
        return 1
    return min(cdiv(k, _K_CHUNK), _MAX_SPLITS)


@on_operand_device
def fp8_mm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    rowwise: bool = False,
) -> torch.Tensor:
    """``(a @ b)`` of FP8 codes, scaled, plus ``bias``: float32 ``[M, N]`` (module docstring).

    Args:
        a: ``[M, K]`` float8 (E4M3 or E5M2), any strides.
        b: ``[K, N]`` float8, any strides.
        scale_a, scale_b: float32; per tensor: scalars, the result is
            ``acc * (scale_a * scale_b)``; with ``rowwise``: ``[M, 1]`` and ``[1, N]``, the
            result is ``(acc[i, j] * scale_a[i]) * scale_b[j]``.
        bias: ``[N]`` float32 added last, or None.

    No host synchronisation: the launches depend on shapes only."""
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty(m, n, dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return out
    codes_a, codes_b = a.view(torch.uint8), b.view(torch.uint8)
    scale_a, scale_b = scale_a.float().contiguous(), scale_b.float().contiguous()
    bias_arg = scale_a if bias is None else bias.float().contiguous()  # unread without a bias
    flags = dict(
        A_E5M2=a.dtype == E5M2,
        B_E5M2=b.dtype == E5M2,
        FP8_DOT=not INTERPRETED,
        ROWWISE=rowwise,
        HAS_BIAS=bias is not None,
    )
    splits = split_k_chunks(m, n, k)
    if splits == 1:
        block_n = _block(n, _MIN_BLOCK, _MAX_BLOCK_N)
        grid = (cdiv(m, _BLOCK_M), cdiv(n, block_n), 1)
        _mm_kernel[grid](
            codes_a, codes_b, out, scale_a, scale_b, bias_arg,
            m, n, k, *codes_a.stride(), *codes_b.stride(), max(k, 1),
            BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=_block(k, _MIN_BLOCK_K, _MAX_BLOCK_K),
            SPLIT=False, enable_fp_fusion=False, **flags,
        )  # fmt: skip
        return out
    # Split-K: every chunk a whole number of BLOCK_K steps, none left empty.
    chunk = cdiv(cdiv(k, splits), _MAX_BLOCK_K) * _MAX_BLOCK_K
    splits = cdiv(k, chunk)
    # At least 64 rows (a weight gradient's output has 3 to 64): the tile Hopper's FP8
    # instructions take; fewer would make Triton convert the codes to f16 for smaller ones.
    block_m = _block(m, _SPLIT_MIN_BLOCK_M, _BLOCK_M)
    block_n = _block(n, _MIN_BLOCK, _MAX_BLOCK_N)
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    grid = (cdiv(m, block_m), cdiv(n, block_n), splits)
    _mm_kernel[grid](
        codes_a, codes_b, partials, scale_a, scale_b, bias_arg,
        m, n, k, *codes_a.stride(), *codes_b.stride(), chunk,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_MAX_BLOCK_K,
        SPLIT=True, enable_fp_fusion=False, **flags,
    )  # fmt: skip
    _split_sum_kernel[(cdiv(m * n, _SUM_BLOCK),)](
        partials, out, scale_a, scale_b, bias_arg, m, n, splits,
        BLOCK=_SUM_BLOCK, SPLIT_TILE=_SPLIT_TILE, ROWWISE=rowwise, HAS_BIAS=bias is not None,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
