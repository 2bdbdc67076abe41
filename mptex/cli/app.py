"""What every Hydra command of mptex shares: exit statuses, the experiments group, the sweep
directories' names, a parallel sweep's stop signals, and starting the app over mptex's
configs; and the check every command's output-file flag makes before its work."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict

from mptex._paths import CONFIG_DIR, EXPERIMENTS_DIR
from mptex.scenes.assets import suite_path
from mptex.train.runinfo import reproducible_blas
from mptex.train.signals import DEFAULT_STOP_SIGNALS, STOP_SIGNAL_NAMES, StopSignals

__all__ = ["EXIT_CODES", "job_dirname", "register_experiments", "run_hydra_app",
           "ParallelSweepStopCallback", "sweep_job_process", "stopped_before_start",
           "record_stopped_job"]  # fmt: skip

# The commands' exit statuses (mptex.cli.train's docstring).
EXIT_CODES = {"ok": 0, "error": 2, "interrupted": 3}
# A job directory name (with its "<num>_" prefix) stays under the 255 bytes most file systems
# allow, and long enough that the usual overrides, swept values included, are all in it.
_MAX_DIRNAME = 200


def job_dirname(overrides: str) -> str:
    """A sweep job's directory name from Hydra's ``override_dirname`` (``"precision=f32,
    train.seed=0"``): ``/`` becomes ``%2F`` (a mesh path would otherwise nest directories),
    and a name longer than 200 characters keeps its first 191 and ends in ``~`` and 8 hex digits
    of its md5 (distinct override lists keep distinct names). Used by ``hydra.sweep.subdir`` in
    configs/config.yaml as ``${mptex_dirname:${hydra.job.override_dirname}}``."""
    name = str(overrides).replace("%", "%25").replace("/", "%2F").replace("\\", "%5C") or "job"
    if len(name) > _MAX_DIRNAME:
        digest = hashlib.md5(name.encode()).hexdigest()[:8]
        name = f"{name[: _MAX_DIRNAME - 9]}~{digest}"
    return name


# A value Hydra's override grammar reads unquoted as itself: ASCII letters, digits and a few
# marks, spaces only between them (Hydra strips them at the ends). Anything else (its syntax's
# = , ( ) [ ] { } ' ", a backslash, which escapes, a leading ~, a non-ASCII letter) is quoted.
_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_./:@+%-]+(?: +[A-Za-z0-9_./:@+%-]+)*")
# A run of backslashes before a double quote or the end of a value: inside Hydra's double
# quotes they would escape the quote (or each other), so they are doubled and the quote escaped.
_HYDRA_QUOTE_ESCAPES = re.compile(r'(\\*)("|$)')
# A run of backslashes before "${": OmegaConf, which resolves the value Hydra read, would take
# "${" as an interpolation's start (and "\\" before it as one backslash): the backslashes are
# doubled and one more escapes the "${", so that the path resolves to itself.
_OMEGACONF_INTERPOLATION = re.compile(r"(\\*)\$\{")


def path_override(key: str, path: str | os.PathLike) -> str:
    """``key=path`` as a shell word that Hydra reads as that one path: a job folder is named by
    its overrides (``0_precision=f32,train.seed=0``), whose ``=`` and ``,`` are Hydra's syntax,
    so such a path (and any other that Hydra does not read unquoted as itself: a backslash, a
    non-ASCII letter) goes in Hydra's double quotes, ``"`` escaped and the backslashes before
    a ``"`` or the closing quote doubled, as Hydra's grammar reads them, and a ``${`` escaped
    as OmegaConf, which resolves the value, reads it; then the shell's quoting where it needs
    any (a space)."""
    value = str(path)
    if _HYDRA_PLAIN.fullmatch(value):
        return f"{key}={shlex.quote(value)}"
    value = _OMEGACONF_INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    value = '"' + _HYDRA_QUOTE_ESCAPES.sub(_escape_before_quote, value) + '"'
    return shlex.quote(f"{key}={value}")


def _escape_before_quote(match: re.Match) -> str:
    backslashes, quote = match.groups()
    return backslashes * 2 + ("\\" + quote if quote else "")


def continue_sweep(sweep_dir: str | os.PathLike) -> str:
    """The words that say how a stopped sweep goes on: ``the same command with
    hydra.sweep.dir=<sweep_dir> hydra.callbacks.fresh_sweep_dir.enabled=false continues the
    sweep`` (the folder quoted as :func:`path_override` says); a sweep run again trains its
    completed runs again, which each message says in its own words."""
    return (
        f"the same command with {path_override('hydra.sweep.dir', sweep_dir)} "
        "hydra.callbacks.fresh_sweep_dir.enabled=false continues the sweep"
    )


# Registered at import: sweep jobs resolve hydra.sweep.subdir in the job's process, which under
# the submitit and joblib launchers imports this module to unpickle the task, not train_main.
OmegaConf.register_new_resolver("mptex_dirname", job_dirname, replace=True)
# configs/scene/<asset>.yaml: the real-asset suite's OBJ path, found in pybullet_data at run time.
OmegaConf.register_new_resolver("mptex_asset", suite_path, replace=True)


# ----------------------------------------------------------------------------- parallel sweeps
# Launchers that run a sweep's jobs in worker processes of the sweep's own process, which waits
# for them: hydra/launcher=joblib (local_parallel), whose loky workers the sweep's process kills
# (SIGKILL) when it leaves the wait on an exception (a KeyboardInterrupt, a job's SystemExit).
_WORKER_LAUNCHERS = ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",)
# Launchers that run a sweep's jobs on this machine, in this folder: a sweep's check of its
# values (override_problem) can look for their input files before the first job.
_LOCAL_LAUNCHERS = (
    "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
    *_WORKER_LAUNCHERS,
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
)
# Set by such a sweep for its worker processes: the sweep process's id.
SWEEP_PARENT_ENV = "MPTEX_SWEEP_PARENT"
# Set by such a sweep for its worker processes: the stop signals they start with blocked.
SWEEP_HELD_ENV = "MPTEX_SWEEP_HELD_SIGNALS"
# Set by such a sweep for its worker processes: a file where each job a signal stopped in its
# worker writes one line, so that the sweep's process, which saw no signal, exits 3 too.
SWEEP_STOPPED_ENV = "MPTEX_SWEEP_STOPPED_JOBS"
# The sweep process's handler (it records and passes each signal on to the workers), or a
# worker's, kept installed between its jobs (it records).
_SWEEP_STOP = StopSignals(relay=True)
_JOB_PROCESS_STOP = StopSignals()
_stopped_sweep_dir: list[str] = []


def _stop_signal_names(cfg) -> list[str]:
    names = OmegaConf.select(cfg, "train.stop_signals", default=list(DEFAULT_STOP_SIGNALS))
    if not OmegaConf.is_list(names) and not isinstance(names, (list, tuple)):
        return []  # the run's own check names the bad value
    return [str(n) for n in names if str(n) in STOP_SIGNAL_NAMES]


class ParallelSweepStopCallback(Callback):
    """Hydra callback: a stop signal stops a sweep whose jobs run in worker processes
    (``hydra/launcher=local_parallel``, joblib's loky workers) as it stops a single run.

    At multirun start, under such a launcher, the sweep's process installs a handler for
    ``train.stop_signals`` that only records the signal and passes it on to the workers (a
    signal sent to the sweep's process alone reaches the jobs too), so that the launcher keeps
    waiting for the jobs under way: each finishes its iteration, writes ``checkpoint.pt`` and
    ``metrics.json`` (``status: "interrupted"``) and returns; a job that had not started when
    the signal came does not start (:func:`stopped_before_start`); the report is written and
    the command exits with status 3 (:func:`run_hydra_app`). The workers start with those
    signals blocked, so that one that comes while a worker starts waits for its handler.
    Without this, joblib kills the workers on the sweep's KeyboardInterrupt, and SIGTERM ends
    the sweep's process at once.
    Other launchers are left as they are. Registered in ``configs/config.yaml``
    (``hydra.callbacks.parallel_stop``).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        target = OmegaConf.select(config, "hydra.launcher._target_", default=None)
        if not self.enabled or target not in _WORKER_LAUNCHERS:
            return
        names = _stop_signal_names(config)
        if not names:  # train.stop_signals=[]: each signal's default action stays
            return
        os.environ[SWEEP_PARENT_ENV] = str(os.getpid())  # the workers inherit it
        fd, path = tempfile.mkstemp(prefix="mptex-stopped-jobs-", suffix=".txt")
        os.close(fd)
        os.environ[SWEEP_STOPPED_ENV] = path
        _stopped_sweep_dir[:] = [str(config.hydra.sweep.dir)]
        _SWEEP_STOP.install(names, owner="hydra.callbacks.parallel_stop")
        _hold_for_workers(names)


def _hold_for_workers(names: list[str]) -> None:
    """Block the stop signals ``names`` in this (the main) thread, so that the worker
    processes the launcher starts from it, and the threads that start more, begin with them
    blocked: a worker takes seconds to start (an interpreter, torch's import) before its job
    installs a handler (:func:`stopped_before_start`), and a Ctrl-C to the process group in
    that time killed it, upon which joblib ended the whole sweep with its error. Blocked, the
    signal waits in the worker until its handler is in place, and the worker's first job
    does not start. This process still receives them: a thread started before the block
    keeps them unblocked, the kernel delivers a process's signal to such a thread, and
    Python runs the handler in the main thread. Released by :func:`_release_held`."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: the workers are not held
        return
    from multiprocessing import resource_tracker

    # The standard library's resource tracker unblocks SIGINT and SIGTERM in the thread that
    # starts it (after its own start), which the launcher's process pool does: started now.
    resource_tracker.ensure_running()
    receiver = threading.Thread(target=threading.Event().wait, daemon=True,
                                name="mptex-stop-signal-receiver")  # fmt: skip
    receiver.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.Signals[n] for n in names})
    os.environ[SWEEP_HELD_ENV] = ",".join(names)


def _release_held() -> None:
    """Unblock in this thread the stop signals a parallel sweep blocked (in the sweep's
    process at its end, in a worker once its handler is installed): one that came while they
    were blocked is handled now."""
    held = os.environ.get(SWEEP_HELD_ENV)
    if held and hasattr(signal, "pthread_sigmask"):
        names = [n for n in held.split(",") if n in STOP_SIGNAL_NAMES]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.Signals[n] for n in names})


def sweep_job_process() -> bool:
    """Whether this process runs jobs of a sweep whose own process waits for them and handles
    stop signals (:class:`ParallelSweepStopCallback`): a job stopped by a signal then returns
    normally, and the sweep's process exits with status 3 at its end."""
    parent = os.environ.get(SWEEP_PARENT_ENV)
    return bool(parent) and parent != str(os.getpid())


def stopped_before_start(cfg, run_dir: str | os.PathLike, prog: str) -> bool:
    """In a job process of a parallel sweep (:func:`sweep_job_process`), at a job's start:
    install the process's own flag-only handler for ``train.stop_signals`` (kept between its
    jobs, so that a signal while it waits for a job does not end it; the run's handler passes
    what it receives on to it), and say whether a stop signal has come: the job then does not
    start, one line says so, and its directory, which Hydra has just made, is removed where it
    holds nothing but Hydra's files (``.hydra/``, the job's log), so that the report counts the
    job as never started. Elsewhere: False."""
    if not sweep_job_process():
        return False
    if not _JOB_PROCESS_STOP.installed:
        _JOB_PROCESS_STOP.install(_stop_signal_names(cfg), owner="a parallel sweep's job")
        _release_held()  # a signal that came while the worker started is recorded now
    if not _JOB_PROCESS_STOP.received:
        return False
    run_dir = Path(run_dir)
    entries = list(run_dir.iterdir()) if run_dir.is_dir() else []
    if entries and all(p.name == ".hydra" or p.suffix == ".log" for p in entries):
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"{prog}: not started: the sweep was stopped by {_JOB_PROCESS_STOP.received[0]} "
          f"before this job ({run_dir.name})", file=sys.stderr, flush=True)  # fmt: skip
    record_stopped_job(run_dir, "not started")
    return True


def record_stopped_job(run_dir: str | os.PathLike, what: str) -> None:
    """In a job process of a parallel sweep, note that a stop signal stopped the job of
    ``run_dir`` (``what``: "interrupted", "not started") before the job returns to the sweep.
    A signal sent to a worker process alone never reaches the sweep's process, which would
    otherwise end with status 0 as if every job had run; it reads these notes at its end
    (:func:`run_hydra_app`). Elsewhere: nothing."""
    path = os.environ.get(SWEEP_STOPPED_ENV)
    if not path or not sweep_job_process():
        return
    # One short write in append mode: the workers' lines do not interleave. A note that
    # cannot be written leaves the job's own line and files to say it.
    with contextlib.suppress(OSError), open(path, "a") as notes:
        notes.write(f"{Path(run_dir).name}: {what}\n")


def _stopped_jobs() -> list[str]:
    """The notes of :func:`record_stopped_job` of this sweep's workers, the file removed."""
    path = os.environ.pop(SWEEP_STOPPED_ENV, None)
    if not path:
        return []
    try:
        with open(path) as notes:
            return [line.rstrip("\n") for line in notes if line.strip()]
    except OSError:
        return []
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def output_file_problem(flag: str, path: str | os.PathLike) -> str | None:
    """The line a command's output flag ``flag`` says where ``path`` cannot be a file this
    process writes (a folder, in a folder that does not exist, or in one it may not write), or
    None. Checked before the command's work, whose result a write failing at the end would
    throw away. A symbolic link is judged by where it points, since writing through it creates
    or replaces that file."""
    folder = os.path.dirname(os.path.realpath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"{flag}: cannot write {path} (not a writable file location)"
    return None


def register_experiments(directory: str | os.PathLike = EXPERIMENTS_DIR) -> list[str]:
    """Make ``experiments/*.yaml`` the ``experiment`` config group (``+experiment=NAME``).

    Sweeps live beside ``configs/`` rather than in it (one place for what to run, one for how);
    Hydra finds a group only under a search-path root, so they are stored in its ConfigStore
    at the ``_global_`` package, as their ``# @package _global_`` header says.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store, names = ConfigStore.instance(), []
    for path in sorted(Path(directory).glob("*.yaml")):
        store.store(group="experiment", name=path.stem, node=OmegaConf.load(path),
                    package="_global_")  # fmt: skip
        names.append(path.stem)
    return names


class _CtrlC:
    """SIGINT's default action (KeyboardInterrupt), noting that it came: a command can tell a
    failure that a Ctrl-C caused inside Hydra from one of Hydra's own. Installed only over
    Python's default handler, in the main thread; a handler installed over it later (a run's
    stop signals) takes SIGINT, and this one is back when that is removed."""

    def __init__(self) -> None:
        self.received = False
        self._previous = None

    def install(self) -> None:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):  # fmt: skip
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class _InterpolationErrorsInOneLine:
    """A Hydra task that says an interpolation that does not resolve in one line naming the
    key, exit status 2 (a single run; in a sweep the next job goes on), where OmegaConf's
    report ran over several lines and a traceback: an override such as
    ``train.lr=${oc.env:LR}`` with ``LR`` unset, or ``${missing.key}``. A class, not a closure,
    so that a sweep's launcher (joblib, submitit) can pickle it; Hydra reads the task's module
    through ``__wrapped__``."""

    def __init__(self, task, prog: str) -> None:
        self.__wrapped__ = task
        self.prog = prog

    def __call__(self, cfg) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf.errors import InterpolationResolutionError

        try:
            return self.__wrapped__(cfg)
        except InterpolationResolutionError as exc:
            # OmegaConf's message adds lines naming the key and the container's type.
            print(f"{self.prog}: error: {exc.full_key}: {str(exc).splitlines()[0]}",
                  file=sys.stderr)  # fmt: skip
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                return None
            sys.exit(EXIT_CODES["error"])


def run_hydra_app(task, prog: str, check=None) -> None:
    """Run ``task(cfg)`` as a Hydra app over mptex's ``configs/config.yaml`` with the
    experiments registered; the common start of ``mptex-train`` and ``mptex-search``. An
    interpolation that does not resolve ends it in one line naming the key, exit status 2.
    ``check(cfg, local)``: the command's own check of a composed config (one line, or None),
    run on each value of a sweep before its first job (:func:`override_problem`)."""
    reproducible_blas()
    if not (CONFIG_DIR / "config.yaml").is_file():
        print(
            f"{prog}: error: configs not found at {CONFIG_DIR}: this mptex is neither a wheel "
            "install (mptex/configs) nor a source checkout (configs/ beside mptex/); reinstall it",
            file=sys.stderr,
        )
        sys.exit(EXIT_CODES["error"])
    import hydra

    register_experiments()
    app = hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")(
        _InterpolationErrorsInOneLine(task, prog)
    )
    ctrl_c = _CtrlC()
    ctrl_c.install()
    outside_loop = (
        f"{prog}: interrupted by SIGINT outside a training loop: no checkpoint was written "
        "for it; files written before it are as they were"
    )
    try:
        problem = override_problem(sys.argv[1:], check)
        if problem is not None:
            print(f"{prog}: error: {problem}", file=sys.stderr)
            sys.exit(EXIT_CODES["error"])
        app()
    except KeyboardInterrupt:
        # Ctrl-C before a run's (or a parallel sweep's) handler took SIGINT over, or after it
        # gave it back: no training loop was under way, so no checkpoint was due.
        print(outside_loop, file=sys.stderr)
        sys.exit(EXIT_CODES["interrupted"])
    except SystemExit as exc:
        # Hydra reports an error of its own with status 1, also one a Ctrl-C caused in the
        # middle of its work (an interrupted composition surfaces as another exception):
        # after its lines, the status of an interrupted command.
        if exc.code == 1 and ctrl_c.received:
            print(outside_loop, file=sys.stderr)
            sys.exit(EXIT_CODES["interrupted"])
        raise
    finally:
        ctrl_c.uninstall()
        stopped = []
        if os.environ.get(SWEEP_PARENT_ENV) == str(os.getpid()):
            _release_held()
            stopped = _stopped_jobs()
    if _SWEEP_STOP.received:  # a parallel sweep stopped: its jobs under way checkpointed
        print(
            f"{prog}: sweep stopped by {_SWEEP_STOP.received[0]}: the jobs under way wrote "
            f"their checkpoints, the others did not start; {continue_sweep(_stopped_sweep_dir[0])} "
            "(train.resume=auto; its completed runs train again)",
            file=sys.stderr,
        )
        sys.exit(EXIT_CODES["interrupted"])
    if stopped:  # a signal to a worker process alone: the sweep ran on, its report counts them
        print(
            f"{prog}: sweep ended with {len(stopped)} of its jobs stopped by a signal to their "
            f"worker process ({'; '.join(stopped)}): {continue_sweep(_stopped_sweep_dir[0])} "
            "(train.resume=auto; its completed runs train again)",
            file=sys.stderr,
        )
        sys.exit(EXIT_CODES["interrupted"])


# Hydra's flags after which it does not compose the run's config as given (help, the config's
# printout, another config): left to Hydra.
_OWN_FLAGS = ("help", "hydra_help", "version", "cfg", "info", "shell_completion", "config_path",
              "config_name", "config_dir", "experimental_rerun")  # fmt: skip


def override_problem(argv: list[str], check=None) -> str | None:
    """One line saying why Hydra would not compose the config of ``argv``'s overrides (a key
    that is not in the config, an unknown option of a config group, a syntax error), or None.

    Each value of a swept override (``precision=f32,f99``) is composed once, the other
    overrides at their first value, before any job starts: a sweep with one bad value runs
    none. Hydra reports these itself, over several lines and with exit status 1, and only once
    a sweep reaches the job. Anything this check cannot read (Hydra's own flags, an error it
    does not recognise) is left to Hydra. For a multirun (``-m``), ``check(cfg, local)`` (the
    command's own check of a composed config, without its ``hydra`` node: one line or None;
    ``local``: the launcher runs the jobs on this machine, from this folder) runs on each of
    those compositions too, so that a value the command refuses
    (``train.seed=0,1,x``) stops the sweep before its first job instead of failing that job
    after the others trained; a single run checks its config itself."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # argparse's own error: Hydra prints it
        return None
    if any(getattr(args, flag, None) for flag in _OWN_FLAGS):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except (HydraException, OmegaConfBaseException) as exc:  # a syntax error
        _reraise_interrupt(exc)
        return "override syntax: " + " ".join(str(exc).split())
    try:
        choices = []
        for override in parsed:
            key = override.get_key_element()
            if override.is_sweep_override():
                choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
            else:
                value = override.get_value_element_as_str()
                choices.append([key if value is None else f"{key}={value}"])
    except Exception as exc:  # a sweep only Hydra's config loader expands (glob(...)): Hydra's
        _reraise_interrupt(exc)
        return None
    try:
        firsts = [values[0] for values in choices]
        trials = [firsts] + [
            [*firsts[:i], value, *firsts[i + 1 :]]
            for i, values in enumerate(choices)
            for value in values[1:]
        ]
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            # ~0.1 s a composition: a long sweep (train.seed=range(0,1000)) is checked on its
            # first values, the rest left to Hydra
            for overrides in trials[:_MAX_TRIALS]:
                cfg = compose("config", overrides=overrides, return_hydra_config=True)
                if check is not None and args.multirun:
                    # A sweeper's own params (an experiment's) set each job's values of their
                    # keys: this composition has none of them, so what it says of those keys
                    # (or of a group they choose) is not about any job.
                    swept = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
                    launcher = OmegaConf.select(cfg, "hydra.launcher._target_", default=None)
                    with open_dict(cfg):
                        del cfg["hydra"]
                    problem = check(cfg, launcher in _LOCAL_LAUNCHERS)
                    key = (problem or "").split(":", 1)[0]
                    if problem is not None and not any(
                        key == k or key.startswith(f"{k}.") for k in swept
                    ):
                        return problem
    except (HydraException, OmegaConfBaseException) as exc:
        _reraise_interrupt(exc)
        message = " ".join(str(exc).split())
        merge = _merge_problem(message, exc.__cause__)
        if merge is not None:
            return merge
        return _did_you_mean(message.split(" Config search path:")[0])  # not the search path
    except Exception as exc:  # what this check cannot compose (sweeper params as an override)
        _reraise_interrupt(exc)
        return None
    return None


_MERGE_PREFIX = "Error merging override "
# What a key of each container kind holds, in a config error's words.
_CONTAINER_KINDS = {list: "a list", dict: "a mapping"}


def _merge_problem(message: str, cause: BaseException | None) -> str | None:
    """``"<key>: expected a list, got <value>"`` for Hydra's ``Error merging override
    <key>=<value>``, where the value is a mapping given for a list (``train.betas={a:1}``) or
    the reverse: OmegaConf's cause names the key and the kind it holds, Hydra's line neither
    what the key takes nor why. None for any other error."""
    from omegaconf.errors import ConfigTypeError

    if not message.startswith(_MERGE_PREFIX) or not isinstance(cause, ConfigTypeError):
        return None
    kind = _CONTAINER_KINDS.get(cause.object_type)
    override = message.removeprefix(_MERGE_PREFIX)
    if kind is None or not cause.full_key or "=" not in override:
        return None
    return f"{cause.full_key}: expected {kind}, got {override.split('=', 1)[1]}"


def _reraise_interrupt(exc: BaseException) -> None:
    """Raise KeyboardInterrupt where ``exc`` came from one: a Ctrl-C in the middle of a
    composition can surface from Hydra or OmegaConf as another error (an empty
    ConfigCompositionException, an AttributeError of a half-built node) with the interrupt as
    its cause or context, which the check must not take for a problem of the config."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__


def _did_you_mean(message: str) -> str:
    """Hydra's line for a key the config lacks (``Could not override 'train.iteration'. To
    append to your config use +train.iteration=5``), with the config's closest key named when
    one is close: a typo is likelier than a wish to add a key the run would refuse."""
    import difflib
    import re

    from hydra import compose, initialize_config_dir

    found = re.match(r"Could not override '([^']+)'\.", message)
    if found is None:
        return message
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            config = OmegaConf.to_container(compose("config"), resolve=False)
    except Exception as exc:  # the base config cannot be composed here: Hydra's words as they are
        _reraise_interrupt(exc)
        return message

    def keys(node, prefix=""):
        for key, value in node.items():
            name = f"{prefix}{key}"
            yield name
            if isinstance(value, dict):
                yield from keys(value, name + ".")

    close = difflib.get_close_matches(found.group(1), list(keys(config)), n=1, cutoff=0.8)
    if not close:
        return message
    # Hydra's advice (append it with +) would add a key the run's check then refuses.
    return f"Could not override '{found.group(1)}': no such key (did you mean {close[0]}?)"


_MAX_TRIALS = 64
