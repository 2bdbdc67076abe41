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
    capsys.readouterr()
    assert check_main(["--device-b", "xyz"]) == 2  # named by the flag that set it
    assert capsys.readouterr().err.startswith("mptex-check: error: --device-b: not a device: 'xyz'")


def test_an_arm_the_bounds_do_not_model_is_refused_with_the_reason(capsys):
    # The fused network and the quantised arms round otherwise than to their dtypes.
    for arm, why in (("tcnn_fused", "'tcnn_fused' rounds otherwise than to its dtypes"),
                     ("fp8", "'fp8' rounds otherwise than to its dtypes"),
                     ("f99", "no arm 'f99'")):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            check_main(["--b", arm])
        assert info.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"mptex-check: error: argument --b: {why}"), last
        assert last.endswith("; one of nvdiffrec, f32, f16_naive, f16_static, f16_dynamic, amp, "
                             "bf16, per_layer, nvdiffrec_scale1, bf16_grid")  # fmt: skip


def test_texture_config_yaml(tmp_path, capsys):
    config = ROOT / "configs" / "texture" / "default.yaml"
    small = tmp_path / "small.yaml"
    small.write_text(
        config.read_text()
        .replace("n_levels: 16", "n_levels: 2")
        .replace("log2_hashmap_size: 19", "log2_hashmap_size: 10")
    )
    assert check_main(["--texture-config", str(small), "--b", "bf16", "--points", "256"]) == 0
