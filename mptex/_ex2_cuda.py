"""tcnn's ``exp2f`` on a CUDA device: PTX ``ex2.approx.ftz.f32``, for the grid's level scales.

tiny-cuda-nn's torch bindings are built with ``--use_fast_math``, under which ``exp2f`` is the
approximate ``ex2.approx.ftz.f32`` instruction (measured 0 or +1 float32 ulp from the correctly
rounded value on an H100; no bit-exact CPU model of it is known to mptex). Its results on the
device itself give :func:`mptex._grid_torch.grid_geometry` tcnn's level scales there
(``exp2="cuda-ex2"``). A one-off Triton kernel with inline PTX evaluates it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mptex._triton_launch import cdiv, launching_on

__all__ = ["ex2_approx_cuda"]


@triton.jit
def _ex2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = PTX ``ex2.approx.ftz.f32`` of x."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    y = tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )
    tl.store(out_ptr + offsets, y, mask=mask)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_ex2_kernel, InterpretedFunction)


def ex2_approx_cuda(inputs: list[float], device: torch.device | str | None = None) -> list[float]:
    """PTX ``ex2.approx.ftz.f32`` of float32 ``inputs`` on a CUDA device (the current one by
    default).

    Args:
        inputs: values, each rounded to float32 first.
        device: a CUDA device.

    Returns:
        The results, as Python floats (float32 values).

    Raises:
        RuntimeError: without an NVIDIA CUDA device, or under Triton's interpreter (which runs
            no inline PTX).
    """
    if _interpreted() or not torch.cuda.is_available() or torch.version.hip is not None:
        raise RuntimeError(
            "exp2='cuda-ex2' needs an NVIDIA CUDA device and compiled Triton (not "
            "TRITON_INTERPRET=1); use exp2='correctly-rounded' or 'h100-table' elsewhere"
        )
    device = torch.device("cuda") if device is None else torch.device(device)
    x = torch.tensor(inputs, dtype=torch.float32, device=device)
    out = torch.empty_like(x)
    if x.numel():
        with launching_on(device):
            # Nothing to contract; stated, so that no Triton default (it changes in 3.10)
            # decides, and Triton 3.9 does not warn in every CUDA run.
            _ex2_kernel[(cdiv(x.numel(), 128),)](x, out, x.numel(), BLOCK=128,
                                                 enable_fp_fusion=False)  # fmt: skip
    return out.cpu().tolist()
