"""The real ``mptex-train`` CLI in a subprocess (each start costs ~2 s of Hydra, so few)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
        # an interpolation that does not resolve: a variable that is not set
        (["train.lr=${oc.env:MPTEX_TEST_UNSET_VARIABLE}"], "train.lr"),
        pytest.param(
            ["precision=tcnn_fused", "precision.mlp_backend=tcnn"], "precision.mlp_backend",
            marks=pytest.mark.skipif(_backends.has_tcnn(), reason="tcnn is available here"),
        ),
    ],
)  # fmt: skip
def test_cli_config_errors_are_one_line_naming_the_key(tmp_path, args, key):
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    # "<key>: <what>", or "<key>=<value> needs ..." for a value this machine cannot run
    named = lines[0].startswith(f"mptex-train: error: {key}:") or lines[0].startswith(
        f"mptex-train: error: {key}="
    )
    assert lines == [lines[0]] and named, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "command, prog",
    [(["mptex.cli.search"], "mptex-search"),
     # mptex-train's alias of the search, which runs it before training would
     (["mptex.cli", "+experiment=precision_search"], "mptex-train")],
)  # fmt: skip
def test_the_search_says_an_interpolation_that_does_not_resolve_in_one_line(
    tmp_path, command, prog
):
    env = {k: v for k, v in os.environ.items() if k != "MPTEX_TEST_UNSET_VARIABLE"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", *command, f"hydra.run.dir={tmp_path}",
           "train.lr=${oc.env:MPTEX_TEST_UNSET_VARIABLE}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    # OmegaConf's words for an unset variable, after the key it names
    assert proc.stderr.splitlines() == [
        f"{prog}: error: train.lr: KeyError raised while resolving interpolation: "
        "\"Environment variable 'MPTEX_TEST_UNSET_VARIABLE' not found\""
    ]


def test_cli_unsupported_obj_feature_is_one_line_naming_file_and_line(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    folder = tmp_path / "my asset"
    folder.mkdir()
    Image.new("RGB", (2, 2)).save(folder / "t.png")
    (folder / "m.mtl").write_text("newmtl a\nKd 1 1 1\nmap_Kd -cc on t.png\n")
    (folder / "an asset.obj").write_text(
        "mtllib m.mtl\nv 0 0 0\nv 1 0 0\nv 0 1 0\nv 0 0 1\nvt 0 0\nusemtl a\nf 1/1 2/1 3/1 4/1\n"
    )
    proc = run_cli(tmp_path, "scene=mesh", f"scene.path={folder / 'an asset.obj'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"mptex-train: error: scene.path: {folder / 'm.mtl'}:3: map_Kd option -cc on (colour "
        "correction) is not supported (material 'a', used at line 8)"
    ]


def test_cli_unknown_arm_is_refused_by_hydra(tmp_path):
    proc = run_cli(tmp_path, "precision=f12")
    assert proc.returncode != 0
    assert "precision/f12" in proc.stderr and "Traceback" not in proc.stderr


def _run_after_mptex_train_blas_setup(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (MKL reads ``MKL_CBWR`` once, at its first call)
    after what ``mptex-train`` does first: ``MKL_CBWR`` unset, then ``reproducible_blas()``."""
    setup = (
        "import os; os.environ.pop('MKL_CBWR', None)\n"
        "from mptex.train.runinfo import reproducible_blas; reproducible_blas()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MKL_CBWR", None)
    cmd = [sys.executable, "-c", setup + code]
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


@pytest.mark.golden_bits
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs torch built with MKL")
def test_mptex_train_makes_mkl_gemms_thread_count_independent():
    # A reduction over 20,000 rows, as the MLP's weight gradient over the batch's points: MKL
    # splits it between threads unless its strict reproducibility mode is on at its first call.
    code = (
        "import torch; g = torch.Generator().manual_seed(0)\n"
        "a, b = torch.randn(32, 20000, generator=g), torch.randn(20000, 32, generator=g)\n"
        "torch.set_num_threads(1); one = a @ b\n"
        "torch.set_num_threads(2); two = a @ b\n"
        "print(os.environ['MKL_CBWR'], torch.equal(one, two))\n"
    )
    out = _run_after_mptex_train_blas_setup(code)
    assert out.stdout.split() == ["AUTO,STRICT", "True"], out.stderr


