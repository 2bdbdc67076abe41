"""Kill a training run at every point where it writes or steps, then resume it (a driver process).

``python tests/kill_points.py <plan.json> <out.json>`` runs the trials of ``plan.json`` and
writes one record per trial to ``out.json``; ``tests/test_kill_points.py`` judges them. Every
run is a child forked from this process (one thread, so that a fork is safe) that calls
:func:`mptex.train.train` with *kill points* installed: before each iteration, around each
atomic write (temporary created, half of it written, written but not synced, synced but not
renamed, renamed), before each validation, and half-way through each file written in place
(validation images, the export's files). The child counts the points it passes and, at the
N-th, does what a ``kill -9`` leaves (a half-written file stays half-written) and sends itself
SIGKILL. A child run without a kill lists the points it passed.

A trial is a list of attempts in one run directory, each ``{"kill": N, "<label>@<k>" or
null, "resume": "auto" | "true"}`` (:class:`_Points`), with ``"overrides"`` of its own where it
runs another config (another export); the last has no kill. ``"true"`` falls
back to ``false`` where no ``checkpoint.pt`` exists (``train.resume=true`` refuses a directory
without one, in one line). ``"before": [[overrides], ...]`` runs to the end first, without
kills (a completed or stopped run already in the directory); ``"user_files"`` are then put in
the directory (paths in it, as a user would add notes beside an export), and ``"removes"``
names the files of earlier exports the last export is to remove. The first trial is the reference
run (one attempt, no kill); with ``"each_point": [modes]`` in the plan, a trial per point the
reference passed follows it, resumed with the modes in turn (point 1 the first, point 2 the
second, ...).
After each killed attempt the record keeps what a reader of the directory would find
(:func:`_snapshot`); after the last, the files to compare with the reference run's.
The trials after the reference run in forked worker processes, two at once where this process
may use two cores (``"workers"`` in the plan sets how many): each has its own run directory and
work folder, and every run is a single-threaded child, so they give what they give one at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import imageio.v3 as iio
import torch
from hydra import compose, initialize_config_dir

import mptex.train.checkpoint as checkpoint_module
import mptex.train.loop as loop
from mptex.cli import CONFIG_DIR
from mptex.train import train

_real = {
    "mkstemp": tempfile.mkstemp,
    "fsync": os.fsync,
    "replace": os.replace,
    "imwrite": iio.imwrite,
    "write_text": Path.write_text,
    "write_bytes": Path.write_bytes,
    "open": Path.open,
    "forward_backward": loop._forward_backward,
    "evaluate": loop.evaluate,
}


class _Points:
    """The kill points one child passes; SIGKILL at ``kill_at``: the N-th point passed
    (1-based), or ``"<label>@<k>"``, the k-th point of that label."""

    def __init__(self, kill_at: int | str | None, log: Path) -> None:
        self.kill_at, self.log, self.passed = kill_at, log, []

    def _due(self) -> bool:
        if isinstance(self.kill_at, str):
            label, nth = self.kill_at.rsplit("@", 1)
            return self.passed[-1] == label and self.passed.count(label) == int(nth)
        return len(self.passed) == self.kill_at

    def __call__(self, label: str, before_kill=None) -> None:
        self.passed.append(label)
        if self._due():
            self.log.write_text(json.dumps(self.passed))
            if before_kill is not None:
                before_kill()
            os.kill(os.getpid(), signal.SIGKILL)


def _fd_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


def _install(point: _Points, run_dir: Path) -> None:
    def inside(path) -> bool:
        return run_dir in Path(path).resolve().parents

    def name(path) -> str:
        return str(Path(path).resolve().relative_to(run_dir))

    def target(tmp) -> str:  # "<dir>/.checkpoint.pt.abc123.tmp" -> "<dir>/checkpoint.pt"
        return name(Path(tmp).parent / Path(tmp).name[1:].rsplit(".", 2)[0])

    def mkstemp(*args, **kwargs):
        fd, tmp = _real["mkstemp"](*args, **kwargs)
        if inside(tmp):
            point(f"{target(tmp)}: temporary created")
        return fd, tmp

    def fsync(fd):
        path = _fd_path(fd)
        # Only an atomic write's temporary: a kill before the fsync of a file written in place
        # (an image, an export's file) leaves what its write left, a point of its own already.
        temporary = path is not None and path.name.startswith(".") and path.suffix == ".tmp"
        if temporary and path.is_file() and inside(path):
            size = os.fstat(fd).st_size
            point(f"{target(path)}: half written", lambda: os.ftruncate(fd, size // 2))
            point(f"{target(path)}: written, not synced")
        return _real["fsync"](fd)

    def replace(src, dst):
        if inside(dst):
            point(f"{name(dst)}: synced, not renamed")
        _real["replace"](src, dst)
        if inside(dst):
            point(f"{name(dst)}: renamed")

    def half(path, data: bytes):
        def write_half():
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])

        return write_half

    def imwrite(uri, image, *args, **kwargs):
        if isinstance(uri, (str, os.PathLike)) and inside(uri):
            suffix = kwargs.get("extension") or Path(uri).suffix
            data = _real["imwrite"]("<bytes>", image, extension=suffix)
            point(f"{name(uri)}: half written", half(uri, data))
        return _real["imwrite"](uri, image, *args, **kwargs)

    # Path.write_text and write_bytes open their file through Path.open: their point is their
    # own, not a stream's as well.
    whole = []

    def write_text(self, data, *args, **kwargs):
        if inside(self):
            point(f"{name(self)}: half written", half(self, data.encode()))
        whole.append(self)
        try:
            return _real["write_text"](self, data, *args, **kwargs)
        finally:
            whole.pop()

    def write_bytes(self, data):
        if inside(self):
            point(f"{name(self)}: half written", half(self, bytes(data)))
        whole.append(self)
        try:
            return _real["write_bytes"](self, data)
        finally:
            whole.pop()

    def path_open(self, mode="r", *args, **kwargs):
        # A file written in place through a stream (mesh.obj, written in blocks of rows): its
        # point comes once everything was written, before it is closed.
        stream = _real["open"](self, mode, *args, **kwargs)
        if "w" in mode and inside(self) and not whole:
            close = stream.close

            def close_at_point():
                if not stream.closed:
                    stream.flush()
                    size = os.fstat(stream.fileno()).st_size
                    point(f"{name(self)}: half written",
                          lambda: os.ftruncate(stream.fileno(), size // 2))  # fmt: skip
                close()

            stream.close = close_at_point
        return stream

    def forward_backward(run, it):
        point(f"iteration {it}")
        return _real["forward_backward"](run, it)

    def evaluate(*args, **kwargs):
        point("validation")
        return _real["evaluate"](*args, **kwargs)

    tempfile.mkstemp = mkstemp
    os.fsync, os.replace = fsync, replace
    iio.imwrite = imwrite
    Path.write_text, Path.write_bytes, Path.open = write_text, write_bytes, path_open
    loop._forward_backward, loop.evaluate = forward_backward, evaluate


def _attempt(run_dir: Path, overrides: list[str], kill_at: int | None, resume: str,
             export: bool, work: Path) -> dict:  # fmt: skip
    """One child run; its outcome: ``killed`` (and the point) or ``returned`` (exit status)."""
    if resume == "true" and not (run_dir / "checkpoint.pt").is_file():
        resume = "false"
    log, error = work / "points.json", work / "error.txt"
    log.unlink(missing_ok=True)
    error.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:  # the child: one run, then out without Python's shutdown
        status = 1
        try:
            point = _Points(kill_at, log)
            _install(point, run_dir.resolve())
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
                cfg = compose("config", overrides=[*overrides, f"train.resume={resume}"])
            exporter = None
            if export:
                from mptex.bake import TrainingExport

                exporter = TrainingExport()
            train(cfg, run_dir, exporter=exporter)
            log.write_text(json.dumps(point.passed))
            status = 0
        except BaseException:
            error.write_text(traceback.format_exc())
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    points = json.loads(log.read_text()) if log.exists() else None
    outcome = {"resume": resume, "points": points}
    if os.WIFSIGNALED(wait_status):
        outcome.update(killed=os.WTERMSIG(wait_status) == signal.SIGKILL,
                       at=points[-1] if points else None)  # fmt: skip
    else:
        outcome.update(killed=False, exit=os.WEXITSTATUS(wait_status))
        if error.exists():
            outcome["error"] = error.read_text()
    return outcome


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(run_dir: Path) -> dict:
    """What a reader finds in ``run_dir``: the record's status, the checkpoint's iteration
    (or why it cannot be read), each file's digest, and whether each PNG decodes."""
    found: dict = {"files": {}, "bad_images": []}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel = str(path.relative_to(run_dir))
        if rel.startswith(".hydra"):
            continue
        found["files"][rel] = _digest(path)
        if path.suffix == ".png":
            try:
                iio.imread(path)
            except Exception:  # a torn PNG: imageio raises several types
                found["bad_images"].append(rel)
    metrics = checkpoint_module.read_metrics(run_dir)
    found["metrics_status"] = None if metrics is None else metrics.get("status")
    found["metrics_unreadable"] = (run_dir / "metrics.json").exists() and metrics is None
    ckpt_path = run_dir / "checkpoint.pt"
    if ckpt_path.exists():
        try:
            ckpt = checkpoint_module.load_checkpoint(
                ckpt_path, required=checkpoint_module.CHECKPOINT_KEYS
            )
            weights = [t for t in ckpt["texture"].values()
                       if torch.is_tensor(t) and t.is_floating_point()]  # fmt: skip
            found["checkpoint"] = {
                "iteration": int(ckpt["iteration"]),
                "finite": all(bool(torch.isfinite(t).all()) for t in weights),
            }
        except checkpoint_module.CheckpointError as exc:
            found["checkpoint"] = {"error": str(exc)}
    export_json = run_dir / "export" / "export.json"
    if export_json.exists():
        try:
            found["export_files"] = json.loads(export_json.read_text())["files"]
        except (ValueError, KeyError) as exc:
            found["export_files"] = {"error": repr(exc)}
    return found


