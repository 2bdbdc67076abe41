"""mptex: mixed-precision neural texture training."""

from mptex._backends import has_nvdiffrast, has_tcnn
from mptex.encoding import HashGridEncoding

__version__ = "0.1.0"

__all__ = ["__version__", "HashGridEncoding", "has_tcnn", "has_nvdiffrast"]
