"""A run killed at any moment (``kill -9``, an OOM kill, a node lost) resumes to the
uninterrupted run's results, and what a kill leaves in the run directory never reads as a
finished run that it is not.

The kill points (before each iteration and validation, at every stage of each atomic write,
half-way through each file written in place) and the driver that forks the runs are in
``tests/kill_points.py``. A few cases run in-process: a kill there is :class:`_Killed`, which no
``except`` clause of ``train`` catches, so nothing runs after it but ``finally`` clauses that
write no file.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_runs import TINY, tiny_cfg

import mptex.train.loop as loop
from mptex.bake import TrainingExport
from mptex.train import load_checkpoint, train
from mptex.train.checkpoint import read_metrics
from mptex.train.signals import auto_resume_path, stopped_record


class _Killed(BaseException):
    """A kill: no ``except Exception`` of the loop records it."""


def _kill_before_iteration(monkeypatch, at: int) -> None:
    real = loop._forward_backward

    def forward_backward(run, it):
        if it == at:
            raise _Killed
        return real(run, it)

    monkeypatch.setattr(loop, "_forward_backward", forward_backward)


@pytest.mark.parametrize(
    "first, again",
    [
        ([], []),  # a completed run started over (train.resume=auto)
        ([], ["train.iterations=8", "train.resume=true"]),  # a completed run continued
    ],
)
def test_a_finished_runs_record_goes_before_its_files_are_rewritten(
    tmp_path, monkeypatch, first, again
):
    # A rerun writes a new checkpoint.pt (and, at its end, images and the export) beside the
    # finished run's metrics.json; killed in between, the directory must not read as that
    # finished run, whose files are no longer there.
    base = ["train.iterations=4", "train.checkpoint_interval=2"]
    assert train(tiny_cfg(*base, *first), tmp_path)["status"] == "completed"
    _kill_before_iteration(monkeypatch, 3 if not again else 7)
    with pytest.raises(_Killed):
        train(tiny_cfg(*base, *again), tmp_path)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["iteration"] == (2 if not again else 6)
    assert read_metrics(tmp_path) is None


def test_a_stopped_runs_record_stays_for_auto_to_continue_it_after_a_kill(tmp_path, monkeypatch):
    base = ["train.iterations=6", "train.checkpoint_interval=2"]
    assert train(tiny_cfg(*base, "train.inject_signal_at=0"), tmp_path)["status"] == "interrupted"
    with monkeypatch.context() as patch:
        _kill_before_iteration(patch, 3)
        with pytest.raises(_Killed):
            train(tiny_cfg(*base), tmp_path)
    assert read_metrics(tmp_path)["status"] == "interrupted"
    # the killed process's time up to its checkpoint (after iteration 2) is in that checkpoint;
    # after it, not known
    carried = load_checkpoint(tmp_path / "checkpoint.pt")["wall_time_total_s"]
    assert carried > read_metrics(tmp_path)["wall_time_s"]
    resumed = train(tiny_cfg(*base), tmp_path)
    assert resumed["status"] == "completed"
    assert (resumed["resumed_from"], resumed["resume_count"]) == (2, 2)
    assert resumed["wall_time_total_s"] == carried + resumed["wall_time_s"]
    assert resumed["time_total_complete"] is False
    reference = train(tiny_cfg(*base), tmp_path / "reference")
    assert resumed["psnr"] == reference["psnr"] and resumed["history"] == reference["history"]
    a = load_checkpoint(tmp_path / "checkpoint.pt")["texture"]
    b = load_checkpoint(tmp_path / "reference" / "checkpoint.pt")["texture"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def _record_syncs(monkeypatch) -> list[tuple[str, str]]:
    """The ``os.fsync`` and ``os.replace`` calls from now on, in order: ``("fsync", path of the
    file or folder)``, ``("replace", destination)`` (real paths)."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        calls.append(("replace", os.path.realpath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


