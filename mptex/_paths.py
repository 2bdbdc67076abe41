"""Where mptex's configs and experiments are: inside the package when installed from a wheel,
beside it in a source checkout or an editable install.

A wheel ships the checkout's top-level ``configs/`` and ``experiments/`` as ``mptex/configs``
and ``mptex/experiments`` (pyproject.toml maps them), so ``mptex-train`` runs from any folder;
in a checkout they stay where users read and edit them. Nothing writes into either at run time.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIG_DIR", "EXPERIMENTS_DIR"]

_PACKAGE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    inside = _PACKAGE / name  # an installed wheel
    return inside if inside.is_dir() else _PACKAGE.parent / name


CONFIG_DIR = _data_dir("configs")
EXPERIMENTS_DIR = _data_dir("experiments")
