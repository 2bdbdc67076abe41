"""Shared skip markers and tolerances.

Mark a test with ``@pytest.mark.requires_cuda``, ``requires_tcnn``, ``requires_nvdiffrast``,
``requires_triton``, ``requires_xatlas``, ``requires_trimesh`` or ``requires_assets``; the hook
below turns the mark into a skip with a reason when the dependency is absent. Markers are
registered in pyproject.toml, and ``--strict-markers`` rejects typos.
"""

import importlib.util

import pytest
import torch

from mptex._backends import has_nvdiffrast, has_tcnn, has_triton
from mptex.bake import has_xatlas
from mptex.scenes import suite_available

_REQUIREMENTS = {
    "requires_cuda": (torch.cuda.is_available, "needs a CUDA device"),
    "requires_tcnn": (has_tcnn, "needs tinycudann importable and a CUDA device"),
    "requires_nvdiffrast": (has_nvdiffrast, "needs nvdiffrast importable and a CUDA device"),
    "requires_triton": (has_triton, "needs triton importable (pip install triton)"),
    "requires_xatlas": (has_xatlas, "needs xatlas (pip install xatlas, or the test extra)"),
    "requires_trimesh": (
        lambda: importlib.util.find_spec("trimesh") is not None,
        "needs trimesh (pip install trimesh, or the test extra)",
    ),
    "requires_assets": (
        suite_available,
        "needs pybullet_data, the real-asset suite's meshes (pip install pybullet==3.2.7, or the "
        "test extra)",
    ),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, (available, reason) in _REQUIREMENTS.items():
            if item.get_closest_marker(name) is not None and not available():
                item.add_marker(pytest.mark.skip(reason=reason))


# Tolerances keyed by dtype, starting from torch.testing's defaults (rtol, atol).
TOL = {
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
}
