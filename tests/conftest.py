"""Shared skip markers and tolerances.

Mark a test with ``@pytest.mark.requires_cuda``, ``requires_tcnn``, ``requires_nvdiffrast``,
``requires_triton``, ``requires_xatlas``, ``requires_trimesh`` or ``requires_assets``; the hook
below turns the mark into a skip with a reason when the dependency is absent. Markers are
registered in pyproject.toml, and ``--strict-markers`` rejects typos.

The quick tier, ``pytest -m "not slow"``, is for an edit-test loop: besides the tests marked
``slow`` where they are written, :data:`SLOW` names the tests that start mptex's commands in a
subprocess (2-60 s each: Hydra's start, a training run, signals, sweeps with launchers) or
compile Triton's kernels under its interpreter. CI runs every test.
"""

import fnmatch
import importlib.util

import pytest
import torch

from mptex._backends import has_nvdiffrast, has_tcnn, has_triton
from mptex.bake import has_xatlas
from mptex.scenes import suite_available
from mptex.train.runinfo import reproducible_blas

# MKL reads MKL_CBWR once, at its first call (the imports above make none): the mode
# mptex-train runs in, and the golden tensors were made in, is set here, before any test module
# computes, so that no test's bits depend on which other modules were collected or ran first.
reproducible_blas()

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


# Node ids (relative to tests/) of the tests the quick tier leaves out, with why.
SLOW = (
    "test_cli.py::*",  # every test runs mptex-train in a subprocess
    "test_signals.py::*",  # signals, requeue, full disks: training subprocesses
    "test_sweep.py::*",  # multiruns with Hydra's launchers
    "test_encoding_triton.py::*",  # Triton's interpreter compiles each kernel (~20 s at first)
    "test_faults.py::test_kill_9_*",  # kills and resumes a training subprocess
    "test_faults.py::test_cli_*",  # mptex-train / mptex-check subprocesses
    "test_search.py::test_mptex_train_runs_the_search_*",  # a search with 2 worker processes
    "test_export.py::test_mptex_train_exports_*",  # mptex-train then its export
    "test_check.py::test_cli_*",  # mptex-check in a subprocess
    "test_gpu_kit.py::test_a_*",  # the GPU kit's stages in subprocesses
    "test_gpu_kit.py::test_bad_options_*",
    "test_gpu_kit.py::test_an_empty_kit_*",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        node = item.nodeid.split("/", 1)[-1]
        if any(fnmatch.fnmatch(node, pattern) for pattern in SLOW):
            item.add_marker(pytest.mark.slow)
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


@pytest.fixture
def no_cuda_toolkit(tmp_path, monkeypatch):
    """The fused loss's libdevice search (``mptex.train._loss_triton.torch_libdevice``) on a
    machine without CUDA toolkits but those a test makes: empty ``MPTEX_LIBDEVICE``,
    ``CUDA_HOME`` and ``CUDA_PATH``, no ``nvcc``, the system location ``tmp_path/system/cuda-<v>``,
    torch built for CUDA 13.0. Returns the module; its cache is cleared before and after."""
    lt = pytest.importorskip("mptex.train._loss_triton")
    for name in ("MPTEX_LIBDEVICE", "CUDA_HOME", "CUDA_PATH"):
        # Set (empty: unset for the search) rather than deleted: monkeypatch then restores the
        # variable even where the code under test sets it itself.
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(lt, "_SYSTEM_TOOLKITS", (str(tmp_path / "system" / "cuda-{version}"),))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    lt.torch_libdevice.cache_clear()
    yield lt
    lt.torch_libdevice.cache_clear()


@pytest.fixture(params=["native", "eager"])
def grid_ops(request, monkeypatch):
    """The torch grid twin's two paths, each test run on both: ``"native"`` (the C kernel,
    skipped where it does not build) and ``"eager"`` (torch ops, the kernel switched off)."""
    import mptex._grid_torch as grid

    if request.param == "eager":
        monkeypatch.setattr(grid, "_native", lambda *args: None)
    elif grid.native_kernels() is None:
        pytest.skip("the C kernel does not build here (no C compiler)")
    return request.param
