"""Validation as nvdiffrec reports it (PSNR over the validation views, constant-colour
baseline), the output-sigmoid saturation on the same pixels, and the validation images."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mptex.host import to_host
from mptex.render.image import save_image
from mptex.scenes import Scene
from mptex.texture import MLPTexture3D
from mptex.train.checkpoint import disk_full_error, fsync_directory, fsync_file
from mptex.train.losses import psnr
from mptex.train.saturation import saturation_statistics
from mptex.train.shading import composite, draw_background, render_batch

__all__ = ["box_filter", "evaluate", "save_val_images"]


# ----------------------------------------------------------------------------- validation
def box_filter(img: torch.Tensor, spp: int) -> torch.Tensor:
    """The mean of each ``spp`` x ``spp`` block: a supersampled image at its pixel resolution.

    Args:
        img: ``[B, H * spp, W * spp, C]``.
        spp: samples per pixel along each axis (1: ``img`` itself).

    Returns:
        ``[B, H, W, C]``, pixel (y, x) the mean of sub-pixels (y * spp + i, x * spp + j).
    """
    if spp == 1:
        return img
    b, h, w, c = img.shape
    if h % spp or w % spp:
        raise ValueError(f"img: expected a height and width divisible by spp={spp}, got {h}x{w}")
    return img.reshape(b, h // spp, spp, w // spp, spp, c).mean(dim=(2, 4))


@torch.no_grad()
def evaluate(
    texture: MLPTexture3D, scene: Scene, settings: Mapping[str, Any], light_dir: torch.Tensor
) -> dict[str, Any]:
    """Validation as nvdiffrec reports it (PSNR over the validation views, constant-colour
    baseline), optionally supersampled, plus the output-sigmoid saturation.

    Algorithm: with ``settings["val_spp"]`` = 1 (the default) every validation pixel is scored
    at its centre, as nvdiffrec does. With ``val_spp`` = k > 1 the views are rendered at k x
    the resolution (the same cameras; :meth:`Scene.views`), the prediction is clamped to
    [0, 1] sub-pixel by sub-pixel (what validation does to every pixel: a texel beyond the
    output range must not cancel a neighbour's error), then prediction, reference and the
    constant-colour image are box-filtered back to the scene's resolution (:func:`box_filter`)
    before the PSNR: a pixel's score is its mean colour over its footprint, so a texture edge
    that crosses a pixel counts by the area it covers, not by which side the centre falls on.
    The views are evaluated in chunks of about as many sub-pixels as one point-sampled
    validation of all views has.

    Returns:
        dict with ``psnr`` (mean over views), ``psnr_per_image`` (list), ``baseline_psnr`` (the
        best constant colour: the mean reference colour over covered pixels, rendered and
        scored the same way), and ``pred``/``ref`` ``[B, H, W, 3]`` composited linear images
        at the scene's resolution, upright: row 0 is the top of the picture (the camera's
        projection flips y, as nvdiffrec's, so rasterized row 0 is already the top), ready to
        display without a flip; ``saturation``:
        :func:`~mptex.train.saturation.saturation_statistics` of the texture's logits at the
        covered (sub-)pixels of the validation views (the same
        pixels at every validation), its ``stuck_fraction`` against the reference's colour where
        ``shading`` is ``kd`` (there the rendered colour is the texture's value; None otherwise).
    """
    spp = int(settings.get("val_spp", 1))
    n_views = scene.n_val_views
    per_chunk = max(1, n_views // (spp * spp))
    kd = settings["shading"] == "kd"
    logits, values, references, valid = [], [], [], []
    preds, refs, coverages = [], [], []
    color_sum, alpha_sum = 0.0, 0.0
    # The render's own forward: the saturation costs no second evaluation of the texture.
    hook = texture.net.register_forward_hook(lambda module, args, out: logits.append(out))
    try:
        for first in range(0, n_views, per_chunk):
            views = scene.views("val", range(first, min(first + per_chunk, n_views)), spp)
            shape = views.mask.shape + (3,)
            background = draw_background(settings["val_background"], shape, views.rgba.device, None)
            ref = composite(views.rgba[..., 0:3], views.rgba[..., 3:4], background)
            pred, _ = render_batch(texture, views, settings, background, light_dir)
            covered = views.mask
            # Under kd shading a covered pixel is opaque: pred there is the texture's kd.
            values.append(pred[covered] if kd else None)
            references.append(views.rgba[..., 0:3][covered] if kd else None)
            # Where the reference is mostly background (alpha < 0.5) its colour is no target.
            valid.append(views.rgba[..., 3][covered] >= 0.5)
            alpha = views.rgba[..., 3:4]
            color_sum = color_sum + (views.rgba[..., 0:3] * alpha).sum((0, 1, 2))
            alpha_sum = alpha_sum + alpha.sum()
            if spp > 1:
                pred = pred.clamp(0.0, 1.0)
            preds.append(box_filter(pred, spp))
            refs.append(box_filter(ref, spp))
            coverages.append(box_filter(covered.unsqueeze(-1).float(), spp))
    finally:
        hook.remove()
    pred, ref = torch.cat(preds), torch.cat(refs)
    saturation = saturation_statistics(
        torch.cat(logits).float(),
        values=torch.cat(values) if kd else None,
        reference=torch.cat(references) if kd else None,
        valid=torch.cat(valid),
    )
    per_image = psnr(pred, ref)
    mean_color = color_sum / alpha_sum.clamp(min=1e-8)
    # composite() is linear in alpha and the background is uniform, so box-filtering the
    # constant-colour image equals compositing over the same background with the pixels'
    # covered fraction.
    background = draw_background(settings["val_background"], pred.shape, pred.device, None)
    constant = composite(mean_color.expand(pred.shape), torch.cat(coverages), background)
    # One host copy: the mean, the baseline's mean and each image's PSNR (float32 values).
    *per_image_host, psnr_mean, baseline_mean = to_host(
        torch.cat([per_image, per_image.mean().reshape(1), psnr(constant, ref).mean().reshape(1)])
    ).tolist()
    return dict(
        psnr=psnr_mean,
        psnr_per_image=per_image_host,
        baseline_psnr=baseline_mean,
        pred=pred,
        ref=ref,
        saturation=saturation,
    )


def save_val_images(out_dir: str | os.PathLike, evaluation: dict, n_images: int) -> None:
    """The first ``n_images`` validation views as ``out_dir/val_<i>.png``, reference | prediction
    side by side in sRGB.

    Each image is written in place and fsync'ed, then ``out_dir`` and the folder above it (the
    run directory, whose ``metrics.json`` comes next and names them): a record written after
    this never sits beside an empty or truncated image after a power loss.

    Raises:
        DiskFullError: the disk filled up (the partial image is removed).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref, pred = evaluation["ref"].cpu(), evaluation["pred"].cpu()
    for i in range(min(n_images, ref.shape[0])):
        # No flip: the projection already put the camera's up at row 0 (see evaluate).
        side = torch.cat([ref[i], pred[i]], dim=1)
        path = out_dir / f"val_{i:03d}.png"
        try:
            save_image(path, side, to_srgb=True)
            fsync_file(path)
        except Exception as exc:
            # A preview, written in place (not atomically): a full disk leaves no half PNG.
            full = disk_full_error(exc, path, "the partial image was removed")
            if full is None:
                raise
            path.unlink(missing_ok=True)
            raise full from None
    fsync_directory(out_dir)
    fsync_directory(out_dir.parent)
