"""mptex: mixed-precision neural texture training.

The public API lives in a few modules: this package (the texture and its parts),
``mptex.render`` (rasterize, interpolate, cameras, meshes, images), ``mptex.scenes``,
``mptex.train`` (the loop behind ``mptex-train``), ``mptex.report`` and ``mptex.diagnostics``.
"""

from mptex._backends import has_nvdiffrast, has_tcnn, has_triton
from mptex.encoding import HashGridEncoding
from mptex.mlp import PrecisionMLP
from mptex.network import FullyFusedMLP
from mptex.precision import PrecisionPolicy, PrecisionStepper, StepResult
from mptex.texture import MLPTexture3D, convert_state_dict

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "HashGridEncoding",
    "has_tcnn",
    "has_nvdiffrast",
    "has_triton",
    "PrecisionPolicy",
    "PrecisionStepper",
    "StepResult",
    "PrecisionMLP",
    "FullyFusedMLP",
    "MLPTexture3D",
    "convert_state_dict",
]
