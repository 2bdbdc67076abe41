"""Files of a run: atomic writes, metrics.json, checkpoint.pt, the texture rebuilt from it."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mptex.texture import MLPTexture3D

_CHECKPOINT = "checkpoint.pt"
_METRICS = "metrics.json"


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
