"""Seeds and random-number-generator state (saved in checkpoints so that resume is bit-exact)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["seed_everything", "rng_state", "set_rng_state"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators with ``seed`` (NumPy's mod 2^32)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(generators: Mapping[str, torch.Generator]) -> dict[str, Any]:
    """Every generator's state for a checkpoint: the global ones (Python, NumPy, torch, CUDA when
    available) and ``generators`` by name (``gen_<name>``)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        **{f"gen_{k}": g.get_state() for k, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator]) -> None:
    """Restore what :func:`rng_state` saved, into the global generators and ``generators``.

    Every torch generator takes its state as a CPU byte tensor, a CUDA generator's too; a
    checkpoint loaded with ``map_location`` a GPU holds the states there, so each is taken
    to the CPU first (no copy where it already is)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    for k, g in generators.items():
        g.set_state(state[f"gen_{k}"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        # one state per device the saving process saw; this one may see fewer
        for index, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state.cpu(), index)
