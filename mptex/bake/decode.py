"""The trained texture decoded in a lower precision, as a runtime decoder would: the PSNR each
precision costs against the f32 decode, and the neural export (grid and MLP weights in one
precision, a safetensors file that :mod:`mptex.bake.neural_decoder` reads with NumPy alone).

Decode precisions (:data:`DECODE_PRECISIONS`); in every one the sigmoid and the output range
are f32, the activation between layers is ReLU:

==========  ====================================  ===============================================
precision   hash grid                             MLP
==========  ====================================  ===============================================
``f32``     f32 table, f32 interpolation          f32 weights and activations, f32 GEMMs
``f16``     f16 table, tcnn's half mode (f16      f16 weights and activations, f32 accumulation,
            products summed in f16, f16 output)   each layer's output rounded to f16
``bf16``    bf16 table, f32 interpolation,        bf16 weights and activations, f32
            output rounded to bf16                accumulation, output rounded to bf16
``fp8``     as ``f16``                            weights E4M3 per tensor (``448 / amax``),
                                                  each layer's input E4M3 per tensor with a
                                                  scale calibrated on the decoded points (or
                                                  given), f32 accumulation and output
``fp8_``    as ``f16``                            weights E4M3 per output channel (``448 /
``rowwise``                                       amax`` of the row), each layer's input E4M3
                                                  per point with its own ``448 / amax``
                                                  (nothing to calibrate), the f32 sum times
                                                  the point's and the channel's inverse scales
                                                  (:func:`mptex.fp8.scaled_mm_rowwise`)
``int8``    as ``f16``                            weights int8 per output channel (symmetric,
                                                  :func:`mptex.quantize.quantize_int8`),
                                                  activations f16: ``s_c * sum_j q_cj x_j``
                                                  accumulated in f32, output rounded to f16
==========  ====================================  ===============================================

The weights come from the texture's f32 masters by post-training quantisation. A texture trained
for its decoder (``int8_qat``, ``fp8_qat``, ``fp8_rowwise_qat``) holds masters whose
quantisation with the same quantiser *is* its trained fake-quantised weights:
:func:`decode_precision_table` says which. tcnn's fused network decodes with its padded
matrices and its input padded with ones, as tcnn evaluates it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mptex._fp8_scaling import _amax, _to_fp8
from mptex._grid_torch import hash_grid_encode
from mptex.export_config import DECODE_PRECISIONS
from mptex.fp8 import (
    E4M3,
    fp8_scale,
    quantize_fp8,
    quantize_fp8_rowwise,
    scaled_mm_rowwise,
)
from mptex.quantize import quantize_int8
from mptex.render.image import psnr
from mptex.texture import MLPTexture3D, _sigmoid

__all__ = [
    "DECODE_PRECISIONS",
    "DecoderWeights",
    "decoder_weights",
    "decode_texture",
    "decode_precision_table",
    "export_neural",
    "calibrate_fp8",
    "NEURAL_FORMAT",
]

NEURAL_FORMAT = "mptex-neural-texture/1"
_FLOAT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class DecoderWeights:
    """A texture's decoder, independent of how it was trained.

    Attributes:
        matrices: ``[out, in]`` f32 weights, input layer first (tcnn's padded ones for the
            fused network).
        input_padding: constant-1 inputs appended to the grid's features (tcnn pads its input
            with ones to a multiple of 16; 0 for the linear MLP).
        n_outputs: the texture's channels (rows of the last matrix beyond it are cut).
        trained_for: ``"int8"``/``"fp8"``/``"fp8_rowwise"`` for a QAT texture, else None.
    """

    matrices: list[torch.Tensor]
    input_padding: int
    n_outputs: int
    trained_for: str | None


def decoder_weights(texture: MLPTexture3D) -> DecoderWeights:
    """The texture's MLP as plain matrices (see :class:`DecoderWeights`).

    Raises:
        ValueError: ``texture: ...`` for an MLP with biases or a non-ReLU activation (mptex's
            texture builds neither).
    """
    net = texture.net
    if net.policy.mlp == "fused":
        fused = net.net
        matrices = [w.detach().float() for w in fused.layer_weights()]
        padding = matrices[0].shape[1] - fused.n_input_dims
        return DecoderWeights(matrices, padding, texture.channels, None)
    if any(layer.bias is not None for layer in net.layers):
        raise ValueError("texture: the decoder handles bias-free MLPs (nvdiffrec's), got biases")
    if any(not isinstance(m, (torch.nn.ReLU, torch.nn.Linear)) for m in net.net):
        raise ValueError("texture: the decoder handles ReLU MLPs (nvdiffrec's)")
    quant = net.policy.weight_quant
    return DecoderWeights(
        [layer.weight.detach().float() for layer in net.layers],
        0,
        texture.channels,
        None if quant == "none" else quant,
    )


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


def _features(texture: MLPTexture3D, points: torch.Tensor, precision: str) -> torch.Tensor:
    """[N, L * F] f32 grid features at world ``points`` in ``precision``'s grid mode."""
    lo, hi = texture.AABB[0], texture.AABB[1]
    unit = torch.clamp((points.float() - lo[None]) / (hi - lo)[None], min=0, max=1).contiguous()
    params = texture.encoder.params.detach().float()
    geometry = texture.encoder.geometry
    if precision == "f32":
        return hash_grid_encode(unit, params, geometry, torch.float32)
    if precision == "bf16":
        table = _round(params, torch.bfloat16)
        return _round(hash_grid_encode(unit, table, geometry, torch.float32), torch.bfloat16)
    return hash_grid_encode(unit, params, geometry, torch.float16).float()  # tcnn's half mode


