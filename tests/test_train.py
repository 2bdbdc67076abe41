"""Tests for mptex.train: the loop, metrics.json, resume, atomic checkpoints, divergence."""

from __future__ import annotations

import csv
import functools
import json
import math
import mmap
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import mptex.train as mtrain
from mptex.cli import CONFIG_DIR
from mptex.train import (
    ConfigError,
    image_loss,
    load_checkpoint,
    load_texture,
    lr_schedule,
    psnr,
    train,
    validate_config,
)

# A seconds-long run: 32 px views, 4 training views, 2 validation views, a 4-level grid.
TINY = [
    "train=tiny",
    "texture=tiny",
    "scene.resolution=32",
    "scene.n_train_views=4",
    "scene.n_val_views=2",
    "scene.tubular_segments=48",
    "scene.radial_segments=8",
]
CPU_ARMS = [
    "nvdiffrec",
    "f32",
    "f16_naive",
    "f16_static",
    "f16_dynamic",
    "amp",
    "bf16",
    "per_layer",
    # tcnn_fused and the #154 arms: the fused network's torch twin on a CPU
    "tcnn_fused",
    "tcnn_fused_swap154",
    "tcnn_fused_dynamic",
    "tcnn_fused_f32acc",
    "tcnn_fused_nosplitk",
    "tcnn_fused_scale1024",
    "nvdiffrec_scale1",
]


def tiny_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[*TINY, *overrides])


_TYPES = {
    "status": str, "psnr": float, "baseline_psnr": float, "psnr_per_image": list,
    "saturation": dict,
    "precision": str, "scene": str, "seed": int, "iterations": int,
    "iterations_planned": int, "final_loss": float, "time_per_iter_s": float,
    "wall_time_s": float, "train_time_s": float, "time_split_s": dict,
    "wall_time_total_s": float, "train_time_total_s": float, "time_total_complete": bool,
    "peak_memory_bytes": int, "start_peak_memory_bytes": int,
    "peak_memory_kind": str, "skipped_steps": int, "final_loss_scale": float,
    "n_params": int, "device": str, "device_name": str, "torch_threads": int,
    "versions": dict, "run_dir": str, "history": list, "config": dict,
}  # fmt: skip


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.parametrize("arm", CPU_ARMS)
def test_every_cpu_arm_writes_complete_metrics(tmp_path, arm):
    train(tiny_cfg(f"precision={arm}", "train.iterations=4", "train.val_interval=2"), tmp_path)
    m = read_metrics(tmp_path)
    assert set(m) == set(mtrain.METRICS_KEYS)
    if arm == "f16_naive":
        # Measured (docs/benchmarks.md, "Precision arms"): f16 Adam state
        # underflows (eps = 1e-8 rounds to 0) and the parameters turn NaN at the first step; the
        # stepper's check after that step ends the run there. That is this arm's finding:
        # recorded, not a crash, and no checkpoint holds the NaN weights.
        assert m["status"] == "diverged" and m["diverged_at"] == 0 and m["psnr"] is None
        assert not (tmp_path / "checkpoint.pt").exists()
        assert [h["iteration"] for h in m["history"]] == [1]
        return
    for key, kind in _TYPES.items():
        assert isinstance(m[key], kind), (key, m[key])
    assert m["status"] == "completed" and m["precision"] == arm and m["iterations"] == 4
    assert m["diverged_at"] is None and m["error"] is None
    assert m["peak_memory_kind"] in ("run_peak_rss", "process_peak_rss", "cuda_max_allocated")
    assert m["peak_memory_bytes"] > 0
    assert set(m["versions"]) >= {"mptex", "torch", "python", "cuda"}
    # The CPU's vector capability picks the kernels whose rounding a run's bits depend on.
    capability = torch.backends.cpu.get_cpu_capability()
    assert m["device_name"].endswith(f" cores, {capability})"), m["device_name"]
    # On a CPU every arm runs mptex's PyTorch twins (tcnn_fused included) and the torch
    # rasterizer, and says so.
    assert m["backends"] == {"encoder": "torch", "mlp": "torch", "raster": "torch"}
    assert [h["iteration"] for h in m["history"]] == list(range(1, 5))
    for h in m["history"]:
        assert set(h) >= {"iteration", "loss", "psnr", "loss_scale", "skipped"}
    assert [h["iteration"] for h in m["history"] if h["psnr"] is not None] == [2, 4]
    assert (tmp_path / "images" / "val_000.png").is_file()
    assert (tmp_path / "checkpoint.pt").is_file()