def _unsynced_before(calls: list, record: Path, files: list[Path], folders: list[Path]) -> list:
    """What was not flushed before the last rename of ``record`` in ``calls``: each of ``files``
    never fsync'ed before it, each of ``folders`` not fsync'ed after the last of those files."""

    def last(call, end):
        return max((i for i, c in enumerate(calls[:end]) if c == call), default=-1)

    renamed = last(("replace", str(record)), len(calls))
    missing = [path for path in files if last(("fsync", str(path)), renamed) < 0]
    files_synced = max((last(("fsync", str(path)), renamed) for path in files), default=-1)
    missing += [
        folder for folder in folders if last(("fsync", str(folder)), renamed) < files_synced
    ]
    return missing if renamed >= 0 else [f"{record} never renamed"]


@pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="reads the fsync'ed files from /proc"
)
def test_the_files_a_record_names_reach_the_disk_before_the_record(tmp_path, monkeypatch):
    # A power loss, unlike a kill, drops what was written and not yet flushed. metrics.json and
    # export.json are flushed and renamed into place: the validation images and the export's
    # files they name must be flushed, with their folders' entries, before that rename.
    calls = _record_syncs(monkeypatch)
    cfg = tiny_cfg("train.iterations=2", *EXPORT, "export.neural_precision=f16")
    metrics = train(cfg, tmp_path, exporter=TrainingExport())
    assert metrics["status"] == "completed" and "error" not in metrics["export"]
    run_dir = Path(os.path.realpath(tmp_path))
    images = sorted((run_dir / "images").glob("val_*.png"))
    export = run_dir / "export"
    files = sorted(json.loads((export / "export.json").read_text())["files"].values())
    assert images and "neural_decoder.py" in files and "mesh.obj" in files
    assert _unsynced_before(calls, run_dir / "metrics.json", images,
                            [run_dir / "images", run_dir]) == []  # fmt: skip
    assert _unsynced_before(calls, export / "export.json", [export / name for name in files],
                            [export, run_dir]) == []  # fmt: skip


def test_a_process_killed_before_it_checkpointed_leaves_the_total_partial(tmp_path, monkeypatch):
    # Stopped after iteration 1 (its record holds all of that process's time), then resumed
    # and killed before it wrote a checkpoint: the next resume continues from the same
    # checkpoint beside the same record, but the killed process's time is known nowhere.
    base = ["train.iterations=6", "train.checkpoint_interval=2"]
    stopped = train(tiny_cfg(*base, "train.inject_signal_at=0"), tmp_path)
    assert stopped["status"] == "interrupted"
    carried = load_checkpoint(tmp_path / "checkpoint.pt")["wall_time_total_s"]
    with monkeypatch.context() as patch:
        _kill_before_iteration(patch, 1)
        with pytest.raises(_Killed):
            train(tiny_cfg(*base), tmp_path)
    assert read_metrics(tmp_path)["status"] == "interrupted"
    resumed = train(tiny_cfg(*base), tmp_path)
    assert (resumed["resumed_from"], resumed["resume_count"]) == (1, 1)
    assert resumed["wall_time_total_s"] == carried + resumed["wall_time_s"]
    assert resumed["time_total_complete"] is False


@pytest.mark.parametrize("record, stopped", [
    ({"status": "completed"}, False),
    ({"status": "diverged", "diverged_at": 3}, False),
    ({"status": "failed", "failed_at": "start", "error": "ValueError: x"}, False),
    ({"status": "failed", "failed_at": 3, "error": "RuntimeError: x"}, False),
    ({"status": "interrupted", "interrupted_at": 2, "signal": "SIGTERM"}, True),
    ({"status": "failed", "failed_at": 3, "failed_writing": "checkpoint.pt"}, True),  # full disk
])  # fmt: skip
def test_only_a_stopped_runs_record_outlives_the_start_of_a_run_in_its_directory(
    tmp_path, monkeypatch, record, stopped
):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)  # a requeue resumes whatever
    # A stop signal's record and a full disk's are continued by train.resume=auto (with a
    # checkpoint beside them) and stay when a run starts there; any other record goes.
    (tmp_path / "metrics.json").write_text(json.dumps(record))
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert stopped_record(record) is stopped
    assert auto_resume_path(tmp_path) == (tmp_path / "checkpoint.pt" if stopped else None)
    loop._retire_finished_record(tmp_path)
    assert read_metrics(tmp_path) == (record if stopped else None)


