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