def test_psnr_rises_and_beats_the_constant_baseline(tmp_path):
    train(tiny_cfg("train.iterations=30", "train.val_interval=10"), tmp_path)
    m = read_metrics(tmp_path)
    curve = [h["psnr"] for h in m["history"] if h["psnr"] is not None]
    assert len(curve) == 3 and curve[-1] > curve[0]
    assert m["psnr"] == curve[-1] and m["psnr"] > m["baseline_psnr"]
    # A healthy fit: no covered pixel saturated at a wrong value, at any validation.
    validations = [h for h in m["history"] if h["psnr"] is not None]
    assert all(h["stuck_fraction"] == [0.0, 0.0, 0.0] for h in validations)
    assert m["saturation"]["stuck_fraction"] == validations[-1]["stuck_fraction"]
    assert m["saturation"]["covered_pixels"] > 0


def _saturating_build(monkeypatch):
    """Make the loop's textures start saturated: grid features of order 1 (tcnn's init gives
    1e-4) and a last layer of +-1e3 per channel, so every logit is ~+-1e3 (yellow, (1, 1, 0)):
    the sigmoid's float32 gradient there is 0 (or ~1e-40), the run cannot leave it."""
    build = mtrain.loop.build_texture

    def saturated(*args, **kwargs):
        texture = build(*args, **kwargs)
        with torch.no_grad():
            texture.encoder.params.mul_(1e4)
            last = texture.net.layers[-1].weight
            last.copy_(torch.tensor([1e3, 1e3, -1e3])[:, None].expand_as(last))
        return texture

    monkeypatch.setattr(mtrain.loop, "build_texture", saturated)


def test_a_run_forced_to_saturate_is_reported_collapsed(tmp_path, monkeypatch):
    from mptex.report import summarize, write_report
    from mptex.report.collect import collect_runs

    steps = ("train.iterations=40", "train.val_interval=10")
    for arm in ("f32", "bf16"):
        for seed in (0, 1, 2):
            if (arm, seed) == ("f32", 1):
                _saturating_build(monkeypatch)
            train(tiny_cfg(f"precision={arm}", f"train.seed={seed}", *steps),
                  tmp_path / f"{arm}_{seed}")  # fmt: skip
            monkeypatch.undo()
    m = read_metrics(tmp_path / "f32_1")
    assert m["status"] == "completed"  # the loop records what happened; the report names it
    assert m["saturation"]["saturated_fraction"] == [1.0, 1.0, 1.0]
    assert min(m["saturation"]["stuck_fraction"]) > 0.8  # measured: 0.97, 0.89, 0.97
    validations = [h for h in m["history"] if h["psnr"] is not None]
    assert [h["iteration"] for h in validations] == [10, 20, 30, 40]
    assert all(min(h["stuck_fraction"]) > 0.8 for h in validations)  # from the first one
    assert m["psnr"] < m["baseline_psnr"]
    assert max(h["psnr"] for h in validations) - min(h["psnr"] for h in validations) < 0.2
    # The monitor saw it on the training batches too.
    sampled = [h for h in m["history"] if "output.saturated_frac.0" in h]
    assert sampled and all(h["output.saturated_frac.2"] == 1.0 for h in sampled)

    runs = {(r["precision"], r["seed"]): r for r in collect_runs(tmp_path)}
    collapsed = runs[("f32", 1)]
    assert collapsed["status"] == "collapsed" and collapsed["collapsed"] is True
    assert collapsed["collapse"]["rule"] == "stuck"
    assert collapsed["collapse"]["stuck_since"] == 10
    assert collapsed["collapse"]["flat_since"] == 10
    assert all(r["status"] == "completed" for key, r in runs.items() if key != ("f32", 1))
    rows = {r["precision"]: r for r in summarize(list(runs.values()))}
    assert rows["f32"]["completed"] == 2 and rows["f32"]["collapsed"] == 1
    assert rows["f32"]["n_seeds"] == 2
    # bf16's seed 1 lost its f32 partner: two pairs left, and none of them is the collapse.
    assert [seed for seed, _ in rows["bf16"]["pairs"]] == [0, 2]
    assert rows["bf16"]["excluded"] == [
        {"seed": 1, "run_dir": "bf16_1", "why": "its f32 run collapsed"}
    ]
    write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "6 runs, 5 completed, 1 collapsed" in text
    assert "- Collapsed (1 run; counted apart from the completed runs" in text
    assert "`f32` seed 1: 9" in text and "% of covered pixels stuck in channel" in text
    assert ("- Excluded from the paired differences: `f32` seed 1 (collapsed), `bf16` seed 1 "
            "(its f32 run collapsed).") in text  # fmt: skip
    with (tmp_path / "results.csv").open(newline="") as f:
        flags = {(r["precision"], r["seed"]): r["collapsed"] for r in csv.DictReader(f)}
    assert flags.pop(("f32", "1")) == "True" and set(flags.values()) == {"False"}


