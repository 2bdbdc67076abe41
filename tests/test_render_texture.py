"""Bilinear wrap-mode texture sampling against hand-computed values."""

import pytest
import torch

from mptex.render import texture

# Row 0 = [0, 1], row 1 = [2, 3]; texel (i, j) centred at ((i + 0.5) / 2, (j + 0.5) / 2).
TEX = torch.tensor([[[0.0], [1.0]], [[2.0], [3.0]]]).unsqueeze(0)


@pytest.mark.parametrize(
    "uv, expected",
    [
        ((0.25, 0.25), 0.0),  # texel centre (0, 0)
        ((0.75, 0.75), 3.0),  # texel centre (1, 1)
        ((0.5, 0.25), 0.5),  # halfway along row 0
        ((0.5, 0.5), 1.5),  # the four texels' mean
        ((0.375, 0.25), 0.25),  # a quarter of the way
        ((0.0, 0.25), 0.5),  # wraps: halfway between column 1 (left neighbour) and column 0
        ((1.0, 0.25), 0.5),
        ((0.25, 0.0), 1.0),  # wraps vertically: halfway between rows 1 and 0
        ((1.25, -0.75), 0.0),  # whole periods away from texel (0, 0)
    ],
)
def test_bilinear_wrap(uv, expected):
    out = texture(TEX, torch.tensor(uv).reshape(1, 1, 1, 2), backend="torch")
    torch.testing.assert_close(out, torch.full((1, 1, 1, 1), expected))


def test_shared_texture_is_broadcast_and_differentiable():
    tex = TEX.double().requires_grad_()
    uv = torch.rand(2, 3, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert texture(tex, uv, backend="torch").shape == (2, 3, 3, 1)
    # uv away from texel centres' kinks at these random points; tex enters linearly.
    assert torch.autograd.gradcheck(lambda t: texture(t, uv, backend="torch"), (tex,))


def test_bad_arguments():
    with pytest.raises(ValueError, match="uv: expected shape"):
        texture(TEX, torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="filter_mode"):
        texture(TEX, torch.zeros(1, 1, 1, 2), filter_mode="nearest")
    with pytest.raises(ValueError, match="boundary_mode: expected 'wrap' or 'clamp'"):
        texture(TEX, torch.zeros(1, 1, 1, 2), boundary_mode="mirror")


@pytest.mark.parametrize(
    "uv, expected",
    [
        ((0.25, 0.25), 0.0),  # inside: as wrap
        ((0.5, 0.5), 1.5),
        ((0.0, 0.25), 0.0),  # at the edge: column 0 only (wrap would blend in column 1)
        ((1.0, 0.25), 1.0),
        ((-0.5, 0.25), 0.0),  # beyond the edges: the edge texel
        ((1.5, 0.75), 3.0),
        ((0.75, 7.0), 3.0),
    ],
)
def test_bilinear_clamp(uv, expected):
    out = texture(TEX, torch.tensor(uv).reshape(1, 1, 1, 2), boundary_mode="clamp", backend="torch")
    torch.testing.assert_close(out, torch.full((1, 1, 1, 1), expected))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvdiffrast needs CUDA")
@pytest.mark.parametrize("mode", ["wrap", "clamp"])
def test_boundary_modes_match_nvdiffrast(mode):
    pytest.importorskip("nvdiffrast")
    tex = torch.rand(1, 5, 7, 3, generator=torch.Generator().manual_seed(0)).cuda()
    uv = (torch.rand(1, 8, 8, 2, generator=torch.Generator().manual_seed(1)) * 3 - 1).cuda()
    got = texture(tex, uv, boundary_mode=mode, backend="torch")
    want = texture(tex, uv, boundary_mode=mode, backend="nvdiffrast")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
