"""The nvdiffrec-style texture training loop: losses, schedule, validation, checkpoints, metrics.

One iteration (nvdiffrec's ``optimize_mesh`` with a fixed mesh and only the texture trained):

1. draw ``batch_size`` training views (their G-buffers come from the scene's cache);
2. sample the :class:`~mptex.MLPTexture3D` at the covered surface points only
   (``view.position[view.mask]``);
3. shade: ``kd`` (the first three channels, albedo) or ``diffuse`` (see :func:`shade`);
4. composite prediction and reference over the background (per-pixel random, white or black);
5. loss = color loss (``logl1`` by default) on RGB masked by the reference alpha + alpha MSE
   + the kd smoothness regulariser (``0.03 * min(1, it / 500) * mean(|kd(p + N(0, 0.01)) -
   kd(p)| / 3)`` over covered pixels, as nvdiffrec's ``kd_grad``);
6. :class:`~mptex.PrecisionStepper` does backward, unscale, overflow check, step or skip;
7. learning rate ``lr * lr_schedule(it)``: ``it / warmup_iter`` during warm-up, then
   ``10 ** (-lr_decay * (it - warmup_iter))`` (nvdiffrec: ``lr_decay = 0.0002``).

Validation is nvdiffrec's: render the validation views, convert to sRGB, clamp to [0, 1],
PSNR per image ``-10 log10(MSE)``, mean over the images.

Results go to a run directory: ``metrics.json`` (the contract with ``mptex-report``; keys in
:data:`METRICS_KEYS`), ``images/`` (reference | prediction PNGs), ``checkpoint.pt`` (written
atomically; :func:`load_texture` rebuilds the texture from it).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mptex._backends import has_nvdiffrast, has_tcnn
from mptex.diagnostics import PrecisionMonitor
from mptex.precision import PrecisionPolicy, PrecisionStepper
from mptex.render.image import rgb_to_srgb, save_image
from mptex.scenes import Scene, build_scene
from mptex.texture import MLPTexture3D

__all__ = [
    "ConfigError",
    "TRAIN_DEFAULTS",
    "METRICS_KEYS",
    "LOSSES",
    "lr_schedule",
    "image_loss",
    "shade",
    "composite",
    "psnr",
    "evaluate",
    "atomic_write_bytes",
    "save_checkpoint",
    "load_checkpoint",
    "load_texture",
    "validate_config",
    "train",
]

# Every key of the ``train`` config group and its default (configs/train/default.yaml mirrors
# this table; unknown keys are rejected so that typos fail at start).
TRAIN_DEFAULTS: dict[str, Any] = dict(
    iterations=200,
    batch_size=2,
    lr=0.01,
    betas=[0.9, 0.999],
    warmup_iter=0,
    lr_decay=0.0002,
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

METRICS_KEYS = (
    "status", "psnr", "baseline_psnr", "psnr_per_image", "precision", "scene", "seed",
    "iterations", "iterations_planned", "final_loss", "time_per_iter_s", "wall_time_s",
    "train_time_s", "peak_memory_bytes", "peak_memory_kind", "skipped_steps", "final_loss_scale",
    "diverged_at", "error", "failed_at", "resumed_from", "n_params", "device", "device_name",
    "torch_threads", "versions", "run_dir", "history", "config",
)  # fmt: skip

_BACKGROUNDS = ("random", "white", "black")
_SHADINGS = ("kd", "diffuse")
_CHECKPOINT = "checkpoint.pt"
_METRICS = "metrics.json"


# ----------------------------------------------------------------------------- schedule, losses
def lr_schedule(iteration: int, warmup_iter: int = 0, lr_decay: float = 0.0002) -> float:
    """nvdiffrec's learning-rate factor for 0-based ``iteration``.

    ``iteration / warmup_iter`` while ``iteration < warmup_iter``, then
    ``10 ** (-lr_decay * (iteration - warmup_iter))`` (nvdiffrec's ``lr_schedule`` with its
    0.0002, i.e. the rate falls 10x every 5000 iterations).
    """
    if iteration < warmup_iter:
        return iteration / warmup_iter
    return max(0.0, 10.0 ** (-(iteration - warmup_iter) * lr_decay))


def _tonemap_srgb(f: torch.Tensor) -> torch.Tensor:
    # nvdiffrec's loss.py _tonemap_srgb (the sRGB curve without the clamp to [0, 1]).
    return torch.where(
        f > 0.0031308,
        torch.pow(torch.clamp(f, min=0.0031308), 1.0 / 2.4) * 1.055 - 0.055,
        12.92 * f,
    )


def _log_srgb(f: torch.Tensor) -> torch.Tensor:
    return _tonemap_srgb(torch.log(torch.clamp(f, min=0, max=65535) + 1))


def _l1(img, target):
    return torch.nn.functional.l1_loss(img, target)


def _mse(img, target):
    return torch.nn.functional.mse_loss(img, target)


def _smape(img, target, eps: float = 0.01):
    return torch.mean(torch.abs(img - target) / (torch.abs(img) + torch.abs(target) + eps))


def _relmse(img, target, eps: float = 0.1):
    return torch.mean((img - target) ** 2 / (img * img + target * target + eps))


# name -> (tonemapper or None, error); nvdiffrec's render/loss.py get_loss_fn.
LOSSES: dict[str, tuple[Callable | None, Callable]] = {
    "logl1": (_log_srgb, _l1),
    "logl2": (_log_srgb, _mse),
    "l1": (None, _l1),
    "mse": (None, _mse),
    "relmse": (None, _relmse),
    "smape": (None, _smape),
}


def image_loss(img: torch.Tensor, target: torch.Tensor, loss: str = "logl1") -> torch.Tensor:
    """nvdiffrec's image loss ``loss`` (a key of :data:`LOSSES`) between linear RGB images.

    Args:
        img, target: ``[..., 3]`` float32 linear RGB of the same shape.

    Returns:
        scalar float32, the mean over all elements.
    """
    if loss not in LOSSES:
        raise ValueError(f"train.loss: expected one of {sorted(LOSSES)}, got {loss!r}")
    tonemap, error = LOSSES[loss]
    if tonemap is not None:
        img, target = tonemap(img), tonemap(target)
    return error(img, target)


# ----------------------------------------------------------------------------- shading, PSNR
def shade(
    tex: torch.Tensor,
    normal: torch.Tensor,
    shading: str = "kd",
    light_dir: torch.Tensor | None = None,
    ambient: float = 0.25,
) -> torch.Tensor:
    """Colour of surface points from their texture values.

    ``"kd"``: the albedo, ``tex[..., 0:3]`` (nvdiffrec's ``kd`` buffer).
    ``"diffuse"`` (``channels=9``: kd, ks, normal as nvdiffrec's ``kd_ks_normal``)::

        n     = normalize(normal + 2 * tex[..., 6:9] - 1)   # the texture perturbs the normal
        color = kd * (ambient + (1 - ambient) * max(0, dot(n, light_dir)))

    The normal channels are a world-space offset (a sigmoid output of 0.5 leaves the
    geometric normal unchanged) because the G-buffer has no tangent frame for nvdiffrec's
    tangent-space normals; ``ks`` (channels 3:6) is not used: no specular term.

    Args:
        tex: ``[N, C]`` float32 texture values (C >= 3; 9 for ``"diffuse"``).
        normal: ``[N, 3]`` float32 unit geometric normals.
        shading: ``"kd"`` or ``"diffuse"``.
        light_dir: ``[3]`` unit direction towards the light (``"diffuse"`` only).
        ambient: ambient fraction in [0, 1] (``"diffuse"`` only).

    Returns:
        ``[N, 3]`` float32 linear RGB.
    """
    kd = tex[..., 0:3]
    if shading == "kd":
        return kd
    if shading != "diffuse":
        raise ValueError(f"train.shading: expected one of {_SHADINGS}, got {shading!r}")
    if tex.shape[-1] < 9:
        raise ValueError("train.shading: 'diffuse' needs texture.channels=9 (kd, ks, normal)")
    n = torch.nn.functional.normalize(normal + 2.0 * tex[..., 6:9] - 1.0, dim=-1)
    cos = torch.clamp((n * light_dir).sum(-1, keepdim=True), min=0.0)
    return kd * (ambient + (1.0 - ambient) * cos)


def composite(rgb: torch.Tensor, alpha: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """``lerp(background, rgb, alpha)``: ``[B, H, W, 3]`` over ``[B, H, W, 3]`` by ``[B, H, W, 1]``
    (nvdiffrec's ``prepare_batch``)."""
    return background + (rgb - background) * alpha


def psnr(img: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB as nvdiffrec's ``validate_itr``.

    Both images are linear RGB; each is converted to sRGB and clamped to [0, 1], then
    ``-10 log10(MSE)`` per image. The MSE is floored at 1e-10 (PSNR <= 100 dB) so that a
    perfect match stays a finite JSON number.

    Args:
        img, ref: ``[B, H, W, 3]`` float32 linear RGB.

    Returns:
        ``[B]`` float32.
    """
    a = torch.clamp(rgb_to_srgb(img), 0.0, 1.0)
    b = torch.clamp(rgb_to_srgb(ref), 0.0, 1.0)
    mse = ((a - b) ** 2).flatten(1).mean(1)
    return -10.0 * torch.log10(torch.clamp(mse, min=1e-10))


def _background(kind: str, shape, device, generator: torch.Generator | None) -> torch.Tensor:
    if kind == "white":
        return torch.ones(shape, device=device)
    if kind == "black":
        return torch.zeros(shape, device=device)
    # nvdiffrec's 'random': independent uniform noise per pixel and channel.
    return torch.rand(shape, device=device, generator=generator)


def _render(
    texture: MLPTexture3D,
    views,
    settings: Mapping[str, Any],
    background: torch.Tensor,
    light_dir: torch.Tensor,
    jitter: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shaded prediction ``[B, H, W, 3]`` composited over ``background`` and the kd smoothness
    term (mean over all pixels of the covered points' kd gradient; None without ``jitter``)."""
    mask = views.mask
    points = views.position[mask]  # [N, 3]: only covered pixels reach the texture
    tex = texture.sample(points)
    color = shade(tex, views.gbuffer.normal[mask], settings["shading"], light_dir,
                  settings["ambient"])  # fmt: skip
    image = torch.zeros(mask.shape + (3,), device=points.device, dtype=color.dtype)
    image = image.index_put((mask,), color)
    pred = composite(image, mask.unsqueeze(-1).to(image.dtype), background)
    kd_grad = None
    if jitter is not None:
        tex_jitter = texture.sample(jitter(points))
        per_point = torch.sum(torch.abs(tex_jitter[..., 0:3] - tex[..., 0:3]), dim=-1) / 3
        # nvdiffrec: mean over every pixel of kd_grad * alpha (zero on background).
        kd_grad = per_point.sum() / mask.numel()
    return pred, kd_grad


# ----------------------------------------------------------------------------- validation
@torch.no_grad()
def evaluate(
    texture: MLPTexture3D, scene: Scene, settings: Mapping[str, Any], light_dir: torch.Tensor
) -> dict[str, Any]:
    """Validation as nvdiffrec reports it, plus the constant-colour baseline.

    Returns:
        dict with ``psnr`` (mean over views), ``psnr_per_image`` (list), ``baseline_psnr`` (the
        best constant colour: the mean reference colour over covered pixels, rendered and
        scored the same way), and ``pred``/``ref`` ``[B, H, W, 3]`` composited linear images.
    """
    views = scene.val_views()
    shape = views.mask.shape + (3,)
    background = _background(settings["val_background"], shape, views.rgba.device, None)
    ref = composite(views.rgba[..., 0:3], views.rgba[..., 3:4], background)
    pred, _ = _render(texture, views, settings, background, light_dir)
    per_image = psnr(pred, ref)
    alpha = views.rgba[..., 3:4]
    mean_color = (views.rgba[..., 0:3] * alpha).sum((0, 1, 2)) / alpha.sum().clamp(min=1e-8)
    constant = composite(mean_color.expand(shape), views.mask.unsqueeze(-1).float(), background)
    return dict(
        psnr=float(per_image.mean().item()),
        psnr_per_image=[float(v) for v in per_image.cpu()],
        baseline_psnr=float(psnr(constant, ref).mean().item()),
        pred=pred,
        ref=ref,
    )


def _save_val_images(out_dir: Path, evaluation: dict, n_images: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ref, pred = evaluation["ref"].cpu(), evaluation["pred"].cpu()
    for i in range(min(n_images, ref.shape[0])):
        # Rows are stored bottom-up (nvdiffrast's convention); flip for a viewer.
        side = torch.cat([ref[i], pred[i]], dim=1).flip(0)
        save_image(out_dir / f"val_{i:03d}.png", side, to_srgb=True)


# ----------------------------------------------------------------------------- files
def atomic_write_bytes(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Write a file so that a crash or kill at any moment leaves either the old or the new file.

    ``write(fileobj)`` fills a temporary file in the same directory; it is flushed, fsync'ed and
    moved over ``path`` with ``os.replace`` (atomic on POSIX and Windows), then the directory is
    fsync'ed so the rename itself survives a power loss. On any error the temporary is removed.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_oserror():
            os.unlink(tmp)
        raise
    with _suppress_oserror():  # not every platform can fsync a directory
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class _suppress_oserror:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, OSError)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no inf/NaN; a diverged loss is recorded as null
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_metrics(run_dir: str | os.PathLike, metrics: Mapping[str, Any]) -> Path:
    """Write ``metrics.json`` atomically (non-finite floats become null); returns its path."""
    path = Path(run_dir) / _METRICS
    text = json.dumps(_json_safe(dict(metrics)), indent=2, allow_nan=False) + "\n"
    atomic_write_bytes(path, lambda f: f.write(text.encode()))
    return path


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """``torch.save(state)`` to ``path`` atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, lambda f: torch.save(dict(state), f))


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`train` (a plain dict; see :func:`train`)."""
    # weights_only=False: the checkpoint holds RNG states and Python lists written by us.
    return torch.load(path, map_location=map_location, weights_only=False)


def _build_texture(aabb, texture_cfg: Mapping[str, Any], precision: Any) -> MLPTexture3D:
    cfg = dict(texture_cfg)
    return MLPTexture3D(
        aabb,
        channels=int(cfg.get("channels", 3)),
        internal_dims=int(cfg.get("internal_dims", 32)),
        hidden=int(cfg.get("hidden", 2)),
        min_max=cfg.get("min_max"),
        precision=precision,
        encoder=cfg.get("encoder"),
        backend=cfg.get("backend", "auto"),
    )


def load_texture(path: str | os.PathLike, device: str | torch.device = "cpu") -> MLPTexture3D:
    """The trained :class:`~mptex.MLPTexture3D` from a ``checkpoint.pt`` written by ``train``.

    The texture is rebuilt with the run's AABB, texture config and precision policy, then its
    state dict (nvdiffrec's keys) is loaded::

        tex = mptex.train.load_texture("outputs/.../checkpoint.pt")
        kd = tex.sample(points)  # [N, 3]
    """
    ckpt = load_checkpoint(path)
    texture = _build_texture(ckpt["aabb"], ckpt["config"]["texture"], ckpt["precision"])
    texture.load_state_dict(ckpt["texture"])
    return texture.to(device)


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


# ----------------------------------------------------------------------------- the loop
def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state(generators: Mapping[str, torch.Generator]) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        **{f"gen_{k}": g.get_state() for k, g in generators.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for k, g in generators.items():
        g.set_state(state[f"gen_{k}"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _RunPeakRss:
    """This run's peak resident memory, from /proc/self/statm sampled by a daemon thread.

    ``ru_maxrss`` is the process's lifetime peak: jobs that share a process (Hydra's basic
    launcher) would all report the largest earlier job. Where /proc is missing (macOS) it is
    the fallback, and says so in ``peak_memory_kind``.
    """

    _STATM = "/proc/self/statm"

    def __init__(self, interval_s: float = 0.005):
        self.available = os.path.exists(self._STATM)
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

    def start(self) -> _RunPeakRss:
        if self.available:
            self._sample()
            self._thread.start()
        return self

    def stop(self) -> None:
        if self.available and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._sample()


def _peak_memory(device: torch.device, rss: _RunPeakRss) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    if rss.available:
        return rss.peak, "run_peak_rss"
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(lifetime if sys.platform == "darwin" else lifetime * 1024), "process_peak_rss"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _versions() -> dict[str, Any]:
    import mptex

    try:
        import hydra

        hydra_version = hydra.__version__
    except ImportError:  # pragma: no cover
        hydra_version = None
    return {
        "mptex": mptex.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "hydra": hydra_version,
        "cuda": torch.version.cuda,
        "tcnn_available": has_tcnn(),
        "nvdiffrast_available": has_nvdiffrast(),
    }


class _Progress:
    """tqdm bar with loss, PSNR and loss scale; a no-op when disabled or tqdm is missing."""

    def __init__(self, total: int, initial: int, enabled: Any):
        if enabled == "auto":
            enabled = sys.stdout.isatty()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="it", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: v for k, v in postfix.items() if v is not None}, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _tensorboard(run_dir: Path, enabled: bool):
    if not enabled:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("mptex-train: train.tensorboard=true but tensorboard is not installed; skipping",
              file=sys.stderr)  # fmt: skip
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _resume_path(setting: Any, run_dir: Path) -> Path | None:
    if setting is False or setting is None:
        return None
    path = run_dir / _CHECKPOINT if setting is True else Path(setting)
    if not path.is_file():
        raise ValueError(f"train.resume: no checkpoint at {path}")
    return path


def train(cfg: Mapping[str, Any], run_dir: str | os.PathLike) -> dict[str, Any]:
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
            ``failed_at: "start"``).
        Exception: anything raised mid-run is re-raised after ``metrics.json`` records
            ``status: "failed"`` and the error.

    A non-finite loss in an arm without loss scaling is not an error: the run stops with
    ``status: "diverged"`` and ``diverged_at``. So is a run of ``max_consecutive_skips`` skipped
    steps in a loss-scaled arm.

    The checkpoint (every ``checkpoint_interval`` iterations and at the end) holds ``texture``
    (state dict), ``optimizer``, ``stepper`` (GradScaler state), ``iteration`` (completed),
    ``rng`` (python, numpy, torch, view and noise generators), ``history``, ``skipped_steps``,
    ``consecutive_skips``, ``aabb``, ``precision`` and ``config``.
    """
    start_wall = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plain = dict(_plain(cfg))
    metrics: dict[str, Any] = {
        "status": "failed",
        "precision": (plain.get("precision") or {}).get("name"),
        "scene": (plain.get("scene") or {}).get("name"),
        "seed": (plain.get("train") or {}).get("seed", TRAIN_DEFAULTS["seed"]),
        "run_dir": str(run_dir.resolve()),
        "versions": _versions(),
        "config": plain,
    }
    try:
        full = validate_config(plain)
        settings = full["train"]
        device = torch.device(settings["device"])
        resume_from = _resume_path(settings["resume"], run_dir)
        scene = build_scene(full["scene"], device)
    except ValueError as exc:
        metrics.update(error=str(exc), failed_at="start")
        write_metrics(run_dir, metrics)
        raise ConfigError(str(exc)) from None
    metrics["config"] = full
    try:
        rss = _RunPeakRss().start()
        try:
            return _train(full, scene, run_dir, device, resume_from, metrics, start_wall, rss)
        finally:
            rss.stop()
    except ConfigError as exc:
        metrics.update(status="failed", error=str(exc), failed_at="start")
        write_metrics(run_dir, metrics)
        raise
    except Exception as exc:
        metrics.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                       failed_at=metrics.get("iterations", 0))  # fmt: skip
        write_metrics(run_dir, metrics)
        raise


def _train(
    full: dict[str, Any],
    scene: Scene,
    run_dir: Path,
    device: torch.device,
    resume_from: Path | None,
    metrics: dict[str, Any],
    start_wall: float,
    rss: _RunPeakRss,
) -> dict[str, Any]:
    settings = full["train"]
    if settings["threads"] is not None:
        torch.set_num_threads(settings["threads"])
    seed = int(settings["seed"])
    _seed_everything(seed)
    view_gen = torch.Generator().manual_seed(seed)
    noise_gen = torch.Generator(device).manual_seed(seed + 1)
    generators = {"views": view_gen, "noise": noise_gen}

    texture = _build_texture(scene.aabb, full["texture"], full["precision"]).to(device)
    policy = texture.policy
    optimizer = torch.optim.Adam(
        texture.parameters(), lr=settings["lr"], betas=tuple(settings["betas"]), eps=1e-8
    )
    stepper = PrecisionStepper(policy, optimizer)
    # Per-layer underflow/overflow statistics of the compute-dtype gradients (issue 7), sampled.
    stats_every = settings["stats_interval"]
    monitor = PrecisionMonitor(texture, every=stats_every) if stats_every else None
    light_dir = torch.nn.functional.normalize(
        torch.tensor(settings["light_dir"], dtype=torch.float32, device=device), dim=0
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    start_iter, history, skipped_steps, consecutive_skips = 0, [], 0, 0
    if resume_from is not None:
        ckpt = load_checkpoint(resume_from, map_location=device)
        for group in ("scene", "precision", "texture"):
            if ckpt["config"][group] != full[group]:
                raise ConfigError(
                    f"train.resume: checkpoint {resume_from} was trained with another "
                    f"{group} config"
                )
        texture.load_state_dict(ckpt["texture"])
        optimizer.load_state_dict(ckpt["optimizer"])
        stepper.load_state_dict(ckpt["stepper"])
        _set_rng_state(ckpt["rng"], generators)
        start_iter, history = int(ckpt["iteration"]), list(ckpt["history"])
        skipped_steps, consecutive_skips = ckpt["skipped_steps"], ckpt["consecutive_skips"]
    metrics["resumed_from"] = start_iter if resume_from is not None else None

    def checkpoint(completed: int) -> None:
        save_checkpoint(run_dir / _CHECKPOINT, {
            "texture": texture.state_dict(),
            "optimizer": optimizer.state_dict(),
            "stepper": stepper.state_dict(),
            "iteration": completed,
            "rng": _rng_state(generators),
            "history": history,
            "skipped_steps": skipped_steps,
            "consecutive_skips": consecutive_skips,
            "aabb": scene.aabb.cpu(),
            "precision": full["precision"],
            "config": full,
        })  # fmt: skip

    n_iter = int(settings["iterations"])
    ramp = float(settings["kd_smooth_ramp"])
    std = float(settings["kd_jitter_std"])

    def jitter(points: torch.Tensor) -> torch.Tensor:
        return points + torch.randn(points.shape, device=points.device, generator=noise_gen) * std

    writer = _tensorboard(run_dir, bool(settings["tensorboard"]))
    progress = _Progress(n_iter, start_iter, settings["progress"])
    iter_times: list[float] = []
    status, diverged_at, last_psnr, loss_value = "completed", None, None, None
    metrics.update(iterations=start_iter, iterations_planned=n_iter)
    train_start = time.perf_counter()
    for it in range(start_iter, n_iter):
        _sync(device)
        tick = time.perf_counter()
        factor = lr_schedule(it, settings["warmup_iter"], settings["lr_decay"])
        for group in optimizer.param_groups:
            group["lr"] = settings["lr"] * factor
        optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.start(it)  # arms the hooks on sampled iterations, before the forward

        views = scene.sample_train_batch(settings["batch_size"], view_gen)
        shape = views.mask.shape + (3,)
        background = _background(settings["background"], shape, device, noise_gen)
        ref_alpha = views.rgba[..., 3:4]
        ref = composite(views.rgba[..., 0:3], ref_alpha, background)
        use_reg = settings["kd_smooth"] and settings["kd_smooth_weight"] > 0
        pred, kd_grad = _render(texture, views, settings, background, light_dir,
                                jitter if use_reg else None)  # fmt: skip
        # nvdiffrec: alpha MSE + color loss on RGB masked by the reference alpha. The predicted
        # alpha is the fixed mesh's coverage, so the alpha term carries no texture gradient.
        pred_alpha = views.mask.unsqueeze(-1).to(pred.dtype)
        loss = torch.nn.functional.mse_loss(pred_alpha, ref_alpha)
        loss = loss + image_loss(pred * ref_alpha, ref * ref_alpha, settings["loss"])
        if kd_grad is not None:
            weight = settings["kd_smooth_weight"] * (min(1.0, it / ramp) if ramp > 0 else 1.0)
            loss = loss + kd_grad * weight
        if settings["inject_nonfinite_at"] == it:  # test hook: a forced overflow
            loss = loss * float("inf")

        loss_value = float(loss.item())  # synchronous; also the divergence check
        if not math.isfinite(loss_value) and stepper.scaler is None:
            status, diverged_at = "diverged", it
            break
        stepper.backward(loss)
        result = stepper.step()
        stats = monitor.collect(result) if monitor is not None else None
        _sync(device)
        iter_times.append(time.perf_counter() - tick)
        skipped_steps += int(result.skipped)
        consecutive_skips = consecutive_skips + 1 if result.skipped else 0
        completed = it + 1
        metrics["iterations"] = completed

        evaluated = None
        last = completed == n_iter
        val_interval = settings["val_interval"]
        if last or (val_interval and completed % val_interval == 0):
            evaluated = evaluate(texture, scene, settings, light_dir)
            last_psnr = evaluated["psnr"]
            if writer is not None:
                writer.add_scalar("val/psnr", last_psnr, completed)
                writer.add_images("val/prediction", rgb_to_srgb(evaluated["pred"]).clamp(0, 1)
                                  .flip(1).cpu(), completed, dataformats="NHWC")  # fmt: skip
        interval = settings["history_interval"]
        sampled = stats is not None
        if sampled or evaluated is not None or last or (interval and completed % interval == 0):
            entry = {
                "iteration": completed,
                "loss": loss_value,
                "psnr": None if evaluated is None else evaluated["psnr"],
                "loss_scale": result.loss_scale,
                "skipped": bool(result.skipped),
                "lr": settings["lr"] * factor,
            }
            if sampled:
                entry.update({k: v for k, v in stats.items() if k not in entry})
            history.append(entry)
        if writer is not None:
            writer.add_scalar("train/loss", loss_value, completed)
            writer.add_scalar("train/loss_scale", result.loss_scale, completed)
            writer.add_scalar("train/lr", settings["lr"] * factor, completed)
        progress.update(loss=f"{loss_value:.4f}", psnr=None if last_psnr is None
                        else f"{last_psnr:.2f}", scale=f"{result.loss_scale:g}")  # fmt: skip
        if consecutive_skips >= settings["max_consecutive_skips"]:
            status, diverged_at = "diverged", it
            break
        ck_interval = settings["checkpoint_interval"]
        if not last and ck_interval and completed % ck_interval == 0:
            checkpoint(completed)
    progress.close()
    train_time = time.perf_counter() - train_start

    completed = metrics["iterations"]
    if status == "completed":
        checkpoint(completed)
    evaluation = evaluate(texture, scene, settings, light_dir)
    if status == "completed" or math.isfinite(evaluation["psnr"]):
        _save_val_images(run_dir / "images", evaluation, settings["n_val_images"])
    if writer is not None:
        writer.close()
    rss.stop()
    peak, peak_kind = _peak_memory(device, rss)
    metrics.update(
        status=status,
        psnr=evaluation["psnr"],
        baseline_psnr=evaluation["baseline_psnr"],
        psnr_per_image=evaluation["psnr_per_image"],
        final_loss=loss_value,
        time_per_iter_s=statistics.median(iter_times) if iter_times else None,
        train_time_s=train_time,
        wall_time_s=time.perf_counter() - start_wall,
        peak_memory_bytes=peak,
        peak_memory_kind=peak_kind,
        skipped_steps=skipped_steps,
        final_loss_scale=stepper.loss_scale,
        diverged_at=diverged_at,
        error=None,
        failed_at=None,
        n_params=sum(p.numel() for p in texture.parameters()),
        device=str(device),
        device_name=_device_name(device),
        torch_threads=torch.get_num_threads(),
        history=history,
    )
    metrics = {k: metrics.get(k) for k in METRICS_KEYS}
    write_metrics(run_dir, metrics)
    return metrics
