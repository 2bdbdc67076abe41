"""The torch rasterizer's work in blocks of triangle instances: bounded, and bit for bit the
output of one block; triangles that cover no sample culled before their integer setup; the
per-vertex setup (frustum flags, 1 / w, snapping) computed once per vertex of each view and
gathered per triangle corner, the same bits as computing it per corner."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from mptex.render import interpolate, orbit_views, rasterize
from mptex.scenes import torus_knot

rz = importlib.import_module("mptex.render.rasterize")


def _knot_views(n_views=3, near=False):
    mesh = torus_knot(60, 8)  # 960 triangles
    cams = orbit_views(n_views, radius=0.9 if near else 3.0, elevation=-0.4)
    v_hom = F.pad(mesh.v_pos, (0, 1), value=1.0)
    return v_hom @ cams.mvp.transpose(1, 2), mesh.t_pos_idx, mesh.v_pos


def _outputs(pos, tri, attr, res):
    """rast, rast_db, interpolate's output and the gradient of a weighted sum of rast[..., :3]
    and the interpolated attribute w.r.t. pos, on one thread (the gradient's scatter-add into
    shared vertices sums in a thread-dependent order: two threads can differ in the last bit
    from one run to the next)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pos = pos.clone().requires_grad_(True)
        rast, rast_db = rasterize(pos, tri, res, backend="torch")
        out, _ = interpolate(attr, rast, tri, backend="torch")
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(rast[..., :3].shape, generator=gen, dtype=rast.dtype)
        ((rast[..., :3] * weight).sum() + out.sum()).backward()
    finally:
        torch.set_num_threads(threads)
    return rast.detach(), rast_db, out.detach(), pos.grad


