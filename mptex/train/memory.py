"""Peak memory of one run: the CUDA allocator peak, or resident memory sampled from /proc.

A run's memory is measured in two parts, in this order: its start (the config, the scene with
the training views' G-buffers, the texture, set-up with a checkpoint restored; up to the first
iteration, :func:`start_peak_memory`), then the rest (iterations, validation, export;
:func:`peak_memory`). The arms of a sweep differ in the second; a job needs the larger of the
two.
"""

from __future__ import annotations

import os
import resource
import sys
import threading

import torch

__all__ = ["RunPeakRss", "measure_memory", "start_peak_memory", "peak_memory"]


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
        # The sampling thread and split() both write peak: one at a time, or a split's new
        # start could be overwritten by the sample it raced with.
        self._lock = threading.Lock()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mptex-rss", daemon=True)

    def _sample(self) -> None:
        with self._lock:
            self.peak = max(self.peak, self._resident())

    def _resident(self) -> int:
        with open(self._STATM) as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def start(self) -> RunPeakRss:
        if self.available:
            self._sample()
            self._thread.start()
        return self

    def split(self) -> int:
        """The peak so far (a last sample included); the peak then starts again from the
        resident memory now. 0 when /proc cannot be sampled."""
        if not self.available:
            return 0
        with self._lock:
            now = self._resident()
            peak, self.peak = max(self.peak, now), now
        return peak

    def stop(self) -> None:
        if self.available and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._sample()


def measure_memory(device: torch.device) -> RunPeakRss:
    """Begin measuring a run's memory on ``device``, before its start: the CUDA allocator's
    peak reset (what an earlier run in this process peaked at is not this run's), or a started
    resident-memory sampler off CUDA (on CUDA a disabled one: no thread takes the GIL from the
    loop). Stop the returned sampler when the run ends."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return RunPeakRss(enabled=device.type != "cuda").start()


def start_peak_memory(device: torch.device, rss: RunPeakRss) -> int:
    """The peak of a run's start, in the kind :func:`peak_memory` names; call it once the start
    is over. From then on ``rss`` (or, on CUDA, the allocator's peak, reset here) measures the
    rest of the run. Where /proc cannot be sampled it is the process's lifetime peak so far."""
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    if rss.available:
        return rss.split()
    return _lifetime_peak()


def _lifetime_peak() -> int:
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(lifetime if sys.platform == "darwin" else lifetime * 1024)


def peak_memory(device: torch.device, rss: RunPeakRss) -> tuple[int, str]:
    """``(bytes, kind)``: the CUDA allocator's peak (``"cuda_max_allocated"``), this run's sampled
    resident peak (``"run_peak_rss"``), or the process's lifetime peak (``"process_peak_rss"``)
    where /proc cannot be sampled."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    if rss.available:
        return rss.peak, "run_peak_rss"
    return _lifetime_peak(), "process_peak_rss"
