"""Writing a baked texture as an asset (OBJ + MTL + PNG, GLB) and measuring the bake.

:func:`export_mesh` is the whole export of a trained texture on a mesh, in order: check the
options (:func:`check_export_config`) and that every writer is usable, bake
(:func:`~mptex.bake.bake_texture`), write the texture images, ``mesh.obj`` + ``mesh.mtl`` and
``mesh.glb``, measure (:func:`measure_bake`, on views of its own or a scene's) and write
``export.json``. :func:`export_asset` runs it on the scene a texture was trained on
(``mptex-export``, ``mptex-train`` with ``export.enabled=true``).

With ``measure``, the texture is also decoded in each of ``decode_precisions`` (f32, f16, bf16,
fp8, fp8_rowwise, int8: :mod:`mptex.bake.decode`) on the measured views, and ``export.json``'s
``decode_precision`` holds each one's PSNR against the f32 decode. With ``neural_precision`` the
grid and MLP weights are written in that precision (``texture_neural.safetensors``) with
``neural_decoder.py``, a NumPy decoder for the file (:mod:`mptex.bake.neural_decoder`).

Files (channel layout of the texture, nvdiffrec's split for ``channels=9``):

* ``texture_kd.png``: channels 0:3, albedo, **sRGB** (8-bit; 16-bit PNG with
  ``kd_format="png16"``; ``.exr`` with ``kd_format="exr"``, which holds linear values);
* ``texture_ks.png`` (channels >= 6): channels 3:6, **linear**, nvdiffrec's ks (occlusion,
  roughness, metalness: glTF's metallic-roughness layout), ``map_Ks`` in the MTL;
* ``texture_n.png`` (channels >= 9): channels 6:9, **linear**, mptex's world-space normal offset
  (0.5 = unperturbed; see ``mptex.train.shade``), not a tangent-space normal map, so the MTL does
  not reference it;
* channels beyond 9 are not written (``export.json`` lists them).

8- and 16-bit PNGs (and the GLB's base colour) hold [0, 1]; a texture whose ``min_max`` lets
values outside it (such as nvdiffrec's normal range [-1, 1]) has them written as 0 or 1, never
silently: ``export.json``'s ``value_ranges`` holds, per written file, the values' ``min``,
``max``, how many lay outside [0, 1] (``outside_0_1``) and how many of those were clamped
(``clamped``; 0 in an EXR, which holds the floats), and each file that clamped is named in one
line on stderr with the range.

An export into a folder that holds an earlier one replaces it: the files the earlier
``export.json`` lists that this export does not write are removed (named on stderr and in
``export.json``'s ``removed_earlier_files``). Only those: a file it does not list, or whose name
is not one an export writes, stays, and so does everything when there is no readable
``export.json`` or ``export.pending.json``. The latter lists the earlier exports' files and this
export's while it rewrites them: written before the earlier ``export.json`` is removed, removed
once the new one is written, so that the export after one killed or failed midway still removes
the files it does not write.

Image row 0 is v = 0 (mptex's, nvdiffrast's and glTF's convention: the top of the image);
OBJ's ``vt`` counts v from the bottom, so the OBJ gets ``1 - v`` (``load_obj`` flips it back).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from mptex.bake.bake import (
    BakeResult,
    bake_texture,
    check_bake_memory,
    needs_unwrap,
    sample_in_chunks,
    texel_positions,
)
from mptex.bake.decode import decode_precision_table, export_neural
from mptex.bake.unwrap import check_xatlas_options, has_xatlas
from mptex.export_config import (
    EXPORT_DEFAULTS,
    FORMATS,
    KD_FORMATS,
    ExportConfig,
    check_export_config,
)
from mptex.render.camera import orbit_views, translate
from mptex.render.image import psnr, rgb_to_srgb, save_image
from mptex.render.material import shade_kd
from mptex.render.mesh import Mesh
from mptex.render.obj import _blocks, load_obj
from mptex.scenes import GBuffer, Scene, ViewBatch, render_gbuffer
from mptex.texture import MLPTexture3D
from mptex.train.checkpoint import (
    atomic_write_bytes,
    fsync_directory,
    fsync_file,
    remove_stale_temporaries,
)

__all__ = [
    "ExportConfig",
    "EXPORT_DEFAULTS",
    "FORMATS",
    "KD_FORMATS",
    "check_export_config",
    "preflight_export",
    "write_png16",
    "write_texture_images",
    "value_range",
    "write_obj_asset",
    "write_glb",
    "MEASURE_VIEWS",
    "MEASURE_RESOLUTION",
    "orbit_views_around",
    "measure_bake",
    "export_mesh",
    "export_asset",
]

# The views export_mesh measures the bake on when it has no scene: a mesh scene's validation
# orbit (8 views), at twice the scenes' default resolution (thin features stay visible).
MEASURE_VIEWS = 8
MEASURE_RESOLUTION = 256
# Channel groups written as images: (name, first channel, is colour (sRGB in 8/16-bit files)).
_GROUPS = (("kd", 0, True), ("ks", 3, False), ("n", 6, False))


def _import_trimesh():
    try:
        return importlib.import_module("trimesh")
    except ImportError:
        return None


def preflight_export(
    options: Mapping[str, Any] | None,
    mesh: Mesh,
    channels: int,
    device: torch.device | str,
    directory: str | os.PathLike,
) -> dict[str, Any]:
    """Everything that can stop an export, checked before any work (the bake, or the run).

    Checks the options (:func:`check_export_config`), the writers (trimesh for ``"glb"``, an
    EXR plugin for ``kd_format="exr"``, probed by writing one pixel inside ``directory``: a
    folder made for the probe is removed when it fails), the memory of the resolution
    (:func:`~mptex.bake.check_bake_memory`) and, when the mesh needs new UVs
    (:func:`~mptex.bake.needs_unwrap`), xatlas.

    Returns:
        the checked options (plain dict), with ``unwrap_reason`` (None: the mesh's UVs are kept).

    Raises:
        ValueError: ``"export.<key>: ..."`` or ``"resolution: ..."``, one line.
        RuntimeError: a library the export needs is not installed, one line.
    """
    options = check_export_config(options)
    check_xatlas_options(options["chart_options"], options["pack_options"], "export.")
    if "glb" in options["formats"] and _import_trimesh() is None:
        raise RuntimeError("export.formats: 'glb' needs trimesh, which is not installed "
                           "(pip install trimesh, or export obj only)")  # fmt: skip
    if options["neural_precision"] is not None and importlib.util.find_spec("safetensors") is None:
        raise RuntimeError("export.neural_precision: the neural export needs safetensors, which "
                           "is not installed (pip install safetensors)")  # fmt: skip
    if options["kd_format"] == "exr":
        _probe_exr_writer(Path(directory))
    try:
        check_bake_memory(options["resolution"], channels, device)
    except ValueError as exc:
        raise ValueError(f"export.{exc}") from None
    reason = needs_unwrap(mesh.to(device), options["unwrap"])
    if reason is not None and not has_xatlas():
        raise RuntimeError(
            f"mesh: {reason}; new UVs need xatlas, which is not installed (pip install xatlas)"
        )
    return {**options, "unwrap_reason": reason}


def _probe_exr_writer(directory: Path) -> None:
    """Write a 1-pixel EXR in a temporary folder inside ``directory`` (the disk the export
    writes to); a folder made for the probe alone is removed again when no writer works."""
    created = [p for p in (directory, *directory.parents) if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            save_image(Path(tmp) / "probe.exr", torch.zeros(1, 1, 3))
    except RuntimeError:
        for folder in created:  # deepest first; never a folder that was there before
            try:
                folder.rmdir()
            except OSError:
                break
        # imageio's own message names the probe's temporary file, gone by now
        raise RuntimeError(
            "export.kd_format: 'exr' needs an imageio plugin that writes EXR, and none is "
            "installed (python -c 'import imageio; imageio.plugins.freeimage.download()', or "
            "pip install opencv-python-headless with OPENCV_IO_ENABLE_OPENEXR=1); or use png16"
        ) from None


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def write_png16(path: str | os.PathLike, image: torch.Tensor) -> None:
    """Write a 16-bit RGB PNG (Pillow writes no 16-bit colour PNG, so it is encoded here).

    Args:
        path: destination.
        image: [H, W, 3] float in [0, 1] (clamped), stored as ``round(x * 65535)``, row 0 first.
    """
    data = (image.detach().float().cpu().clamp(0, 1) * 65535 + 0.5).to(torch.int32).numpy()
    height, width, channels = data.shape
    if channels != 3:
        raise ValueError(f"image: expected [H, W, 3], received {list(image.shape)}")
    rows = data.astype(">u2").reshape(height, width * 3)
    # Every scanline starts with filter type 0 (none).
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows.view(np.uint8)], axis=1)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)  # 16-bit, RGB
    Path(path).write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + chunk(b"IEND", b"")
    )  # fmt: skip


def value_range(values: torch.Tensor, clamped: bool) -> dict[str, Any]:
    """What a file holds of ``values`` outside [0, 1], the range of an 8/16-bit image.

    Args:
        values: the linear values written to one file, any shape (sRGB encoding maps [0, 1]
            onto itself and keeps the order, so a value lies outside [0, 1] before it exactly
            when it does after).
        clamped: whether the file's format clamps to [0, 1] (PNG) or holds floats (EXR).

    Returns:
        ``{"min", "max"}`` of the values, ``"outside_0_1"`` (how many lie below 0 or above 1)
        and ``"clamped"`` (how many of those the file holds as 0 or 1: ``outside_0_1`` for a
        PNG, 0 for an EXR).
    """
    values = values.detach().float()
    outside = int(((values < 0) | (values > 1)).sum())
    return {
        "min": float(values.min()),
        "max": float(values.max()),
        "outside_0_1": outside,
        "clamped": outside if clamped else 0,
    }


def _warn_clamped(file_name: str, record: Mapping[str, Any], instead: str = "") -> None:
    """One line on stderr for a file that holds some of its values as 0 or 1."""
    if record["clamped"]:
        print(
            f"mptex export: warning: {file_name}: {record['clamped']} values outside [0, 1] "
            f"written as 0 or 1 (the texture's range here is [{record['min']:.6g}, "
            f"{record['max']:.6g}]; export.json's value_ranges records it{instead})",
            file=sys.stderr,
        )


def write_texture_images(
    directory: str | os.PathLike,
    texture: torch.Tensor,
    kd_format: str = "png8",
    value_ranges: dict[str, dict[str, Any]] | None = None,
) -> dict[str, str]:
    """Write the channel groups of a baked texture (layout in the module docstring).

    8- and 16-bit PNGs hold [0, 1]: a value outside it is written as 0 or 1, never silently:
    each such file is named in one line on stderr with the texture's range, and recorded in
    ``value_ranges``. EXR holds the floats as they are.

    Args:
        directory: output folder.
        texture: [N, N, C] float32, row 0 = v = 0.
        kd_format: ``"png8"``, ``"png16"`` or ``"exr"`` (every group gets that format).
        value_ranges: when given, filled with ``{file name: value_range(...)}`` for every file
            written (:func:`value_range`).

    Returns:
        ``{"kd": "texture_kd.png", ...}``, the files written (names relative to ``directory``).
    """
    directory = Path(directory)
    suffix = KD_FORMATS[kd_format]
    written = {}
    for name, first, colour in _GROUPS:
        if texture.shape[-1] < first + 3:
            break
        values = texture[..., first : first + 3].cpu()
        file_name = f"texture_{name}{suffix}"
        record = value_range(values, clamped=kd_format != "exr")
        _warn_clamped(file_name, record, "; kd_format exr keeps them")
        if value_ranges is not None:
            value_ranges[file_name] = record
        if kd_format == "exr":
            save_image(directory / file_name, values)  # float files hold linear values
        elif kd_format == "png16":
            write_png16(directory / file_name, rgb_to_srgb(values) if colour else values)
        else:
            save_image(directory / file_name, values, to_srgb=colour)
        written[name] = file_name
    return written


# ---------------------------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------------------------


def _write_rows(out: TextIO, line: str, values: np.ndarray) -> None:
    """``line % tuple(row)`` for every row, formatted and written a block of rows at a time (as
    ``write_obj`` writes them): a 1M-face mesh's text (~95 MB) and the Python lists of its
    numbers are never held whole."""
    for rows in _blocks(values):
        out.write("".join(line % tuple(row) for row in rows))


def _write_vertices(out: TextIO, prefix: str, values: np.ndarray) -> None:
    # 9 significant digits reproduce a float32 exactly.
    _write_rows(out, f"{prefix} {' '.join(['%.9g'] * values.shape[1])}\n", values)


def write_obj_asset(
    directory: str | os.PathLike, mesh: Mesh, images: Mapping[str, str]
) -> dict[str, str]:
    """Write ``mesh.obj`` and ``mesh.mtl`` (one material, ``map_Kd`` and ``map_Ks``).

    Args:
        directory: output folder (the images are already there).
        mesh: positions, normals and the baked UVs (``v_tex``: v = 0 is image row 0; written
            as ``vt u 1-v``).
        images: the written image names (:func:`write_texture_images`).

    Returns:
        ``{"obj": "mesh.obj", "mtl": "mesh.mtl"}``.
    """
    directory = Path(directory)
    mtl = ["# mptex baked texture", "newmtl baked", "Ka 0 0 0", "Kd 1 1 1", "Ks 0 0 0",
           f"map_Kd {images['kd']}"]  # fmt: skip
    if "ks" in images:
        mtl.append(f"map_Ks {images['ks']}")
    (directory / "mesh.mtl").write_text("\n".join(mtl) + "\n")
    uv = mesh.v_tex.detach().cpu().double().numpy()
    uv = np.stack([uv[:, 0], 1.0 - uv[:, 1]], axis=1)
    corners = [mesh.t_pos_idx, mesh.t_tex_idx]
    has_normals = mesh.v_nrm is not None and mesh.t_nrm_idx is not None
    if has_normals:
        corners.append(mesh.t_nrm_idx)
    index = torch.stack([c.long().cpu() for c in corners], dim=-1).numpy() + 1  # [T, 3, k]
    corner = "/".join(["%d"] * index.shape[-1])
    with (directory / "mesh.obj").open("w") as out:
        out.write("# mptex baked texture\nmtllib mesh.mtl\n")
        _write_vertices(out, "v", mesh.v_pos.detach().cpu().double().numpy())
        _write_vertices(out, "vt", uv)
        if has_normals:
            _write_vertices(out, "vn", mesh.v_nrm.detach().cpu().double().numpy())
        out.write("usemtl baked\n")
        _write_rows(out, f"f {corner} {corner} {corner}\n", index.reshape(index.shape[0], -1))
    return {"obj": "mesh.obj", "mtl": "mesh.mtl"}


def _split_at_seams(mesh: Mesh) -> tuple[torch.Tensor, ...]:
    """One vertex per distinct (position, UV, normal) corner, as glTF needs.

    Returns:
        (positions [V', 3], uvs [V', 2], normals [V', 3] or None, faces [T, 3] int64).
    """
    corners = [mesh.t_pos_idx, mesh.t_tex_idx]
    has_normals = mesh.v_nrm is not None and mesh.t_nrm_idx is not None
    if has_normals:
        corners.append(mesh.t_nrm_idx)
    keys = torch.stack([c.long().cpu() for c in corners], dim=-1).reshape(-1, len(corners))
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    positions = mesh.v_pos.detach().cpu()[unique[:, 0]]
    uvs = mesh.v_tex.detach().cpu()[unique[:, 1]]
    normals = mesh.v_nrm.detach().cpu()[unique[:, 2]] if has_normals else None
    return positions, uvs, normals, inverse.reshape(-1, 3)


def write_glb(path: str | os.PathLike, mesh: Mesh, kd: torch.Tensor) -> dict[str, int]:
    """Write a binary glTF with the baked albedo as its sRGB base-colour texture (trimesh).

    Vertices are split where a position has several UVs or normals (glTF indexes one
    attribute set per vertex). The base colour is stored as an 8-bit sRGB PNG inside the file,
    as glTF requires (``baseColorTexture`` is sRGB-encoded); metallic 0, roughness 1.

    Args:
        path: the ``.glb`` file.
        mesh: mesh with the baked UVs.
        kd: [N, N, 3] float32 linear albedo in [0, 1], row 0 = v = 0.

    Returns:
        ``{"vertices": V', "faces": T}`` of the written mesh.
    """
    trimesh = _import_trimesh()
    if trimesh is None:
        raise RuntimeError("export.formats: 'glb' needs trimesh (pip install trimesh)")
    from PIL import Image

    positions, uvs, normals, faces = _split_at_seams(mesh)
    srgb = (rgb_to_srgb(kd.detach().float().cpu()).clamp(0, 1) * 255 + 0.5).to(torch.uint8)
    material = trimesh.visual.material.PBRMaterial(
        baseColorTexture=Image.fromarray(srgb.numpy()), metallicFactor=0.0, roughnessFactor=1.0
    )
    # trimesh keeps UVs with v up (OBJ's convention) and flips them into glTF's v down on export.
    uv_up = torch.stack([uvs[:, 0], 1 - uvs[:, 1]], dim=-1).numpy()
    visual = trimesh.visual.TextureVisuals(uv=uv_up, material=material)
    tm = trimesh.Trimesh(
        vertices=positions.numpy(), faces=faces.numpy(),
        vertex_normals=None if normals is None else normals.numpy(), visual=visual, process=False,
    )  # fmt: skip
    Path(path).write_bytes(tm.export(file_type="glb"))
    return {"vertices": int(positions.shape[0]), "faces": int(faces.shape[0])}


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def _over(rgba: torch.Tensor, background: float) -> torch.Tensor:
    """[B, H, W, 4] over a constant background -> [B, H, W, 3] (nvdiffrec's composite)."""
    return background + (rgba[..., :3] - background) * rgba[..., 3:4]


def orbit_views_around(
    mesh: Mesh,
    n_views: int = MEASURE_VIEWS,
    resolution: int = MEASURE_RESOLUTION,
    backend: str = "auto",
) -> tuple[GBuffer, torch.Tensor]:
    """Views of a mesh alone: the scenes' validation orbit around its bounding box.

    The cameras are :func:`~mptex.render.orbit_views` (radius 3, fov 45 degrees, elevation -0.4
    rad, as a mesh scene's validation views) in the frame where the mesh's AABB is centred and
    its longest side is 2 (:func:`~mptex.render.unit_size`); the G-buffer positions stay in the
    mesh's own frame, the texture's.

    Args:
        mesh: the mesh, on the device the views are rendered on.
        n_views, resolution: ``n_views`` square views of ``resolution`` pixels.
        backend: rasterizer backend.

    Returns:
        ``(gbuffer, mvp)``: the views' G-buffer and ``[n_views, 4, 4]`` world-to-clip matrices.
    """
    lo, hi = mesh.aabb
    scale = 2.0 / float((hi - lo).max())
    centre = ((lo + hi) / 2).tolist()
    device = mesh.v_pos.device
    to_unit = torch.diag(torch.tensor([scale, scale, scale, 1.0], device=device))
    to_unit = to_unit @ translate(-centre[0], -centre[1], -centre[2], device=device)
    cameras = orbit_views(n_views, device=device)
    mvp = cameras.mvp @ to_unit
    return render_gbuffer(mesh, mvp, (resolution, resolution), backend), mvp


@torch.no_grad()
def measure_bake(
    texture: MLPTexture3D,
    obj_path: str | os.PathLike,
    gbuffer: GBuffer,
    mvp: torch.Tensor,
    reference: torch.Tensor | None = None,
    background: str = "white",
    chunk_size: int = 1 << 18,
    backend: str = "auto",
) -> dict[str, Any]:
    """Render views with the exported OBJ and with the neural texture; compare.

    The OBJ is re-read from disk (:func:`~mptex.render.load_obj`) and rendered as the mesh scene
    renders its reference (UVs interpolated, ``map_Kd`` decoded from sRGB, bilinear wrap
    lookups: :func:`~mptex.render.material.shade_kd`), so it shows exactly what the files
    hold. Both sides show the albedo (texture channels 0:3, unshaded) over the background;
    PSNR is nvdiffrec's (sRGB, clamp, per image, mean over the views).

    Args:
        texture: the neural texture.
        obj_path: the exported ``mesh.obj``.
        gbuffer: the views of the mesh the texture was baked from (a scene's
            ``val_views().gbuffer``, or :func:`orbit_views_around`), ``[B, H, W, ...]``.
        mvp: ``[B, 4, 4]`` world-to-clip matrices of those views.
        reference: ``[B, H, W, 4]`` reference RGBA of the views (a scene's ``val_views().rgba``),
            or None when there is none.
        background: ``"white"`` or ``"black"``.
        chunk_size: points per ``texture.sample`` call.
        backend: rasterizer backend for the OBJ's views.

    Returns:
        ``psnr_baked_vs_neural`` (dB, mean over views), ``psnr_baked_vs_neural_per_image``,
        with a reference ``psnr_baked_vs_reference`` and ``psnr_neural_vs_reference``;
        ``world_units_per_pixel`` (median distance between the surface points of neighbouring
        pixels), ``n_views``, ``background``.
    """
    level = 1.0 if background == "white" else 0.0
    baked_mesh = load_obj(obj_path).to(mvp.device)
    baked_views = render_gbuffer(baked_mesh, mvp, tuple(gbuffer.mask.shape[1:3]), backend)
    alpha = baked_views.mask.unsqueeze(-1).float()
    baked_rgb = shade_kd(baked_mesh, baked_views.rast, backend)
    baked = _over(torch.cat([baked_rgb * alpha, alpha], -1), level)
    kd = sample_in_chunks(texture, gbuffer.position[gbuffer.mask], chunk_size)[..., :3]
    neural_rgb = torch.zeros_like(gbuffer.position).index_put((gbuffer.mask,), kd)
    neural = _over(torch.cat([neural_rgb, gbuffer.mask.unsqueeze(-1).float()], -1), level)
    per_image = psnr(baked, neural)
    step = (gbuffer.position[:, :, 1:] - gbuffer.position[:, :, :-1]).norm(dim=-1)
    both = gbuffer.mask[:, :, 1:] & gbuffer.mask[:, :, :-1]
    measured: dict[str, Any] = dict(
        psnr_baked_vs_neural=float(per_image.mean()),
        psnr_baked_vs_neural_per_image=[float(v) for v in per_image.cpu()],
    )
    if reference is not None:
        reference = _over(reference, level)
        measured["psnr_baked_vs_reference"] = float(psnr(baked, reference).mean())
        measured["psnr_neural_vs_reference"] = float(psnr(neural, reference).mean())
    return dict(
        **measured,
        world_units_per_pixel=float(step[both].median()) if bool(both.any()) else None,
        n_views=int(gbuffer.mask.shape[0]),
        background=background,
    )


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def export_mesh(
    texture: MLPTexture3D,
    mesh: Mesh,
    out_dir: str | os.PathLike,
    *,
    resolution: int = EXPORT_DEFAULTS["resolution"],
    formats: str | Sequence[str] = tuple(EXPORT_DEFAULTS["formats"]),
    padding: int = EXPORT_DEFAULTS["padding"],
    unwrap: str = EXPORT_DEFAULTS["unwrap"],
    kd_format: str = EXPORT_DEFAULTS["kd_format"],
    chunk_size: int = EXPORT_DEFAULTS["chunk_size"],
    measure: bool = EXPORT_DEFAULTS["measure"],
    chart_options: Mapping[str, Any] | None = None,
    pack_options: Mapping[str, Any] | None = None,
    decode_precisions: str | Sequence[str] = tuple(EXPORT_DEFAULTS["decode_precisions"]),
    neural_precision: str | None = EXPORT_DEFAULTS["neural_precision"],
    views: ViewBatch | None = None,
    background: str = "white",
    backend: str = "auto",
    source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Bake ``texture`` on ``mesh``, write the asset files and ``export.json``: the export of
    ``mptex-export``, from a texture and a mesh alone.

    Order: :func:`preflight_export` (options, writers, memory, xatlas when needed), bake
    (:func:`~mptex.bake.bake_texture`), images, OBJ/MTL, GLB, measurement
    (:func:`measure_bake`), ``export.json``. The mesh is written in its own frame, the frame
    of the texture's AABB. Files and orientation: the module docstring.

    Args:
        texture: the trained neural texture (its AABB in ``mesh``'s frame).
        mesh: the mesh to texture (UVs kept when usable, else xatlas's).
        out_dir: output folder (created); the files of an earlier export there that this one
            does not write are removed (module docstring).
        resolution: texels per side; this and ``formats``, ``padding``, ``unwrap``,
            ``kd_format``, ``chunk_size``, ``measure``, ``chart_options``, ``pack_options``,
            ``decode_precisions``, ``neural_precision`` are the ``export`` config group's keys
            (:data:`EXPORT_DEFAULTS`, ``configs/export/default.yaml``).
        views: the measurement's views: a scene's ``val_views()`` (its reference images add
            ``psnr_baked_vs_reference``); None: :data:`MEASURE_VIEWS` orbit views of
            :data:`MEASURE_RESOLUTION` squared pixels made here (:func:`orbit_views_around`).
        background: the measurement's background, ``"white"`` or ``"black"``.
        backend: rasterizer backend of the bake and the measurement (``"auto"``, ``"torch"``,
            ``"nvdiffrast"``).
        source: where the texture's weights came from, written as ``export.json``'s
            ``source`` (a run's: :func:`mptex.train.checkpoint.export_source`); None (null)
            for a texture that is not a run's.

    Returns:
        the ``export.json`` contents: ``source``, ``files``, ``resolution``, ``channels``,
        ``layout``, ``uv_source``, ``unwrap_reason``, ``value_ranges`` (per written image and
        the GLB: the values outside [0, 1] and how many were clamped), the bake's ``stats``
        (``coverage``, ``texels_per_unit``, times, ...), ``texels_per_pixel``,
        ``measured_on`` and the measurement's PSNRs (or ``measure_skipped``), ``glb`` vertex
        and face counts, ``decode_precision`` (with ``measure`` and ``decode_precisions``:
        :func:`~mptex.bake.decode.decode_precision_table`) and ``neural`` (with
        ``neural_precision``: the file, its precision and size).

    Raises:
        ValueError: ``"export.<key>: ..."`` / ``"resolution: ..."`` (one line) before any work.
        RuntimeError: a writer or xatlas is needed but not installed (one line).
    """
    if not isinstance(texture, MLPTexture3D):
        raise ValueError(f"texture: expected an MLPTexture3D, got {type(texture).__name__}")
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh: expected an mptex Mesh (mptex.render.load_obj), got {type(mesh).__name__}"
        )
    if background not in ("white", "black"):
        raise ValueError(f"background: expected 'white' or 'black', got {background!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {out} exists and is not a folder")
    options = dict(
        resolution=resolution, formats=formats, padding=padding, unwrap=unwrap,
        kd_format=kd_format, chunk_size=chunk_size, measure=measure,
        chart_options=chart_options or {}, pack_options=pack_options or {},
        decode_precisions=decode_precisions, neural_precision=neural_precision,
    )  # fmt: skip
    checked = preflight_export(options, mesh, texture.channels, texture.AABB.device, out)
    options = {k: v for k, v in checked.items() if k in EXPORT_DEFAULTS and k != "enabled"}
    mesh = mesh.to(texture.AABB.device)
    earlier = _earlier_files(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: BakeResult = bake_texture(
        texture, mesh, options["resolution"], padding=options["padding"],
        unwrap=options["unwrap"], chart_options=options["chart_options"],
        pack_options=options["pack_options"], chunk_size=options["chunk_size"], backend=backend,
    )  # fmt: skip
    tick = time.perf_counter()
    # export.json, written last, says what the files beside it are: the earlier one goes before
    # the first of them is rewritten, so that a kill in between leaves none (and the
    # temporaries of an export.json or export.pending.json write that a kill cut short go too).
    # export.pending.json, written first, lists the earlier exports' files and this one's until
    # export.json is there: the next export after a kill still removes those it does not write.
    remove_stale_temporaries(out, names=(_EXPORT_JSON, _EXPORT_PENDING))
    pending = {"files": sorted(set(earlier) | _files_to_write(options, result.texture.shape[-1])),
               "about": _PENDING_ABOUT}  # fmt: skip
    pending_text = json.dumps(pending, indent=2) + "\n"
    atomic_write_bytes(out / _EXPORT_PENDING, lambda f: f.write(pending_text.encode()))
    (out / _EXPORT_JSON).unlink(missing_ok=True)
    value_ranges: dict[str, dict[str, Any]] = {}
    files = write_texture_images(out, result.texture, options["kd_format"], value_ranges)
    images = dict(files)
    glb = None
    if _writes_obj(options):
        files.update(write_obj_asset(out, result.mesh, images))
    if "glb" in options["formats"]:
        glb = write_glb(out / "mesh.glb", result.mesh, result.texture[..., :3])
        files["glb"] = "mesh.glb"
        # its base colour is an 8-bit sRGB PNG of channels 0:3, whatever kd_format is
        value_ranges["mesh.glb"] = value_range(result.texture[..., :3], clamped=True)
        _warn_clamped("mesh.glb", value_ranges["mesh.glb"])
    write_time = time.perf_counter() - tick
    channels = result.texture.shape[-1]
    summary: dict[str, Any] = dict(
        source=dict(source) if source is not None else None,
        files=files,
        channels=channels,
        layout={name: [first, first + 3] for name, first, _ in _GROUPS if name in images},
        channels_not_written=list(range(3 * len(images), channels)),
        kd_encoding="linear float (EXR)" if options["kd_format"] == "exr" else "sRGB",
        value_ranges=value_ranges,
        uv_source=result.uv_source,
        unwrap_reason=result.unwrap_reason,
        xatlas_available=has_xatlas(),
        **result.stats,
        write_time_s=write_time,
        glb=glb,
        options=options,
    )
    if options["measure"]:
        tick = time.perf_counter()
        if views is None:
            gbuffer, mvp = orbit_views_around(mesh, backend=backend)
            reference, summary["measured_on"] = None, (
                f"{MEASURE_VIEWS} orbit views of {MEASURE_RESOLUTION}x{MEASURE_RESOLUTION} "
                "around the mesh")  # fmt: skip
        else:
            gbuffer, mvp, reference = views.gbuffer, views.mvp, views.rgba
            summary["measured_on"] = f"the scene's {len(views)} validation views"
        measured = measure_bake(texture, out / "mesh.obj", gbuffer, mvp, reference, background,
                                options["chunk_size"], backend)  # fmt: skip
        summary.update(measured)
        if measured["world_units_per_pixel"] and summary["texels_per_unit"]:
            summary["texels_per_pixel"] = (
                summary["texels_per_unit"] * measured["world_units_per_pixel"]
            )
        if options["decode_precisions"]:
            summary["decode_precision"] = decode_precision_table(
                texture, gbuffer.position, gbuffer.mask, background,
                options["decode_precisions"], reference,
            )  # fmt: skip
            summary["decode_precision"]["views"] = summary["measured_on"]
        summary["measure_time_s"] = time.perf_counter() - tick
    else:
        summary["measure_skipped"] = "export.measure=false"
    if options["neural_precision"] is not None:
        summary["neural"] = _write_neural(texture, result, options, out, backend)
        summary["files"].update(
            neural=summary["neural"]["file"], neural_decoder="neural_decoder.py"
        )
    removed = _remove_earlier_files(out, earlier, set(summary["files"].values()))
    if removed:
        summary["removed_earlier_files"] = removed
        print(f"mptex export: removed {', '.join(removed)}: written by the earlier export in "
              f"{out}, not by this one", file=sys.stderr)  # fmt: skip
    # The files export.json names reach the disk before it does (and the removals too): after
    # a power loss it never sits beside an empty or truncated file of its list.
    for name in sorted(set(summary["files"].values())):
        fsync_file(out / name)
    fsync_directory(out)
    fsync_directory(out.parent)
    summary["export_time_s"] = time.perf_counter() - start
    text = json.dumps(_json_safe(summary), indent=2, allow_nan=False) + "\n"
    atomic_write_bytes(out / _EXPORT_JSON, lambda f: f.write(text.encode()))
    (out / _EXPORT_PENDING).unlink(missing_ok=True)
    return summary


# What an export writes last: what it did, which files (export_mesh's return value).
_EXPORT_JSON = "export.json"
# Every file name an export writes (besides export.json).
_EXPORT_FILES = frozenset(
    ["mesh.obj", "mesh.mtl", "mesh.glb", "texture_neural.safetensors", "neural_decoder.py"]
    + [f"texture_{name}{suffix}" for name, _, _ in _GROUPS for suffix in (".png", ".exr")]
)


# What an export writes first and removes last: the files of the earlier exports and its own.
_EXPORT_PENDING = "export.pending.json"
_PENDING_ABOUT = (
    "an export in progress, or one killed or failed midway: no export.json describes the files "
    "here; the next export removes those of these files it does not write"
)


def _writes_obj(options: Mapping[str, Any]) -> bool:
    # The measurement re-reads the OBJ: it is written whenever the bake is measured.
    return "obj" in options["formats"] or options["measure"]


def _files_to_write(options: Mapping[str, Any], channels: int) -> set[str]:
    """The names of the files an export with ``options`` writes for a texture of ``channels``
    (``export.json``'s ``files``)."""
    suffix = KD_FORMATS[options["kd_format"]]
    names = {f"texture_{name}{suffix}" for name, first, _ in _GROUPS if channels >= first + 3}
    if _writes_obj(options):
        names |= {"mesh.obj", "mesh.mtl"}
    if "glb" in options["formats"]:
        names.add("mesh.glb")
    if options["neural_precision"] is not None:
        names |= {"texture_neural.safetensors", "neural_decoder.py"}
    return names


def _listed_files(record: Path) -> set[str]:
    """The names ``record`` (an ``export.json`` or ``export.pending.json``) lists under
    ``files``: only names an export writes, in its folder itself (none when it is missing or
    unreadable)."""
    try:
        content = json.loads(record.read_text())
    except (OSError, ValueError):
        return set()
    files = content.get("files") if isinstance(content, dict) else None
    if isinstance(files, dict):
        files = list(files.values())
    if not isinstance(files, list):
        return set()
    return {name for name in files if isinstance(name, str) and name in _EXPORT_FILES}


def _earlier_files(out: Path) -> list[str]:
    """The files earlier exports in ``out`` wrote: those its ``export.json`` lists, and those
    an ``export.pending.json`` lists (an export killed or failed midway, and the exports
    before it)."""
    return sorted(_listed_files(out / _EXPORT_JSON) | _listed_files(out / _EXPORT_PENDING))


def _remove_earlier_files(out: Path, earlier: Sequence[str], written: set[str]) -> list[str]:
    """Remove the files of ``earlier`` that this export did not write; returns their names."""
    removed = []
    for name in earlier:
        path = out / name
        if name not in written and (path.is_file() or path.is_symlink()):
            path.unlink()
            removed.append(name)
    return removed


def _write_neural(texture, result: BakeResult, options, out: Path, backend: str) -> dict[str, Any]:
    """The neural export and its NumPy decoder (a copy of mptex.bake.neural_decoder)."""
    import mptex.bake.neural_decoder as decoder

    calibration = None
    if options["neural_precision"] == "fp8":
        # The activation scales come from the points the bake evaluated: the surface.
        _, calibration, _ = texel_positions(result.mesh, options["resolution"], backend)
    neural = export_neural(
        texture, out / "texture_neural.safetensors", options["neural_precision"], calibration
    )
    (out / "neural_decoder.py").write_text(Path(decoder.__file__).read_text())
    neural["decoder"] = "neural_decoder.py"
    if calibration is not None:
        neural["calibrated_on"] = f"{calibration.shape[0]} texel positions of the bake"
    return neural


def export_asset(
    texture: MLPTexture3D,
    scene: Scene,
    out_dir: str | os.PathLike,
    options: Mapping[str, Any] | None = None,
    background: str = "white",
    source: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`export_mesh` of a texture on the scene it was trained on (``mptex-export``, and
    ``mptex-train`` with ``export.enabled=true``).

    The scene gives the mesh (in its world frame: a mesh scene's ``normalize`` applied, the
    frame of the texture and of the cameras), the rasterizer backend, and the measurement's
    views: its validation views, whose references add ``psnr_baked_vs_reference`` and
    ``psnr_neural_vs_reference``.

    Args:
        texture: the trained neural texture.
        scene: the scene it was trained on.
        out_dir: output folder (created).
        options: the ``export`` group (:data:`EXPORT_DEFAULTS`; ``enabled`` is ignored here).
        background: the measurement's background (the run's ``train.val_background``).
        source: ``export.json``'s ``source`` (:func:`mptex.train.checkpoint.export_source`).

    Returns and Raises: as :func:`export_mesh`.
    """
    options = check_export_config(options)
    options.pop("enabled")
    views = scene.val_views() if options["measure"] else None
    return export_mesh(texture, scene.mesh, out_dir, **options, views=views,
                       background=background, backend=scene.gbuffers.backend,
                       source=source)  # fmt: skip


class TrainingExport:
    """The exporter ``mptex-train`` hands the training loop for ``export.enabled=true``
    (:class:`mptex.train.exporter.Exporter`): :func:`preflight_export` before the first
    iteration, :func:`export_asset` on the run's scene after the final validation."""

    def preflight(
        self, settings: Mapping[str, Any], mesh: Mesh, channels: int, device: torch.device,
        run_dir: str | os.PathLike,
    ) -> None:  # fmt: skip
        preflight_export(settings, mesh, channels, device, run_dir)

    def export(
        self, texture: MLPTexture3D, scene: Scene, out_dir: str | os.PathLike,
        settings: Mapping[str, Any], background: str, source: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return export_asset(texture, scene, out_dir, settings, background, source)
