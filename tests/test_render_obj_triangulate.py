"""Ear clipping in the OBJ reader (mptex.render.obj._triangulate) against its first version."""

import math
import random

import pytest
from obj_triangulate_reference import triangulate_reference

from mptex.render.obj import _triangulate


def _rotate(points, rng):
    """The points turned by a random rotation (a random unit quaternion)."""
    w, x, y, z = (rng.gauss(0, 1) for _ in range(4))
    norm = math.sqrt(w * w + x * x + y * y + z * z)
    w, x, y, z = w / norm, x / norm, y / norm, z / norm
    m = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ]
    return [[sum(m[r][k] * p[k] for k in range(3)) for r in range(3)] for p in points]


def _star(rng, n, depth):
    """A polygon star-shaped from the origin: sorted angles, radii in [1 - depth, 1]."""
    angles = sorted(rng.uniform(0, 2 * math.pi) for _ in range(n))
    return [[r * math.cos(a), r * math.sin(a), 0.0] for a in angles
            for r in [1 - depth * rng.random()]]  # fmt: skip


def _polygon(rng, kind):
    n = rng.randint(4, 40)
    if kind == "convex":
        points = _star(rng, n, 0.0)
    elif kind == "star":
        points = _star(rng, n, rng.choice([0.3, 0.7, 0.95]))
    elif kind == "grid":  # a star snapped to a coarse grid: collinear runs, duplicates, spikes
        step = rng.choice([0.25, 0.5, 1.0])
        points = [[round(x / step) * step, round(y / step) * step, 0.0]
                  for x, y, _ in _star(rng, n, 0.8)]  # fmt: skip
        for _ in range(rng.randint(0, 4)):  # corners on the middle of an edge
            k = rng.randrange(len(points))
            p, q = points[k], points[(k + 1) % len(points)]
            points.insert(k + 1, [(p[0] + q[0]) / 2, (p[1] + q[1]) / 2, 0.0])
    elif kind == "duplicates":
        points = _star(rng, n, 0.7)
        for _ in range(rng.randint(1, 5)):
            k = rng.randrange(len(points))
            points.insert(rng.choice([k, rng.randrange(len(points))]), list(points[k]))
    elif kind == "self_intersecting":  # corners in random order
        points = [[rng.uniform(-1, 1), rng.uniform(-1, 1), 0.0] for _ in range(n)]
    elif kind == "flat":  # no area: all on one line (or back and forth on it)
        points = [[t, 2 * t, 0.0] for t in (rng.uniform(-1, 1) for _ in range(n))]
    else:
        assert kind == "non_planar"
        points = [[x, y, rng.uniform(-0.3, 0.3)] for x, y, _ in _star(rng, n, 0.7)]
    if rng.random() < 0.7:
        points = _rotate(points, rng)
    scale = rng.choice([1.0, 1e-20, 1e20, 3.7, 1e-100])  # 1e-100: no pruning (underflow)
    offset = rng.choice([0.0, 1e6, -12.5]) * scale
    return [[c * scale + offset for c in p] for p in points]


KINDS = ["convex", "star", "grid", "duplicates", "self_intersecting", "flat", "non_planar"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_polygons_get_exactly_the_first_versions_triangles(kind):
    rng = random.Random(f"triangulate-{kind}")
    clipped = failed = 0
    for _ in range(600):
        points = _polygon(rng, kind)
        expected = triangulate_reference(points)
        assert _triangulate(points) == expected, points
        fan = [(0, k, k + 1) for k in range(1, len(points) - 1)]
        clipped += expected != fan
        failed += expected is None
    # The comparison reaches ear clipping, and for the self-intersecting ones its failures.
    if kind not in ("convex", "flat"):
        assert clipped > 100, clipped
    if kind == "self_intersecting":
        assert failed > 10, failed


def _spiral(n):
    """A spiral strip of 1.5 turns, out along one arm and back along the other."""
    arm = [(0.2 + k / n, 3 * math.pi * k / (n // 2)) for k in range(n // 2)]
    spiral = [[r * math.cos(a), r * math.sin(a), 0.0] for r, a in arm]
    return spiral + [[(r + 0.1) * math.cos(a), (r + 0.1) * math.sin(a), 0.0]
                     for r, a in arm[::-1]]  # fmt: skip


@pytest.mark.parametrize("n", [300, 1000])
def test_large_concave_polygons_get_exactly_the_first_versions_triangles(n):
    rng = random.Random(n)
    star = _star(rng, n, 0.9)
    for points in (star, _rotate(star, rng), _spiral(n)):
        expected = triangulate_reference(points)
        assert expected is not None and len(expected) == len(points) - 2
        assert _triangulate(points) == expected


class _CountingCorners(list):
    """A polygon's corners, counting how often one is read (a measure of work, not of time)."""

    reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("shape", ["star", "spiral"])
def test_ear_clipping_of_2000_corners_reads_fewer_than_40_n_to_the_1_5_corners(shape):
    n = 2000
    points = _CountingCorners(_star(random.Random(0), n, 0.9) if shape == "star" else _spiral(n))
    assert len(_triangulate(points)) == n - 2
    # Measured 23 (star) and 20 (spiral) * n**1.5 reads, growing about as n**1.5 from n = 250
    # to 4,000; rescanning every corner after each cut read 6 * n**2 (star: 281 * n**1.5).
    reads = points.reads
    assert reads < 40 * n**1.5, reads / n**1.5
