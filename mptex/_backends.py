"""Lazy detection of the optional backends (tinycudann, nvdiffrast, triton).

Nothing here imports them at ``import mptex`` time: they are imported on first
use and the result is cached. tinycudann raises ``OSError``/``EnvironmentError``
(not ``ImportError``) when its CUDA libraries are missing, so both are caught.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "has_tcnn",
    "has_nvdiffrast",
    "has_triton",
    "import_tcnn",
    "import_nvdiffrast",
    "import_triton",
    "tcnn_module_sharing",
    "warn_fallback_once",
]


@functools.cache
def _try_import(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(name), ""
    except (ImportError, OSError) as exc:  # tcnn raises OSError without CUDA
        return None, f"{type(exc).__name__}: {exc}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def has_tcnn() -> bool:
    """True when ``tinycudann`` imports and a CUDA device is present."""
    return _cuda_available() and _try_import("tinycudann")[0] is not None


def has_nvdiffrast() -> bool:
    """True when ``nvdiffrast.torch`` imports and a CUDA device is present."""
    return _cuda_available() and _try_import("nvdiffrast.torch")[0] is not None


def has_triton() -> bool:
    """True when ``triton`` imports (no device needed: its interpreter runs on the CPU)."""
    return _try_import("triton")[0] is not None


def import_tcnn() -> ModuleType:
    """Return the ``tinycudann`` module or raise ``RuntimeError`` saying why it is unusable."""
    if not _cuda_available():
        raise RuntimeError(
            "backend 'tcnn' needs a CUDA device, and torch.cuda.is_available() is False"
        )
    module, why = _try_import("tinycudann")
    if module is None:
        raise RuntimeError(
            "backend 'tcnn' needs tinycudann, which is not importable "
            f"({why}); install it with: pip install "
            "git+https://github.com/NVlabs/tiny-cuda-nn/#subdirectory=bindings/torch"
        )
    return module


def import_nvdiffrast() -> ModuleType:
    """Return ``nvdiffrast.torch`` or raise ``RuntimeError`` saying why it is unusable."""
    if not _cuda_available():
        raise RuntimeError(
            "backend 'nvdiffrast' needs a CUDA device, and torch.cuda.is_available() is False"
        )
    module, why = _try_import("nvdiffrast.torch")
    if module is None:
        raise RuntimeError(
            f"backend 'nvdiffrast' needs nvdiffrast, which is not importable ({why}); install it "
            "with: pip install git+https://github.com/NVlabs/nvdiffrast/"
        )
    return module


def import_triton() -> ModuleType:
    """Return ``triton`` or raise ``RuntimeError`` saying why it is unusable."""
    module, why = _try_import("triton")
    if module is None:
        raise RuntimeError(
            f"backend 'triton' needs triton, which is not importable ({why}); it ships with "
            "PyTorch's CUDA/ROCm builds, or install it with: pip install triton"
        )
    return module


@functools.cache
def warn_fallback_once(what: str, reason: str) -> None:
    """Warn once per (what, reason) that ``backend='auto'`` fell back to the torch path."""
    warnings.warn(
        f"{what}: using the pure-PyTorch backend ({reason})", RuntimeWarning, stacklevel=3
    )


def tcnn_module_sharing(owner: Any, build: Callable[[], Any]) -> Any:
    """The tinycudann module behind ``owner`` (a HashGridEncoding or FullyFusedMLP), sharing its
    flat f32 ``owner.params``.

    ``build()`` makes the native module; it is built once per device of ``owner.params`` and
    cached in ``owner._tcnn_module`` as ``(device, module)``, outside the module tree so that
    ``state_dict`` holds only ``owner.params``. Its ``params`` is pointed at ``owner.params`` on
    every call (tcnn casts the master vector per call), so both always hold the same values.

    Raises:
        RuntimeError: tinycudann's parameter count differs from ``owner.n_params`` (a layout
            mptex computed wrongly must not be trained silently).
    """
    params = owner.params
    cached = owner._tcnn_module
    if cached is None or cached[0] != params.device:
        native = build()
        if native.params.numel() != owner.n_params:
            raise RuntimeError(
                f"tinycudann has {native.params.numel()} params, mptex computed {owner.n_params}"
            )
        owner._tcnn_module = cached = (params.device, native.to(params.device))
    native = cached[1]
    native.params = params
    return native
