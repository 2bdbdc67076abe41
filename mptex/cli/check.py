"""``mptex-check``: run one MLPTexture3D under two setups and say where they part from f64.

Example::

    mptex-check --a f32 --b f16_dynamic --points 4096 --seed 0 --out check.json
    mptex-check --a f32 --b f32 --device-b cuda --backend-b tcnn
    mptex-check --a f32 --b f32 --mode-b no_grad --texture-config nvdiffrec

Prints a per-stage table (see :func:`mptex.diagnostics.compare_setups`), writes the JSON report
with ``--out``, and exits 0 when every stage of both setups is within its dtype's bound, 1 when
one is not (so it can gate CI), 2 for bad arguments and I/O errors (an unreadable or malformed
``--texture-config``, an unknown key in it, an unwritable ``--out``): a crash is never read as
a precision failure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mptex.cli.app import output_file_problem

__all__ = ["check_main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The ``mptex-check`` argument parser."""
    from mptex.diagnostics import TEXTURE_CONFIGS
    from mptex.precision import PrecisionPolicy

    parser = argparse.ArgumentParser(
        prog="mptex-check",
        description="Compare every stage of an MLPTexture3D under two setups with a float64 "
        "CPU reference; name the first stage whose error its dtype does not explain.",
    )
    # The bounds model rounding to dtypes; the fused network and the quantised arms (FP8 GEMMs,
    # fake-quantised weights) round otherwise.
    arms = [
        n
        for n in PrecisionPolicy.names()
        if PrecisionPolicy.named(n).mlp == "linear" and not PrecisionPolicy.named(n).quantized
    ]

    def arm(name: str) -> str:
        if name in arms:
            return name
        if name in PrecisionPolicy.names():
            raise argparse.ArgumentTypeError(
                f"{name!r} rounds otherwise than to its dtypes (tcnn's fused network, or FP8 / "
                "int8 quantisation), which the stages' bounds do not model; one of "
                f"{', '.join(arms)}"
            )
        raise argparse.ArgumentTypeError(f"no arm {name!r}; one of {', '.join(arms)}")

    for tag in ("a", "b"):
        upper = tag.upper()
        parser.add_argument(f"--{tag}", default="f32", type=arm, metavar="ARM",
                            help=f"setup {upper}'s arm: {', '.join(arms)}")  # fmt: skip
        parser.add_argument(f"--device-{tag}", default="cpu", help="cpu, cuda, cuda:1, xpu, mps")
        parser.add_argument(
            f"--backend-{tag}", default="torch", choices=("torch", "tcnn", "auto"),
            help="hash-grid backend",
        )  # fmt: skip
        parser.add_argument(
            f"--mode-{tag}", default="train", choices=("train", "eval", "no_grad"),
            help="train / eval (forward and backward) or no_grad (forward only)",
        )  # fmt: skip
    parser.add_argument("--points", type=int, default=4096, help="random points in the AABB")
    parser.add_argument("--seed", type=int, default=0, help="seed of points, cotangent, weights")
    parser.add_argument(
        "--texture-config", default="small",
        help=f"{' or '.join(sorted(TEXTURE_CONFIGS))}, or a YAML file of MLPTexture3D arguments "
        "(configs/texture/default.yaml's format)",
    )  # fmt: skip
    parser.add_argument(
        "--cotangent-scale", default="training",
        help="standard deviation of the output gradient: 'training' (default, the size the "
        "default training run puts on one texture output, ~1e-5) or a number",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write the JSON report here")
    return parser


def _texture_config(value: str):
    from mptex.diagnostics import TEXTURE_CONFIGS

    if value in TEXTURE_CONFIGS:
        return value
    from omegaconf import OmegaConf

    from mptex.diagnostics.compare import _source_texture
    from mptex.train.config import check_texture_config, config_key

    try:
        config = OmegaConf.to_container(OmegaConf.load(value), resolve=True)
    except Exception as error:  # OSError, yaml's parser errors, OmegaConf's
        why = " ".join(str(error).split())[:200]
        raise ValueError(
            f"--texture-config: expected {sorted(TEXTURE_CONFIGS)} or a readable YAML file, "
            f"got {value!r} ({type(error).__name__}: {why})"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"--texture-config: {value}: expected a mapping of texture keys")
    try:
        check_texture_config(config)
        # The values check_texture_config leaves to the constructors (the encoder's sizes):
        # built once here, so that their errors name the file too.
        _source_texture(config, 0)
    except ValueError as error:
        raise ValueError(f"--texture-config: {value}: {config_key(str(error))}") from None
    if config.get("backend", "auto") not in ("auto", "torch"):
        # The setups choose the grid's backend (--backend-a, --backend-b): said, not dropped.
        print(
            f"mptex-check: --texture-config: {value}: its backend {config['backend']!r} is "
            "not used; --backend-a and --backend-b choose the grid's backend",
            file=sys.stderr,
        )
    return config


def _cotangent_scale(value: str) -> float | None:
    if value == "training":
        return None
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"--cotangent-scale: expected 'training' or a number > 0, got {value!r}")
    return scale


def check_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mptex-check``; returns (and, as a script, exits with) the exit code."""
    args = build_parser().parse_args(argv)
    from mptex.diagnostics import Setup, compare_setups

    try:
        setups = []
        for tag in ("a", "b"):
            try:
                setups.append(Setup(getattr(args, tag), device=getattr(args, f"device_{tag}"),
                                    backend=getattr(args, f"backend_{tag}"),
                                    mode=getattr(args, f"mode_{tag}")))  # fmt: skip
            except ValueError as error:
                # Setup names its own field (device: ...): the flag that set it is this one's.
                field, _, rest = str(error).partition(": ")
                flag = {"device": f"--device-{tag}", "backend": f"--backend-{tag}",
                        "mode": f"--mode-{tag}"}.get(field)  # fmt: skip
                raise ValueError(f"{flag}: {rest}" if flag and rest else str(error)) from None
        if args.points < 1:
            raise ValueError(f"--points: expected a positive integer, got {args.points}")
        problem = output_file_problem("--out", args.out) if args.out else None
        if problem is not None:
            raise ValueError(problem)
        report = compare_setups(
            _texture_config(args.texture_config), *setups, points=args.points, seed=args.seed,
            cotangent_scale=_cotangent_scale(args.cotangent_scale),
        )  # fmt: skip
        print(report.format_table())
        if args.out:
            report.to_json(args.out)
            print(f"report: {args.out}")
    except (ValueError, RuntimeError, OSError) as error:
        print(f"mptex-check: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0 if report.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(check_main())
