"""Files of a run: atomic writes, metrics.json, checkpoint.pt, the texture rebuilt from it."""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mptex.precision import all_finite, optimizer_state_tensors
from mptex.texture import MLPTexture3D

__all__ = [
    "CHECKPOINT_FILE",
    "TEXTURE_KEYS",
    "CHECKPOINT_KEYS",
    "CheckpointError",
    "DiskFullError",
    "remove_stale_temporaries",
    "atomic_write_bytes",
    "fsync_file",
    "fsync_directory",
    "disk_full_error",
    "write_metrics",
    "save_checkpoint",
    "load_checkpoint",
    "build_texture",
    "load_texture",
    "texture_from_checkpoint",
    "unfinished_note",
    "export_source",
    "no_checkpoint_reason",
    "read_metrics",
    "run_time_total",
]

CHECKPOINT_FILE = "checkpoint.pt"
_METRICS = "metrics.json"
# What a checkpoint needs to rebuild its texture (load_texture, texture_from_checkpoint).
TEXTURE_KEYS = ("texture", "aabb", "config", "precision")
# What train() writes into a checkpoint and reads back on resume (older checkpoints lack the
# optional ones: ``loss``, ``time_per_iter_s`` and the time totals of the run so far).
CHECKPOINT_KEYS = (
    "texture", "optimizer", "stepper", "iteration", "rng", "history", "skipped_steps",
    "consecutive_skips", "aabb", "precision", "config",
)  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: ``"<path>: <what is wrong>"`` (one line)."""


# A full disk, and a full quota (the usual form of it on a shared cluster filesystem).
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A write that found no space (ENOSPC) or no quota (EDQUOT) left:
    ``"<path>: no space left on device (ENOSPC); <path> is unchanged"`` (one line);
    ``filename`` is the file that could not be written."""

    def __str__(self) -> str:
        return str(self.strerror)  # OSError's would prefix "[Errno 28] "


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _file_mode() -> int:
    """``0o666`` less the process umask: the mode ``open()`` would give a new file."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def remove_stale_temporaries(
    run_dir: str | os.PathLike, names: tuple[str, ...] = (CHECKPOINT_FILE, _METRICS)
) -> list[Path]:
    """Delete the temporaries a killed :func:`atomic_write_bytes` of the files ``names`` left
    in ``run_dir``.

    They are named ``.<file>.<random>.tmp`` (``mkstemp``); a kill between ``mkstemp`` and
    ``os.replace`` leaves one behind (a checkpoint's is as large as the checkpoint). Called
    when a run starts in ``run_dir`` (an export in its folder: ``names`` its ``export.json``),
    i.e. when no other writer can be using them. Returns the removed paths.
    """
    removed = []
    for name in names:
        for tmp in Path(run_dir).glob(f".{name}.*.tmp"):
            with _suppress_oserror():
                tmp.unlink()
                removed.append(tmp)
    return removed


# ----------------------------------------------------------------------------- files
def atomic_write_bytes(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Write a file so that a crash or kill at any moment leaves either the old or the new file.

    ``write(fileobj)`` fills a temporary file in the same directory; it is flushed, fsync'ed and
    moved over ``path`` with ``os.replace`` (atomic on POSIX and Windows), then the directory is
    fsync'ed so the rename itself survives a power loss. On any error the temporary is removed
    (a ``kill -9`` cannot be caught: :func:`remove_stale_temporaries` clears those). The file
    gets the mode a plain ``open()`` would give (``0o666`` less the umask), not ``mkstemp``'s
    private ``0o600``.

    Raises:
        DiskFullError: the disk or the quota is full (at ``mkstemp``, a write, the flush, the
            fsync, or the rename); the temporary is removed and ``path`` is unchanged.
    """
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with _suppress_oserror():  # e.g. a filesystem without POSIX modes
            os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with _suppress_oserror():
                os.unlink(tmp)
        full = disk_full_error(exc, path)
        if full is not None:
            raise full from None
        raise
    fsync_directory(path.parent)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file written in place (not through :func:`atomic_write_bytes`) to the disk.

    Called for each file a record names before that record is written (the validation images
    before ``metrics.json``, an export's files before its ``export.json``): after a power loss
    a record never sits beside an empty or truncated file it names. The file's entry in its
    folder needs :func:`fsync_directory` too. An error (a full disk, which some filesystems
    report only here) is raised as the ``OSError`` it is.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush a folder's entries (files created, renamed or removed in it) to the disk."""
    with _suppress_oserror():  # not every platform can fsync a directory
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def disk_full_error(
    exc: BaseException, path: str | os.PathLike, outcome: str = "{path} is unchanged"
) -> DiskFullError | None:
    """``exc`` as a :class:`DiskFullError` naming ``path`` when a full disk or quota caused it.

    That is ``exc`` itself or the exception it was raised from or during: torch's zip writer
    turns the ``OSError`` of its file's ``write`` into a ``RuntimeError`` ("unexpected pos"),
    keeping the ``OSError`` as ``__context__``. The message, ``"<path>: no space left on device
    (ENOSPC); <outcome>"``, names ``path`` (the file being written), never a temporary; the
    default ``outcome`` is an atomic write's. None when no full disk is involved.
    """
    if isinstance(exc, DiskFullError):
        return exc
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, OSError) and error.errno in _DISK_FULL:
            what, code = os.strerror(error.errno).lower(), errno.errorcode[error.errno]
            message = f"{path}: {what} ({code}); {outcome.format(path=path)}"
            return DiskFullError(error.errno, message, str(path))
    return None


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


def read_metrics(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``run_dir``'s ``metrics.json`` as a dict; None where it is missing, unreadable, not JSON
    or not a mapping."""
    try:
        metrics = json.loads((Path(run_dir) / _METRICS).read_text())
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return metrics if isinstance(metrics, dict) else None


def run_time_total(metrics: Mapping[str, Any]) -> tuple[float | None, bool]:
    """A run's wall time over every process that trained it, from its ``metrics.json``:
    ``(seconds, complete)``; ``complete`` false means "at least" (``docs/metrics.md``).

    A record with the totals: ``wall_time_total_s`` and ``time_total_complete``. A record from
    before them: a run never resumed (``resume_count`` 0) took its one process's
    ``wall_time_s``, whole; a resumed one (or one from before ``resume_count``) at least its
    last process's ``wall_time_s``, since its earlier processes' time is in no record. A
    record without times (a run that failed at its start): ``(None, False)``.
    """
    if "wall_time_total_s" in metrics:
        return metrics["wall_time_total_s"], metrics.get("time_total_complete") is True
    last = metrics.get("wall_time_s")
    if last is None:
        return None, False
    return last, metrics.get("resume_count") == 0


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """``torch.save(state)`` to ``path`` atomically (:func:`atomic_write_bytes`).

    Raises:
        CheckpointError: when a floating-point tensor of ``state["texture"]``, or of the
            optimizer's per-parameter state ``state["optimizer"]["state"]``
            (:func:`mptex.precision.optimizer_state_tensors`), holds inf/NaN; nothing is
            written, so the last good checkpoint stays.
    """
    weights = [t for t in (state.get("texture") or {}).values()
               if torch.is_tensor(t) and t.is_floating_point()]  # fmt: skip
    moments = optimizer_state_tensors((state.get("optimizer") or {}).get("state") or {})
    # One reduction and one read for both on the way that writes; the second only says which.
    if not all_finite([*weights, *moments]):
        what = "non-finite weights" if not all_finite(weights) else "a non-finite optimizer state"
        raise CheckpointError(f"{path}: refusing to write a checkpoint with {what}")
    atomic_write_bytes(path, lambda f: torch.save(dict(state), f))


def load_checkpoint(
    path: str | os.PathLike, map_location: Any = "cpu", required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Read a checkpoint written by :func:`train` (a plain dict; see :func:`train`).

    Args:
        path: the ``checkpoint.pt``.
        map_location: as ``torch.load``'s.
        required: keys the caller needs (:data:`CHECKPOINT_KEYS` for a resume).

    Raises:
        CheckpointError: one line naming ``path`` and what is wrong: unreadable, not a
            checkpoint (corrupt or truncated: torch's zip reader, pickle or EOF errors), not a
            dict, or a required key missing.
    """
    try:
        # weights_only=False: the checkpoint holds RNG states and Python lists written by us.
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({_one_line(exc.strerror or exc)})") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        why = _one_line(exc)[:200]
        raise CheckpointError(
            f"{path}: not a readable checkpoint, corrupt or truncated ({type(exc).__name__}: {why})"
        ) from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path}: not an mptex checkpoint (holds {type(ckpt).__name__})")
    missing = [key for key in required if key not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not an mptex training checkpoint (missing {missing})")
    return ckpt


def build_texture(aabb, texture_cfg: Mapping[str, Any], precision: Any) -> MLPTexture3D:
    """The :class:`~mptex.MLPTexture3D` a run trains: its ``texture`` group (defaults as
    ``configs/texture/default.yaml``) and ``precision`` (a name or policy) over ``aabb``."""
    cfg = dict(texture_cfg)
    return MLPTexture3D(
        aabb,
        # No int(): a 4.7 must reach the constructor's check, not become 4.
        channels=cfg.get("channels", 3),
        internal_dims=cfg.get("internal_dims", 32),
        hidden=cfg.get("hidden", 2),
        min_max=cfg.get("min_max"),
        precision=precision,
        encoder=cfg.get("encoder"),
        backend=cfg.get("backend", "auto"),
        fp8_gemm=cfg.get("fp8_gemm", "auto"),
    )


def load_texture(path: str | os.PathLike, device: str | torch.device = "cpu") -> MLPTexture3D:
    """The trained :class:`~mptex.MLPTexture3D` from a ``checkpoint.pt`` written by ``train``
    (``path``: the file, or the run's directory that holds it).

    The texture is rebuilt with the run's AABB, texture config and precision policy, then its
    state dict (nvdiffrec's keys) is loaded::

        tex = mptex.train.load_texture("outputs/.../checkpoint.pt")  # or "outputs/..."
        kd = tex.sample(points)  # [N, 3]
    """
    if Path(path).is_dir():
        if not (Path(path) / CHECKPOINT_FILE).is_file():
            raise CheckpointError(f"{path}: {no_checkpoint_reason(path)}")
        path = Path(path) / CHECKPOINT_FILE
    ckpt = load_checkpoint(path, required=TEXTURE_KEYS)
    return texture_from_checkpoint(ckpt, device)


def _texture_on(ckpt: dict[str, Any], texture_cfg: dict[str, Any], device) -> MLPTexture3D:
    texture = build_texture(ckpt["aabb"], texture_cfg, ckpt["precision"])
    texture.load_state_dict(ckpt["texture"])
    return texture.to(device)


def texture_from_checkpoint(
    ckpt: dict[str, Any], device: str | torch.device = "cpu"
) -> MLPTexture3D:
    """:func:`load_texture` for a checkpoint already read with :func:`load_checkpoint`
    (``required`` including :data:`TEXTURE_KEYS`): one read when the caller also needs the
    checkpoint's config."""
    stored = dict(ckpt["config"]["texture"])
    backend = stored.get("backend", "auto")
    try:
        texture = _texture_on(ckpt, stored, device)
        if backend != "auto":  # an explicit grid backend: does it run here?
            with torch.no_grad():
                texture.encoder(torch.full((1, 3), 0.5, device=texture.AABB.device))
    except RuntimeError as exc:
        if backend == "auto":
            raise
        # The run's texture.backend (tcnn, triton) is how its grid computed, not what it
        # learned: every backend holds the same flat parameters. Where it cannot run (an
        # export on a CPU of a GPU run), the device's default evaluates them.
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        warnings.warn(
            f"texture.backend: the checkpoint's {backend!r} cannot run here ({why}); its grid "
            "runs on 'auto' instead",
            stacklevel=2,
        )
        texture = _texture_on(ckpt, {**stored, "backend": "auto"}, device)
    try:
        texture.net.fp8_gemm_backend()  # resolved for this device
    except ValueError as exc:
        # The run's texture.fp8_gemm (scaled_mm, triton) is how it computed, not what it
        # learned: where that backend cannot run (an export on a CPU of a GPU run), the
        # weights are evaluated with the device's default, and the user is told.
        warnings.warn(
            f"texture.fp8_gemm: the checkpoint's {ckpt['config']['texture'].get('fp8_gemm')!r} "
            f"cannot run here ({str(exc).removeprefix('backend: ')}); its FP8 GEMMs run on "
            "'auto' instead",
            stacklevel=2,
        )
        texture.net.set_fp8_gemm("auto")
    return texture


def unfinished_note(
    ckpt: Mapping[str, Any],
    run_dir: str | os.PathLike,
    metrics: Mapping[str, Any] | None = None,
) -> str | None:
    """``"a checkpoint of <done> of <planned> iterations (the run is <status>)"`` when the run in
    ``run_dir`` did not complete (its ``metrics.json`` says another status, or is missing or
    unreadable, or the checkpoint holds fewer iterations than planned), else None: what
    ``mptex-export`` and ``mptex-rescore`` say before they use such a checkpoint, whose weights
    are not the run's result. ``metrics``: the ``metrics.json`` the caller already read (its
    :func:`read_metrics`, None where unreadable), so that both judge one reading of a file a
    running job may rewrite; without it the file is read here."""
    done = int(ckpt.get("iteration", 0))
    planned = int(((ckpt.get("config") or {}).get("train") or {}).get("iterations", done))
    if metrics is None:
        metrics = read_metrics(run_dir)
    status = (metrics or {}).get("status")
    if status == "completed" and done >= planned:
        return None
    said = status if isinstance(status, str) else "without a readable metrics.json"
    return f"a checkpoint of {done} of {planned} iterations (the run is {said})"


def export_source(
    run_dir: str | os.PathLike, config: Mapping[str, Any], iterations: int, status: str | None
) -> dict[str, Any]:
    """Where an export's weights came from: ``export.json``'s ``source``.

    Args:
        run_dir: the run directory (its ``checkpoint.pt`` holds the weights).
        config: the run's config as the checkpoint holds it.
        iterations: the iterations the weights were trained for (the checkpoint's).
        status: the run's status (``metrics.json``'s, None where it is missing or unreadable).

    Returns:
        ``run_dir`` and ``checkpoint`` (absolute paths), ``iterations``, ``iterations_planned``
        (``train.iterations``), ``status``, ``final_weights`` (a completed run's weights after
        all its planned iterations: what :func:`unfinished_note` judges), and the run's arm
        (``precision``), ``scene`` and ``seed`` where its config names them.
    """
    run_dir = Path(run_dir).resolve()
    train = config.get("train") or {}
    planned = int(train.get("iterations", iterations))
    return {
        "run_dir": str(run_dir),
        "checkpoint": str(run_dir / CHECKPOINT_FILE),
        "iterations": int(iterations),
        "iterations_planned": planned,
        "status": status,
        "final_weights": status == "completed" and iterations >= planned,
        "precision": (config.get("precision") or {}).get("name"),
        "scene": (config.get("scene") or {}).get("name"),
        "seed": train.get("seed"),
    }


def no_checkpoint_reason(run_dir: str | os.PathLike) -> str:
    """Why ``run_dir`` holds no ``checkpoint.pt``, as far as its ``metrics.json`` tells: a run
    that diverged before its first checkpoint (``"the run diverged at iteration 0 before its
    first checkpoint: no weights"``), one that failed at start, or else that it is not a
    finished mptex-train run. What ``mptex-export`` and ``mptex-rescore`` say."""
    metrics = read_metrics(run_dir) or {}
    status = metrics.get("status")
    if status == "diverged":
        at = metrics.get("diverged_at")
        return f"the run diverged at iteration {at} before its first checkpoint: no weights"
    if status == "failed" and metrics.get("failed_at") == "start":
        return f"the run failed at start ({metrics.get('error')}): no weights"
    return "no checkpoint.pt (not a finished mptex-train run)"
