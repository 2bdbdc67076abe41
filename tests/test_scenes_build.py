"""What ``build_scene`` makes of a mesh scene's config, and the built-in knot, against references.

The projection of the views against OpenGL's perspective matrix written out here (with the
y flip of nvdiffrec's ``util.perspective``), ``normalize`` against the box the file's vertices
span, ``seed`` against the training views it draws, supersampled views against a direct
rasterization at their size. Each test names the mutant of ``mptex/scenes`` (build.py,
builtin.py, scene.py) it was written against, which the quick scene tests let pass.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mptex.render import Mesh, write_obj
from mptex.scenes import build_scene, render_gbuffer, torus_knot


def _quad_obj(tmp_path: Path) -> Path:
    # A 4 x 2 quad at x in [1, 5], y in [-3, -1], z = 2: far from the origin and not square.
    mesh = Mesh(
        v_pos=torch.tensor([[1.0, -3, 2], [5, -3, 2], [5, -1, 2], [1, -1, 2]]),
        t_pos_idx=torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32),
        v_tex=torch.tensor([[0.0, 0], [1, 0], [1, 1], [0, 1]]),
        t_tex_idx=torch.tensor([[0, 1, 2], [0, 2, 3]], dtype=torch.int32),
        kd=torch.tensor([0.5, 0.25, 0.125]),
    )
    write_obj(tmp_path / "quad.obj", mesh)
    return tmp_path / "quad.obj"


def _scene(tmp_path: Path, **overrides):
    cfg = {"name": "mesh", "path": str(_quad_obj(tmp_path)), "resolution": [12, 20],
           "n_train_views": 2, "n_val_views": 2, "raster_backend": "torch",
           **overrides}  # fmt: skip
    return build_scene(cfg)


def test_views_project_with_the_configured_vertical_fov_and_the_width_over_height_aspect(tmp_path):
    # Mutants caught: aspect height / width (for [H, W] = [12, 20] views) and a halved fovy.
    scene = _scene(tmp_path, fovy_deg=60.0, near=0.5, far=50.0)
    y = math.tan(math.radians(60.0) / 2)
    aspect, near, far = 20 / 12, 0.5, 50.0
    want = torch.tensor([
        [1 / (y * aspect), 0, 0, 0],
        [0, -1 / y, 0, 0],
        [0, 0, -(far + near) / (far - near), -2 * far * near / (far - near)],
        [0, 0, -1, 0],
    ], dtype=torch.float64)  # fmt: skip
    for split in ("train", "val"):
        cameras = scene._cameras[split]
        proj = cameras.mvp.double() @ torch.linalg.inv(cameras.mv.double())
        for view in proj:
            # float32 matrices multiplied, then inverted in float64: a few ulps of order 1
            torch.testing.assert_close(view, want, rtol=0, atol=1e-5)


def test_normalize_fits_the_files_box_into_the_unit_box_and_false_keeps_the_file(tmp_path):
    # Mutant caught: normalize ignored (the mesh kept the file's coordinates either way).
    lo_hi = torch.tensor([[1.0, -3, 2], [5, -1, 2]])
    kept = _scene(tmp_path, normalize=False)
    torch.testing.assert_close(kept.aabb.cpu(), lo_hi, rtol=0, atol=0)
    # Centre (3, -2, 2), longest side 4 -> scale 1/2: x in [-1, 1], y in [-0.5, 0.5], z 0.
    unit = _scene(tmp_path, normalize=True)
    torch.testing.assert_close(unit.aabb.cpu(), torch.tensor([[-1.0, -0.5, 0], [1, 0.5, 0]]),
                               rtol=0, atol=0)  # fmt: skip


def test_the_seed_chooses_the_training_views(tmp_path):
    # Mutant caught: the training views' generator seeded with 0 whatever scene.seed said.
    a, b = _scene(tmp_path, seed=1), _scene(tmp_path, seed=1)
    c = _scene(tmp_path, seed=2)
    assert torch.equal(a._cameras["train"].mv, b._cameras["train"].mv)
    assert not torch.equal(a._cameras["train"].mv, c._cameras["train"].mv)
    assert torch.equal(a._cameras["val"].mv, c._cameras["val"].mv)  # the orbit is fixed


def test_the_torus_knot_is_wound_counter_clockwise_seen_from_outside():
    # A closed mesh wound counter-clockwise seen from outside encloses a positive signed volume
    # (sum of p0 . (p1 x p2) / 6 over its triangles, the divergence theorem). Mutant caught:
    # the quads split as (a, b, c), (a, c, d) (inside out: viewers that cull back faces drew
    # the knot's inside).
    mesh = torus_knot(64, 8)
    p = mesh.v_pos.double()[mesh.t_pos_idx.long()]
    volume = float((p[:, 0] * torch.linalg.cross(p[:, 1], p[:, 2])).sum() / 6)
    assert volume > 0
    # Each face normal agrees with its corners' vertex normals (the ones shading uses).
    face = torch.linalg.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0])
    corner_normals = mesh.v_nrm.double()[mesh.t_nrm_idx.long()]
    assert bool(((corner_normals * face[:, None]).sum(-1) > 0).all())
    # UVs: u = i / 64 along the tube, v = j / 8 around it (mutant caught: v = j / 64).
    assert mesh.v_tex[:, 0].unique().tolist() == [i / 64 for i in range(64)]
    assert mesh.v_tex[:, 1].unique().tolist() == [j / 8 for j in range(8)]


def test_supersampled_views_of_a_wide_scene_are_spp_times_its_height_and_width(tmp_path):
    # Mutant caught: the supersampled G-buffers sized (W * spp, H * spp), which only a scene
    # whose views are not square shows. Their coverage is the rasterization at 24 x 40 itself.
    scene = _scene(tmp_path)
    views = scene.views("val", [0, 1], spp=2)
    assert views.rgba.shape == (2, 24, 40, 4)
    direct = render_gbuffer(scene.mesh, views.mvp, (24, 40), "torch")
    assert torch.equal(views.gbuffer.mask, direct.mask)
    assert bool(direct.mask.any())
