"""The torch grid's bfloat16 mode (tcnn has none) against the twin's float32 path: forward and
backward bit for bit where the rounding is the only difference, and within bfloat16's bound of
the unrounded float32 grid; the arm that uses it keeps float32 parameters, gradients and Adam
state."""

import pytest
import torch

import mptex
from mptex._grid_torch import hash_grid_encode
from mptex.encoding import HashGridEncoding

CONFIG = dict(n_levels=4, n_features_per_level=2, log2_hashmap_size=12, base_resolution=4,
              per_level_scale=2.0)  # fmt: skip
BF16_UNIT = 2.0**-8  # bfloat16's unit roundoff (8 significand bits; torch's eps is 2^-7)


def _grid():
    torch.manual_seed(0)
    grid = HashGridEncoding(3, **CONFIG, dtype=torch.bfloat16, backend="torch")
    with torch.no_grad():  # a trained-looking table: values of order 1
        grid.params.uniform_(-1, 1)
    return grid


def _points(n=2000, seed=1):
    # Points away from cell boundaries are not needed: the comparisons below are exact or
    # bounded per corner, so a point on a boundary interpolates the same corners either way.
    return torch.rand(n, 3, generator=torch.Generator().manual_seed(seed))


def test_forward_is_the_float32_path_on_the_rounded_table_rounded_once():
    grid, x = _grid(), _points()
    out = grid(x)
    assert out.dtype == torch.bfloat16 and grid.resolved_backend() == "torch"
    rounded = grid.params.detach().to(torch.bfloat16).float()
    expected = hash_grid_encode(x, rounded, grid.geometry, torch.float32).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_forward_within_bfloat16s_bound_of_the_unrounded_float32_grid():
    grid, x = _grid(), _points()
    out = grid(x).double()
    exact = hash_grid_encode(x, grid.params.detach(), grid.geometry, torch.float32).double()
    # Each table value is off by at most u |v|, so the interpolation by at most u sum_c w_c |v_c|;
    # the output's rounding adds u |y| <= u sum w|v|: 2u in all. (float32's own rounding, ~1e-7
    # relative, is far inside it.)
    magnitude = hash_grid_encode(x, grid.params.detach().abs(), grid.geometry, torch.float32)
    assert torch.all((out - exact).abs() <= 2 * BF16_UNIT * magnitude.double() + 1e-7)
    assert (out - exact).abs().max() > 0  # the bound is not met by accident of no rounding


def test_backward_is_the_float32_paths_on_the_bfloat16_cotangent():
    grid, x = _grid(), _points()
    x = x.clone().requires_grad_()
    cotangent = torch.randn(x.shape[0], grid.n_output_dims,
                            generator=torch.Generator().manual_seed(2))  # fmt: skip
    out = grid(x)
    grad_x, grad_params = torch.autograd.grad((out.float() * cotangent).sum(), (x, grid.params))
    assert grad_params.dtype == torch.float32 and grad_x.dtype == torch.float32
    # The same sums in float32: the table rounded to bfloat16 and dL/dy as the bfloat16 output's
    # gradient arrives (rounded to bfloat16), no loss scale.
    table = grid.params.detach().to(torch.bfloat16).float().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    ref = hash_grid_encode(x_ref, table, grid.geometry, torch.float32)
    g = cotangent.to(torch.bfloat16).float()
    ref_x, ref_params = torch.autograd.grad((ref * g).sum(), (x_ref, table))
    assert torch.equal(grad_params, ref_params)
    # dL/dx sums the same terms; the float32 reference may run the C kernel, whose order of
    # the per-corner sums is the eager path's (tests/test_grid_torch.py): equal to float32's
    # rounding.
    torch.testing.assert_close(grad_x, ref_x, rtol=1.3e-6, atol=1e-5)


def test_bfloat16_refuses_tcnn_in_one_line():
    # The Triton kernels have the bfloat16 mode (tests/test_encoding_triton.py); tcnn has none.
    with pytest.raises(ValueError, match="^dtype: tcnn has no bfloat16 grid") as info:
        HashGridEncoding(3, **CONFIG, dtype=torch.bfloat16, backend="tcnn")
    assert "\n" not in str(info.value) and "'triton'" in str(info.value)


def test_the_bf16_grid_arm_keeps_float32_parameters_gradients_and_adam_state():
    torch.manual_seed(0)
    encoder = {**CONFIG, "otype": "HashGrid"}
    texture = mptex.MLPTexture3D([[-1.0] * 3, [1.0] * 3], precision="bf16_grid",
                                 encoder=encoder, backend="torch")  # fmt: skip
    assert texture.encoder.dtype == torch.bfloat16
    optimizer = torch.optim.Adam(texture.parameters(), lr=1e-2)
    stepper = texture.policy.stepper(optimizer)
    points = torch.rand(1024, 3) * 2 - 1
    for _ in range(3):
        optimizer.zero_grad()
        result = stepper((texture.sample(points) - 0.5).square().mean())
        assert not result.skipped and result.loss_scale == 1.0
    for param in texture.parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
        assert all(v.dtype == torch.float32 for k, v in optimizer.state[param].items()
                   if k != "step")  # fmt: skip
    assert torch.count_nonzero(texture.encoder.params.grad) > 0
