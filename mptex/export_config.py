"""The ``export`` config group: what ``export.enabled=true`` bakes and writes at the end of a run.

The writers are :mod:`mptex.bake`'s (:func:`mptex.bake.export_mesh`); the group's schema sits
here, below them, because ``mptex-train`` checks the whole run config, this group included,
before any work, and training may not import the bake (mptex's layers point down).
``configs/export/default.yaml`` mirrors :class:`ExportConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mptex.config_schema import (
    Integer,
    ListOf,
    OneOf,
    OrNull,
    Table,
    check_group,
    defaults_of,
    setting,
)

__all__ = [
    "ExportConfig",
    "EXPORT_DEFAULTS",
    "FORMATS",
    "KD_FORMATS",
    "DECODE_PRECISIONS",
    "check_export_config",
]

FORMATS = ("obj", "glb")
# The precisions a trained texture is decoded in (mptex.bake.decode).
DECODE_PRECISIONS = ("f32", "f16", "bf16", "fp8", "fp8_rowwise", "int8")
# The albedo's file formats and the suffix of their files.
KD_FORMATS = {"png8": ".png", "png16": ".png", "exr": ".exr"}
_XATLAS_OPTIONS = Table(what="a mapping of xatlas option names to values")


def _padding_within_the_atlas(s: Mapping[str, Any]) -> str | None:
    if s["padding"] <= s["resolution"]:
        return None
    return (f"at most export.resolution ({s['resolution']}: a padding wider than the atlas "
            "fills no more texels)")  # fmt: skip


@dataclass
class ExportConfig:
    """The ``export`` group (files under ``<run dir>/export/``: mesh.obj + mesh.mtl +
    texture_kd.png, mesh.glb, export.json)."""

    enabled: bool = False
    """Export when the run completes (``mptex-export RUN_DIR`` does the same afterwards)."""
    resolution: int = setting(1024, Integer(min=2))
    """Atlas size N (N x N texels); refused at start when it does not fit in memory."""
    formats: list[str] = setting(
        ["obj", "glb"], ListOf(OneOf(FORMATS), non_empty=True, unique=True, comma_text=True)
    )
    """``obj``: OBJ + MTL + PNG; ``glb``: binary glTF (needs trimesh). A list, or
    ``"obj,glb"``."""
    padding: int = setting(4, Integer(min=0), rule=_padding_within_the_atlas)
    """Seam padding in texels (nearest-texel dilation): bilinear filtering and mip levels 0-2.
    At most ``resolution``: a wider padding fills no more texels (the bake's cost grows as its
    square)."""
    unwrap: str = setting("auto", OneOf(("auto", "always")))
    """``auto``: the mesh's own UVs when usable, else xatlas's; ``always``: xatlas's."""
    kd_format: str = setting("png8", OneOf(tuple(KD_FORMATS)))
    """``png8`` / ``png16`` (sRGB) or ``exr`` (linear; needs an imageio EXR plugin)."""
    chunk_size: int = setting(1 << 18, Integer(min=1))
    """Texels per MLP evaluation batch."""
    measure: bool = True
    """Render the validation views with the baked texture: PSNRs in export.json."""
    chart_options: dict[str, Any] = setting({}, _XATLAS_OPTIONS)
    """``xatlas.ChartOptions`` attributes, e.g. ``{max_iterations: 4}``."""
    pack_options: dict[str, Any] = setting({}, _XATLAS_OPTIONS)
    """``xatlas.PackOptions`` attributes (:data:`mptex.bake.PACK_DEFAULTS` unless given)."""
    decode_precisions: list[str] = setting(
        list(DECODE_PRECISIONS), ListOf(OneOf(DECODE_PRECISIONS), unique=True, comma_text=True)
    )
    """With ``measure``: decode the texture in each (``f32``, ``f16``, ``bf16``, ``fp8``,
    ``fp8_rowwise``, ``int8``; :mod:`mptex.bake.decode`) on the measured views; export.json's
    ``decode_precision`` holds each one's PSNR against the f32 decode. ``[]``: none."""
    neural_precision: str | None = setting(
        None, OrNull(OneOf(DECODE_PRECISIONS), "no neural export")
    )
    """Also write the grid and MLP weights in this precision (``texture_neural.safetensors``,
    needs safetensors) with ``neural_decoder.py``, a NumPy decoder for it."""


EXPORT_DEFAULTS = defaults_of(ExportConfig)


def check_export_config(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``export`` group with defaults filled in, every key checked.

    Args:
        cfg: the group (a mapping; None: all defaults).

    Returns:
        a plain dict with every key of :class:`ExportConfig`, ``formats`` a list without
        duplicates.

    Raises:
        ConfigError: (a ``ValueError``) ``"export.<key>: ..."`` for an unknown key or a bad
            value, one line.
    """
    return check_group(ExportConfig, cfg, "export")