@pytest.mark.golden_bits
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs torch built with MKL")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reduced_precision_linear_layers_are_thread_count_independent(dtype):
    # f16/bf16 layers (f16_dynamic, bf16, amp) with a batch of 33,621 points, as a 128x128 batch
    # of 2 views: forward, dL/dx and dL/dW must give the same bits with 1 and 2 threads (oneDNN's
    # own half GEMM splits the weight gradient's batch reduction between threads; 10,007 and
    # 33,621 rows differed when measured).
    code = (
        "import torch; from mptex.mlp import CastLinear\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"dt = torch.{dtype}\n"
        "outs = []\n"
        "for autocast in (False, True):\n"
        "    lin = CastLinear(32, 64, bias=True, compute_dtype=None if autocast else dt)\n"
        "    x = torch.randn(33621, 32, generator=g); w = torch.randn(33621, 64, generator=g)\n"
        "    for threads in (1, 2):\n"
        "        torch.set_num_threads(threads); lin.zero_grad(); xx = x.clone().requires_grad_()\n"
        "        with torch.autocast('cpu', dtype=dt, enabled=autocast):\n"
        "            y = lin(xx)\n"
        "        (y.float() * w).sum().backward()\n"
        "        outs.append((y, xx.grad, lin.weight.grad, lin.bias.grad))\n"
        "same = [all(torch.equal(a, b) for a, b in zip(outs[i], outs[i + 1])) for i in (0, 2)]\n"
        "print(outs[0][0].dtype == dt, *same)\n"
    )
    out = _run_after_mptex_train_blas_setup(code)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr


def test_help_says_what_the_commands_do(tmp_path):
    # Hydra's own first line ("train is powered by Hydra.") said nothing about mptex.
    proc = run_cli(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("mptex: nvdiffrec's texture optimisation")
    assert any(line.strip().startswith("mptex-train -m") for line in lines[:6])
    assert "precision: amp, bf16" in proc.stdout  # Hydra's list of groups follows


def test_help_points_to_what_an_installed_user_has(tmp_path):
    # An installed wheel has no README.md or docs/: the help names the project's site (mkdocs.yml's
    # repo_url) and the configs' folder inside the installed package (pyproject's package-dir).
    import yaml
    from pyproject_toml import pyproject

    proc = run_cli(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.split("== Configuration groups ==")[0]
    assert "Its README.md and docs/ say more" not in header
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["repo_url"]
    assert site in header
    package_dir = pyproject()["tool"]["setuptools"]["package-dir"]
    assert package_dir["mptex.configs"] == "configs"
    assert "mptex/configs/" in header


def test_mptex_search_adds_its_experiment_where_hydras_parser_takes_it():
    # Hydra's parser takes the overrides as one run of words: in front of "-m a=b" the added
    # experiment made "-m" split them ("unrecognized arguments").
    from hydra._internal.utils import get_args_parser

    from mptex.cli.search import _with_experiment

    exp = "+experiment=precision_search"
    cases = {
        (): [exp],
        ("-m", "scene=a,b"): ["-m", exp, "scene=a,b"],
        ("scene=soccer", "-m"): [exp, "scene=soccer", "-m"],
        ("--config-dir", "d", "train.seed=1"): ["--config-dir", "d", exp, "train.seed=1"],
        ("--info",): [exp, "--info"],
        ("-m", "+experiment=quick"): ["-m", "+experiment=quick"],
    }
    for args, expected in cases.items():
        assert _with_experiment(list(args)) == expected, args
        parsed = get_args_parser().parse_args(expected)
        assert exp in parsed.overrides or "+experiment=quick" in parsed.overrides
