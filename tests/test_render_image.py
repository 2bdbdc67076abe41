"""sRGB conversion and image I/O."""

import struct
import zlib

import numpy as np
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


def test_a_file_no_reader_decodes_is_one_line_naming_it(tmp_path):
    # Bytes no format starts with: imageio's "no backend" reason spans several lines.
    (tmp_path / "notes.png").write_bytes(b"junk")
    with pytest.raises(RuntimeError) as info:
        load_image(tmp_path / "notes.png")
    message = str(info.value)
    assert message.startswith(f"load_image: cannot read {tmp_path / 'notes.png'} (")
    assert "\n" not in message


def write_png16(path, data: np.ndarray) -> None:
    """A 16-bit grey, grey + alpha, RGB or RGBA PNG ([H, W, 1 to 4]) of uint16 ``data``
    (Pillow writes none but grey)."""
    height, width, channels = data.shape
    rows = data.astype(">u2").reshape(height, -1).view(np.uint8)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1)  # filter 0 per row

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return (
            struct.pack(">I", len(payload))
            + kind
            + payload
            + struct.pack(">I", zlib.crc32(kind + payload))
        )

    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    png = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes()))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png + chunk(b"IEND", b""))


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_16bit_png_keeps_all_16_bits(tmp_path, channels):
    # Pillow alone keeps only the high byte: 257 and 300 would both read as 1 / 255.
    words = np.array([[[0, 257, 300, 65535], [1, 32768, 65534, 12345]]], np.uint16)[..., :channels]
    write_png16(tmp_path / "a.png", words)
    got = load_image(tmp_path / "a.png")
    assert got.shape == (1, 2, channels)
    torch.testing.assert_close(got, torch.from_numpy(words.astype(np.float32) / 65535), rtol=0,
                               atol=0)  # fmt: skip


def test_cmyk_jpeg_reads_as_rgb(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "a.jpg", quality=100)
    got = load_image(tmp_path / "a.jpg")
    assert got.shape == (4, 4, 3)  # not 4 channels read as RGBA
    torch.testing.assert_close(got[0, 0], torch.tensor([1.0, 0, 0]), rtol=0, atol=2 / 255)


def test_animated_gif_reads_as_its_first_frame(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    frames = [Image.new("RGB", (3, 2), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:])
    got = load_image(tmp_path / "a.gif")
    torch.testing.assert_close(got, torch.tensor([1.0, 0, 0]).expand(2, 3, 3), rtol=0, atol=0)