def _assert_same_bits(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("near", [False, True])  # near: the camera inside the knot clips
def test_blocks_bound_the_instances_set_up_at_once_and_change_no_bit(monkeypatch, near):
    pos, tri, attr = _knot_views(near=near)
    res = (40, 48)
    whole = _outputs(pos, tri, attr, res)
    assert int((whole[0][..., 3] > 0).sum()) > 1000  # the views see the knot

    sizes = []
    setup = rz._setup_triangles

    def spy(verts, height, width):
        sizes.append(verts.shape[0])
        return setup(verts, height, width)

    budget = 97  # not a divisor of 960: blocks straddle views
    monkeypatch.setattr(rz, "_MAX_TRIS_PER_BLOCK", budget, raising=False)
    monkeypatch.setattr(rz, "_setup_triangles", spy)
    blocked = _outputs(pos, tri, attr, res)
    assert max(sizes) <= budget
    assert sum(sizes) == pos.shape[0] * tri.shape[0]  # each instance set up once
    _assert_same_bits(blocked, whole)


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_equal_depth_ties_go_to_the_higher_id_across_blocks(monkeypatch, budget):
    # Six copies of one triangle (own vertices, equal depths everywhere), in two views; with
    # one or a few per block, the copies meet only in the per-pixel minimum across blocks.
    xy = torch.tensor([[-0.9, -0.8], [0.8, -0.9], [0.1, 0.9]])
    one = torch.cat([xy, torch.full((3, 1), 0.25), torch.ones(3, 1)], dim=1)
    pos = torch.stack([one.repeat(6, 1), (one * torch.tensor([-1.0, 1, 1, 1])).repeat(6, 1)])
    tri = torch.arange(18, dtype=torch.int32).reshape(6, 3)
    monkeypatch.setattr(rz, "_MAX_TRIS_PER_BLOCK", budget, raising=False)
    rast, _ = rasterize(pos, tri, (8, 8), backend="torch")
    ids = rast[..., 3]
    assert (ids > 0).sum() > 40
    assert torch.all(ids[ids > 0] == 6)


def test_triangles_between_the_samples_get_no_integer_setup(monkeypatch):
    # 64 triangles, 0.05 NDC wide, 0.02 NDC from the lower-left corners of the pixels of an
    # 8 x 8 view (pixel centres sit 0.125 NDC from them), and one over half the view: only
    # that one holds a sample.
    res = 8
    corner = torch.stack(
        torch.meshgrid(torch.arange(res) / 4 - 1, torch.arange(res) / 4 - 1, indexing="xy"), -1
    ).reshape(-1, 1, 2)
    tiny = corner + torch.tensor([[0.02, 0.02], [0.07, 0.02], [0.02, 0.07]])
    big = torch.tensor([[[-0.99, -0.99], [0.99, -0.99], [-0.99, 0.99]]])
    xy = torch.cat([tiny, big]).reshape(-1, 2)
    pos = torch.cat([xy, torch.full((xy.shape[0], 1), 0.5), torch.ones(xy.shape[0], 1)], dim=1)
    tri = torch.arange(xy.shape[0], dtype=torch.int32).reshape(-1, 3)

    planes = []
    plane = rz._setup_plane

    def spy(values, *args):
        planes.append(values.shape[0])
        return plane(values, *args)

    monkeypatch.setattr(rz, "_setup_plane", spy)
    rast, _ = rasterize(pos, tri, (res, res), backend="torch")
    ids = rast[..., 3]
    assert (ids > 0).sum() == 28 and torch.all(ids[ids > 0] == tri.shape[0])
    assert planes == [1]


def test_a_triangle_over_more_tiles_than_a_chunk_is_split_across_chunks(monkeypatch):
    # Two triangles over a 64 x 64 view (clipped to it: 256 tiles of 4 x 4 pixels, fanned
    # sub-triangles of many tiles each); a chunk of 64 evaluations (4 tiles) must not take a
    # whole sub-triangle.
    pos = torch.tensor([[-3.0, -3, 0.5, 2], [3, -3, 0.5, 2], [-3, 3, 0.5, 2],
                        [3, 3, 0.5, 2]])  # fmt: skip
    tri = torch.tensor([[0, 1, 2], [1, 3, 2]], dtype=torch.int32)
    whole, _ = rasterize(pos, tri, (64, 64), backend="torch")
    assert torch.all(whole[..., 3] > 0)

    drawn = []
    scatter = torch.Tensor.scatter_reduce_

    def spy(self, dim, index, src, **kwargs):
        drawn.append(index.numel())
        return scatter(self, dim, index, src, **kwargs)

    monkeypatch.setattr(rz, "_MAX_EVALS_PER_CHUNK", 64)
    monkeypatch.setattr(torch.Tensor, "scatter_reduce_", spy)
    chunked, _ = rasterize(pos, tri, (64, 64), backend="torch")
    monkeypatch.undo()
    assert max(drawn) <= 64 and sum(drawn) == 64 * 64
    _assert_same_bits([chunked], [whole])


def _grid(n=9):
    """A grid of n x n vertices and 2 (n - 1)^2 triangles of both windings (most vertices
    shared by six), inside the frustum."""
    t = torch.linspace(-0.9, 0.9, n)
    y, x = torch.meshgrid(t, t, indexing="ij")
    v = torch.stack([x, y, 0.3 * x * y, torch.ones_like(x)], dim=-1).reshape(-1, 4)
    i = torch.arange(n - 1)
    c = (i[:, None] * n + i[None, :]).reshape(-1)
    tri = torch.cat([torch.stack([c, c + 1, c + n + 1], 1), torch.stack([c, c + n, c + n + 1], 1)])
    return v, tri.to(torch.int32)


@pytest.mark.parametrize("budget", [1 << 16, 50, 100])  # 100: groups of 3 views, blocks straddle
def test_snapping_runs_once_per_vertex_of_each_view(monkeypatch, budget):
    v, tri = _grid()
    views = torch.stack([v, v * torch.tensor([1.05, 0.8, 1, 1]), v * torch.tensor([-1, 1, 1, 1])])
    assert 3 * tri.shape[0] > 2 * v.shape[0]  # corners outnumber vertices
    whole, _ = rasterize(views, tri, (16, 16), backend="torch")
    rows = []
    snap = rz._snap

    def spy(verts, height, width):
        rows.append(verts.numel() // 4)
        return snap(verts, height, width)

    monkeypatch.setattr(rz, "_MAX_TRIS_PER_BLOCK", budget, raising=False)
    monkeypatch.setattr(rz, "_snap", spy)
    rast, _ = rasterize(views, tri, (16, 16), backend="torch")
    assert sum(rows) == views.shape[0] * v.shape[0]  # nothing is clipped
    assert (rast[..., 3] > 0).sum() > 3 * 100
    assert torch.equal(rast.view(torch.int32), whole.view(torch.int32))


def _per_corner(verts, height, width):
    """What the per-corner setup computed from the [N, 3, 4] corners: the frustum outcome
    (culled, wholly inside), 1 / w, the snapped corners and whether their bounding box holds
    a sample, in its operation order."""
    xyz, w = verts[..., :3], verts[..., 3]
    outside = ((w[..., None] < xyz).all(dim=1) | (w[..., None] < -xyz).all(dim=1)).any(dim=1)
    inside = (w >= xyz.abs().amax(dim=-1)).all(dim=1)
    rcp_w = 1.0 / w
    scale = torch.tensor([float(width * 8), float(height * 8)])
    snapped = torch.round(verts[..., :2] * rcp_w[..., None] * scale)
    snapped = torch.nan_to_num(snapped, nan=0.0).clamp(-(2.0**31), 2.0**31 - 128)
    first, last = rz._sample_span(snapped.long(), height, width)
    return outside, inside, rcp_w, snapped, rz._any_sample(first, last)


def _random_mesh(gen, n_views, n_vert, n_tri):
    """Clip-space vertices in and around the frustum: some behind the camera, some on its
    planes, some with w 0, inf or NaN or x NaN; triangles with shared, repeated (degenerate)
    corners and both windings; and a few collinear corners."""
    pos = torch.randn(n_views, n_vert, 4, generator=gen) * 0.8
    pos[..., 3] = torch.rand(n_views, n_vert, generator=gen) * 1.5 + 0.3
    r = torch.rand(n_views, n_vert, generator=gen)
    w = pos[..., 3]
    w[r < 0.04] = float("nan")
    w[(r >= 0.04) & (r < 0.07)] = float("inf")
    w[(r >= 0.07) & (r < 0.09)] = 0.0
    w[(r >= 0.09) & (r < 0.15)] *= -1
    pos[..., 0][(r >= 0.15) & (r < 0.17)] = float("nan")
    pos[..., 1][(r >= 0.17) & (r < 0.22)] = w[(r >= 0.17) & (r < 0.22)]  # on a frustum plane
    pos[..., 0][(r >= 0.22) & (r < 0.25)] = -w[(r >= 0.22) & (r < 0.25)]
    pos[:, 2] = (pos[:, 0] + pos[:, 1]) / 2  # vertex 2 on the line of 0 and 1
    tri = torch.randint(0, n_vert, (n_tri, 3), generator=gen, dtype=torch.int32)
    tri[: n_tri // 10, 1] = tri[: n_tri // 10, 0]  # degenerate
    tri[n_tri // 10 : n_tri // 5] = torch.tensor([0, 1, 2], dtype=torch.int32)
    return pos, tri


@pytest.mark.parametrize("seed", range(4))
def test_gathered_vertex_setup_is_the_per_corner_setup_bit_for_bit(monkeypatch, seed):
    gen = torch.Generator().manual_seed(seed)
    pos, tri = _random_mesh(gen, n_views=3, n_vert=30, n_tri=80)
    attr = torch.randn(30, 3, generator=gen)
    res = (24, 20)
    whole = _outputs(pos, tri, attr, res)
    assert int((whole[0][..., 3] > 0).sum()) > 100

    checked = {"clipped": 0, "hit": 0, "culled": 0}
    setup = rz._setup_triangles

    def check(instances, height, width):
        cull = instances.cull[instances.corners]
        flags = cull[:, 0, 0] & cull[:, 1, 0] & cull[:, 2, 0]
        first = cull[..., 1:3].amin(dim=1).long()
        last = cull[..., 3:5].amax(dim=1).long()
        gathered = instances.snap[instances.corners]
        outside, inside, rcp_w, snapped, hit = _per_corner(
            instances.positions[instances.corners], height, width
        )
        assert torch.equal((flags & 0b0111111) != 0, outside)
        assert torch.equal((flags & 0b1000000) != 0, inside)
        assert torch.equal(gathered[..., 0].view(torch.int32), rcp_w.view(torch.int32))
        assert torch.equal(gathered[..., 1:], snapped)
        drawn = ~outside & inside
        assert torch.equal(rz._any_sample(first, last)[drawn], hit[drawn])
        checked["clipped"] += int((~outside & ~inside).sum())
        checked["hit"] += int((drawn & hit).sum())
        checked["culled"] += int(outside.sum())
        return setup(instances, height, width)

    monkeypatch.setattr(rz, "_setup_triangles", check)
    for budget in (1 << 16, 7, 50):  # 7 and 50: groups of one view and of several
        monkeypatch.setattr(rz, "_MAX_TRIS_PER_BLOCK", budget, raising=False)
        blocked = _outputs(pos, tri, attr, res)
        _assert_same_bits(blocked, whole)
    assert min(checked.values()) > 0  # each path taken
