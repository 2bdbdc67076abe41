"""Two reports' ``results.json`` compared value by value, timings and paths left out.

What a change that must not move any result is checked with (a faster kernel, another thread
count, a new version of a dependency): every PSNR, baseline, paired difference, interval,
verdict and statistic of every run and arm must be the same, while times per iteration, peak
memory, speed-ups and the directories the runs were written to may differ.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOT_RESULTS", "result_differences"]

# Keys left out of the comparison: a key containing any of these words is a timing, a memory
# figure or a path, which differ between two runs of the same computation, or where it ran
# (package versions, thread count, device), which a comparison across thread counts, versions
# or machines changes on purpose.
NOT_RESULTS = ("time", "memory", "speedup", "run_dir", "sweep_dir", "versions", "threads",
               "device")  # fmt: skip


def result_differences(before: Any, after: Any, where: str = "") -> list[str]:
    """Where two ``results.json`` documents (or any JSON values) differ.

    Walks both documents together: mappings key by key (a key in one only is a difference;
    keys containing a word of :data:`NOT_RESULTS` are skipped), lists entry by entry (lists of
    different lengths are one difference), anything else compared with ``==`` (so two floats
    must be the same number, bit for bit once parsed).

    Returns:
        one line per difference, ``"<where>: <before> -> <after>"`` (``where`` the place in
        the documents, as ``/runs[0]/psnr``), ``"<where>: only in before|after"`` or
        ``"<where>: 3 vs 4 entries"``; empty when the results are the same.
    """
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after)):
            if any(word in key for word in NOT_RESULTS):
                continue
            if key not in before or key not in after:
                out.append(f"{where}/{key}: only in {'after' if key in after else 'before'}")
            else:
                out += result_differences(before[key], after[key], f"{where}/{key}")
        return out
    if isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            return [f"{where}: {len(before)} vs {len(after)} entries"]
        return [
            line
            for i, (a, b) in enumerate(zip(before, after, strict=True))
            for line in result_differences(a, b, f"{where}[{i}]")
        ]
    return [] if before == after else [f"{where}: {before!r} -> {after!r}"]
