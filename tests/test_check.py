"""The mptex-check command: a real subprocess run on a healthy model, exit codes, JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mptex.cli.check import check_main

ROOT = Path(__file__).resolve().parents[1]


def test_cli_f32_vs_f16_dynamic_passes(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "mptex.cli.check", "--a", "f32", "--b", "f16_dynamic",
         "--points", "2048", "--seed", "0", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "B: every stage within its dtype's bound" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["stages"][0] == "encoder"
    assert report["info"]["loss_scale"]["f16_dynamic (cpu, torch, train)"] == 65536.0


def test_check_main_modes_and_bad_arguments(capsys):
    assert check_main(["--a", "f32", "--b", "amp", "--mode-b", "no_grad", "--points", "256"]) == 0
    assert "n/a" in capsys.readouterr().out
    assert check_main(["--points", "0"]) == 2
    assert check_main(["--texture-config", "/nonexistent.yaml"]) == 2
    with pytest.raises(SystemExit):
        check_main(["--a", "nonsense"])


def test_texture_config_yaml(tmp_path, capsys):
    config = ROOT / "configs" / "texture" / "default.yaml"
    small = tmp_path / "small.yaml"
    small.write_text(
        config.read_text()
        .replace("n_levels: 16", "n_levels: 2")
        .replace("log2_hashmap_size: 19", "log2_hashmap_size: 10")
    )
    assert check_main(["--texture-config", str(small), "--b", "bf16", "--points", "256"]) == 0
