"""The torch rasterizer's work in blocks of triangle instances: bounded, and bit for bit the
output of one block; triangles that cover no sample culled before their integer setup."""

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