# ----------------------------------------------------------------- killed in a child process
ROOT = Path(__file__).resolve().parents[1]
# f16_dynamic: a loss scale to restore too; checkpoints after iterations 2, 4 and 6 (the end),
# validations after 3 and 6.
RUN = [*TINY, "precision=f16_dynamic", "train.iterations=6", "train.checkpoint_interval=2",
       "train.val_interval=3"]  # fmt: skip
EXPORT = ["export.enabled=true", "export.resolution=64", "export.formats=[obj]",
          "export.measure=false"]  # fmt: skip
# metrics.json keys that differ between two runs of one config: times, memory, where it ran,
# how it was resumed (checked on their own)
_MEASURED = {
    "wall_time_s", "train_time_s", "time_split_s", "time_per_iter_s", "peak_memory_bytes",
    "start_peak_memory_bytes", "run_dir", "resume_count", "resumed_from", "interruptions",
    "wall_time_total_s", "train_time_total_s", "time_total_complete",
}  # fmt: skip
# train keys that say how a run was started, not what it trains
_HOW_STARTED = {"resume", "inject_signal_at"}


def _drive(tmp_path: Path, trials: list[dict], export: bool = False, **plan) -> list[dict]:
    """The records of ``tests/kill_points.py`` for the reference run, then ``trials``."""
    reference = {"attempts": [{"kill": None, "resume": "auto"}]}
    plan = {"root": str(tmp_path), "overrides": RUN + (EXPORT if export else []),
            "export": export, "trials": [reference, *trials], **plan}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "tests" / "kill_points.py"), str(tmp_path / "plan.json"),
           str(tmp_path / "records.json")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr
    return json.loads((tmp_path / "records.json").read_text())


def _comparable(final: dict, record: dict) -> dict:
    """``final`` without what differs between two runs of one config, the user's files and the
    earlier exports' files the export removed (checked by :func:`_export_folder_problems`)."""
    metrics = {k: v for k, v in final["metrics"].items() if k not in _MEASURED}
    train_cfg = {k: v for k, v in metrics["config"]["train"].items() if k not in _HOW_STARTED}
    metrics["config"] = {**metrics["config"], "train": train_cfg}
    if metrics.get("export"):
        metrics["export"] = {k: v for k, v in metrics["export"].items()
                             if not k.endswith("_time_s")}  # fmt: skip
    files = {k: v for k, v in final["files"].items() if k not in record.get("user_files", [])}
    if "export/export.json" in files:
        files["export/export.json"] = {k: v for k, v in files["export/export.json"].items()
                                       if k != "removed_earlier_files"}  # fmt: skip
    return {**final, "metrics": metrics, "files": files, "resume_count_in_checkpoint": None}


def _export_folder_problems(name: str, record: dict) -> list[str]:
    """The finished run's export folder holds its export.json, the files that lists and the
    user's files, no more (none an earlier or a killed export left), and export.json names the
    earlier exports' files it removed."""
    export = record["final"]["files"].get("export/export.json")
    if export is None:
        return []
    listed = {f"export/{file}" for file in ["export.json", *export["files"].values()]}
    user = {file for file in record.get("user_files", []) if file.startswith("export/")}
    found = {file for file in record["final"]["files"] if file.startswith("export/")}
    problems = []
    if found != listed | user:
        extra, lacking = sorted(found - listed - user), sorted((listed | user) - found)
        problems.append(f"{name}: the export folder holds {extra} beyond export.json's files "
                        f"and the user's, lacks {lacking}")  # fmt: skip
    removed = export.get("removed_earlier_files", [])
    if removed != record.get("removes", []):
        problems.append(f"{name}: export.json's removed_earlier_files {removed}, expected "
                        f"{record.get('removes', [])}")  # fmt: skip
    return problems


