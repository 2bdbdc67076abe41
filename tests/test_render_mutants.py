"""Hand-computed cases that pin the rasterizer's decisions at their boundaries: each case here
was added because a one-character change of ``mptex/render/rasterize.py`` (a mutant) passed
every other test.

Mutants found equivalent, with why (no test can tell them apart): ``area <= 0`` for the
winding swap (zero-area triangles are dropped by ``keep`` either way); ``dx < 0`` for the
horizontal-edge tie rule (an edge with dx = dy = 0 has zero length: its triangle has zero
area); ``area != 0`` left out of ``keep`` (a collinear triangle's edges run both ways, one of
them exclusive, so it covers no sample); the span's ``last`` one sample lower (a sample at the
snapped maximum lies on a right or top edge, which the tie rule excludes); ``first`` not
raised to 0 (clipped triangles lie in the viewport, whose first sample column has
first >= 0); the snap's saturating clamp (clipped vertices have |x/w|, |y/w| <= 1); and a
strict ``inside`` (a triangle with a vertex on a clip plane then goes through the clipper,
which returns it unchanged: the far-plane case below passes either way).

Not pinned: ``depth < _DEPTH_MAX`` for ``<=`` differs only at a fragment whose fixed-point
depth is exactly the maximum (a plane extrapolated past the far plane's 4294949632 by 63
units); 800,000 random triangles near the far plane on 8 x 8 pixels held none.
"""

from __future__ import annotations

import pytest
import torch

from mptex.render import rasterize

TRI1 = torch.tensor([[0, 1, 2]], dtype=torch.int32)


@pytest.mark.parametrize("plane", [1.0, -1.0], ids=["far", "near"])
def test_a_triangle_on_a_depth_clip_plane_is_drawn(plane):
    # Clip space is closed (-w <= z <= w, as nvdiffrast's): a triangle with every vertex on
    # the far plane (z = w) or the near plane (z = -w) is neither culled as outside nor
    # dropped by the depth range; it covers what the same triangle at z = 0 covers, at
    # z/w = +-1 exactly. 4x4 pixels, no pixel centre near an edge.
    xy = [[-0.8, -0.8], [0.6, -0.8], [-0.8, 0.6]]
    on_plane = torch.tensor([[x, y, plane, 1.0] for x, y in xy])
    mid = torch.tensor([[x, y, 0.0, 1.0] for x, y in xy])
    rast = rasterize(on_plane, TRI1, (4, 4), backend="torch")[0][0]
    ref = rasterize(mid, TRI1, (4, 4), backend="torch")[0][0]
    covered = ref[..., 3] == 1
    # pixels (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (0, 2): centres with x + y < -0.2
    assert int(covered.sum()) == 6
    assert torch.equal(rast[..., 3], ref[..., 3])
    assert torch.equal(rast[..., 2][covered], torch.full((6,), plane))
    assert torch.equal(rast[..., :2], ref[..., :2])
