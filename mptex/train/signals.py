"""Stop signals: a run asked to stop (Slurm preemption, a time limit, Ctrl-C) ends cleanly.

Slurm and its launchers stop a job with a signal and kill it a grace period later (Slurm's
``KillWait``; ``docs/cluster.md``). :class:`StopSignals` installs, for the signals named in
``train.stop_signals``, a handler that only records the signal; the training loop looks at
:attr:`StopSignals.received` after each completed iteration, writes ``checkpoint.pt`` and a
``metrics.json`` with ``status: "interrupted"``, and returns. Because the handler never raises,
a second signal during those writes interrupts nothing: the atomic writes stay atomic. A signal
that comes once the last iteration has begun stops nothing: the run completes and records it
(``metrics.json``'s ``stop_requested``).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mptex.config_schema import ListOf, OneOf
from mptex.train.checkpoint import read_metrics

# The signals ``train.stop_signals`` may name: those a scheduler or a user sends to ask for a
# stop. SIGUSR2 is submitit's pre-timeout / preemption signal (its SUBMITIT_PREEMPT_SIGNAL
# default), SIGXCPU what some schedulers send at a CPU-time limit. SIGKILL and SIGSTOP cannot
# be caught.
STOP_SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU")


# train.stop_signals' default: what Slurm, submitit and a terminal send to stop a job.
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
# The kind of value ``train.stop_signals`` is (duplicates dropped).
STOP_SIGNAL_LIST = ListOf(
    OneOf(STOP_SIGNAL_NAMES),
    unique=True,
    what=f"a list of signal names from {list(STOP_SIGNAL_NAMES)}",
)


def send_signal(name: str) -> None:
    """Send the signal ``name`` (e.g. ``"SIGTERM"``) to this process, as ``kill`` would."""
    os.kill(os.getpid(), signal.Signals[name])


class StopSignals:
    """Flag-only handlers for stop signals, restored on :meth:`uninstall`.

    Usage (what :func:`mptex.train.train` does)::

        stop = StopSignals()
        try:
            stop.install(["SIGTERM", "SIGINT"])
            ...  # after each iteration: if stop.received: checkpoint, write metrics, return
        finally:
            stop.uninstall()  # the previous handlers are back

    Python runs signal handlers in the main thread only, and ``signal.signal`` may only be
    called there: from another thread :meth:`install` warns and installs nothing.

    Installed over another StopSignals (a parallel sweep's job process keeps one installed
    between its jobs, :mod:`mptex.cli.app`), it starts with the signals that one has already
    received, and passes each new one on to it: a signal that arrives while a run starts stops
    the run, and the enclosing one knows of every signal.

    Args:
        relay: also pass each signal on to this process's child processes (the precision
            search's worker processes, :mod:`mptex.search.pool`): each one's run then stops
            with its own handlers, checkpoints and exits, while this process, which only
            records the signal, starts nothing new.
    """

    def __init__(self, relay: bool = False) -> None:
        self.received: list[str] = []  # signal names in order of arrival
        self.relay = relay
        self._previous: dict[signal.Signals, object] = {}

    def install(self, names: Sequence[str], owner: str = "train.stop_signals: train()") -> None:
        """Install the handler for the signals ``names``; ``owner`` names the caller in the
        warning given outside the main thread."""
        if not names:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                f"{owner} runs outside the main thread, where Python cannot install signal "
                "handlers; a stop signal will end the run without a checkpoint",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        outers = []
        for name in names:
            signum = signal.Signals[name]
            self._previous[signum] = signal.signal(signum, self._handle)
            outer = _owner(self._previous[signum])
            if outer is not None and outer not in outers:
                outers.append(outer)
        for outer in outers:  # what arrived before this install
            self.received.extend(n for n in outer.received if n in names)

    @property
    def installed(self) -> bool:
        """Whether :meth:`install` installed handlers that :meth:`uninstall` has not removed."""
        return bool(self._previous)

    def _handle(self, signum: int, frame: object) -> None:
        # Only record (and relay): raising here could land inside a checkpoint write.
        self.received.append(signal.Signals(signum).name)
        if self.relay:
            for child in multiprocessing.active_children():
                try:
                    os.kill(child.pid, signum)
                except (ProcessLookupError, TypeError):  # exited, or not started (pid None)
                    pass
        outer = self._previous.get(signal.Signals(signum))
        if _owner(outer) is not None:
            outer(signum, frame)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            # None: a handler installed from C, which Python cannot reinstate; the default
            # action is the closest.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()


def _owner(handler: object) -> StopSignals | None:
    """The StopSignals whose handler ``handler`` is, or None."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, StopSignals) else None


def auto_resume_path(run_dir: str | os.PathLike) -> Path | None:
    """What ``train.resume=auto`` resumes from: ``<run_dir>/checkpoint.pt``, or None.

    The checkpoint is used when it exists and ``metrics.json`` says ``status: "interrupted"``
    (the last run here stopped on a stop signal and wrote both files), or ``status: "failed"``
    with ``failed_writing`` (a full disk stopped it; its checkpoint is the last good one), or
    when Slurm restarted this job (``SLURM_RESTART_COUNT`` >= 1: a requeue after a preemption
    or a node failure, which may come without a stop signal). Otherwise the run starts over,
    as with ``train.resume=false``: a completed, diverged or failed run is not continued by
    accident.
    """
    checkpoint = Path(run_dir) / "checkpoint.pt"
    if not checkpoint.is_file():
        return None
    if os.environ.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0"):
        return checkpoint
    metrics = read_metrics(run_dir)
    return checkpoint if metrics is not None and stopped_record(metrics) else None


def stopped_record(metrics: Mapping[str, Any]) -> bool:
    """Whether ``metrics`` (a ``metrics.json``) records a run that stopped to be continued: a
    stop signal's ``status: "interrupted"``, or a full disk's ``status: "failed"`` with
    ``failed_writing``. ``train.resume=auto`` continues such a run (:func:`auto_resume_path`)."""
    status = metrics.get("status")
    return status == "interrupted" or bool(status == "failed" and metrics.get("failed_writing"))
