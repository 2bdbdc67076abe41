"""The run config: the ``train`` group's schema and the checks made before any work.

:class:`TrainConfig` is the ``train`` group (``configs/train/default.yaml`` mirrors it; unknown
keys are refused so that typos fail at start). :func:`validate_config` checks the whole run
config: each group against its schema (:mod:`mptex.config_schema`), then what relates groups to
each other and to this machine (an arm's backend, the device, the channels shading needs).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from mptex._backends import (
    auto_device,
    available_bytes,
    cuda_device_problem,
    unavailable_message,
)
from mptex.config_schema import (
    REQUIRED,
    SEED,
    AnyOf,
    ConfigError,
    FilePath,
    Flag,
    Integer,
    ListOf,
    Number,
    OneOf,
    OrNull,
    Text,
    check_group,
    defaults_of,
    plain,
    setting,
)
from mptex.export_config import check_export_config
from mptex.fp8 import resolve_gemm_backend
from mptex.precision import PrecisionPolicy
from mptex.render.rasterize import _MAX_TRIS_PER_BLOCK, resolved_backend
from mptex.scenes.config import check_scene_config
from mptex.texture import NVDIFFREC_ENCODER_CONFIG, GridConfig, check_texture_config
from mptex.train.losses import LOSSES, LR_SCHEDULES
from mptex.train.shading import _BACKGROUNDS, _SHADINGS
from mptex.train.signals import DEFAULT_STOP_SIGNALS, STOP_SIGNAL_LIST, STOP_SIGNAL_NAMES

__all__ = [
    "TrainConfig",
    "TRAIN_DEFAULTS",
    "ConfigError",
    "check_texture_config",
    "config_key",
    "mlp_activation_problem",
    "normalized_config",
    "absolute_scene_paths",
    "validate_config",
]

_POSITIVE = Number(min=0, min_open=True)  # a learning rate, a scale: finite and > 0
_AT_LEAST_0 = Number(min=0)
_PERIOD = Integer(min=0, note="0: only at the end")


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _largest_step(s: Mapping[str, Any]) -> float:
    # Adam's first step is rate / (1 - betas[0]) (its bias correction; later steps less), the
    # rate at most lr * max(1, the MLP's factor); torch refuses a step beyond float32 ("value
    # cannot be converted to type float without overflow") where NaN weights would be a result.
    factor = max(1.0, s["mlp_lr_scale"], s["mlp_lr_ramp_to"] or 0.0)
    return s["lr"] * factor / (1.0 - s["betas"][0])


# The MLP's factors, with their defaults: a factor the user left as it was is not to blame.
_MLP_FACTORS = {"mlp_lr_scale": 1.0, "mlp_lr_ramp_to": None}
_DEFAULT_LR = 0.01


def _factor_set(s: Mapping[str, Any]) -> str | None:
    """The MLP factor the user set that makes the largest rate (None: neither, or <= 1)."""
    chosen = [k for k, default in _MLP_FACTORS.items() if s[k] != default and (s[k] or 0) > 1]
    return max(chosen, key=lambda k: s[k], default=None)


def _step_in_float32(key: str):
    """The rule on ``key`` (lr or one of the MLP's factors) that the largest Adam step is a
    float32 number: the product lr x factor is what is checked, and the line names the key
    the user set (lr where both were, with the factor beside it)."""

    def rule(s: Mapping[str, Any]) -> str | None:
        step = _largest_step(s)
        if step <= _FLOAT32_MAX:
            return None
        factor = _factor_set(s)
        lr_set = s["lr"] != _DEFAULT_LR or factor is None
        if (key == "lr") != lr_set or (key != "lr" and key != factor):
            return None
        beside = f"with train.{factor}={s[factor]!r}, " if key == "lr" and factor else ""
        return (
            f"{beside}a rate whose largest Adam step, lr * max(1, mlp_lr_scale, "
            f"mlp_lr_ramp_to) / (1 - betas[0]) = {step:.6g}, is a float32 number "
            f"(<= {_FLOAT32_MAX:.6g})"
        )

    return rule


def _non_zero_light(s: Mapping[str, Any]) -> str | None:
    return None if any(v != 0 for v in s["light_dir"]) else "a non-zero [x, y, z] of numbers"


def _reached_iteration(key: str):
    """The rule of a test hook set at an iteration: one the run reaches (iterations run 0 to
    ``iterations - 1``), since a hook beyond them would never fire and the test it serves
    would pass without what it tests having happened."""

    def rule(s: Mapping[str, Any]) -> str | None:
        at, iterations = s[key], s["iterations"]
        if at is None or at < iterations:
            return None
        return (f"null or an iteration the run reaches (0 to {iterations - 1}: "
                f"train.iterations={iterations}; the run would never reach {at})")  # fmt: skip

    return rule


_DEVICE_WORDS = "auto, cpu, cuda or cuda:N"


def torch_device(device: str) -> torch.device:
    """``train.device`` (not ``auto``) as a torch device.

    Raises:
        ConfigError: ``"train.device: expected auto, cpu, cuda or cuda:N, got 'gpu'"`` where
            torch cannot read it (its own words name no expectation for ``''`` and list twenty
            device types for ``'gpu'``).
    """
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"train.device: expected {_DEVICE_WORDS}, got {device!r}") from None


@dataclass
class TrainConfig:
    """The ``train`` group: nvdiffrec's texture-training recipe, and how a run records, stops
    and resumes (``docs/training.md``)."""

    iterations: int = setting(200, Integer(min=1, note="optimizer steps; 0 would train nothing"))
    """Optimizer steps (nvdiffrec runs thousands; 200 fits a one-minute CPU run). At least one:
    a run of none would record its initial texture as a completed run, which a sweep's report
    would compare with f32's as if trained, and a search would certify."""
    batch_size: int = setting(2, Integer(min=1))
    """Views per iteration (nvdiffrec's ``FLAGS.batch``)."""
    lr: float = setting(_DEFAULT_LR, _POSITIVE, rule=_step_in_float32("lr"))
    """Adam's learning rate (nvdiffrec's for the material); its largest step, with the MLP's
    factor and Adam's bias correction, must be a float32 number."""
    mlp_lr_scale: float = setting(
        1.0,
        Number(min=0, min_open=True, note="the MLP's learning rate over the grid's"),
        rule=_step_in_float32("mlp_lr_scale"),
    )
    """The MLP learns at ``lr * mlp_lr_scale``."""
    mlp_lr_ramp_to: float | None = setting(
        None,
        OrNull(_POSITIVE, "the MLP keeps mlp_lr_scale"),
        rule=_step_in_float32("mlp_lr_ramp_to"),
    )
    """A number: the MLP's factor ramps linearly from ``mlp_lr_scale`` to it."""
    mlp_lr_ramp_iter: int = setting(100, Integer(min=1, note="iterations of the MLP rate's ramp"))
    """The iteration where the ramp ends."""
    betas: list[float] = setting(
        [0.9, 0.999], ListOf(Number(0, 1, max_open=True), length=2, what="two numbers in [0, 1)")
    )
    """Adam's betas."""
    adam_eps: float = setting(1e-8, Number(0, _FLOAT32_MAX, min_open=True, note="a float32 number"))
    """Adam's epsilon (torch's default, nvdiffrec's); added to float32 tensors, so a float32
    number (beyond it, inf: every step would be 0)."""
    warmup_iter: int = setting(0, Integer(min=0))
    """Learning-rate factor ``it / warmup_iter`` during the warm-up."""
    lr_decay: float = setting(0.0002, _AT_LEAST_0)
    """Then ``10 ** (-lr_decay * (it - warmup_iter))`` (the exponential schedule)."""
    lr_schedule: str = setting("exponential", OneOf(LR_SCHEDULES))
    """``exponential`` (nvdiffrec's) or ``cosine`` (to 0 at the last iteration)."""
    loss: str = setting("logl1", OneOf(sorted(LOSSES)))
    """The image loss (:data:`mptex.train.LOSSES`)."""
    kd_smooth: bool = True
    """nvdiffrec's kd smoothness regulariser."""
    kd_smooth_weight: float = setting(0.03, _AT_LEAST_0)
    """Its weight, ramped linearly over ``kd_smooth_ramp`` iterations."""
    kd_smooth_ramp: float = setting(500, _AT_LEAST_0)
    """Iterations of the weight's ramp."""
    kd_jitter_std: float = setting(0.01, _AT_LEAST_0)
    """Its positions are jittered by N(0, std)."""
    kd_smooth_joint: bool = True
    """The texture evaluated once per iteration, on the covered points and their jittered copies
    together (one forward and one backward through the grid and the MLP, fewer kernel launches);
    false: two evaluations, as nvdiffrec's two calls. The same objective; the per-tensor FP8
    GEMM arms (``fp8``, ``fp8_current``) then quantise both halves with one scale, and the
    delayed recipe records one amax per iteration instead of two."""
    shading: str = setting("kd", OneOf(_SHADINGS))
    """``kd`` (albedo) or ``diffuse`` (needs ``texture.channels=9``)."""
    light_dir: list[float] = setting(
        [0.5, 0.8, 0.3],
        ListOf(Number(), length=3, what="a non-zero [x, y, z] of numbers"),
        rule=_non_zero_light,
    )
    """Diffuse shading: the direction towards the light (world space)."""
    ambient: float = setting(0.25, Number(0, 1))
    """Diffuse shading: the ambient fraction."""
    background: str = setting("random", OneOf(_BACKGROUNDS))
    """Training background: ``random`` (per-pixel noise), ``white`` or ``black``."""
    val_background: str = setting("white", OneOf(_BACKGROUNDS[1:]))
    """Validation background."""
    val_spp: int = setting(1, Integer(1, 16, note="validation samples per pixel along each axis"))
    """1 scores each pixel's centre (nvdiffrec's PSNR); k renders the validation views at k x
    the resolution and scores the k x k box-filtered mean. Mesh and builtin scenes only."""
    val_interval: int = setting(50, _PERIOD)
    """Validate every N iterations: the PSNR curve."""
    history_interval: int = setting(1, _PERIOD)
    """Record the loss and loss scale every N iterations in metrics.json."""
    stats_interval: int = setting(10, Integer(min=0, note="0: no precision statistics"))
    """Per-layer underflow/overflow statistics every N iterations."""
    threads: int | None = setting(None, OrNull(Integer(min=1), "torch's default"))
    """Torch CPU threads (1 for parallel sweep jobs)."""
    checkpoint_interval: int = setting(100, _PERIOD)
    """Also at the end."""
    n_val_images: int = setting(4, Integer(min=0))
    """Reference | prediction PNGs written to ``images/``: the first ``n_val_images``
    validation views (all of them where the scene has fewer)."""
    seed: int = setting(0, SEED)
    """Seeds torch, numpy, random, the view sampling, the noise."""
    init_seed: int | None = setting(None, OrNull(SEED, "train.seed"))
    """The texture's initial weights only; set apart from ``seed``, it measures the init's
    share of the seed spread."""
    device: str = setting("auto", Text(what=_DEVICE_WORDS))
    """``auto``: cuda if available, else cpu."""
    resume: Any = setting(
        "auto", AnyOf(Flag(), FilePath(), what="auto, true, false or a checkpoint path")
    )
    """``auto``: continue a run dir whose last run was stopped by a stop signal (or a Slurm
    requeue); ``true``: from ``<run dir>/checkpoint.pt``; ``false``: start over; or a path."""
    tensorboard: bool = False
    """Write TensorBoard scalars and images (if tensorboard is installed)."""
    progress: Any = setting("auto", AnyOf(OneOf(("auto",)), Flag(), what="auto, true or false"))
    """The tqdm bar; ``auto``: only on a terminal."""
    overlap: Any = setting("auto", AnyOf(OneOf(("auto",)), Flag(), what="auto, true or false"))
    """Queue each iteration's forward and backward before the previous iteration's host read,
    so host and device work at once; ``auto``: where the optimizer step is decided on the
    device (CUDA). The results are those without it."""
    fused_loss: Any = setting("auto", AnyOf(OneOf(("auto",)), Flag(), what="auto, true or false"))
    """The loss's image and kd smoothness terms in Triton kernels instead of about sixty eager
    ops (:mod:`mptex.train.fused_loss`); ``auto``: where they can run (CUDA, Triton, ``loss``
    logl1 or l1). The gradients are the eager loss's, bit for bit."""
    max_consecutive_skips: int = setting(200, Integer(min=1))
    """A loss-scaled arm that skips this many steps in a row has diverged."""
    inject_nonfinite_at: int | None = setting(
        None,
        OrNull(Integer(min=0), what="null or an iteration"),
        rule=_reached_iteration("inject_nonfinite_at"),
    )
    """Test hook: multiply the loss by inf at this iteration (below ``iterations``)."""
    stop_signals: list[str] = setting(list(DEFAULT_STOP_SIGNALS), STOP_SIGNAL_LIST)
    """Signals that stop the run cleanly: it finishes the iteration, writes checkpoint.pt and
    metrics.json (``status: interrupted``); ``[]``: each signal's default action."""
    inject_signal_at: int | None = setting(
        None,
        OrNull(Integer(min=0), what="null or an iteration"),
        rule=_reached_iteration("inject_signal_at"),
    )
    """Test hook: send ``inject_signal`` to this process during this iteration (below
    ``iterations``)."""
    inject_signal: str = setting(
        "SIGTERM", OneOf(STOP_SIGNAL_NAMES, what=f"a signal name from {list(STOP_SIGNAL_NAMES)}")
    )
    """The signal ``inject_signal_at`` sends."""


TRAIN_DEFAULTS = defaults_of(TrainConfig)
# The texture group's width and depth as configs/texture/default.yaml sets them (nvdiffrec's).
_TEXTURE_DEFAULTS = {"internal_dims": 32, "hidden": 2}

# Constructor argument -> config key, for errors raised while building the run's objects.
_ARGUMENT_KEYS = {
    **{f.name: f"texture.encoder.{f.name}" for f in fields(GridConfig)},
    "config": "texture.encoder",
    "grid_type": "texture.encoder.type",
    "channels": "texture.channels",
    "internal_dims": "texture.internal_dims",
    "n_neurons": "texture.internal_dims",
    "hidden": "texture.hidden",
    "n_hidden_layers": "texture.hidden",
    "min_max": "texture.min_max",
    "backend": "texture.backend",
    "fp8_gemm": "texture.fp8_gemm",
    "encoder": "texture.encoder",
    "AABB": "scene",
    "mlp_dtypes": "precision.mlp_dtypes",
}


def config_key(message: str) -> str:
    """``"<key>: ..."`` for a constructor's ``"<argument>: ..."`` / ``"<argument> must ..."``.

    The message's leading argument name is replaced by the config key that feeds it (e.g.
    ``n_levels`` -> ``texture.encoder.n_levels``, ``config.n_levels`` -> the same); a message
    naming no known argument is returned unchanged.
    """
    match = re.match(r"(\w+)((?:\.\w+)*)(:| must)(.*)", message, flags=re.DOTALL)
    if match is None or match.group(1) not in _ARGUMENT_KEYS:
        return message
    name, inner, sep, rest = match.groups()
    return f"{_ARGUMENT_KEYS[name]}{inner}:{rest if sep == ':' else ' must' + rest}"


def _rendered_scene(scene: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checked config of a scene whose views mptex renders at ``scene.resolution``, else
    None (a bad scene config, which ``build_scene`` reports; a scene of images at their own
    resolution, NeRF)."""
    try:
        checked = check_scene_config(scene)
    except ValueError:
        return None
    if not isinstance(checked.get("resolution"), tuple) or "n_train_views" not in checked:
        return None
    return checked


def _view_pixels(checked: Mapping[str, Any], val_spp: int) -> int:
    """Pixels of a rendered scene's views: the training views, the validation views at
    ``val_spp`` x the resolution."""
    height, width = checked["resolution"]
    return height * width * (checked["n_train_views"] + checked["n_val_views"] * val_spp**2)


# What a scene holds per pixel of each view it draws: the G-buffer (rast 16 bytes, position
# 12, normal 12, mask 1) and the reference RGBA (16); the rasterizer's temporaries come on top.
_VIEW_BYTES_PER_PIXEL = 57


def _short_of(needed: int | float, device: torch.device) -> int | None:
    """What ``device`` has free (:func:`available_bytes`) when ``needed`` bytes do not fit in
    it; None when they fit or where the free memory is unknown (nothing is refused then)."""
    available = available_bytes(device)
    return None if available is None or needed <= available else available


def _scene_memory_problem(scene: Mapping[str, Any], s: Mapping[str, Any], device: torch.device):
    """The first of the rendered scene's memory problems (:func:`_view_memory_problem`,
    :func:`_mesh_memory_problem`, :func:`_iteration_memory_problem`), else None; None too
    where the scene's config cannot be read (``build_scene`` reports it) or its images have
    their own resolution (NeRF). The scene's config is checked once for the three."""
    checked = _rendered_scene(scene)
    if checked is None:
        return None
    return (
        _view_memory_problem(checked, s["val_spp"], device)
        or _mesh_memory_problem(checked, device)
        or _iteration_memory_problem(checked, s, device)
    )


def _view_memory_problem(checked: Mapping[str, Any], val_spp: int, device: torch.device):
    """One line naming ``scene.resolution`` when the rendered scene's views (``checked``: its
    config from :func:`_rendered_scene`; the training views, and the validation views at
    ``val_spp`` x the resolution) cannot fit in what ``device`` has free, else None; None too
    where the free memory cannot be read."""
    size = checked["resolution"]
    needed = _view_pixels(checked, val_spp) * _VIEW_BYTES_PER_PIXEL
    available = _short_of(needed, device)
    if available is None:
        return None
    supersampled = f" (validation at train.val_spp={val_spp} x that)" if val_spp > 1 else ""
    return (
        f"scene.resolution: {checked['n_train_views']} training and {checked['n_val_views']} "
        f"validation views of {size[0]} x {size[1]} pixels{supersampled} need "
        f"{needed / 2**30:.1f} GiB for their buffers alone, only {available / 2**30:.1f} GiB "
        f"is free on {device} (lower scene.resolution, the view counts or train.val_spp)"
    )


# Views the scene rasterizes in one call: the training views in chunks of this many
# (mptex.scenes.Scene.prepare_training's default), the validation views all at once.
_TRAIN_VIEWS_PER_RASTER_CALL = 16
# The torch rasterizer's work per triangle instance (a triangle of one view) it sets up
# (mptex.render.rasterize's _setup_triangles), alive at once while it culls: the corners' rows
# of the per-vertex tables [3] (int64, 24 bytes), the rows gathered [3, 5] (int16, 30), the
# flags (int16, 2) and the culled, inside and drawn masks (3); the tables themselves (22 bytes
# per vertex of a few views), clipping, binning and the tiles' samples come on top. It sets up
# at most _MAX_TRIS_PER_BLOCK instances at once: this does not grow with the mesh.
_RASTER_BYTES_PER_INSTANCE = 59
# And per vertex of each view: its clip-space position (4 float32); the mesh itself holds
# 12 bytes per vertex (float32 position) and 12 per triangle (int32 corners).
_RASTER_BYTES_PER_VERTEX_VIEW = 16
_MESH_BYTES_PER_VERTEX, _MESH_BYTES_PER_FACE = 12, 12


def _views_per_raster_call(checked: Mapping[str, Any]) -> int:
    return max(min(_TRAIN_VIEWS_PER_RASTER_CALL, checked["n_train_views"]), checked["n_val_views"])


def _builtin_mesh_bytes(checked: Mapping[str, Any], device: torch.device) -> int:
    """A lower bound of the memory the builtin scene's knot takes while its views are
    rasterized: the mesh, the rasterizer's per-vertex work for the largest number of views
    drawn in one call and (torch rasterizer) its per-triangle work on one block of triangle
    instances."""
    tubular, radial = checked["tubular_segments"], checked["radial_segments"]
    vertices, faces = tubular * radial, 2 * tubular * radial
    views = _views_per_raster_call(checked)
    per_vertex = _MESH_BYTES_PER_VERTEX + views * _RASTER_BYTES_PER_VERTEX_VIEW
    needed = faces * _MESH_BYTES_PER_FACE + vertices * per_vertex
    if resolved_backend(checked["raster_backend"], device) == "torch":
        needed += min(faces * views, _MAX_TRIS_PER_BLOCK) * _RASTER_BYTES_PER_INSTANCE
    return needed


def _mesh_memory_problem(checked: Mapping[str, Any], device: torch.device) -> str | None:
    """One line naming ``scene.tubular_segments`` (or ``scene.radial_segments``, the larger)
    when the builtin scene's knot and its rasterization (:func:`_builtin_mesh_bytes`) cannot
    fit in what ``device`` has free, else None (None too for other scenes or where the free
    memory is unknown); ``checked``: the scene's config from :func:`_rendered_scene`."""
    if "tubular_segments" not in checked:
        return None
    needed = _builtin_mesh_bytes(checked, device)
    available = _short_of(needed, device)
    if available is None:
        return None
    tubular, radial = checked["tubular_segments"], checked["radial_segments"]
    key = "scene.tubular_segments" if tubular >= radial else "scene.radial_segments"
    views = _views_per_raster_call(checked)
    return (
        f"{key}: the builtin knot of {tubular} x {radial} segments ({2 * tubular * radial} "
        f"triangles), rasterized {views} views at a time, needs {needed / 2**30:.3g} GiB "
        f"for the mesh and the rasterizer's per-triangle work alone, only "
        f"{available / 2**30:.1f} GiB is free on {device} (lower scene.tubular_segments or "
        "scene.radial_segments)"
    )


# What a training iteration holds per pixel of its batch at once (mptex.train.loop.step,
# mptex.train.shading.render_batch), float32: the batch's reference RGBA (16 bytes) and
# coverage (4) gathered from the prepared views, the background (12), the composite's
# (rgb - background) x alpha (12) and the prediction (12); the texture's image, the loss's
# temporaries and the MLP's activations at the covered points come on top.
_ITERATION_BYTES_PER_PIXEL = 56


def _iteration_memory_problem(checked: Mapping[str, Any], s: Mapping[str, Any], device):
    """One line naming ``train.batch_size`` when the rendered scene's views (``checked``: its
    config from :func:`_rendered_scene`, the views as :func:`_view_memory_problem` counts
    them) and one training iteration's per-pixel buffers at ``batch_size`` x the resolution
    cannot fit together in what ``device`` has free, else None; None too where the free
    memory cannot be read."""
    size = checked["resolution"]
    views = _view_pixels(checked, s["val_spp"])
    batch = s["batch_size"] * size[0] * size[1]
    needed = views * _VIEW_BYTES_PER_PIXEL + batch * _ITERATION_BYTES_PER_PIXEL
    available = _short_of(needed, device)
    if available is None:
        return None
    return (
        f"train.batch_size: an iteration of {s['batch_size']} views of {size[0]} x {size[1]} "
        f"pixels needs {batch * _ITERATION_BYTES_PER_PIXEL / 2**30:.3g} GiB for its images "
        f"alone ({needed / 2**30:.3g} GiB with the views' buffers), only "
        f"{available / 2**30:.1f} GiB is free on {device} (lower train.batch_size or "
        "scene.resolution)"
    )


# Bytes per MLP parameter in training: the float32 weight, its gradient, Adam's two moments.
_MLP_BYTES_PER_PARAM = 16


def _mlp_params(texture: Mapping[str, Any]) -> int:
    """Parameters of the texture's MLP (an upper count: with biases)."""
    encoder = texture.get("encoder") or NVDIFFREC_ENCODER_CONFIG
    inputs = encoder.get("n_levels", 16) * encoder.get("n_features_per_level", 2)
    width, hidden, channels = texture["internal_dims"], texture["hidden"], texture["channels"]
    # Layers inputs -> width, (hidden - 1) x width -> width, width -> channels, with biases.
    return (inputs + 1) * width + (hidden - 1) * (width + 1) * width + (width + 1) * channels


def _mlp_memory_problem(texture: Mapping[str, Any], device: torch.device) -> str | None:
    """One line naming ``texture.internal_dims`` (or ``texture.hidden``, where the MLP is
    deeper than wide, or ``texture.channels``, where its output layer holds most of its
    parameters) when the texture's MLP (its weights, gradients and Adam's moments;
    activations not counted, so a lower bound) cannot fit in what ``device`` has free, else
    None (None too where the free memory is unknown)."""
    width, hidden, channels = texture["internal_dims"], texture["hidden"], texture["channels"]
    params = _mlp_params(texture)
    needed = params * _MLP_BYTES_PER_PARAM
    available = _short_of(needed, device)
    if available is None:
        return None
    if (width + 1) * channels > params / 2:  # the output layer holds most of them
        return (
            f"texture.channels: an MLP of {hidden + 1} layers {width} wide with {channels} "
            f"output channels ({params:.3g} parameters) needs {needed / 2**30:.3g} GiB for its "
            f"weights, gradients and Adam's moments alone, only {available / 2**30:.1f} GiB is "
            f"free on {device} (lower texture.channels)"
        )
    key = "texture.hidden" if hidden > width else "texture.internal_dims"
    return (
        f"{key}: an MLP of {hidden + 1} layers {width} wide ({params:.3g} "
        f"parameters) needs {needed / 2**30:.3g} GiB for its weights, gradients and Adam's "
        f"moments alone, only {available / 2**30:.1f} GiB is free on {device} (lower "
        "texture.internal_dims or texture.hidden)"
    )


def _module_bytes() -> int:
    # An empty torch module's Python objects on this interpreter (itself, its __dict__ and the
    # hook and parameter tables in it, shallow): what each layer and activation of the MLP
    # holds at least (tracemalloc counts about 4.6 kB per hidden layer, Linear and ReLU).
    module = torch.nn.Module()
    return (
        sys.getsizeof(module)
        + sys.getsizeof(vars(module))
        + sum(sys.getsizeof(value) for value in vars(module).values())
    )


_MODULE_BYTES = _module_bytes()


def mlp_activation_problem(
    texture: Mapping[str, Any],
    policy: PrecisionPolicy,
    settings: Mapping[str, Any],
    fewest_covered: int,
    device: torch.device,
) -> str | None:
    """One line naming ``texture.hidden``, ``texture.internal_dims`` or ``train.batch_size``
    (whichever is furthest above its default) when the MLP's training state and the
    activations one iteration keeps for the backward cannot fit together in what ``device``
    has free, else None (None too where it is unknown).

    A lower bound: an iteration samples the texture at ``batch_size`` x ``fewest_covered``
    points at least (the training view covering the fewest pixels), twice that with the kd
    smoothness term (its jittered copies), and each hidden layer's backward keeps its input,
    ``width`` values per point in the MLP's narrowest compute dtype (one byte for the FP8
    arms, whose GEMMs may keep FP8 copies); on the CPU each of its torch modules holds at
    least an empty module's Python objects too (in the host's memory, so not counted against
    a GPU's).
    """
    jittered = settings["kd_smooth"] and settings["kd_smooth_weight"] > 0
    points = settings["batch_size"] * fewest_covered * (2 if jittered else 1)
    width, hidden = texture["internal_dims"], texture["hidden"]
    itemsize = 1 if policy.fp8_gemm else min(dtype.itemsize for dtype in policy.mlp_dtypes)
    activations = hidden * width * points * itemsize
    # hidden + 1 linear layers, an activation after each but the last; tcnn's fused network
    # (and its torch twin) is one module
    modules = 1 if policy.mlp == "fused" else 2 * hidden + 1
    on_host = device.type == "cpu"
    objects = modules * _MODULE_BYTES if on_host else 0
    needed = _mlp_params(texture) * _MLP_BYTES_PER_PARAM + activations + objects
    available = _short_of(needed, device)
    if available is None:
        return None
    growth = {
        "texture.hidden": hidden / _TEXTURE_DEFAULTS["hidden"],
        "texture.internal_dims": width / _TEXTURE_DEFAULTS["internal_dims"],
        "train.batch_size": settings["batch_size"] / TRAIN_DEFAULTS["batch_size"],
    }
    key = max(growth, key=growth.get)
    return (
        f"{key}: an MLP of {hidden + 1} layers {width} wide keeps {activations / 2**30:.3g} GiB "
        f"of activations for the backward of an iteration ({points} points at least: "
        f"train.batch_size={settings['batch_size']} views, the fewest covered pixels of a "
        f"training view {fewest_covered}), {needed / 2**30:.3g} GiB with its training state"
        f"{f' and its {modules} modules' if on_host else ''}, "
        f"only {available / 2**30:.1f} GiB is free on {device} (lower texture.hidden, "
        "texture.internal_dims or train.batch_size)"
    )


# FP8 scaling states per layer of an FP8 MLP (mptex.mlp.FP8Linear: input, weight, gradient),
# each a float32 history of precision.fp8_amax_history_len amaxes.
_FP8_STATES_PER_LAYER = 3


def _fp8_history_problem(policy: PrecisionPolicy, hidden: int, device: torch.device):
    """One line naming ``precision.fp8_amax_history_len`` when the FP8 layers' amax histories
    cannot fit in what ``device`` has free, else None (None too where it is unknown)."""
    if not policy.fp8_gemm:
        return None
    layers = hidden + 1
    states = _FP8_STATES_PER_LAYER * layers
    needed = states * policy.fp8_amax_history_len * 4
    available = _short_of(needed, device)
    if available is None:
        return None
    return (
        f"precision.fp8_amax_history_len: {states} FP8 scaling states (input, weight and "
        f"gradient of {layers} layers) of {policy.fp8_amax_history_len} float32 amaxes each "
        f"need {needed / 2**30:.3g} GiB, only {available / 2**30:.1f} GiB is free on {device} "
        "(Transformer Engine's default: 1024)"
    )


# The scene keys that name files or folders (a mesh, a dataset).
_SCENE_PATHS = ("path", "mesh")


def absolute_scene_paths(scene: Mapping[str, Any]) -> dict[str, Any]:
    """``scene`` with its file and folder paths made absolute against the current directory
    (``~`` expanded): the run records where its files were, so that ``mptex-export``,
    ``mptex-rescore`` and a resume find them from any directory."""
    scene = dict(scene)
    for key in _SCENE_PATHS:
        # A required path left unset ("???") stays so: the scene's check names it as unset.
        if isinstance(scene.get(key), str) and scene[key] and scene[key] != REQUIRED:
            scene[key] = os.path.abspath(os.path.expanduser(scene[key]))
    return scene


def normalized_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`validate_config` would record for ``cfg``, as far as ``cfg`` allows: each
    group normalised on its own where it is valid (train's and export's defaults filled in,
    the precision arm's fields written out, ``train.device: auto`` resolved for this machine),
    left as given where it is not. Never raises. A run that fails at
    start records this, so that it compares with its sweep's other runs key by key."""
    cfg = dict(plain(cfg))
    if isinstance(cfg.get("scene"), Mapping):
        cfg["scene"] = absolute_scene_paths(cfg["scene"])
    given = cfg.get("train")
    train = dict(given) if isinstance(given, Mapping) else {}
    try:
        train = check_group(TrainConfig, train, "train")
    except ValueError:  # a bad value: the others' defaults, that value as given
        train = {**TRAIN_DEFAULTS, **train}
    if train.get("device") == "auto":
        train["device"] = auto_device()
    cfg["train"] = train
    for group, normalise in (
        ("precision", lambda g: PrecisionPolicy.from_config(g).to_config()),
        ("export", check_export_config),
    ):
        try:
            cfg[group] = normalise(cfg.get(group))
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
    return cfg


def validate_config(cfg: Mapping[str, Any], *, machine: bool = True) -> dict[str, Any]:
    """Check the whole run config before any work; returns it as plain dicts.

    Args:
        cfg: mapping (or Hydra ``DictConfig``) with groups ``scene``, ``precision``,
            ``texture``, ``train`` and optionally ``export``; missing ``train`` keys take
            :class:`TrainConfig`'s defaults, missing ``export`` keys
            :class:`~mptex.export_config.ExportConfig`'s.
        machine: also check what the run needs from this machine (the device, the optional
            backends, the views' memory). False checks the config alone, as a sweep's
            launcher does before jobs that may run on other machines (a cluster's GPU nodes);
            ``train.device`` is then read as given (``auto``: the CPU).

    Raises:
        ValueError: ``"<key>: <message>"`` naming the first bad key, e.g. ``train.iterations``,
            ``precision.name`` (unknown arm, or an arm this machine cannot run, such as
            ``tcnn_fused`` without tinycudann), ``scene.path`` (missing file, raised later by
            ``build_scene``).
    """
    cfg = dict(plain(cfg))
    for group in ("scene", "precision", "texture"):
        if not isinstance(cfg.get(group), Mapping):
            raise ValueError(f"{group}: missing config group")
    cfg["scene"] = absolute_scene_paths(cfg["scene"])
    for group in ("scene", "precision", "texture"):
        for key in cfg[group]:
            if not isinstance(key, str):
                raise ValueError(f"{group}.{key}: expected a string key")
    s = check_group(TrainConfig, cfg.get("train"), "train")
    device = str(s["device"])
    if device == "auto":
        device = auto_device() if machine else "cpu"
    dev = torch_device(device)
    problem = cuda_device_problem(dev, repr(device)) if dev.type == "cuda" else None
    if problem is not None and machine:
        raise ValueError(f"train.device: {problem}")
    s["device"] = device

    try:
        policy = PrecisionPolicy.from_config(cfg["precision"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"precision.{exc}") from None
    ok, why = policy.availability()
    if not ok and machine:
        raise ValueError(why)  # it names the key, precision.mlp_backend
    texture = check_texture_config(cfg["texture"])
    channels = texture["channels"]
    if channels < 3:
        raise ValueError(f"texture.channels: expected an integer >= 3, got {channels!r}")
    if len(policy.mlp_dtypes) != 1:  # one dtype is broadcast to any depth
        try:
            policy.layer_dtypes(texture["hidden"] + 1)
        except ValueError as exc:
            raise ValueError(f"precision.{exc} (texture.hidden + 1)") from None
    if s["val_spp"] > 1 and cfg["scene"].get("name") == "nerf":
        raise ValueError(
            "train.val_spp: scene=nerf's validation references are images at their own "
            f"resolution (no sub-pixel samples to render); expected 1, got {s['val_spp']}"
        )
    if s["shading"] == "diffuse" and channels < 9:
        raise ValueError("train.shading: 'diffuse' needs texture.channels=9 (kd, ks, normal)")
    export = check_export_config(cfg.get("export"))
    if not machine:
        return {**cfg, "train": s, "precision": policy.to_config(), "export": export}
    backend = texture["backend"]
    why = unavailable_message(backend, "texture.backend") if backend in ("tcnn", "triton") else None
    if why is not None:
        raise ValueError(why)
    if backend == "tcnn" and dev.type != "cuda":
        raise ValueError(
            f"texture.backend='tcnn' needs train.device=cuda, got {dev.type}; "
            "texture.backend='torch' runs on any device"
        )
    if backend == "triton":
        # Triton compiles for GPUs; on a CPU only its (slow) interpreter runs the kernels.
        if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "texture.backend: 'triton' on train.device=cpu runs only under Triton's "
                "interpreter: set TRITON_INTERPRET=1 (slow; for testing) or use a GPU"
            )
    if policy.fp8_gemm and texture["fp8_gemm"] != "auto":
        rowwise = policy.fp8_recipe == "rowwise"
        try:
            resolve_gemm_backend(texture["fp8_gemm"], dev, rowwise=rowwise)
        except ValueError as exc:
            raise ValueError(f"texture.fp8_gemm: {str(exc).removeprefix('backend: ')}") from None
    if policy.mlp_backend == "tcnn" and dev.type != "cuda":
        raise ValueError(
            f"precision.mlp_backend='tcnn' needs train.device=cuda, got {dev.type}; the arm "
            f"{policy.name} runs on the CPU with mlp_backend='torch'"
        )
    problem = (
        _mlp_memory_problem(texture, dev)
        or _fp8_history_problem(policy, texture["hidden"], dev)
        or _scene_memory_problem(cfg["scene"], s, dev)
    )
    if problem is not None:
        raise ValueError(problem)
    # The export group is optional (configs written before it existed); its keys are checked
    # above, what the export needs from the machine by the loop once the scene is built.
    return {**cfg, "train": s, "precision": policy.to_config(), "export": export}
