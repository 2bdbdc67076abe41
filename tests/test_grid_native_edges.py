"""The torch hash grid's C kernel (mptex._native_cpu) against its eager PyTorch ops, bit for
bit, where a dense level's index wraps exactly twice around its table.

The C kernel takes a dense index modulo the table size by one subtraction inside the unit cube
(index < 2 size) and falls back to ``%`` for the whole block where a row still lands at or past
the size. Points outside [0, 1] (tcnn does not clamp) reach any index; at index == 2 size
exactly the subtraction leaves ``size`` itself, the boundary of the fallback's test: the row
must wrap to 0, not read the entry past the level's table. The golden cases' points outside
[0, 1] are random and never hit it.
"""

import pytest
import torch
from golden_io import bits

import mptex._grid_torch as grid
from mptex._grid_torch import grid_geometry, hash_grid_encode

# Level 0: 5 x 5 dense, scale 4, a table of 32 entries; level 1: dense too.
KWARGS = dict(n_levels=2, n_features_per_level=2, log2_hashmap_size=10, base_resolution=5,
              per_level_scale=2.0)  # fmt: skip


def _points():
    # (0.9375, 2.9375): positions 4.25 and 12.25 at level 0, cell (4, 12), corner (0, 0) at
    # dense index 4 + 12 * 5 = 64, twice the table's 32 entries; and some points inside.
    inside = torch.rand(13, 2, generator=torch.Generator().manual_seed(3))
    return torch.cat([torch.tensor([[0.9375, 2.9375]]), inside])


def _run(x, params, geometry, dtype):
    x = x.clone().requires_grad_(True)
    params = params.clone().requires_grad_(True)
    out = hash_grid_encode(x, params, geometry, dtype)
    v = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out.float() * v).sum().backward()
    return out.detach(), x.grad, params.grad


def test_the_point_meets_twice_the_table_size():
    geometry = grid_geometry(2, **KWARGS)
    assert geometry.resolutions[0] == 5 and geometry.table_sizes[0] == 32
    assert geometry.scales[0] == 4.0 and not geometry.hashed[0]
    x = _points()[0]
    cells = torch.floor(x * 4.0 + 0.5)
    assert cells.tolist() == [4.0, 12.0] and 4 + 12 * 5 == 2 * 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_matches_eager_at_twice_the_table_size(dtype, monkeypatch):
    if grid.native_kernels() is None:
        pytest.skip("the C kernel does not build here (no C compiler)")
    geometry = grid_geometry(2, **KWARGS)
    params = torch.rand(geometry.n_params, generator=torch.Generator().manual_seed(5)) * 2 - 1
    x = _points()
    native = _run(x, params, geometry, dtype)
    monkeypatch.setattr(grid, "_native", lambda *args: None)
    eager = _run(x, params, geometry, dtype)
    for what, got, want in zip(("out", "grad_x", "grad_params"), native, eager):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        assert torch.equal(bits(got), bits(want)), what
