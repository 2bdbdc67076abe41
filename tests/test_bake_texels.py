"""Which texels a bake evaluates and where, against a float64 reference worked out here.

One triangle is given in texel units (texel (i, j) centred at (i, j), as ``bake.py`` states:
texel row j has its centre at v = (j + 0.5) / N), its world positions an affine map of its UVs,
so a baked position tells the UV it was evaluated at. The reference: a texel is evaluated when
its centre lies in the triangle or within sqrt(2) texels of it (the docstring's conservative
ring, boundary included), at its centre or at the triangle's closest point. Each test names the
mutant of ``mptex/bake`` it was written against, which the bake and export tests let pass.
"""

from __future__ import annotations

import numpy as np
import torch

import mptex.bake.bake as bake_module
from mptex.bake import texel_positions
from mptex.render import Mesh

N = 16
# Corners at texel centres: (2, 3) is one, and each edge passes through another ((7, 4),
# (8, 8), (3, 7)). Texel (1, 2) lies exactly sqrt(2) from the corner (2, 3), its closest point.
TRIANGLE = np.array([[2.0, 3.0], [12.0, 5.0], [4.0, 11.0]])
# World position = uv @ _LINEAR + _OFFSET (invertible in x and y), exact in float32.
_LINEAR = np.array([[2.0, 0.0, -1.0], [0.0, 3.0, 0.5]])
_OFFSET = np.array([-1.0, 0.25, 0.5])


def _mesh(triangle: np.ndarray = TRIANGLE) -> Mesh:
    uv = (triangle + 0.5) / N  # exact: multiples of 1/32
    pos = uv @ _LINEAR + _OFFSET
    faces = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    return Mesh(v_pos=torch.tensor(pos, dtype=torch.float32), t_pos_idx=faces,
                v_tex=torch.tensor(uv, dtype=torch.float32), t_tex_idx=faces.clone())  # fmt: skip


def _closest(point: np.ndarray, tri: np.ndarray) -> np.ndarray:
    """Closest point of the triangle to ``point`` in float64 (inside: the point itself)."""
    a, b, c = tri
    det = (b - a)[0] * (c - a)[1] - (b - a)[1] * (c - a)[0]
    sides = [((q - p)[0] * (point - p)[1] - (q - p)[1] * (point - p)[0]) * det
             for p, q in ((a, b), (b, c), (c, a))]  # fmt: skip
    if min(sides) >= 0:
        return point
    best = None
    for p, q in ((a, b), (b, c), (c, a)):
        t = np.clip(np.dot(point - p, q - p) / np.dot(q - p, q - p), 0.0, 1.0)
        candidate = p + t * (q - p)
        if best is None or np.sum((candidate - point) ** 2) < np.sum((best - point) ** 2):
            best = candidate
    return best


def _reference(tri: np.ndarray) -> dict[int, np.ndarray]:
    """{flat texel index: world position} of every texel the bake should evaluate."""
    out = {}
    for row in range(N):
        for col in range(N):
            centre = np.array([col, row], dtype=np.float64)
            closest = _closest(centre, tri)
            if np.sum((closest - centre) ** 2) <= 2.0:
                out[row * N + col] = ((closest + 0.5) / N) @ _LINEAR + _OFFSET
    return out


def _as_dict(index: torch.Tensor, position: torch.Tensor) -> dict[int, np.ndarray]:
    assert index.unique().numel() == index.numel(), "a texel evaluated twice"
    return {int(i): p for i, p in zip(index.tolist(), position.double().numpy())}


def test_the_ring_holds_every_texel_within_sqrt2_of_a_triangle_at_its_closest_point():
    # Mutants caught: the ring's search window starting at floor(min) instead of
    # floor(min - sqrt(2)) (texels left of / below a corner on a texel centre were never
    # evaluated), a ring radius of sqrt(2) - 1e-3 (texel (1, 2) at exactly sqrt(2) dropped).
    index, position, n_covered = texel_positions(_mesh(), N, backend="torch")
    got, want = _as_dict(index, position), _reference(TRIANGLE)
    assert sorted(got) == sorted(want)
    assert (2 * N + 1) in got  # texel (1, 2): the boundary of the ring
    for texel, pos in got.items():
        # float32 positions of values of order 1
        np.testing.assert_allclose(pos, want[texel], rtol=0, atol=1e-6, err_msg=f"texel {texel}")
    assert 0 < n_covered < len(got)


def test_texel_centres_on_an_edge_are_evaluated_at_the_centre_whichever_triangle_owns_them():
    # The three edges pass through texel centres, which the rasterizer's tie rule may leave
    # uncovered; the ring then finds them inside the triangle (distance 0). Mutant caught: the
    # ring's inside barycentrics (w0, w2, w1) instead of (w0, w1, w2), which moved those texels
    # onto another edge. Both windings: the tie rule leaves different edges uncovered.
    for tri in (TRIANGLE, TRIANGLE[[0, 2, 1]]):
        index, position, _ = texel_positions(_mesh(tri), N, backend="torch")
        got = _as_dict(index, position)
        for col, row in ((7, 4), (8, 8), (3, 7), (2, 3)):
            centre = (np.array([col, row]) + 0.5) / N @ _LINEAR + _OFFSET
            np.testing.assert_allclose(got[row * N + col], centre, rtol=0, atol=1e-6)


def test_an_atlas_drawn_in_several_bands_evaluates_what_one_band_does(monkeypatch):
    # Atlases above 2^22 texels (beyond 2048^2) are rasterized in horizontal bands; a band's
    # texels are offset by its first row. Mutant caught: the offset row0 instead of row0 * N
    # (every band after the first wrote its texels into the first rows).
    whole = _as_dict(*texel_positions(_mesh(), N, backend="torch")[:2])
    monkeypatch.setattr(bake_module, "_BAND_TEXELS", 3 * N)  # bands of 3 rows, the last of 1
    banded = _as_dict(*texel_positions(_mesh(), N, backend="torch")[:2])
    assert sorted(banded) == sorted(whole)
    for texel, pos in whole.items():
        # A band maps v to NDC with another scale and offset: barycentrics, and so positions,
        # may differ in their last float32 bits (and a centre on an edge change hands).
        np.testing.assert_allclose(banded[texel], pos, rtol=0, atol=1e-6)
