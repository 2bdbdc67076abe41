"""Image I/O through imageio and sRGB <-> linear conversion as nvdiffrec's ``render/util.py``.

8-bit formats (PNG, JPEG) go through Pillow, which imageio always has. Float formats (EXR, HDR)
need an imageio plugin that can write them (FreeImage or OpenCV); when none is installed,
``save_image`` / ``load_image`` raise a RuntimeError that says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["rgb_to_srgb", "srgb_to_rgb", "psnr", "save_image", "load_image"]

_FLOAT_FORMATS = (".exr", ".hdr")
# TIFF's PhotometricInterpretation tag and its value for YCbCr samples.
_TIFF_PHOTOMETRIC, _TIFF_YCBCR = 262, 6


def _linear_to_srgb(f: torch.Tensor) -> torch.Tensor:
    # The clamp inside pow keeps the unused branch finite, so gradients stay finite too.
    return torch.where(
        f <= 0.0031308, f * 12.92, torch.pow(torch.clamp(f, 0.0031308), 1.0 / 2.4) * 1.055 - 0.055
    )


def _srgb_to_linear(f: torch.Tensor) -> torch.Tensor:
    return torch.where(
        f <= 0.04045, f / 12.92, torch.pow((torch.clamp(f, 0.04045) + 0.055) / 1.055, 2.4)
    )


def _per_rgb(fn, f: torch.Tensor, name: str) -> torch.Tensor:
    if f.shape[-1] not in (3, 4):
        raise ValueError(f"{name}: expected 3 or 4 channels (last dim), received {f.shape[-1]}")
    if f.shape[-1] == 3:
        return fn(f)
    return torch.cat([fn(f[..., :3]), f[..., 3:]], dim=-1)  # alpha is not a colour


def rgb_to_srgb(f: torch.Tensor) -> torch.Tensor:
    """Linear RGB(A) -> sRGB(A), the piecewise sRGB curve; alpha passes through.

    Args:
        f: [..., 3] or [..., 4] floating-point image.
    """
    return _per_rgb(_linear_to_srgb, f, "f")


def srgb_to_rgb(f: torch.Tensor) -> torch.Tensor:
    """sRGB(A) -> linear RGB(A), the inverse of ``rgb_to_srgb``; alpha passes through."""
    return _per_rgb(_srgb_to_linear, f, "f")


def psnr(img: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB as nvdiffrec's ``validate_itr``.

    Both images are linear RGB; each is converted to sRGB and clamped to [0, 1], then
    ``-10 log10(MSE)`` per image. The MSE is floored at 1e-10 (PSNR <= 100 dB) so that a
    perfect match stays a finite JSON number.

    Args:
        img, ref: ``[B, H, W, 3]`` float32 linear RGB.

    Returns:
        ``[B]`` float32.
    """
    a = torch.clamp(rgb_to_srgb(img), 0.0, 1.0)
    b = torch.clamp(rgb_to_srgb(ref), 0.0, 1.0)
    mse = ((a - b) ** 2).flatten(1).mean(1)
    return -10.0 * torch.log10(torch.clamp(mse, min=1e-10))


def save_image(path: str | os.PathLike, img: torch.Tensor | np.ndarray, to_srgb: bool = False):
    """Write an image.

    Args:
        path: destination; ``.png``/``.jpg`` are written as 8-bit (values clamped to [0, 1]),
            ``.exr``/``.hdr`` as float32 (needs an imageio plugin that writes them).
        img: [H, W, C] (C in 1, 3, 4) or [H, W] float image.
        to_srgb: convert linear RGB to sRGB before writing (8-bit formats only make sense so).

    Raises:
        RuntimeError: for a float format that no installed imageio plugin can write.
    """
    import imageio.v3 as iio

    path = Path(path)
    data = torch.as_tensor(img).detach().float().cpu()
    if data.dim() == 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if to_srgb:
        data = rgb_to_srgb(data)
    if path.suffix.lower() in _FLOAT_FORMATS:
        try:
            iio.imwrite(path, data.numpy().astype(np.float32))
        except Exception as exc:  # imageio raises several types when no plugin fits
            raise RuntimeError(
                f"save_image: cannot write {path.suffix} here ({type(exc).__name__}: {exc}); "
                "install an imageio plugin for it (e.g. `pip install opencv-python-headless` "
                "or FreeImage) or write .png"
            ) from exc
        return
    data = (data.clamp(0, 1) * 255 + 0.5).to(torch.uint8).numpy()
    iio.imwrite(path, data)


