"""Rendering: rasterization, interpolation, cameras, texture sampling, meshes, OBJ files and image
I/O.

``import mptex.render`` imports no native backend; nvdiffrast loads on first use.
"""

from mptex.render.camera import (
    Cameras,
    cameras_from_mv,
    fovx_to_fovy,
    look_at,
    orbit_views,
    perspective,
    random_rotation_translation,
    random_views,
    rotate_x,
    rotate_y,
    translate,
)
from mptex.render.image import load_image, psnr, rgb_to_srgb, save_image, srgb_to_rgb
from mptex.render.mesh import Material, Mesh, unit_size, vertex_normals
from mptex.render.obj import UndefinedMaterialWarning, load_obj, write_obj
from mptex.render.rasterize import interpolate, rasterize
from mptex.render.texture import texture

__all__ = [
    "rasterize",
    "interpolate",
    "texture",
    "Cameras",
    "perspective",
    "translate",
    "rotate_x",
    "rotate_y",
    "look_at",
    "fovx_to_fovy",
    "random_rotation_translation",
    "random_views",
    "orbit_views",
    "cameras_from_mv",
    "Mesh",
    "Material",
    "UndefinedMaterialWarning",
    "load_obj",
    "write_obj",
    "vertex_normals",
    "unit_size",
    "rgb_to_srgb",
    "srgb_to_rgb",
    "psnr",
    "save_image",
    "load_image",
]
