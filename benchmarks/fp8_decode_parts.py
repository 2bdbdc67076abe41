"""Which part of the FP8 decode costs a trained texture: its E4M3 weights, its E4M3 layer
inputs, or both.

The export's ``fp8`` decode (:func:`mptex.bake.decode_texture`) reads the hash grid in tcnn's
half mode, rounds every MLP weight to E4M3 with one per-tensor scale (``448 / amax``) and every
layer's input to E4M3 with one scale calibrated on the decoded points, and accumulates in f32.
The export's ``fp8_rowwise`` decode scales per row instead: each weight row (output channel)
with its own ``448 / amax`` and each point's layer input with its own. This script decodes a
run's validation views seven ways, each with the half grid of the FP8 decodes and f32
accumulation:

- ``none``: f32 weights, f32 layer inputs;
- ``weights``: E4M3 weights, one scale per tensor, f32 layer inputs (a weight-only FP8 decoder);
- ``inputs``: f32 weights, E4M3 layer inputs, one scale per layer;
- ``both``: E4M3 weights and inputs per tensor, which is the ``fp8`` decode itself (checked to
  the bit against :func:`mptex.bake.decode_texture`; the script stops if it differs);
- ``row weights``, ``row inputs``, ``row both``: the same with one scale per weight row and per
  point, ``row both`` being the ``fp8_rowwise`` decode itself (checked to the bit likewise).

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
from mptex.fp8 import E4M3, fp8_scale, quantize_fp8_rowwise  # noqa: E402
from mptex.intervals import mean_ci, verdict  # noqa: E402
from mptex.render import psnr  # noqa: E402
from mptex.scenes import build_scene  # noqa: E402
from mptex.train.checkpoint import TEXTURE_KEYS, load_checkpoint, texture_from_checkpoint  # noqa: E402

# name: (weights in E4M3, inputs in E4M3, one scale per row instead of per tensor)
VARIANTS = {"none": (False, False, False), "weights": (True, False, False),
            "inputs": (False, True, False), "both": (True, True, False),
            "row weights": (True, False, True), "row inputs": (False, True, True),
            "row both": (True, True, True)}  # fmt: skip
# The variants that are a decode of mptex.bake.decode, bit for bit.
DECODES = {"both": "fp8", "row both": "fp8_rowwise"}
# Paired differences printed for several runs: (minuend, subtrahend).
PAIRS = [("weights", "none"), ("inputs", "none"), ("both", "none"), ("both", "weights"),
         ("row weights", "none"), ("row inputs", "none"), ("row both", "none"),
         ("row both", "row weights"), ("row both", "both")]  # fmt: skip


def decode_parts(texture, points: torch.Tensor, weights_fp8: bool, inputs_fp8: bool,
                 rowwise: bool = False):  # fmt: skip
    """[N, channels] values at world ``points``: the fp8 (``rowwise``: fp8_rowwise) decode with
    only the named parts in E4M3 (the others f32). Mirrors ``mptex.bake.decode``'s fp8 layers,
    whose helpers it uses."""
    matrices = decode.decoder_weights(texture)
    with torch.no_grad():
        h = decode._features(texture, points, "fp8")
        if matrices.input_padding:
            h = torch.cat([h, h.new_ones(h.shape[0], matrices.input_padding)], dim=1)
        last = len(matrices.matrices) - 1
        for index, weight in enumerate(matrices.matrices):
            if rowwise:
                h = _rowwise_layer(h, weight.to(h.device).float(), weights_fp8, inputs_fp8)
                if index < last:
                    h = torch.relu(h)
                continue
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


def _rowwise_layer(h, weight, weights_fp8: bool, inputs_fp8: bool) -> torch.Tensor:
    """One layer of the fp8_rowwise decode with the parts not named in E4M3 left f32 (scale 1:
    the same exact sum and scale products as :func:`mptex.fp8.scaled_mm_rowwise`'s emulation)."""
    if weights_fp8 and inputs_fp8:
        return decode._layer(h, weight, "fp8_rowwise", None)
    w, w_inv = weight, torch.ones(1, weight.shape[0], device=h.device)
    x, x_inv = h, torch.ones(h.shape[0], 1, device=h.device)
    if weights_fp8:
        w, w_inv, _, _ = quantize_fp8_rowwise(weight, E4M3)
        w_inv = w_inv.t()
    if inputs_fp8:
        x, x_inv, _, _ = quantize_fp8_rowwise(h, E4M3)
    return (x.double() @ w.double().t()).float() * x_inv * w_inv


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
    for name, (weights_fp8, inputs_fp8, rowwise) in VARIANTS.items():
        values = decode_parts(texture, points, weights_fp8, inputs_fp8, rowwise)
        if name in DECODES and not torch.equal(
            values, decode.decode_texture(texture, points, DECODES[name])
        ):
            raise SystemExit(f"{run_dir}: the {name!r} variant differs from decode_texture's "
                             f"{DECODES[name]} decode; this script no longer mirrors "
                             "mptex.bake.decode")  # fmt: skip
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
