"""The real ``mptex-train`` CLI in a subprocess (each start costs ~2 s of Hydra, so few)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mptex import _backends

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train=tiny", "texture=tiny", "scene.resolution=24", "scene.n_train_views=2",
        "scene.n_val_views=1"]  # fmt: skip


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "mptex.cli", f"hydra.run.dir={tmp_path}", *TINY, *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_cli_trains_and_prints_where_results_are(tmp_path):
    proc = run_cli(tmp_path, "train.iterations=4")
    assert proc.returncode == 0, proc.stderr
    assert f"metrics in {tmp_path / 'metrics.json'}" in proc.stdout
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "completed"
    assert (tmp_path / ".hydra" / "config.yaml").is_file()


def test_cli_diverged_run_is_a_result(tmp_path):
    proc = run_cli(tmp_path, "precision=bf16", "train.inject_nonfinite_at=1")
    assert proc.returncode == 0, proc.stderr
    assert "diverged at iteration 1" in proc.stdout


@pytest.mark.parametrize(
    "args, key",
    [
        (["train.iterations=-5"], "train.iterations"),
        (["scene=mesh", "scene.path=/nonexistent/mesh.obj"], "scene.path"),
        pytest.param(
            ["precision=tcnn_fused", "precision.mlp_backend=tcnn"], "precision.name",
            marks=pytest.mark.skipif(_backends.has_tcnn(), reason="tcnn is available here"),
        ),
    ],
)  # fmt: skip
def test_cli_config_errors_are_one_line_naming_the_key(tmp_path, args, key):
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith(f"mptex-train: error: {key}:"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_unknown_arm_is_refused_by_hydra(tmp_path):
    proc = run_cli(tmp_path, "precision=f12")
    assert proc.returncode != 0
    assert "precision/f12" in proc.stderr and "Traceback" not in proc.stderr
