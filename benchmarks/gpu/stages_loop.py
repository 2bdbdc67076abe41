"""The GPU kit's training-loop stages, for ``benchmarks/gpu/validate.py`` to import:

* ``profile`` (:func:`stage_profile`): each main arm at nvdiffrec's scale (512², batch 4, its
  texture) for ``--profile-iterations`` iterations under ``torch.profiler``: ms per iteration,
  kernel launches, stream synchronisations and device-to-host copies per iteration, the time
  of the loop's parts (the ``mptex.*`` scopes) and the top ops by device time; then their host
  floor (``benchmarks/loop_overhead.py --host-ms`` on the device: the iteration time where the
  kernels cost next to nothing), and the same arms under ``loop_overhead.py``'s counter on the
  device (ops and host synchronisations per iteration, the sites of the syncs).
* ``mainjob`` (:func:`stage_mainjob`): ``mptex-train -m +experiment=gpu_main`` (the main arms
  x 5 seeds at nvdiffrec's scale, four runs sharing the GPU) as a user runs it, its wall time
  against the 10-minute target, each arm's median ms per iteration and PSNR from the sweep's
  ``results.json``, and the report's path.

Each stage takes validate.py's ``StageContext`` (``small`` on ``--device cpu``: tiny sizes for
a dry run) and writes tables and ``data`` through it; a failing check goes into
``failed_checks``. validate.py runs ``profile`` by default and ``mainjob`` when named
(``--stages mainjob``, in a call of its own: its target is 10 minutes), and keeps the main job's
report as ``mainjob-report.md`` beside its results.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROFILE_ARMS = ("f32", "fp8", "fp8_current", "nvdiffrec", "f16_dynamic", "bf16_grid")
# Profiled after fp8: the same arm with its GEMMs in mptex's Triton kernels and emulated instead
# of torch._scaled_mm, which tells how much of the FP8 arms' time is the FP8 GEMM path's (the
# profile's first rows are the ones a short time box keeps).
TRITON = "fp8, GEMMs in Triton"
EMULATED = "fp8, GEMMs emulated"
TRITON_GEMMS = "texture.fp8_gemm=triton"
VARIANTS = {
    TRITON: ("fp8", TRITON_GEMMS),
    EMULATED: ("fp8", "texture.fp8_gemm=emulated"),
}
PROFILED = ("f32", "fp8", TRITON, EMULATED, "fp8_current", "nvdiffrec", "f16_dynamic", "bf16_grid")
# The host floor also times the row-wise FP8 arm, the most host-heavy one.
HOST_FLOOR_ARMS = (*PROFILE_ARMS, "fp8_rowwise")
MAINJOB_TARGET_S = 600.0


def override_problem(override: str | None, device: str) -> str | None:
    """Why a run with the Hydra ``override`` cannot run on ``device``, or None: the Triton FP8
    GEMMs need a CUDA device with FP8 tensor cores, or Triton's interpreter (shared with
    validate.py's arms stage, whose FP8 variants use the same override)."""
    if override != TRITON_GEMMS:
        return None
    from mptex.fp8 import triton_gemm_problem

    return triton_gemm_problem(device)


def scale_overrides(ctx, iterations: int) -> list[str]:
    """nvdiffrec's scale on a GPU (512², batch 4, its texture); tiny on the CPU dry run. Shared
    with validate.py's training stages."""
    if ctx.small:
        sizes = ["texture=tiny", "scene.resolution=32", "train.batch_size=1",
                 "scene.n_train_views=4", "scene.n_val_views=2"]  # fmt: skip
    else:
        sizes = ["texture=default", "scene.resolution=512", "train.batch_size=4"]
    return sizes + [f"train.iterations={iterations}", f"train.val_interval={iterations}",
                    f"train.device={ctx.device}", "train.checkpoint_interval=0",
                    "train.progress=false", "train.n_val_images=0"]  # fmt: skip


