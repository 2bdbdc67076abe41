"""The torch rasterizer's triangles that cover no sample: culled before their integer setup."""

import importlib

import torch

from mptex.render import rasterize

rz = importlib.import_module("mptex.render.rasterize")


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
