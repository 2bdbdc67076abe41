"""What the report collects from a sweep's folders, at its edges, against hand-built run folders.

Which folders are jobs and which are sweeps, how a run's status is decided from its
``metrics.json`` (refused for a missing backend or for another reason, interrupted, a PSNR that
is no number), which of its statistics are kept (top-level values, counts, maxima and means of
the sampled history), how seeds are ordered and how runs are grouped into rows, and what the
attribution of the fused network's gap (``mptex.report.attribution``) pairs and computes.
Every expected value is worked out in the comments.
"""

import json
from pathlib import Path

import pytest
from report_runs import metrics as _metrics
from report_runs import write_run as _write

from mptex.report import attribution as attr
from mptex.report.collect import (
    collect_runs,
    find_sweeps,
    partial_keys,
    planned_jobs,
    shown_keys,
    sorted_seeds,
    swept_keys,
)

_TCNN_REFUSED = "precision.mlp_backend='tcnn' needs tinycudann and a CUDA device"


def _dirs(folder):
    return [r["run_dir"] for r in collect_runs(folder)]


def _hydra_config(job: Path, arm: str, seed: int) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(
        f"precision:\n  name: {arm}\nscene:\n  name: builtin\ntrain:\n  seed: {seed}\n"
    )


# ----------------------------------------------------------------------------- jobs and sweeps
def test_a_runs_time_over_all_its_processes_is_collected(tmp_path):
    # results.csv / results.json are where "each arm cost X GPU-hours" is read from: a run
    # stopped and continued cost its totals, not its last process's wall_time_s
    totals = {"wall_time_total_s": 4.0, "train_time_total_s": 3.0, "time_total_complete": False}
    _write(tmp_path, "f0", _metrics("f32", 0, wall_time_s=1.5, train_time_s=1.0, **totals))
    _write(tmp_path, "f1", _metrics("f32", 1))  # a record from before the totals
    runs = {run["seed"]: run for run in collect_runs(tmp_path)}
    assert {k: runs[0][k] for k in totals} == totals and runs[0]["wall_time_s"] == 1.5
    assert [runs[1][k] for k in totals] == [None] * 3


def test_the_sweeps_own_hydra_folder_is_not_a_job(tmp_path):
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    _hydra_config(tmp_path, "f32", 0)
    _write(tmp_path, "0", _metrics("f32", 0))
    assert _dirs(tmp_path) == ["0"]


def test_submitit_folders_hold_no_jobs_and_no_sweeps(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0))
    _write(tmp_path, ".submitit/123", _metrics("bf16", 0))
    _hydra_config(tmp_path / ".submitit" / "124", "bf16", 1)
    (tmp_path / ".submitit" / "multirun.yaml").write_text("hydra: {}\n")
    assert _dirs(tmp_path) == ["0"]
    assert find_sweeps(tmp_path) == [tmp_path.resolve()]


def test_a_sweep_folder_that_is_its_own_job_belongs_to_its_sweep(tmp_path):
    # sweep a ran its one job in its own folder; sweep b in a subfolder: no job is loose.
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "multirun.yaml").write_text("hydra: {}\n")
    (tmp_path / "a" / "metrics.json").write_text(json.dumps(_metrics("f32", 0)))
    _write(tmp_path / "b", "0", _metrics("f32", 0))
    root = tmp_path.resolve()
    assert find_sweeps(tmp_path) == [root / "a", root / "b"]
    assert _dirs(tmp_path / "a") == ["."]


# ----------------------------------------------------------------------------- statuses
def _refused(failed_at="start", versions=None, error=_TCNN_REFUSED):
    m = _metrics("tcnn_fused", 0, status="failed", failed_at=failed_at, error=error)
    m["config"]["precision"]["mlp_backend"] = "tcnn"
    if versions is not None:
        m["versions"] = versions
    return m


@pytest.mark.parametrize(
    "metrics, status",
    [
        (_refused(), "unavailable"),  # refused at start, tcnn_available: false
        (_refused(versions={"torch": "x"}), "failed"),  # availability not recorded
        (_refused(versions={"torch": "x", "tcnn_available": None}), "failed"),
        (_refused(failed_at="iteration 7"), "failed"),  # it ran: the backend was not why
    ],
    ids=["missing-backend", "not-recorded", "null-flag", "failed-later"],
)
def test_an_arm_is_unavailable_only_where_the_machine_said_it_lacked_the_backend(
    tmp_path, metrics, status
):
    _write(tmp_path, "0", metrics)
    (run,) = collect_runs(tmp_path)
    assert run["status"] == status
    assert run["error"] == _TCNN_REFUSED