def _final(run_dir: Path) -> dict:
    """What the finished run's files hold, for the comparison with the reference."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    tensors = {}

    def walk(prefix: str, value) -> None:
        if torch.is_tensor(value):
            tensors[prefix] = hashlib.sha256(value.cpu().reshape(-1).contiguous().view(torch.uint8)
                                             .numpy().tobytes()).hexdigest()  # fmt: skip
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            tensors[prefix] = repr(value)

    for key in ("texture", "optimizer", "stepper", "rng", "history", "iteration",
                "skipped_steps", "consecutive_skips", "loss"):  # fmt: skip
        walk(key, ckpt.get(key))
    files = {}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel = str(path.relative_to(run_dir))
        if rel.startswith(".hydra") or rel in ("metrics.json", "checkpoint.pt"):
            continue
        if rel == "export/export.json":
            export = json.loads(path.read_text())
            export.pop("source", None)  # names the run directory
            files[rel] = {k: v for k, v in export.items() if not k.endswith("_time_s")}
        else:
            files[rel] = _digest(path)
    return {"metrics": metrics, "checkpoint": tensors, "files": files,
            "resume_count_in_checkpoint": ckpt.get("resume_count")}  # fmt: skip


def _trial(plan: dict, index: int, trial: dict, work: Path) -> dict:
    """Run one trial in ``plan["root"]/trial<index>``; its record."""
    run_dir = Path(plan["root"]) / f"trial{index}"
    for setup in trial.get("before", []):  # e.g. a completed run already in the directory
        _attempt(run_dir, plan["overrides"] + setup, None, "auto", plan["export"], work)
    for name in trial.get("user_files", []):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text("mine")
    record = {"attempts": [], "snapshots": [], "user_files": trial.get("user_files", []),
              "removes": trial.get("removes", [])}  # fmt: skip
    for attempt in trial["attempts"]:
        overrides = [*plan["overrides"], *trial.get("overrides", []),
                     *attempt.get("overrides", [])]  # fmt: skip
        outcome = _attempt(run_dir, overrides, attempt["kill"], attempt["resume"],
                           plan["export"], work)  # fmt: skip
        record["attempts"].append(outcome)
        if outcome["killed"]:
            record["snapshots"].append(_snapshot(run_dir))
    if not record["attempts"][-1]["killed"] and record["attempts"][-1].get("exit") == 0:
        record["final"] = _final(run_dir)
    return record


def _trials_in_workers(plan: dict, trials: list[tuple[int, dict]], workers: int) -> dict:
    """Run ``trials`` (index, trial) in ``workers`` forked driver processes, trial ``k`` of the
    list in worker ``k % workers``; their records by index. The trials share nothing (a run
    directory and a work folder each), and every run is a single-threaded child, so that on
    a machine with two cores two trials run at once and give what they give one at a time."""
    root = Path(plan["root"])
    children = {}
    for worker in range(workers):
        share = trials[worker::workers]
        out, error = root / f"records{worker}.json", root / f"error{worker}.txt"
        pid = os.fork()
        if pid == 0:  # a worker: its share of the trials, then out without Python's shutdown
            status = 1
            try:
                work = root / f"work{worker}"
                work.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({i: _trial(plan, i, t, work) for i, t in share}))
                status = 0
            except BaseException:
                error.write_text(traceback.format_exc())
            finally:
                os._exit(status)
        children[pid] = (out, error)
    records, failures = {}, []
    for pid, (out, error) in children.items():
        _, wait_status = os.waitpid(pid, 0)
        if os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) == 0:
            records.update({int(i): r for i, r in json.loads(out.read_text()).items()})
        else:
            failures.append(error.read_text() if error.exists() else f"status {wait_status}")
    if failures:
        raise RuntimeError("a trial worker failed:\n" + "\n".join(failures))
    return records


def main(plan_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    plan = json.loads(Path(plan_path).read_text())
    work = Path(plan["root"]) / "work"
    work.mkdir(parents=True, exist_ok=True)
    trials = list(plan["trials"])
    reference = _trial(plan, 0, trials[0], work)
    if plan.get("each_point"):
        # the first trial is the reference run: a kill at each point it passed, then resume
        points = reference["attempts"][0]["points"]
        modes = plan["each_point"]
        trials += [
            {"attempts": [{"kill": n, "resume": mode}, {"kill": None, "resume": mode}]}
            for n in range(1, len(points) + 1)
            for mode in [modes[(n - 1) % len(modes)]]
        ]
    # one worker per core this process may use, at most two (the trials' runs are small)
    workers = int(plan.get("workers") or min(2, len(os.sched_getaffinity(0))))
    rest = _trials_in_workers(plan, list(enumerate(trials))[1:], workers)
    records = [reference, *(rest[i] for i in range(1, len(trials)))]
    Path(out_path).write_text(json.dumps(records))


if __name__ == "__main__":
    main(*sys.argv[1:])
