"""Test hooks of tests/test_signals.py, read from the environment at interpreter start.

This folder goes first on a subprocess's ``PYTHONPATH``; Python then imports this module at
start. With none of the ``MPTEX_TEST_*`` variables set it only defines :func:`failing_writer`.
Once ``mptex.train.loop`` is imported it patches, as asked:

* ``MPTEX_TEST_ITER_SLEEP_S``: every iteration sleeps this long (in ``lr_schedule``, called
  once per iteration) and the first prints ``ITERATING``;
* ``MPTEX_TEST_SLOW_SAVE_S``: ``torch.save`` writes half, prints ``WRITING``, sleeps, then writes
  the rest, so that a signal lands in the middle of a checkpoint write;
* ``MPTEX_TEST_ENOSPC_AT``: :func:`failing_writer` from that atomic write on;
* ``MPTEX_TEST_SIGNAL_IN``: the process sends itself ``MPTEX_TEST_SIGNAL`` (default SIGTERM),
  as a ``kill`` from outside would, at the start of a part of the run after its last
  iteration: ``validation`` (the final validation), ``checkpoint`` (the final checkpoint's
  write) or ``export``; or ``end``, just after ``train()`` has removed its handlers (the run
  ended; the process has not exited yet); once per process.

And at once, in a worker process of a parallel sweep (joblib's loky, started by the sweep's
process, whose id ``MPTEX_SWEEP_PARENT`` holds):

* ``MPTEX_TEST_WORKER_START_S``: the worker creates ``worker-<pid>`` in the folder
  ``MPTEX_TEST_MARK_DIR``, then sleeps this long before it goes on starting (a slow start: a
  cold import from a network file system), so that a signal can be sent while it starts.
"""

import builtins
import errno
import io
import os
import sys
import time

SLEEP = float(os.environ.get("MPTEX_TEST_ITER_SLEEP_S", "0"))
SLOW_SAVE = float(os.environ.get("MPTEX_TEST_SLOW_SAVE_S", "0"))
ENOSPC_AT = int(os.environ.get("MPTEX_TEST_ENOSPC_AT", "0"))
SIGNAL_IN = os.environ.get("MPTEX_TEST_SIGNAL_IN", "")
WORKER_START = float(os.environ.get("MPTEX_TEST_WORKER_START_S", "0"))


def _loky_worker() -> bool:
    parent = os.environ.get("MPTEX_SWEEP_PARENT")
    if not parent or parent == str(os.getpid()):
        return False
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"popen_loky_posix" in f.read()
    except OSError:
        return False


if WORKER_START and _loky_worker():
    mark = os.path.join(os.environ["MPTEX_TEST_MARK_DIR"], f"worker-{os.getpid()}")
    open(mark, "w").close()
    time.sleep(WORKER_START)


def failing_writer(atomic_write_bytes, at, sticky=True):
    """``atomic_write_bytes`` whose call number ``at`` (1-based), and every later one when
    ``sticky`` (the disk stays full), writes half of its first chunk and raises ENOSPC."""
    count = [0]

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

    def write(path, fill):
        count[0] += 1
        if count[0] < at or (count[0] > at and not sticky):
            return atomic_write_bytes(path, fill)
        return atomic_write_bytes(path, lambda f: fill(Full(f)))

    return write


def _patch(loop, checkpoint, torch):
    if SLEEP:
        schedule = loop.lr_schedule

        def slow_schedule(*args, **kwargs):
            if not getattr(slow_schedule, "said", False):
                slow_schedule.said = True
                print("ITERATING", flush=True)
            time.sleep(SLEEP)
            return schedule(*args, **kwargs)

        loop.lr_schedule = slow_schedule
    if SLOW_SAVE:
        save = torch.save

        def slow_save(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            print("WRITING", flush=True)
            time.sleep(SLOW_SAVE)
            f.write(data[len(data) // 2 :])

        torch.save = slow_save
    if ENOSPC_AT:
        checkpoint.atomic_write_bytes = failing_writer(checkpoint.atomic_write_bytes, ENOSPC_AT)
    if SIGNAL_IN:
        _signal_in(loop)


def _signal_in(loop):
    import signal

    sent = []

    def send():
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.Signals[os.environ.get("MPTEX_TEST_SIGNAL", "SIGTERM")])

    if SIGNAL_IN == "validation":
        validate = loop.validate

        def signalled_validate(run, completed):
            if completed == run.n_iter:
                send()
            return validate(run, completed)

        loop.validate = signalled_validate
    elif SIGNAL_IN == "checkpoint":
        save = loop.save_checkpoint

        def signalled_save(path, payload):
            if payload["iteration"] == payload["config"]["train"]["iterations"]:
                send()
            return save(path, payload)

        loop.save_checkpoint = signalled_save
    elif SIGNAL_IN == "end":

        class SignalledAtEnd(loop.StopSignals):
            def uninstall(self):
                super().uninstall()
                send()

        loop.StopSignals = SignalledAtEnd
    elif SIGNAL_IN == "export":
        export = loop._export

        def signalled_export(full, *args):
            if full["export"]["enabled"]:
                send()
            return export(full, *args)

        loop._export = signalled_export
    else:
        raise ValueError(
            f"MPTEX_TEST_SIGNAL_IN: expected validation, checkpoint, export or end, got "
            f"{SIGNAL_IN!r}"
        )


if SLEEP or SLOW_SAVE or ENOSPC_AT or SIGNAL_IN:
    _real_import = builtins.__import__

    def _hooked_import(*args, **kwargs):
        # Patch once mptex.train.loop is fully imported (its last definition, finish, exists).
        module = _real_import(*args, **kwargs)
        loop = sys.modules.get("mptex.train.loop")
        if loop is not None and hasattr(loop, "finish"):
            builtins.__import__ = _real_import
            _patch(loop, sys.modules["mptex.train.checkpoint"], sys.modules["torch"])
        return module

    builtins.__import__ = _hooked_import
