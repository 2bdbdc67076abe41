"""mptex: mixed-precision neural texture training."""

from mptex._backends import has_nvdiffrast, has_tcnn
from mptex.encoding import HashGridEncoding
from mptex.mlp import PrecisionMLP
from mptex.precision import PrecisionPolicy, PrecisionStepper, StepResult
from mptex.texture import MLPTexture3D

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "HashGridEncoding",
    "has_tcnn",
    "has_nvdiffrast",
    "HashGridEncoding",
    "PrecisionPolicy",
    "PrecisionStepper",
    "StepResult",
    "PrecisionMLP",
    "MLPTexture3D",
]
