"""The report's and the search's figures, read back from the data they hand to matplotlib.

Every plotting function here draws on a Figure and saves it; ``Figure.savefig`` is replaced by
one that keeps the figure and the path, so that each test reads the Axes' lines, bands, error
bars, images, labels and scales against values worked out by hand from constructed runs (no
pixels compared, nothing written).
"""

import numpy as np
import pytest
from matplotlib.figure import Figure

from mptex.report import attribution, plots
from mptex.search import report as search_report


@pytest.fixture
def saved(monkeypatch):
    """``[(figure, path), ...]`` of every savefig call, in order."""
    calls = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: calls.append((self, path)))
    return calls


def _run(status, history, **extra):
    return {"status": status, "history": history, **extra}


def _psnr_history(*pairs):
    return [{"iteration": i, "psnr": p} for i, p in pairs]


def _band(ax, k):
    """The (low, high) ends of the k-th band at each x, from its polygon's vertices."""
    vertices = ax.collections[k].get_paths()[0].vertices
    ends = {}
    for x, y in vertices:
        low, high = ends.get(x, (y, y))
        ends[x] = (min(low, y), max(high, y))
    return ends


# ----------------------------------------------------------------------------- curves
ROWS = [
    {"precision": "f32", "keys": {"precision.name": "f32"}},
    {"precision": "bf16", "keys": {"precision.name": "bf16", "precision.grid": "bfloat16"}},
]


def test_the_psnr_curve_is_the_mean_over_seeds_with_a_min_max_band(tmp_path, saved):
    groups = [
        # f32: three completed seeds (mean 14, median 12 at iteration 0); a failed run's
        # history is not drawn
        [_run("completed", _psnr_history((0, 10), (100, 20))),
         _run("completed", _psnr_history((0, 12), (100, 22))),
         _run("completed", _psnr_history((0, 20), (100, 24))),
         _run("failed", _psnr_history((0, 99), (100, 99)))],
        # bf16: a diverged run's curve counts up to where it stopped
        [_run("diverged", _psnr_history((0, 8), (100, 9))),
         _run("completed", _psnr_history((0, 10), (100, 13), (200, 15)))],
    ]  # fmt: skip
    path = tmp_path / "psnr_curves.png"
    assert plots.plot_history(path, [("Scene `s`", [0, 1])], ROWS, groups, "psnr") is True
    (fig, png), (same, pdf) = saved
    assert same is fig and png == path and pdf == tmp_path / "psnr_curves.pdf"
    (ax,) = fig.axes
    f32, bf16 = ax.lines
    assert list(f32.get_xdata()) == [0, 100] and list(f32.get_ydata()) == [14, 22]
    assert list(bf16.get_xdata()) == [0, 100, 200] and list(bf16.get_ydata()) == [9, 11, 15]
    assert _band(ax, 0) == {0: (10, 20), 100: (20, 24)}
    assert _band(ax, 1) == {0: (8, 10), 100: (9, 13), 200: (15, 15)}
    assert f32.get_label() == "f32" and bf16.get_label() == "bf16 grid=bfloat16"
    assert f32.get_color() == plots.ARM_COLORS["f32"]
    assert bf16.get_color() == plots.ARM_COLORS["bf16"]
    assert ax.get_xlabel() == "iteration" and ax.get_ylabel() == "validation PSNR (dB)"
    assert ax.get_title() == "Scene `s`" and ax.get_yscale() == "linear"


