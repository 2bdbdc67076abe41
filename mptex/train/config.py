"""The run config: defaults of the ``train`` group and the checks made before any work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mptex._backends import has_tcnn
from mptex.precision import PrecisionPolicy
from mptex.train.losses import LOSSES, LR_SCHEDULES
from mptex.train.shading import _BACKGROUNDS, _SHADINGS

# Every key of the ``train`` config group and its default (configs/train/default.yaml mirrors
# this table; unknown keys are rejected so that typos fail at start).
TRAIN_DEFAULTS: dict[str, Any] = dict(
    iterations=200,
    batch_size=2,
    lr=0.01,
    betas=[0.9, 0.999],
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
    val_interval=50,
    history_interval=1,
    stats_interval=10,
    threads=None,
    checkpoint_interval=100,
    n_val_images=4,
    seed=0,
    device="auto",
    resume=False,
    tensorboard=False,
    progress="auto",
    max_consecutive_skips=200,
    inject_nonfinite_at=None,
)


# ----------------------------------------------------------------------------- config
class ConfigError(ValueError):
    """A bad config value found before training: ``"<key>: <message>"``."""


def _plain(cfg: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return cfg


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check the whole run config before any work; returns it as plain dicts.

    Args:
        cfg: mapping (or Hydra ``DictConfig``) with groups ``scene``, ``precision``,
            ``texture``, ``train``; missing ``train`` keys take :data:`TRAIN_DEFAULTS`.

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
    need("max_consecutive_skips", _is_int(s["max_consecutive_skips"])
         and s["max_consecutive_skips"] >= 1, "an integer >= 1")  # fmt: skip
    need("lr", isinstance(s["lr"], (int, float)) and s["lr"] > 0, "a positive number")
    need(
        "lr_decay", isinstance(s["lr_decay"], (int, float)) and s["lr_decay"] >= 0, "a number >= 0"
    )
    need("betas", isinstance(s["betas"], (list, tuple)) and len(s["betas"]) == 2
         and all(0 <= float(b) < 1 for b in s["betas"]), "two numbers in [0, 1)")  # fmt: skip
    need("lr_schedule", s["lr_schedule"] in LR_SCHEDULES, f"one of {LR_SCHEDULES}")
    need("loss", s["loss"] in LOSSES, f"one of {sorted(LOSSES)}")
    need("shading", s["shading"] in _SHADINGS, f"one of {_SHADINGS}")
    need("background", s["background"] in _BACKGROUNDS, f"one of {_BACKGROUNDS}")
    need("val_background", s["val_background"] in _BACKGROUNDS[1:], "'white' or 'black'")
    need("ambient", isinstance(s["ambient"], (int, float)) and 0 <= s["ambient"] <= 1, "in [0, 1]")
    need("light_dir", isinstance(s["light_dir"], (list, tuple)) and len(s["light_dir"]) == 3
         and any(float(v) != 0 for v in s["light_dir"]), "a non-zero [x, y, z]")  # fmt: skip
    for key in ("kd_smooth_weight", "kd_jitter_std", "kd_smooth_ramp"):
        need(key, isinstance(s[key], (int, float)) and s[key] >= 0, "a number >= 0")
    need("progress", s["progress"] in ("auto", True, False), "auto, true or false")
    need("seed", _is_int(s["seed"]), "an integer")
    need("resume", isinstance(s["resume"], (bool, str)), "true, false or a checkpoint path")
    need("inject_nonfinite_at", s["inject_nonfinite_at"] is None
         or _is_int(s["inject_nonfinite_at"]), "null or an iteration")  # fmt: skip
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
    except ValueError as exc:
        raise ValueError(f"precision.{exc}") from None
    ok, why = policy.availability()
    if not ok:
        raise ValueError(f"precision.name: {why}")
    texture = dict(cfg["texture"])
    channels = texture.get("channels", 3)
    if not _is_int(channels) or channels < 3:
        raise ValueError(f"texture.channels: expected an integer >= 3, got {channels!r}")
    if s["shading"] == "diffuse" and channels < 9:
        raise ValueError("train.shading: 'diffuse' needs texture.channels=9 (kd, ks, normal)")
    if texture.get("backend", "auto") == "tcnn" and not has_tcnn():
        raise ValueError("texture.backend: 'tcnn' needs tinycudann and a CUDA device")
    if policy.mlp_backend == "tcnn" and dev.type != "cuda":
        raise ValueError(f"precision.name: {policy.name!r} needs train.device=cuda")
    return {**cfg, "train": s, "precision": policy.to_config()}
