"""Compact tcnn's hash-grid golden outputs for the CPU tests (tests/test_gpu_golden_grid.py).

The source is the ``grid.npz`` that the GPU capture script writes (one full file per capture):
for each config of ``benchmarks/gpu/validate.py``'s ``GRID_CONFIGS`` and dtype float32 /
float16, keys ``{config}.{dtype}.x`` [8192, D], ``.v`` [2048, L*F], ``.out`` [8192, L*F]
(tcnn's forward), ``.grad_idx`` / ``.grad_val`` (the nonzero entries of tcnn's parameter
gradient of ``sum(out[:2048].float() * v)``). Parameters, points and cotangents come from
``gen = torch.Generator().manual_seed(0)``: ``params = rand(n_params) * 2 - 1``, then
``x = rand(8192, D)``, ``v = randn(2048, L*F)``. The compact file stores ``v`` (torch's
``randn`` gives other values under ``ATEN_CPU_CAPABILITY=default`` than with AVX2 or AVX-512)
but neither the parameters nor ``x`` (``rand`` is the same on every CPU path).

The compact ``grid.npz`` keeps, per ``{config}.{dtype}``:

- ``.out``: tcnn's forward on the first ``N_FORWARD`` points (float32, or float16 bits as
  float16);
- ``.grad_idx`` (int32), ``.grad_val`` (float32): ``N_GRAD`` entries of tcnn's parameter
  gradient, drawn without replacement from its nonzero entries with
  ``numpy.random.default_rng(0)``, sorted by index;
- ``.grad_norm`` (float64 scalar): the norm of tcnn's whole gradient;
- ``.x_sha256``: the SHA-256 of the float32 bytes of ``x`` as captured, so that a test can
  tell its regenerated points are the captured ones;

and per ``{config}``: ``.v`` (float32 [2048, L*F], the cotangent, the same for both dtypes).

Usage: ``python tests/gpu_golden/build_grid.py SRC_DIR OUT_DIR`` (reads SRC_DIR/grid.npz,
writes OUT_DIR/grid.npz).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

__all__ = ["N_FORWARD", "N_GRAD", "compact", "digest"]

N_FORWARD = 1024
N_GRAD = 4096


def digest(x: np.ndarray) -> str:
    """SHA-256 of float32 ``x`` (C order)."""
    return hashlib.sha256(np.ascontiguousarray(x, dtype=np.float32).tobytes()).hexdigest()


def compact(src_dir: Path, out_dir: Path) -> Path:
    """Write ``out_dir / "grid.npz"`` from the full capture ``src_dir / "grid.npz"``.

    Returns:
        The path written.
    """
    full = np.load(Path(src_dir) / "grid.npz")
    cases = sorted({key.rsplit(".", 1)[0] for key in full.files})
    arrays = {}
    for case in cases:
        out, idx, val = full[f"{case}.out"], full[f"{case}.grad_idx"], full[f"{case}.grad_val"]
        rng = np.random.default_rng(0)
        keep = np.sort(rng.choice(idx.size, size=min(N_GRAD, idx.size), replace=False))
        arrays[f"{case}.out"] = out[:N_FORWARD]
        arrays[f"{case}.grad_idx"] = idx[keep].astype(np.int32)
        arrays[f"{case}.grad_val"] = val[keep].astype(np.float32)
        arrays[f"{case}.grad_norm"] = np.float64(np.linalg.norm(val.astype(np.float64)))
        arrays[f"{case}.x_sha256"] = np.array(digest(full[f"{case}.x"]))
        config, v = case.split(".")[0], full[f"{case}.v"].astype(np.float32)
        if f"{config}.v" in arrays and not np.array_equal(arrays[f"{config}.v"], v):
            raise ValueError(f"{case}.v differs from the other dtype's cotangent")
        arrays[f"{config}.v"] = v
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "grid.npz"
    np.savez_compressed(path, **arrays)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tests/gpu_golden/build_grid.py SRC_DIR OUT_DIR")
    written = compact(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{written}: {written.stat().st_size / 1024:.0f} KiB")
