"""The nvdiffrec-style texture training loop: losses, schedule, validation, checkpoints, metrics.

One iteration (nvdiffrec's ``optimize_mesh`` with a fixed mesh and only the texture trained):

1. draw ``batch_size`` training views (their G-buffers come from the scene's cache);
2. sample the :class:`~mptex.MLPTexture3D` at the covered surface points only
   (``view.position[view.mask]``), together with the smoothness term's jittered copies of them
   in one evaluation (``train.kd_smooth_joint``; false: two evaluations, as nvdiffrec);
3. shade: ``kd`` (the first three channels, albedo) or ``diffuse`` (see :func:`shade`);
4. composite prediction and reference over the background (per-pixel random, white or black);
5. loss = color loss (``logl1`` by default) on RGB masked by the reference alpha + alpha MSE
   + the kd smoothness regulariser (``0.03 * min(1, it / 500) * mean(|kd(p + N(0, 0.01)) -
   kd(p)| / 3)`` over covered pixels, as nvdiffrec's ``kd_grad``); on CUDA the colour and
   smoothness terms run in Triton kernels (``train.fused_loss``, :mod:`mptex.train.fused_loss`);
6. :class:`~mptex.PrecisionStepper` does backward, unscale, overflow check, step or skip;
7. learning rate ``lr * lr_schedule(it)``: ``it / warmup_iter`` during warm-up, then
   ``10 ** (-lr_decay * (it - warmup_iter))`` (nvdiffrec: ``lr_decay = 0.0002``), or with
   ``lr_schedule: cosine`` a cosine from 1 to 0 at the last iteration.

A run is five named steps over one :class:`RunState`: :func:`setup` (optimizer, stepper,
monitor, a checkpoint's state), :func:`step` (one iteration, above), :func:`validate` (every
``val_interval`` and at the end), :func:`checkpoint` (every ``checkpoint_interval`` and at the
end) and :func:`finish` (final evaluation, images, export, ``metrics.json``); :func:`train` runs
them in that order, with the config check before and the failure handling around them.

Validation is nvdiffrec's: render the validation views, convert to sRGB, clamp to [0, 1],
PSNR per image ``-10 log10(MSE)``, mean over the images.

Results go to a run directory: ``metrics.json`` (the contract with ``mptex-report``; keys in
:data:`METRICS_KEYS`), ``images/`` (reference | prediction PNGs), ``checkpoint.pt`` (written
atomically; :func:`load_texture` rebuilds the texture from it) and, with
``export.enabled=true``, ``export/`` (the baked asset, after the final validation of a
completed run, by the ``exporter`` that ``mptex-train`` passes: :class:`mptex.bake.TrainingExport`;
the loop itself never imports the exporter).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mptex._profiler_scope import profiler_scope
from mptex._triton_launch import launching_on
from mptex.config_schema import plain as plain_config
from mptex.host import to_host
from mptex.mlp import float32_gemm_sums
from mptex.precision import PrecisionPolicy, PrecisionStepper
from mptex.render.image import rgb_to_srgb
from mptex.scenes import MESH_SCENES, Scene, build_scene, same_suite_asset
from mptex.texture import MLPTexture3D
from mptex.train.checkpoint import (
    CHECKPOINT_FILE,
    CHECKPOINT_KEYS,
    CheckpointError,
    DiskFullError,
    build_texture,
    export_source,
    load_checkpoint,
    read_metrics,
    remove_stale_temporaries,
    save_checkpoint,
    write_metrics,
)
from mptex.train.config import (
    TRAIN_DEFAULTS,
    ConfigError,
    absolute_scene_paths,
    check_texture_config,
    config_key,
    mlp_activation_problem,
    normalized_config,
    validate_config,
)
from mptex.train.exporter import Exporter
from mptex.train.fused_loss import fused_loss_check, fused_loss_problem, masked_image_loss
from mptex.train.losses import lr_schedule
from mptex.train.memory import RunPeakRss, measure_memory, peak_memory, start_peak_memory
from mptex.train.monitor import PrecisionMonitor
from mptex.train.rng import rng_state, seed_everything, set_rng_state
from mptex.train.runinfo import (
    Progress,
    device_name,
    package_versions,
    tensorboard_writer,
)
from mptex.train.shading import draw_background, light_direction, render_batch
from mptex.train.signals import StopSignals, auto_resume_path, send_signal, stopped_record
from mptex.train.validation import evaluate, save_val_images

__all__ = [
    "METRICS_KEYS",
    "train",
    "RunState",
    "StepOutcome",
    "setup",
    "step",
    "validate",
    "checkpoint",
    "finish",
    "mlp_rate_factor",
]

METRICS_KEYS = (
    "status", "psnr", "baseline_psnr", "psnr_per_image", "saturation", "precision", "scene", "seed",
    "iterations", "iterations_planned", "final_loss", "time_per_iter_s", "wall_time_s",
    "train_time_s", "time_split_s", "wall_time_total_s", "train_time_total_s",
    "time_total_complete", "peak_memory_bytes", "peak_memory_kind", "start_peak_memory_bytes",
    "skipped_steps", "final_loss_scale",
    "diverged_at", "error", "failed_at", "failed_writing", "interrupted_at", "signal",
    "resumed_from", "stop_requested",
    "resume_count", "interruptions", "n_params", "backends", "device",
    "device_name", "torch_threads", "versions", "run_dir", "history", "config", "export",
)  # fmt: skip
# What metrics.json keeps of export.json (the report's bake column reads psnr_baked_vs_neural).
_EXPORT_SUMMARY = (
    "resolution", "uv_source", "coverage", "texels_per_unit", "texels_per_pixel",
    "psnr_baked_vs_neural", "psnr_baked_vs_reference", "bake_time_s", "export_time_s",
    "decode_precision",
)  # fmt: skip


def _resume_path(setting: Any, run_dir: Path) -> Path | None:
    if setting == "auto":
        return auto_resume_path(run_dir)
    if setting is False or setting is None:
        return None
    path = run_dir / CHECKPOINT_FILE if setting is True else Path(setting)
    if not path.is_file():
        raise ValueError(f"train.resume: no checkpoint at {path}")
    return path


def _unrecorded_checkpoint(setting: Any, resume_from: Path | None, run_dir: Path) -> bool:
    """Whether ``train.resume=auto`` starts over beside a checkpoint without a record of how
    its run ended (no ``metrics.json``, or only a refused start's): a kill (SIGKILL, an OOM
    kill, power lost) before any record. Starting over is the rule; the loop says so, so that
    the checkpoint's iterations are not lost without a word."""
    if setting != "auto" or resume_from is not None:
        return False
    if not (run_dir / CHECKPOINT_FILE).is_file():
        return False
    kept = read_metrics(run_dir)
    return kept is None or kept.get("failed_at") == "start"


def _retire_finished_record(run_dir: Path) -> None:
    """Remove ``metrics.json`` when it records a run that is not to be continued (completed,
    diverged, failed), before a run that got past its start writes its first file here.

    The record is written last, so a record of a finished run describes the files beside it;
    a run started over or continued in its directory rewrites them (``checkpoint.pt`` every
    ``checkpoint_interval``, then the images and the export), and a kill in between would leave
    that record beside files of another run, a validation image or export cut short, read as
    the finished run by ``mptex-report``. Without it, the directory reads as a run killed
    before its record. A stopped run's record (:func:`~mptex.train.signals.stopped_record`)
    stays: it is what lets ``train.resume=auto`` continue after such a kill, and it claims no
    results."""
    kept = read_metrics(run_dir)
    if kept is not None and not stopped_record(kept):
        (run_dir / "metrics.json").unlink(missing_ok=True)


_TIME_TOTALS = ("wall_time_total_s", "train_time_total_s", "time_total_complete")