@pytest.mark.parametrize("psnr", ["31.5", True, None])
def test_a_completed_run_whose_psnr_is_no_number_is_diverged(tmp_path, psnr):
    m = _metrics("f32", 0)
    m["psnr"] = psnr
    _write(tmp_path, "0", m)
    (run,) = collect_runs(tmp_path)
    assert run["status"] == "diverged"
    assert run["note"] == "recorded as completed, but its PSNR is not a finite number"


def test_an_unknown_status_is_a_failed_run_that_says_so(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, status="finished"))
    (run,) = collect_runs(tmp_path)
    assert (run["status"], run["note"]) == ("failed", "unknown status 'finished'")


@pytest.mark.parametrize(
    "tries, tail",
    [
        ([], ""),
        ([{"error": "disk full"}], "; 1 attempt to continue it failed at start, the last: "
                                   "disk full"),
        ([{"error": "out of memory"}, {"error": "disk full"}],
         "; 2 attempts to continue it failed at start, the last: disk full"),
    ],
)  # fmt: skip
def test_an_interrupted_run_is_failed_with_its_signal_and_its_last_failed_resume(
    tmp_path, tries, tail
):
    m = _metrics("f32", 0, status="interrupted", signal="SIGTERM", interrupted_at=40,
                 start_failures=tries)  # fmt: skip
    _write(tmp_path, "0", m)
    (run,) = collect_runs(tmp_path)
    assert (run["status"], run["note"]) == ("failed", None)
    assert run["error"] == "interrupted by SIGTERM after iteration 40 and not resumed" + tail


# ----------------------------------------------------------------------------- statistics
def test_a_top_level_underflow_value_wins_over_its_history_mean(tmp_path):
    # net.0.grad_zero_frac: 0.9 at the top level, 0.25 in the history: 0.9.
    # encoder.grad_subnormal_frac only in the history: the mean of 0.1 and 0.4, 0.25.
    m = _metrics("f16_static", 0, **{"net.0.grad_zero_frac": 0.9})
    m["history"][0]["encoder"] = {"grad_subnormal_frac": 0.1}
    m["history"][1]["encoder"] = {"grad_subnormal_frac": 0.4}
    _write(tmp_path, "0", m)
    (run,) = collect_runs(tmp_path)
    assert run["underflow"] == {"encoder.grad_subnormal_frac": pytest.approx(0.25),
                                "net.0.grad_zero_frac": 0.9}  # fmt: skip


def test_quantisation_counts_take_the_last_sample_amax_the_largest_others_the_mean(tmp_path):
    m = _metrics("fp8", 0)
    m["history"] = [
        {"iteration": i, "psnr": 30.0, "net.0.q_grad_overflows": count,
         "net.0.q_grad_amax": amax, "net.0.q_grad_rel_error": error}
        for i, (count, amax, error) in enumerate([(4, 0.5, 0.1), (9, 2.0, 0.2), (6, 1.0, 0.6)])
    ]  # fmt: skip
    _write(tmp_path, "0", m)
    (run,) = collect_runs(tmp_path)
    assert run["quantization"] == {"net.0.q_grad_amax": 2.0, "net.0.q_grad_overflows": 6.0,
                                   "net.0.q_grad_rel_error": pytest.approx(0.3)}  # fmt: skip


# ----------------------------------------------------------------------------- identity, order
def test_an_auto_device_takes_the_sweeps_device_only_where_the_others_agree(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, config={"train.device": "cpu"}))
    _write(tmp_path, "1", _metrics("f32", 1, config={"train.device": "auto"}))
    assert [r["config"]["train.device"] for r in collect_runs(tmp_path)] == ["cpu", "cpu"]
    _write(tmp_path, "2", _metrics("f32", 2, config={"train.device": "cuda"}))
    got = [r["config"]["train.device"] for r in collect_runs(tmp_path)]
    assert got == ["cpu", "auto", "cuda"]


def test_sorted_seeds_leave_out_none_and_put_numbers_first_by_value():
    assert sorted_seeds([None, 10, "b", 2, 0, 2, None]) == ["0", "2", "10", "b"]


def test_a_folder_holding_multirun_yaml_is_one_sweep_whatever_lies_below(tmp_path):
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    _write(tmp_path, "0", _metrics("f32", 0))
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "multirun.yaml").write_text("hydra: {}\n")
    _write(tmp_path / "inner", "0", _metrics("bf16", 0))
    assert find_sweeps(tmp_path) == [tmp_path.resolve()]
    assert _dirs(tmp_path) == ["0", "inner/0"]