def compose_config(overrides: list[str]):
    """mptex-train's config with ``overrides`` (validate.py's stages name their experiment)."""
    from hydra import compose, initialize_config_dir

    from mptex.cli import CONFIG_DIR, register_experiments

    register_experiments()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _profile_arm(ctx, arm: str, iterations: int) -> dict[str, Any]:
    """One run under the profiler, recording a window of iterations (from a third of the way
    in to just before the last iteration: after the first iterations' one-time work, before
    the final validation and checkpoint), so that every count and time is per iteration of
    the steady loop."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from mptex.train import loop, train

    label, (arm, *variant) = arm, VARIANTS.get(arm, (arm,))
    # The arms stage's config (train=default, torch's thread count), so that the two stages'
    # ms / iteration differ by the profiler's own cost only.
    overrides = [f"precision={arm}", *scale_overrides(ctx, iterations)]
    cfg = compose_config([*overrides, *variant])
    activities = [ProfilerActivity.CPU]
    if ctx.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    skip = iterations // 3
    active = max(1, iterations - skip - 2)
    forward = loop._forward_backward

    def stepped(run, it):  # one profiler step per iteration, at its start
        prof.step()
        return forward(run, it)

    window = schedule(skip_first=skip, wait=0, warmup=1, active=active, repeat=1)
    loop._forward_backward = stepped
    try:
        with (
            tempfile.TemporaryDirectory() as run_dir,
            profile(activities=activities, schedule=window) as prof,
        ):
            metrics = train(cfg, run_dir)
    finally:
        loop._forward_backward = forward
    events = prof.key_averages()
    by_name = {e.key: e for e in events if not _on_device(e) or not _annotation(e)}
    # What the window recorded: one profiler step per iteration (fewer than `active` where the
    # run ended inside the window), averaged as "ProfilerStep*" or kept as "ProfilerStep#N".
    steps = sum(e.count for e in events if e.key.startswith("ProfilerStep") and not _on_device(e))
    iterations = steps or active

    def calls(*names: str) -> float:
        return sum(by_name[n].count for n in names if n in by_name) / max(1, iterations)

    def device_ms(e) -> float:
        return getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) / 1e3

    # A scope's device time: its host range's, which sums the kernels launched inside it (with
    # CUDA activity each range also has a device-side copy, an annotation spanning its
    # kernels and the gaps between them: left out).
    parts = {e.key: device_ms(e) / iterations for e in events
             if e.key.startswith("mptex.") and not _on_device(e)}  # fmt: skip
    # The device's busy time: the kernels' and copies' own events (device-side, no children),
    # each counted once; against ms / iter it says whether the loop waits for the device or
    # for the host.
    device = [e for e in events if _on_device(e) and not _annotation(e)]
    kernels = sum(e.count for e in device if not e.key.startswith(("Memcpy", "Memset")))
    busy = sum(device_ms(e) for e in device) / iterations
    top = sorted((e for e in events if not e.key.startswith(("mptex.", "ProfilerStep"))
                  and not _annotation(e)), key=device_ms, reverse=True)[:10]  # fmt: skip
    # Where the host's time goes: an op's own CPU time (its launches, a library's set-up such
    # as cuBLASLt's algorithm choice, Python called inside a custom op), children excluded.
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "arm": label,
        "status": metrics["status"],
        # None: the run stopped before a timed iteration
        "ms_per_iter": None
        if metrics["time_per_iter_s"] is None
        else metrics["time_per_iter_s"] * 1e3,
        "device_busy_ms_per_iter": busy if ctx.device.startswith("cuda") else None,
        # Kernels as the device ran them: torch's launches (cudaLaunchKernel*) and Triton's
        # (cuLaunchKernelEx) alike.
        "launches_per_iter": kernels / max(1, iterations),
        "stream_syncs_per_iter": calls("cudaStreamSynchronize", "cudaDeviceSynchronize"),
        "dtoh_per_iter": calls(
            "Memcpy DtoH (Device -> Pageable)", "Memcpy DtoH (Device -> Pinned)"
        ),
        "parts_device_ms_per_iter": parts,
        "top_ops": [[e.key, f"{device_ms(e) / iterations:.3f}", e.count] for e in top],
        "top_host_ops": [
            [e.key, f"{e.self_cpu_time_total / 1e3 / iterations:.3f}", e.count] for e in host
        ],  # fmt: skip
        "backends": metrics.get("backends"),
        "torch": torch.__version__,
    }


def _on_device(event) -> bool:
    """Whether a profiler event is the device's own (a kernel, a copy, a memset), not a host
    op that launched it."""
    from torch.autograd import DeviceType

    return getattr(event, "device_type", DeviceType.CPU) == DeviceType.CUDA


def _annotation(event) -> bool:
    """Whether a profiler event is a ``record_function`` range (a loop scope, a profiler step)
    as the device timeline shows it: not work of its own."""
    return bool(getattr(event, "is_user_annotation", False))


def _host_floor(ctx, loop_overhead) -> None:
    """``loop_overhead.py --host-ms`` on the device: each arm's iteration time at 8 x 8 pixels
    with a tiny texture, where the kernels cost next to nothing, i.e. the host's work per
    iteration (launches included): the floor under the arms stage's times at nvdiffrec's
    scale. An arm whose time there is near its floor here is bound by the host."""
    if ctx.remaining() < 45:
        ctx.result["data"]["host_floor"] = "not run: time box"
        return
    iterations = 20 if ctx.small else 200
    try:
        results = loop_overhead.host_ms(HOST_FLOOR_ARMS, 1, iterations,
                                        [f"train.device={ctx.device}"])  # fmt: skip
    except Exception as exc:  # a diagnostic: its failure is a note, not the stage's end
        ctx.result["data"]["host_floor"] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
        return
    ctx.result["data"]["host_floor"] = results
    # one run per arm; None where it stopped before a timed iteration
    ms = {r["arm"]: r["host_ms_runs"][0] for r in results}
    f32 = ms.get("f32")
    ctx.table(
        f"Host floor on {ctx.device}: ms per iteration at 8x8, batch 4, texture=tiny, "
        f"{iterations} iterations",
        ["arm", "ms / iter", "x f32"],
        [[arm, "–" if t is None else f"{t:.2f}",
          f"{t / f32:.2f}" if f32 and t is not None else "–"] for arm, t in ms.items()],
        "the loop's median iteration time where the kernels cost next to nothing: the host's "
        "work per iteration (Python, dispatch, autograd, launches); compare with the arms "
        "stage's times at nvdiffrec's scale",
    )  # fmt: skip


def stage_profile(ctx) -> None:
    """The loop's cost per arm on the device (module docstring)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import loop_overhead

    iterations = 4 if ctx.small else int(getattr(ctx.args, "profile_iterations", 60))
    rows, runs = [], []
    for arm in PROFILED:
        if runs and ctx.remaining() < 75:  # the host floors below need about a minute
            rows.append([arm, "not run: time box", *[""] * 6])
            continue
        problem = override_problem(VARIANTS.get(arm, (arm, None))[1], ctx.device)
        if problem:
            rows.append([arm, f"not run: {problem}", *[""] * 6])
            continue
        try:
            run = _profile_arm(ctx, arm, iterations)
        except Exception as exc:  # one arm's failure is a row, not the stage's end
            rows.append([arm, f"failed: {type(exc).__name__}: {exc}".splitlines()[0],
                         *[""] * 6])  # fmt: skip
            continue
        runs.append(run)
        backends = ", ".join(f"{k}={v}" for k, v in (run["backends"] or {}).items())
        busy = run["device_busy_ms_per_iter"]
        ms = run["ms_per_iter"]
        rows.append([arm, run["status"], "–" if ms is None else f"{ms:.2f}",
                     "–" if busy is None else f"{busy:.2f}", f"{run['launches_per_iter']:.0f}",
                     f"{run['stream_syncs_per_iter']:.1f}", f"{run['dtoh_per_iter']:.1f}",
                     backends])  # fmt: skip
        ctx.result["data"]["profile"] = runs
        ctx.save()
    ctx.table(
        f"The loop under torch.profiler, {iterations} iterations, nvdiffrec's scale",
        ["arm", "status", "ms / iter", "device busy ms / iter", "launches / iter",
         "stream syncs / iter", "DtoH / iter", "backends"],
        rows,
        "ms / iter: the loop's median iteration time over the run; the other columns and the "
        "tables below: per iteration of a window in the middle of the run (after the first "
        "third, before the final validation); device busy: the kernels' and copies' own time "
        "(well under ms / iter: the loop waits for the host; the profiler adds host time)",
    )  # fmt: skip
    for run in runs:
        ctx.table(f"{run['arm']}: device ms per iteration by part and the top ops",
                  ["part or op", "device ms / iter", "calls"],
                  [[k, f"{v:.3f}", ""]
                   for k, v in sorted(run["parts_device_ms_per_iter"].items())]
                  + run["top_ops"])  # fmt: skip
        ctx.table(f"{run['arm']}: host ms per iteration by op (own time, children excluded)",
                  ["op", "host ms / iter", "calls"], run["top_host_ops"],
                  "under the profiler, whose own cost per op is included")  # fmt: skip
    # f32's count first (the stage's check: at most one host synchronisation per iteration),
    # then the host floors (what a GPU iteration cannot go under, to compare with the arms
    # stage's times), then the other arms' counts (measurable on a CPU too). The counts and the
    # check are saved after each count: a box that ends during the host floors keeps f32's.
    counted, count_rows = [], []
    start, stop = (2, 6) if ctx.small else (10, 50)
    overrides = [f"train.device={ctx.device}"]
    title = f"benchmarks/loop_overhead.py on {ctx.device}, iterations [{start}, {stop})"

    def publish_counts(final: bool) -> None:
        ctx.result["tables"] = [t for t in ctx.result["tables"] if t["title"] != title]
        ctx.result["data"]["loop_overhead"] = counted
        ctx.table(title, ["arm", "ops / iter", "host syncs / iter", "sync sites"], count_rows)
        f32 = next((r for r in counted if r["arm"] == "f32"), None)
        failed = []
        if f32 is None or f32["syncs_per_iter"] is None:
            if final:  # unmeasured is not passed: the stage's one check needs the count
                failed.append("f32: host syncs per iteration not counted (time box or failure)")
        elif f32["syncs_per_iter"] > 1.0:
            failed.append(f"f32: {f32['syncs_per_iter']:.2f} host syncs per iteration, over 1")
        ctx.result.pop("failed_checks", None)
        if failed:
            ctx.result.update(failed_what="loop target missed", failed_checks=failed)
        ctx.save()

    for arm in PROFILE_ARMS:
        if arm == PROFILE_ARMS[1]:
            _host_floor(ctx, loop_overhead)
        if ctx.remaining() < 45:
            count_rows.append([arm, "not counted: time box", "", ""])
            continue
        try:
            result = loop_overhead.count_arm(arm, start, stop, 32 if ctx.small else 64, overrides,
                                             "tiny" if ctx.small else "default")  # fmt: skip
        except Exception as exc:
            count_rows.append([arm, f"failed: {type(exc).__name__}: {exc}".splitlines()[0], "", ""])
            continue
        counted.append(result)
        if result["ops_per_iter"] is None:
            count_rows.append([arm, f"{result['status']} before the window", "", ""])
        else:
            sites = "; ".join(f"{s['per_iter']:.2f} {s['kind']} at {s['site'].split(' < ')[0]}"
                              for s in result["sync_sites"] if s["phase"] == "step")  # fmt: skip
            count_rows.append([arm, f"{result['ops_per_iter']:.1f}",
                               f"{result['syncs_per_iter']:.2f}", sites or "–"])  # fmt: skip
        publish_counts(final=False)
    publish_counts(final=True)