def _pillow_special(path: Path) -> np.ndarray | None:
    """The pixels of images that imageio would misread, or None for the others.

    * 16-bit colour PNGs: Pillow (imageio's PNG reader) keeps only the high byte of each
      sample. Its decoder is run twice, once reading each sample's bytes as big-endian (high
      bytes) and once as little-endian (low bytes), and the two halves are joined: [H, W, C]
      uint16. 16-bit grey + alpha has no little-endian reader: its 4 bytes per pixel are
      read once as 8-bit RGBA (the same bytes per pixel, so PNG's filters undo alike), i.e.
      (grey high, grey low, alpha high, alpha low): [H, W, 2] uint16. (16-bit grey is read at
      full depth by Pillow itself.)
    * CMYK / YCbCr / LAB / HSV JPEGs and TIFFs: four or three channels that are not RGB(A);
      converted to RGB by Pillow: [H, W, 3] uint8.

    Raises ValueError for an uncompressed YCbCr TIFF that Pillow opens as RGB (Pillow 12.3.0,
    the newest for Python 3.10, does; 13.0.0 opens it as YCbCr): its Y, Cb, Cr samples would
    come back as R, G, B.
    """
    try:
        import PIL
        from PIL import Image
    except ImportError:  # imageio's Pillow plugin is then missing too; imageio reports it
        return None
    try:
        image = Image.open(path)
    except Exception:  # not a Pillow format (EXR, HDR, ...): imageio's other plugins decide
        return None
    with image:
        if (
            image.format == "TIFF"
            and image.tag_v2.get(_TIFF_PHOTOMETRIC) == _TIFF_YCBCR
            and image.mode != "YCbCr"
            and image.tile[0][0] == "raw"
        ):
            raise ValueError(
                f"Pillow {PIL.__version__} opens this uncompressed YCbCr TIFF as {image.mode}, "
                "its Y, Cb, Cr samples as colours (Pillow >= 13.0 reads it)"
            )
        if image.mode in ("CMYK", "YCbCr", "LAB", "HSV"):
            return np.asarray(image.convert("RGB"))
        tile = image.tile
        rawmodes = {"RGB;16B": "RGB;16L", "RGBA;16B": "RGBA;16L", "LA;16B": "RGBA"}
        if image.format != "PNG" or len(tile) != 1 or tile[0].args not in rawmodes:
            return None
        if tile[0].args == "LA;16B":
            image.tile = [tile[0]._replace(args="RGBA")]
            data = np.asarray(image).astype(np.uint16)
            return data[..., 0::2] * 256 + data[..., 1::2]
        high = np.asarray(image)
    with Image.open(path) as again:
        again.tile = [again.tile[0]._replace(args=rawmodes[tile[0].args])]
        low = np.asarray(again)
    return high.astype(np.uint16) * 256 + low


def load_image(path: str | os.PathLike, to_linear: bool = False) -> torch.Tensor:
    """Read an image as float32.

    8-bit images (PNG, JPEG, ...) are scaled by 1 / 255, 16-bit PNGs (grey, grey + alpha, RGB,
    RGBA) by 1 / 65535 at their full depth, floats (EXR, HDR) kept. Palette images come back as
    RGB (RGBA when the palette has transparency), CMYK / YCbCr JPEGs as RGB, 1-bit images as
    0 / 1, animated GIFs / PNGs and multi-page TIFFs as their first frame.

    Args:
        path: image file.
        to_linear: convert sRGB colour channels to linear RGB (alpha untouched; only 3- and
            4-channel images are converted: a grey image is returned as stored).

    Returns:
        [H, W, C] float32 tensor (grey images get C = 1, grey + alpha C = 2).

    Raises:
        FileNotFoundError: ``path`` is no file.
        RuntimeError: no installed reader decodes it; one line naming the file and the reader's
            reason.
    """
    import imageio.v3 as iio

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_image: no such file {path}")
    try:
        data = _pillow_special(path)
        if data is None:
            data = iio.imread(path)
    except Exception as exc:
        # One line: imageio's "no backend" message lists plugins over several lines.
        why = " ".join(str(exc).split())
        raise RuntimeError(f"load_image: cannot read {path} ({type(exc).__name__}: {why})") from exc
    if data.ndim == 4:  # the frames of an animated GIF / PNG or the pages of a TIFF
        data = data[0]
    if data.dtype == np.uint8:
        out = torch.from_numpy(data.astype(np.float32) / 255.0)
    elif data.dtype == np.uint16:
        out = torch.from_numpy(data.astype(np.float32) / 65535.0)
    else:
        out = torch.from_numpy(data.astype(np.float32))
    if out.dim() == 2:
        out = out.unsqueeze(-1)
    if to_linear and out.shape[-1] in (3, 4):
        out = srgb_to_rgb(out)
    return out
