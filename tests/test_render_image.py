"""sRGB conversion and image I/O."""

import pytest
import torch

from mptex.render import load_image, rgb_to_srgb, save_image, srgb_to_rgb


def test_srgb_known_values_and_round_trip():
    lin = torch.tensor([0.001, 0.5, 1.0])
    srgb = rgb_to_srgb(torch.stack([lin] * 3, -1))[:, 0]
    # linear segment below 0.0031308; 1.055 * x^(1/2.4) - 0.055 above.
    torch.testing.assert_close(srgb, torch.tensor([0.01292, 1.055 * 0.5 ** (1 / 2.4) - 0.055, 1.0]))
    x = torch.rand(64, 4, generator=torch.Generator().manual_seed(0))
    back = srgb_to_rgb(rgb_to_srgb(x))
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-6)  # pow round trip in float32
    assert torch.equal(rgb_to_srgb(x)[:, 3], x[:, 3])  # alpha untouched


def test_png_round_trip(tmp_path):
    img = torch.rand(5, 7, 4, generator=torch.Generator().manual_seed(0))
    save_image(tmp_path / "a.png", img)
    back = load_image(tmp_path / "a.png")
    assert back.shape == (5, 7, 4)
    torch.testing.assert_close(back, img, rtol=0, atol=0.5 / 255 + 1e-6)  # 8-bit rounding
    save_image(tmp_path / "b.png", img[..., :3], to_srgb=True)
    lin = load_image(tmp_path / "b.png", to_linear=True)
    torch.testing.assert_close(lin, img[..., :3], rtol=0, atol=0.01)  # 8-bit in sRGB space


def test_float_formats_write_or_explain(tmp_path):
    img = torch.rand(4, 4, 3) * 4  # HDR values above 1
    try:
        save_image(tmp_path / "a.exr", img)
    except RuntimeError as exc:
        assert "plugin" in str(exc)
        pytest.skip(f"no EXR writer on this machine: {exc}")
    torch.testing.assert_close(load_image(tmp_path / "a.exr")[..., :3], img)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_image(tmp_path / "nope.png")