def _judge(records: list[dict]) -> list[str]:
    """What went wrong in each trial, as lines naming the trial's kill points (none: all held)."""
    reference = records[0]["final"]
    expected = _comparable(reference, records[0])
    problems = _export_folder_problems("the uninterrupted run", records[0])
    for record in records[1:]:
        kills = [a["at"] for a in record["attempts"] if a["killed"]]
        name = f"killed at {kills}, resumed with train.resume={record['attempts'][-1]['resume']}"
        for snapshot in record["snapshots"]:
            ckpt = snapshot.get("checkpoint")
            if ckpt is not None and ("error" in ckpt or not ckpt["finite"]):
                problems.append(f"{name}: checkpoint.pt left unusable: {ckpt}")
            if snapshot["metrics_unreadable"]:
                problems.append(f"{name}: metrics.json left unreadable")
            if snapshot["metrics_status"] == "completed":
                # a record of a completed run sits beside that run's files: the reference's
                files = {k: v for k, v in snapshot["files"].items() if k != "metrics.json"}
                want = {k: v for k, v in reference["files"].items() if k != "export/export.json"}
                kept = {k: files.get(k) for k in want}
                if kept != want or snapshot["bad_images"] or (ckpt or {}).get("iteration") != 6:
                    problems.append(f"{name}: metrics.json says completed beside other files "
                                    f"({snapshot})")  # fmt: skip
        if "final" not in record:
            last = record["attempts"][-1]
            problems.append(f"{name}: the resumed run failed: {last.get('error') or last}")
            continue
        final = record["final"]
        problems += _export_folder_problems(name, record)
        got = _comparable(final, record)
        if got != expected:
            differ = [f"{part}.{k}" for part in ("metrics", "checkpoint", "files")
                      for k in sorted(set(got[part]) | set(expected[part]))
                      if got[part].get(k) != expected[part].get(k)]  # fmt: skip
            problems.append(f"{name}: ends otherwise than the uninterrupted run: {differ[:10]}")
        metrics = final["metrics"]
        if metrics["resume_count"] != final["resume_count_in_checkpoint"]:
            problems.append(f"{name}: resume_count {metrics['resume_count']} in metrics.json, "
                            f"{final['resume_count_in_checkpoint']} in checkpoint.pt")  # fmt: skip
        problems += _time_total_problems(name, record, metrics)
        once = len(kills) == 1 and not metrics["interruptions"]  # one kill, no stop signal
        if once and metrics["resume_count"] != (metrics["resumed_from"] is not None):
            problems.append(f"{name}: resume_count {metrics['resume_count']} after one kill "
                            f"(resumed from {metrics['resumed_from']})")  # fmt: skip
    return problems


def _time_total_problems(name: str, record: dict, metrics: dict) -> list[str]:
    """A resumed run calls its time complete only where no process it continued was killed
    while it held time that no file records: a kill counts after that process's record was
    written, or before it trained (its start, which the totals leave out)."""
    problems = []
    if not (metrics["wall_time_total_s"] >= metrics["wall_time_s"] > 0
            and metrics["train_time_total_s"] >= metrics["train_time_s"] > 0):  # fmt: skip
        problems.append(f"{name}: total times below this process's: {metrics}")
    if metrics["resumed_from"] is None or not metrics["time_total_complete"]:
        return problems
    for attempt in record["attempts"]:
        trained = any(p.startswith("iteration ") for p in attempt["points"] or [])
        if attempt["killed"] and trained and attempt["at"] != "metrics.json: renamed":
            problems.append(f"{name}: time_total_complete after a kill at {attempt['at']}")
    return problems


