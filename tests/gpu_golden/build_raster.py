"""Compact nvdiffrast's rasterizer golden outputs for tests/test_gpu_golden_raster.py.

The sources are the ``raster_{mesh}.npz`` files that the GPU capture script writes, one per
mesh (the built-in torus knot ``torus_knot(200, 24)`` and pybullet_data's duck normalised to
unit size), each nvdiffrast 0.4.0's ``rasterize`` (CUDA context) of 4 views at 512x512: keys
``clip`` [B, V, 4] float32 (the clip-space vertices given to nvdiffrast), ``tri`` [T, 3] int32,
``uv`` [B, H, W, 2] and ``zw`` [B, H, W] float32 (its output), ``tri_id`` [B, H, W] int32
(triangle id + 1, 0 where empty).

The clip-space vertices are stored although the project's camera code makes them: a matmul on
another CPU rounds differently in the last bit, and a last-bit change moves a vertex's snapped
position and with it pixels on edges. The compact ``raster_{mesh}.npz`` keeps:

- ``clip_bytes``: uint8 [4, B, V, 4], byte k (little-endian) of each float32 of ``clip`` in
  plane k (deflate compresses the planes by 15 % more than the floats; ``clip_from_bytes``
  reassembles them);
- ``tri``: int32 [T, 3];
- ``tri_id``: int16 [B, H, W], nvdiffrast's ids in full;
- ``sample``: int32 [N], flat indices into [B, H, W] of every ``SAMPLE_STRIDE``-th pixel that
  nvdiffrast covers (in C order), and ``uv`` [N, 2], ``zw`` [N] float32 there.

Usage: ``python tests/gpu_golden/build_raster.py SRC_DIR OUT_DIR`` (reads
SRC_DIR/raster_{torus,duck}.npz, writes OUT_DIR/raster_{torus,duck}.npz).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

__all__ = ["MESHES", "SAMPLE_STRIDE", "clip_from_bytes", "compact"]

MESHES = ("torus", "duck")
SAMPLE_STRIDE = 97


def clip_from_bytes(planes: np.ndarray) -> np.ndarray:
    """float32 [B, V, 4] from the uint8 [4, B, V, 4] byte planes of ``clip_bytes``."""
    little = np.ascontiguousarray(np.moveaxis(planes, 0, -1))
    return little.view("<f4")[..., 0].astype(np.float32)


def compact(src_dir: Path, out_dir: Path) -> list[Path]:
    """Write ``out_dir / f"raster_{mesh}.npz"`` for each mesh of ``MESHES`` found in ``src_dir``.

    Returns:
        The paths written.

    Raises:
        ValueError: a source lacks a key, or has ids beyond int16.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for mesh in MESHES:
        src = Path(src_dir) / f"raster_{mesh}.npz"
        if not src.exists():
            continue
        full = np.load(src)
        missing = {"clip", "tri", "uv", "zw", "tri_id"} - set(full.files)
        if missing:
            raise ValueError(f"{src}: expected keys clip, tri, uv, zw, tri_id; missing {missing}")
        clip = np.ascontiguousarray(full["clip"], dtype="<f4")
        ids = full["tri_id"]
        if ids.max() > np.iinfo(np.int16).max:
            raise ValueError(f"{src}: tri_id: expected ids below 32768, received {ids.max()}")
        sample = np.flatnonzero(ids.ravel() > 0)[::SAMPLE_STRIDE].astype(np.int32)
        path = out_dir / f"raster_{mesh}.npz"
        np.savez_compressed(
            path,
            clip_bytes=np.ascontiguousarray(np.moveaxis(clip[..., None].view(np.uint8), -1, 0)),
            tri=full["tri"].astype(np.int32),
            tri_id=ids.astype(np.int16),
            sample=sample,
            uv=full["uv"].reshape(-1, 2)[sample].astype(np.float32),
            zw=full["zw"].ravel()[sample].astype(np.float32),
        )
        assert np.array_equal(clip_from_bytes(np.load(path)["clip_bytes"]), clip)
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/gpu_golden/build_raster.py SRC_DIR OUT_DIR")
    for written in compact(Path(sys.argv[1]), Path(sys.argv[2])):
        print(f"{written}: {written.stat().st_size / 1024:.0f} KiB")