def _take_recorded_time(ckpt: dict[str, Any], resume_from: Path, run_dir: Path) -> None:
    """The run's time before this process, into ``ckpt``'s :data:`_TIME_TOTALS`: the whole
    time of the process that wrote the checkpoint where its record says it, else the
    checkpoint's (up to its write) with ``time_total_complete`` False.

    The checkpoint carries the run's time up to its write; what its writer did after it is
    known only from that writer's ``metrics.json`` (a stop signal's ``interrupted`` record, a
    completed or diverged run's, a mid-run failure's: a full disk freed), which is taken when
    it is ``run_dir``'s, the checkpoint is ``run_dir``'s, it holds the totals, it is of the
    same process (its ``resume_count`` is the checkpoint's) and no resume took it before.
    Taking it marks it (``time_total_taken``), so that a later resume from the same
    checkpoint, after this process was killed without a record, does not count this process's
    time as known. A writer killed without a record (SIGKILL, an OOM kill), one whose record
    could not be written (the disk stayed full), and a checkpoint written before these keys
    leave the time after the checkpoint (or all of it) unknown.
    """
    kept = read_metrics(run_dir)
    ours = Path(resume_from).resolve() == (run_dir / CHECKPOINT_FILE).resolve()
    recorded = (
        ours
        and kept is not None
        and not kept.get("time_total_taken")
        and kept.get("resume_count", 0) == ckpt.get("resume_count", 0)
        and all(isinstance(kept.get(key), float) for key in _TIME_TOTALS[:2])
        and isinstance(kept.get("time_total_complete"), bool)
    )
    if not recorded:
        ckpt["time_total_complete"] = False
        return
    try:
        write_metrics(run_dir, {**kept, "time_total_taken": True})
    except DiskFullError:
        # Unmarked, the record could be counted again after a kill: not known.
        ckpt["time_total_complete"] = False
        return
    ckpt.update({key: kept[key] for key in _TIME_TOTALS})


def _history_entry(completed, loss_value, psnr_value, result, lr, stats) -> dict[str, Any]:
    entry = {
        "iteration": completed,
        "loss": loss_value,
        "psnr": psnr_value,
        "loss_scale": result.loss_scale,
        "skipped": bool(result.skipped),
        "lr": lr,
    }
    if stats is not None:
        entry.update({k: v for k, v in stats.items() if k not in entry})
    return entry


def _param_groups(texture, mlp_lr_scale: float) -> list[dict[str, Any]]:
    """Adam's parameter groups: the hash grid (and anything else) at ``lr`` times its group's
    ``lr_scale`` (1), the MLP at ``lr`` times :func:`mlp_rate_factor` (``mlp_lr_scale``, or its
    ramp), both on top of the schedule; the MLP group's ``lr_scale`` records
    ``mlp_lr_scale``, the ramp's start, in the checkpoint's optimizer state.

    Why a separate MLP rate (docs/archive/mlp-learning-rate.md): Adam moves every weight by about
    ``lr`` per step whatever its gradient's size, so a consistent gradient (a colour the
    sigmoid reaches only at an infinite logit) changes a ``32 x 32`` layer by a rank-one
    matrix of spectral norm ~``32 lr`` per step. Measured on the duck (f32, lr 0.03, one MLP
    rate): logits ~10 by iteration 10 and 50-100 by iterations 20-50; past ~17 the sigmoid's
    float32 gradient is exactly 0, and such pixels stay stuck. Each grid entry is one
    independent parameter and takes ``lr`` safely.
    """
    mlp = list(texture.net.parameters())
    in_mlp = {id(p) for p in mlp}
    rest = [p for p in texture.parameters() if id(p) not in in_mlp]
    return [{"params": rest, "lr_scale": 1.0}, {"params": mlp, "lr_scale": float(mlp_lr_scale)}]


def mlp_rate_factor(settings: Mapping[str, Any], iteration: int) -> float:
    """The MLP's rate over the grid's at ``iteration`` (0-based): ``mlp_lr_scale``, or with
    ``mlp_lr_ramp_to`` set a linear ramp from ``mlp_lr_scale`` at iteration 0 to
    ``mlp_lr_ramp_to`` at ``mlp_lr_ramp_iter`` and constant after. A function of the iteration
    only, so a resumed run takes the same steps.

    Why a ramp (docs/archive/mlp-learning-rate.md): the MLP's runaway towards saturated logits
    happens in the first tens of steps; past them, with the output margin keeping every target
    at a finite logit, a larger MLP rate converges faster on every scene measured.
    """
    start, end = float(settings["mlp_lr_scale"]), settings.get("mlp_lr_ramp_to")
    if end is None:
        return start
    return start + (float(end) - start) * min(1.0, iteration / settings["mlp_lr_ramp_iter"])


def _adam_implementation(texture: MLPTexture3D, device: torch.device) -> dict[str, bool]:
    """Adam's implementation flags for the run: ``fused`` on CUDA (one multi-tensor kernel,
    and it takes the stepper's ``found_inf``, so a skipped step is decided on the device);
    ``foreach`` on the CPU when every parameter is float32 (measured bit-identical to the
    per-parameter loop with torch 2.13; fused Adam on the CPU is not: 1 ulp), else the loop."""
    if device.type == "cuda":
        return {"fused": True, "foreach": False}
    f32 = all(p.dtype == torch.float32 for p in texture.parameters())
    return {"fused": False, "foreach": f32}


def _forward_state(texture: MLPTexture3D) -> list[tuple[str, torch.nn.Module]]:
    """The texture's modules that keep state outside its parameters and buffers (a module's
    extra state: the FP8 layers' scales and amax histories, which their forwards and backwards
    update), by name."""
    base = torch.nn.Module.get_extra_state
    return [(name or type(texture).__name__, module) for name, module in texture.named_modules()
            if type(module).get_extra_state is not base]  # fmt: skip


def _resolve_overlap(
    setting: Any, stateful: list[tuple[str, torch.nn.Module]], optimizer: torch.optim.Adam
) -> bool:
    """``train.overlap``: whether :func:`_iterate` queues an iteration's forward and backward
    before the previous iteration's read. It needs the optimizer step decided on the device
    (fused Adam, the loop's on CUDA: the step is queued before the read), and every module
    with state of its own to be able to take a snapshot of it and restore it (the FP8 layers:
    a dropped look-ahead is undone there; ``stateful``: :func:`_forward_state`'s list).
    ``auto``: on wherever both hold; ``true`` where they do not is a config error."""
    if setting is False:
        return False
    problem = None
    if not optimizer.defaults.get("fused"):
        problem = ("the optimizer step decided on the device (fused Adam, which the loop uses "
                   "on CUDA)")  # fmt: skip
    else:
        for name, module in stateful:
            if not (hasattr(module, "snapshot") and hasattr(module, "restore")):
                problem = (f"every module with state of its own to snapshot and restore it; "
                           f"{name} ({type(module).__name__}) cannot")  # fmt: skip
                break
    if problem is None:
        return True
    if setting is True:
        raise ConfigError(f"train.overlap: true needs {problem}; use auto or false")
    return False


def _resolve_fused_loss(setting: Any, device: torch.device, loss: str) -> bool:
    """``train.fused_loss``: whether the loss's image and smoothness terms run in their Triton
    kernels (:mod:`mptex.train.fused_loss`). They must be able to run on the device
    (:func:`~mptex.train.fused_loss.fused_loss_problem`) and give the eager gradients bit for
    bit there (:func:`~mptex.train.fused_loss.fused_loss_check`, once per process). ``auto``:
    wherever both hold, with a warning where only the second fails; ``true`` where either
    fails is a config error."""
    if setting is False:
        return False
    problem = fused_loss_problem(device, loss)
    checked = problem is None
    if checked:
        problem = fused_loss_check(str(device), loss)
    if problem is not None and setting is True:
        raise ConfigError(f"train.fused_loss: true needs {problem}; use auto or false")
    if problem is not None and checked:
        warnings.warn(f"train.fused_loss: the fused loss needs {problem}; it runs eager",
                      stacklevel=2)  # fmt: skip
    return problem is None


