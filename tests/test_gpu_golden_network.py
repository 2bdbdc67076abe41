"""The FullyFusedMLP twin against real tinycudann 2.0's outputs (tests/gpu_golden/network.npz).

The fixture holds tcnn's outputs, input gradients and parameter gradients of three networks
(``benchmarks/gpu/validate.py``'s ``NETWORK_CONFIGS``: 32x2, 64x3, 128x5, ReLU), captured on an
NVIDIA H100 (tinycudann 2.0 from tiny-cuda-nn 6ee3546); tests/gpu_golden/build_network.py says
what is stored. Parameters and points are regenerated here from their seeds (the cotangents
are stored). Set ``MPTEX_GPU_GOLDEN_DIR`` to check against another capture compacted by that
script.

What is claimed, for the C kernel (the eager ops give the same bits, tests/test_fused_mlp_torch.py):
outputs, input gradients and parameter gradients bit-equal to tcnn's, every stored element
(measured so). The twin's model of the tensor core (see mptex/_fused_mlp_torch.py): products
aligned to the largest exponent and truncated to 2^(E - 25), summed exactly, rounded once to
half; tcnn's block order (16 for the fused kernel, 8 for CUTLASS) and split-K slices.
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

pytestmark = pytest.mark.golden_bits  # rerun under other CPU kernels: tests/test_dispatch.py

HERE = Path(__file__).resolve().parent
FIXTURE_DIR = Path(os.environ.get("MPTEX_GPU_GOLDEN_DIR", HERE / "gpu_golden"))
LOSS_SCALE = 128.0
N_POINTS = 8209


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
    for name, summary in got.items():
        assert summary["equal"] == 1.0 and summary["nonfinite"] == 0, (name, summary)
