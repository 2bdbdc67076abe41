"""``build_scene``: a ``Scene`` from a config mapping (a Hydra ``scene`` group entry).

Each scene name has a schema (:mod:`mptex.scenes.config`); the config is checked against it
before any work (unknown name or key, missing required value, missing file -> ``ValueError``
naming the key).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from mptex._backends import unavailable_message
from mptex.render.camera import orbit_views, random_views
from mptex.render.material import mesh_materials, shade_kd
from mptex.render.mesh import unit_size
from mptex.render.obj import load_obj
from mptex.scenes.assets import SUITE, suite_path
from mptex.scenes.builtin import gt_texture, torus_knot
from mptex.scenes.config import MESH_SCENES, check_scene_config
from mptex.scenes.gbuffer import GBuffer
from mptex.scenes.nerf import load_nerf_split
from mptex.scenes.scene import Scene

__all__ = ["build_scene", "raster_backend_problem", "missing_file_problem"]

# The scene group's check, under the name the tests of the shipped configs call.
_validate = check_scene_config


def _check_extent(mesh, key: str, path: Path) -> None:
    """Refuse a mesh of one repeated point (nothing to see, and ``unit_size`` divides by its
    extent). A flat mesh is a valid scene; training refuses it (a 3D texture needs a volume)."""
    if not float((mesh.aabb[1] - mesh.aabb[0]).max()) > 0:
        raise ValueError(f"scene.{key}: {path}: every vertex is the same point; expected a mesh")


def _camera_splits(cfg: dict, device):
    height, width = cfg["resolution"]
    common = dict(
        radius=cfg["cam_radius"],
        fovy=math.radians(cfg["fovy_deg"]),
        aspect=width / height,
        near=cfg["near"],
        far=cfg["far"],
        device=device,
    )
    generator = torch.Generator().manual_seed(int(cfg["seed"]))
    train = random_views(cfg["n_train_views"], generator=generator, **common)
    val = orbit_views(cfg["n_val_views"], **common)
    return train, val


def _coverage_rgba(rgb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    alpha = mask.unsqueeze(-1).to(rgb.dtype)
    return torch.cat([rgb * alpha, alpha], dim=-1)


def _build_builtin(cfg: dict, device) -> Scene:
    mesh = torus_knot(cfg["tubular_segments"], cfg["radial_segments"])

    def reference(gbuffer: GBuffer) -> torch.Tensor:
        rgb = torch.zeros_like(gbuffer.position)
        rgb[gbuffer.mask] = gt_texture(gbuffer.position[gbuffer.mask])
        return _coverage_rgba(rgb, gbuffer.mask)

    train, val = _camera_splits(cfg, device)
    return Scene(
        "builtin", mesh, cfg["resolution"], train, val, reference, device,
        backend=cfg["raster_backend"], gt_texture=gt_texture,
    )  # fmt: skip


def _textured_reference(mesh, backend: str):
    def reference(gbuffer: GBuffer) -> torch.Tensor:
        # Each pixel takes its triangle's material: its texture at the UV, or its Kd; with the
        # scene's rasterizer backend, as its G-buffers (not whichever "auto" finds installed).
        return _coverage_rgba(shade_kd(mesh, gbuffer.rast, backend), gbuffer.mask)

    return reference


def _load_obj(path: Path, key: str):
    """``load_obj`` with its one-line ``<file>:<line>: <what>`` errors under ``scene.<key>``."""
    try:
        return load_obj(path)
    except ValueError as exc:
        raise ValueError(f"scene.{key}: {exc}") from None


def _build_mesh(cfg: dict, device) -> Scene:
    path = Path(cfg["path"])
    if not path.is_file() and cfg["name"] in SUITE:
        # A suite asset's path as the machine that ran it resolved it (a run's config stores
        # it resolved): this machine's copy of the same asset, said.
        here = Path(suite_path(cfg["name"]))
        warnings.warn(f"scene.path: {path} not found; suite asset {cfg['name']!r} read from "
                      f"{here}", stacklevel=3)  # fmt: skip
        path = here
    if not path.is_file():
        raise ValueError(f"scene.path: file not found: {path}")
    mesh = _load_obj(path, "path")
    if mesh_materials(mesh) is None:
        raise ValueError(f"scene.path: {path} has no material with Kd or map_Kd to render")
    _check_extent(mesh, "path", path)
    if cfg["normalize"]:
        mesh = unit_size(mesh)
    mesh = mesh.to(device)
    train, val = _camera_splits(cfg, device)
    reference = _textured_reference(mesh, cfg["raster_backend"])
    return Scene(
        cfg["name"], mesh, cfg["resolution"], train, val, reference, device,
        backend=cfg["raster_backend"],
    )  # fmt: skip


def _build_nerf(cfg: dict, device) -> Scene:
    root, mesh_path = Path(cfg["path"]), Path(cfg["mesh"])
    problem = missing_file_problem(cfg)
    if problem is not None:
        raise ValueError(problem)
    mesh = _load_obj(mesh_path, "mesh")
    _check_extent(mesh, "mesh", mesh_path)
    train, train_rgba = load_nerf_split(root, cfg["train_split"], cfg["near"], cfg["far"])
    val, val_rgba = load_nerf_split(root, cfg["val_split"], cfg["near"], cfg["far"])
    if train_rgba.shape[1:3] != val_rgba.shape[1:3]:
        raise ValueError("scene.val_split: image size differs from the training split")
    resolution = tuple(train_rgba.shape[1:3])
    return Scene(
        "nerf", mesh, resolution, train, val,
        {"train": train_rgba.to(device), "val": val_rgba.to(device)}, device,
        backend=cfg["raster_backend"],
    )  # fmt: skip


_BUILDERS = {"builtin": _build_builtin, "nerf": _build_nerf,
             **{name: _build_mesh for name in MESH_SCENES}}  # fmt: skip


def build_scene(cfg: Mapping, device: torch.device | str = "cpu") -> Scene:
    """Build a scene from its config (a dict or the Hydra ``scene`` node).

    Args:
        cfg: mapping with ``name`` ("builtin", "mesh" or "nerf") and that scene's keys (see
            :mod:`mptex.scenes.config`; omitted keys take the defaults).
        device: where the mesh, cameras, G-buffers and references live.

    Raises:
        ValueError: naming the key, for an unknown name or key, a missing required value, a
            bad value or a missing file.
    """
    resolved = check_scene_config(cfg)
    device = torch.device(device)
    why = raster_backend_problem(resolved["raster_backend"], device)
    if why is not None:
        raise ValueError(why)
    return _BUILDERS[resolved["name"]](resolved, device)


def missing_file_problem(cfg: Mapping) -> str | None:
    """The first file or folder a checked scene config (:func:`check_scene_config`'s result)
    reads that this machine lacks, in one line naming its key as :func:`build_scene` says it;
    None where all are there. A real-asset scene's path is not judged: its build reads this
    machine's copy of the asset (pybullet_data) where the path is not there."""
    name = cfg["name"]
    if name in MESH_SCENES:
        path = Path(cfg["path"])
        if name not in SUITE and not path.is_file():
            return f"scene.path: file not found: {path}"
    elif name == "nerf":
        root, mesh_path = Path(cfg["path"]), Path(cfg["mesh"])
        if not root.is_dir():
            return f"scene.path: dataset folder not found: {root}"
        if not mesh_path.is_file():
            return f"scene.mesh: file not found: {mesh_path}"
        for key in ("train_split", "val_split"):
            if not (root / f"transforms_{cfg[key]}.json").is_file():
                return f"scene.{key}: {root}/transforms_{cfg[key]}.json not found"
    return None


def raster_backend_problem(backend: str, device: torch.device | str) -> str | None:
    """Why ``scene.raster_backend`` ``backend`` cannot draw a scene on ``device`` here (one
    line naming the key), or None: nvdiffrast needs its package and a CUDA device."""
    if backend != "nvdiffrast":
        return None
    why = unavailable_message("nvdiffrast", "scene.raster_backend")
    device = torch.device(device)
    if why is None and device.type != "cuda":
        why = (f"scene.raster_backend='nvdiffrast' needs the scene on a CUDA device, got "
               f"{device}; scene.raster_backend='torch' runs on any device")  # fmt: skip
    return why
