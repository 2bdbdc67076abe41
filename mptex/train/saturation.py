"""Output-sigmoid saturation of an :class:`~mptex.MLPTexture3D`: which fraction of the texture's
logits sit where the sigmoid is flat, and which of those are also wrong ("stuck").

The texture's output is ``lo + sigmoid(z) * (hi - lo)`` per channel, ``z`` the MLP's logit. The
gradient through the sigmoid is ``sigmoid'(z) = s (1 - s)``: 0.25 at ``z = 0``, 3.4e-4 at
``|z| = 8`` (1/740 of its peak) and exactly 0 in float32 beyond ``|z| ~ 17`` (``s`` rounds to 1).
A logit past :data:`SATURATION_LOGIT` therefore barely moves however wrong its pixel is: Adam
normalises per parameter, not per pixel, so a saturated pixel's share of the shared weights'
gradient stays ~1/740 of an unsaturated one's. Saturation alone is not a fault: a pure colour
channel (a reference blue of exactly 0) drives its logit towards -inf in a healthy fit. The
collapse signature is a pixel that is saturated *and* wrong, :func:`saturation_statistics`'s
``stuck_fraction``.
"""

from __future__ import annotations

from typing import Any

import torch

from mptex.host import to_host
from mptex.render.image import rgb_to_srgb

__all__ = ["SATURATION_LOGIT", "STUCK_TOLERANCE", "saturated_counts", "saturation_statistics"]

# |z| > 8: sigmoid'(z) < 3.4e-4 (1/740 of its peak 0.25) and the output is within 3.4e-4 of its
# rail, closer than one 8-bit sRGB level over most of the range (near 0, sRGB's slope of 12.92
# puts it at ~1.1 levels): the channel is at the rail to display precision and its gradient is
# almost gone.
SATURATION_LOGIT = 8.0
# A saturated value counts as wrong when it differs from the reference by more than this, in the
# texture's linear output space: 0.1 is 10 % of the [0, 1] range, far beyond what a fit of a
# near-black or near-white reference leaves (a reference within 0.1 of a rail is fitted by a
# saturated logit legitimately), and well inside the gap of a channel pinned at the wrong rail
# (the duck's eye: blue pinned at 0 where the reference is white, docs/archive/loss-function.md).
STUCK_TOLERANCE = 0.1


def srgb_clamped(values: torch.Tensor) -> torch.Tensor:
    """Linear values ``[N, K]`` (any K) -> sRGB clamped to [0, 1]: what nvdiffrec's PSNR
    compares. The sRGB curve is per channel, so any channel count goes through it."""
    per_value = rgb_to_srgb(values.reshape(-1, 1).expand(-1, 3))[:, 0]
    return torch.clamp(per_value.reshape(values.shape), 0.0, 1.0)


def saturated_counts(logits: torch.Tensor, threshold: float = SATURATION_LOGIT) -> torch.Tensor:
    """``[C]`` float64 (float32 on MPS) counts, on ``logits``' device, of the rows whose logit in
    channel ``c`` has ``|z| > threshold`` (NaN counts as not saturated). No host copy.

    Args:
        logits: ``[N, C]`` the texture's logits (any float dtype).
        threshold: the ``|z|`` beyond which a logit is saturated.
    """
    acc = torch.float32 if logits.device.type == "mps" else torch.float64
    return (logits.detach().abs() > threshold).sum(0).to(acc)


def saturation_statistics(
    logits: torch.Tensor,
    values: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    threshold: float = SATURATION_LOGIT,
    tolerance: float = STUCK_TOLERANCE,
) -> dict[str, Any]:
    """Per channel: the fraction of pixels whose logit is saturated, and of those stuck.

    A pixel is *saturated* in channel ``c`` when ``|logits[:, c]| > threshold`` and *stuck* when
    it is saturated and ``|values[:, c] - reference[:, c]| > tolerance`` at a ``valid`` pixel
    (where the reference shows no surface, nothing is wrong). Both fractions are over all ``N``
    pixels. Only the first ``K`` channels, those with a reference, have a stuck fraction.

    Args:
        logits: ``[N, C]`` the texture's logits at the N covered pixels (before the sigmoid).
        values: ``[N, K]`` (K <= C) float the texture's output in channels ``0..K-1``, in its
            linear output space (``lo + sigmoid(z) * (hi - lo)``), or None (no stuck fraction).
        reference: ``[N, K]`` float what those channels should be, or None.
        valid: ``[N]`` bool, the pixels where the reference holds a surface (default: all).
        threshold: the saturation logit (default :data:`SATURATION_LOGIT`, 8).
        tolerance: how far from the reference a saturated value is wrong (default
            :data:`STUCK_TOLERANCE`, 0.1).

    Returns:
        ``{"saturated_fraction": [C floats], "stuck_fraction": [C] floats, None for channels
        without a reference, or None without ``values``/``reference``,
        "stuck_error_fraction": the share of the squared error that the stuck pixels hold (a
        pixel stuck in any channel; the error of the K channels as the PSNR measures it: sRGB,
        clamped to [0, 1], summed over channels and the valid pixels; 0.0 without error, None
        without ``values``/``reference``), "covered_pixels": N, "threshold_logit": threshold,
        "stuck_tolerance": tolerance}``; one host copy.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits: expected shape [N, C], got {list(logits.shape)}")
    n_pixels, n_channels = logits.shape
    counts = [saturated_counts(logits, threshold)]
    n_ref = 0
    if values is not None and reference is not None:
        n_ref = values.shape[-1]
        if (
            values.shape != reference.shape
            or values.shape[0] != n_pixels
            or not 0 < n_ref <= n_channels
        ):
            raise ValueError(
                f"values, reference: expected shape [{n_pixels}, K <= {n_channels}], got "
                f"{list(values.shape)} and {list(reference.shape)}"
            )
        saturated = logits.detach()[:, :n_ref].abs() > threshold
        wrong = (values.detach().float() - reference.detach().float()).abs() > tolerance
        if valid is not None:
            wrong = wrong & valid.reshape(-1, 1)
        stuck_pixels = saturated & wrong
        counts.append(stuck_pixels.sum(0).to(counts[0].dtype))
        # What the PSNR sees of each pixel's error (nvdiffrec's: sRGB, clamped).
        error = (
            (srgb_clamped(values.detach().float()) - srgb_clamped(reference.detach().float()))
            .square()
            .sum(-1)
        )
        if valid is not None:
            error = error * valid.reshape(-1).to(error.dtype)
        stuck_error = error[stuck_pixels.any(-1)].sum()
        counts.append(torch.stack([stuck_error, error.sum()]).to(counts[0].dtype))
    host = to_host(torch.cat(counts)).tolist()  # the one host copy
    total = max(n_pixels, 1)
    stuck = stuck_error_fraction = None
    if n_ref:
        stuck = [c / total for c in host[n_channels : n_channels + n_ref]]
        stuck += [None] * (n_channels - n_ref)
        stuck_sum, error_sum = host[n_channels + n_ref :]
        stuck_error_fraction = stuck_sum / error_sum if error_sum > 0 else 0.0
    return {
        "saturated_fraction": [c / total for c in host[:n_channels]],
        "stuck_fraction": stuck,
        "stuck_error_fraction": stuck_error_fraction,
        "covered_pixels": int(n_pixels),
        "threshold_logit": float(threshold),
        "stuck_tolerance": float(tolerance),
    }