def _once(kill: str, resume: str, before: list | None = None) -> dict:
    trial = {"attempts": [{"kill": kill, "resume": resume}, {"kill": None, "resume": resume}]}
    return {**trial, "before": before} if before else trial


def test_a_kill_at_each_kind_of_point_resumes_to_the_uninterrupted_run(tmp_path):
    # A kill in an iteration, half-way through a checkpoint's atomic write, after the final
    # checkpoint's rename, half-way through the record's write, resumed both ways; and a
    # completed run started over, killed half-way through rewriting its validation image.
    trials = [
        _once("iteration 1@1", "auto"),
        _once("checkpoint.pt: half written@2", "true"),
        _once("checkpoint.pt: renamed@3", "true"),
        _once("metrics.json: half written@1", "auto"),
        _once("images/val_000.png: half written@1", "auto", before=[[]]),
    ]
    records = _drive(tmp_path, trials)
    assert [a["at"] for r in records[1:] for a in r["attempts"] if a["killed"]] == [
        t["attempts"][0]["kill"].rsplit("@", 1)[0] for t in trials
    ]  # every kill landed where it was meant to
    assert _judge(records) == []


@pytest.mark.requires_trimesh
def test_a_kill_mid_export_then_another_export_leaves_only_the_last_exports_files(tmp_path):
    # A completed run's export with a GLB and the neural files, started over with an OBJ-only
    # export killed midway, then again; and a completed run's OBJ-only export, started over with
    # a GLB and the neural files killed once it had written them, then again OBJ-only. Each run
    # ends as the uninterrupted one, its export folder holding the files its export.json lists
    # and the user's notes, no earlier export's.
    more = ["export.formats=[obj,glb]", "export.neural_precision=f16"]
    removes = ["mesh.glb", "neural_decoder.py", "texture_neural.safetensors"]
    user = {"user_files": ["export/notes.txt"], "removes": removes}
    killed_after_its_files = [
        {"kill": "export/neural_decoder.py: half written@1", "resume": "auto", "overrides": more},
        {"kill": None, "resume": "auto"},
    ]  # fmt: skip
    trials = [
        {**_once("export/mesh.obj: half written@1", "auto", before=[more]), **user},
        {"before": [[]], "attempts": killed_after_its_files, **user},
    ]
    records = _drive(tmp_path, trials, export=True)
    assert [a["at"] for r in records[1:] for a in r["attempts"] if a["killed"]] == [
        "export/mesh.obj: half written", "export/neural_decoder.py: half written",
    ]  # fmt: skip
    assert _judge(records) == []


@pytest.mark.slow
def test_a_kill_at_every_point_resumes_to_the_uninterrupted_run(tmp_path):
    # Every kill point of a run that exports, resumed with train.resume=true and auto in turn
    # (alternating along the run); kills during a resumed run;
    # a completed run started over and a stopped run continued, killed at their file writes.
    rng = random.Random(23)
    points = 42  # the reference run's kill points (checked below)
    chains = [{"attempts": [{"kill": rng.randint(1, points), "resume": "true"},
                            {"kill": rng.randint(1, 20), "resume": mode},
                            {"kill": None, "resume": mode}]}
              for mode in ("true", "auto", "true", "auto")]  # fmt: skip
    rerun = [_once(f"{name}: half written@1", "auto", before=[[]])
             for name in ("images/val_000.png", "export/texture_kd.png", "export/mesh.obj",
                          "export/export.json", "metrics.json")]  # fmt: skip
    stopped = [_once(kill, "auto", before=[["train.inject_signal_at=2"]])
               for kill in ("checkpoint.pt: half written@1", "checkpoint.pt: renamed@1",
                            "iteration 5@1", "images/val_000.png: half written@1")]  # fmt: skip
    records = _drive(tmp_path, chains + rerun + stopped, export=True,
                     each_point=["true", "auto"])  # fmt: skip
    assert len(records[0]["attempts"][0]["points"]) == points
    assert len(records) == 1 + len(chains + rerun + stopped) + points
    assert _judge(records) == []
