"""What a run records about where it ran (device, versions) and how it reports progress."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mptex._backends import has_nvdiffrast, has_tcnn

__all__ = [
    "device_name",
    "cpu_model",
    "package_versions",
    "Progress",
    "tensorboard_writer",
    "reproducible_blas",
]


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model, core count and torch's CPU capability.

    The capability (``torch.backends.cpu.get_cpu_capability()``: DEFAULT, AVX2, AVX512, ...)
    helps pick ATen's and MKL's vectorised kernels, whose rounding differs: a run is
    bit-identical for any thread count on one machine, but the same seed on another CPU model
    moved by 0.03-0.19 dB on most scenes and up to 1.3 dB on the duck
    (docs/archive/across-machines.md). Naming it here lets the report show when compared runs
    came from machines that may round differently.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()})"


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's first ``model name``, else ``platform``'s guess.

    Shared by ``metrics.json``'s device name and the benchmark tables' machine line.
    """
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions() -> dict[str, Any]:
    """mptex, torch, Python, NumPy, Hydra and CUDA versions, and whether tinycudann and
    nvdiffrast import: ``metrics.json``'s ``versions``."""
    import mptex

    try:
        import hydra

        hydra_version = hydra.__version__
    except ImportError:  # pragma: no cover
        hydra_version = None
    return {
        "mptex": mptex.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "hydra": hydra_version,
        "cuda": torch.version.cuda,
        "tcnn_available": has_tcnn(),
        "nvdiffrast_available": has_nvdiffrast(),
    }


class Progress:
    """tqdm bar with loss, PSNR and loss scale; a no-op when disabled or tqdm is missing."""

    def __init__(self, total: int, initial: int, enabled: Any):
        if enabled == "auto":
            enabled = sys.stdout.isatty()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="it", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: v for k, v in postfix.items() if v is not None}, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tensorboard_writer(run_dir: str | os.PathLike, enabled: bool):
    """A TensorBoard ``SummaryWriter`` into ``run_dir/tensorboard``; None when not ``enabled``,
    or (with one line on stderr) when tensorboard is not installed."""
    if not enabled:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("mptex-train: train.tensorboard=true but tensorboard is not installed; skipping",
              file=sys.stderr)  # fmt: skip
        return None
    return SummaryWriter(str(Path(run_dir) / "tensorboard"))


def reproducible_blas() -> None:
    """Turn on MKL's strict conditional numerical reproducibility (``MKL_CBWR=AUTO,STRICT``)
    unless the user set ``MKL_CBWR``: its GEMMs then return the same bits for any thread count.

    Without it torch's CPU matmuls split the reduction over points between threads, so 1 and 2
    threads gave different MLP weight gradients, and a training run amplifies such differences
    (docs/archive/thread-count.md). MKL reads the variable at its first call: call this before
    any tensor work (``mptex-train`` does it first).
    """
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