def test_the_loss_scale_curve_is_the_effective_scale_on_a_log2_axis(tmp_path, saved):
    rows = [ROWS[0], {"precision": "f16_dynamic", "keys": {"precision.name": "f16_dynamic"}}]
    groups = [
        [_run("completed", [{"iteration": 0, "loss_scale": 1.0}, {"iteration": 10,
                                                                  "loss_scale": 1.0}])],
        # a recorded effective scale wins over the GradScaler scale beside it
        [_run("completed", [{"iteration": 0, "loss_scale": 4.0, "effective_loss_scale": 512.0},
                            {"iteration": 10, "loss_scale": 2.0,
                             "effective_loss_scale": 256.0}])],
    ]  # fmt: skip
    assert plots.plot_history(tmp_path / "loss_scale.png", [("s", [0, 1])], rows, groups,
                              "loss_scale")  # fmt: skip
    (ax,) = saved[0][0].axes
    first, second = ax.lines
    # the k-th arm's line drawn x 2^(0.1 k); the legend gives the true last value
    assert list(first.get_ydata()) == [1.0, 1.0]
    assert list(second.get_ydata()) == pytest.approx([512 * 2**0.1, 256 * 2**0.1])
    assert first.get_label() == "f32 (last 1)"
    assert second.get_label() == "f16_dynamic (last 256)"
    assert ax.get_yscale() == "log" and ax.yaxis.get_transform().base == 2
    assert ax.get_ylabel() == "effective loss scale" and ax.get_xlabel() == "iteration"


def test_a_loss_scale_without_a_recorded_effective_scale_carries_nvdiffrecs_x128(tmp_path, saved):
    rows = [{"precision": "nvdiffrec", "keys": {"precision.name": "nvdiffrec"}}]
    config = {"precision.loss_scaling": "nvdiffrec", "precision.static_loss_scale": 128.0}
    groups = [[_run("completed", [{"iteration": 0, "loss_scale": 2.0}], config=config)]]
    assert plots.plot_history(tmp_path / "l.png", [("s", [0])], rows, groups, "loss_scale")
    (line,) = saved[0][0].axes[0].lines
    assert list(line.get_ydata()) == [256.0]


def _arms(n):
    """``n`` rows with their one-run groups (names of a sweep's length, 4-13 characters)."""
    names = [f"arm_{k}" + "x" * (k % 10) for k in range(n)]
    rows = [{"precision": name, "keys": {"precision.name": name}} for name in names]
    groups = [[_run("completed", _psnr_history((0, 10 + k), (100, 20 + k)))] for k in range(n)]
    return rows, groups


