"""One Triton launch for a ``torch._scaled_mm`` operand that must be copied and zero-padded.

``torch._scaled_mm`` takes a row-major ``a`` and a column-major ``b`` whose reduced dimension K
and whose N are multiples of 16 (:func:`mptex.fp8._scaled_mm_padded`). An FP8 operand in another
layout or of another size is copied into one that is; written in PyTorch that is two launches
(``new_zeros``, then ``copy_`` into a slice of it), one of them a pass that writes zeros over the
whole output before the values overwrite most of it. :func:`padded_copy` writes every byte of
the output once, the operand's where it has one and zero elsewhere, in one launch: the same
bytes as the PyTorch copy (``tests/test_fp8_mm_triton.py`` compares them).

The copy moves bytes (an FP8 code is one): any strides of the source, a row-major or a
column-major output. CPU tensors run only under Triton's interpreter (``TRITON_INTERPRET=1``
before this module is first imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mptex._triton_launch import cdiv, on_operand_device

__all__ = ["padded_copy"]

# Output tiles of _BLOCK x _BLOCK bytes (4 KiB per program).
_BLOCK = 64


@triton.jit(do_not_specialize=["src_rows"])
def _padded_copy_kernel(
    src_ptr,
    dst_ptr,
    src_rows,
    src_cols,
    rows,
    cols,
    stride_sr,
    stride_sc,
    stride_dr,
    stride_dc,
    BLOCK: tl.constexpr,
):
    """dst[r, c] = src[r, c] inside the source, 0 elsewhere, for the ``BLOCK x BLOCK`` output
    tile of this program, tiles numbered row by row over a one-axis grid (CUDA caps a grid's
    second axis at 65,535 programs: 4.2 M columns of tiles of 64, and a weight gradient's
    operand has the covered points as columns); int64 offsets: an operand may pass 2**31
    bytes."""
    col_tiles = tl.cdiv(cols, BLOCK)
    tile = tl.program_id(0).to(tl.int64)
    r = (tile // col_tiles) * BLOCK + tl.arange(0, BLOCK)
    c = (tile % col_tiles) * BLOCK + tl.arange(0, BLOCK)
    r64 = r.to(tl.int64)[:, None]
    c64 = c.to(tl.int64)[None, :]
    inside = (r < src_rows)[:, None] & (c < src_cols)[None, :]
    values = tl.load(src_ptr + r64 * stride_sr + c64 * stride_sc, mask=inside, other=0)
    written = (r < rows)[:, None] & (c < cols)[None, :]
    tl.store(dst_ptr + r64 * stride_dr + c64 * stride_dc, values, mask=written)


@on_operand_device
def padded_copy(x: torch.Tensor, rows: int, cols: int, column_major: bool) -> torch.Tensor:
    """``x`` (``[r, c]``, one byte per element, any strides, ``r <= rows``, ``c <= cols``) in a
    new ``[rows, cols]`` tensor of its dtype, row-major or ``column_major``, zero outside it."""
    if x.element_size() != 1 or x.ndim != 2 or x.shape[0] > rows or x.shape[1] > cols:
        raise ValueError(
            f"x: expected a [r, c] matrix of one-byte elements within [{rows}, {cols}], got "
            f"{x.dtype} {list(x.shape)}"
        )
    out = torch.empty((cols, rows) if column_major else (rows, cols), dtype=x.dtype,
                      device=x.device)  # fmt: skip
    out = out.t() if column_major else out
    if rows and cols:
        src, dst = x.view(torch.uint8), out.view(torch.uint8)
        grid = (cdiv(rows, _BLOCK) * cdiv(cols, _BLOCK),)
        # A copy of bytes: nothing to contract; stated, so that Triton 3.9 does not warn.
        _padded_copy_kernel[grid](src, dst, x.shape[0], x.shape[1], rows, cols, *src.stride(),
                                  *dst.stride(), BLOCK=_BLOCK,
                                  enable_fp_fusion=False)  # fmt: skip
    return out
