"""Camera matrices against hand-computed values (nvdiffrec's conventions)."""

import math

import torch

from mptex.render import (
    fovx_to_fovy,
    look_at,
    orbit_views,
    perspective,
    random_views,
    rotate_x,
    rotate_y,
    translate,
)


def test_perspective_matches_hand_computed_matrix():
    # fovy = 90 deg -> tan(fovy/2) = 1; (f+n)/(f-n) = 2, 2fn/(f-n) = 3 for n = 1, f = 3.
    expected = torch.tensor(
        [[0.5, 0, 0, 0], [0, -1, 0, 0], [0, 0, -2, -3], [0, 0, -1, 0]], dtype=torch.float32
    )
    torch.testing.assert_close(perspective(math.pi / 2, 2.0, 1.0, 3.0), expected)


def test_perspective_maps_near_and_far_to_unit_depth_and_flips_y():
    proj = perspective(math.pi / 2, 1.0, 1.0, 3.0)
    near = proj @ torch.tensor([0.0, 1.0, -1.0, 1.0])
    far = proj @ torch.tensor([0.0, 0.0, -3.0, 1.0])
    torch.testing.assert_close(near[2] / near[3], torch.tensor(-1.0))
    torch.testing.assert_close(far[2] / far[3], torch.tensor(1.0))
    torch.testing.assert_close(near[1] / near[3], torch.tensor(-1.0))  # world up -> NDC y = -1


def test_rotations_and_translation():
    torch.testing.assert_close(
        translate(1, 2, 3) @ torch.tensor([1.0, 1, 1, 1]), torch.tensor([2.0, 3, 4, 1])
    )
    # nvdiffrec's sign conventions: rotate_y(90 deg) sends +x to -z, rotate_x(90 deg) +y to -z.
    torch.testing.assert_close(
        rotate_y(math.pi / 2) @ torch.tensor([1.0, 0, 0, 1]),
        torch.tensor([0.0, 0, -1, 1]),
        atol=1e-7,
        rtol=0,
    )
    torch.testing.assert_close(
        rotate_x(math.pi / 2) @ torch.tensor([0.0, 1, 0, 1]),
        torch.tensor([0.0, 0, -1, 1]),
        atol=1e-7,
        rtol=0,
    )


def test_look_at():
    torch.testing.assert_close(look_at([0, 0, 3], [0, 0, 0], [0, 1, 0]), translate(0, 0, -3))
    mv = look_at([3.0, 0, 0], [0.0, 0, 0], [0.0, 1, 0])
    # The target lands 3 units down the camera's -z axis; the eye at the origin; up stays up.
    torch.testing.assert_close(mv @ torch.tensor([0.0, 0, 0, 1]), torch.tensor([0.0, 0, -3, 1]))
    torch.testing.assert_close(mv @ torch.tensor([3.0, 0, 0, 1]), torch.tensor([0.0, 0, 0, 1]))
    torch.testing.assert_close(mv @ torch.tensor([3.0, 1, 0, 1]), torch.tensor([0.0, 1, 0, 1]))


def test_fovx_to_fovy():
    assert math.isclose(fovx_to_fovy(math.pi / 2, 2.0), 2 * math.atan(0.5))


def test_orbit_and_random_views():
    orbit = orbit_views(6, radius=3.0)
    torch.testing.assert_close(orbit.campos.norm(dim=-1), torch.full((6,), 3.0))
    torch.testing.assert_close(orbit.mvp, perspective() @ orbit.mv)
    gen = torch.Generator().manual_seed(5)
    views = random_views(16, radius=3.0, generator=gen)
    # camera 3 units from the object's jittered centre: |t| <= 0.25 * sqrt(3)
    dist = views.campos.norm(dim=-1)
    assert torch.all((dist > 3 - 0.44) & (dist < 3 + 0.44))
    rot = views.mv[:, :3, :3]
    torch.testing.assert_close(rot @ rot.transpose(1, 2), torch.eye(3).expand(16, 3, 3))
    again = random_views(16, radius=3.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(views.mv, again.mv)


def test_a_denser_orbit_contains_the_sparser_one_bit_for_bit():
    # experiments/real_assets.yaml validates 64 orbit views; docs/archive/validation-views.md
    # reads the 8-view protocol's PSNR from the same runs as every 8th view, which needs equal
    # cameras.
    dense, sparse = orbit_views(64), orbit_views(8)
    assert torch.equal(dense.mv[::8], sparse.mv)
    assert torch.equal(dense.mvp[::8], sparse.mvp)
    assert not torch.equal(dense.mv[1], sparse.mv[1])
