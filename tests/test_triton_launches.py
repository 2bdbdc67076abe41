"""Compile variants of mptex's Triton kernels over batch sizes, counted without a GPU by
``benchmarks/triton_launches.py`` (Triton's launch path for sm_90, the driver stubbed): the
batch-dependent arguments that only bound loops or mask a strided axis are not specialised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="needs triton")

ROOT = Path(__file__).resolve().parents[1]

# Sites whose every kernel compiles once whatever the batch size. At the other sites a
# batch-dependent bound of a contiguous axis stays specialised (the compiler vectorises that
# axis when it knows the bound divisible by 16): two variants, never more.
ONE_VARIANT = (
    *(f"quantise {recipe}: {what}" for recipe in ("delayed", "current") for what in (
        "activation [M, 32], both layouts", "activation [M, 32], as it lies",
        "weight [32, 32], both layouts")),
    "quantise rowwise: weight [32, 32], both layouts",
    "padded copy: [M, 3] to [pad(M), 16]",
    "hash grid (triton): forward, M points",
    "hash grid (triton): backward, M points",
    "fused loss: image partials (l1), 512^2 x 4",
)  # fmt: skip


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("launches") / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_launches.py"), "--sizes", "24",
         "--calls", "2", "--repeats", "1", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["site"]: r for r in json.loads(out.read_text())["results"]}, proc.stdout


def test_no_kernel_compiles_more_than_two_variants_over_batch_sizes(probed):
    results, _ = probed
    assert set(ONE_VARIANT) <= set(results)
    for site, result in results.items():
        assert result["variants"], site  # every site launched and compiled something
        # the first call of a site compiles each of its kernels
        assert set(result["variants"]) == set(result["launches"]), site
        limit = 1 if site in ONE_VARIANT else 2
        assert max(result["variants"].values()) <= limit, (site, result["variants"])
        assert result["host_us"] > 0, site


def test_the_table_names_every_site(probed):
    results, stdout = probed
    for site in results:
        assert f"| {site}" in stdout


# Each site's kernels and the most compile variants each may take over the test's 24 batch
# sizes (500,000 .. 500,019 and the multiples of 16, 1024 and 2^19 among ``sizes``), per kernel:
# a kernel that compiles one variant where its site's other kernel compiles two (an argument
# that only bounds a loop specialised again) passes the per-site bound above, not this one.
# 1: no batch-dependent integer of the kernel is specialised; 2: one bound of a contiguous axis
# is (a multiple of 16 or not).
_PER_TENSOR = {"_amax_partials_kernel": 1, "_scale_cast_kernel": 1}
_PER_TENSOR_SITES = (
    ("activation [M, 32], both layouts", _PER_TENSOR),
    ("gradient [M, 3] E5M2, both layouts", {"_amax_partials_kernel": 2, "_scale_cast_kernel": 2}),
    ("activation [M, 32], as it lies", _PER_TENSOR),
    ("weight [32, 32], both layouts", {"_scale_cast_kernel": 1}),
)
VARIANTS = {
    **{f"quantise {recipe}: {what}": kernels
       for recipe in ("delayed", "current") for what, kernels in _PER_TENSOR_SITES},
    **{f"quantise rowwise: {what}": {"_rowwise_both_kernel": 1, "_rowwise_kernel": 2}
       for what in ("activation [M, 32], both layouts", "gradient [M, 3] E5M2, both layouts")},
    "quantise rowwise: activation [M, 32], as it lies":
        {"_rowwise_kernel": 2, "_row_statistics_kernel": 1},
    "quantise rowwise: weight [32, 32], both layouts": {"_rowwise_both_kernel": 1},
    "FP8 GEMM (triton): forward [M, 32] x [32, 32]": {"_mm_kernel": 2},
    "FP8 GEMM (triton): weight gradient [32, M] x [M, 32]":
        {"_mm_kernel": 2, "_split_sum_kernel": 1},
    "padded copy: [M, 3] to [pad(M), 16]": {"_padded_copy_kernel": 1},
    "hash grid (triton): forward, M points": {"_forward_kernel": 1},
    "hash grid (triton): backward, M points": {"_backward_kernel": 1},
    "fused loss: smoothness partials [M, 4]": {"_kd_partials_kernel": 2},
    "fused loss: smoothness gradient [M, 4]": {"_kd_grad_kernel": 2},
    "fused loss: image partials (l1), 512^2 x 4": {"_partials_kernel": 1},
}  # fmt: skip


def test_each_kernel_compiles_the_variants_its_specialised_arguments_allow(probed):
    results, _ = probed
    assert set(results) == set(VARIANTS)
    for site, result in results.items():
        assert set(result["variants"]) == set(VARIANTS[site]), site
        for kernel, variants in result["variants"].items():
            assert variants <= VARIANTS[site][kernel], (site, kernel, variants)