def test_the_starts_memory_peak_is_recorded_apart_and_the_report_names_it(tmp_path, monkeypatch):
    """A start whose G-buffers peak above everything after it (a large mesh): the run's
    peak_memory_bytes is the training's, start_peak_memory_bytes the start's, and the report's
    notes say that a job needs the start's."""
    from mptex.report import write_report
    from mptex.train import memory

    statm = tmp_path / "statm"
    statm.write_text("3000 300 10 20 0 30 0\n")  # resident: the second column, in pages
    monkeypatch.setattr(memory.RunPeakRss, "_STATM", str(statm))
    # sampled at start, split and stop only
    hourly = functools.partialmethod(memory.RunPeakRss.__init__, interval_s=3600)
    monkeypatch.setattr(memory.RunPeakRss, "__init__", hourly)
    samplers = []
    real_measure, real_build = mtrain.loop.measure_memory, mtrain.loop.build_scene

    def measure(device):
        samplers.append(real_measure(device))
        return samplers[-1]

    def build(cfg, device):
        scene = real_build(cfg, device)
        statm.write_text("30000 5000 10 20 0 30 0\n")
        samplers[-1]._sample()  # the start's high point, seen by the sampler
        statm.write_text("3000 400 10 20 0 30 0\n")  # freed before the start ends
        return scene

    monkeypatch.setattr(mtrain.loop, "measure_memory", measure)
    monkeypatch.setattr(mtrain.loop, "build_scene", build)
    page = os.sysconf("SC_PAGE_SIZE")
    for seed in (0, 1):
        train(tiny_cfg("train.iterations=2", f"train.seed={seed}"), tmp_path / f"f32_{seed}")
        m = read_metrics(tmp_path / f"f32_{seed}")
        assert m["status"] == "completed"
        assert (m["start_peak_memory_bytes"], m["peak_memory_bytes"]) == (5000 * page, 400 * page)
    write_report(tmp_path)
    text = " ".join((tmp_path / "report.md").read_text().split())
    assert (f"`start_peak_memory_bytes`; the largest over the completed runs is "
            f"{5000 * page / 2**20:.0f} MiB, more than the column's largest: a job needs that "
            "much.") in text  # fmt: skip
    with (tmp_path / "results.csv").open(newline="") as f:
        assert {int(r["start_peak_memory_bytes"]) for r in csv.DictReader(f)} == {5000 * page}


def test_two_runs_give_identical_metrics_except_timings(tmp_path):
    timing = {"time_per_iter_s", "wall_time_s", "train_time_s", "time_split_s",
              "wall_time_total_s", "train_time_total_s", "peak_memory_bytes",
              "start_peak_memory_bytes",
              "run_dir"}  # fmt: skip
    runs = []
    for name in ("a", "b"):
        train(tiny_cfg("precision=f16_dynamic", "train.iterations=8"), tmp_path / name)
        runs.append({k: v for k, v in read_metrics(tmp_path / name).items() if k not in timing})
    assert runs[0] == runs[1]


def test_time_split_adds_up_to_the_wall_time(tmp_path):
    train(tiny_cfg("train.iterations=6", "train.val_interval=3", "train.stats_interval=2",
                   "train.checkpoint_interval=2"), tmp_path)  # fmt: skip
    m = read_metrics(tmp_path)
    split = m["time_split_s"]
    assert set(split) == {"start", "iterations", "sampled_iterations", "validation",
                          "checkpoints", "rest"}  # fmt: skip
    assert all(v >= 0 for v in split.values()), split
    # Disjoint parts of one interval (sampled_iterations is a part of iterations).
    parts = sum(v for k, v in split.items() if k != "sampled_iterations")
    assert parts == pytest.approx(m["wall_time_s"], rel=1e-9), split
    # Iterations 0, 2 and 4 collected statistics; 6 iterations were timed one by one.
    assert 0 < split["sampled_iterations"] < split["iterations"] <= m["train_time_s"]
    assert split["iterations"] >= 6 * m["time_per_iter_s"] / 2  # the median of 6 positive times
    # Two validations in the loop (3, 6), checkpoints at 2 and 4 and the final one.
    assert split["validation"] > 0 and split["checkpoints"] > 0 and split["start"] > 0


