"""A run's files and its resume against independent references.

The order of an atomic write's flush, fsyncs and rename, a full quota and a full disk seen
through another error, what ``metrics.json`` makes of non-finite numbers, the refusal of a
non-finite weight wherever it is, the one-line errors of a checkpoint that cannot be read, what
``train.resume=auto`` continues, the stop handlers' bookkeeping, and what a resume refuses or
carries over from the checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import threading

import pytest
import torch
from test_loop_edges import _SKIPS, _overflow_at
from test_train import read_metrics, tiny_cfg

from mptex.train import load_checkpoint, train
from mptex.train.checkpoint import (
    CheckpointError,
    DiskFullError,
    atomic_write_bytes,
    disk_full_error,
    export_source,
    save_checkpoint,
    unfinished_note,
    write_metrics,
)
from mptex.train.config import ConfigError
from mptex.train.signals import StopSignals, auto_resume_path, send_signal


# ----------------------------------------------------------------------------- atomic writes
def test_a_write_is_flushed_and_fsynced_before_the_rename_and_the_folder_after(
    tmp_path, monkeypatch
):
    # Durable on a power loss: the file's bytes reach the disk (fsync of the complete file)
    # before the rename makes them the file, and the rename reaches it (fsync of the folder).
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        info = os.fstat(fd)
        events.append(("fsync dir",) if stat.S_ISDIR(info.st_mode) else ("fsync file",
                                                                        info.st_size))  # fmt: skip
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    atomic_write_bytes(tmp_path / "f.bin", lambda f: f.write(b"0123456789"))
    assert events == [("fsync file", 10), ("replace", "f.bin"), ("fsync dir",)]
    assert (tmp_path / "f.bin").read_bytes() == b"0123456789"


def _fails_with(error: BaseException):
    def write(f):
        f.write(b"half")
        raise error

    return write


def test_a_full_quota_is_a_disk_full_error_naming_the_file(tmp_path):
    # EDQUOT is how a full disk looks on a shared cluster filesystem: the same one line.
    path = tmp_path / "metrics.json"
    path.write_bytes(b"old")
    with pytest.raises(DiskFullError) as info:
        atomic_write_bytes(path, _fails_with(OSError(errno.EDQUOT, "quota")))
    assert str(info.value) == f"{path}: disk quota exceeded (EDQUOT); {path} is unchanged"
    assert info.value.filename == str(path)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["metrics.json"]


def test_a_full_disk_behind_another_error_is_found_as_cause_or_context(tmp_path):
    # torch's zip writer turns its file's OSError into a RuntimeError raised while handling it
    # (the OSError is the RuntimeError's __context__); "raise ... from" makes it the __cause__.
    path = tmp_path / "checkpoint.pt"
    for chained in ("context", "cause"):

        def write(f, chained=chained):
            try:
                raise OSError(errno.ENOSPC, "full")
            except OSError as exc:
                if chained == "cause":
                    raise RuntimeError("unexpected pos 64 vs 0") from exc
                raise RuntimeError("unexpected pos 64 vs 0")  # noqa: B904

        with pytest.raises(DiskFullError) as info:
            atomic_write_bytes(path, write)
        assert str(info.value) == (f"{path}: no space left on device (ENOSPC); {path} is unchanged")
        assert not path.exists() and os.listdir(tmp_path) == []
    # not a full disk: the error as it came
    assert disk_full_error(RuntimeError("x"), path) is None
    assert disk_full_error(OSError(errno.EACCES, "denied"), path) is None


def test_an_interrupted_write_leaves_no_temporary_and_the_old_file(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(path, _fails_with(KeyboardInterrupt()))
    with pytest.raises(ValueError, match="^boom$"):
        atomic_write_bytes(path, _fails_with(ValueError("boom")))
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["metrics.json"]


# ----------------------------------------------------------------------------- metrics.json
def test_metrics_write_every_non_finite_float_as_null_at_any_depth(tmp_path):
    inf, nan = float("inf"), float("nan")
    path = write_metrics(tmp_path, {
        "final_loss": inf, "low": -inf, "psnr": nan, "ok": 1.5,
        "history": [{"loss": nan, "psnr": 20.0}, {"loss": (1.0, inf)}],
        "pair": (nan, 2.0), "nested": {"deeper": {"x": -inf}},
    })  # fmt: skip
    assert json.loads(path.read_text()) == {
        "final_loss": None, "low": None, "psnr": None, "ok": 1.5,
        "history": [{"loss": None, "psnr": 20.0}, {"loss": [1.0, None]}],
        "pair": [None, 2.0], "nested": {"deeper": {"x": None}},
    }  # fmt: skip


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_anywhere_is_refused_and_nothing_written(tmp_path, where, bad):
    texture = {name: torch.ones(4, 3) for name in ("grid", "net.0", "net.1", "net.2")}
    name = "grid" if where == "first" else "net.2"
    texture[name] = texture[name].clone()
    texture[name][3, 2] = bad
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(path, {"texture": texture, "iteration": 1})
    assert str(info.value) == f"{path}: refusing to write a checkpoint with non-finite weights"
    assert os.listdir(tmp_path) == []


def test_integer_buffers_of_a_texture_are_no_weights(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"texture": {"w": torch.zeros(2), "offsets": torch.arange(3)}})
    assert torch.equal(load_checkpoint(path)["texture"]["offsets"], torch.arange(3))


def test_a_checkpoint_that_is_no_dict_is_refused_even_without_required_keys(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"{path}: not an mptex checkpoint (holds list)"


def test_a_missing_checkpoint_is_one_line_saying_it_cannot_be_read(tmp_path):
    path = tmp_path / "nowhere" / "checkpoint.pt"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"{path}: cannot read (No such file or directory)"


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '"completed"', '{"status": 3}'])
def test_an_unreadable_or_odd_metrics_json_makes_the_checkpoint_unfinished(tmp_path, text):
    (tmp_path / "metrics.json").write_text(text)
    ckpt = {"iteration": 8, "config": {"train": {"iterations": 8}}}
    assert unfinished_note(ckpt, tmp_path) == (
        "a checkpoint of 8 of 8 iterations (the run is without a readable metrics.json)"
    )


# ----------------------------------------------------------------------------- resume=auto
def _run_dir(tmp_path, metrics: str | None, checkpoint: bool = True):
    if checkpoint:
        (tmp_path / "checkpoint.pt").write_bytes(b"x")
    if metrics is not None:
        (tmp_path / "metrics.json").write_text(metrics)
    return tmp_path


@pytest.mark.parametrize(
    "metrics, resumes",
    [
        ('{"status": "interrupted"}', True),
        ('{"status": "failed", "failed_writing": "/r/checkpoint.pt"}', True),
        ('{"status": "failed", "failed_writing": null}', False),
        ('{"status": "failed"}', False),
        ('{"status": "completed"}', False),
        ('{"status": "diverged"}', False),
        ("[]", False),
        ('"interrupted"', False),
        ("{half", False),
        (None, False),
    ],
)  # fmt: skip
def test_auto_resume_continues_only_a_stopped_run(tmp_path, monkeypatch, metrics, resumes):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    run_dir = _run_dir(tmp_path, metrics)
    assert auto_resume_path(run_dir) == (run_dir / "checkpoint.pt" if resumes else None)


def test_auto_resume_of_a_latin1_metrics_file_starts_over(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    (tmp_path / "metrics.json").write_bytes('{"status": "interrupt\xe9d"}'.encode("latin-1"))
    assert auto_resume_path(tmp_path) is None


@pytest.mark.parametrize("count, resumes", [("1", True), ("12", True), (" 2 ", True),
                                            ("0", False), ("", False), (" ", False)])  # fmt: skip
def test_a_slurm_requeue_resumes_whatever_metrics_json_says(tmp_path, monkeypatch, count,
                                                             resumes):  # fmt: skip
    # A requeue after a node failure comes without a stop signal: metrics.json may say
    # completed (an earlier run's) or nothing at all.
    monkeypatch.setenv("SLURM_RESTART_COUNT", count)
    run_dir = _run_dir(tmp_path, '{"status": "completed"}')
    assert auto_resume_path(run_dir) == (run_dir / "checkpoint.pt" if resumes else None)


def test_auto_resume_needs_a_checkpoint_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert auto_resume_path(_run_dir(tmp_path, '{"status": "interrupted"}', False)) is None
    (tmp_path / "checkpoint.pt").mkdir()  # a folder of that name is no checkpoint
    assert auto_resume_path(tmp_path) is None


# ----------------------------------------------------------------------------- stop handlers
def test_stop_signals_are_recorded_in_order_and_the_previous_handlers_come_back():
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, previous)
    stop = StopSignals()
    try:
        stop.install(["SIGUSR1", "SIGUSR2"])
        send_signal("SIGUSR1")
        send_signal("SIGUSR2")
        send_signal("SIGUSR2")
    finally:
        stop.uninstall()
    try:
        assert stop.received == ["SIGUSR1", "SIGUSR2", "SIGUSR2"]
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
        send_signal("SIGUSR1")
        assert seen == [signal.SIGUSR1] and len(stop.received) == 3
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_stop_signals_installed_outside_the_main_thread_warn_and_install_nothing():
    stop = StopSignals()
    caught = []

    def install():
        with pytest.warns(RuntimeWarning, match="^train.stop_signals: train\\(\\) runs outside"):
            stop.install(["SIGUSR1"])
        caught.append(True)

    worker = threading.Thread(target=install)
    worker.start()
    worker.join()
    assert caught == [True]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL and stop._previous == {}


# ----------------------------------------------------------------------------- resume
def _start_error(run_dir, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        train(tiny_cfg(*overrides), run_dir)
    return str(info.value)


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    """A completed run of 2 iterations: its checkpoint's bytes, to copy into a test's folder."""
    run_dir = tmp_path_factory.mktemp("two")
    train(tiny_cfg("train.iterations=2"), run_dir)
    return (run_dir / "checkpoint.pt").read_bytes()


def _with_checkpoint(tmp_path, data: bytes, edit=None):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(data)
    if edit is not None:
        ckpt = torch.load(path, weights_only=False)
        edit(ckpt)
        torch.save(ckpt, path)
    return path


@pytest.mark.parametrize(
    "override, key",
    [
        ("precision=bf16", "precision.name"),
        ("texture.internal_dims=8", "texture.internal_dims"),
        ("scene.n_train_views=3", "scene.n_train_views"),
    ],
)
def test_a_resume_under_another_group_config_names_the_key(tmp_path, two_iterations, override,
                                                           key):  # fmt: skip
    path = _with_checkpoint(tmp_path, two_iterations)
    message = _start_error(tmp_path, "train.iterations=4", "train.resume=true", override)
    assert message.startswith(f"train.resume: checkpoint {path} was trained with another ")
    assert key in message.split("(different: ")[1]


def test_a_key_only_the_checkpoints_config_has_is_a_difference(tmp_path, two_iterations):
    def extra(ckpt):
        ckpt["config"]["texture"]["retired_option"] = 1

    path = _with_checkpoint(tmp_path, two_iterations, extra)
    message = _start_error(tmp_path, "train.iterations=4", "train.resume=true")
    assert message == (f"train.resume: checkpoint {path} was trained with another texture "
                       "config (different: texture.retired_option)")  # fmt: skip


def test_a_checkpoint_without_a_group_is_refused_naming_the_group(tmp_path, two_iterations):
    def no_texture(ckpt):
        del ckpt["config"]["texture"]

    path = _with_checkpoint(tmp_path, two_iterations, no_texture)
    message = _start_error(tmp_path, "train.iterations=4", "train.resume=true")
    assert message == (f"train.resume: checkpoint {path} was trained with another texture "
                       "config (different: texture)")  # fmt: skip


def test_resume_false_starts_over_and_a_named_file_must_exist(tmp_path, two_iterations):
    _with_checkpoint(tmp_path, two_iterations)
    m = train(tiny_cfg("train.iterations=1", "train.resume=false"), tmp_path)
    assert m["status"] == "completed" and m["resumed_from"] is None
    missing = tmp_path / "elsewhere.pt"
    message = _start_error(tmp_path, "train.iterations=4", f"train.resume={missing}")
    assert message == f"train.resume: no checkpoint at {missing}"


def test_a_signal_during_the_last_iteration_completes_the_run(tmp_path):
    m = train(tiny_cfg("train.iterations=3", "train.inject_signal_at=2",
                       "train.inject_signal=SIGUSR1"), tmp_path)  # fmt: skip
    assert m["status"] == "completed" and m["interruptions"] == []
    assert m["psnr"] is not None


def test_an_interrupted_run_checkpoints_where_it_stopped_and_the_resume_carries_it(tmp_path):
    # A stop during iteration 1 (0-based), checkpoints every 10: the run stops after iteration
    # 2 and its checkpoint holds those 2 iterations, not the start. Two more interruptions.
    cfg = ("train.iterations=8", "train.checkpoint_interval=10")
    first = train(tiny_cfg(*cfg, "train.inject_signal_at=1", "train.inject_signal=SIGUSR1"),
                  tmp_path)  # fmt: skip
    assert (first["status"], first["interrupted_at"], first["signal"]) == (
        "interrupted", 2, "SIGUSR1")  # fmt: skip
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["iteration"] == 2 and len(ckpt["history"]) == 2
    second = train(tiny_cfg(*cfg, "train.inject_signal_at=4"), tmp_path)
    assert (second["resumed_from"], second["interrupted_at"], second["resume_count"]) == (2, 5, 1)
    last = train(tiny_cfg(*cfg), tmp_path)
    assert last["status"] == "completed" and last["resume_count"] == 2
    assert last["interruptions"] == [{"iteration": 2, "signal": "SIGUSR1"},
                                     {"iteration": 5, "signal": "SIGTERM"}]  # fmt: skip
    assert read_metrics(tmp_path)["resumed_from"] == 5
    assert [h["iteration"] for h in last["history"]] == list(range(1, 9))


def test_a_checkpoint_one_iteration_past_the_plan_is_refused(tmp_path, two_iterations):
    path = _with_checkpoint(tmp_path, two_iterations)
    message = _start_error(tmp_path, "train.iterations=1", "train.resume=true")
    assert message == (
        f"train.iterations: expected at least the 2 iterations checkpoint {path} has done, got 1"
    )


def test_a_resume_with_no_iteration_left_keeps_the_checkpoints_loss_for_the_next(tmp_path):
    # Killed between the final checkpoint and metrics.json: the resume runs no iteration and
    # writes the checkpoint again; a further resume still reports the run's last loss.
    first = train(tiny_cfg("train.iterations=2"), tmp_path)
    for _ in range(2):
        (tmp_path / "metrics.json").unlink()
        again = train(tiny_cfg("train.iterations=2", "train.resume=true"), tmp_path)
        assert again["final_loss"] == first["final_loss"] is not None
        assert again["time_per_iter_s"] == first["time_per_iter_s"]
    assert load_checkpoint(tmp_path / "checkpoint.pt")["loss"] == first["final_loss"]


def test_a_resume_continues_from_the_loss_scale_the_checkpoint_had(tmp_path, monkeypatch):
    # f16_dynamic starts at 65536 and halves on an overflow: the skip at iteration 1 (0-based)
    # leaves 32768 in the checkpoint after 3, and the resumed iterations run at 32768, as the
    # uninterrupted run's do (no growth within 5 iterations).
    _overflow_at(monkeypatch, {1})
    full = train(tiny_cfg(*_SKIPS, "train.iterations=5"), tmp_path / "full")
    train(tiny_cfg(*_SKIPS, "train.iterations=3"), tmp_path / "part")
    resumed = train(tiny_cfg(*_SKIPS, "train.iterations=5", "train.resume=true"), tmp_path / "part")
    scales = [h["loss_scale"] for h in resumed["history"]]
    assert scales == [65536.0, 32768.0, 32768.0, 32768.0, 32768.0]
    assert scales == [h["loss_scale"] for h in full["history"]]
    assert resumed["final_loss_scale"] == full["final_loss_scale"] == 32768.0


@pytest.mark.parametrize("iterations, status, final", [
    (4, "completed", True),  # the weights after all 4 planned iterations
    (3, "completed", False),  # a checkpoint of 3 of them (the run went on past it)
    (4, "interrupted", False),
    (4, None, False),  # no readable metrics.json
])  # fmt: skip
def test_an_exports_source_calls_only_a_completed_runs_last_weights_final(
    tmp_path, iterations, status, final
):
    config = {"train": {"iterations": 4, "seed": 7}, "precision": {"name": "bf16"},
              "scene": {"name": "spot"}}  # fmt: skip
    run_dir = tmp_path.resolve()
    assert export_source(tmp_path, config, iterations, status) == {
        "run_dir": str(run_dir), "checkpoint": str(run_dir / "checkpoint.pt"),
        "iterations": iterations, "iterations_planned": 4, "status": status,
        "final_weights": final, "precision": "bf16", "scene": "spot", "seed": 7,
    }  # fmt: skip


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_optimizer_state_is_refused_and_nothing_written(tmp_path, moment, bad):
    # Adam's second moment goes inf on a finite gradient over about 5.8e20 (float32), and the
    # weight it belongs to then stops moving while it stays finite: the weights pass, the
    # optimizer's state must not. The step counters are float tensors too, and finite.
    texture = {"grid": torch.ones(4, 3), "net.0": torch.ones(2, 2)}
    state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3),
                 "exp_avg_sq": torch.zeros(4, 3)} for i in range(2)}  # fmt: skip
    state[1][moment] = state[1][moment].clone()
    state[1][moment][2, 1] = bad
    optimizer = {"state": state, "param_groups": [{"params": [0, 1], "lr": 0.01}]}
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(path, {"texture": texture, "optimizer": optimizer, "iteration": 1})
    assert str(info.value) == (
        f"{path}: refusing to write a checkpoint with a non-finite optimizer state"
    )
    assert os.listdir(tmp_path) == []
    state[1][moment][2, 1] = 0.0
    save_checkpoint(path, {"texture": texture, "optimizer": optimizer, "iteration": 1})
    assert load_checkpoint(path)["optimizer"]["state"][1]["step"] == 3.0


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"wall_time_s": 1.0, "wall_time_total_s": 5.0, "time_total_complete": True}, (5.0, True)),
        ({"wall_time_s": 1.0, "wall_time_total_s": 2.0, "time_total_complete": False},
         (2.0, False)),
        # from before the totals: never resumed, its one process; resumed (or a record from
        # before resume_count too), at least its last process's
        ({"wall_time_s": 2.0, "resume_count": 0}, (2.0, True)),
        ({"wall_time_s": 2.0, "resume_count": 3}, (2.0, False)),
        ({"wall_time_s": 2.0}, (2.0, False)),
        ({"status": "failed"}, (None, False)),  # failed at its start: no time recorded
    ],
)  # fmt: skip
def test_a_runs_total_time_is_read_one_way_for_old_and_new_records(record, expected):
    from mptex.train.checkpoint import run_time_total

    assert run_time_total(record) == expected
