"""Peak memory of one run: the CUDA allocator peak, or resident memory sampled from /proc."""

from __future__ import annotations

import os
import resource
import sys
import threading

import torch

__all__ = ["RunPeakRss", "peak_memory"]


class RunPeakRss:
    """This run's peak resident memory, from /proc/self/statm sampled by a daemon thread.

    ``ru_maxrss`` is the process's lifetime peak: jobs that share a process (Hydra's basic
    launcher) would all report the largest earlier job. Where /proc is missing (macOS) it is
    the fallback, and says so in ``peak_memory_kind``.
    """

    _STATM = "/proc/self/statm"

    def __init__(self, interval_s: float = 0.005, enabled: bool = True):
        # enabled=False (a CUDA run, whose peak is the allocator's): no thread wakes every
        # interval to take the GIL from the loop
        self.available = enabled and os.path.exists(self._STATM)
        self.peak = 0
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mptex-rss", daemon=True)

    def _sample(self) -> None:
        with open(self._STATM) as f:
            pages = int(f.read().split()[1])
        self.peak = max(self.peak, pages * os.sysconf("SC_PAGE_SIZE"))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def start(self) -> RunPeakRss:
        if self.available:
            self._sample()
            self._thread.start()
        return self

    def stop(self) -> None:
        if self.available and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._sample()


def peak_memory(device: torch.device, rss: RunPeakRss) -> tuple[int, str]:
    """``(bytes, kind)``: the CUDA allocator's peak (``"cuda_max_allocated"``), this run's sampled
    resident peak (``"run_peak_rss"``), or the process's lifetime peak (``"process_peak_rss"``)
    where /proc cannot be sampled."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    if rss.available:
        return rss.peak, "run_peak_rss"
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(lifetime if sys.platform == "darwin" else lifetime * 1024), "process_peak_rss"