def test_an_empty_per_image_list_gives_no_view_count(tmp_path):
    _write(tmp_path, "0", _metrics("f32", 0, psnr_per_image=[]))
    _write(tmp_path, "1", _metrics("f32", 1, psnr_per_image=[30.0, 31.0, 29.0]))
    got = [(r["val_views"], r["val_spp"]) for r in collect_runs(tmp_path)]
    assert got == [(None, None), (3, 1)]


# ----------------------------------------------------------------------------- rows
def test_list_values_compare_by_content_whatever_their_keys_order(tmp_path):
    # A list of mappings (a schedule) written with its keys in another order: the same value.
    for seed, schedule in enumerate(([{"at": 10, "lr": 0.1}], [{"lr": 0.1, "at": 10}])):
        config = {"train.schedule": schedule}
        _write(tmp_path, f"{seed}", _metrics("f32", seed, config=config))
    _write(tmp_path, "2", _metrics("f32", 2, config={"train.schedule": [{"at": 20, "lr": 0.1}]}))
    runs = collect_runs(tmp_path)
    assert swept_keys(runs[:2]) == [] and swept_keys(runs) == ["train.schedule"]


def test_the_seed_and_how_a_run_was_driven_are_never_partial_keys():
    # train.seed and train.resume that some hand-made configs lack are no other mptex version.
    runs = [{"config": {"train.seed": 0, "train.resume": True, "train.lr": 0.1}},
            {"config": {"train.lr": 0.1}}, {"config": None}]  # fmt: skip
    assert partial_keys(runs) == {}
    runs[1]["config"]["texture.levels"] = 8
    assert partial_keys(runs) == {"texture.levels": [8]}


def test_a_key_is_shown_unless_every_arm_has_one_value_of_it():
    # f16_static at scales 64 and 1024, f32 at 128 only: the scale is a setting swept within
    # an arm, shown; the loss scaling follows from the arm, not shown.
    runs = [{"config": {"precision.name": arm, "precision.static_loss_scale": scale,
                        "precision.loss_scaling": "static" if arm != "f32" else "none"}}
            for arm, scale in (("f16_static", 64), ("f16_static", 1024), ("f32", 128))]  # fmt: skip
    keys = ["precision.name", "precision.loss_scaling", "precision.static_loss_scale"]
    assert shown_keys(runs, keys) == ["precision.name", "precision.static_loss_scale"]


def test_a_sweeper_other_than_hydras_basic_one_has_no_planned_job_count(tmp_path):
    sweeper = ("hydra:\n  sweeper:\n    _target_: hydra_plugins.hydra_optuna_sweeper."
               "optuna_sweeper.OptunaSweeper\n    params:\n      train.seed: 0,1\n")  # fmt: skip
    (tmp_path / "multirun.yaml").write_text(sweeper)
    assert planned_jobs(tmp_path) is None
    basic = sweeper.replace("hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
                            "hydra._internal.core_plugins.basic_sweeper.BasicSweeper")  # fmt: skip
    (tmp_path / "multirun.yaml").write_text(basic)
    assert planned_jobs(tmp_path) == 2


# ----------------------------------------------------------------------------- gap attribution
def _run(arm, seed, psnr, history=(), mlp=None, status="completed", run_dir=None):
    """A collected, grouped run of one context (only the arm is swept)."""
    return {"precision": arm, "seed": seed, "psnr": psnr, "status": status,
            "run_dir": run_dir or f"{arm}_{seed}", "keys": {"precision.name": arm},
            "history": list(history), "mlp_backend": mlp, "encoder_backend": None}  # fmt: skip


def test_the_attribution_applies_only_with_both_ends_of_the_gap():
    assert not attr.applies([_run(attr.SWAP, 0, 28.0), _run("tcnn_fused", 0, 28.0)])
    assert not attr.applies([_run(attr.BASE, 0, 30.0)])
    assert attr.applies([_run(attr.SWAP, 0, 28.0), _run(attr.BASE, 0, 30.0)])


def test_two_completed_runs_of_one_arm_and_seed_are_refused():
    runs = [_run(attr.BASE, 0, 30.0), _run(attr.BASE, 0, 31.0, run_dir="again"),
            _run(attr.SWAP, 0, 28.0)]  # fmt: skip
    with pytest.raises(ValueError, match=r"`nvdiffrec` has two completed runs with seed 0 "
                       r"\(nvdiffrec_0, again\)"):  # fmt: skip
        attr.attribution(runs, 0.5)


