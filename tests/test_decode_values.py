"""The exported NumPy decoder (mptex.bake.neural_decoder) and mptex's decode precisions
(mptex.bake.decode) on inputs with a known right answer: the float64 texture, every E4M3 byte,
points outside the box, an output range that does not start at 0, an all-zero activation row,
the fp8 calibration chain and the decode table's PSNR by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_decode import AABB, FLIP, SMALL, _points, _texture

from mptex._grid_torch import hash_grid_encode
from mptex.bake import neural_decoder
from mptex.bake.decode import (
    DECODE_PRECISIONS,
    _layer,
    calibrate_fp8,
    decode_precision_table,
    decode_texture,
    decoder_weights,
    export_neural,
)

safetensors_torch = pytest.importorskip("safetensors.torch")


def _float64_texture(texture, points: torch.Tensor) -> np.ndarray:
    """The texture's values at ``points`` with every sum and product in float64: the grid of its
    f32 table, its f32 MLP masters, the sigmoid and the output range."""
    lo, hi = texture.AABB.double()
    unit = ((points.double() - lo) / (hi - lo)).clamp(0, 1)
    params = texture.encoder.params.detach().double()
    h = hash_grid_encode(unit, params, texture.encoder.geometry, torch.float64)
    weights = decoder_weights(texture)
    if weights.input_padding:
        h = torch.cat([h, h.new_ones(h.shape[0], weights.input_padding)], 1)
    for index, matrix in enumerate(weights.matrices):
        h = h @ matrix.double().t()
        if index < len(weights.matrices) - 1:
            h = torch.relu(h)
    low, high = texture.min_max.double()
    return (torch.sigmoid(h[:, : weights.n_outputs]) * (high - low) + low).numpy()


# Each precision's unit roundoff: f32 2^-24, f16 2^-11, bf16 2^-8, E4M3 2^-4 (3 mantissa bits),
# int8 2^-8 (half a step of 1/127 of a row's largest weight).
UNIT = {"f32": 2.0**-24, "f16": 2.0**-11, "bf16": 2.0**-8, "fp8": 2.0**-4,
        "fp8_rowwise": 2.0**-4, "int8": 2.0**-8}  # fmt: skip
# f32: up to 64 roundings on the way to a logit (8 corners x 4 levels, two 8-term layers), the
# sigmoid's slope at most 1/4, logits below 2 here: 64 u. The others: each value the precision
# rounds is off by at most u relatively; measured, the largest value error is 0.6 u (fp8) to
# 1.2 u (f16) on these textures: 2 u. A decoder off by one step of its precision throughout
# (a wrong scale, a dropped rounding, the wrong grid mode) exceeds it.
ROUNDINGS = {"f32": 64, "f16": 2, "bf16": 2, "fp8": 2, "fp8_rowwise": 2, "int8": 2}


@pytest.mark.parametrize("arm", ["f32", "tcnn_fused"])
@pytest.mark.parametrize("precision", DECODE_PRECISIONS)
def test_the_exported_decoder_is_the_float64_texture_to_its_precision(arm, precision, tmp_path):
    texture, points = _texture(arm), _points(5000)
    path = tmp_path / "neural.safetensors"
    export_neural(texture, path, precision, calibration_points=points)
    got = neural_decoder.load(path).decode(points.numpy())
    error = np.abs(got.astype(np.float64) - _float64_texture(texture, points))
    assert error.max() <= ROUNDINGS[precision] * UNIT[precision], error.max()


def test_every_e4m3_byte_reads_as_torchs_float8_e4m3fn(tmp_path):
    codes = torch.arange(256, dtype=torch.uint8)
    path = tmp_path / "bytes.safetensors"
    safetensors_torch.save_file({"w": codes.view(torch.float8_e4m3fn)}, str(path))
    tensors, _ = neural_decoder.read_safetensors(path)
    expected = codes.view(torch.float8_e4m3fn).float().numpy()
    # 0x7F and 0xFF are NaN; the subnormals (exponent 0) are m / 8 * 2^-6: 0x01 is 2^-9.
    assert np.array_equal(tensors["w"], expected, equal_nan=True)
    assert tensors["w"][1] == 2.0**-9 and np.isnan(tensors["w"][0x7F])
    assert tensors["w"][0x7E] == 448.0


def test_rounding_to_e4m3_and_bf16_matches_torch_on_its_grid_and_specials():
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[finite.isfinite()]
    # every E4M3 value, its float32 neighbours and the midpoints between it and its neighbours
    up = torch.nextafter(finite, torch.tensor(float("inf")))
    down = torch.nextafter(finite, torch.tensor(float("-inf")))
    grid = torch.sort(torch.unique(finite)).values
    mid = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([finite, up, down, mid, torch.nextafter(mid, grid[1:])])
    x = x[x.abs() <= 448]
    e4m3 = x.to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(neural_decoder.round_to_e4m3(x.numpy()), e4m3)
    # bf16: infinities stay, every NaN stays NaN (also one whose only set bit is the lowest)
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFF800001],
                       dtype=np.uint32).view(np.float32)  # fmt: skip
    rounded = neural_decoder.round_to_bf16(special)
    assert np.array_equal(rounded[:2], [np.inf, -np.inf])
    assert np.isnan(rounded[2:]).all(), rounded


@pytest.mark.parametrize("precision", DECODE_PRECISIONS)
def test_points_outside_the_box_decode_as_the_nearest_point_of_the_box(precision, tmp_path):
    texture = _texture("f32")
    lo, hi = torch.tensor(AABB[0]), torch.tensor(AABB[1])
    inside = _points(2000, seed=5)
    # the same points pushed out of the box on every axis by up to its size: clamped back
    gen = torch.Generator().manual_seed(6)
    push = (torch.rand(2000, 3, generator=gen) - 0.5) * 4 * (hi - lo)
    outside = inside + push
    clamped = torch.minimum(torch.maximum(outside, lo), hi)
    assert (outside != clamped).any(1).float().mean() > 0.5
    path = tmp_path / "neural.safetensors"
    export_neural(texture, path, precision, calibration_points=inside)
    scales = calibrate_fp8(texture, inside) if precision == "fp8" else None
    decoder = neural_decoder.load(path)
    assert np.array_equal(decoder.decode(outside.numpy()), decoder.decode(clamped.numpy()))
    assert torch.equal(decode_texture(texture, outside, precision, scales),
                       decode_texture(texture, clamped, precision, scales))  # fmt: skip
    if precision == "f32":
        with torch.no_grad():
            assert torch.equal(decode_texture(texture, outside, "f32"), texture.sample(outside))


@pytest.mark.parametrize("precision", DECODE_PRECISIONS)
def test_an_output_range_that_does_not_start_at_0_is_kept(precision, tmp_path):
    import mptex

    torch.manual_seed(0)
    min_max = [[-1.0, 0.5, 2.0], [1.0, 0.75, 6.0]]
    texture = mptex.MLPTexture3D(AABB, precision="f32", min_max=min_max, encoder=SMALL,
                                 backend="torch")  # fmt: skip
    with torch.no_grad():
        texture.encoder.params.uniform_(-1, 1)
    points = _points(3000)
    path = tmp_path / "neural.safetensors"
    info = export_neural(texture, path, precision, calibration_points=points)
    expected = decode_texture(texture, points, precision, info.get("input_scales")).numpy()
    got = neural_decoder.load(path).decode(points.numpy())
    # the NumPy decoder's sum order: FLIP's bound, scaled by the widest channel's range (4)
    assert np.abs(got - expected).max() <= 4 * FLIP[precision]
    low, high = np.array(min_max[0]), np.array(min_max[1])
    assert ((got >= low) & (got <= high)).all() and (got[:, 0] < 0).any()
    reference = _float64_texture(texture, points)
    assert np.abs(got - reference).max() <= 4 * ROUNDINGS[precision] * UNIT[precision]


def test_a_rowwise_fp8_layer_maps_an_all_zero_row_to_zeros(tmp_path):
    # A point whose activations after a ReLU are all 0 has amax 0: its scale is 1, and its
    # outputs 0, in the decoder as in mptex's decode (not 0 * inf = NaN).
    texture = _texture("f32")
    path = tmp_path / "neural.safetensors"
    export_neural(texture, path, "fp8_rowwise")
    decoder = neural_decoder.load(path)
    gen = torch.Generator().manual_seed(7)
    h = torch.rand(3, 8, generator=gen)
    h[1] = 0.0
    got = decoder._layer(h.numpy(), decoder.layers[0])
    expected = _layer(h, decoder_weights(texture).matrices[0], "fp8_rowwise", None).numpy()
    assert np.array_equal(got[1], np.zeros_like(got[1])) and np.array_equal(got, expected)


def test_each_fp8_scale_is_448_over_the_amax_of_what_the_fp8_layers_before_it_give():
    texture, points = _texture("f32"), _points(3000)
    scales = calibrate_fp8(texture, points)
    matrices = decoder_weights(texture).matrices
    lo, hi = texture.AABB
    unit = ((points - lo) / (hi - lo)).clamp(0, 1)
    params = texture.encoder.params.detach().float()
    h = hash_grid_encode(unit, params, texture.encoder.geometry, torch.float16).float()
    for index, matrix in enumerate(matrices):
        amax = np.float32(h.abs().max().item())
        assert scales[index] == float(np.float32(448.0) / amax), index
        h = _layer(h, matrix, "fp8", scales[index])
        if index < len(matrices) - 1:
            h = torch.relu(h)


def _srgb(linear: float) -> float:
    return 1.055 * linear ** (1 / 2.4) - 0.055


def test_the_decode_table_scores_against_the_reference_over_its_background():
    texture = _texture("f32")
    gen = torch.Generator().manual_seed(8)
    lo, hi = torch.tensor(AABB[0]), torch.tensor(AABB[1])
    # One view of 64 x 1 pixels: 63 covered, the last one not.
    positions = lo + (hi - lo) * torch.rand(1, 64, 1, 3, generator=gen)
    mask = torch.ones(1, 64, 1, dtype=torch.bool)
    mask[0, 63, 0] = False
    covered = decode_texture(texture, positions[mask], "f32")
    reference = torch.zeros(1, 64, 1, 4)
    reference[mask] = torch.cat([covered, torch.ones(63, 1)], 1)
    # The uncovered pixel: black at half coverage, over white 0.5, over black 0.
    reference[0, 63, 0] = torch.tensor([0.0, 0.0, 0.0, 0.5])
    white = decode_precision_table(texture, positions, mask, "white", ["f32", "f16"], reference)
    black = decode_precision_table(texture, positions, mask, "black", ["f32", "f16"], reference)
    # White: the decode's background 1 against the reference's 0.5 (sRGB 0.7354) at 1 pixel of
    # 64, on all 3 channels; the covered pixels agree to float32's 1 + (v - 1) (MSE ~1e-15).
    mse = (1.0 - _srgb(0.5)) ** 2 / 64
    assert white["psnr_vs_reference"]["f32"] == pytest.approx(-10 * math.log10(mse), abs=1e-3)
    # Black: 0 over 0 on the uncovered pixel; the covered ones agree to within 1e-10: 100 dB.
    assert black["psnr_vs_reference"]["f32"] == pytest.approx(100.0, abs=1e-3)
    f16 = decode_texture(texture, positions[mask], "f16")
    largest = float((f16 - covered).abs().max())
    assert white["max_abs_error"]["f16"] == largest > float((f16 - covered).abs().mean())


def test_views_that_cover_no_pixel_decode_nothing_in_every_precision():
    # A decode of no points gives no values (fp8 calibrates no activations: amax 0, scale 1),
    # and the decode table of views with no covered pixel differs from f32 nowhere.
    texture = _texture("f32")
    none = torch.zeros(0, 3)
    for precision in DECODE_PRECISIONS:
        assert decode_texture(texture, none, precision).shape == (0, 3), precision
    assert calibrate_fp8(texture, none) == [1.0] * len(decoder_weights(texture).matrices)
    positions = torch.zeros(1, 4, 4, 3)
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    table = decode_precision_table(texture, positions, mask, "white")
    assert table["max_abs_error"] == {p: 0.0 for p in DECODE_PRECISIONS if p != "f32"}


def test_the_neural_export_refuses_a_grid_its_decoder_does_not_interpolate(tmp_path):
    import mptex

    encoder = {**SMALL, "interpolation": "Smoothstep"}
    texture = mptex.MLPTexture3D(AABB, precision="f32", encoder=encoder, backend="torch")
    path = tmp_path / "neural.safetensors"
    with pytest.raises(ValueError, match="^texture: the neural export's decoder interpolates "
                       "linearly .*got interpolation 'Smoothstep'$"):  # fmt: skip
        export_neural(texture, path, "f16")
    assert not path.exists()


def test_the_decoder_refuses_a_safetensors_file_that_is_not_a_neural_export(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="^metadata: not an mptex neural export: 'pt'$"):
        neural_decoder.load(path)
