"""mptex-rescore: a finished run's checkpoint scored again, at its own and other
validation settings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir

from mptex.cli import CONFIG_DIR, rescore
from mptex.train import train


def _run(tmp_path, *extra: str):
    overrides = [
        "texture=tiny", "train=tiny", "train.iterations=4", "train.val_interval=0",
        "scene.resolution=24", "scene.n_train_views=2", "scene.n_val_views=2",
        "scene.tubular_segments=48", "scene.radial_segments=8", "train.device=cpu", *extra,
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    run_dir = tmp_path / "run"
    metrics = train(cfg, run_dir)
    return run_dir, metrics


def test_own_setting_reproduces_the_runs_psnr_and_others_differ(tmp_path, capsys):
    run_dir, metrics = _run(tmp_path, "train.val_spp=2")
    out = tmp_path / "scores.json"
    assert rescore.rescore_main([str(run_dir), "--val-spp", "2", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["scores"]
    own, point = rows
    # validation draws no random number and reads the texture only: the same bits
    assert own["val_spp"] == 2 and own["psnr"] == metrics["psnr"] == own["own"]
    assert own["psnr_per_image"] == metrics["psnr_per_image"]
    assert own["baseline_psnr"] == metrics["baseline_psnr"]
    # another setting is another score (and is not labelled as the run's own)
    assert point["val_spp"] == 1 and point["own"] is None and point["psnr"] != own["psnr"]
    assert "equal" in capsys.readouterr().out


def test_more_views_are_scored_when_asked(tmp_path):
    run_dir, _ = _run(tmp_path)
    (rows,) = rescore.rescore(run_dir, [1], torch.device("cpu"), n_val_views=3)
    assert rows["n_val_views"] == 3 and len(rows["psnr_per_image"]) == 3 and rows["own"] is None


def test_the_summary_keeps_runs_of_different_configs_apart(tmp_path, capsys):
    # Two f32 runs of one seed that differ in train.iterations are not two samples of one
    # setting: each gets its own summary row, which names the key that differs, and its mean
    # is its own PSNR (one run: no spread).
    short, short_metrics = _run(tmp_path / "a", "train.iterations=2")
    long, long_metrics = _run(tmp_path / "b", "train.iterations=4")
    assert short_metrics["psnr"] != long_metrics["psnr"]
    assert rescore.rescore_main([str(short), str(long)]) == 0
    summary = capsys.readouterr().out.strip().split("\n\n")[-1].splitlines()
    assert [c.strip() for c in summary[0].strip("|").split("|")] == [
        "scene", "arm", "config", "val_spp", "runs", "mean ± sample std (dB)"
    ]  # fmt: skip
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in summary[2:]]
    assert cells == [
        ["builtin", "f32", "train.iterations=2", "1", "1", f"{short_metrics['psnr']:.2f} ± -"],
        ["builtin", "f32", "train.iterations=4", "1", "1", f"{long_metrics['psnr']:.2f} ± -"],
    ]


def test_a_seed_scored_twice_counts_once_in_the_summary(tmp_path, capsys):
    # A copy of a run (the same config and seed) is one sample of the setting, not two: the
    # summary's mean is its PSNR with no spread, as the report counts such a repeat once.
    first, metrics = _run(tmp_path / "a")
    copy = tmp_path / "b" / "run"
    shutil.copytree(first, copy)
    assert rescore.rescore_main([str(first), str(copy)]) == 0
    captured = capsys.readouterr()
    summary = captured.out.strip().split("\n\n")[-1].splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in summary[2:]]
    assert cells == [["builtin", "f32", "1", "1", f"{metrics['psnr']:.2f} ± -"]]
    assert f"{copy}: seed 0 again (as {first}): counted once in the summary" in captured.err


def test_the_runs_own_view_count_given_explicitly_is_still_its_own_setting(tmp_path):
    # --n-val-views 2 is the run's scene.n_val_views: the same views, so the same score, and
    # the run's own PSNR is shown beside it as at the default.
    run_dir, metrics = _run(tmp_path)
    (rows,) = rescore.rescore(run_dir, [1], torch.device("cpu"), n_val_views=2)
    assert rows["psnr"] == metrics["psnr"] == rows["own"]


def test_bad_arguments_fail_with_one_line(tmp_path, capsys):
    assert rescore.rescore_main([str(tmp_path), "--val-spp", "0"]) == 2
    expected = "mptex-rescore: error: --val-spp: expected integers in [1, 16], got [0]"
    assert capsys.readouterr().err.strip() == expected
    for flag, message in (
        ("--threads", "--threads: expected an integer >= 1, got 0"),
        ("--n-val-views", "--n-val-views: expected an integer >= 1, got 0"),
    ):
        assert rescore.rescore_main([str(tmp_path), flag, "0"]) == 2  # fmt: skip
        assert capsys.readouterr().err.strip() == f"mptex-rescore: error: {message}"
    assert rescore.rescore_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no checkpoint.pt (not a finished mptex-train run)") and "\n" not in err
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert rescore.rescore_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mptex-rescore: error: ") and "checkpoint.pt" in err and "\n" not in err
    if not torch.cuda.is_available():  # a GPU asked for on a machine without one
        assert rescore.rescore_main([str(tmp_path), "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == "mptex-rescore: error: --device: cuda requested but CUDA is not available"
    assert rescore.rescore_main([str(tmp_path), "--device", "gpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mptex-rescore: error: --device: expected a torch device such as cpu, cuda or cuda:1, "
        "got 'gpu'"
    )
    missing = tmp_path / "nonexistent"
    assert rescore.rescore_main([str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"mptex-rescore: {missing}: no such run directory"


def test_a_gpu_runs_backends_fall_back_where_they_cannot_run(tmp_path, recwarn):
    # A run trained with nvdiffrast and tinycudann's grid, rescored on a machine without them:
    # the same parameters and views with the device's defaults, the run's own PSNR again, and
    # a warning for each.
    from mptex._backends import has_nvdiffrast, has_tcnn

    if has_nvdiffrast() or has_tcnn():
        pytest.skip("needs a machine without nvdiffrast and tinycudann")
    run_dir, metrics = _run(tmp_path)
    path = run_dir / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=False)
    ckpt["config"]["scene"]["raster_backend"] = "nvdiffrast"
    ckpt["config"]["texture"]["backend"] = "tcnn"
    torch.save(ckpt, path)
    (rows,) = rescore.rescore(run_dir, [1], torch.device("cpu"))
    assert rows["psnr"] == metrics["psnr"] == rows["own"]
    said = [str(w.message) for w in recwarn]
    for start in ("scene.raster_backend: the run's 'nvdiffrast' cannot run",
                  "texture.backend: the checkpoint's 'tcnn' cannot run"):  # fmt: skip
        assert any(m.startswith(start) for m in said), (start, said)


def test_a_batch_scores_each_run_once_skips_one_without_checkpoint_and_names_unfinished_ones(
    tmp_path, capsys
):
    run_dir, metrics = _run(tmp_path)
    diverged = tmp_path / "diverged"  # a diverged run writes no checkpoint
    diverged.mkdir()
    out = tmp_path / "scores.json"
    argv = [str(run_dir), str(run_dir / "."), str(diverged), "--json", str(out)]
    assert rescore.rescore_main(argv) == 0
    (row,) = json.loads(out.read_text())["scores"]
    assert row["psnr"] == metrics["psnr"] and row["iterations"] == 4
    assert row["status"] == "completed"
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "mptex-rescore: 1 run directory given more than once: each is scored once",
        f"mptex-rescore: {diverged}: no checkpoint.pt (not a finished mptex-train run)",
    ]
    assert rescore.rescore_main([str(diverged)]) == 2  # nothing left to score
    capsys.readouterr()
    # several runs, none of them scored: each says why, and a last line says none was
    missing, gone = tmp_path / "missing", tmp_path / "gone"
    assert rescore.rescore_main([str(diverged), str(missing), str(gone)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mptex-rescore: {diverged}: no checkpoint.pt (not a finished mptex-train run)",
        f"mptex-rescore: {missing}: no such run directory",
        f"mptex-rescore: {gone}: no such run directory",
        "mptex-rescore: error: none of the 3 run directories could be scored",
    ]
    # What the run's metrics.json says of why there are no weights, where it says so.
    (diverged / "metrics.json").write_text(json.dumps({"status": "diverged", "diverged_at": 0}))
    assert rescore.rescore_main([str(diverged)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mptex-rescore: {diverged}: the run diverged at iteration 0 before its first "
        "checkpoint: no weights"
    )
    from mptex.cli.export import export_main

    assert export_main([str(diverged)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mptex-export: error: {diverged}: the run diverged at iteration 0 before its first "
        "checkpoint: no weights"
    )
    # A run stopped before its last iteration: its checkpoint is scored, and said to be early.
    record = json.loads((run_dir / "metrics.json").read_text())
    record["status"] = "interrupted"
    (run_dir / "metrics.json").write_text(json.dumps(record))
    assert rescore.rescore_main([str(run_dir)]) == 0
    assert capsys.readouterr().err.strip() == (
        f"mptex-rescore: {run_dir}: scoring a checkpoint of 4 of 4 iterations (the run is "
        "interrupted)"
    )


def test_unfinished_note_says_what_a_checkpoint_holds(tmp_path):
    from mptex.train.checkpoint import unfinished_note

    ckpt = {"iteration": 3, "config": {"train": {"iterations": 8}}}
    assert unfinished_note(ckpt, tmp_path) == (
        "a checkpoint of 3 of 8 iterations (the run is without a readable metrics.json)"
    )
    (tmp_path / "metrics.json").write_text('{"status": "interrupted"}')
    assert unfinished_note(ckpt, tmp_path).endswith("(the run is interrupted)")
    (tmp_path / "metrics.json").write_text('{"status": "completed"}')
    assert unfinished_note({**ckpt, "iteration": 8}, tmp_path) is None
    assert unfinished_note(ckpt, tmp_path) is not None  # fewer iterations than planned
    # The caller's reading is judged, not the file: a job that rewrote metrics.json since
    # (here: interrupted) does not change what the caller scored against.
    (tmp_path / "metrics.json").write_text('{"status": "interrupted"}')
    done = {**ckpt, "iteration": 8}
    assert unfinished_note(done, tmp_path, {"status": "completed"}) is None
    assert unfinished_note(done, tmp_path, {}).endswith(
        "(the run is without a readable metrics.json)"
    )


@pytest.mark.parametrize(
    "content",
    ['{"status": "completed", "psnr": 3', "[1, 2]", '"completed"', '{"psnr": "40.1"}'],
    ids=["corrupt", "a list", "a string", "psnr not a number"],
)
def test_an_unreadable_metrics_file_scores_the_checkpoint_and_says_so(tmp_path, capsys, content):
    # The checkpoint holds the weights; metrics.json only gives the run's own PSNR and status.
    # Where it is not a readable mapping, the weights are still scored, nothing is compared
    # with an own PSNR, and the run's status is said to be unknown.
    run_dir, metrics = _run(tmp_path)
    (run_dir / "metrics.json").write_text(content)
    out = tmp_path / "scores.json"
    assert rescore.rescore_main([str(run_dir), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["scores"]
    assert row["psnr"] == metrics["psnr"] and row["own"] is None
    assert capsys.readouterr().err.splitlines() == [
        f"mptex-rescore: {run_dir}: scoring a checkpoint of 4 of 4 iterations (the run is "
        "without a readable metrics.json)"
    ]


def test_a_sweep_folder_is_scored_as_its_run_directories(tmp_path, capsys):
    # A sweep folder as mptex-train -m leaves it: multirun.yaml, the report's files and one
    # directory per job (here two seeds, and a diverged job without checkpoint.pt).
    sweep = tmp_path / "sweep"
    runs = {seed: _run(sweep / f"{seed}_train.seed={seed}", f"train.seed={seed}")
            for seed in (0, 1)}  # fmt: skip
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "report.md").write_text("")
    diverged = sweep / "2_train.seed=2"
    diverged.mkdir()
    (diverged / "metrics.json").write_text(json.dumps({"status": "diverged", "diverged_at": 0}))
    out = tmp_path / "scores.json"
    assert rescore.rescore_main([str(sweep), "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["scores"]
    assert sorted(row["seed"] for row in scores) == [0, 1]
    for row in scores:
        assert row["psnr"] == runs[row["seed"]][1]["psnr"] == row["own"]
    assert capsys.readouterr().err.splitlines() == [
        f"mptex-rescore: {sweep}: a sweep folder; scoring its 3 run directories",
        f"mptex-rescore: {diverged}: the run diverged at iteration 0 before its first "
        "checkpoint: no weights",
    ]
    # Without multirun.yaml (runs copied into a folder): the same runs, so named.
    (sweep / "multirun.yaml").unlink()
    assert rescore.rescore_main([str(sweep)]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"mptex-rescore: {sweep}: a folder of runs; scoring its 3 run directories"
    )


def test_a_run_directory_without_checkpoint_is_not_taken_for_a_sweep_folder(tmp_path, capsys):
    # A diverged run's directory holds metrics.json (and Hydra's .hydra/) but no checkpoint.pt:
    # it is the run, named as such, not a folder of runs.
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}\n")
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "diverged", "diverged_at": 0}))
    assert rescore.rescore_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mptex-rescore: {tmp_path}: the run diverged at iteration 0 before its first "
        "checkpoint: no weights",
    ]
