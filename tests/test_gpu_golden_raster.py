"""The torch rasterizer against real nvdiffrast 0.4.0's (tests/gpu_golden/raster_{mesh}.npz).

The fixtures hold nvdiffrast's ``rasterize`` (CUDA context, nvdiffrast 0.4.0 from 253ac4f,
NVIDIA H100) of the built-in torus knot and of pybullet_data's duck, 4 views each at 512x512,
with the clip-space vertices it was given; tests/gpu_golden/build_raster.py says what is
stored. Set ``MPTEX_GPU_GOLDEN_DIR`` to check against another capture compacted by that script.

What is claimed, on the CPU:

- triangle ids equal at every pixel. The 99.98 % that a GPU comparison allows
  (tests/test_render_rasterize.py::test_torch_matches_nvdiffrast) would not catch a broken
  part of the model: drawing every edge inclusively changes 76-175 pixels of 1.2 M, a
  floating-point depth test 32-74, no frustum clipping 2-3, the lowest id winning equal
  depths 3. The twin's coverage and depth are integer arithmetic on correctly rounded float32
  values, the same on every CPU, so nothing is left to tolerate;
- barycentrics and z/w equal to the bit where the ids agree. Evaluating the edge functions'
  ``a * b - c * d`` with the other product fused changes them by up to 3.5e-6, without fusing
  by up to 1.5e-4; a division by the sum of the edge functions in place of the multiply by its
  reciprocal changes 13 % of them in the last bit.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mptex.render import rasterize

pytestmark = pytest.mark.golden_bits  # rerun under other CPU kernels: tests/test_dispatch.py

HERE = Path(__file__).parent
FIXTURE_DIR = Path(os.environ.get("MPTEX_GPU_GOLDEN_DIR", HERE / "gpu_golden"))

_spec = importlib.util.spec_from_file_location(
    "build_raster", HERE / "gpu_golden" / "build_raster.py"
)
build_raster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_raster)


def _load(mesh: str) -> dict[str, np.ndarray]:
    path = FIXTURE_DIR / f"raster_{mesh}.npz"
    if not path.exists():
        pytest.skip(f"{path} not found (MPTEX_GPU_GOLDEN_DIR={FIXTURE_DIR})")
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    arrays["clip"] = build_raster.clip_from_bytes(arrays.pop("clip_bytes"))
    return arrays


@pytest.mark.parametrize("mesh", build_raster.MESHES)
def test_torch_rasterizer_matches_nvdiffrast(mesh):
    golden = _load(mesh)
    ref_ids = torch.from_numpy(golden["tri_id"].astype(np.int64))
    rast, _ = rasterize(
        torch.from_numpy(golden["clip"]),
        torch.from_numpy(golden["tri"]),
        tuple(ref_ids.shape[1:]),
        backend="torch",
    )
    ids = rast[..., 3].round().long()
    differ = int((ids != ref_ids).sum())
    assert differ == 0, f"{mesh}: {differ} of {int((ref_ids > 0).sum())} covered pixels differ"
    sample = torch.from_numpy(golden["sample"].astype(np.int64))
    flat = rast.reshape(-1, 4)[sample]
    assert torch.equal(flat[:, 3].round().long(), ref_ids.reshape(-1)[sample])
    # Bit for bit: the twin's float32 steps are the kernel's, contractions included.
    torch.testing.assert_close(flat[:, :2], torch.from_numpy(golden["uv"]), rtol=0, atol=0)
    torch.testing.assert_close(flat[:, 2], torch.from_numpy(golden["zw"]), rtol=0, atol=0)


def test_compact_keeps_what_the_test_reads(tmp_path):
    gen = np.random.default_rng(0)
    clip = gen.standard_normal((2, 5, 4)).astype(np.float32)
    ids = gen.integers(0, 4, size=(2, 3, 4)).astype(np.int32)
    uv = gen.random((2, 3, 4, 2)).astype(np.float32)
    zw = gen.random((2, 3, 4)).astype(np.float32)
    tri = np.array([[0, 1, 2], [1, 2, 3], [2, 3, 4]], dtype=np.int32)
    np.savez(tmp_path / "raster_duck.npz", clip=clip, tri=tri, uv=uv, zw=zw, tri_id=ids)
    (written,) = build_raster.compact(tmp_path, tmp_path / "out")
    with np.load(written) as out:
        assert np.array_equal(build_raster.clip_from_bytes(out["clip_bytes"]), clip)
        assert np.array_equal(out["tri"], tri) and np.array_equal(out["tri_id"], ids)
        sample = out["sample"]
        covered = np.flatnonzero(ids.ravel() > 0)
        assert np.array_equal(sample, covered[:: build_raster.SAMPLE_STRIDE])
        assert np.array_equal(out["uv"], uv.reshape(-1, 2)[sample])
        assert np.array_equal(out["zw"], zw.ravel()[sample])
