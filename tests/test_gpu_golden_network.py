"""The FullyFusedMLP twin against real tinycudann 2.0's outputs (tests/gpu_golden/network.npz).

The fixture holds tcnn's outputs, input gradients and parameter gradients of three networks
(``benchmarks/gpu/validate.py``'s ``NETWORK_CONFIGS``: 32x2, 64x3, 128x5, ReLU), captured on an
NVIDIA H100 (tinycudann 2.0 from tiny-cuda-nn 6ee3546); tests/gpu_golden/build_network.py says
what is stored. Parameters and points are regenerated here from their seeds (the cotangents
are stored). Set ``MPTEX_GPU_GOLDEN_DIR`` to check against another capture compacted by that
script.

What is claimed (the floors sit below what was measured on the fixture, in half ulps):

- outputs and input gradients bit-equal at >= 99.9 % at widths 32 and 64 (measured 99.99 /
  99.9 %), >= 99 % at width 128 (measured 99.1 / 99.4 %): the twin rounds each tensor-core
  step's exact sum once to half; tcnn's tensor cores align the 16 products before they add
  them, which the twin does not model, and a differing hidden unit passes on through the
  layers below it;
- parameter gradients: p99 <= 4 half ulps in every case (measured 0, 0, 4), the split-K
  CUTLASS reduction of two slices of 4224 samples in blocks of 8.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mptex._fused_mlp_torch import FusedMLPSpec, fused_mlp, xavier_uniform_params
from mptex.diagnostics.ulp import ulp_summary

HERE = Path(__file__).resolve().parent
FIXTURE_DIR = Path(os.environ.get("MPTEX_GPU_GOLDEN_DIR", HERE / "gpu_golden"))
LOSS_SCALE = 128.0
N_POINTS = 8209

# case: (output floor, input-gradient floor) as shares bit-equal; wgrad p99 bound in half ulps
FLOORS = {"32x2": (0.999, 0.999), "64x3": (0.999, 0.999), "128x5": (0.99, 0.99)}
WGRAD_P99 = 4.0


def _builder():
    path = HERE / "gpu_golden" / "build_network.py"
    spec = importlib.util.spec_from_file_location("build_network", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _builder()


@pytest.fixture(scope="module")
def fixture():
    path = FIXTURE_DIR / "network.npz"
    if not path.exists():
        pytest.skip(f"no fixture at {path}")
    return dict(np.load(path))


def _inputs(key: str, data: dict):
    n_in, n_out, width, n_hidden = BUILD.CASES[key]
    spec = FusedMLPSpec(n_in, n_out, width, n_hidden)
    params = xavier_uniform_params(spec, seed=1337)
    x = torch.rand(N_POINTS, n_in, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert BUILD.digest(params.numpy()) == str(data[f"{key}.params_sha256"]), "params differ"
    assert BUILD.digest(x.numpy()) == str(data[f"{key}.x_sha256"]), "regenerated x differs"
    return spec, params, x, torch.from_numpy(data[f"{key}.cot"])


@pytest.mark.parametrize("key", list(BUILD.CASES))
def test_twin_matches_tcnn(key, fixture):
    spec, params, x, cot = _inputs(key, fixture)
    x = x.requires_grad_(True)
    params = params.requires_grad_(True)
    out = fused_mlp(x, params, spec)
    out.backward(cot)
    out_floor, xgrad_floor = FLOORS[key]
    n_out = fixture[f"{key}.out"].shape[0]
    n_xgrad = fixture[f"{key}.xgrad128"].shape[0]
    got = {
        "out": ulp_summary(out[:n_out], torch.from_numpy(fixture[f"{key}.out"])),
        "xgrad": ulp_summary(
            (x.grad[:n_xgrad] * LOSS_SCALE).half(), torch.from_numpy(fixture[f"{key}.xgrad128"])
        ),
        "wgrad": ulp_summary(params.grad.half(), torch.from_numpy(fixture[f"{key}.wgrad"])),
    }
    print(key, {k: (round(100 * v["equal"], 3), v["p99"], v["max"]) for k, v in got.items()})
    assert got["out"]["equal"] >= out_floor, got["out"]
    assert got["xgrad"]["equal"] >= xgrad_floor, got["xgrad"]
    assert got["wgrad"]["p99"] <= WGRAD_P99, got["wgrad"]
    assert all(v["nonfinite"] == 0 for v in got.values()), got
