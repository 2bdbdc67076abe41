"""The ear clipping ``mptex.render.obj._triangulate`` reproduces, as it was first written.

A copy, unchanged but for its name, of the straightforward version (it rescans every corner
and every candidate blocker after each cut, cubic in the number of corners in the worst case):
the fast one must return exactly its triangles, in its order, for every polygon.
"""

from __future__ import annotations

import math


def triangulate_reference(points: list[list[float]]) -> list[tuple[int, int, int]] | None:
    """Triangles (corner indices, the polygon's winding kept) covering a planar polygon.

    The fan around corner 0 (as nvdiffrec and most readers split polygons) when it is valid:
    every fan triangle turns the polygon's way (its normal along the polygon's Newell normal),
    which holds for every convex polygon and for concave ones star-shaped from corner 0.
    Otherwise (a concave polygon, e.g. an L-shaped hexagon, whose fan would cover area outside
    it) ear clipping in the polygon's plane. A degenerate polygon (no area) keeps its fan.

    Returns:
        the triangles, or None when ear clipping finds no ear (some self-intersecting polygons;
        others get triangles that cover them in some way).
        A corner on the straight line between its neighbours may be left out of them.
    """
    n = len(points)
    fan = [(0, k, k + 1) for k in range(1, n - 1)]
    if n == 3:
        return fan
    # Newell's normal: twice the polygon's vector area, robust for non-planar polygons.
    nx = ny = nz = 0.0
    for k in range(n):
        (x0, y0, z0), (x1, y1, z1) = points[k], points[(k + 1) % n]
        nx += (y0 - y1) * (z0 + z1)
        ny += (z0 - z1) * (x0 + x1)
        nz += (x0 - x1) * (y0 + y1)
    area2 = math.sqrt(nx * nx + ny * ny + nz * nz)
    if area2 == 0.0:
        return fan
    eps = 1e-9 * area2  # relative: a fan triangle this small counts as flat, not turned back

    def turn(a: int, b: int, c: int) -> float:  # twice the area of (a, b, c) along the normal
        pa, pb, pc = points[a], points[b], points[c]
        u = (pb[0] - pa[0], pb[1] - pa[1], pb[2] - pa[2])
        v = (pc[0] - pa[0], pc[1] - pa[1], pc[2] - pa[2])
        return (
            nx * (u[1] * v[2] - u[2] * v[1])
            + ny * (u[2] * v[0] - u[0] * v[2])
            + nz * (u[0] * v[1] - u[1] * v[0])
        ) / area2

    if all(turn(*t) >= -eps for t in fan):
        return fan
    # Ear clipping: cut off a corner whose triangle turns the polygon's way and holds no other
    # remaining corner, until three corners remain.
    remaining = list(range(n))
    triangles = []
    while len(remaining) > 3:
        m = len(remaining)
        for j in range(m):
            a, b, c = remaining[j - 1], remaining[j], remaining[(j + 1) % m]
            if turn(a, b, c) <= eps:
                continue
            if any(
                turn(a, b, q) >= -eps and turn(b, c, q) >= -eps and turn(c, a, q) >= -eps
                for q in remaining
                if q not in (a, b, c) and points[q] not in (points[a], points[b], points[c])
            ):
                continue
            triangles.append((a, b, c))
            del remaining[j]
            break
        else:
            # No ear: drop a flat corner (on the line between its neighbours) if there is one.
            flat = [j for j in range(m) if abs(turn(remaining[j - 1], remaining[j],
                                                    remaining[(j + 1) % m])) <= eps]  # fmt: skip
            if not flat:
                return None
            del remaining[flat[0]]
    triangles.append(tuple(remaining))
    return triangles
