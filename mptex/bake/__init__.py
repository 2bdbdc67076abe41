"""Baking a trained ``MLPTexture3D`` into UV maps and exporting a textured mesh.

* :mod:`~mptex.bake.bake`: :func:`bake_texture` (texel G-buffer, batched evaluation, seam
  dilation), :func:`dilate`;
* :mod:`~mptex.bake.unwrap`: xatlas UVs packed at the bake resolution;
* :mod:`~mptex.bake.export`: OBJ + MTL + PNG and GLB writers, ``export.json``, the bake's
  measurement: :func:`export_mesh` (a texture and a mesh alone) and :func:`export_asset` (on
  the scene the texture was trained on);
* :mod:`~mptex.bake.decode`: the texture decoded in f32, f16, bf16, fp8 and int8
  (:func:`decode_texture`, :func:`decode_precision_table`) and the neural export
  (:func:`export_neural`), which :mod:`~mptex.bake.neural_decoder` (NumPy only) decodes;
* the command ``mptex-export RUN_DIR`` is :mod:`mptex.cli.export`.

Nothing here imports the training loop: ``mptex-train`` hands the loop a
:class:`TrainingExport`, which runs :func:`export_asset` at the end of a run with
``export.enabled=true``; the ``mptex-export`` command reads a checkpoint. ``xatlas`` and
``trimesh`` are imported on first use.
"""

from mptex.bake.bake import (
    MAX_RESOLUTION,
    BakeResult,
    bake_texture,
    check_bake_memory,
    dilate,
    needs_unwrap,
    sample_in_chunks,
    texel_positions,
    uv_problem,
)
from mptex.bake.decode import (
    DECODE_PRECISIONS,
    decode_precision_table,
    decode_texture,
    export_neural,
)
from mptex.bake.export import (
    EXPORT_DEFAULTS,
    MEASURE_RESOLUTION,
    MEASURE_VIEWS,
    TrainingExport,
    check_export_config,
    export_asset,
    export_mesh,
    measure_bake,
    orbit_views_around,
    preflight_export,
    write_glb,
    write_obj_asset,
    write_texture_images,
)
from mptex.bake.unwrap import PACK_DEFAULTS, has_xatlas, unwrap_mesh

__all__ = [
    "TrainingExport",
    "BakeResult",
    "bake_texture",
    "dilate",
    "sample_in_chunks",
    "uv_problem",
    "needs_unwrap",
    "check_bake_memory",
    "texel_positions",
    "MAX_RESOLUTION",
    "has_xatlas",
    "unwrap_mesh",
    "PACK_DEFAULTS",
    "EXPORT_DEFAULTS",
    "check_export_config",
    "preflight_export",
    "export_mesh",
    "export_asset",
    "measure_bake",
    "orbit_views_around",
    "MEASURE_VIEWS",
    "MEASURE_RESOLUTION",
    "write_texture_images",
    "write_obj_asset",
    "write_glb",
    "DECODE_PRECISIONS",
    "decode_texture",
    "decode_precision_table",
    "export_neural",
]