def _fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, f32 scale_inv) with the per-tensor scale 448 / amax."""
    amax = weight.abs().amax()
    q, scale_inv, _, _ = quantize_fp8(weight, fp8_scale(amax, E4M3), E4M3, amax)
    return q, scale_inv


def _fp8_input(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # A calibrated scale can be exceeded by points outside the calibration set: saturated at
    # 448 (what a decoder's conversion with satfinite does), as mptex's quantisation casts.
    return _to_fp8(h * scale, E4M3)


def decode_texture(
    texture: MLPTexture3D,
    points: torch.Tensor,
    precision: str,
    input_scales: Sequence[float] | None = None,
) -> torch.Tensor:
    """The texture's values at ``points`` decoded in ``precision`` (module docstring).

    Args:
        texture: the trained texture (any arm).
        points: ``[N, 3]`` world positions (clamped into the AABB as ``sample`` does).
        precision: one of :data:`DECODE_PRECISIONS`.
        input_scales: ``fp8`` only: each layer's input scale (``448 / amax`` of a calibration
            set); None calibrates on ``points`` themselves.

    Returns:
        ``[N, channels]`` float32 in the texture's output range.
    """
    if precision not in DECODE_PRECISIONS:
        raise ValueError(f"precision: expected one of {DECODE_PRECISIONS}, got {precision!r}")
    weights = decoder_weights(texture)
    with torch.no_grad():
        h = _features(texture, points, precision)
        if weights.input_padding:
            h = torch.cat([h, h.new_ones(h.shape[0], weights.input_padding)], dim=1)
        last = len(weights.matrices) - 1
        for index, weight in enumerate(weights.matrices):
            h = _layer(h, weight, precision, None if input_scales is None else input_scales[index])
            if index < last:
                h = torch.relu(h)
        logits = h[:, : weights.n_outputs].float()
        lo, hi = texture.min_max[0], texture.min_max[1]
        return _sigmoid(logits) * (hi - lo)[None] + lo[None]


def _layer(h: torch.Tensor, weight: torch.Tensor, precision: str, input_scale) -> torch.Tensor:
    """One bias-free linear layer of the decoder in ``precision`` (module docstring)."""
    weight = weight.to(h.device)
    if precision in _FLOAT:
        dtype = _FLOAT[precision]
        out = _round(h, dtype) @ _round(weight, dtype).t()
        return out if precision == "f32" else _round(out, dtype)
    if precision == "int8":
        q, scales = quantize_int8(weight)
        return _round((_round(h, torch.float16) @ q.float().t()) * scales[None], torch.float16)
    if precision == "fp8_rowwise":
        w_q, w_inv, _, _ = quantize_fp8_rowwise(weight, E4M3)
        x_q, x_inv, _, _ = quantize_fp8_rowwise(h, E4M3)
        # The emulation on every device: its exact sums make the decode device-independent.
        return scaled_mm_rowwise(x_q, w_q.t(), x_inv, w_inv.t(), backend="emulated")
    w_q, w_inv = _fp8_weight(weight)
    if input_scale is None:
        input_scale = fp8_scale(_amax(h), E4M3)  # no points: amax 0, scale 1
    scale = torch.as_tensor(input_scale, dtype=torch.float32, device=h.device)
    x_q = _fp8_input(h, scale)
    return (x_q.float() @ w_q.float().t()) * (torch.reciprocal(scale) * w_inv)


def calibrate_fp8(texture: MLPTexture3D, points: torch.Tensor) -> list[float]:
    """Each layer's fp8 input scale ``448 / amax`` over ``points`` (decoded in fp8 in order:
    layer ``i``'s input is what the fp8 layers before it produce)."""
    weights = decoder_weights(texture)
    scales = []
    with torch.no_grad():
        h = _features(texture, points, "fp8")
        if weights.input_padding:
            h = torch.cat([h, h.new_ones(h.shape[0], weights.input_padding)], dim=1)
        for index, weight in enumerate(weights.matrices):
            scale = fp8_scale(_amax(h), E4M3)  # no points: amax 0, scale 1
            scales.append(float(scale))
            h = _layer(h, weight, "fp8", scale)
            if index < len(weights.matrices) - 1:
                h = torch.relu(h)
    return scales