def _sweep_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One record per run of the main job that wrote its metrics.json (arm, seed, status, PSNR,
    ms / iteration, wall time and start), in job order."""

    def job_number(path: Path) -> tuple[int, str]:  # Hydra's job folders: "<n>_<overrides>"
        head = path.parent.name.split("_", 1)[0]
        return (int(head) if head.isdecimal() else -1, path.parent.name)

    runs = []
    for path in sorted(sweep_dir.glob("*/metrics.json"), key=job_number):
        try:
            metrics = json.loads(path.read_text())
        except (OSError, ValueError):  # being written: the next reading has it
            continue
        seconds = metrics.get("time_per_iter_s")
        runs.append({
            "job": path.parent.name,
            "precision": metrics.get("precision") or "?",
            "seed": metrics.get("seed"),
            "status": metrics.get("status"),
            "psnr": metrics.get("psnr"),
            "ms_per_iter": None if seconds is None else seconds * 1e3,
            "wall_s": metrics.get("wall_time_s"),
            "start_s": (metrics.get("time_split_s") or {}).get("start"),
            "backends": metrics.get("backends") or {},
        })  # fmt: skip
    return runs


def _sweep_summary(runs: list[dict[str, Any]]) -> list[list[str]]:
    """The main job's table: per arm, its completed runs, median ms / iteration, mean PSNR and
    mean run wall time and start (:func:`_sweep_runs`' records)."""
    per_arm: dict[str, list[dict]] = {}
    for run in runs:
        per_arm.setdefault(run["precision"], []).append(run)
    rows = []
    for arm, arm_runs in sorted(per_arm.items()):
        done = [r for r in arm_runs if r["status"] == "completed"]
        times = [r["ms_per_iter"] for r in done if r["ms_per_iter"] is not None]
        psnrs = [r["psnr"] for r in done if r["psnr"] is not None]
        walls = [r["wall_s"] for r in done if r["wall_s"] is not None]
        starts = [r["start_s"] for r in done if r["start_s"] is not None]
        rows.append(
            [
                arm,
                f"{len(done)}/{len(arm_runs)}",
                f"{statistics.median(times):.2f}" if times else "–",
                f"{statistics.mean(psnrs):.2f}" if psnrs else "–",
                f"{statistics.mean(walls):.1f} / {statistics.mean(starts):.1f}"
                if walls and starts
                else "–",
                ", ".join(f"{k}={v}" for k, v in arm_runs[0]["backends"].items()),
            ]
        )
    return rows  # fmt: skip


def job_env(environ) -> dict[str, str]:
    """The main job's environment: ``environ`` with the checkout first on ``PYTHONPATH``. The
    entries already there stay: on a GPU machine the kit's packages (Hydra, OmegaConf) are
    importable only through them."""
    path = os.pathsep.join(p for p in (str(REPO), environ.get("PYTHONPATH", "")) if p)
    return {**environ, "PYTHONPATH": path, "OMP_WAIT_POLICY": "passive"}


def stage_mainjob(ctx) -> None:
    """``mptex-train -m +experiment=gpu_main`` as a user runs it (module docstring)."""
    # The sweep in scratch space, removed at the end with its checkpoints and images; its
    # table, its runs' records and its report are what the stage keeps.
    with tempfile.TemporaryDirectory(prefix="mptex-mainjob-", ignore_cleanup_errors=True) as tmp:
        _mainjob(ctx, Path(tmp))


def _mainjob(ctx, scratch: Path) -> None:
    sweep_dir = scratch / "sweep"
    overrides = [f"hydra.sweep.dir={sweep_dir}"]
    if ctx.small:
        overrides += [
            "precision=f32,fp8",
            "train.seed=0",
            "train.device=cpu",
            "texture=tiny",
            "train.iterations=2",
            "train.val_interval=1",
            "train.n_val_images=1",
            "scene.resolution=24",
            "scene.n_train_views=2",
            "scene.n_val_views=1",
        ]
    env = job_env(os.environ)
    command = [sys.executable, "-m", "mptex.cli", "-m", "+experiment=gpu_main", *overrides]
    start = time.time()
    # A session of its own: on a timeout the whole job goes, the launcher's worker processes
    # (the sweep's children, each training a run on the GPU) with it, not the parent only. The
    # stage stops it 20 s before its own box ends, and stops it whatever ends the stage: the
    # kit's kill of the stage's group would not reach a session of its own. Its output goes to
    # files (read at the end), so that the stage can save the runs finished so far meanwhile.
    stderr_path = scratch / "stderr.txt"
    with open(scratch / "stdout.txt", "w") as out, open(stderr_path, "w") as err:
        job = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err,
                               start_new_session=True)  # fmt: skip
        try:
            while True:
                left = ctx.remaining() - 20
                if left <= 0:
                    raise subprocess.TimeoutExpired(command, left)
                try:
                    job.wait(timeout=min(15.0, left))
                    break
                except subprocess.TimeoutExpired:  # the runs finished so far, saved
                    _mainjob_table(ctx, sweep_dir, time.time() - start, None, None)
            returncode = job.returncode
            tail = stderr_path.read_text(errors="replace")[-3000:]
        except subprocess.TimeoutExpired:
            returncode, tail = None, "timed out"
        finally:
            if job.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.wait(timeout=10)
    wall = time.time() - start
    timed_out = returncode is None
    report = sweep_dir / "report.md"
    results_dir = getattr(ctx.args, "results_dir", None)
    if report.is_file() and results_dir:  # the sweep's folder is scratch: keep the report
        kept = Path(results_dir) / "mainjob-report.md"
        kept.write_text(report.read_text())
        report = kept
    ctx.result["data"].update(wall_s=wall, returncode=returncode, stderr_tail=tail,
                              report=str(report) if report.is_file() else None,
                              target_s=MAINJOB_TARGET_S)  # fmt: skip
    _mainjob_table(ctx, sweep_dir, wall, returncode, report if report.is_file() else None)
    failed = []
    if timed_out:
        # Stopped by the box: the job takes longer than the box (over the target only if the
        # box was at least the target).
        failed.append(f"stopped after {wall:.0f} s (the stage's box), before the sweep ended")
    elif returncode != 0:
        failed.append(f"mptex-train exited {returncode}")
    if not report.is_file():
        failed.append("no report.md")
    if not ctx.small and wall > MAINJOB_TARGET_S:
        failed.append(f"wall {wall:.0f} s over the {MAINJOB_TARGET_S:.0f} s target")
    if failed:
        ctx.result.update(failed_checks=failed, failed_what="the main job's checks failed")
    ctx.save()


def _mainjob_table(ctx, sweep_dir: Path, wall: float, returncode, report) -> None:
    """The main job's table and its runs' records as they stand (saved: a stage stopped from
    outside keeps them); ``returncode`` None while the job runs or after its box stopped it."""
    runs = _sweep_runs(sweep_dir) if sweep_dir.is_dir() else []
    ctx.result["data"]["runs"] = runs
    ctx.result["tables"] = []
    ctx.table(
        f"experiments/gpu_main.yaml: wall {wall:.0f} s (target < {MAINJOB_TARGET_S:.0f} s), "
        f"exit {returncode}",
        ["arm", "completed runs", "median ms / iter", "mean PSNR (dB)", "mean run / start (s)",
         "backends"],
        _sweep_summary(runs),
        f"report: {report or 'not written'}; ms / iter with the runs sharing the GPU; a run's "
        "wall time and its start (scene, texture, set-up) from metrics.json; each run's record "
        "in the stage's data",
    )  # fmt: skip
