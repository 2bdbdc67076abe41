"""Loading and comparing the golden tensors of ``tests/golden/`` (see ``make_golden.py``)."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
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


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns as integers of its width, so that inf, NaN payloads and -0.0
    compare too (FP8 codes as uint8)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.detach().contiguous().view(view)


def assert_same_bits(name: str, actual: torch.Tensor, stored: dict) -> None:
    """``actual`` has exactly the stored bits (whole tensor, or digest and first rows)."""
    module = make_golden()
    if "full" in stored:
        expected = stored["full"]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        differ = int((bits(actual) != bits(expected)).sum())
        assert differ == 0, f"{name}: {differ} of {expected.numel()} elements differ"
        return
    assert actual.dtype == stored["dtype"] and tuple(actual.shape) == stored["shape"], name
    head = stored["head"]
    differ = int((bits(actual[: head.shape[0]]) != bits(head)).sum())
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


# Builds of the C kernel besides the default (-march=native): the portable code paths.
_BUILDS = {
    # x86-64 baseline or any other CPU: no F16C, no AVX-512 (_Float16 conversions)
    "portable": (),
    # AVX2 + F16C + FMA, no AVX-512: the scalar F16C conversions
    "avx2": ("-mavx2", "-mf16c", "-mfma"),
}
PATHS = ["native", "eager", *_BUILDS]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_or_eager(path: str, module, monkeypatch, pytest) -> str:
    """Run ``module``'s op in the C kernel (``"native"``: the default build; a name of
    ``_BUILDS``: that build; skipped where it does not build or the CPU lacks what it needs)
    or in its eager PyTorch ops (``"eager"``: ``module._native`` answers None)."""
    from mptex import _native_cpu

    if path == "eager":
        monkeypatch.setattr(module, "_native", lambda *args: None)
    elif path == "native":
        if module.native_kernels() is None:
            pytest.skip("the C kernel does not build here (no C compiler)")
    else:
        extra = _BUILDS[path]
        if extra and not {"avx2", "f16c", "fma"} <= _cpu_flags():
            pytest.skip(f"the {path} build needs an x86-64 CPU with AVX2, F16C and FMA")
        flags = tuple(f for f in _native_cpu._CFLAGS if f != "-march=native") + extra
        try:
            lib = _native_cpu.build_kernels(flags)
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"the {path} build of the C kernel failed here: {exc}")
        monkeypatch.setattr(module, "native_kernels", lambda: lib)
    return path


def default_and_scalar_kernels(build: str, module, monkeypatch, pytest):
    """The C kernel's default build (vector loops where the CPU has AVX-512) and ``build``, a
    name of ``_BUILDS`` (one-at-a-time loops), the second put in ``module``'s place; skipped
    where either does not build or run here."""
    from mptex import _native_cpu

    default = _native_cpu.native_kernels()
    if default is None:
        pytest.skip("the C kernel does not build here (no C compiler)")
    native_or_eager(build, module, monkeypatch, pytest)
    return default, module.native_kernels()


def edge_values(shape, gen, binades, dtype, specials):
    """Values of ``dtype`` for a kernel's every class of input: magnitudes in [0.5, 1.5) x 2^e
    for e in ``range(*binades)`` (subnormals below the dtype's normal range), random signs,
    then ``specials``, ``(value, fraction)`` pairs such as signed zeros, values whose sums
    overflow, inf and NaN, each put at that fraction of the positions (disjoint)."""
    magnitude = torch.exp2(torch.randint(*binades, shape, generator=gen).double())
    values = (magnitude * (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5)).to(dtype)
    values = torch.where(torch.rand(shape, generator=gen) < 0.5, values, -values)
    pick, start = torch.rand(shape, generator=gen), 0.0
    for value, fraction in specials:
        values[(pick >= start) & (pick < start + fraction)] = value
        start += fraction
    return values