def test_init_seed_sets_the_initial_weights_and_train_seed_the_rest(tmp_path, monkeypatch):
    # What each run drew: its texture's weights right after construction, and the state of the
    # view generator before every training batch (the data order).
    import mptex.train.loop as loop
    from mptex.scenes.scene import Scene

    drawn: dict[str, dict] = {}
    build, sample = loop.build_texture, Scene.training_batch

    def recording_build(*args, **kwargs):
        texture = build(*args, **kwargs)
        current["init"] = {k: v.clone() for k, v in texture.state_dict().items()}
        return texture

    def recording_sample(self, batch_size, generator, *args, **kwargs):
        current["views"].append(generator.get_state().clone())
        return sample(self, batch_size, generator, *args, **kwargs)

    monkeypatch.setattr(loop, "build_texture", recording_build)
    monkeypatch.setattr(Scene, "training_batch", recording_sample)
    runs = {
        "seed3": ["train.seed=3"],
        "init3_seed3": ["train.seed=3", "train.init_seed=3"],
        "init3_seed5": ["train.seed=5", "train.init_seed=3"],
        "seed5": ["train.seed=5"],
    }
    for name, overrides in runs.items():
        current = drawn[name] = {"views": []}
        train(tiny_cfg("precision=f32", "train.iterations=3", *overrides), tmp_path / name)

    def same(a, b, key):
        if key == "views":
            return all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True))
        return all(torch.equal(a[key][k], b[key][k]) for k in a[key])

    # init_seed equal to seed changes nothing, bit for bit.
    assert same(drawn["seed3"], drawn["init3_seed3"], "init")
    psnr = {name: read_metrics(tmp_path / name)["psnr"] for name in runs}
    assert psnr["seed3"] == psnr["init3_seed3"]
    # init_seed=3 with seed=5: seed 3's initial weights, seed 5's data order.
    assert same(drawn["init3_seed5"], drawn["seed3"], "init")
    assert not same(drawn["init3_seed5"], drawn["seed5"], "init")
    assert same(drawn["init3_seed5"], drawn["seed5"], "views")
    assert not same(drawn["init3_seed5"], drawn["seed3"], "views")


def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg("precision=f16_dynamic", "train.iterations=8"), full)
    train(tiny_cfg("precision=f16_dynamic", "train.iterations=3"), part)
    assert load_checkpoint(part / "checkpoint.pt")["iteration"] == 3
    m = train(tiny_cfg("precision=f16_dynamic", "train.iterations=8", "train.resume=true"), part)
    assert m["resumed_from"] == 3 and m["iterations"] == 8
    a, b = load_checkpoint(full / "checkpoint.pt"), load_checkpoint(part / "checkpoint.pt")
    for key, value in a["texture"].items():
        assert torch.equal(value, b["texture"][key]), key
    # The interrupted run also validated at its last iteration (3): only what a validation
    # writes (its PSNR and saturation statistics) differs.
    val_keys = {"psnr", "saturated_fraction", "stuck_fraction"}
    drop = [{k: v for k, v in h.items() if k not in val_keys} for h in a["history"]]
    assert drop == [{k: v for k, v in h.items() if k not in val_keys} for h in b["history"]]
    assert read_metrics(full)["psnr"] == m["psnr"]


