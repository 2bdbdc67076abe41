"""Decode precisions (mptex.bake.decode) and the neural export's NumPy decoder
(mptex.bake.neural_decoder): the NumPy decoder reproduces mptex's decode within each precision's
stated tolerance, imports no torch, and the export writes both with the PSNR table."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mptex
from mptex.bake import export_mesh, neural_decoder
from mptex.bake.decode import (
    DECODE_PRECISIONS,
    calibrate_fp8,
    decode_precision_table,
    decode_texture,
    export_neural,
)
from mptex.scenes.builtin import torus_knot

pytest.importorskip("safetensors")

SMALL = {"otype": "HashGrid", "n_levels": 4, "n_features_per_level": 2,
         "log2_hashmap_size": 12, "base_resolution": 4, "per_level_scale": 2.0}  # fmt: skip
AABB = [[-1.0, -2.0, 0.0], [3.0, 2.0, 1.0]]

# NumPy's matrix products sum in another order than torch's, so a value near a rounding
# boundary of the precision can round the other way: once in a few thousand values (measured:
# 1 of 60,000 in f16, none in the others). One such flip moves a hidden activation or a logit
# (|z| < 16 here) by one unit in the last place of the precision, and the sigmoid passes at most
# a quarter of it: f16 2**-7 * 16 / 4 = 3e-2 at the most, far less in practice; the bound is a
# few flips. Everything else agrees to float32's sum-order error (1e-6 after the sigmoid).
FLIP = {
    "f32": 1e-6,
    "f16": 2e-2,
    "bf16": 1.5e-1,
    "fp8": 2.5e-1,
    "int8": 2e-2,
    # Row-wise FP8's sums are exact in both (float64) and every scale a float32 division
    # or product rounded once in both: bit for bit, up to the grid's f16 sum-order flips
    # (none expected: the grid's arithmetic is the same per element), so f16's bound.
    "fp8_rowwise": 2e-2,
}
AGREE = 1e-6  # float32 sum-order error after the sigmoid
MOST = 0.999  # at least this fraction of the values agree to AGREE


def _texture(arm: str, encoder=SMALL) -> mptex.MLPTexture3D:
    torch.manual_seed(0)
    texture = mptex.MLPTexture3D(AABB, precision=arm, encoder=encoder, backend="torch")
    with torch.no_grad():  # a trained-looking table: features of order 1
        texture.encoder.params.uniform_(-1, 1)
    return texture


def _points(n: int = 20000, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = torch.tensor(AABB[0]), torch.tensor(AABB[1])
    return lo + (hi - lo) * torch.rand(n, 3, generator=gen)


@pytest.mark.parametrize("arm", ["f32", "tcnn_fused", "int8_qat", "fp8_rowwise_qat"])
@pytest.mark.parametrize("precision", DECODE_PRECISIONS)
def test_numpy_decoder_reproduces_mptex_decode(arm, precision, tmp_path):
    texture, points = _texture(arm), _points()
    path = tmp_path / "neural.safetensors"
    info = export_neural(texture, path, precision, calibration_points=points)
    scales = info.get("input_scales")
    expected = decode_texture(texture, points, precision, scales).numpy()
    got = neural_decoder.load(path).decode(points.numpy())
    assert got.shape == expected.shape == (points.shape[0], 3) and got.dtype == np.float32
    error = np.abs(got - expected)
    assert error.max() <= FLIP[precision], error.max()
    assert (error <= AGREE).mean() >= MOST, (error > AGREE).mean()


def test_f32_decode_is_the_f32_texture():
    texture, points = _texture("f32"), _points(5000)
    with torch.no_grad():
        assert torch.equal(decode_texture(texture, points, "f32"), texture.sample(points))


def test_fp8_calibration_is_448_over_each_layers_input_amax():
    texture, points = _texture("f32"), _points(3000)
    scales = calibrate_fp8(texture, points)
    with torch.no_grad():
        features = texture.encoder(
            ((points - texture.AABB[0]) / (texture.AABB[1] - texture.AABB[0])).clamp(0, 1)
        )
    # Layer 0's input is the grid's features in tcnn's half mode (f16 table and sums).
    half = mptex.HashGridEncoding.from_tcnn_config(3, SMALL, backend="torch", dtype=torch.float16)
    half.load_state_dict(texture.encoder.state_dict())
    with torch.no_grad():
        unit = ((points - texture.AABB[0]) / (texture.AABB[1] - texture.AABB[0])).clamp(0, 1)
        amax = half(unit).float().abs().max().item()
    assert scales[0] == float(np.float32(448.0) / np.float32(amax))
    assert len(scales) == len(texture.net.layers) and features.shape[1] == 8


def test_decode_table_orders_the_precisions_by_their_bits():
    texture = _texture("f32")
    gen = torch.Generator().manual_seed(2)
    lo, hi = torch.tensor(AABB[0]), torch.tensor(AABB[1])
    positions = lo + (hi - lo) * torch.rand(2, 24, 24, 3, generator=gen)
    mask = torch.rand(2, 24, 24, generator=gen) > 0.3
    table = decode_precision_table(texture, positions, mask, "white")
    psnr = table["psnr_vs_f32"]
    assert set(psnr) == {"f16", "bf16", "fp8", "fp8_rowwise", "int8"}
    assert table["reference"] == "f32"
    # 11, 8 and 4 significant bits: each precision further from f32 than the one before; int8
    # weights (~7 bits of the row's largest) with f16 activations sit between bf16 and fp8 here.
    assert psnr["f16"] > psnr["bf16"] > psnr["fp8"]
    assert psnr["int8"] > psnr["fp8"]
    # The same E4M3 values with a scale per point and channel: never flushed by a larger row.
    assert psnr["fp8_rowwise"] > psnr["fp8"]
    assert all(0 < table["max_abs_error"][p] < 0.5 for p in psnr)
    assert table["weights"] == "post-training quantisation"
    qat = decode_precision_table(_texture("int8_qat"), positions, mask, "white", ["f32", "int8"])
    assert qat["weights"].startswith("trained fake-quantised (int8)")
    with pytest.raises(ValueError, match="precisions: expected"):
        decode_precision_table(texture, positions, mask, "white", ["int4"])


def test_rowwise_fp8_decode_runs_the_network_its_qat_arm_trained():
    """fp8_rowwise_qat trains with each layer's input E4M3 per row and its weights E4M3 per
    output channel (fake-quantised, f32 GEMM); the fp8_rowwise decoder multiplies the same E4M3
    values and applies the same scales after an exact sum. Layer by layer they differ only by
    the f32 GEMM's rounding: K terms, at most K u sum |x_q w_q| (u = 2^-24) and two roundings
    of the scales."""
    from mptex.bake.decode import _layer
    from mptex.quantize import fake_quantize, fake_quantize_input

    texture = _texture("fp8_rowwise_qat")
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(500, 8, generator=gen) * 10.0 ** torch.linspace(-4, 2, 500)[:, None]
    for layer in texture.net.layers:
        w = layer.weight.detach()
        decoded = _layer(h, w, "fp8_rowwise", None).double()
        x_q, w_q = fake_quantize_input(h, "fp8_rowwise"), fake_quantize(w, "fp8_rowwise")
        trained = x_q.double() @ w_q.double().t()  # exact in float64
        bound = (h.shape[1] + 3) * 2.0**-24 * (x_q.double().abs() @ w_q.double().abs().t())
        assert torch.all((decoded - trained).abs() <= bound)
        assert torch.allclose(layer(h).double(), trained, rtol=0, atol=float(bound.max()))
        h = torch.relu(decoded.float())


def test_the_numpy_decoder_imports_no_torch():
    source = Path(neural_decoder.__file__)
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    # NumPy and the standard library only.
    assert imported - {"numpy"} <= set(sys.stdlib_module_names), imported
    # And it runs where torch cannot be imported at all, loaded from its file alone.
    code = (
        "import sys, importlib.util; sys.modules['torch'] = None; "
        f"spec = importlib.util.spec_from_file_location('neural_decoder', {str(source)!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(m.round_to_e4m3(m.np.array([0.3, 500.0, -0.0009], dtype=m.np.float32)).tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # 0.3 -> 0.3125 (E4M3's neighbours 0.28125, 0.3125), 500 saturates at 448, -0.0009 is
    # below half the smallest subnormal 2**-9: -0.
    assert out.stdout.strip() == "[0.3125, 448.0, -0.0]"


def test_numpy_rounding_helpers_match_torchs_casts():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20000, generator=gen) * 10.0 ** (torch.rand(20000, generator=gen) * 8 - 5)
    x = x[x.abs() < 448]
    e4m3 = x.to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(neural_decoder.round_to_e4m3(x.numpy()), e4m3)
    bf16 = x.to(torch.bfloat16).float().numpy()
    assert np.array_equal(neural_decoder.round_to_bf16(x.numpy()), bf16)


@pytest.mark.requires_xatlas
def test_export_mesh_writes_the_decode_table_and_the_neural_export(tmp_path):
    mesh = torus_knot(48, 8)
    texture = _texture("f32", encoder=SMALL)
    texture.AABB.copy_(mesh.aabb)
    out = tmp_path / "asset"
    summary = export_mesh(texture, mesh, out, resolution=64, formats="obj",
                          neural_precision="fp8")  # fmt: skip
    written = json.loads((out / "export.json").read_text())
    table = written["decode_precision"]
    assert set(table["psnr_vs_f32"]) == {"f16", "bf16", "fp8", "fp8_rowwise", "int8"}
    assert table["views"].startswith("8 orbit views")
    neural = written["neural"]
    assert neural["precision"] == "fp8" and (out / neural["file"]).is_file()
    assert summary["files"]["neural_decoder"] == "neural_decoder.py"
    # The exported decoder, run from the export folder, reproduces mptex's fp8 decode.
    decoder = neural_decoder.load(out / neural["file"])
    lo, hi = mesh.aabb
    points = lo + (hi - lo) * torch.rand(4000, 3, generator=torch.Generator().manual_seed(4))
    expected = decode_texture(texture, points, "fp8", neural["input_scales"]).numpy()
    error = np.abs(decoder.decode(points.numpy()) - expected)
    assert error.max() <= FLIP["fp8"] and (error <= AGREE).mean() >= MOST
    none = export_mesh(texture, mesh, tmp_path / "none", resolution=64, formats="obj",
                       decode_precisions=[])  # fmt: skip
    assert "decode_precision" not in none and "neural" not in none


def test_the_neural_file_gets_the_mode_of_every_other_written_file(tmp_path):
    # A plain open() gives 0o666 less the umask (0o640 under 0o027), as the asset's other files
    # get: a shared asset folder must not hold one file only its owner can read.
    texture = _texture("f32")
    path = tmp_path / "neural.safetensors"
    old = os.umask(0o027)
    try:
        export_neural(texture, path, "f16")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640
    assert neural_decoder.load(path).decode(np.zeros((1, 3), np.float32)).shape == (1, 3)
