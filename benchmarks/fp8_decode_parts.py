"""Which part of the FP8 decode costs a trained texture: its E4M3 weights, its E4M3 layer
inputs, or both.

The export's ``fp8`` decode (:func:`mptex.bake.decode_texture`) reads the hash grid in tcnn's
half mode, rounds every MLP weight to E4M3 with one per-tensor scale (``448 / amax``) and every
layer's input to E4M3 with one scale calibrated on the decoded points, and accumulates in f32.
This script decodes a run's validation views four ways, each with the ``fp8`` decode's half
grid and f32 accumulation:

- ``none``: f32 weights, f32 layer inputs;
- ``weights``: E4M3 weights, f32 layer inputs (a weight-only FP8 decoder);
- ``inputs``: f32 weights, E4M3 layer inputs;
- ``both``: E4M3 weights and inputs, which is the ``fp8`` decode itself (checked to the bit
  against :func:`mptex.bake.decode_texture`; the script stops if it differs).

Each decode is scored as the export's decode table scores (``export.json``'s
``decode_precision.psnr_vs_reference``): the albedo on the covered pixels over the run's
validation background, nvdiffrec's PSNR against the reference images, mean over views. With
several runs it prints the paired differences between the variants over them, with the
report's 95 % Student-t interval and verdict (runs should be seeds of one arm and scene).

Usage::

    python benchmarks/fp8_decode_parts.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, print_table  # noqa: E402

from mptex.bake import decode  # noqa: E402
from mptex.fp8 import E4M3, fp8_scale  # noqa: E402
from mptex.intervals import mean_ci, verdict  # noqa: E402
from mptex.render import psnr  # noqa: E402
from mptex.scenes import build_scene  # noqa: E402
from mptex.train.checkpoint import TEXTURE_KEYS, load_checkpoint, texture_from_checkpoint  # noqa: E402

VARIANTS = {"none": (False, False), "weights": (True, False), "inputs": (False, True),
            "both": (True, True)}  # fmt: skip
# Paired differences printed for several runs: (minuend, subtrahend).
PAIRS = [("weights", "none"), ("inputs", "none"), ("both", "none"), ("both", "weights")]


def decode_parts(texture, points: torch.Tensor, weights_fp8: bool, inputs_fp8: bool):
    """[N, channels] values at world ``points``: the fp8 decode with only the named parts in
    E4M3 (the others f32). Mirrors ``mptex.bake.decode``'s fp8 layer, whose helpers it uses."""
    matrices = decode.decoder_weights(texture)
    with torch.no_grad():
        h = decode._features(texture, points, "fp8")
        if matrices.input_padding:
            h = torch.cat([h, h.new_ones(h.shape[0], matrices.input_padding)], dim=1)
        last = len(matrices.matrices) - 1
        for index, weight in enumerate(matrices.matrices):
            w_scale_inv = torch.ones((), device=h.device)
            x_scale = torch.ones((), device=h.device)
            w, x = weight.to(h.device).float(), h
            if weights_fp8:
                w, w_scale_inv = decode._fp8_weight(weight.to(h.device))
            if inputs_fp8:
                x_scale = fp8_scale(h.abs().amax(), E4M3)
                x = decode._fp8_input(h, x_scale)
            h = (x.float() @ w.float().t()) * (torch.reciprocal(x_scale) * w_scale_inv)
            if index < last:
                h = torch.relu(h)
        lo, hi = texture.min_max[0], texture.min_max[1]
        return decode._sigmoid(h[:, : matrices.n_outputs].float()) * (hi - lo)[None] + lo[None]


def measure_run(run_dir: Path) -> dict[str, float]:
    """PSNR (dB) of each variant on the run's validation views."""
    ckpt = load_checkpoint(run_dir / "checkpoint.pt", map_location="cpu", required=TEXTURE_KEYS)
    config = ckpt["config"]
    scene = build_scene(config["scene"], "cpu")
    texture = texture_from_checkpoint(ckpt, "cpu")
    views = scene.val_views()
    mask = views.gbuffer.mask
    points = views.gbuffer.position[mask]
    level = 1.0 if (config.get("train") or {}).get("val_background", "white") == "white" else 0.0
    target = level + (views.rgba[..., :3] - level) * views.rgba[..., 3:4]
    scores = {}
    for name, (weights_fp8, inputs_fp8) in VARIANTS.items():
        values = decode_parts(texture, points, weights_fp8, inputs_fp8)
        fp8 = decode.decode_texture(texture, points, "fp8") if name == "both" else None
        if fp8 is not None and not torch.equal(values, fp8):
            raise SystemExit(f"{run_dir}: the 'both' variant differs from decode_texture's fp8 "
                             "decode; this script no longer mirrors mptex.bake.decode")  # fmt: skip
        scores[name] = float(psnr(decode._composite(values, mask, level), target).mean())
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="mptex-train run directories")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "checkpoint.pt").is_file()]
    if missing:
        print(f"runs: no checkpoint.pt in {', '.join(missing)}", file=sys.stderr)
        return 2
    print(f"Machine: {machine('cpu')}\n")
    results = [(run, measure_run(run)) for run in args.runs]
    print_table(["run", *(f"{name} (dB)" for name in VARIANTS)],
                [[str(run), *(f"{s[name]:.2f}" for name in VARIANTS)]
                 for run, s in results])  # fmt: skip
    if len(results) >= 2:
        rows = []
        for a, b in PAIRS:
            ci = mean_ci([s[a] - s[b] for _, s in results])
            rows.append([f"{a} − {b}", ci["n"], f"{ci['mean']:+.2f} [{ci['low']:+.2f}, "
                         f"{ci['high']:+.2f}]", verdict(ci)])  # fmt: skip
        print()
        print_table(["paired difference", "runs", "mean (dB) [95 % CI]", "verdict"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
