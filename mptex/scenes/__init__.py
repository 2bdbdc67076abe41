"""Scenes for texture fitting: built-in procedural, textured OBJ, NeRF-synthetic.

Use ``build_scene(cfg, device)`` and the returned ``Scene``'s ``sample_train_batch``,
``train_views`` and ``val_views``; every view's G-buffer is rasterized once and cached.
"""

from mptex.scenes.assets import SUITE, same_suite_asset, suite_available, suite_path
from mptex.scenes.build import build_scene
from mptex.scenes.builtin import gt_texture, torus_knot
from mptex.scenes.config import MESH_SCENES, SCENE_DEFAULTS
from mptex.scenes.gbuffer import GBuffer, GBufferCache, render_gbuffer
from mptex.scenes.nerf import load_nerf_split
from mptex.scenes.scene import Scene, TrainingBatch, ViewBatch

__all__ = [
    "build_scene",
    "SCENE_DEFAULTS",
    "MESH_SCENES",
    "SUITE",
    "suite_available",
    "suite_path",
    "same_suite_asset",
    "Scene",
    "ViewBatch",
    "TrainingBatch",
    "GBuffer",
    "GBufferCache",
    "render_gbuffer",
    "torus_knot",
    "gt_texture",
    "load_nerf_split",
]
