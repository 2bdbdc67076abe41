"""Rendering: rasterization, interpolation, cameras, texture sampling, meshes and image I/O."""

from mptex.render.rasterize import interpolate, rasterize

__all__ = ["rasterize", "interpolate"]
