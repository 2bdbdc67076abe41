"""UV unwrapping with xatlas (charts, then one atlas packed at the bake resolution).

xatlas is imported lazily (``import mptex.bake`` does not need it); :func:`has_xatlas` says
whether it is importable and :func:`unwrap_mesh` raises a one-line ``RuntimeError`` without it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from mptex.config_schema import Flag, Integer, Number, defaults_of
from mptex.render.mesh import Mesh

__all__ = ["has_xatlas", "check_xatlas_options", "unwrap_mesh", "PackDefaults", "PACK_DEFAULTS"]


@dataclass
class PackDefaults:
    """mptex's ``xatlas.PackOptions`` where they differ from xatlas's own; ``export.pack_options``
    overrides them and may set any other ``PackOptions`` attribute (xatlas's class is the
    schema of those: :func:`unwrap_mesh` refuses a name it does not have)."""

    padding: int = 2
    """Texels between charts."""
    bilinear: bool = True
    """Leave room for bilinear filtering at chart borders."""


PACK_DEFAULTS = defaults_of(PackDefaults)
# Set by unwrap_mesh itself: the atlas is packed at exactly the bake resolution.
_PACK_RESERVED = ("resolution", "texels_per_unit", "create_image")
# Shrinking steps of texels_per_unit until all charts fit one N x N atlas.
_MAX_PACK_TRIES = 12


def _import_xatlas():
    try:
        return importlib.import_module("xatlas")
    except ImportError:
        return None


def has_xatlas() -> bool:
    """True when the ``xatlas`` package imports."""
    return _import_xatlas() is not None


# The kinds of xatlas's option values (its C struct fields: bool, uint32_t, float).
_XATLAS_KINDS = {
    bool: Flag(),
    int: Integer(0, 2**32 - 1, note="xatlas's uint32"),
    float: Number(),
}


def _options(xatlas_cls, given: dict[str, Any] | None, defaults: dict[str, Any], arg: str,
             prefix: str = ""):  # fmt: skip
    options = xatlas_cls()
    key = f"{prefix}{arg}"
    for name, value in {**defaults, **(given or {})}.items():
        if name in _PACK_RESERVED and arg == "pack_options":
            raise ValueError(f"{key}.{name}: set by the bake (the atlas is the bake resolution)")
        if name.startswith("_") or not hasattr(options, name):
            valid = sorted(n for n in dir(options) if not n.startswith("_"))
            raise ValueError(f"{key}.{name}: unknown xatlas option; valid: {valid}")
        # xatlas's own TypeError spans lines and names no type, and pybind takes True for 1,
        # 1 for True and NaN for a number: each value is checked against its default's kind.
        _XATLAS_KINDS[type(getattr(options, name))](value, f"{key}.{name}")
        setattr(options, name, value)
    return options


def check_xatlas_options(
    chart_options: dict[str, Any] | None, pack_options: dict[str, Any] | None, prefix: str = ""
) -> None:
    """Refuse what :func:`unwrap_mesh` would refuse in ``chart_options`` / ``pack_options``
    (an unknown name, one the bake sets, a value xatlas does not take) before any work, also
    where the mesh keeps its UVs and the options go unused. Without xatlas nothing is checked
    (an unwrap then says that xatlas is missing).

    Raises:
        ValueError: ``"<prefix>chart_options.<name>: ..."`` (or ``pack_options``), one line.
    """
    xatlas = _import_xatlas()
    if xatlas is None:
        return
    _options(xatlas.ChartOptions, chart_options, {}, "chart_options", prefix)
    _options(xatlas.PackOptions, pack_options, PACK_DEFAULTS, "pack_options", prefix)


def unwrap_mesh(
    mesh: Mesh,
    resolution: int,
    chart_options: dict[str, Any] | None = None,
    pack_options: dict[str, Any] | None = None,
    why: str = "",
) -> Mesh:
    """A copy of ``mesh`` with xatlas UVs packed into one ``resolution`` x ``resolution`` atlas.

    xatlas cuts the surface into charts, parameterises them and packs them. Its packer leaves
    ``pack_options["padding"]`` texels (default 2) between charts only at the resolution it
    packed for, so the atlas is packed at the bake resolution: a first pack estimates the
    texel scale, then ``texels_per_unit`` shrinks until every chart fits one N x N atlas.

    Args:
        mesh: triangle mesh (positions and ``t_pos_idx``; its UVs are ignored).
        resolution: N of the atlas the texture is baked into.
        chart_options: ``xatlas.ChartOptions`` attributes (e.g. ``max_iterations``,
            ``max_cost``, ``normal_seam_weight``).
        pack_options: ``xatlas.PackOptions`` attributes (defaults :data:`PACK_DEFAULTS`;
            ``resolution`` and ``texels_per_unit`` are set here).
        why: the reason for unwrapping, for the error message when xatlas is missing.

    Returns:
        a ``Mesh`` with ``v_tex`` [V', 2] float32 in [0, 1] (v = 0 is texel row 0) and
        ``t_tex_idx`` [T, 3] int32 (one UV vertex per xatlas vertex: vertices are split at chart
        seams); positions, normals and materials are the input's, triangles in the same order.

    Raises:
        RuntimeError: xatlas is not installed (``pip install xatlas``).
        ValueError: an unknown option (``chart_options.<name>``), or no packing fits.
    """
    xatlas = _import_xatlas()
    if xatlas is None:
        because = f"{why}; " if why else ""
        raise RuntimeError(
            f"mesh: {because}new UVs need xatlas, which is not installed (pip install xatlas)"
        )
    chart = _options(xatlas.ChartOptions, chart_options, {}, "chart_options")
    # Checked before an Atlas exists: an Atlas dropped while an exception unwinds has hung in
    # its task scheduler's thread join.
    _options(xatlas.PackOptions, pack_options, PACK_DEFAULTS, "pack_options")
    positions = mesh.v_pos.detach().cpu().numpy().astype(np.float32)
    indices = mesh.t_pos_idx.detach().cpu().numpy().astype(np.uint32)
    atlas = xatlas.Atlas()
    atlas.add_mesh(positions, indices)

    def pack(texels_per_unit: float, size: int):
        options = _options(xatlas.PackOptions, pack_options, PACK_DEFAULTS, "pack_options")
        options.resolution, options.texels_per_unit = size, texels_per_unit
        atlas.generate(chart, options)

    # Resolution 0 with no scale: xatlas estimates the scale of one atlas of about 1024^2.
    pack(0.0, 0)
    scale = atlas.texels_per_unit * resolution / max(atlas.width, atlas.height)
    for _ in range(_MAX_PACK_TRIES):
        pack(scale, resolution)
        if atlas.atlas_count == 1 and max(atlas.width, atlas.height) <= resolution:
            break
        scale *= 0.9
    else:
        raise ValueError(
            f"resolution: xatlas cannot pack the mesh's charts into one {resolution}^2 atlas"
        )
    vmapping, faces, uvs = atlas[0]
    # xatlas normalises UVs by the atlas size; keep texel units of the N x N grid.
    uvs = uvs * np.array([atlas.width, atlas.height], dtype=np.float32) / resolution
    if not np.array_equal(vmapping[faces], indices):
        raise ValueError("mesh: xatlas reordered the triangles; cannot map its UVs back")
    device = mesh.v_pos.device
    return replace(
        mesh,
        v_tex=torch.from_numpy(uvs.astype(np.float32)).to(device),
        t_tex_idx=torch.from_numpy(faces.astype(np.int32)).to(device),
    )