def _place_adam_steps(optimizer: torch.optim.Adam) -> None:
    """Put Adam's ``step`` counters where its implementation wants them after a checkpoint's
    state was loaded (written by another implementation): fused on the parameter's device,
    float32; otherwise on the host, as torch keeps them."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            step = state.get("step")
            if not isinstance(step, torch.Tensor):
                continue
            if group.get("fused"):
                state["step"] = step.to(device=param.device, dtype=torch.float32)
            elif not group.get("capturable"):
                state["step"] = step.to(device="cpu", dtype=torch.float32)


def _optimizer_state(
    saved: Any, texture: MLPTexture3D, groups: list[dict[str, Any]], path: Path
) -> dict[str, Any]:
    """A checkpoint's Adam state dict laid out for ``groups`` (:func:`_param_groups`).

    A checkpoint written before the MLP had its own rate holds one group of all the texture's
    parameters in ``texture.parameters()`` order: its per-parameter state (step, moments) moves
    to the same parameters in the two groups, which take that group's hyperparameters.

    Raises:
        ValueError: ``"train.resume: ..."`` when the state does not fit the texture.
    """
    wanted = [len(group["params"]) for group in groups]
    try:
        state, saved_groups = saved["state"], saved["param_groups"]
        sizes = [len(group["params"]) for group in saved_groups]
    except (TypeError, KeyError, IndexError):
        sizes = None
    if sizes == wanted:
        return saved
    if sizes != [sum(wanted)]:
        held = "no Adam state" if sizes is None else f"parameter groups of {sizes} parameters"
        raise ValueError(
            f"train.resume: checkpoint {path}: its optimizer state does not fit the texture "
            f"({held}; expected groups of {wanted})"
        )
    old = saved_groups[0]
    position = {id(p): i for i, p in enumerate(texture.parameters())}
    new_groups, new_state, n = [], {}, 0
    for group in groups:
        ids = []
        for param in group["params"]:
            index = old["params"][position[id(param)]]
            if index in state:
                new_state[n] = state[index]
            ids.append(n)
            n += 1
        new_groups.append({**old, "params": ids, "lr_scale": group["lr_scale"]})
    return {"state": new_state, "param_groups": new_groups}


def _check_coverage(scene: Scene) -> None:
    # Cameras that see nothing (near beyond the mesh, a camera inside it) would train on
    # empty views and report a perfect PSNR for texture and baseline alike.
    if not bool(scene.val_views().mask.any()):
        raise ValueError(
            "scene: no validation view covers the mesh; expected cameras that see it "
            "(check scene.cam_radius, scene.near, scene.far, scene.fovy_deg)"
        )


def _start(
    full: dict[str, Any], resume_from: Path | None, run_dir: Path, exporter: Exporter | None
) -> tuple[Scene, MLPTexture3D, dict[str, Any] | None]:
    """Everything a run reads before its first iteration: scene, texture, checkpoint.

    Seeding comes first: the texture's initial weights are drawn from the global generators,
    seeded with ``train.init_seed`` when it is set (``train.seed`` otherwise); the generators
    are then seeded with ``train.seed``, which alone sets the views, noise and jitter.
    A constructor's ``ValueError`` names its argument; the re-raised one names the config key.
    """
    settings = full["train"]
    device = torch.device(settings["device"])
    scene = build_scene(full["scene"], device)
    extent = (scene.aabb[1] - scene.aabb[0]).tolist()
    flat = [axis for axis, size in zip("xyz", extent, strict=True) if not size > 0]
    if flat:
        # MLPTexture3D normalises positions by the AABB: a flat mesh has no volume to texture.
        key = (
            "scene.path"
            if scene.name in MESH_SCENES
            else "scene.mesh"
            if scene.name == "nerf"
            else "scene"
        )
        raise ValueError(
            f"{key}: {full['scene'].get('path' if key == 'scene.path' else 'mesh')}: the mesh "
            f"has zero extent along {', '.join(flat)}; a 3D texture needs a mesh with a volume"
        )
    _check_coverage(scene)
    # The training views are prepared now (setup would), so that an MLP whose activations
    # cannot fit at their covered points is refused before it is built.
    fewest = min(scene.covered_pixels(normals=settings["shading"] != "kd"))
    policy = PrecisionPolicy.from_config(full["precision"])
    texture_cfg = check_texture_config(full["texture"])
    problem = mlp_activation_problem(texture_cfg, policy, settings, fewest, device)
    if problem is not None:
        raise ValueError(problem)
    init_seed = settings["init_seed"]
    seed_everything(int(settings["seed"] if init_seed is None else init_seed))
    try:
        texture = build_texture(scene.aabb, full["texture"], full["precision"]).to(device)
    except ValueError as exc:
        raise ValueError(config_key(str(exc))) from None
    if init_seed is not None:
        # Only the initial weights follow init_seed; everything drawn later follows train.seed.
        seed_everything(int(settings["seed"]))
    if full["export"]["enabled"]:
        if exporter is None:
            raise ValueError(
                "export.enabled: true needs the exporter mptex-train passes; from Python, "
                "train(cfg, run_dir, exporter=mptex.bake.TrainingExport())"
            )
        # Everything the export at the end needs (writers, memory, xatlas) is checked now.
        try:
            exporter.preflight(full["export"], scene.mesh, texture.channels, device, run_dir)
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
    ckpt = None
    if resume_from is not None:
        ckpt = load_checkpoint(resume_from, map_location=device, required=CHECKPOINT_KEYS)
        for group in ("scene", "precision", "texture", "train"):
            stored = ckpt["config"].get(group)
            current = full[group]
            if group == "train":
                # The seeds name the run (the report pairs runs by train.seed) and made its
                # initial weights and random streams; the rest of train may change on a resume.
                stored = _run_seeds(stored or {})
                current = _run_seeds(current)
            differ = _config_differences(group, stored, current)
            if differ:
                raise ValueError(
                    f"train.resume: checkpoint {resume_from} was trained with another "
                    f"{group} config (different: {', '.join(differ)})"
                )
        # The random streams a resume restores are the device's (a CUDA generator's state is
        # not a CPU one's): a run continues on the kind of device it started on.
        trained_on = torch.device(str(ckpt["config"].get("train", {}).get("device", "cpu")))
        here = torch.device(full["train"]["device"])
        if trained_on.type != here.type:
            raise ValueError(
                f"train.resume: checkpoint {resume_from} was trained on {trained_on.type}, "
                f"this run is on {here.type}: a resume continues on the device it started on "
                "(train.device)"
            )
        groups = _param_groups(texture, settings["mlp_lr_scale"])
        ckpt["optimizer"] = _optimizer_state(ckpt["optimizer"], texture, groups, resume_from)
        done, planned = int(ckpt["iteration"]), int(settings["iterations"])
        if done > planned:
            raise ValueError(
                f"train.iterations: expected at least the {done} iterations checkpoint "
                f"{resume_from} has done, got {planned}"
            )
    return scene, texture, ckpt


_RUN_SEEDS = ("seed", "init_seed")


def _run_seeds(train: Mapping[str, Any]) -> dict[str, Any]:
    """The seeds that name a run: ``train.seed`` and the initial weights' seed
    (``train.init_seed``, which null leaves to ``train.seed``)."""
    seed = train.get("seed", TRAIN_DEFAULTS["seed"])
    init_seed = train.get("init_seed", TRAIN_DEFAULTS["init_seed"])
    return {"seed": seed, "init_seed": seed if init_seed is None else init_seed}


def _config_differences(group: str, stored: Any, current: Mapping[str, Any]) -> list[str]:
    """The keys (``group.key``) whose values differ between a checkpoint's config group and
    this run's. A suite asset's ``scene.path`` is the same asset wherever each machine's
    ``pybullet_data`` holds it (the config stores the path as the training machine resolved
    it), so that a run preempted on one machine resumes on another."""
    if not isinstance(stored, Mapping):
        return [group]
    missing = object()
    differ = []
    for key in sorted(set(stored) | set(current), key=str):
        a, b = stored.get(key, missing), current.get(key, missing)
        if a == b:
            continue
        if (group == "scene" and key == "path" and stored.get("name") == current.get("name")
                and same_suite_asset(current.get("name"), a, b)):  # fmt: skip
            continue
        if group == "scene" and absolute_scene_paths({key: a}) == {key: b}:
            continue  # a path a run before absolute paths stored relative to the same folder
        differ.append(f"{group}.{key}")
    return differ


def train(
    cfg: Mapping[str, Any], run_dir: str | os.PathLike, *, exporter: Exporter | None = None
) -> dict[str, Any]:
    """Train an :class:`~mptex.MLPTexture3D` on a scene; write results into ``run_dir``.

    Args:
        cfg: the composed config (``scene``, ``precision``, ``texture``, ``train`` groups; see
            ``configs/``), a mapping or a Hydra ``DictConfig``.
        run_dir: output directory (created): ``metrics.json``, ``images/``, ``checkpoint.pt``.

    Returns:
        the metrics dict that was written to ``metrics.json``.

    Raises:
        ConfigError: (a ``ValueError``) ``"<key>: <message>"`` for a bad config value, before
            any training (``metrics.json`` then says ``status: "failed"``,
            ``failed_at: "start"``, except in the directory of a run that got past its start,
            such as a stopped run that ``train.resume=auto`` would continue: its record, with
            the attempt added to ``start_failures``, and its checkpoint stay).
        Exception: anything raised mid-run is re-raised after ``metrics.json`` records
            ``status: "failed"`` and the error.

    A non-finite loss in an arm without loss scaling is not an error: the run stops with
    ``status: "diverged"`` and ``diverged_at``. So is a run of ``max_consecutive_skips`` skipped
    steps in a loss-scaled arm.

    Neither is a stop signal (``train.stop_signals``, handled from the main thread while
    ``train`` runs, then the previous handlers are back): the iteration under way finishes,
    ``checkpoint.pt`` is written and the run returns with ``status: "interrupted"``,
    ``interrupted_at`` (completed iterations) and ``signal``, without the final validation.
    A stop signal that comes once the last iteration has begun (during it, the final
    validation, the final checkpoint, the images, the export or the ``metrics.json`` write)
    stops nothing: the run ends as it would have (``completed``, its results whole) and
    ``stop_requested`` records ``{"signal", "during"}``, the first such signal and the part of
    the run it came in; ``mptex-train`` then exits 3 (a sweep stops).
    ``train.resume=auto`` (the default) continues such a run directory; ``resume_count`` and
    ``interruptions`` carry over. A full disk (ENOSPC, EDQUOT) raises
    :class:`~mptex.train.checkpoint.DiskFullError` after ``metrics.json`` records ``status:
    "failed"`` where it still can be written; the file that failed is unchanged.

    The checkpoint (every ``checkpoint_interval`` iterations and at the end) holds ``texture``
    (state dict), ``optimizer``, ``stepper`` (GradScaler state), ``iteration`` (completed),
    ``rng`` (python, numpy, torch, view and noise generators), ``history``, ``skipped_steps``,
    ``consecutive_skips``, ``aabb``, ``precision`` and ``config``, and the run so far:
    ``loss``, ``time_per_iter_s``, ``resume_count``, ``interruptions``, and
    ``wall_time_total_s``, ``train_time_total_s``, ``time_total_complete`` (the run's time over
    its processes up to this write; metrics.json's totals, :func:`_take_recorded_time`).
    """
    start_wall = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plain = dict(plain_config(cfg))
    metrics: dict[str, Any] = {
        "status": "failed",
        "precision": (plain.get("precision") or {}).get("name"),
        "scene": (plain.get("scene") or {}).get("name"),
        "seed": (plain.get("train") or {}).get("seed", TRAIN_DEFAULTS["seed"]),
        "run_dir": str(run_dir.resolve()),
        "versions": package_versions(),
        "config": plain,
    }
    # A kill -9 during an atomic write leaves its temporary behind; no writer can be using
    # them now that a run starts here.
    remove_stale_temporaries(run_dir)
    stop = StopSignals()
    try:
        # cuda:N current while the run trains (Triton launches there); a device value the
        # config's check refuses changes nothing, and the check's one-line error comes later
        device = (plain.get("train") or {}).get("device")
        with launching_on(device), float32_gemm_sums():
            metrics = _train_validated(plain, run_dir, metrics, start_wall, stop, exporter)
    finally:
        stop.uninstall()
    if stop.received and metrics["status"] != "interrupted" and not metrics.get("stop_requested"):
        # A stop signal while metrics.json was written: recorded in a second write (a signal
        # from now on takes its previous handler's action, which nothing swallows).
        metrics["stop_requested"] = {"signal": stop.received[0], "during": "metrics"}
        with contextlib.suppress(DiskFullError):  # the returned record still says it
            write_metrics(run_dir, metrics)
    return metrics


def _record_start_failure(run_dir: Path, metrics: Mapping[str, Any]) -> None:
    """Record a run refused or failed before its first iteration in ``metrics.json``. In the
    directory of a stopped run that ``train.resume=auto`` would continue, the stopped run's
    record stays, with this attempt added to its ``start_failures`` (``error``,
    ``failed_at``): a mistyped command (fewer iterations, another arm) or a start that failed
    for a passing reason must not turn an interrupted run into a failed one, after which the
    right command would start over and overwrite its checkpoint. So does the record of any
    other run that got past its start (completed, diverged, failed mid-run): an attempt that
    did nothing (a mistyped ``train.resume=true`` in a finished run's directory) must not
    replace the results of the run whose checkpoint is still there. A record of an earlier
    start failure is replaced: it holds no results."""
    kept = read_metrics(run_dir)
    if auto_resume_path(run_dir) is None:
        if kept is None or (kept.get("status") == "failed" and kept.get("failed_at") == "start"):
            write_metrics(run_dir, metrics)
            return
    elif kept is None:  # a Slurm requeue without a readable record
        return
    attempt = {"error": metrics.get("error"), "failed_at": metrics.get("failed_at")}
    kept["start_failures"] = [*(kept.get("start_failures") or []), attempt]
    write_metrics(run_dir, kept)


def _train_validated(
    plain: dict[str, Any],
    run_dir: Path,
    metrics: dict[str, Any],
    start_wall: float,
    stop: StopSignals,
    exporter: Exporter | None,
) -> dict[str, Any]:
    try:
        full = validate_config(plain)
        settings = full["train"]
        # Before the scene is built: a preemption during a long start-up is a clean stop too.
        stop.install(settings["stop_signals"])
        device = torch.device(settings["device"])
        resume_from = _resume_path(settings["resume"], run_dir)
        unrecorded = _unrecorded_checkpoint(settings["resume"], resume_from, run_dir)
        rss = measure_memory(device)
        try:
            scene, texture, ckpt = _start(full, resume_from, run_dir, exporter)
        except BaseException:
            rss.stop()
            raise
        if unrecorded:
            # Said once the run has started (a refused start says only why it was refused).
            print(
                f"mptex: {run_dir / CHECKPOINT_FILE} is of a run that ended without a record "
                "(killed?); train.resume=auto starts over, train.resume=true continues from it",
                file=sys.stderr,
            )
    except ValueError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the source wrote
        # The config as a run that started records it (defaults, the device, the arm's
        # fields), as far as it is valid: the report places this run in its arm's row.
        metrics.update(error=message, failed_at="start", config=normalized_config(plain))
        _record_start_failure(run_dir, metrics)
        raise ConfigError(message) from None
    except Exception as exc:
        # Not the config's fault (the scene's buffers did not fit, a library failed): recorded
        # as a failure at start all the same, then raised as it came.
        error = " ".join(f"{type(exc).__name__}: {exc}".split())
        metrics.update(error=error, failed_at="start", config=normalized_config(plain))
        _record_start_failure(run_dir, metrics)
        raise
    metrics["config"] = full
    run: RunState | None = None
    try:
        try:
            # The named steps: setup, the iterations (step, validate, checkpoint), finish.
            if ckpt is not None:
                _take_recorded_time(ckpt, resume_from, run_dir)
            run = setup(full, scene, texture, ckpt, run_dir, device, metrics, start_wall)
            # The start's peak (the scene's G-buffers at their largest) apart from the rest:
            # arms differ in the rest, and a job needs the larger of the two.
            metrics["start_peak_memory_bytes"] = start_peak_memory(device, rss)
            _retire_finished_record(run_dir)
            evaluated = _iterate(run, stop)
            return finish(run, evaluated, start_wall, rss, exporter)
        finally:
            rss.stop()
    except ConfigError as exc:
        metrics.update(status="failed", error=str(exc), failed_at="start")
        _record_start_failure(run_dir, metrics)
        raise
    except Exception as exc:
        full = exc if isinstance(exc, DiskFullError) else None
        error = str(exc) if full is not None else f"{type(exc).__name__}: {exc}"
        metrics.update(status="failed", error=error, failed_at=metrics.get("iterations", 0),
                       failed_writing=full.filename if full is not None else None)  # fmt: skip
        if run is not None:
            # This process's time, for the run's totals: a run continued after a failure
            # (a full disk, freed) counts it whole when its checkpoint is this process's.
            metrics.update(_failed_times(run), resume_count=run.resume_count)
        try:
            write_metrics(run_dir, metrics)
        except DiskFullError:
            pass  # the disk is still full: metrics.json stays as it was; the error is raised
        raise


def _failed_times(run: RunState) -> dict[str, Any]:
    """A failed run's ``wall_time_s``, ``train_time_s`` and totals (:meth:`RunState.time_totals`)
    up to now: its training loop's time is up to the loop's end, or up to now where the failure
    came inside the loop (none where it came before)."""
    now = time.perf_counter()
    trained, wall = run.loop_time(now), now - run.start_wall
    return {"wall_time_s": wall, "train_time_s": trained, **run.time_totals(wall, trained)}


def _export(
    full: dict[str, Any], scene: Scene, texture: MLPTexture3D, run_dir: Path, exporter,
    iterations: int,
) -> dict[str, Any] | None:  # fmt: skip
    """With ``export.enabled``: bake and write ``run_dir/export/`` (``exporter.export``).

    Returns the summary kept in metrics.json (None when not enabled). A failure here (the disk
    filled up, ...) does not undo the completed training: it is recorded as ``export.error``.
    """
    if not full["export"]["enabled"]:
        return None
    try:
        source = export_source(run_dir, full, iterations, "completed")
        summary = exporter.export(texture, scene, run_dir / "export", full["export"],
                                  full["train"]["val_background"], source)  # fmt: skip
    except (ValueError, RuntimeError, OSError) as exc:
        return {"dir": "export", "error": " ".join(f"{type(exc).__name__}: {exc}".split())}
    return {"dir": "export", **{k: summary.get(k) for k in _EXPORT_SUMMARY}}


class RunState:
    """What the steps of one run share: the run's objects, its counters and what it has measured.

    Built by :func:`setup`; :func:`step`, :func:`validate`, :func:`checkpoint` and :func:`finish`
    read and update it. ``status`` starts ``"completed"`` and becomes ``"diverged"`` or
    ``"interrupted"`` when the loop stops early (``diverged_at``: the iteration, 0-based).
    """

    def __init__(self, full: dict[str, Any], scene: Scene, texture: MLPTexture3D,
                 run_dir: str | os.PathLike, device: torch.device,
                 metrics: dict[str, Any]) -> None:  # fmt: skip
        self.full, self.settings = full, full["train"]
        self.scene, self.texture, self.run_dir, self.device = scene, texture, Path(run_dir), device
        self.metrics = metrics
        seed = int(self.settings["seed"])
        # Two generators of the run's own: the views drawn, and the noise (random backgrounds,
        # the smoothness jitter); with the global ones, a checkpoint saves them all.
        self.generators = {
            "views": torch.Generator().manual_seed(seed),
            "noise": torch.Generator(device).manual_seed(seed + 1),
        }
        self.optimizer: torch.optim.Adam | None = None
        self.stepper: PrecisionStepper | None = None
        self.monitor: PrecisionMonitor | None = None
        self.light_dir: torch.Tensor | None = None
        self.writer = None
        self.start_iter, self.n_iter = 0, int(self.settings["iterations"])
        self.history: list[dict[str, Any]] = []
        self.skipped_steps, self.consecutive_skips = 0, 0
        self.resume_count, self.interruptions = 0, []
        # What a resume that has no iteration left to run reports (the checkpoint's).
        self.resumed_loss, self.resumed_time = None, None
        self.iter_times: list[float] = []
        self.loss_value: float | None = None
        self.status, self.diverged_at = "completed", None
        # The stop signals' handler (set by _iterate), and a stop signal that came after the
        # last iteration had begun: {"signal", "during"} (_note_stop)
        self.stop: StopSignals | None = None
        self.stop_requested: dict[str, str] | None = None
        self.train_time = 0.0
        # The run's time before this process (the checkpoint's or its writer's record's
        # wall_time_total_s and train_time_total_s; setup), and whether that is all of it
        # (time_total_complete); when this process's run began and its training loop ended.
        self.earlier_wall, self.earlier_train, self.time_total_complete = 0.0, 0.0, True
        self.start_wall = time.perf_counter()
        self.loop_end: float | None = None
        # Where this process's wall time went (metrics.json's time_split_s): seconds per part,
        # filled by step, validate, checkpoint and _iterate; finish adds start and rest.
        self.time_split = {"iterations": 0.0, "sampled_iterations": 0.0, "validation": 0.0,
                           "checkpoints": 0.0}  # fmt: skip
        self.loop_start: float | None = None
        # The next iteration's forward and backward queued before this one's read
        # (_resolve_overlap, _iterate); the read's side stream on CUDA; when the last
        # overlapped iteration ended.
        self.overlap = False
        self.stateful: list[torch.nn.Module] = []  # modules with state of their own
        self.read_stream = None
        self.overlap_clock: float | None = None
        self.fused_loss = False  # the loss terms' Triton kernels (_resolve_fused_loss)

    def jitter(self, points: torch.Tensor) -> torch.Tensor:
        """``points`` moved by ``N(0, kd_jitter_std)`` noise: the kd smoothness term's samples."""
        noise = torch.randn(points.shape, device=points.device, generator=self.generators["noise"])
        return points + noise * float(self.settings["kd_jitter_std"])

    def time_totals(self, wall: float, train: float) -> dict[str, Any]:
        """The run's time over all its processes, given this process's ``wall`` and ``train``
        (its training loop's) seconds so far: ``wall_time_total_s``, ``train_time_total_s``
        and ``time_total_complete`` (False where an earlier process's time is known only up
        to the checkpoint this run continued from: :func:`_take_recorded_time`)."""
        return {
            "wall_time_total_s": self.earlier_wall + wall,
            "train_time_total_s": self.earlier_train + train,
            "time_total_complete": self.time_total_complete,
        }

    def loop_time(self, now: float) -> float:
        """This process's training-loop seconds up to ``now`` (``time.perf_counter()``): up to
        the loop's end once it ended, none before it began."""
        if self.loop_start is None:
            return 0.0
        return (now if self.loop_end is None else self.loop_end) - self.loop_start

    def time_per_iter(self) -> float | None:
        """The median time of this run's iterations (the checkpoint's when none ran)."""
        return statistics.median(self.iter_times) if self.iter_times else self.resumed_time


@dataclass(frozen=True)
class StepOutcome:
    """One iteration's result (:func:`step`).

    Attributes:
        loss: the iteration's loss (a Python float; may be non-finite).
        lr: the grid's learning rate this iteration (``train.lr`` times the schedule).
        result: the :class:`~mptex.precision.PrecisionStepper` step's result; None when a
            non-finite loss in an arm without loss scaling stopped the run before backward.
        stats: the precision monitor's statistics on a sampled iteration, else None.
        diverged: the run ends here as diverged.
    """

    loss: float
    lr: float
    result: Any = None
    stats: dict[str, Any] | None = None
    diverged: bool = False


def setup(
    full: dict[str, Any],
    scene: Scene,
    texture: MLPTexture3D,
    ckpt: dict[str, Any] | None,
    run_dir: str | os.PathLike,
    device: torch.device,
    metrics: dict[str, Any],
    start_wall: float | None = None,
) -> RunState:
    """The run's optimizer (:func:`_param_groups`), stepper, precision monitor, light and
    generators, with a checkpoint's state restored when ``ckpt`` is given. ``start_wall``:
    when this process's run began (``time.perf_counter()``; default now), from which its
    wall time counts."""
    run = RunState(full, scene, texture, run_dir, device, metrics)
    if start_wall is not None:
        run.start_wall = start_wall
    settings = run.settings
    if settings["threads"] is not None:
        torch.set_num_threads(settings["threads"])
    # As floats: torch's Adam refuses betas that mix an int and a float ([0, 0.99] as the
    # command line gives train.betas=[0,0.99]).
    betas = tuple(float(beta) for beta in settings["betas"])
    run.optimizer = torch.optim.Adam(
        _param_groups(texture, settings["mlp_lr_scale"]),
        lr=settings["lr"], betas=betas, eps=settings["adam_eps"],
        **_adam_implementation(texture, device),
    )  # fmt: skip
    # Every training view's G-buffer and covered pixels, now (one rasterization per chunk).
    scene.prepare_training(normals=settings["shading"] != "kd")
    run.stepper = PrecisionStepper(texture.policy, run.optimizer)
    stateful = _forward_state(texture)
    run.overlap = _resolve_overlap(settings["overlap"], stateful, run.optimizer)
    run.stateful = [module for _, module in stateful]
    run.fused_loss = _resolve_fused_loss(settings["fused_loss"], device, settings["loss"])
    if run.overlap and device.type == "cuda":
        run.read_stream = torch.cuda.Stream(device)
    # Per-layer underflow/overflow statistics of the compute-dtype gradients, sampled.
    stats_every = settings["stats_interval"]
    run.monitor = PrecisionMonitor(texture, every=stats_every) if stats_every else None
    run.light_dir = light_direction(settings, device)
    if ckpt is not None:
        texture.load_state_dict(ckpt["texture"])
        own = [(g["lr_scale"], g["betas"], g["eps"]) for g in run.optimizer.param_groups]
        run.optimizer.load_state_dict(ckpt["optimizer"])  # also the checkpoint's hyperparameters
        # The MLP's rate is this run's train.mlp_lr_scale, as lr is this run's train.lr; Adam's
        # betas and epsilon are this run's train.betas and train.adam_eps.
        implementation = _adam_implementation(texture, device)
        for group, (scale, betas, eps) in zip(run.optimizer.param_groups, own, strict=True):
            group.update(lr_scale=scale, betas=betas, eps=eps, **implementation)
        _place_adam_steps(run.optimizer)
        run.stepper.load_state_dict(ckpt["stepper"])
        set_rng_state(ckpt["rng"], run.generators)
        run.start_iter, run.history = int(ckpt["iteration"]), list(ckpt["history"])
        run.skipped_steps, run.consecutive_skips = ckpt["skipped_steps"], ckpt["consecutive_skips"]
        run.resumed_loss = ckpt.get("loss", run.history[-1]["loss"] if run.history else None)
        run.resumed_time = ckpt.get("time_per_iter_s")
        run.resume_count = ckpt.get("resume_count", 0) + 1
        run.interruptions = list(ckpt.get("interruptions", []))
        # A checkpoint written before these keys: its run's earlier time is not known.
        run.earlier_wall = float(ckpt.get("wall_time_total_s") or 0.0)
        run.earlier_train = float(ckpt.get("train_time_total_s") or 0.0)
        run.time_total_complete = ckpt.get("time_total_complete") is True
    metrics["resumed_from"] = run.start_iter if ckpt is not None else None
    metrics.update(iterations=run.start_iter, iterations_planned=run.n_iter)
    run.writer = tensorboard_writer(run.run_dir, bool(settings["tensorboard"]))
    return run


@dataclass
class _Enqueued:
    """An iteration whose views, render, loss and backward are queued (:func:`_forward_backward`);
    ``tick``: when its host work began."""

    it: int
    tick: float
    loss: torch.Tensor


@dataclass
class _Launched:
    """An iteration whose optimizer step is queued too (:func:`_launch_step`): what its one host
    read takes (``packed``: loss, the step's flags, the sampled statistics; ``ready``: on CUDA,
    an event recorded after ``packed``) and how to decode it."""

    enqueued: _Enqueued
    lr: float
    pending: Any
    monitored: Any
    packed: torch.Tensor
    ready: Any


def _forward_backward(run: RunState, it: int) -> _Enqueued:
    """Iteration ``it``'s work up to its gradients (the module docstring's steps 1-5 and the
    backward of 6): nothing is read on the host and the optimizer is not touched, so it can be
    queued while the previous iteration's outcome is still on its way (:func:`_iterate`)."""
    settings, texture, device = run.settings, run.texture, run.device
    noise_gen = run.generators["noise"]
    tick = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)
    if run.monitor is not None:
        run.monitor.start(it)  # arms the hooks on sampled iterations, before the forward

    # Scopes named mptex.* split a torch profile of the run by part
    # (benchmarks/cpu_speed.py profile); outside a profiler they are not entered.
    with profiler_scope("mptex.views"):
        views = run.scene.training_batch(settings["batch_size"], run.generators["views"],
                                         normals=settings["shading"] != "kd")  # fmt: skip
        shape = views.coverage.shape[:-1] + (3,)
        background = draw_background(settings["background"], shape, device, noise_gen)
        ref_alpha = views.rgba[..., 3:4]
    use_reg = settings["kd_smooth"] and settings["kd_smooth_weight"] > 0
    with profiler_scope("mptex.render"):
        pred, kd_grad = render_batch(texture, views, settings, background, run.light_dir,
                                     run.jitter if use_reg else None,
                                     fused=run.fused_loss,
                                     joint=settings["kd_smooth_joint"])  # fmt: skip
    with profiler_scope("mptex.loss"):
        # nvdiffrec: alpha MSE + color loss on RGB masked by the reference alpha. The
        # predicted alpha is the fixed mesh's coverage: the alpha term has no texture gradient.
        pred_alpha = views.coverage.to(pred.dtype)
        loss = torch.nn.functional.mse_loss(pred_alpha, ref_alpha)
        # The reference composited over the same background, both masked by its alpha.
        loss = loss + masked_image_loss(pred, views.rgba, background, settings["loss"],
                                        fused=run.fused_loss)  # fmt: skip
        if kd_grad is not None:
            ramp = float(settings["kd_smooth_ramp"])
            weight = settings["kd_smooth_weight"] * (min(1.0, it / ramp) if ramp > 0 else 1.0)
            loss = loss + kd_grad * weight
    if settings["inject_nonfinite_at"] == it:  # test hook: a forced overflow
        loss = loss * float("inf")
    if settings["inject_signal_at"] == it:  # test hook: a stop signal mid-iteration
        send_signal(settings["inject_signal"])

    with profiler_scope("mptex.backward"):
        run.stepper.backward(loss)
    return _Enqueued(it, tick, loss)


def _launch_step(run: RunState, enqueued: _Enqueued) -> _Launched:
    """The iteration's learning rates and optimizer step (the module docstring's 6-7), queued:
    the finite check, the scale update and (fused Adam) the step or skip run on the device;
    and the one tensor its host read takes."""
    settings, it, loss = run.settings, enqueued.it, enqueued.loss
    factor = lr_schedule(it, settings["warmup_iter"], settings["lr_decay"],
                         settings["lr_schedule"], run.n_iter)  # fmt: skip
    lr = settings["lr"] * factor
    mlp_factor = mlp_rate_factor(settings, it)
    for i, group in enumerate(run.optimizer.param_groups):
        # group 1 is the MLP (_param_groups); its lr_scale is the ramp's start
        group["lr"] = lr * (mlp_factor if i == 1 else group["lr_scale"])
    with profiler_scope("mptex.optimizer"):
        # A non-finite loss in an arm without loss scaling skips the step there too.
        pending = run.stepper.step_async(loss)
    with profiler_scope("mptex.stats"):
        monitored = run.monitor.pending() if run.monitor is not None else None
        # The iteration's one host read: loss, the step's flags and, on sampled iterations,
        # the statistics, in one copy (docs/training.md, "Host synchronisation").
        parts = [loss.detach().float().reshape(1), pending.flags]
        if monitored is not None and monitored[0] is not None:
            # The statistics' counts need float64 (exact beyond 2**24); float32 values
            # (loss, flags) convert exactly.
            parts = [part.to(monitored[0].dtype) for part in parts] + [monitored[0]]
        packed = torch.cat(parts)
    return _Launched(enqueued, lr, pending, monitored, packed, None)


def _read(run: RunState, launched: _Launched) -> list[float]:
    """The iteration's one host read, a synchronous copy. With ``launched.ready`` (the next
    iteration already queued behind it) the copy runs on a side stream that waits for that
    event only, so the host waits for this iteration's work and the device goes on with the
    next one's; a copy on the main stream would wait for both."""
    if launched.ready is None:
        return to_host(launched.packed).tolist()
    side = run.read_stream
    side.wait_event(launched.ready)
    with torch.cuda.stream(side):
        host = to_host(launched.packed)
    return host.tolist()


def _finish_step(run: RunState, launched: _Launched, host: list[float]) -> StepOutcome:
    """The iteration's outcome from its host read: the stepper's result, the statistics, the
    counters; the run's divergence checks (:func:`step`'s docstring)."""
    enqueued, pending, monitored = launched.enqueued, launched.pending, launched.monitored
    with profiler_scope("mptex.stats"):
        n_flags = pending.flags.numel()
        run.loss_value = loss_value = host[0]
        flags, rest = host[1 : 1 + n_flags], host[1 + n_flags :]
    if not math.isfinite(loss_value) and run.stepper.scaler is None:
        # Skipped: the weights and Adam's state are those after iteration it - 1.
        return StepOutcome(loss_value, launched.lr, diverged=True)
    with profiler_scope("mptex.optimizer"):
        result = run.stepper.finish(pending, flags)
    stats = None if monitored is None else monitored[1](rest if monitored[0] is not None
                                                         else None, result)  # fmt: skip
    if result.diverged and result.skipped:
        # A non-finite gradient without loss scaling: the step was not taken, the weights
        # and Adam state are those after iteration it - 1; the run ends here.
        return StepOutcome(loss_value, launched.lr, result, stats, diverged=True)
    now = time.perf_counter()
    # An iteration's time runs from the end of the previous one when that one's read came
    # after this one's work was queued (overlapped), else from the start of its own work.
    begun = run.overlap_clock if run.overlap_clock is not None else enqueued.tick
    elapsed = now - begun
    run.iter_times.append(elapsed)
    run.time_split["iterations"] += elapsed
    if stats is not None:
        run.time_split["sampled_iterations"] += elapsed
    run.skipped_steps += int(result.skipped)
    run.consecutive_skips = run.consecutive_skips + 1 if result.skipped else 0
    run.metrics["iterations"] = enqueued.it + 1
    if result.diverged:  # the step itself made a weight non-finite (f16 Adam)
        run.history.append(_history_entry(enqueued.it + 1, loss_value, None, result,
                                          launched.lr, stats))  # fmt: skip
        return StepOutcome(loss_value, launched.lr, result, stats, diverged=True)
    return StepOutcome(loss_value, launched.lr, result, stats)


def step(run: RunState, it: int) -> StepOutcome:
    """Iteration ``it`` (0-based): a batch of views, the render, the loss, backward, the
    learning rates and the optimizer step through the stepper (the module docstring's steps
    1-7), then its one host read.

    Counts the step (``iter_times``, skipped steps, ``metrics["iterations"]``) unless it ends
    the run before the optimizer (a non-finite loss without loss scaling, a non-finite gradient
    without loss scaling: the weights stay those after iteration ``it - 1``). A step that made a
    weight non-finite is counted and recorded in the history, and ends the run.

    :func:`_iterate` runs the same three parts, and where ``run.overlap`` allows queues the
    next iteration's forward and backward before this one's read.
    """
    run.overlap_clock = None
    launched = _launch_step(run, _forward_backward(run, it))
    return _finish_step(run, launched, _read(run, launched))


def validate(run: RunState, completed: int) -> dict[str, Any]:
    """:func:`~mptex.train.validation.evaluate` on the validation views after ``completed``
    iterations, logged to TensorBoard when it is on; returns the evaluation."""
    tick = time.perf_counter()
    with profiler_scope("mptex.validation"):
        evaluated = evaluate(run.texture, run.scene, run.settings, run.light_dir)
    # evaluate ends with host reads of the PSNR: the device has finished
    run.time_split["validation"] += time.perf_counter() - tick
    if run.writer is not None:
        run.writer.add_scalar("val/psnr", evaluated["psnr"], completed)
        run.writer.add_images("val/prediction", rgb_to_srgb(evaluated["pred"]).clamp(0, 1).cpu(),
                              completed, dataformats="NHWC")  # fmt: skip
    return evaluated


def checkpoint(run: RunState, completed: int) -> bool:
    """Write ``checkpoint.pt`` (atomically) after ``completed`` iterations; False, and nothing
    written, when a weight or the optimizer's state is not finite (a checkpoint never holds
    one; a finite gradient over about 5.8e20 makes Adam's float32 second moment inf, and the
    weight it belongs to stops moving)."""
    tick = time.perf_counter()
    # This process's time up to the write (the write itself is not in the file it writes).
    trained = run.loop_time(tick)
    # save_checkpoint checks the weights and the optimizer's state (one reduction) and refuses
    # a non-finite one before it writes anything.
    try:
        with profiler_scope("mptex.checkpoint"):
            save_checkpoint(run.run_dir / CHECKPOINT_FILE, {
                "texture": run.texture.state_dict(),
                "optimizer": run.optimizer.state_dict(),
                "stepper": run.stepper.state_dict(),
                "iteration": completed,
                "rng": rng_state(run.generators),
                "history": run.history,
                "skipped_steps": run.skipped_steps,
                "consecutive_skips": run.consecutive_skips,
                "aabb": run.scene.aabb.cpu(),
                "precision": run.full["precision"],
                "config": run.full,
                "loss": run.loss_value if run.loss_value is not None else run.resumed_loss,
                "time_per_iter_s": run.time_per_iter(),
                "resume_count": run.resume_count,
                "interruptions": run.interruptions,
                **run.time_totals(tick - run.start_wall, trained),
            })  # fmt: skip
    except CheckpointError:
        run.time_split["checkpoints"] += time.perf_counter() - tick
        return False
    # the state dicts were copied to the host before the write: the device has finished
    run.time_split["checkpoints"] += time.perf_counter() - tick
    return True


def _record(run: RunState, out: StepOutcome, completed: int, evaluated) -> None:
    """The history entry (sampled statistics, a validation, the last iteration, every
    ``history_interval``), TensorBoard's scalars and the progress bar after a step."""
    settings, result = run.settings, out.result
    interval = settings["history_interval"]
    last = completed == run.n_iter
    if (
        out.stats is not None
        or evaluated is not None
        or last
        or (interval and completed % interval == 0)
    ):
        psnr_now = None if evaluated is None else evaluated["psnr"]
        run.history.append(_history_entry(completed, out.loss, psnr_now, result, out.lr,
                                          out.stats))  # fmt: skip
        if evaluated is not None:  # the saturation curve: when it sets in
            saturation = evaluated["saturation"]
            run.history[-1].update(saturated_fraction=saturation["saturated_fraction"],
                                   stuck_fraction=saturation["stuck_fraction"])  # fmt: skip
    if run.writer is not None:
        run.writer.add_scalar("train/loss", out.loss, completed)
        run.writer.add_scalar("train/loss_scale", result.loss_scale, completed)
        run.writer.add_scalar("train/lr", out.lr, completed)


def _looks_ahead(run: RunState, it: int) -> bool:
    """Whether iteration ``it + 1``'s forward and backward may be queued before iteration
    ``it``'s read: ``run.overlap`` is on, and nothing after iteration ``it`` needs its
    weights before that read (a validation, a checkpoint, the end of the run)."""
    if not run.overlap:
        return False
    completed = it + 1
    settings = run.settings
    val_interval, ck_interval = settings["val_interval"], settings["checkpoint_interval"]
    return not (
        completed >= run.n_iter
        or (val_interval and completed % val_interval == 0)
        or (ck_interval and completed % ck_interval == 0)
    )


def _drop(ahead: _Enqueued | None, kept: list) -> None:
    """A run that ends with a look-ahead queued: its forward and backward are dropped, as if
    never queued (their gradients are never stepped), and what they recorded in modules with
    state of their own is restored from the snapshot taken before them."""
    if ahead is not None:
        for module, snapshot in kept:
            module.restore(snapshot)


def _note_stop(run: RunState, during: str) -> None:
    """After the part ``during`` of a run whose last iteration had begun (``"last iteration"``,
    ``"final validation"``, ``"final checkpoint"``, ``"images"``, ``"export"``, ``"metrics"``):
    the first stop signal received, if one came and none was noted before, as
    ``run.stop_requested`` (``{"signal", "during"}``). Such a signal does not stop the run (its
    results are whole a moment later); it is recorded, and ``mptex-train`` exits 3."""
    stop = run.stop
    if run.stop_requested is None and stop is not None and stop.received:
        run.stop_requested = {"signal": stop.received[0], "during": during}


def _iterate(run: RunState, stop: StopSignals) -> dict[str, Any] | None:
    """The iterations left: :func:`step`'s parts, then :func:`validate` every
    ``val_interval`` and at the end, the history, :func:`checkpoint` every
    ``checkpoint_interval``, and the stop checks (divergence, skipped steps, a stop signal).
    Returns the last iteration's evaluation when the last iteration validated (None otherwise).

    With ``run.overlap`` (:func:`_resolve_overlap`), iteration ``it + 1``'s forward and backward
    are queued after iteration ``it``'s optimizer step and before its read, so the device
    works through them while the host waits, and the host queues them while the device
    finishes iteration ``it``. Nothing else moves: iteration ``it + 1``'s optimizer step is
    queued only after iteration ``it``'s outcome is known, so a run that ends at ``it``
    (diverged) ends with the weights and optimizer state it had without the overlap, and
    the queued forward and backward are dropped (what they recorded in modules with state of
    their own, the FP8 layers' scaling, restored from a snapshot); a stop signal that arrives
    during them is taken after iteration ``it + 1``, as it would be without the overlap.
    """
    settings = run.settings
    run.stop = stop
    progress = Progress(run.n_iter, run.start_iter, settings["progress"])
    evaluated, last_psnr = None, None
    train_start = run.loop_start = time.perf_counter()
    run.overlap_clock = None
    ahead: _Enqueued | None = None
    kept: list = []
    for it in range(run.start_iter, run.n_iter):
        enqueued = ahead if ahead is not None else _forward_backward(run, it)
        launched = _launch_step(run, enqueued)
        ahead = None
        # A stop signal already received stops the run after this iteration: nothing more is
        # queued.
        if not stop.received and _looks_ahead(run, it):
            if launched.packed.device.type == "cuda":
                # on the run's device's stream, which the current device's need not be
                launched.ready = torch.cuda.Event()
                launched.ready.record(torch.cuda.current_stream(launched.packed.device))
            # What the look-ahead's forward and backward record (the FP8 layers' scaling
            # state), to undo if the run ends at this iteration; no device work.
            kept = [(module, module.snapshot()) for module in run.stateful]
            ahead = _forward_backward(run, it + 1)
        out = _finish_step(run, launched, _read(run, launched))
        run.overlap_clock = time.perf_counter() if ahead is not None else None
        if out.diverged:
            _drop(ahead, kept)
            run.status, run.diverged_at = "diverged", it
            break
        completed = it + 1
        last = completed == run.n_iter
        val_interval = settings["val_interval"]
        evaluated = None
        if last:
            _note_stop(run, "last iteration")
        if last or (val_interval and completed % val_interval == 0):
            evaluated = validate(run, completed)
            last_psnr = evaluated["psnr"]
        if last:
            _note_stop(run, "final validation")
        _record(run, out, completed, evaluated)
        progress.update(loss=f"{out.loss:.4f}", psnr=None if last_psnr is None
                        else f"{last_psnr:.2f}", scale=f"{out.result.loss_scale:g}")  # fmt: skip
        if run.consecutive_skips >= settings["max_consecutive_skips"]:
            _drop(ahead, kept)
            run.status, run.diverged_at = "diverged", it
            break
        ck_interval = settings["checkpoint_interval"]
        if not last and ck_interval and completed % ck_interval == 0:
            if not checkpoint(run, completed):
                run.status, run.diverged_at = "diverged", it
                break
        # A signal that came while the next iteration was queued belongs to that one.
        if ahead is None and stop.received and not last:
            run.status = "interrupted"
            run.interruptions.append({"iteration": completed, "signal": stop.received[0]})
            break
    progress.close()
    run.loop_end = time.perf_counter()
    run.train_time = run.loop_end - train_start
    return evaluated


def finish(
    run: RunState,
    evaluated: dict[str, Any] | None,
    start_wall: float,
    rss: RunPeakRss,
    exporter: Exporter | None,
) -> dict[str, Any]:
    """After the last iteration: the final checkpoint, the final evaluation (``evaluated``, the
    last iteration's, when it validated the final weights), validation images, the export of
    a completed run; writes and returns ``metrics.json``'s dict.

    An interrupted run is checkpointed and not validated (it stops within the scheduler's
    grace period). A completed or interrupted run whose weights are not finite, or a completed
    run whose final render is not, ends as diverged.
    """
    metrics, settings, device = run.metrics, run.settings, run.device
    completed = metrics["iterations"]
    status = run.status
    written = status in ("completed", "interrupted") and checkpoint(run, completed)
    if status != "interrupted":  # a diverged run writes none: it stopped at its last iteration
        _note_stop(run, "final checkpoint" if written else "last iteration")
    if status in ("completed", "interrupted") and not written:
        status, run.diverged_at = "diverged", completed
    if status == "interrupted":
        # Within the scheduler's grace period: no validation render, no images.
        evaluation = dict.fromkeys(("psnr", "baseline_psnr", "psnr_per_image", "saturation"))
        metrics.update(interrupted_at=completed, signal=run.interruptions[-1]["signal"])
    elif status == "completed" and evaluated is not None and completed == run.n_iter:
        # The last iteration validated these weights (validation is deterministic: its
        # background is white or black), so the final evaluation is that one.
        evaluation = evaluated
    else:
        tick = time.perf_counter()
        with profiler_scope("mptex.validation"):
            evaluation = evaluate(run.texture, run.scene, settings, run.light_dir)
        run.time_split["validation"] += time.perf_counter() - tick
        _note_stop(run, "final validation")
    if status == "completed" and not math.isfinite(evaluation["psnr"]):
        # Finite weights can still render a non-finite image (an f16 overflow in the forward):
        # never a completed run.
        status, run.diverged_at = "diverged", completed
    if status == "completed" or (status != "interrupted" and math.isfinite(evaluation["psnr"])):
        with profiler_scope("mptex.images"):
            save_val_images(run.run_dir / "images", evaluation, settings["n_val_images"])
        _note_stop(run, "images")
    if run.writer is not None:
        run.writer.close()
    run.status = status
    export = (_export(run.full, run.scene, run.texture, run.run_dir, exporter, completed)
              if status == "completed" else None)  # fmt: skip
    if status != "interrupted":
        _note_stop(run, "export")
    rss.stop()
    peak, peak_kind = peak_memory(device, rss)
    wall = time.perf_counter() - start_wall
    split = dict(run.time_split)
    # start: the config, the scene (the training views' G-buffers), the texture (a library's
    # kernel compilation) and setup, up to the first iteration
    start = (run.loop_start if run.loop_start is not None else time.perf_counter()) - start_wall
    parts = start + split["iterations"] + split["validation"] + split["checkpoints"]
    # rest: the history, progress, images, export and the metrics' own bookkeeping (the parts
    # are disjoint intervals of the wall time; max() only absorbs the rounding of their sum)
    time_split = {"start": start, **split, "rest": max(0.0, wall - parts)}
    metrics.update(
        status=status,
        psnr=evaluation["psnr"],
        baseline_psnr=evaluation["baseline_psnr"],
        psnr_per_image=evaluation["psnr_per_image"],
        saturation=evaluation["saturation"],
        final_loss=run.loss_value if run.loss_value is not None else run.resumed_loss,
        time_per_iter_s=run.time_per_iter(),
        train_time_s=run.train_time,
        wall_time_s=wall,
        time_split_s=time_split,
        **run.time_totals(wall, run.train_time),
        peak_memory_bytes=peak,
        peak_memory_kind=peak_kind,
        skipped_steps=run.skipped_steps,
        final_loss_scale=run.stepper.loss_scale,
        diverged_at=run.diverged_at,
        error=None,
        failed_at=None,
        failed_writing=None,
        resume_count=run.resume_count,
        interruptions=run.interruptions,
        n_params=sum(p.numel() for p in run.texture.parameters()),
        backends={
            **run.texture.backends(),
            "raster": run.scene.gbuffers.resolved_backend(),
            **({"loop": "overlap"} if run.overlap else {}),
            **({"loss": "triton"} if run.fused_loss else {}),
        },  # fmt: skip
        device=str(device),
        device_name=device_name(device),
        torch_threads=torch.get_num_threads(),
        history=run.history,
        export=export,
        stop_requested=run.stop_requested,
    )
    metrics = {k: metrics.get(k) for k in METRICS_KEYS}
    write_metrics(run.run_dir, metrics)
    return metrics
