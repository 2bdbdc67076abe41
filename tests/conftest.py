"""Shared skip markers and tolerances. Markers are registered in pyproject.toml (--strict-markers)."""

import pytest
import torch

from mptex._backends import has_nvdiffrast, has_tcnn

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_tcnn = pytest.mark.skipif(
    not has_tcnn(), reason="needs tinycudann importable and a CUDA device"
)
requires_nvdiffrast = pytest.mark.skipif(
    not has_nvdiffrast(), reason="needs nvdiffrast importable and a CUDA device"
)

# Tolerances keyed by dtype, from torch.testing's defaults (rtol, atol).
TOL = {
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
}
