"""The search's training runs: a pool of worker processes, finished runs read back, stop signals.

:class:`RunPool` trains (candidate, seed) runs, ``search.workers`` at a time, each in a fresh
process. A run whose ``metrics.json`` says completed or diverged is read back instead of trained
again; an interrupted one continues from its checkpoint (``train.resume=auto``). Stop signals
are :class:`mptex.train.signals.StopSignals`' with ``relay``: the search's own handler records
the signal and passes it on to the worker processes, whose runs checkpoint and stop as any
``mptex-train`` run does; the pool then starts nothing new and raises
:class:`SearchInterrupted`. A worker process that dies without a result (killed by the
out-of-memory killer, say) costs only its own run: the others finish, and the pool then raises
:class:`SearchInterrupted` naming the run and how its process ended.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from mptex.search.space import Candidate
from mptex.train.checkpoint import atomic_write_bytes, read_metrics, run_time_total
from mptex.train.signals import StopSignals

__all__ = ["SearchInterrupted", "RunPool", "run_summary"]

# A run in one of these states is read back, never trained again.
_DONE = ("completed", "diverged")
# Beside a run's metrics.json: how many other runs shared the device while it trained.
_SHARING = "search_sharing.json"


class SearchInterrupted(RuntimeError):
    """A stop signal ended the search; the same command continues it."""


def _train_run(cfg: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One training run (in a worker process); the metrics the search reads."""
    from mptex.train import train

    try:
        metrics = train(cfg, run_dir)
    except Exception as exc:  # noqa: BLE001 - a failed run is a result (metrics.json has it)
        return {**run_summary({}), "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    return run_summary(metrics)


def _child(conn, cfg: dict[str, Any], run_dir: str) -> None:
    """A worker process's body: one run, its summary sent back through ``conn``."""
    try:
        conn.send(_train_run(cfg, run_dir))
    finally:
        conn.close()


def _run_in_process(cfg: dict[str, Any], run_dir: str, child=_child) -> dict[str, Any]:
    """One run in a fresh spawned interpreter: no torch state (threads, seeds) leaks between
    runs, and a run is the same whichever worker trains it. A process that ends without sending
    its summary gives status ``"lost"`` and how it ended as ``error`` (``"killed by SIGKILL"``).
    ``child`` is the process's body, called with the pipe's sending end, ``cfg`` and ``run_dir``
    (default: train the run)."""
    context = get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=child, args=(send, cfg, run_dir), name="mptex-search-run")
    process.start()
    send.close()  # the child's end: recv raises EOFError once the child has closed it too
    try:
        result = receive.recv()
    except EOFError:
        result = None
    finally:
        receive.close()
    process.join()
    if result is not None:
        return result
    code = process.exitcode
    if code is not None and code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exited with status {code}"
    return {**run_summary({}), "status": "lost", "error": how}


