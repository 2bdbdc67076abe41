"""The report's pictures: PSNR curves, effective loss scales, validation images with error maps.

Every figure uses matplotlib's object API on the Agg canvas (headless, and no global pyplot
state that could disturb a user's figures when the report runs inside their process). An arm
keeps its colour across sweeps (:func:`arm_color`).
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mptex.numbers import is_number
from mptex.report.stats import _effective_scale

__all__ = ["ARM_COLORS", "arm_color", "error_gain", "image_panels", "plot_history",
           "plot_images"]  # fmt: skip

# One fixed colour per known arm (matplotlib's tab10, f32 black as the reference), so that the
# same arm looks the same in every sweep's plots whatever subset of arms ran.
ARM_COLORS = {
    "f32": "#000000", "nvdiffrec": "#1f77b4", "f16_naive": "#d62728", "f16_static": "#ff7f0e",
    "f16_dynamic": "#2ca02c", "amp": "#9467bd", "bf16": "#8c564b", "per_layer": "#e377c2",
    "tcnn_fused": "#17becf", "fp8": "#bcbd22", "fp8_current": "#7f7f7f", "int8_qat": "#aec7e8",
    "fp8_qat": "#98df8a", "fp8_rowwise": "#dbdb8d", "fp8_rowwise_qat": "#c5b0d5",
}  # fmt: skip
_LINESTYLES = ("-", "--", "-.", ":")
# A legend of more entries than this, drawn inside a panel 4 inches high, covers its curves and
# runs past its top (20 arms: over the title and off the figure); larger ones go beside the
# panel, in columns of at most _LEGEND_ROWS entries, and the figure widens to hold them.
_LEGEND_INSIDE_MAX = 8
_LEGEND_ROWS = 12
# Picture columns of images.png: a sweep of 20 arms would otherwise make one line 46 inches
# wide; more arms wrap onto further lines of view, zoom and error map.
_IMAGE_COLS = 8
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<")


def arm_color(arm: str) -> str:
    """The arm's fixed colour; an unknown arm gets one from a hash of its name (md5, so the
    same on every machine and Python run, unlike ``hash()``)."""
    if arm in ARM_COLORS:
        return ARM_COLORS[arm]
    import colorsys

    digest = hashlib.md5(str(arm).encode()).digest()
    hue = digest[0] / 255.0
    red, green, blue = colorsys.hsv_to_rgb(hue, 0.65 + 0.35 * digest[1] / 255.0, 0.75)
    return "#{:02x}{:02x}{:02x}".format(*(round(255 * c) for c in (red, green, blue)))


def _figure(n_cols: int, n_rows: int = 1, width: float = 6.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n_cols, height * n_rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(n_rows, n_cols, squeeze=False)


def _place_legend(ax) -> float:
    """Draw ``ax``'s legend inside the panel (up to :data:`_LEGEND_INSIDE_MAX` entries) or
    beside it; returns the inches it takes beside the panel (0 inside)."""
    labels = ax.get_legend_handles_labels()[1]
    if len(labels) <= _LEGEND_INSIDE_MAX:
        ax.legend(fontsize="small")
        return 0.0
    n_cols = -(-len(labels) // _LEGEND_ROWS)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              ncols=n_cols)  # fmt: skip
    # about 0.07 inch per character at the "small" size, plus the line sample and the gaps
    return n_cols * (0.7 + 0.07 * max(len(label) for label in labels))


def _label(row: Mapping[str, Any]) -> str:
    extra = [f"{k.removeprefix('precision.')}={v}" for k, v in row["keys"].items()
             if k.startswith("precision.") and k != "precision.name"]  # fmt: skip
    return " ".join([str(row["precision"]), *extra])


def _curve(runs: Sequence[Mapping[str, Any]], value):
    """Iterations and per-iteration mean/min/max of ``value(run, entry)`` over runs."""
    by_iter: dict[int, list[float]] = {}
    for run in runs:
        for entry in run["history"]:
            y = value(run, entry)
            if is_number(entry.get("iteration")) and is_number(y):
                by_iter.setdefault(int(entry["iteration"]), []).append(float(y))
    its = sorted(by_iter)
    return (its, [statistics.fmean(by_iter[i]) for i in its], [min(by_iter[i]) for i in its],
            [max(by_iter[i]) for i in its])  # fmt: skip


def _psnr(run, entry):
    return entry.get("psnr")


def _scale(run, entry):
    # A run that records its effective scale wins; otherwise it is derived from its config.
    if is_number(entry.get("effective_loss_scale")):
        return entry["effective_loss_scale"]
    scale = entry.get("loss_scale")
    return _effective_scale(run, float(scale)) if is_number(scale) else None


def plot_history(
    path: str | os.PathLike,
    sections: Sequence[tuple[str, Sequence[int]]],
    rows: Sequence[Mapping[str, Any]],
    groups: Sequence[Sequence[Mapping[str, Any]]],
    what: str,
) -> bool:
    """One panel per section (up to three in a row, more in a near-square grid): mean over seeds
    of ``what`` against iteration, band min–max; a legend of many arms beside its panel.

    Args:
        what: ``"psnr"`` (validation PSNR) or ``"loss_scale"`` (the effective loss scale: the
            recorded GradScaler scale times the fixed x128 of the nvdiffrec and tcnn arms,
            log2 axis; the lines of several arms are drawn with distinct line styles and
            markers, and the k-th arm's line is multiplied by ``2^(0.1 k)`` (a tenth of an
            octave per arm, stated in the title; the legend gives each arm's true last value),
            so that f32, bf16 and the other unscaled arms do not hide each other).

    Writes ``path`` (PNG) and, beside it, the same figure as a vector PDF (``path`` with
    ``.pdf``), the one to put in a paper.

    Returns:
        False (nothing written) when no completed or diverged run has a history.
    """
    value, ylabel = (_psnr, "validation PSNR (dB)") if what == "psnr" else (
        _scale, "effective loss scale")  # fmt: skip
    drawn = False
    beside = 0.0
    # Up to three panels side by side, more in a grid about as wide as high (four scenes: 2 x
    # 2), so that the figure keeps a page's proportions as scenes are added.
    n_cols = len(sections) if len(sections) <= 3 else math.ceil(math.sqrt(len(sections)))
    fig, grid = _figure(n_cols, math.ceil(len(sections) / n_cols))
    for ax in grid.flat[len(sections) :]:
        ax.remove()
    for ax, (title, indices) in zip(grid.flat, sections):
        for k, index in enumerate(indices):
            runs = [r for r in groups[index] if r["status"] in ("completed", "diverged")]
            its, mean, lo, hi = _curve(runs, value)
            if not its:
                continue
            offset = 2.0 ** (0.1 * k) if what == "loss_scale" else 1.0
            style = dict(color=arm_color(rows[index]["precision"]),
                         linestyle=_LINESTYLES[k % len(_LINESTYLES)],
                         marker=_MARKERS[k % len(_MARKERS)],
                         markevery=(k % 5, max(1, len(its) // 8)), markersize=4)  # fmt: skip
            label = _label(rows[index])
            if what == "loss_scale":
                label += f" (last {mean[-1]:g})"
            ax.plot(its, [y * offset for y in mean], label=label, **style)
            ax.fill_between(its, [y * offset for y in lo], [y * offset for y in hi],
                            color=style["color"], alpha=0.15, linewidth=0)  # fmt: skip
            drawn = True
        if what == "loss_scale":
            ax.set_yscale("log", base=2)
        ax.set(title=title, xlabel="iteration", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            beside = max(beside, _place_legend(ax))
    if not drawn:
        return False
    fig.set_size_inches(fig.get_figwidth() + beside * n_cols, fig.get_figheight())
    note = "; the k-th arm's line is drawn x 2^(0.1 k) so that equal scales stay visible" if (
        what == "loss_scale") else ""  # fmt: skip
    import textwrap

    fig.suptitle(textwrap.fill(f"{ylabel}: mean over seeds, band min–max{note}",
                               55 * n_cols), fontsize="medium")  # fmt: skip
    fig.savefig(path, dpi=100)
    # No creation date (the same curves give the same bytes) and TrueType fonts (venues refuse
    # the Type 3 fonts matplotlib embeds by default).
    import logging

    import matplotlib

    # Embedding TrueType subsets, fontTools logs each step at INFO: under Hydra, whose job
    # logging passes INFO to the console, a report would end in hundreds of its lines.
    fonttools = logging.getLogger("fontTools")
    level = fonttools.level
    fonttools.setLevel(logging.WARNING)
    try:
        with matplotlib.rc_context({"pdf.fonttype": 42}):
            fig.savefig(Path(path).with_suffix(".pdf"), metadata={"CreationDate": None})
    finally:
        fonttools.setLevel(level)
    return True


def _read_image(path: Path):
    import imageio.v3 as iio
    import numpy as np

    image = np.asarray(iio.imread(path))
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return image[..., :3]


def _detail_window(image, size: int) -> tuple[int, int]:
    """Top-left (row, col) of the ``size`` x ``size`` window with the most fine detail (the
    largest sum of absolute Laplacian): where a precision loss in fine levels shows first."""
    import numpy as np

    gray = image.astype(np.float64).mean(-1)
    lap = np.zeros_like(gray)
    lap[1:-1, 1:-1] = np.abs(4 * gray[1:-1, 1:-1] - gray[:-2, 1:-1] - gray[2:, 1:-1]
                             - gray[1:-1, :-2] - gray[1:-1, 2:])  # fmt: skip
    integral = np.pad(lap.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    sums = (integral[size:, size:] - integral[:-size, size:] - integral[size:, :-size]
            + integral[:-size, :-size])  # fmt: skip
    row, col = np.unravel_index(int(np.argmax(sums)), sums.shape)
    return int(row), int(col)


def image_panels(sweep_dir: str | os.PathLike, runs: Sequence[Mapping[str, Any]]):
    """The reference and one prediction per row, as stored on disk.

    The loop writes each validation view as one PNG ``[reference | prediction]`` side by side
    (``mptex.train.validation``), already in viewing orientation (row 0 at the top): the
    report shows the arrays as read, never flips them, so the saved PNGs and images.png agree.

    Args:
        runs: one run per row (the first completed seed), each with ``run_dir``.

    Returns:
        ``(reference, [(run, prediction)])``: uint8 ``[H, W, 3]`` arrays (``reference`` None
        when no run has an image).
    """
    reference, predictions = None, []
    for run in runs:
        images = sorted((Path(sweep_dir) / run["run_dir"] / "images").glob("*.png"))
        if not images:
            continue
        side = _read_image(images[0])
        width = side.shape[1] // 2
        if reference is None:
            reference = side[:, :width]
        predictions.append((run, side[:, width : 2 * width]))
    return reference, predictions


def error_gain(errors: Sequence[Any]) -> int:
    """One amplification for every arm's error map: the power of two that maps the 99.5th
    percentile of all arms' non-zero absolute errors (8-bit sRGB) to at most 255, between 1 and
    256 (256 when every error is zero)."""
    import numpy as np

    values = np.concatenate([np.asarray(e).reshape(-1) for e in errors]) if errors else []
    # Exact zeros (the background, which every arm composites alike) would pull the percentile
    # to 0 and saturate every map.
    values = values[values > 0] if len(values) else values
    if not len(values):
        return 256
    p995 = float(np.percentile(values, 99.5))
    return int(min(256, max(1, 2 ** math.floor(math.log2(255.0 / p995)))))


def plot_images(
    path: str | os.PathLike,
    sweep_dir: str | os.PathLike,
    sections: Sequence[tuple[str, Sequence[int]]],
    rows: Sequence[Mapping[str, Any]],
    groups: Sequence[Sequence[Mapping[str, Any]]],
) -> int | None:
    """Per section three picture rows: the reference and each row's first validation view
    (lowest completed seed) with a red box, the box zoomed, and the error map
    ``|prediction - reference| x gain`` (8-bit sRGB, one gain for every arm of the figure).
    A section's panels fill lines of at most :data:`_IMAGE_COLS` columns, reference first, each
    line its own three picture rows.

    Returns:
        the gain, or None (nothing written) when no completed run has an image.
    """
    import numpy as np
    from matplotlib.patches import Rectangle

    blocks = []
    for title, indices in sections:
        firsts = {}
        for i in indices:
            done = [r for r in groups[i] if r["status"] == "completed"]
            if done:
                firsts[id(done[0])] = (done[0], rows[i])
        reference, predictions = image_panels(sweep_dir, [run for run, _ in firsts.values()])
        if reference is not None:
            preds = [(firsts[id(run)][1], run, pred) for run, pred in predictions]
            blocks.append((title, reference, preds))
    if not blocks:
        return None
    errors = [np.abs(pred.astype(np.int16) - ref.astype(np.int16)).max(-1)
              for _, ref, preds in blocks for _, _, pred in preds]  # fmt: skip
    gain = error_gain(errors)
    n_cols = min(_IMAGE_COLS, 1 + max(len(preds) for _, _, preds in blocks))
    # Each block's panels (its reference, then one per arm) fill lines of n_cols; a line is
    # three picture rows (view, zoom, error map).
    n_lines = [-(-(1 + len(preds)) // n_cols) for _, _, preds in blocks]
    fig, grid = _figure(n_cols, 3 * sum(n_lines), width=2.2, height=2.3)
    for ax in grid.flat:
        ax.axis("off")
    for b, (title, ref, preds) in enumerate(blocks):
        # A quarter of the shorter side, at least 8 pixels, at most the whole view (a view
        # under 8 pixels a side is zoomed whole).
        side = min(ref.shape[:2])
        size = min(side, max(8, side // 4))
        top, left = _detail_window(ref, size)
        panels = [("reference", ref, None)] + [
            (f"{_label(row)}\n{run['psnr']:.2f} dB", pred,
             np.abs(pred.astype(np.int16) - ref.astype(np.int16)))
            for row, run, pred in preds
        ]  # fmt: skip
        first_row = 3 * sum(n_lines[:b])
        for k, (name, image, error) in enumerate(panels):
            r, c = first_row + 3 * (k // n_cols), k % n_cols
            full, zoom, err = grid[r, c], grid[r + 1, c], grid[r + 2, c]
            full.imshow(image, interpolation="nearest")
            full.add_patch(Rectangle((left - 0.5, top - 0.5), size, size, fill=False,
                                     edgecolor="red", linewidth=1))  # fmt: skip
            full.set_title(f"{title}\n{name}" if k == 0 else name, fontsize="small")
            zoom.imshow(image[top : top + size, left : left + size], interpolation="nearest")
            zoom.set_title("zoom (red box)", fontsize="x-small")
            if error is not None:
                err.imshow(np.clip(error.max(-1) * gain, 0, 255), cmap="magma", vmin=0,
                           vmax=255, interpolation="nearest")  # fmt: skip
                err.set_title(f"|pred - ref| x {gain}", fontsize="x-small")
    import textwrap

    # Wrapped to the figure's width (about 30 characters per 2.2-inch column).
    caption = (f"validation view 0 of the lowest completed seed; error maps: |prediction - "
               f"reference| of the 8-bit sRGB images (max over channels) x {gain}, one scale "
               "for all arms")  # fmt: skip
    fig.suptitle(textwrap.fill(caption, 30 * n_cols), fontsize="small")
    fig.savefig(path, dpi=100)
    return gain