def test_checkpoint_survives_an_interrupted_write(tmp_path, monkeypatch):
    train(tiny_cfg("train.iterations=4"), tmp_path)
    path = tmp_path / "checkpoint.pt"
    before = path.read_bytes()

    def dies_mid_write(state, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # a kill in the middle of torch.save

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        mtrain.save_checkpoint(path, {"iteration": 99})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    monkeypatch.undo()
    assert load_checkpoint(path)["iteration"] == 4
    texture = load_texture(path)
    out = texture.sample(torch.zeros(5, 3))
    assert out.shape == (5, 3) and out.dtype == torch.float32


def test_nonfinite_loss_without_loss_scaling_is_a_divergence(tmp_path):
    m = train(tiny_cfg("precision=f32", "train.inject_nonfinite_at=3"), tmp_path)
    assert m["status"] == "diverged" and m["diverged_at"] == 3 and m["iterations"] == 3
    assert read_metrics(tmp_path)["status"] == "diverged"


def test_nonfinite_loss_with_loss_scaling_is_a_skipped_step(tmp_path):
    m = train(tiny_cfg("precision=f16_static", "train.iterations=5",
                       "train.inject_nonfinite_at=2"), tmp_path)  # fmt: skip
    assert m["status"] == "completed" and m["skipped_steps"] == 1
    assert m["history"][2]["skipped"] is True


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.iterations=-1", "train.iterations"),
        ("train.iterations=0", "train.iterations"),
        ("train.loss=l3", "train.loss"),
        ("train.background=grey", "train.background"),
        ("train.shading=diffuse", "train.shading"),
        ("+train.itterations=3", "train.itterations"),
        ("precision.mlp_dtypes=[f8]", "precision.mlp_dtypes"),
    ],
)
def test_config_errors_name_the_key_and_are_recorded(tmp_path, override, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        train(tiny_cfg(override), tmp_path)
    m = read_metrics(tmp_path)
    assert m["status"] == "failed" and m["failed_at"] == "start" and m["error"].startswith(key)


def test_a_run_of_no_iterations_is_refused_at_start_in_one_line():
    # Zero steps would evaluate the initial texture and record it as a completed run: a sweep
    # of such runs compared every arm's untrained texture with f32's and called the arms
    # equal ("no detectable difference"), and a search would certify its cheapest candidate.
    with pytest.raises(ConfigError) as info:
        validate_config(tiny_cfg("train.iterations=0"), machine=False)
    assert str(info.value) == (
        "train.iterations: expected an integer >= 1 (optimizer steps; 0 would train nothing), got 0"
    )
    one = validate_config(tiny_cfg("train.iterations=1"), machine=False)
    assert one["train"]["iterations"] == 1


@pytest.mark.parametrize("device", ["", "gpu", "cuda:x", "cpu:0:1"])
def test_a_device_torch_cannot_read_says_what_was_expected(device):
    # torch's own words were "Device string must not be empty" for '' (no expectation) and a
    # list of twenty device types (ipu, xpu, mkldnn, ...) for 'gpu'.
    with pytest.raises(ConfigError) as info:
        validate_config(tiny_cfg(f"train.device='{device}'"), machine=False)
    assert str(info.value) == f"train.device: expected auto, cpu, cuda or cuda:N, got {device!r}"


def test_an_empty_arm_name_is_refused_at_start():
    # An f32 run named '' trained, and its sweep's report listed it as the arm `unknown`, with
    # no reference to compare with: the name a report groups runs by cannot be empty.
    with pytest.raises(ValueError) as info:
        validate_config(tiny_cfg("precision.name=''"), machine=False)
    assert str(info.value) == (
        "precision.name: expected a non-empty string (the arm's name in reports), got ''"
    )


def test_crash_mid_run_is_recorded_then_raised(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(mtrain.loop, "evaluate", broken)
    with pytest.raises(RuntimeError, match="boom"):
        train(tiny_cfg("train.iterations=3", "train.val_interval=2"), tmp_path)
    m = read_metrics(tmp_path)
    assert m["status"] == "failed" and "boom" in m["error"] and m["failed_at"] == 2


def test_diffuse_shading_with_nine_channels(tmp_path):
    m = train(tiny_cfg("texture.channels=9", "train.shading=diffuse", "train.iterations=3"),
              tmp_path)  # fmt: skip
    assert m["status"] == "completed" and math.isfinite(m["psnr"])


def test_lr_schedule_is_nvdiffrecs():
    assert lr_schedule(0, 0) == 1.0
    assert lr_schedule(5, 10) == 0.5
    assert lr_schedule(10, 10) == 1.0
    assert lr_schedule(5010, 10) == pytest.approx(0.1)


def test_cosine_lr_schedule_on_hand_computed_values():
    # 0.5 * (1 + cos(pi * t)) at t = 0, 1/4, 1/2, 1 of the run after warm-up.
    assert lr_schedule(0, kind="cosine", iterations=200) == 1.0
    assert lr_schedule(50, kind="cosine", iterations=200) == pytest.approx(0.8535533905932737)
    assert lr_schedule(100, kind="cosine", iterations=200) == pytest.approx(0.5)
    assert lr_schedule(200, kind="cosine", iterations=200) == pytest.approx(0.0, abs=1e-12)
    assert lr_schedule(5, 10, kind="cosine", iterations=110) == 0.5  # warm-up ramp
    assert lr_schedule(60, 10, kind="cosine", iterations=110) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="train.lr_schedule"):
        lr_schedule(0, kind="step", iterations=10)


def test_losses_and_psnr_on_known_values():
    a, b = torch.full((1, 2, 2, 3), 0.5), torch.full((1, 2, 2, 3), 0.25)
    assert image_loss(a, b, "l1").item() == pytest.approx(0.25)
    assert image_loss(a, b, "mse").item() == pytest.approx(0.0625)
    assert image_loss(a, b, "smape").item() == pytest.approx(0.25 / 0.76)
    assert image_loss(a, b, "relmse").item() == pytest.approx(0.0625 / (0.25 + 0.0625 + 0.1))
    assert image_loss(a, a, "logl1").item() == 0.0

    def log_srgb(v):  # nvdiffrec's tonemap in float64: sRGB's curve of ln(v + 1), above 0.0031308
        return 1.055 * math.log(v + 1) ** (1 / 2.4) - 0.055

    # float32's log, pow and the arithmetic around them, each within an ulp (6e-8) of values
    # below 1: a few 1e-7 at most.
    logl1 = abs(log_srgb(0.5) - log_srgb(0.25))
    assert image_loss(a, b, "logl1").item() == pytest.approx(logl1, abs=1e-6)
    assert image_loss(a, b, "logl2").item() == pytest.approx(logl1**2, abs=1e-6)
    # sRGB(1) = 1, sRGB(0) = 0: MSE 1 on one of two images' every pixel.
    ones, zeros = torch.ones(2, 2, 2, 3), torch.zeros(2, 2, 2, 3)
    zeros[1] = 1.0
    per_image = psnr(ones, zeros)
    assert per_image[0].item() == pytest.approx(0.0, abs=1e-5) and per_image[1].item() == 100.0


def test_precision_statistics_reach_the_history(tmp_path):
    # f16_naive's first step: the first layer's f16 weight gradients all underflow to zero,
    # the mechanism behind its failure; f32 keeps them.
    naive = train(tiny_cfg("precision=f16_naive", "train.iterations=2", "train.stats_interval=1"),
                  tmp_path / "naive")  # fmt: skip
    f32 = train(tiny_cfg("precision=f32", "train.iterations=2", "train.stats_interval=1"),
                tmp_path / "f32")  # fmt: skip
    first = naive["history"][0]
    assert {"net.0.grad_zero_frac", "encoder.out_grad_subnormal_frac"} <= set(first)
    assert first["net.0.grad_zero_frac"] > 0.9
    assert f32["history"][0]["net.0.grad_zero_frac"] < 0.5
    off = train(tiny_cfg("train.iterations=2", "train.stats_interval=0"), tmp_path / "off")
    assert "net.0.grad_zero_frac" not in off["history"][0]


def test_run_peak_rss_sees_memory_held_during_the_run():
    from mptex.train.memory import RunPeakRss

    rss = RunPeakRss(interval_s=0.001).start()
    if not rss.available:
        pytest.skip("no /proc/self/statm on this platform")
    before = rss.peak
    # A fresh anonymous mapping, every page written: a tensor could reuse pages that an
    # earlier test freed but the allocator kept resident, and then RSS would not grow.
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"\1" * (64 * 2**20))
    rss.stop()
    block.close()
    assert rss.peak - before >= 60 * 2**20


