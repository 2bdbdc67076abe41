"""Weight quantisation for a decoder that runs in int8 or FP8: the quantisers, and their
fake-quantised form for training (quantisation-aware training, QAT) with straight-through
gradients.

* **int8**, per output channel, symmetric (what int8 inference engines and the RTX Neural
  Texture Compression SDK's int8 decoder take): row ``c`` of a ``[out, in]`` weight has the f32
  scale ``s_c = max_j |W[c, j]| / 127`` (1.0 where that is 0: a zero row, or one whose
  largest magnitude is below 64 x 2^-149, where the quotient underflows) and the values
  ``q = clamp(round_half_even(W / s_c), -127, 127)``; it stands for ``q * s_c``. -128 is never
  used, so the range is symmetric.
* **fp8**, per tensor, E4M3 with the current amax (:func:`mptex.fp8.quantize_fp8`,
  ``scale = 448 / amax``): the weight stands for ``fp8(W * scale) / scale``.
* **fp8_rowwise**, E4M3 per output channel (row ``c`` with ``scale_c = 448 / amax_c``,
  :func:`mptex.fp8.quantize_fp8_rowwise`), for a decoder whose layer inputs are E4M3 per row
  (sample) as well: :func:`fake_quantize_input` rounds them so in training.

Fake quantisation returns the f32 value the quantised weight stands for; the backward passes
the gradient through unchanged (the straight-through estimator: ``d fake_quantize(W) / dW`` is
taken as the identity; no value is clipped, since the scales come from the weight's own
maximum). The f32 master weights keep training; the forward sees what the decoder will see.
"""

from __future__ import annotations

import torch

from mptex._fp8_scaling import _constant
from mptex.fp8 import E4M3, _rowwise_operand, quantization_error

__all__ = [
    "WEIGHT_QUANT",
    "INT8_MAX",
    "int8_channel_scales",
    "quantize_int8",
    "e4m3_values",
    "fake_quantize",
    "fake_quantize_input",
    "quantization_error",
]

WEIGHT_QUANT = ("none", "int8", "fp8", "fp8_rowwise")
INT8_MAX = 127


def int8_channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """``[out]`` f32 scales ``max_j |W[c, j]| / 127`` (1.0 where the quotient is 0: a row all
    zero, or with its largest magnitude below 64 x 2^-149, whose quotient underflows float32;
    a scale of 0 would divide the row's zeros into NaN codes and its other values into +-127
    codes that an engine inverting the scale reads as infinite). A row holding a NaN gets 1.0
    too; no trained weight holds one (a step with a non-finite gradient is skipped, and a
    checkpoint with non-finite weights is refused).

    Args:
        weight: ``[out, in]`` float.
    """
    amax = weight.detach().float().abs().amax(dim=1)
    # A tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal,
    # not the correctly rounded quotient the CPU computes.
    scales = torch.div(amax, _constant(float(INT8_MAX), amax.device))
    return torch.where(scales > 0, scales, torch.ones_like(amax))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: ``q`` ``[out, in]`` int8 in [-127, 127] and ``scales`` ``[out]`` f32,
    with ``weight ~ q * scales[:, None]`` (module docstring)."""
    q, scales = _int8_codes(weight)
    return q.to(torch.int8), scales


def _int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8``'s codes as float32 integers (NaN where the weight is NaN, which the
    int8 cast would turn into some code), and its scales."""
    scales = int8_channel_scales(weight)
    # torch.round rounds half to even, as the IEEE default and int8 engines' conversions.
    q = torch.round(weight.detach().float() / scales[:, None]).clamp(-INT8_MAX, INT8_MAX)
    return q, scales


def e4m3_values(x: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
    """``x`` rounded to E4M3 with its current scale, as the float32 values an FP8 decoder
    sees: one scale for the tensor (``448 / amax``, :func:`mptex.fp8.quantize_fp8` with
    :func:`mptex.fp8.fp8_scale` of the amax) or, with ``rowwise``, one per row of a ``[M, K]``
    ``x`` (:func:`mptex.fp8.quantize_fp8_rowwise`), then times the inverse scale
    (:func:`mptex.fp8.dequantize_fp8`). The same bits as those eager ops, in one
    ``mptex::fp8_quantize`` (the current or row-wise recipe, margin 0, returning the codes'
    float32 values) and one multiply.

    Args:
        x: any shape (``[M, K]`` with ``rowwise``), any float dtype.

    Returns:
        float32, ``x``'s shape.
    """
    q, scale_inv = _rowwise_operand(x.detach().float(), E4M3, 0, torch.float32, rowwise=rowwise)
    return q * scale_inv


def _quantized_value(weight: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "int8":
        # The codes before their int8 cast: the same values, and a NaN weight stays NaN in
        # the forward, as the FP8 kinds keep it.
        q, scales = _int8_codes(weight)
        return q * scales[:, None]
    return e4m3_values(weight, rowwise=kind == "fp8_rowwise")


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, kind):
        return _quantized_value(weight, kind).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The value ``weight`` takes in an int8 or FP8 decoder, with a straight-through gradient.

    Args:
        weight: ``[out, in]`` float (the f32 master).
        kind: ``"int8"`` (per output channel), ``"fp8"`` (per tensor, E4M3) or
            ``"fp8_rowwise"`` (per output channel, E4M3); ``"none"`` returns ``weight`` itself.

    Returns:
        ``[out, in]`` in ``weight``'s dtype; its gradient reaches ``weight`` unchanged.
    """
    if kind == "none":
        return weight
    if kind not in WEIGHT_QUANT:
        raise ValueError(f"kind: expected one of {WEIGHT_QUANT}, got {kind!r}")
    return _StraightThrough.apply(weight, kind)


def fake_quantize_input(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A layer's input as the decoder of ``kind`` sees it, with a straight-through gradient:
    for ``"fp8_rowwise"`` each row (sample) E4M3 with its own current scale
    (:func:`mptex.fp8.quantize_fp8_rowwise`); ``x`` itself for the other kinds, which train
    with rounded weights only.

    Args:
        x: ``[..., in]`` float.
        kind: one of :data:`WEIGHT_QUANT`.

    Returns:
        ``x``'s shape and dtype; its gradient reaches ``x`` unchanged.
    """
    if kind not in WEIGHT_QUANT:
        raise ValueError(f"kind: expected one of {WEIGHT_QUANT}, got {kind!r}")
    if kind != "fp8_rowwise":
        return x
    return _StraightThroughRows.apply(x)


class _StraightThroughRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        rows = x.detach().reshape(-1, x.shape[-1])
        return e4m3_values(rows, rowwise=True).reshape(x.shape).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad
