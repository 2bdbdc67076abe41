"""The run config: defaults of the ``train`` group and the checks made before any work."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from mptex._backends import unavailable_message
from mptex.bake.export import check_export_config
from mptex.encoding import BACKENDS as ENCODER_BACKENDS
from mptex.precision import PrecisionPolicy
from mptex.train.losses import LOSSES, LR_SCHEDULES
from mptex.train.shading import _BACKGROUNDS, _SHADINGS
from mptex.train.signals import STOP_SIGNAL_NAMES, check_signal_names

# Every key of the ``train`` config group and its default (configs/train/default.yaml mirrors
# this table; unknown keys are rejected so that typos fail at start).
TRAIN_DEFAULTS: dict[str, Any] = dict(
    iterations=200,
    batch_size=2,
    lr=0.01,
    mlp_lr_scale=1.0,
    mlp_lr_ramp_to=None,
    mlp_lr_ramp_iter=100,
    betas=[0.9, 0.999],
    adam_eps=1e-8,
    warmup_iter=0,
    lr_decay=0.0002,
    lr_schedule="exponential",
    loss="logl1",
    kd_smooth=True,
    kd_smooth_weight=0.03,
    kd_smooth_ramp=500,
    kd_jitter_std=0.01,
    shading="kd",
    light_dir=[0.5, 0.8, 0.3],
    ambient=0.25,
    background="random",
    val_background="white",
    val_spp=1,
    val_interval=50,
    history_interval=1,
    stats_interval=10,
    threads=None,
    checkpoint_interval=100,
    n_val_images=4,
    seed=0,
    init_seed=None,
    device="auto",
    resume="auto",
    tensorboard=False,
    progress="auto",
    max_consecutive_skips=200,
    inject_nonfinite_at=None,
    stop_signals=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
    inject_signal_at=None,
    inject_signal="SIGTERM",
)


# ----------------------------------------------------------------------------- config
class ConfigError(ValueError):
    """A bad config value found before training: ``"<key>: <message>"``."""


def _plain(cfg: Any) -> Any:
    try:
        from omegaconf import OmegaConf
        from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return cfg
    if not OmegaConf.is_config(cfg):
        return cfg
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except InterpolationResolutionError as exc:
        # A resolver's own error (the real-asset suite's path: pybullet_data not installed) is
        # the config error: one line naming the key, not OmegaConf's multi-line report.
        cause = exc.__context__  # OmegaConf re-raises inside its handlers: walk the chain
        while isinstance(cause, OmegaConfBaseException):
            cause = cause.__context__
        if not isinstance(cause, ValueError):
            raise
        raise ConfigError(f"{exc.full_key}: {cause}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool: YAML's ``true`` is no learning rate)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The texture group: MLPTexture3D's arguments (configs/texture/*.yaml) and, under ``encoder``,
# tcnn's grid keys (HashGridEncoding.from_tcnn_config). Types are checked here; ranges by the
# constructors themselves, whose errors name the argument (mapped to the key by
# :func:`config_key`).
TEXTURE_KEYS = ("channels", "internal_dims", "hidden", "min_max", "backend", "encoder")
ENCODER_KEYS = {
    "otype": str, "type": str, "n_levels": int, "n_features_per_level": int,
    "log2_hashmap_size": int, "base_resolution": int, "per_level_scale": float,
    "interpolation": str,
}  # fmt: skip

# Constructor argument -> config key, for errors raised while building the run's objects.
_ARGUMENT_KEYS = {
    **{name: f"texture.encoder.{name}" for name in ENCODER_KEYS},
    "config": "texture.encoder",
    "grid_type": "texture.encoder.type",
    "channels": "texture.channels",
    "internal_dims": "texture.internal_dims",
    "n_neurons": "texture.internal_dims",
    "hidden": "texture.hidden",
    "n_hidden_layers": "texture.hidden",
    "min_max": "texture.min_max",
    "backend": "texture.backend",
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


def check_texture_config(texture: Mapping[str, Any]) -> None:
    """Check a texture group's keys and types (``ValueError`` ``"texture.<key>: ..."``); the
    constructors check the ranges."""
    unknown = sorted(set(texture) - set(TEXTURE_KEYS))
    if unknown:
        raise ValueError(f"texture.{unknown[0]}: unknown key; valid keys: {list(TEXTURE_KEYS)}")
    for key in ("channels", "internal_dims", "hidden"):
        if key in texture and not (_is_int(texture[key]) and texture[key] >= 1):
            raise ValueError(f"texture.{key}: expected an integer >= 1, got {texture[key]!r}")
    if texture.get("backend", "auto") not in ENCODER_BACKENDS:
        raise ValueError(
            f"texture.backend: expected one of {list(ENCODER_BACKENDS)}, got {texture['backend']!r}"
        )
    encoder = texture.get("encoder")
    if encoder is None:
        return
    if not isinstance(encoder, Mapping):
        raise ValueError(f"texture.encoder: expected a mapping of grid keys, got {encoder!r}")
    unknown = sorted(set(encoder) - set(ENCODER_KEYS))
    if unknown:
        raise ValueError(
            f"texture.encoder.{unknown[0]}: unknown key; valid keys: {list(ENCODER_KEYS)}"
        )
    for key, kind in ENCODER_KEYS.items():
        if key not in encoder:
            continue
        value = encoder[key]
        ok = {int: _is_int, float: _is_number, str: lambda v: isinstance(v, str)}[kind](value)
        if not ok:
            what = {int: "an integer", float: "a finite number", str: "a string"}[kind]
            raise ValueError(f"texture.encoder.{key}: expected {what}, got {value!r}")


def validate_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check the whole run config before any work; returns it as plain dicts.

    Args:
        cfg: mapping (or Hydra ``DictConfig``) with groups ``scene``, ``precision``,
            ``texture``, ``train`` and optionally ``export``; missing ``train`` keys take
            :data:`TRAIN_DEFAULTS`, missing ``export`` keys ``mptex.bake.EXPORT_DEFAULTS``.

    Raises:
        ValueError: ``"<key>: <message>"`` naming the first bad key, e.g. ``train.iterations``,
            ``precision.name`` (unknown arm, or an arm this machine cannot run, such as
            ``tcnn_fused`` without tinycudann), ``scene.path`` (missing file, raised later by
            ``build_scene``).
    """
    cfg = dict(_plain(cfg))
    for group in ("scene", "precision", "texture"):
        if not isinstance(cfg.get(group), Mapping):
            raise ValueError(f"{group}: missing config group")
    for group in ("scene", "precision", "texture"):
        for key in cfg[group]:
            if not isinstance(key, str):
                raise ValueError(f"{group}.{key}: expected a string key")
    train_cfg = dict(cfg.get("train") or {})
    unknown = sorted(set(train_cfg) - set(TRAIN_DEFAULTS))
    if unknown:
        raise ValueError(f"train.{unknown[0]}: unknown key; valid keys: {sorted(TRAIN_DEFAULTS)}")
    s = {**TRAIN_DEFAULTS, **train_cfg}

    def need(key, ok, what):
        if not ok:
            raise ValueError(f"train.{key}: expected {what}, got {s[key]!r}")

    need("iterations", _is_int(s["iterations"]) and s["iterations"] >= 0, "an integer >= 0")
    need("batch_size", _is_int(s["batch_size"]) and s["batch_size"] >= 1, "an integer >= 1")
    for key in ("val_interval", "history_interval", "checkpoint_interval"):
        need(key, _is_int(s[key]) and s[key] >= 0, "an integer >= 0 (0: only at the end)")
    need("threads", s["threads"] is None or (_is_int(s["threads"]) and s["threads"] >= 1),
         "null (torch's default) or an integer >= 1")  # fmt: skip
    need("stats_interval", _is_int(s["stats_interval"]) and s["stats_interval"] >= 0,
         "an integer >= 0 (0: no precision statistics)")  # fmt: skip
    need("warmup_iter", _is_int(s["warmup_iter"]) and s["warmup_iter"] >= 0, "an integer >= 0")
    need("n_val_images", _is_int(s["n_val_images"]) and s["n_val_images"] >= 0, "an integer >= 0")
    need("val_spp", _is_int(s["val_spp"]) and 1 <= s["val_spp"] <= 16,
         "an integer in [1, 16] (validation samples per pixel along each axis)")  # fmt: skip
    need("max_consecutive_skips", _is_int(s["max_consecutive_skips"])
         and s["max_consecutive_skips"] >= 1, "an integer >= 1")  # fmt: skip
    need("lr", _is_number(s["lr"]) and s["lr"] > 0, "a finite number > 0")
    need("mlp_lr_scale", _is_number(s["mlp_lr_scale"]) and s["mlp_lr_scale"] > 0,
         "a finite number > 0 (the MLP's learning rate over the grid's)")  # fmt: skip
    need("mlp_lr_ramp_to", s["mlp_lr_ramp_to"] is None
         or (_is_number(s["mlp_lr_ramp_to"]) and s["mlp_lr_ramp_to"] > 0),
         "null (the MLP keeps mlp_lr_scale) or a finite number > 0")  # fmt: skip
    need("mlp_lr_ramp_iter", _is_int(s["mlp_lr_ramp_iter"]) and s["mlp_lr_ramp_iter"] >= 1,
         "an integer >= 1 (iterations of the MLP rate's ramp)")  # fmt: skip
    need("lr_decay", _is_number(s["lr_decay"]) and s["lr_decay"] >= 0, "a finite number >= 0")
    need("betas", isinstance(s["betas"], (list, tuple)) and len(s["betas"]) == 2
         and all(_is_number(b) and 0 <= b < 1 for b in s["betas"]),
         "two numbers in [0, 1)")  # fmt: skip
    need("adam_eps", _is_number(s["adam_eps"]) and s["adam_eps"] > 0, "a finite number > 0")
    need("lr_schedule", s["lr_schedule"] in LR_SCHEDULES, f"one of {LR_SCHEDULES}")
    need("loss", s["loss"] in LOSSES, f"one of {sorted(LOSSES)}")
    need("shading", s["shading"] in _SHADINGS, f"one of {_SHADINGS}")
    need("background", s["background"] in _BACKGROUNDS, f"one of {_BACKGROUNDS}")
    need("val_background", s["val_background"] in _BACKGROUNDS[1:], "'white' or 'black'")
    need("ambient", _is_number(s["ambient"]) and 0 <= s["ambient"] <= 1, "a number in [0, 1]")
    need("light_dir", isinstance(s["light_dir"], (list, tuple)) and len(s["light_dir"]) == 3
         and all(_is_number(v) for v in s["light_dir"])
         and any(v != 0 for v in s["light_dir"]), "a non-zero [x, y, z] of numbers")  # fmt: skip
    for key in ("kd_smooth_weight", "kd_jitter_std", "kd_smooth_ramp"):
        need(key, _is_number(s[key]) and s[key] >= 0, "a finite number >= 0")
    for key in ("kd_smooth", "tensorboard"):
        need(key, isinstance(s[key], bool), "true or false")
    need("progress", s["progress"] == "auto" or isinstance(s["progress"], bool),
         "auto, true or false")  # fmt: skip
    # The loop seeds numpy with seed % 2**32 and a torch generator with seed + 1 (< 2**64).
    def is_seed(value: Any) -> bool:
        return _is_int(value) and 0 <= value < 2**63 - 1

    need("seed", is_seed(s["seed"]), "an integer in [0, 2**63 - 1)")
    need("init_seed", s["init_seed"] is None or is_seed(s["init_seed"]),
         "null (train.seed) or an integer in [0, 2**63 - 1)")  # fmt: skip
    need("resume", isinstance(s["resume"], bool) or (isinstance(s["resume"], str)
         and s["resume"] != ""), "auto, true, false or a checkpoint path")  # fmt: skip
    need("device", isinstance(s["device"], str), "auto, cpu, cuda or cuda:N")
    need("inject_nonfinite_at", s["inject_nonfinite_at"] is None
         or _is_int(s["inject_nonfinite_at"]), "null or an iteration")  # fmt: skip
    s["stop_signals"] = check_signal_names(s["stop_signals"], "train.stop_signals")
    need("inject_signal_at", s["inject_signal_at"] is None or _is_int(s["inject_signal_at"]),
         "null or an iteration")  # fmt: skip
    need("inject_signal", s["inject_signal"] in STOP_SIGNAL_NAMES,
         f"a signal name from {list(STOP_SIGNAL_NAMES)}")  # fmt: skip
    device = str(s["device"])
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"train.device: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device: {device!r} requested but CUDA is not available")
    s["device"] = device

    try:
        policy = PrecisionPolicy.from_config(cfg["precision"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"precision.{exc}") from None
    ok, why = policy.availability()
    if not ok:
        raise ValueError(why)  # it names the key, precision.mlp_backend
    texture = dict(cfg["texture"])
    check_texture_config(texture)
    channels = texture.get("channels", 3)
    if channels < 3:
        raise ValueError(f"texture.channels: expected an integer >= 3, got {channels!r}")
    try:
        policy.layer_dtypes(texture.get("hidden", 2) + 1)
    except ValueError as exc:
        raise ValueError(f"precision.{exc} (texture.hidden + 1)") from None
    if s["val_spp"] > 1 and cfg["scene"].get("name") == "nerf":
        raise ValueError(
            "train.val_spp: scene=nerf's validation references are images at their own "
            f"resolution (no sub-pixel samples to render); expected 1, got {s['val_spp']}"
        )
    if s["shading"] == "diffuse" and channels < 9:
        raise ValueError("train.shading: 'diffuse' needs texture.channels=9 (kd, ks, normal)")
    backend = texture.get("backend", "auto")
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
    if policy.mlp_backend == "tcnn" and dev.type != "cuda":
        raise ValueError(
            f"precision.mlp_backend='tcnn' needs train.device=cuda, got {dev.type}; the arm "
            f"{policy.name} runs on the CPU with mlp_backend='torch'"
        )
    # The export group is optional (configs written before it existed); its keys are checked
    # here, what the export needs from the machine by the loop once the scene is built.
    export = check_export_config(cfg.get("export"))
    return {**cfg, "train": s, "precision": policy.to_config(), "export": export}