def test_profiler_scopes_are_entered_only_while_a_profiler_records(monkeypatch, tmp_path):
    import mptex._profiler_scope as scopes

    entered, real = [], scopes.record_function
    monkeypatch.setattr(scopes, "record_function", lambda name: entered.append(name) or real(name))
    cfg = tiny_cfg("train.iterations=3", "train.val_interval=3")
    mtrain.train(cfg, tmp_path / "plain")
    assert entered == []  # ~6.5 us each: not entered without a profiler
    with torch.profiler.profile() as prof:
        mtrain.train(cfg, tmp_path / "profiled")
    names = {e.name for e in prof.events()}
    for scope in ("mptex.views", "mptex.render", "mptex.loss", "mptex.backward", "mptex.optimizer",
                  "mptex.validation"):  # fmt: skip
        assert scope in names and scope in entered, scope


def test_an_indexed_cuda_device_is_made_current_for_the_run(monkeypatch):
    # Triton launches on the current CUDA device whatever device its tensors are on: a run on
    # cuda:N makes that device current while it trains; nothing else changes the current one.
    import contextlib

    from mptex._triton_launch import launching_on

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value in ("cpu", "cuda", "cuda:1", "nonsense", None, 3):  # no CUDA device
        guard = launching_on(value)
        assert isinstance(guard, contextlib.nullcontext), value
    assert isinstance(launching_on(None), contextlib.nullcontext)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    guard = launching_on("cuda:1")
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    for value in ("cuda", "cuda:2", "cpu"):  # current already, or the device check's error
        guard = launching_on(value)
        assert isinstance(guard, contextlib.nullcontext), value


def test_a_run_keeps_cublas_half_sums_in_float32_and_restores_the_setting(monkeypatch, tmp_path):
    # The f16 / bf16 arms model a float32 accumulation (mptex.mlp.reduced_linear); torch's
    # default would let cuBLAS reduce split sums in the reduced type.
    from mptex.train import loop

    matmul = torch.backends.cuda.matmul
    seen = []

    def body(*args, **kwargs):
        seen.append((matmul.allow_fp16_reduced_precision_reduction,
                     matmul.allow_bf16_reduced_precision_reduction))  # fmt: skip
        raise RuntimeError("stop here")

    monkeypatch.setattr(loop, "_train_validated", body)
    before = (torch._C._get_cublas_allow_fp16_reduced_precision_reduction(),
              torch._C._get_cublas_allow_bf16_reduced_precision_reduction())  # fmt: skip
    with pytest.raises(RuntimeError, match="stop here"):
        loop.train({"train": {"device": "cpu"}}, tmp_path)
    assert seen == [(False, False)]
    # restored whole (with newer torch, whether split-K is allowed too)
    assert (torch._C._get_cublas_allow_fp16_reduced_precision_reduction(),
            torch._C._get_cublas_allow_bf16_reduced_precision_reduction()) == before  # fmt: skip


def test_a_cuda_device_index_beyond_the_machines_is_a_config_error(monkeypatch):
    # One line at start, as any other bad key, not CUDA's "invalid device ordinal" later.
    from mptex.config_schema import plain
    from mptex.train import ConfigError, validate_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises((ConfigError, ValueError), match=r"^train\.device: 'cuda:1' requested, "
                       r"1 CUDA device\(s\) here$"):  # fmt: skip
        validate_config(dict(plain(tiny_cfg("train.device=cuda:1"))))


@pytest.mark.parametrize("backend", ["tcnn", "triton"])
def test_a_checkpoint_of_a_gpu_grid_backend_loads_on_the_cpu(tmp_path, backend):
    # A GPU run's texture.backend (tcnn, triton) cannot run on a CPU without them (tcnn: no
    # library; triton: no interpreter): export and rescore evaluate the same parameters with
    # the device's default grid, and say so.
    import os
    import subprocess
    import sys

    from mptex.train import load_texture

    train(tiny_cfg("train.iterations=2"), tmp_path)
    path = tmp_path / "checkpoint.pt"
    points = torch.rand(64, 3) * 2 - 1
    with torch.no_grad():
        want = load_texture(path).sample(points)
    ckpt = torch.load(path, weights_only=False)
    ckpt["config"]["texture"]["backend"] = backend
    torch.save(ckpt, path)
    torch.save(points, tmp_path / "points.pt")
    # in a fresh process, without Triton's interpreter (which would run the triton grid)
    code = (
        "import sys, torch, warnings\n"
        "from mptex.train import load_texture\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    tex = load_texture(sys.argv[1])\n"
        "print([str(w.message) for w in caught])\n"
        "with torch.no_grad():\n"
        "    torch.save(tex.sample(torch.load(sys.argv[2])), sys.argv[3])\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path / "points.pt"),
         str(tmp_path / "got.pt")], capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"texture.backend: the checkpoint's '{backend}' cannot run here" in proc.stdout
    assert torch.equal(torch.load(tmp_path / "got.pt"), want)
