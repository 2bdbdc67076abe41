"""A Hydra callback that refuses a sweep meant for a device this machine does not have.

A preset sized for a GPU (``experiments/gpu_main.yaml``) would otherwise start every job, and
each would fail on its own (``train.device: 'cuda' requested but CUDA is not available``), or,
with ``train.device=auto``, train for hours on the CPU. The callback checks once, before
Hydra starts any job, and exits with one line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from hydra.experimental.callback import Callback

from mptex._backends import cuda_device_problem
from mptex.train.config import torch_device

__all__ = ["RequireDeviceCallback", "device_problem"]


def device_problem(device: str) -> str | None:
    """Why ``device`` (``"cuda"``, ``"cuda:N"`` or ``"cpu"``) cannot run here, or None."""
    try:
        dev = torch_device(device)
    except ValueError as exc:
        return str(exc)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "this preset needs a CUDA GPU and none is available here"
        return cuda_device_problem(dev, device)
    return None


class RequireDeviceCallback(Callback):
    """Hydra callback: exit (status 2, one line on stderr) at the start of a run or multirun
    whose ``train.device`` is not available on this machine.

    Hydra turns an exception in a callback into a warning, so the refusal is a ``SystemExit``;
    at a multirun's start it is ``os._exit(2)`` after flushing the output, because the report
    callback (``configs/config.yaml``, which runs first) has registered writing the report at
    exit, and would add a second line about an empty sweep. No job has started then.
    Registered by a preset under ``hydra.callbacks``; the device read is the composed
    ``train.device`` (a command-line ``train.device=cpu`` runs the preset on the CPU, e.g. at
    test size).
    """

    def _refused(self, config) -> bool:
        device = str(config.train.device)
        problem = None if device == "auto" else device_problem(device)
        if problem is not None:
            print(f"mptex-train: error: {problem} (train.device={device})", file=sys.stderr)
        return problem is not None

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        if self._refused(config):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)

    def on_run_start(self, config, **kwargs: Any) -> None:
        if self._refused(config):
            raise SystemExit(2)
