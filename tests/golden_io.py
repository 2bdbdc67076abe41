"""Loading and comparing the golden tensors of ``tests/golden/`` (see ``make_golden.py``)."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import torch

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def make_golden():
    """``tests/golden/make_golden.py`` as a module: its case lists and input formulas."""
    path = GOLDEN_DIR / "make_golden.py"
    spec = importlib.util.spec_from_file_location("make_golden", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(name: str) -> dict:
    return torch.load(GOLDEN_DIR / name, weights_only=True)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # bit patterns, so that inf, NaN and -0.0 compare too
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.detach().contiguous().view(view)


def assert_same_bits(name: str, actual: torch.Tensor, stored: dict) -> None:
    """``actual`` has exactly the stored bits (whole tensor, or digest and first rows)."""
    module = make_golden()
    if "full" in stored:
        expected = stored["full"]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        differ = int((_bits(actual) != _bits(expected)).sum())
        assert differ == 0, f"{name}: {differ} of {expected.numel()} elements differ"
        return
    assert actual.dtype == stored["dtype"] and tuple(actual.shape) == stored["shape"], name
    head = stored["head"]
    differ = int((_bits(actual[: head.shape[0]]) != _bits(head)).sum())
    assert differ == 0, f"{name}: {differ} of the first {head.numel()} elements differ"
    assert module.digest(actual) == stored["sha256"], f"{name}: digest differs (later rows)"


@contextlib.contextmanager
def torch_threads(count: int):
    """Run the block with ``count`` torch threads (the golden files were written with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def native_or_eager(path: str, module, monkeypatch, pytest) -> str:
    """Run ``module``'s op in the C kernel (``path == "native"``; skipped where it does not
    build) or in its eager PyTorch ops (``module._native`` answers None)."""
    if path == "native":
        if module.native_kernels() is None:
            pytest.skip("the C kernel does not build here (no C compiler)")
    else:
        monkeypatch.setattr(module, "_native", lambda *args: None)
    return path