@pytest.mark.parametrize("n_arms", [2, 8, 9, 20, 30])
def test_a_legend_too_tall_for_its_panel_goes_beside_it_inside_the_figure(tmp_path, saved, n_arms):
    rows, groups = _arms(n_arms)
    sections = [("scene a", list(range(n_arms))), ("scene b", list(range(n_arms)))]
    assert plots.plot_history(tmp_path / "p.png", sections, rows, groups, "psnr")
    fig = saved[0][0]
    fig.canvas.draw()  # places the constrained layout's axes and the legends
    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    for ax in fig.axes:
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == [r["precision"] for r in rows]
        box, panel = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        # every entry on the figure: none cut off at its top or right edge
        assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1 + 0.5
        assert figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1 + 0.5
        if n_arms <= plots._LEGEND_INSIDE_MAX:
            assert panel.x0 <= box.x0 and box.x1 <= panel.x1
        else:
            # beside the panel (no curve or title under it), in columns of at most 12 entries
            assert box.x0 >= panel.x1 and box.y1 <= panel.y1 + 0.5
            assert legend._ncols == -(-n_arms // 12)
            assert ax.title.get_window_extent(renderer).x1 <= box.x0
    # the second panel starts right of the first one's legend
    first, second = fig.axes
    assert first.get_legend().get_window_extent(renderer).x1 <= second.get_window_extent(
        renderer).x0  # fmt: skip


@pytest.mark.parametrize(
    "n_sections, shape", [(1, (1, 1)), (3, (1, 3)), (4, (2, 2)), (5, (2, 3)), (7, (3, 3))]
)
def test_panels_past_three_wrap_into_a_near_square_grid_in_section_order(
    tmp_path, saved, n_sections, shape
):
    rows, groups = _arms(2)
    sections = [(f"scene {k}", [0, 1]) for k in range(n_sections)]
    assert plots.plot_history(tmp_path / "p.png", sections, rows, groups, "psnr")
    fig = saved[0][0]
    assert [ax.get_title() for ax in fig.axes] == [title for title, _ in sections]
    grid = fig.axes[0].get_subplotspec().get_gridspec()
    assert (grid.nrows, grid.ncols) == shape
    positions = [ax.get_subplotspec().rowspan.start * shape[1]
                 + ax.get_subplotspec().colspan.start for ax in fig.axes]  # fmt: skip
    assert positions == list(range(n_sections))
    assert tuple(fig.get_size_inches()) == (6.0 * shape[1], 4.0 * shape[0])


def test_nothing_is_drawn_from_runs_that_neither_completed_nor_diverged(tmp_path, saved):
    groups = [[_run("failed", _psnr_history((0, 10)))], [_run("collapsed", _psnr_history((0, 9)))]]
    assert plots.plot_history(tmp_path / "p.png", [("s", [0, 1])], ROWS, groups, "psnr") is False
    assert saved == []


# ----------------------------------------------------------------------------- images
def _reference():
    """40 x 56 pixels, flat but for a checker patch off the diagonal: its detail window's row
    and column differ, so that a swapped box or zoom shows; a quarter of the shorter side (10)
    is over the 8-pixel floor, so that the box's size is the quarter's."""
    image = np.full((40, 56, 3), 100, np.uint8)
    image[2:6, 30:34] = np.indices((4, 4)).sum(0)[..., None] % 2 * 200
    return image


def _write_view(folder, reference, prediction):
    import imageio.v3 as iio

    (folder / "images").mkdir(parents=True)
    iio.imwrite(folder / "images" / "val_000.png", np.concatenate([reference, prediction], 1))


def test_the_images_show_the_lowest_completed_seed_its_box_zoom_and_error_map(tmp_path, saved):
    reference = _reference()
    first, later, diverged, other = (reference.copy() for _ in range(4))
    first[1, 1] = 110  # an error of 10 (and 10 in the other arm): gain 2^floor(log2 25.5) = 16
    later[1, 1] = 0
    diverged[1, 1] = 0
    other[1, 2] = 90
    for name, image in (("a0", first), ("a1", later), ("b0", diverged), ("b1", other)):
        _write_view(tmp_path / name, reference, image)
    groups = [
        [{"status": "completed", "run_dir": "a0", "psnr": 31.0},
         {"status": "completed", "run_dir": "a1", "psnr": 29.0}],
        [{"status": "diverged", "run_dir": "b0", "psnr": 5.0},
         {"status": "completed", "run_dir": "b1", "psnr": 30.5}],
    ]  # fmt: skip
    gain = plots.plot_images(tmp_path / "images.png", tmp_path, [("s", [0, 1])], ROWS, groups)
    assert gain == 16
    (fig, path), = saved  # fmt: skip
    assert path == tmp_path / "images.png"
    grid = np.array(fig.axes).reshape(3, 3)  # reference + two arms; full, zoom, error rows
    size = 10  # max(8, 40 // 4), at most the shorter side
    top, left = plots._detail_window(reference, size)
    assert top != left  # the test's premise: a swap of the two shows
    for c, image in enumerate((reference, first, other)):
        full, zoom = grid[0, c], grid[1, c]
        assert np.array_equal(full.images[0].get_array(), image)
        (box,) = full.patches
        assert box.get_xy() == (left - 0.5, top - 0.5)
        assert (box.get_width(), box.get_height()) == (size, size)
        assert np.array_equal(zoom.images[0].get_array(),
                              image[top : top + size, left : left + size])  # fmt: skip
    assert grid[0, 1].get_title() == "f32\n31.00 dB"
    assert grid[0, 2].get_title() == "bf16 grid=bfloat16\n30.50 dB"
    assert len(grid[2, 0].images) == 0  # no error map for the reference
    error = np.asarray(grid[2, 1].images[0].get_array())
    expected = np.zeros((40, 56))
    expected[1, 1] = 160
    assert np.array_equal(error, expected) and grid[2, 1].get_title() == "|pred - ref| x 16"


def test_the_images_of_many_arms_wrap_onto_lines_of_eight_columns_per_section(tmp_path, saved):
    # 10 arms in scene a (11 panels: lines of 8 and 3), 2 in scene b (one line): 3 lines of
    # three picture rows each, every panel at its section's place in reading order.
    reference = _reference()
    rows, groups, sections = [], [], [("a", []), ("b", [])]
    for k in range(12):
        prediction = reference.copy()
        prediction[0, k] = 101  # tells the arms' panels apart
        _write_view(tmp_path / f"r{k}", reference, prediction)
        rows.append({"precision": f"arm{k}", "keys": {"precision.name": f"arm{k}"}})
        groups.append([{"status": "completed", "run_dir": f"r{k}", "psnr": 20.0 + k}])
        sections[0 if k < 10 else 1][1].append(k)
    assert plots.plot_images(tmp_path / "images.png", tmp_path, sections, rows, groups) == 128
    fig = saved[0][0]
    assert tuple(fig.get_size_inches()) == (8 * 2.2, 9 * 2.3)
    grid = np.array(fig.axes).reshape(9, 8)
    titles = [[ax.get_title() for ax in line] for line in grid[::3]]
    assert titles[0] == ["a\nreference"] + [f"arm{k}\n{20 + k:.2f} dB" for k in range(7)]
    assert titles[1] == [f"arm{k}\n{20 + k:.2f} dB" for k in (7, 8, 9)] + [""] * 5
    assert titles[2] == ["b\nreference", "arm10\n30.00 dB", "arm11\n31.00 dB"] + [""] * 5
    for r, c, k in ((0, 1, 0), (3, 0, 7), (3, 2, 9), (6, 2, 11)):
        assert grid[r, c].images[0].get_array()[0, k, 0] == 101
        assert grid[r + 2, c].images[0].get_array()[0, k] == 128  # error 1 x gain 128
    assert all(not ax.images for ax in grid[3:6, 3:].flat) and not grid[8, 0].images


# ----------------------------------------------------------------------------- pareto.png
def _summary(measured=False):
    cert = {"certified": True, "mean": 0.1, "low": -0.1, "high": 0.4}
    fails = {"certified": False, "mean": -0.8, "low": -1.2, "high": -0.5}
    return {
        "screen_seed": 0, "margin_db": 0.5, "certified": "bf16", "confidence": 0.95,
        "cost": {"measured": measured, "gpu_name": "H100"},
        "candidates": [
            {"candidate": "f32", "cost_s": 100e-6, "certificate": None, "delta_db": {"0": 0.0}},
            {"candidate": "bf16", "cost_s": 60e-6, "certificate": cert, "delta_db": {"0": 0.3}},
            {"candidate": "f16", "cost_s": 40e-6, "certificate": fails, "delta_db": {"0": -0.7}},
            {"candidate": "fp8", "cost_s": 20e-6, "certificate": None, "delta_db": {"0": -3.0}},
            # no quality at the screen seed: not drawn
            {"candidate": "int8", "cost_s": 10e-6, "certificate": None, "delta_db": {}},
        ],
    }  # fmt: skip


def test_the_pareto_figure_puts_cost_in_us_against_the_certified_mean(tmp_path, saved):
    assert search_report._plot(tmp_path / "pareto.png", _summary()) is True
    (ax,) = saved[0][0].axes
    by_label = {line.get_label(): line for line in ax.lines}
    front = by_label["Pareto front"]
    # (cost, |Δ|): no point beats another on both, so all four are on the front, by cost;
    # a certified candidate's quality is its certificate's mean, not its screen's Δ
    assert list(front.get_xdata()) == pytest.approx([20, 40, 60, 100])
    assert list(front.get_ydata()) == pytest.approx([-3.0, -0.8, 0.1, 0.0])
    star = by_label["certified: bf16"]
    assert list(star.get_xdata()) == pytest.approx([60]) and list(star.get_ydata()) == [0.1]
    # error bars: the certificate's interval, low to high, green where certified
    bars = {}
    for container in ax.containers:
        data, _, (segments,) = container
        ((x0, low), (x1, high)), = segments.get_segments()  # fmt: skip
        bars[round(x0, 6)] = (round(low, 6), round(high, 6), data.get_color())
    assert bars == {60: (-0.1, 0.4, "tab:green"), 40: (-1.2, -0.5, "tab:red")}
    hollow = [(float(line.get_xdata()[0]), float(line.get_ydata()[0])) for line in ax.lines
              if line.get_marker() == "o" and line.get_markerfacecolor() == "none"]  # fmt: skip
    # one approx per point: pytest >= 9.2 refuses approx of a list of tuples (TypeError)
    assert hollow == [pytest.approx((100, 0.0)), pytest.approx((20, -3.0))]
    band = ax.patches[0]  # the margin
    assert (band.get_y(), band.get_y() + band.get_height()) == (-0.5, 0.5)
    assert ax.get_xlabel() == "modelled µs / iteration on H100"
    assert ax.get_ylabel() == "PSNR − PSNR(f32) [dB]"
    assert [t.get_text() for t in ax.texts] == ["f32", "bf16", "f16", "fp8"]


def test_measured_costs_are_labelled_measured(tmp_path, saved):
    search_report._plot(tmp_path / "pareto.png", _summary(measured=True))
    assert saved[0][0].axes[0].get_xlabel() == "measured µs / iteration on H100"


# ----------------------------------------------------------------------------- gap_curves.png
def _term(arm, minus, curve):
    return {
        "arm": arm,
        "minus": minus,
        "curve": {i: {"mean": m, "low": lo, "high": hi} for i, (m, lo, hi) in curve.items()},
    }


def test_the_gap_plot_draws_the_gap_and_each_term_with_its_interval(tmp_path, saved):
    gap = _term("tcnn_fused", "nvdiffrec", {0: (-1.0, -1.5, -0.25), 50: (-2.0, -3.0, -1.25)})
    terms = [_term("tcnn_fused_swap154", "tcnn_fused", {0: (0.5, 0.25, 0.75)}),
             _term("f16_dynamic", "nvdiffrec", {0: (-0.5, -0.75, 0.0)}),
             _term("bf16", "f32", {})]  # no curve: not drawn  # fmt: skip
    result = {"gap": gap, "decomposition": terms}
    assert attribution.plot_gap(tmp_path / "gap_curves.png", [({"scene": "s"}, result)])
    (ax,) = saved[0][0].axes
    lines = [line for line in ax.lines if not line.get_label().startswith("_")]
    assert [line.get_label() for line in lines] == [
        "tcnn_fused − nvdiffrec (the gap)", "tcnn_fused_swap154 − tcnn_fused",
        "f16_dynamic − nvdiffrec"]  # fmt: skip
    assert list(lines[0].get_ydata()) == [-1.0, -2.0]
    assert [line.get_color() for line in lines] == [
        "black",
        plots.arm_color("tcnn_fused_swap154"),
        plots.arm_color("f16_dynamic"),
    ]
    assert _band(ax, 0) == {0: (-1.5, -0.25), 50: (-3.0, -1.25)}
    assert _band(ax, 1) == {0: (0.25, 0.75)}
    assert ax.get_ylabel() == "ΔPSNR (dB), paired by seed" and ax.get_xlabel() == "iteration"
    assert ax.get_title().endswith("CI, scene=s")
