"""Tests for mptex.train.validation: the saved validation images are upright."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import torch
from hydra import compose, initialize_config_dir

from mptex.cli import CONFIG_DIR
from mptex.scenes import build_scene
from mptex.train import train

# A tetrahedron whose front face is a triangle in the z = 0 plane with its apex along world +y,
# and a fourth vertex behind the centroid (a flat mesh would have an empty bounding box in z):
# seen from the front, rows narrow towards the apex, so the picture tells up from down.
_APEX_UP_TRIANGLE = """mtllib tri.mtl
usemtl red
v -1 -1 0
v 1 -1 0
v 0 1 0
v 0 -0.333 -0.5
f 1 2 3
f 1 4 2
f 2 4 3
f 3 4 1
"""
_MTL = "newmtl red\nKd 0.8 0.1 0.1\n"


def test_saved_validation_png_is_upright_for_the_cameras_up_vector(tmp_path):
    (tmp_path / "tri.obj").write_text(_APEX_UP_TRIANGLE)
    (tmp_path / "tri.mtl").write_text(_MTL)
    overrides = [
        "scene=mesh",
        f"scene.path={tmp_path / 'tri.obj'}",
        "scene.resolution=48",
        "scene.n_train_views=2",
        "scene.n_val_views=1",  # orbit view 0: the triangle seen from the front
        "texture=tiny",
        "train=tiny",
        "train.iterations=0",
        "train.n_val_images=1",
        "train.val_background=white",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    train(cfg, tmp_path / "run")

    # The camera's up vector in world space is the second row of the world-to-camera rotation;
    # the apex lies along it, seen from this camera.
    views = build_scene(cfg.scene).val_views()
    up_world = views.mv[0, 1, :3]
    apex_dir = torch.tensor([0.0, 1.0, 0.0]) - torch.tensor([0.0, -1 / 3, 0.0])
    assert float(up_world @ apex_dir) > 0.5 * float(apex_dir.norm())

    # Read with imageio, not mptex: file row 0 is the top of the picture in every viewer.
    png = iio.imread(tmp_path / "run" / "images" / "val_000.png").astype(np.float32) / 255
    width = png.shape[1] // 2
    for half in (png[:, :width], png[:, width:]):  # reference | prediction
        covered = (half[..., :3] < 0.99).any(-1)  # not the white background
        rows = np.nonzero(covered.any(1))[0]
        assert len(rows) > 10, "the triangle should fill a good part of the view"
        widths = covered[rows].sum(1)
        quarter = len(rows) // 4
        # Upright: the apex (narrow rows) is at the top of the file, the base at the bottom.
        assert widths[:quarter].mean() < 0.5 * widths[-quarter:].mean()
    ref, pred = png[:, :width], png[:, width:]
    np.testing.assert_array_equal((ref[..., :3] < 0.99).any(-1), (pred[..., :3] < 0.99).any(-1))
