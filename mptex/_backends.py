"""Lazy detection of the optional backends (tinycudann, nvdiffrast, triton).

Nothing here imports them at ``import mptex`` time: they are imported on first
use and the result is cached. tinycudann raises ``OSError``/``EnvironmentError``
(not ``ImportError``) when its CUDA libraries are missing, so both are caught.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "has_tcnn",
    "has_nvdiffrast",
    "has_triton",
    "backend_problem",
    "cuda_device_problem",
    "auto_device",
    "unavailable_message",
    "import_tcnn",
    "import_nvdiffrast",
    "import_triton",
    "tcnn_module_sharing",
    "warn_fallback_once",
    "available_bytes",
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


def auto_device() -> str:
    """What ``device: auto`` means on this machine: ``"cuda"`` where CUDA is available, else
    ``"cpu"``."""
    return "cuda" if _cuda_available() else "cpu"


def cuda_device_problem(device: Any, named: str) -> str | None:
    """Why the CUDA device ``device`` (a ``torch.device`` of type cuda) is not on this machine,
    in words that start with ``named`` (how the caller's message shows it): no CUDA at all, or
    an index beyond its devices; None where it is."""
    import torch

    if not _cuda_available():
        return f"{named} requested but CUDA is not available"
    count = torch.cuda.device_count()
    if (device.index or 0) >= count:
        return f"{named} requested, {count} CUDA device(s) here"
    return None


def has_tcnn() -> bool:
    """True when ``tinycudann`` imports and a CUDA device is present."""
    return _cuda_available() and _try_import("tinycudann")[0] is not None


def has_nvdiffrast() -> bool:
    """True when ``nvdiffrast.torch`` imports and a CUDA device is present."""
    return _cuda_available() and _try_import("nvdiffrast.torch")[0] is not None


def has_triton() -> bool:
    """True when ``triton`` imports (no device needed: its interpreter runs on the CPU)."""
    return _try_import("triton")[0] is not None


# What each optional backend needs, and how to install it.
_NEEDS = {
    "tcnn": ("tinycudann", True, "pip install "
             "git+https://github.com/NVlabs/tiny-cuda-nn/#subdirectory=bindings/torch"),
    "nvdiffrast": ("nvdiffrast.torch", True, "pip install git+https://github.com/NVlabs/nvdiffrast/"),
    "triton": ("triton", False, "it ships with PyTorch's CUDA/ROCm builds, or pip install triton"),
}  # fmt: skip


def backend_problem(backend: str) -> str | None:
    """Why ``backend`` ("tcnn", "nvdiffrast" or "triton") cannot run here, or None when it can;
    never raises. The reason names what is missing: the CUDA device or the import (with its
    error and how to install it)."""
    module_name, needs_cuda, install = _NEEDS[backend]
    if needs_cuda and not _cuda_available():
        return "torch.cuda.is_available() is False"
    module, why = _try_import(module_name)
    if module is None:
        return f"{module_name.split('.')[0]} is not importable ({why}); {install}"
    return None


def unavailable_message(backend: str, key: str, instead: str | None = None) -> str | None:
    """One line naming ``key`` (the argument or config key that asked for ``backend``), what the
    backend needs, why it is missing here (:func:`backend_problem`) and what runs ``instead``
    (default: ``key='torch'``, which runs on any device); None when the backend is usable."""
    problem = backend_problem(backend)
    if problem is None:
        return None
    module_name, needs_cuda, _ = _NEEDS[backend]
    needs = module_name.split(".")[0] + (" and a CUDA device" if needs_cuda else "")
    instead = instead or f"{key}='torch' runs on any device"
    return f"{key}={backend!r} needs {needs}: {problem}; {instead}"


def _require(backend: str, key: str, instead: str | None) -> ModuleType:
    message = unavailable_message(backend, key, instead)
    if message is not None:
        raise RuntimeError(message)
    return _try_import(_NEEDS[backend][0])[0]


def import_tcnn(key: str = "backend", instead: str | None = None) -> ModuleType:
    """Return the ``tinycudann`` module, or raise ``RuntimeError`` naming ``key`` (the argument
    or config key that asked for tcnn), why tcnn is unusable, and ``instead`` (default: that
    ``key='torch'`` runs on any device)."""
    return _require("tcnn", key, instead)


def import_nvdiffrast(key: str = "backend", instead: str | None = None) -> ModuleType:
    """Return ``nvdiffrast.torch``, or raise ``RuntimeError`` as :func:`import_tcnn`."""
    return _require("nvdiffrast", key, instead)


def import_triton(key: str = "backend", instead: str | None = None) -> ModuleType:
    """Return ``triton``, or raise ``RuntimeError`` as :func:`import_tcnn`."""
    return _require("triton", key, instead)


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


def available_bytes(device: Any) -> int | None:
    """Free memory on ``device`` (a ``torch.device``, its string, or None for the CPU) in bytes
    (CUDA: the driver's free memory; CPU: MemAvailable), or None when unknown."""
    import torch

    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None
