"""The ``scene`` config group: one schema per scene name (``configs/scene/*.yaml`` mirror them).

``scene.name`` picks the schema (:data:`SCENE_SCHEMAS`); the other keys are checked against it
before any work by :func:`check_scene_config` (unknown key, a required value left unset, a bad
value: one line naming ``scene.<key>``). Whether a file exists is checked when the scene is
built (:func:`mptex.scenes.build_scene`), and by a sweep run on this machine before its first
job (:func:`mptex.scenes.build.missing_file_problem`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mptex.config_schema import (
    REQUIRED,
    SEED,
    AnyOf,
    ConfigError,
    FilePath,
    Integer,
    ListOf,
    Number,
    OneOf,
    OrNull,
    Text,
    check_group,
    defaults_of,
    plain,
    setting,
)
from mptex.scenes.assets import SUITE, is_suite_file, suite_path

# The scene schemas are reached through SCENE_SCHEMAS and documented by name; they stay out of
# __all__, mptex's public API, whose path parameters take str | os.PathLike: scene.path is a
# YAML string (OmegaConf's structured configs allow no such union).
__all__ = [
    "SCENE_SCHEMAS",
    "SCENE_DEFAULTS",
    "MESH_SCENES",
    "check_scene_config",
]

_POSITIVE = Number(min=0, min_open=True)
_SPLIT = Text(non_empty=True, what="a split name")


def _far_beyond_near(s: Mapping[str, Any]) -> str | None:
    return None if s["far"] > s["near"] else f"more than scene.near ({s['near']!r})"


@dataclass
class _Rasterized:
    """What every scene has: its name, the clip planes and the rasterizer."""

    name: str = REQUIRED
    near: float = setting(0.1, _POSITIVE)
    """Near clip plane (nvdiffrec's)."""
    far: float = setting(1000.0, _POSITIVE, rule=_far_beyond_near)
    """Far clip plane."""
    raster_backend: str = setting("auto", OneOf(("auto", "torch", "nvdiffrast")))
    """``auto``: nvdiffrast on CUDA when importable, else the torch rasterizer."""


@dataclass
class _OrbitCameras(_Rasterized):
    """Scenes rendered from a mesh with nvdiffrec's DatasetMesh cameras."""

    resolution: Any = setting(
        128,
        AnyOf(Integer(min=1), ListOf(Integer(min=1), length=2), what="a positive int or [H, W]"),
    )
    """View size in pixels: an int (square) or ``[H, W]``."""
    n_train_views: int = setting(64, Integer(min=1))
    """A fixed pool of random training views (G-buffers cached)."""
    n_val_views: int = setting(8, Integer(min=1))
    """Validation views on an orbit."""
    cam_radius: float = setting(3.0, _POSITIVE)
    """Camera distance from the origin (nvdiffrec's DatasetMesh: 3)."""
    fovy_deg: float = setting(45.0, Number(0, 180, min_open=True, max_open=True, note="degrees"))
    """Vertical field of view."""
    seed: int = setting(0, SEED)
    """Seeds the training cameras."""


@dataclass
class BuiltinScene(_OrbitCameras):
    """The built-in procedural scene: a torus knot with a multi-frequency 3D albedo."""

    name: str = "builtin"
    path: str | None = setting(None, OrNull(FilePath(), "unused"))
    """Unused (no file); accepted so that one sweep can set the file-based scenes' path
    (``scene=builtin,mesh scene.path=spot.obj``)."""
    tubular_segments: int = setting(200, Integer(min=3))
    """Knot mesh: 2 * 200 * 24 = 9600 triangles by default."""
    radial_segments: int = setting(24, Integer(min=3))


@dataclass
class MeshScene(_OrbitCameras):
    """A textured Wavefront OBJ (+ MTL with map_Kd or Kd); the real-asset suite's scenes are
    mesh scenes under their own names."""

    name: str = "mesh"
    path: str = setting(REQUIRED, FilePath(what="a file path"))
    """The .obj file."""
    normalize: bool = True
    """Centre and scale the mesh into [-1, 1]^3."""


@dataclass
class NerfScene(_Rasterized):
    """A NeRF-synthetic dataset (``transforms_<split>.json`` + RGBA images) with a fixed mesh
    in the same world frame; cameras as nvdiffrec's ``dataset_nerf.py``."""

    name: str = "nerf"
    path: str = setting(REQUIRED, FilePath(what="a dataset folder"))
    """The dataset folder."""
    mesh: str = setting(REQUIRED, FilePath(what="a file path"))
    """The .obj file."""
    train_split: str = setting("train", _SPLIT)
    val_split: str = setting("test", _SPLIT)


# Scenes built from one OBJ file at ``scene.path``: the mesh scene and the real-asset suite's
# (mptex.scenes.assets), under their own names so that a sweep's report gives each its section.
MESH_SCENES = ("mesh", *SUITE)
SCENE_SCHEMAS: dict[str, type] = {
    "builtin": BuiltinScene,
    **{name: MeshScene for name in MESH_SCENES},
    "nerf": NerfScene,
}
SCENE_DEFAULTS = {
    name: {**defaults_of(schema), "name": name} for name, schema in SCENE_SCHEMAS.items()
}


def check_scene_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``scene`` group checked against its name's schema, defaults filled in.

    Returns:
        a plain dict with every key of the schema; ``resolution`` as ``(H, W)``.

    Raises:
        ConfigError: (a ``ValueError``) ``"scene.<key>: ..."``, one line: an unknown name or
            key, a required value left unset, a bad value.
    """
    cfg = dict(plain(cfg))
    name = cfg.get("name")
    if not isinstance(name, str) or name not in SCENE_SCHEMAS:
        raise ConfigError(f"scene.name: expected one of {sorted(SCENE_SCHEMAS)}, got {name!r}")
    if name in SUITE and cfg.get("path") is None:
        # From Python ({"name": "duck"}): the suite's file, as configs/scene/<asset>.yaml says
        try:
            cfg["path"] = suite_path(name)
        except ValueError as exc:
            raise ConfigError(f"scene.path: {exc}") from None
    checked = check_group(SCENE_SCHEMAS[name], cfg, "scene", context=f" for scene {name!r}")
    path = checked.get("path")
    if name in SUITE and isinstance(path, str) and not is_suite_file(name, path):
        # Runs, reports and searches name the scene: another mesh under an asset's name would
        # be reported as that asset.
        raise ConfigError(
            f"scene.path: scene {name!r} is the real-asset suite's {SUITE[name].file} in "
            f"pybullet_data, got {path!r}; another mesh is scene=mesh scene.path=<file>"
        )
    if "resolution" in checked:
        size = checked["resolution"]
        checked["resolution"] = (size, size) if isinstance(size, int) else tuple(size)
    return checked