def run_summary(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What the search keeps of a run's ``metrics.json``; a completed run that collapsed
    (:func:`mptex.collapse.classify_collapse`) has status ``"collapsed"`` and the reason in
    ``note``."""
    from mptex.collapse import classify_collapse

    status = metrics.get("status")
    note = None
    # What the run cost over all its processes (an interrupted run continued is several).
    total, complete = run_time_total(metrics)
    if status == "completed":
        collapse = classify_collapse(metrics)
        if collapse is not None:
            status, note = "collapsed", str(collapse.get("reason") or "collapsed")
    return {
        "status": status,
        "psnr": metrics.get("psnr"),
        "baseline_psnr": metrics.get("baseline_psnr"),
        "time_per_iter_s": metrics.get("time_per_iter_s"),
        "wall_time_s": metrics.get("wall_time_s"),
        "wall_time_total_s": total,
        "time_total_complete": complete,
        "iterations": metrics.get("iterations"),
        "device": metrics.get("device"),
        "error": metrics.get("error"),
        "note": note,
    }


class RunPool:
    """Trains (candidate, seed) runs, reusing finished ones; ``settings["workers"]`` processes
    at a time.

    Args:
        base: the run config every run starts from (``scene``, ``texture``, ``train``,
            ``export``); each run sets ``precision`` to its candidate and ``train.seed``.
        out: the search directory; runs live in ``<out>/runs/<candidate>/seed<k>/``.
        settings: the checked ``search`` group.
        stop: the search's installed stop signals (``relay=True``).
    """

    def __init__(
        self,
        base: dict[str, Any],
        out: str | os.PathLike,
        settings: Mapping[str, Any],
        stop: StopSignals,
    ):
        self.base, self.out, self.settings, self.stop = base, Path(out), settings, stop
        self.results: dict[tuple[str, int], dict[str, Any]] = {}
        self.trained, self.reused = 0, 0

    def run_dir(self, candidate: Candidate, seed: int) -> Path:
        return self.out / "runs" / candidate.name / f"seed{seed}"

    def config(self, candidate: Candidate, seed: int) -> dict[str, Any]:
        cfg = json.loads(json.dumps(self.base))
        cfg["precision"] = candidate.policy_dict()
        cfg["train"].update(
            seed=seed,
            threads=self.settings["threads"],
            progress=False,
            n_val_images=0,
            resume="auto",
        )
        return cfg

    def _finished(self, run_dir: Path) -> dict[str, Any] | None:
        metrics = read_metrics(run_dir)  # None: missing, torn, or JSON that is no record
        if metrics is None or metrics.get("status") not in _DONE:
            return None
        summary = run_summary(metrics)
        try:  # unknown (a run trained before this record existed): None
            summary["ran_beside"] = json.loads((run_dir / _SHARING).read_text())["ran_beside"]
        except (OSError, ValueError, KeyError, TypeError):
            summary["ran_beside"] = None
        return summary

    def _stopped_by(self) -> str | None:
        return self.stop.received[0] if self.stop.received else None

    def run(self, jobs: Sequence[tuple[Candidate, int]]) -> None:
        """Train the runs of ``jobs`` not yet finished (read back the others) into
        :attr:`results`.

        Raises:
            SearchInterrupted: a stop signal arrived (before, or during these runs: those
                checkpointed and stopped).
        """
        todo = []
        for candidate, seed in dict.fromkeys(jobs):
            key = (candidate.name, seed)
            if key in self.results:
                continue
            done = self._finished(self.run_dir(candidate, seed))
            if done is not None:
                self.results[key] = done
                self.reused += 1
            else:
                todo.append((candidate, seed))
        if not todo:
            return
        if self._stopped_by():
            raise SearchInterrupted(
                f"stopped by {self._stopped_by()}; the same command continues "
                f"the search in {self.out}"
            )
        args = [(self.config(c, s), str(self.run_dir(c, s))) for c, s in todo]
        workers = min(self.settings["workers"], len(todo))
        if workers == 1:
            outputs = [_train_run(*a) for a in args]
        else:
            # A thread per worker waits on one spawned process per run.
            with ThreadPoolExecutor(workers, thread_name_prefix="mptex-search") as threads:
                outputs = list(threads.map(_run_in_process, *zip(*args, strict=True)))
        ended = list(zip(todo, outputs, strict=True))
        lost = [(self.run_dir(c, s), r["error"]) for (c, s), r in ended if r["status"] == "lost"]
        ended = [(job, r) for job, r in ended if r["status"] != "lost"]
        # How many runs shared the device while each trained: its time per iteration is its
        # own only where it ran alone (kept beside metrics.json for a search that reuses it).
        record = json.dumps({"ran_beside": workers - 1}).encode()
        for (candidate, seed), result in ended:
            result["ran_beside"] = workers - 1
            atomic_write_bytes(self.run_dir(candidate, seed) / _SHARING,
                               lambda f: f.write(record))  # fmt: skip
            self.results[(candidate.name, seed)] = result
            self.trained += 1
        stopped = [self.run_dir(c, s) for (c, s), r in ended if r["status"] == "interrupted"]
        runs = "; ".join(f"{path}: {how}" for path, how in lost)
        if stopped or self._stopped_by():
            # A relayed signal ends a worker that has not yet installed its run's handlers.
            also = f"; {len(lost)} ended without a result: {runs}" if lost else ""
            raise SearchInterrupted(
                f"stopped by {self._stopped_by() or 'a signal'} ({len(stopped)} run(s) "
                f"checkpointed{also}); the same command continues the search in {self.out}"
            )
        if lost:
            hint = ""
            if any(how == "killed by SIGKILL" for _, how in lost):
                hint = "; the out-of-memory killer sends SIGKILL: fewer search.workers use less"
                hint += " memory"
            raise SearchInterrupted(
                f"the worker process of {len(lost)} run(s) ended without a result ({runs}{hint}); "
                f"the finished runs are kept, and the same command continues the search in "
                f"{self.out}"
            )