def _composite(values: torch.Tensor, mask: torch.Tensor, level: float) -> torch.Tensor:
    image = torch.full((*mask.shape, 3), level, dtype=values.dtype, device=values.device)
    image[mask] = values[:, :3]
    return image


def decode_precision_table(
    texture: MLPTexture3D,
    positions: torch.Tensor,
    mask: torch.Tensor,
    background: str = "white",
    precisions: Sequence[str] = DECODE_PRECISIONS,
    reference: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The PSNR of the texture decoded in each precision against its f32 decode (and against
    the views' reference images where there are some).

    Each decode's albedo (channels 0:3) is put on the covered pixels of the views over the
    background and scored as the export scores its bake (nvdiffrec's PSNR: sRGB, clamp, per
    view, mean; at most 100 dB); fp8 calibrates its activation scales on these pixels.

    Args:
        texture: the trained texture.
        positions: ``[B, H, W, 3]`` the views' surface positions (a G-buffer's ``position``).
        mask: ``[B, H, W]`` bool, the covered pixels.
        background: ``"white"`` or ``"black"``.
        precisions: the precisions to decode (f32, the reference, always runs).
        reference: ``[B, H, W, 4]`` the views' reference RGBA (a scene's ``val_views().rgba``),
            or None.

    Returns:
        ``{"reference": "f32", "weights": "post-training quantisation" or "trained
        fake-quantised (<kind>)", "psnr_vs_f32": {precision: dB}, "max_abs_error":
        {precision: largest |value - f32 value| over the covered pixels' channels}}``, and
        with ``reference`` ``"psnr_vs_reference": {precision: dB}`` (f32 included: the
        albedo composited as the export composites its bake, against the reference over the
        same background).
    """
    unknown = [p for p in precisions if p not in DECODE_PRECISIONS]
    if unknown:
        raise ValueError(f"precisions: expected a list of {DECODE_PRECISIONS}, got {unknown}")
    level = 1.0 if background == "white" else 0.0
    points = positions[mask]
    f32_values = decode_texture(texture, points, "f32")
    ref_image = _composite(f32_values, mask, level)
    weights = decoder_weights(texture)
    table: dict[str, Any] = {
        "reference": "f32",
        "weights": "post-training quantisation"
        if weights.trained_for is None
        else f"trained fake-quantised ({weights.trained_for}) for {weights.trained_for}, "
        "post-training quantisation for the others",
        "psnr_vs_f32": {},
        "max_abs_error": {},
    }
    target = None
    if reference is not None:
        target = level + (reference[..., :3] - level) * reference[..., 3:4]
        table["psnr_vs_reference"] = {"f32": float(psnr(ref_image, target).mean())}
    for precision in precisions:
        if precision == "f32":
            continue
        values = decode_texture(texture, points, precision)
        if target is not None:
            image = _composite(values, mask, level)
            table["psnr_vs_reference"][precision] = float(psnr(image, target).mean())
        table["psnr_vs_f32"][precision] = float(
            psnr(_composite(values, mask, level), ref_image).mean()
        )
        table["max_abs_error"][precision] = (
            float((values - f32_values).abs().max()) if values.numel() else 0.0
        )
    return table


def export_neural(
    texture: MLPTexture3D,
    path: str | os.PathLike,
    precision: str,
    calibration_points: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Write the texture's grid and MLP in ``precision`` to a safetensors file that
    :func:`mptex.bake.neural_decoder.load` decodes with NumPy alone.

    Tensors: ``grid.table`` (F32 for ``f32``, BF16 for ``bf16``, F16 otherwise: tcnn's half
    mode), ``mlp.<i>.weight`` (F32 / F16 / BF16 / F8_E4M3 / I8), for ``fp8``
    ``mlp.<i>.weight_scale_inv`` and ``mlp.<i>.input_scale`` (f32 scalars), for
    ``fp8_rowwise`` ``mlp.<i>.weight_scale_inv`` (``[out]`` f32; the input scales are each
    point's own, computed by the decoder), for ``int8``
    ``mlp.<i>.weight_scale`` (``[out]`` f32). Metadata (strings): ``format``
    (:data:`NEURAL_FORMAT`), ``precision``, ``aabb``, ``min_max``, ``grid`` (tcnn's geometry:
    per-level scales, resolutions, table sizes, offsets, hashed), ``input_padding``,
    ``n_outputs``, ``activation`` (JSON).

    Args:
        texture: the trained texture.
        path: the ``.safetensors`` file to write.
        precision: one of :data:`DECODE_PRECISIONS`.
        calibration_points: ``fp8``: ``[M, 3]`` world points whose activations set the input
            scales (required for ``fp8``).

    Returns:
        ``{"file", "precision", "bytes", "input_scales" (fp8)}``. The file gets the mode a
        plain ``open()`` gives (``0o666`` less the umask), as the export's other files.

    Raises:
        RuntimeError: safetensors is not installed (``pip install safetensors``).
    """
    try:
        from safetensors.torch import save
    except ImportError:
        raise RuntimeError(
            "export.neural_precision: the neural export needs safetensors, which is not "
            "installed (pip install safetensors, or the export extra)"
        ) from None
    if precision not in DECODE_PRECISIONS:
        raise ValueError(f"precision: expected one of {DECODE_PRECISIONS}, got {precision!r}")
    weights = decoder_weights(texture)
    geometry = texture.encoder.geometry
    if geometry.interpolation != "Linear":
        raise ValueError(
            "texture: the neural export's decoder interpolates linearly (nvdiffrec's grid), "
            f"got interpolation {geometry.interpolation!r}"
        )
    params = texture.encoder.params.detach().float().cpu()
    grid_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.float16)
    tensors = {"grid.table": params.to(grid_dtype).contiguous()}
    input_scales = None
    if precision == "fp8":
        if calibration_points is None:
            raise ValueError("calibration_points: the fp8 export needs points to calibrate on")
        input_scales = calibrate_fp8(texture, calibration_points)
    for index, weight in enumerate(weights.matrices):
        weight = weight.cpu()
        key = f"mlp.{index}"
        if precision in _FLOAT:
            tensors[f"{key}.weight"] = weight.to(_FLOAT[precision]).contiguous()
        elif precision == "int8":
            q, scales = quantize_int8(weight)
            tensors[f"{key}.weight"], tensors[f"{key}.weight_scale"] = q, scales
        elif precision == "fp8_rowwise":
            q, scale_inv, _, _ = quantize_fp8_rowwise(weight, E4M3)
            tensors[f"{key}.weight"] = q.contiguous()
            tensors[f"{key}.weight_scale_inv"] = scale_inv.reshape(-1).float().contiguous()
        else:
            q, scale_inv = _fp8_weight(weight)
            tensors[f"{key}.weight"] = q.contiguous()
            tensors[f"{key}.weight_scale_inv"] = scale_inv.reshape(1).float()
            tensors[f"{key}.input_scale"] = torch.tensor([input_scales[index]], dtype=torch.float32)
    metadata = {
        "format": NEURAL_FORMAT,
        "precision": precision,
        "aabb": json.dumps(texture.AABB.cpu().tolist()),
        "min_max": json.dumps(texture.min_max.cpu().tolist()),
        "grid": json.dumps(
            {
                "n_input_dims": geometry.n_input_dims,
                "n_features_per_level": geometry.n_features_per_level,
                "interpolation": geometry.interpolation,
                "scales": list(geometry.scales),
                "resolutions": list(geometry.resolutions),
                "table_sizes": list(geometry.table_sizes),
                "offsets": list(geometry.offsets),
                "hashed": list(geometry.hashed),
            }
        ),
        "input_padding": str(weights.input_padding),
        "n_outputs": str(weights.n_outputs),
        "activation": "ReLU",
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # safetensors' save_file creates the file with mode 0o600; written as bytes, the file gets
    # the mode of the asset's other files (0o666 less the umask).
    path.write_bytes(save(tensors, metadata=metadata))
    out: dict[str, Any] = {"file": path.name, "precision": precision, "bytes": path.stat().st_size}
    if input_scales is not None:
        out["input_scales"] = input_scales
    return out
