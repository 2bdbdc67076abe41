"""Reader for the NeRF-synthetic dataset format, with nvdiffrec's camera conversion.

A split ``<root>/transforms_<split>.json`` holds ``camera_angle_x`` (horizontal field of view,
radians) and ``frames``, each with ``file_path`` (relative to root, extension optional as in the
original dataset) and ``transform_matrix`` (4x4 camera-to-world, OpenGL axes). As nvdiffrec's
``dataset_nerf.py``: ``mv = inverse(transform_matrix)``, ``fovy`` from ``camera_angle_x`` and the
image aspect, ``proj = perspective(fovy, aspect, near, far)``, images sRGB -> linear RGB.
"""

from __future__ import annotations

import glob
import json
import math
import os
from pathlib import Path

import torch

from mptex.render.camera import Cameras, cameras_from_mv, fovx_to_fovy, perspective
from mptex.render.image import load_image

__all__ = ["load_nerf_split"]


def _frame_image(root: Path, file_path: str, json_path: Path) -> Path:
    candidate = root / file_path
    if candidate.is_file():
        return candidate
    # The original dataset omits the extension ("./train/r_0"); take the file it names (its
    # name as written: "r_[0]" or "r_*" are names, not patterns matching r_0 or any r_).
    matches = sorted(candidate.parent.glob(glob.escape(candidate.name) + ".*"))
    if not matches:
        raise ValueError(f"{json_path}: frame image {candidate}(.*) does not exist")
    return matches[0]


def load_nerf_split(
    root: str | os.PathLike, split: str, near: float = 0.1, far: float = 1000.0
) -> tuple[Cameras, torch.Tensor]:
    """Load the cameras and images of one split.

    Args:
        root: dataset folder holding ``transforms_<split>.json``.
        split: "train", "val" or "test".
        near, far: clip planes of the projection.

    Returns:
        (cameras, rgba): cameras of the N frames, rgba [N, H, W, 4] float32 with linear RGB and
        the image alpha (1 where the image has no alpha channel).

    Raises:
        ValueError: for a missing or malformed file, naming it.
    """
    root = Path(root)
    json_path = root / f"transforms_{split}.json"
    if not json_path.is_file():
        raise ValueError(f"{json_path}: file not found")
    try:
        meta = json.loads(json_path.read_text())
        given_fovx = meta["camera_angle_x"]
        fovx = float(given_fovx)
        frames = meta["frames"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{json_path}: malformed ({type(exc).__name__}: {exc})") from exc
    # (a field of view past pi would wrap through tan into another, narrower one)
    if isinstance(given_fovx, bool) or not 0 < fovx < math.pi:
        raise ValueError(
            f"{json_path}: camera_angle_x: expected the horizontal field of view in radians, "
            f"in (0, pi), got {given_fovx!r}"
        )
    if not isinstance(frames, list):
        raise ValueError(f"{json_path}: frames: expected a list of frames, got {frames!r:.80}")
    if not frames:
        raise ValueError(f"{json_path}: no frames")

    images, matrices = [], []
    for n, frame in enumerate(frames):
        try:
            c2w = torch.tensor(frame["transform_matrix"], dtype=torch.float32)
            file_path = frame["file_path"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{json_path}: frame {n} malformed ({exc})") from exc
        if not isinstance(file_path, str) or not file_path:
            raise ValueError(
                f"{json_path}: frame {n} file_path: expected an image path relative to the "
                f"dataset folder, got {file_path!r:.80}"
            )
        if c2w.shape != (4, 4):
            raise ValueError(f"{json_path}: frame {n} transform_matrix is not 4x4")
        if not bool(torch.isfinite(c2w).all()) or abs(float(torch.linalg.det(c2w))) < 1e-12:
            raise ValueError(
                f"{json_path}: frame {n} transform_matrix is not a finite invertible camera pose"
            )
        image_path = _frame_image(root, file_path, json_path)
        try:
            img = load_image(image_path, to_linear=True)
        except (OSError, RuntimeError) as exc:  # a corrupt or unreadable frame image
            raise ValueError(
                f"{image_path}: cannot read frame {n} of {json_path} ({exc})"
            ) from None
        if img.shape[-1] == 3:
            img = torch.cat([img, torch.ones_like(img[..., :1])], -1)
        if img.shape[-1] != 4:
            raise ValueError(
                f"{json_path}: frame {n} image {image_path} has {img.shape[-1]} channel(s); "
                "expected RGB or RGBA (3 or 4)"
            )
        if images and img.shape != images[0].shape:
            (height, width), (height0, width0) = img.shape[:2], images[0].shape[:2]
            raise ValueError(
                f"{json_path}: frame {n} image size differs from frame 0: {height} x {width} "
                f"pixels, expected {height0} x {width0} (height x width)"
            )
        images.append(img)
        matrices.append(torch.linalg.inv(c2w))

    height, width = images[0].shape[:2]
    aspect = width / height
    proj = perspective(fovx_to_fovy(fovx, aspect), aspect, near, far)
    return cameras_from_mv(torch.stack(matrices), proj), torch.stack(images)