def test_a_switch_term_is_mixed_only_where_both_arms_recorded_different_backends():
    # tcnn_fused ran tinycudann's network; f32acc's runs recorded no backend (older runs) and
    # nosplitk's the twin: f32acc - tcnn_fused = +1.00 (29 - 28, 29.5 - 28.5), not flagged.
    runs = []
    for seed in (0, 1):
        runs += [_run("tcnn_fused", seed, 28.0 + 0.5 * seed, mlp="tcnn"),
                 _run("tcnn_fused_f32acc", seed, 29.0 + 0.5 * seed),
                 _run("tcnn_fused_nosplitk", seed, 28.0, mlp="torch")]  # fmt: skip
    f32acc, nosplitk = attr.attribution(runs, 0.5)["switches"][:2]
    assert f32acc["n"] == 2 and f32acc["final"]["mean"] == pytest.approx(1.0)
    assert f32acc["mixed"] is None
    assert nosplitk["mixed"] == ("network: `tcnn_fused_nosplitk` ran torch, `tcnn_fused` tcnn")


def test_precision_statistics_are_means_over_samples_then_over_seeds_of_arms_that_ran():
    # seed 0 samples 0.1 and 0.3 (mean 0.2), seed 1 one sample 0.6: (0.2 + 0.6) / 2 = 0.4
    # (pooled over the three samples it would be 0.333).
    key = "net.0.fused_zero_frac"
    runs = [_run("tcnn_fused", 0, 28.0, history=[{key: 0.1}, {key: 0.3}]),
            _run("tcnn_fused", 1, 28.0, history=[{key: 0.6}]),
            _run("tcnn_fused_f32acc", 0, 29.0), _run("tcnn_fused_f32acc", 1, 29.0),
            _run("tcnn_fused_dynamic", 0, None, status="diverged")]  # fmt: skip
    stats = attr.attribution(runs, 0.5)["statistics"]
    assert list(stats) == ["tcnn_fused", "tcnn_fused_f32acc"]
    assert stats["tcnn_fused"] == {key: pytest.approx(0.4)} and stats["tcnn_fused_f32acc"] == {}


def test_the_gap_pairs_every_shared_seed_and_its_table_ends_at_the_last_validation():
    # Four seeds; 14 validations (10 ... 140): every second one shown (14 // 6 = 2) and the
    # last; the swap trails by 1 dB everywhere. A history PSNR that is no number is skipped.
    its = [10 * (k + 1) for k in range(14)]
    runs = []
    for seed in range(4):
        for arm, offset in ((attr.BASE, 0.0), (attr.SWAP, -1.0)):
            history = [{"iteration": it, "psnr": 20.0 + offset + it / 100} for it in its]
            history.append({"iteration": 150, "psnr": "n/a"})
            runs.append(_run(arm, seed, 30.0 + seed + offset, history=history))
    result = attr.attribution(runs, 0.5)
    assert result["gap"]["n"] == 4 and result["gap"]["final"]["mean"] == pytest.approx(-1.0)
    assert list(result["gap"]["curve"]) == its
    lines = attr.render(result, 0.5, plotted=False)
    assert "| iteration | 10 | 30 | 50 | 70 | 90 | 110 | 130 | 140 |" in lines


def test_rows_are_grouped_by_their_context_first_then_by_arm(tmp_path):
    # Two scenes and two arms: the rows of one scene come together (the reference first, then
    # the arms in ARM_ORDER), whatever the order of the folders; arm-major order would
    # interleave the scenes (duck f32, spot f32, duck bf16, spot bf16).
    from mptex.report.collect import group_runs

    for arm in ("bf16", "f32"):
        for scene in ("spot", "duck"):
            for seed in range(2):
                _write(tmp_path, f"{arm}_{scene}_{seed}", _metrics(arm, seed, scene=scene))
    keys, groups, duplicates, unidentified = group_runs(collect_runs(tmp_path))
    assert keys == ["precision.name", "scene.name"]
    assert [(g[0]["scene"], g[0]["precision"]) for g in groups] == [
        ("duck", "f32"), ("duck", "bf16"), ("spot", "f32"), ("spot", "bf16")
    ]  # fmt: skip
    assert [[r["seed"] for r in g] for g in groups] == [[0, 1]] * 4
    assert duplicates == [] and unidentified == []
