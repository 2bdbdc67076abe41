"""Bodies for the search's worker processes that stand in for a training run (a spawned process
imports them by name, so they live in a module of their own, not in a test's closure)."""

from __future__ import annotations

import os
import signal


def send_summary(conn, cfg, run_dir):
    """A run that ends normally: its summary names the run's folder and config."""
    conn.send({"status": "completed", "psnr": 30.0, "error": None, "run_dir": run_dir, "cfg": cfg})
    conn.close()


def killed(conn, cfg, run_dir):
    """A process killed mid-run, as the out-of-memory killer does: nothing is sent."""
    os.kill(os.getpid(), signal.SIGKILL)


def exits_3(conn, cfg, run_dir):
    """A process that exits without a result (an import failure's exit, say)."""
    os._exit(3)
