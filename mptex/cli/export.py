"""``mptex-export RUN_DIR``: bake a finished run's texture and write the asset.

::

    mptex-export outputs/a                       # -> outputs/a/export/{mesh.obj, mesh.glb, ...}
    mptex-export outputs/a --out asset --resolution 2048 --format obj,glb --padding 8

The run's ``checkpoint.pt`` gives the texture and the config it was trained with (scene,
cameras, the run's ``export`` group as defaults); flags override the export keys.
``export.json``'s ``source`` says which weights were exported: the run directory, the
checkpoint, its iterations of those planned, the run's status (from ``metrics.json``), arm,
scene and seed (:func:`mptex.train.checkpoint.export_source`). Every
problem found before the bake (no checkpoint, a bad flag, a mesh that needs xatlas when it is
not installed, a resolution whose buffers do not fit in memory) is one line on stderr and
exit status 2.

The command reads the training checkpoint (``mptex.train.checkpoint``) and hands the texture
and the run's scene to :func:`mptex.bake.export_asset`; the training loop never exports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mptex.export_config import DECODE_PRECISIONS

__all__ = ["export_main"]

_PROG = "mptex-export"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Bake a trained mptex texture into UV maps and export a textured mesh.",
    )
    parser.add_argument("run_dir", help="an mptex-train run directory (holds checkpoint.pt)")
    parser.add_argument("--out", help="output folder (default: RUN_DIR/export)")
    parser.add_argument("--resolution", type=int, help="atlas size N (N x N texels)")
    parser.add_argument("--format", dest="formats", help="comma-separated: obj, glb")
    parser.add_argument("--padding", type=int, help="seam padding in texels (dilation)")
    parser.add_argument("--unwrap", choices=("auto", "always"), help="re-unwrap with xatlas")
    parser.add_argument("--kd-format", choices=("png8", "png16", "exr"), help="image format")
    parser.add_argument("--no-measure", action="store_true", help="skip the PSNR measurement")
    parser.add_argument(
        "--decode", dest="decode_precisions",
        help=f"comma-separated decode precisions to measure ({', '.join(DECODE_PRECISIONS)}; "
        "'' none)",
    )  # fmt: skip
    parser.add_argument(
        "--neural", dest="neural_precision", choices=DECODE_PRECISIONS,
        help="also write the grid and MLP in this precision (safetensors + a NumPy decoder)",
    )  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda")
    return parser


# The flag that sets each export key on the command line.
_FLAGS = {"resolution": "--resolution", "formats": "--format", "padding": "--padding",
          "unwrap": "--unwrap", "kd_format": "--kd-format", "measure": "--no-measure",
          "decode_precisions": "--decode", "neural_precision": "--neural"}  # fmt: skip


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def export_main(argv: list[str] | None = None) -> int:
    """``mptex-export``; returns the exit status (0, or 2 for a problem found before work)."""
    from mptex._backends import auto_device, cuda_device_problem
    from mptex._triton_launch import launching_on

    args = _parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    checkpoint = run_dir / "checkpoint.pt"
    if run_dir.is_file():
        return _fail(f"{run_dir}: a file, not a run directory (give the folder that holds "
                     "checkpoint.pt)")  # fmt: skip
    if not run_dir.is_dir():
        return _fail(f"{run_dir}: no such run directory")
    if not checkpoint.is_file():
        from mptex.train.checkpoint import no_checkpoint_reason

        return _fail(f"{run_dir}: {no_checkpoint_reason(run_dir)}")
    device = args.device
    if device == "auto":
        device = auto_device()
    try:
        device = torch.device(device)
    except RuntimeError:  # torch's message lists every device type it knows: not one line's
        return _fail(f"--device: expected auto or a torch device such as cpu, cuda or cuda:1, "
                     f"got {device!r}")  # fmt: skip
    problem = cuda_device_problem(device, str(device)) if device.type == "cuda" else None
    if problem is not None:
        return _fail(f"--device: {problem}")
    # Triton's kernels launch on the current CUDA device: the export's, for the export
    with launching_on(device):
        return _export_run(args, run_dir, checkpoint, device)


def _export_run(args, run_dir: Path, checkpoint: Path, device: torch.device) -> int:
    from mptex.bake.export import export_asset, preflight_export
    from mptex.scenes import build_scene
    from mptex.train.checkpoint import (
        TEXTURE_KEYS,
        CheckpointError,
        export_source,
        load_checkpoint,
        read_metrics,
        texture_from_checkpoint,
        unfinished_note,
    )

    try:
        ckpt = load_checkpoint(checkpoint, map_location=device, required=TEXTURE_KEYS)
    except CheckpointError as exc:
        return _fail(str(exc))
    metrics = read_metrics(run_dir)
    note = unfinished_note(ckpt, run_dir, metrics)
    if note is not None:  # its weights are not the run's result: said
        print(f"{_PROG}: {run_dir}: exporting {note}", file=sys.stderr)
    config = ckpt["config"]
    status = (metrics or {}).get("status")
    source = export_source(run_dir, config, int(ckpt.get("iteration", 0)),
                           status if isinstance(status, str) else None)  # fmt: skip
    overrides = {
        "resolution": args.resolution, "formats": args.formats, "padding": args.padding,
        "unwrap": args.unwrap, "kd_format": args.kd_format,
        "measure": False if args.no_measure else None,
        "decode_precisions": args.decode_precisions, "neural_precision": args.neural_precision,
    }  # fmt: skip
    options = {**(config.get("export") or {}), "enabled": True}
    options.update({k: v for k, v in overrides.items() if v is not None})
    out = Path(args.out) if args.out else run_dir / "export"
    if out.exists() and not out.is_dir():
        return _fail(f"--out: {out} exists and is not a folder")
    try:
        scene = build_scene(config["scene"], device)
        texture = texture_from_checkpoint(ckpt, device)
        options = preflight_export(options, scene.mesh, texture.channels, device, out)
    except (ValueError, RuntimeError) as exc:
        message = str(exc)
        key = message.split(":", 1)[0].removeprefix("export.")
        if message.startswith("export.") and overrides.get(key) is not None:
            # The value came from a flag, not from the run's config: name the flag.
            message = _FLAGS[key] + message[len("export." + key) :]
        return _fail(message)
    options.pop("unwrap_reason")
    background = (config.get("train") or {}).get("val_background", "white")
    try:
        summary = export_asset(texture, scene, out, options, background, source=source)
    except (ValueError, RuntimeError, OSError) as exc:
        # What only the bake finds (charts that do not pack at this resolution) or the disk
        # says (a folder that cannot be made): one line, as the checks before it.
        return _fail(str(exc) if not isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}")
    print(f"{_PROG}: wrote {', '.join(summary['files'].values())} and export.json to {out}")
    print(
        f"{_PROG}: {summary['resolution']}^2 texels, UVs from {summary['uv_source']}, "
        f"coverage {summary['coverage']:.3f}, {summary['texels_per_unit']:.1f} texels/unit, "
        f"bake {summary['bake_time_s']:.1f} s"
    )
    if "psnr_baked_vs_neural" in summary:
        line = f"{_PROG}: PSNR baked vs neural {summary['psnr_baked_vs_neural']:.2f} dB"
        if "psnr_baked_vs_reference" in summary:
            line += (
                f", baked vs reference {summary['psnr_baked_vs_reference']:.2f} dB "
                f"(neural vs reference {summary['psnr_neural_vs_reference']:.2f} dB)"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(export_main())
