"""What the training loop asks of an exporter, for ``export.enabled=true``.

The loop checks at start whatever the export at the end needs (so a missing writer fails before
training, not after it), and exports a completed run after its final validation. It never
imports the exporter: ``mptex-train`` passes :class:`mptex.bake.TrainingExport` (mptex's layers
point down: the bake sits above training).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import torch

__all__ = ["Exporter"]


class Exporter(Protocol):
    """The two calls the loop makes, in this order."""

    def preflight(
        self, settings: Mapping[str, Any], mesh: Any, channels: int, device: torch.device,
        run_dir: str | os.PathLike,
    ) -> None:  # fmt: skip
        """Before the first iteration: raise ``ValueError`` / ``RuntimeError`` (one line naming
        the ``export.<key>``) for anything the export would fail on."""

    def export(
        self, texture: Any, scene: Any, out_dir: str | os.PathLike, settings: Mapping[str, Any],
        background: str, source: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """After the final validation of a completed run: write ``out_dir`` and return the
        ``export.json`` contents; ``source`` (:func:`mptex.train.checkpoint.export_source`)
        is its ``source`` record, the run the weights came from."""
