"""The precision search (mptex/search): pruning, the cost model against hand-computed values,
certification, the search end to end (result yaml, reproduction, resume after a stop signal)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mptex.cli import CONFIG_DIR, register_experiments
from mptex.intervals import ratio_text, t_quantile
from mptex.search import (
    GPUS,
    Candidate,
    SearchError,
    SearchInterrupted,
    TextureShape,
    certify,
    check_search_config,
    enumerate_space,
    iteration_cost,
    pareto_front,
    run_search,
)
from mptex.search.cost import GPU
from mptex.train import train

# ----------------------------------------------------------------------------- pruning


def test_space_counts_follow_the_pruning_rules():
    kept, pruned = enumerate_space(3, 32)
    # Raw space: 2 encoders x 3^3 layer dtypes x 2 master settings x 3 loss-scaling modes = 324
    # linear candidates, + fused: 2 encoders x (tcnn, none, static, dynamic) = 8, + below f16:
    # 2 encoders x 6 kinds (fp8, fp8_current, fp8_rowwise, int8_qat, fp8_qat, fp8_rowwise_qat)
    # x 3 loss-scaling modes = 36.
    assert len(kept) + len(pruned) == 324 + 8 + 36
    names = {c.name for c in kept}
    by_name = {p["candidate"]: p for p in pruned}
    # f32 masters: encoder f16 keeps all 27 x 3 = 81; encoder f32 loses the 8 layer assignments
    # without f16 ({f32, bf16}^3) x {static, dynamic} = 16 (redundant scaling): 65.
    # No masters: only a single dtype for all layers (3) x 2 encoders x loss "none" (GradScaler
    # refuses f16 grads) = 6, minus the 2 all-f32 ones (redundant): 4. Fused: 2 x 3 = 6.
    # Below f16: an f16 encoder keeps all 6 x 3 = 18; an f32 encoder only loss "none" (6), its
    # 12 scaled ones are redundant (FP8's scales absorb a loss scale; QAT is f32).
    assert len(kept) == 81 + 65 + 4 + 6 + 18 + 6
    assert sum(p["rule"] == "redundant" for p in pruned) == 16 + 2 + 12
    assert {"e16-fp8-dyn", "e16-fp8cur-none", "e32-qat8-none", "e32-qatfp8-none"} <= names
    assert by_name["e32-fp8-dyn"]["rule"] == "redundant"
    assert enumerate_space(3, 32, {"quantized": []})[0] == [c for c in kept if c.quant == "none"]
    assert "e16-f16.f16.f32-dyn" in names and "e16-fused-tcnn" in names
    assert "e16-f16.f16.f16-none-nomaster" in names  # f16_naive's shape
    assert "single mlp_dtypes" in by_name["e16-f16.f32.f32-none-nomaster"]["reason"]
    assert "GradScaler" in by_name["e16-f16.f16.f16-dyn-nomaster"]["reason"]
    assert by_name["e32-bf16.bf16.bf16-dyn"]["rule"] == "redundant"
    assert by_name["e32-f32.f32.f32-none-nomaster"]["rule"] == "redundant"
    assert "fused" in by_name["e16-fused-none"]["reason"]
    for c in kept:  # every kept candidate builds its policy
        c.policy()


def test_the_bf16_grid_is_in_the_space_and_unsupported_fused_widths_are_pruned():
    kept, pruned = enumerate_space(2, 24, {"encoder_dtypes": ["bf16", "f16"]})
    reasons = {p["candidate"]: p["reason"] for p in pruned}
    names = {c.name for c in kept}
    # mptex's bf16 grid is a candidate; like a bf16 layer it needs no loss scale.
    assert {"ebf16-f16.f16-dyn", "ebf16-bf16.bf16-none", "ebf16-fp8-none"} <= names
    assert "no f16 value" in reasons["ebf16-bf16.bf16-dyn"]
    assert "widths [16, 32, 64, 128]" in reasons["e16-fused-tcnn"]
    assert not any(c.mlp == "fused" for c in kept)


def test_cost_of_the_bf16_grid_by_hand():
    parts = _parts(Candidate("bf16", ("f32", "f32")))
    # bf16 table reads (2 B), its gradient summed in f32 (4 B atomics), no gradient cast.
    assert parts["grid forward"]["bytes"] == 1000 * 4 * 8 * 2 + 12000 + 1000 * 4 * 2
    assert parts["grid backward"]["bytes"] == 1000 * 4 * 8 * 2 * 4 + 1000 * 4 * 2 + 12000
    assert parts["grid f32 -> bf16 table"]["bytes"] == 1000 * (4 + 2)
    assert not any("gradient" in n and "cast" in n or n.endswith("f32 gradient") for n in parts)


@pytest.mark.parametrize(
    "search, key",
    [
        ({"bogus": 1}, "search.bogus"),
        ({"certify_seeds": 1}, "search.certify_seeds"),
        ({"cost": {"gpu": "a100"}}, "search.cost.gpu"),
        ({"space": {"layer_dtypes": ["f8"]}}, "search.space.layer_dtypes"),
        ({"space": {"master_weights": ["yes"]}}, "search.space.master_weights"),
        ({"space": {"quantized": ["int4_qat"]}}, "search.space.quantized"),
        ({"name": "a/b"}, "search.name"),
        ({"adjust": "holm"}, "search.adjust"),
    ],
)
def test_bad_search_config_names_the_key(search, key):
    with pytest.raises(SearchError, match=f"^{key}: "):
        check_search_config(search)


# ----------------------------------------------------------------------------- cost model
# Round numbers so that every figure below is checkable by hand: 1 TB/s, f32 1 TFLOP/s, f16 and
# bf16 4 TFLOP/s (f16 with half accumulation 8), 1 us per kernel, 2 us per host sync.
_GPU = GPU("test", bandwidth=1e12, f32=1e12, f16=4e12, bf16=4e12, f16_half_acc=8e12,
           source="round numbers", launch_s=1e-6, sync_s=2e-6)  # fmt: skip
# N = 1000 queries, 2 levels x 2 features (4 inputs), 1000 grid entries, 2 layers: 4 -> 16 -> 3.
_SHAPE = TextureShape(points=1000, n_levels=2, n_features=2, grid_params=1000, n_layers=2,
                      width=16, n_outputs=3)  # fmt: skip


def _parts(candidate):
    return {p["name"]: p for p in iteration_cost(candidate, _SHAPE, _GPU)["parts"]}


def test_cost_of_the_f32_reference_by_hand():
    cost = iteration_cost(Candidate("f32", ("f32", "f32")), _SHAPE, _GPU)
    parts = {p["name"]: p for p in cost["parts"]}
    # grid forward: 1000 x 4 values x 8 corners x 4 B + positions 1000 x 3 x 4 B + output
    # 1000 x 4 x 4 B = 128000 + 12000 + 16000 = 156000 B.
    assert parts["grid forward"]["bytes"] == 156000
    # grid backward: atomics read + write 2 x 128000, gradient in 16000, positions 12000.
    assert parts["grid backward"]["bytes"] == 256000 + 16000 + 12000
    # layer 0 forward: 2 x 1000 x 4 x 16 = 128000 FLOPs at 1 TFLOP/s = 0.128 us; bytes
    # 1000 x (4 + 16) x 4 + weights 64 x 4 = 80256 B = 0.080256 us: compute-bound, + 1 us launch.
    assert parts["layer 0 forward"]["flops"] == 128000
    assert parts["layer 0 forward"]["seconds"] == pytest.approx(0.128e-6 + 1e-6, rel=1e-12)
    # layer 1 backward: 4 x 1000 x 16 x 3 = 192000 FLOPs = 0.192 us; bytes 1000 x (6 + 32) x 4
    # + 2 x 48 x 4 = 152384 B = 0.152384 us; 2 kernels.
    assert parts["layer 1 backward"]["seconds"] == pytest.approx(0.192e-6 + 2e-6, rel=1e-12)
    # Adam: 7 x 4 B per parameter: grid 28000 B, MLP (64 + 48 = 112 params) 3136 B; 5 kernels.
    assert parts["Adam grid"]["seconds"] == pytest.approx(28000 / 1e12 + 5e-6, rel=1e-12)
    assert parts["Adam MLP"]["bytes"] == 3136
    # No casts, no loss scaling in the reference.
    assert not any("cast" in n or "loss" in n for n in parts)
    assert cost["kernels"] == 1 + 1 + 1 + (1 + 2 + 2) + (1 + 2) + 5 + 5
    assert cost["seconds"] == pytest.approx(sum(p["seconds"] for p in cost["parts"]), rel=1e-12)


def test_cost_of_casts_loss_scaling_and_the_fused_network_by_hand():
    parts = _parts(Candidate("f16", ("f16", "f32"), True, "dynamic"))
    # f16 grid: table cast f32 -> f16 over 1000 entries: 1000 x (4 + 2) B and 1 kernel.
    assert parts["grid f32 -> f16 table"]["bytes"] == 6000
    # layer 1 (f32) after layer 0 (f16): input cast forward + backward: 2 x 1000 x 16 x (2 + 4).
    assert parts["layer 1 input cast"]["bytes"] == 192000
    # the f16 layer 0 computes at 4 TFLOP/s: 128000 / 4e12 s, but its bytes dominate now:
    # 1000 x 20 x 2 + 64 x 2 = 40128 B at 1 TB/s = 0.040128 us > 0.032 us.
    assert parts["layer 0 forward"]["seconds"] == pytest.approx(0.040128e-6 + 1e-6, rel=1e-12)
    # dynamic loss scaling: gradients read + written in f32: (1000 + 112) x 4 x 2 B, 3 kernels,
    # one host sync.
    scaling = parts["loss scaling (dynamic)"]
    assert (scaling["bytes"], scaling["kernels"], scaling["syncs"]) == (8896, 3, 1)
    assert scaling["seconds"] == pytest.approx(8896 / 1e12 + 3e-6 + 2e-6, rel=1e-12)
    fused = _parts(Candidate("f16", ("f16",), True, "tcnn", mlp="fused"))
    # fused: inputs padded 4 -> 16, outputs 3 -> 16: MACs 16 x 16 + 16 x 16 = 512 per query;
    # backward 4 x 1000 x 512 FLOPs at 8 TFLOP/s; 1 backward kernel + 2 weight-gradient GEMMs.
    assert fused["fused backward"]["flops"] == 2048000
    assert fused["fused backward"]["kernels"] == 3
    assert not any(n.startswith("loss scaling") for n in fused)


def test_h100_constants_are_the_datasheet_figures():
    h100 = GPUS["h100"]
    assert (h100.bandwidth, h100.f32, h100.f16) == (3.35e12, 66.9e12, 989.4e12)
    assert (GPUS["rtx4090"].f16, GPUS["rtx4090"].f16_half_acc) == (165.2e12, 330.3e12)
    # dense FP8 with f32 accumulation: H100 SXM5 datasheet 1,979 TFLOPS (3,958 with sparsity),
    # twice its f16 rate; RTX 4090 (Ada whitepaper, Table 2) 330.3 TFLOPS.
    assert (h100.rate("fp8"), GPUS["rtx4090"].rate("fp8")) == (1979e12, 330.3e12)
    assert _GPU.rate("fp8") == _GPU.f32  # no FP8 tensor cores: mptex's f32 emulation


def test_cost_of_fp8_gemms_and_qat_by_hand():
    fp8_gpu = GPU("test", bandwidth=1e12, f32=1e12, f16=4e12, bf16=4e12, f16_half_acc=8e12,
                  source="round numbers", launch_s=1e-6, sync_s=2e-6, fp8=8e12)  # fmt: skip
    c = Candidate("f16", ("f32", "f32"), True, "none", quant="fp8")
    parts = {p["name"]: p for p in iteration_cost(c, _SHAPE, fp8_gpu)["parts"]}
    # layer 0: 2 x 1000 x 4 x 16 = 128000 FLOPs at 8 TFLOP/s = 0.016 us; bytes: one-byte input
    # 4000, weight 64, f32 output 64000 = 68064 B = 0.068064 us: memory-bound, + 1 launch.
    assert parts["layer 0 forward"]["seconds"] == pytest.approx(0.068064e-6 + 1e-6, rel=1e-12)
    # quantising input and weight: (4000 + 64) values x (4 + 4 + 1) B, 4 kernels.
    assert (
        parts["layer 0 quantise"]["bytes"] == 4064 * 9 and parts["layer 0 quantise"]["kernels"] == 4
    )
    # the delayed recipe's three histories, 2 kernels each; the current recipe has none.
    assert parts["layer 1 amax histories"]["kernels"] == 6
    current = _parts(Candidate("f16", ("f32", "f32"), True, "none", quant="fp8_current"))
    assert not any("histories" in n for n in current)
    # row-wise: one f32 scale per row of the input and the gradient (1000 each) and of the
    # weight (16 output channels), written and read; input (4000), weight (64) and gradient
    # (16000) quantised again along their other axis, with 4 + 4 + 16 more scales.
    rowwise = _parts(Candidate("f16", ("f32", "f32"), True, "none", quant="fp8_rowwise"))
    assert rowwise["layer 0 row scales"]["bytes"] == (2 * 1000 + 16) * 4 * 2
    assert rowwise["layer 0 column-wise quantise"]["bytes"] == 20064 * 9 + 24 * 8
    assert rowwise["layer 0 forward"] == current["layer 0 forward"]
    assert not any("histories" in n for n in rowwise)
    # the f16 grid's features cast to f32 for the first layer (forward and backward).
    assert parts["layer 0 input cast"]["bytes"] == 2 * 1000 * 4 * (2 + 4)
    qat = _parts(Candidate("f32", ("f32", "f32"), quant="int8_qat"))
    assert qat["layer 1 fake quantisation"]["kernels"] == 5
    assert qat["layer 1 fake quantisation"]["bytes"] == 48 * 4 * 2 * 5
    assert qat["layer 1 forward"] == _parts(Candidate("f32", ("f32", "f32")))["layer 1 forward"]
    row_qat = _parts(Candidate("f32", ("f32", "f32"), quant="fp8_rowwise_qat"))
    assert row_qat["layer 0 input fake quantisation"]["bytes"] == 1000 * 4 * 4 * 2 * 5
    assert not any("input fake" in n for n in qat)


# ----------------------------------------------------------------------------- certification


def test_certification_is_the_report_equivalence_rule():
    # deltas 0.1, 0.3, 0.2: mean 0.2, sd 0.1, t(0.975, 2) = 4.3027: half width 0.2484.
    ok = certify([0.1, 0.3, 0.2], 0.5)
    assert ok["certified"] and ok["low"] == pytest.approx(0.2 - 0.24841, abs=1e-4)
    # shifted by 0.2: [0.152, 0.648] crosses +0.5: not certified (though "better").
    crossing = certify([0.3, 0.5, 0.4], 0.5)
    assert not crossing["certified"] and crossing["high"] > 0.5
    assert crossing["verdict"] == "better"
    assert not certify([0.0], 0.5)["certified"]  # one seed: no interval
    assert not certify([-0.45, -0.05, -0.25], 0.5)["certified"]  # low = -0.25 - 0.497 < -0.5
    # Bonferroni over 3 candidates: each interval at 1 - 0.05/3, t(1 - 0.05/6, 2) = 7.6488 in
    # closed form (2 degrees of freedom: t = u sqrt(2 / (1 - u^2)), u = 2p - 1), half width
    # 7.6488 * 0.1 / sqrt(3) = 0.4416: [-0.242, 0.642] crosses +0.5, so the same deltas that
    # certify on their own do not certify as one of three.
    u = 2 * (1 - 0.05 / 6) - 1
    adjusted = certify([0.1, 0.3, 0.2], 0.5, 1 - 0.05 / 3)
    assert adjusted["half_width"] == pytest.approx(u * (2 / (1 - u * u)) ** 0.5 * 0.1 / 3**0.5,
                                                   rel=1e-9)  # fmt: skip
    assert not adjusted["certified"] and adjusted["confidence"] == 1 - 0.05 / 3


def test_pareto_front_keeps_the_undominated_points():
    # (cost, Δ): distance to f32 is |Δ|; (1.0, +3.0) beats (1.0, -4.0) on |Δ| at equal cost,
    # (2.5, -0.5) loses to (2.0, -0.1) on both.
    points = [(3.0, 0.0), (1.0, +3.0), (2.0, -0.1), (2.5, -0.5), (1.0, -4.0)]
    assert pareto_front(points) == [1, 2, 0]


# ----------------------------------------------------------------------------- the search
_TINY = [
    "train=tiny", "texture=tiny", "scene.resolution=16", "train.iterations=6",
    "train.val_interval=0", "train.checkpoint_interval=0", "train.stats_interval=0",
    "search.certify_seeds=2", "search.workers=1", "search.max_combinations=1",
    "search.max_variants=1", "search.max_certify=2",
    "search.name=tiny_search",  # not a name a real search in configs/ may have written
    "search.space.encoder_dtypes=[f16,f32]", "search.space.layer_dtypes=[f32,f16]",
    "search.space.master_weights=[true]", "search.space.loss_scaling=[none,dynamic]",
    "search.space.fused=false",
]  # fmt: skip


def _cfg(tmp_path: Path, *overrides: str, config_dir: bool = True):
    register_experiments()
    where = [f"search.config_dir={tmp_path / 'cfg'}"] if config_dir else []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=["+experiment=precision_search", *_TINY, *where,
                                            *overrides])  # fmt: skip


def _psnrs(summary):
    return {(r["candidate"], seed): run["psnr"] for r in summary["candidates"]
            for seed, run in r["runs"].items()}  # fmt: skip


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("search")
    # search.config_dir left at its default: the result goes into the search's own folder
    summary = run_search(_cfg(tmp, config_dir=False), tmp / "out")
    return tmp, summary


def test_search_writes_a_result_that_trains_and_reproduces_its_psnr(searched):
    tmp, summary = searched
    out = tmp / "out"
    assert {"search.json", "search.md", "pareto.png", "search_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert json.loads((out / "search.json").read_text())["certified"] == summary["certified"]
    stages = {r["stage"] for r in summary["candidates"]}
    assert {"reference", "screen: one part"} <= stages
    # every trained candidate is a kept one, screened at the first seed
    assert all("0" in r["runs"] for r in summary["candidates"])
    # The certification runs at fresh seeds, not at the screen's, which chose the candidate:
    # with the screen's small |Δ| counted again the interval would lean towards 0.
    assert summary["screen_seed"] == 0 and summary["seeds"] == [1, 2]
    rows = {r["candidate"]: r for r in summary["candidates"]}
    assert sorted(rows[summary["reference"]]["runs"]) == ["0", "1", "2"]
    certified = [r for r in summary["candidates"] if (r["certificate"] or {}).get("n")]
    assert certified  # a candidate went through certification in this search
    for row in certified:
        fresh = [row["delta_db"][s] for s in ("1", "2")]
        assert row["certificate"]["n"] == 2
        assert row["certificate"]["mean"] == pytest.approx(sum(fresh) / 2, abs=1e-12)
    path = Path(summary["result_config"])
    assert path == out / "configs" / "precision" / "tiny_search.yaml"
    assert path.read_text().startswith("# Written by mptex's precision search")
    assert not (CONFIG_DIR / "precision" / "tiny_search.yaml").exists()  # mptex's own: untouched
    # `mptex-train --config-dir <out>/configs precision=tiny_search` composes it...
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        # the reproduction command the search prints: the quick experiment's protocol
        cfg = compose("config", overrides=["+experiment=quick", "precision=tiny_search",
                                           f"hydra.searchpath=[file://{out / 'configs'}]",
                                           *_TINY[:7]])  # fmt: skip
    assert summary["reproduce"].startswith(
        f"mptex-train --config-dir {out / 'configs'} +experiment=quick precision=tiny_search "
        "train.seed=0"
    )
    row = next(r for r in summary["candidates"] if r["candidate"] == summary["certified"])
    assert Candidate.from_json(row).policy_dict("tiny_search") == dict(cfg.precision)
    # ... and trains it to the PSNR the search measured (runs are bit-identical).
    metrics = train(cfg, tmp / "rerun")
    assert metrics["psnr"] == row["runs"]["0"]["psnr"]
    assert "tiny_search" in (out / "search.md").read_text()


def test_not_trained_lists_the_cheapest_of_each_kind_by_hand():
    from mptex.search.results import not_trained

    fp8_a = Candidate("f16", ("f32",) * 3, loss_scaling="dynamic", quant="fp8")
    fp8_b = Candidate("f32", ("f32",) * 3, quant="fp8")
    cur = Candidate("f16", ("f32",) * 3, loss_scaling="dynamic", quant="fp8_current")
    bf16_grid = Candidate("bf16", ("f32",) * 3)
    f16 = Candidate("f16", ("f16",) * 3, loss_scaling="dynamic")
    f32 = Candidate("f32", ("f32",) * 3)
    model = {
        c.name: {"seconds": t}
        for c, t in [
            (fp8_a, 4.0),
            (fp8_b, 3.0),
            (cur, 5.0),
            (bf16_grid, 4.2),
            (f16, 2.5),
            (f32, 4.4),
        ]
    }
    got = not_trained([fp8_a, fp8_b, cur, bf16_grid, f16, f32], {f32.name, cur.name}, model)
    assert got["count"] == 4  # fp8_a, fp8_b, bf16_grid, f16 (an f16 one has no kind listed)
    assert got["cheapest_by_kind"] == [
        {"kind": "FP8 GEMMs, delayed scaling", "candidate": fp8_b.name, "model_s": 3.0},
        {"kind": "bfloat16 hash grid", "candidate": bf16_grid.name, "model_s": 4.2},
    ]


def test_the_search_reports_what_it_did_not_train(searched):
    tmp, summary = searched
    skipped = summary["not_trained"]
    trained = {r["candidate"] for r in summary["candidates"]}
    assert skipped["count"] == summary["space"]["kept"] - len(trained)
    kinds = {k["kind"]: k for k in skipped["cheapest_by_kind"]}
    assert "FP8 GEMMs, delayed scaling" in kinds  # the space holds FP8; the tiny search skips it
    assert all(k["candidate"] not in trained for k in kinds.values())
    text = (tmp / "out" / "search.md").read_text()
    assert f"Not trained: {skipped['count']} kept candidates" in text
    assert f"`{kinds['FP8 GEMMs, delayed scaling']['candidate']}`" in text


def test_a_margin_no_interval_fits_certifies_only_the_reference(tmp_path, searched):
    # Same runs (copied), margin 1e-6 dB: every candidate's interval crosses it.
    import shutil

    tmp, summary = searched
    shutil.copytree(tmp / "out" / "runs", tmp_path / "out" / "runs")
    strict = run_search(_cfg(tmp_path, "search.margin_db=1e-6"), tmp_path / "out")
    assert strict["budget"]["trained"] == 0 or strict["budget"]["reused"] > 0
    assert strict["certified_is_reference"] and strict["certified"] == "e32-f32.f32.f32-none"
    tried = [r for r in strict["candidates"] if r["certificate"] and r["candidate"] !=
             strict["reference"]]  # fmt: skip
    assert tried and not any(r["certificate"]["certified"] for r in tried)
    assert (
        "No assignment cheaper than f32 was certified"
        in (tmp_path / "out" / "search.md").read_text()
    )


def test_search_resumes_after_a_stop_signal_with_the_same_result(tmp_path, searched):
    _, summary = searched
    out = tmp_path / "out"
    # A stop signal during the 4th iteration of the first run: it checkpoints, the search stops.
    with pytest.raises(SearchInterrupted, match="the same command continues"):
        run_search(_cfg(tmp_path, "train.inject_signal_at=3"), out)
    first = next((out / "runs").glob("*/seed*/metrics.json"))
    assert json.loads(first.read_text())["status"] == "interrupted"
    resumed = run_search(_cfg(tmp_path), out)
    assert resumed["certified"] == summary["certified"]
    assert _psnrs(resumed) == _psnrs(summary)  # the resumed run continued bit-exactly
    # a third start trains nothing: every run is read back
    again = run_search(_cfg(tmp_path), out)
    assert again["budget"]["trained"] == 0 and again["budget"]["reused"] == again["budget"]["runs"]
    # its wall time is the invocations' together, not the third's alone (which trained nothing)
    assert again["budget"]["search_wall_s"] > resumed["budget"]["search_wall_s"] > 0


def test_bonferroni_certifies_each_candidate_at_the_searchs_share(tmp_path, searched):
    # Same runs (copied): only the intervals change, each at 1 - 0.05/max_certify (2 here).
    import shutil

    tmp, summary = searched
    shutil.copytree(tmp / "out" / "runs", tmp_path / "out" / "runs")
    held = run_search(_cfg(tmp_path, "search.adjust=bonferroni"), tmp_path / "out")
    assert held["budget"]["trained"] == 0
    assert held["adjust"] == "bonferroni" and held["confidence"] == pytest.approx(0.975)
    assert summary["adjust"] == "none" and summary["confidence"] == 0.95
    widened = 0
    for before, after in zip(summary["candidates"], held["candidates"]):
        old, new = before["certificate"], after["certificate"]
        assert before["candidate"] == after["candidate"]
        if old and old.get("half_width") and before["candidate"] != summary["reference"]:
            widened += 1
            # the same pairs: the interval widens by the ratio of the t quantiles (2 seeds,
            # 1 degree of freedom: t = tan(pi (p - 1/2)), 12.706 -> 25.452)
            ratio = math.tan(math.pi * (0.9875 - 0.5)) / math.tan(math.pi * (0.975 - 0.5))
            assert new["mean"] == old["mean"]
            assert new["half_width"] == pytest.approx(old["half_width"] * ratio, rel=1e-9)
    assert widened  # some candidate other than f32 was certified over seeds with a spread
    text = (tmp_path / "out" / "search.md").read_text()
    assert "97.5% (Bonferroni over max_certify = 2)" in text
    assert "at most 2.5%" in text
    # the directory remembers the adjustment: continuing it unadjusted is another search
    with pytest.raises(SearchError, match=r"different: search.adjust\)"):
        run_search(_cfg(tmp_path), tmp_path / "out")


def test_a_directory_from_before_the_adjustment_continues_unadjusted(tmp_path, searched):
    import shutil

    tmp, _ = searched
    shutil.copytree(tmp / "out", tmp_path / "out")
    record = json.loads((tmp_path / "out" / "search_config.json").read_text())
    assert "adjust" not in record["search"]  # at its default: left out of the record
    # so a directory whose record was written before the key existed is the same search
    again = run_search(_cfg(tmp_path, config_dir=False), tmp_path / "out")
    assert again["budget"]["trained"] == 0


def test_a_search_dir_refuses_other_settings(tmp_path, searched):
    tmp, _ = searched
    with pytest.raises(SearchError, match=r"other settings \(different: .*search.screen_db\)"):
        run_search(_cfg(tmp, "search.screen_db=0.25"), tmp / "out")


def test_a_name_mptex_ships_is_refused_and_the_default_avoids_it(tmp_path):
    # Hydra searches mptex's configs before --config-dir: precision=<a shipped name> would
    # train the shipped config, not the result.
    from mptex.search.results import default_result_name

    for name in ("f32", "search_builtin"):
        with pytest.raises(SearchError) as err:
            run_search(_cfg(tmp_path, f"search.name={name}"), tmp_path / "out")
        assert str(err.value) == (
            f"search.name: mptex ships a precision config {name!r}, which 'mptex-train "
            f"--config-dir ... precision={name}' would train instead of the result; choose "
            "another search.name"
        )
    assert not (tmp_path / "out" / "runs").exists()  # refused before any training
    assert default_result_name("builtin") == "my_search_builtin"  # search_builtin ships
    assert default_result_name("soccer") == "my_search_soccer"
    assert default_result_name("duck") == "search_duck"


def test_a_config_dir_that_cannot_hold_the_result_is_refused_before_training(tmp_path):
    (tmp_path / "a file").write_text("")
    with pytest.raises(SearchError) as err:
        run_search(_cfg(tmp_path, f"search.config_dir={tmp_path / 'a file'}", config_dir=False),
                   tmp_path / "out")  # fmt: skip
    assert str(err.value) == (
        f"search.config_dir: cannot make {tmp_path / 'a file' / 'precision'}: Not a directory"
    )
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize(
    "value, got", [("abc", "'abc'"), ("[1,2]", "[1, 2]"), ("null", "None"), ("inf", "inf")]
)
def test_a_bad_texture_depth_is_refused_in_one_line_before_training(tmp_path, value, got):
    # The search sizes its reference arm (f32 in every layer) by texture.hidden: it read the
    # key with int() before any check, so 'abc' said "invalid literal for int()" without
    # naming the key, and a list, null or inf ended in a TypeError or OverflowError traceback.
    with pytest.raises(ValueError) as err:
        run_search(_cfg(tmp_path, f"texture.hidden={value}"), tmp_path / "out")
    assert str(err.value) == f"texture.hidden: expected an integer >= 1, got {got}"
    assert not (tmp_path / "out" / "runs").exists()


def test_a_user_precision_config_is_never_overwritten(tmp_path):
    target = tmp_path / "cfg" / "precision" / "mine.yaml"
    target.parent.mkdir(parents=True)
    target.write_text("name: mine\n")
    with pytest.raises(SearchError, match="^search.name: .*mine.yaml exists"):
        run_search(_cfg(tmp_path, "search.name=mine"), tmp_path / "out")
    assert target.read_text() == "name: mine\n"
    assert not (tmp_path / "out" / "runs").exists()  # refused before any training


def test_mptex_train_runs_the_search_with_two_workers(tmp_path):
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    cmd = [sys.executable, "-c", "from mptex.cli import train_main; train_main()",
           "+experiment=precision_search", *_TINY, "search.workers=2",
           "search.space.encoder_dtypes=[f32]", f"search.config_dir={tmp_path / 'cfg'}",
           f"hydra.run.dir={tmp_path / 'out'}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "precision search: certified" in done.stdout
    assert (
        f"mptex-train --config-dir {tmp_path / 'cfg'} +experiment=quick precision=tiny_search "
        "train.seed=0"
    ) in done.stdout
    summary = json.loads((tmp_path / "out" / "search.json").read_text())
    assert summary["budget"]["workers"] == 2 and summary["budget"]["trained"] >= 4
    assert math.isfinite(summary["budget"]["search_wall_s"])
    # The printed command runs as printed (a few iterations: the command is what is tested).
    again = shlex.split(summary["reproduce"])
    assert again[0] == "mptex-train"
    rerun = subprocess.run([*cmd[:3], *again[1:], "train.iterations=2", "train.val_interval=1",
                            f"hydra.run.dir={tmp_path / 'rerun'}"],
                           capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads((tmp_path / "rerun" / "metrics.json").read_text())["precision"] == (
        "tiny_search"
    )
    bad = subprocess.run([*cmd[:-1], "search.certify_seeds=1", f"hydra.run.dir={tmp_path}/b"],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("mptex-train: error: search.certify_seeds: expected an integer >= 2")
    )


def test_measured_ms_per_iteration_replaces_the_model_for_runs_on_a_gpu(tmp_path, searched):
    # The same runs, as if trained on CUDA: metrics.json says device cuda:0 and 2 ms / iteration
    # for one candidate, trained alone (no other run beside it); its cost becomes the
    # measurement, the others keep the model.
    import shutil

    tmp, summary = searched
    shutil.copytree(tmp / "out" / "runs", tmp_path / "out" / "runs")
    gpu_run = tmp_path / "out" / "runs" / summary["certified"]
    # each run's record: how many runs trained beside it (its batch of the search's two workers)
    sharing = sorted(gpu_run.glob("seed*/search_sharing.json"))
    assert sharing and {json.loads(p.read_text())["ran_beside"] for p in sharing} <= {0, 1}
    for path in gpu_run.glob("seed*/metrics.json"):
        metrics = json.loads(path.read_text())
        metrics.update(device="cuda:0", time_per_iter_s=0.002)
        path.write_text(json.dumps(metrics))
    for path in sharing:
        path.write_text(json.dumps({"ran_beside": 0}))
    again = run_search(_cfg(tmp_path), tmp_path / "out")
    rows = {r["candidate"]: r for r in again["candidates"]}
    assert rows[summary["certified"]]["cost_s"] == 0.002 == rows[summary["certified"]]["measured_s"]
    assert rows[summary["certified"]]["cost_source"] == "measured"
    others = [r for n, r in rows.items() if n != summary["certified"]]
    assert all(r["measured_s"] is None and r["cost_s"] == r["model_s"] for r in others)
    assert again["cost"]["measured"]
    assert (
        "Cost: measured on this machine's GPU where a candidate ran on CUDA"
        in (tmp_path / "out" / "search.md").read_text()
    )
    # Trained beside another run (or with no record): the time holds the other run's work too;
    # the model stays the cost.
    for beside in (1, None):
        for path in sharing:
            if beside is None:
                path.unlink()
            else:
                path.write_text(json.dumps({"ran_beside": beside}))
        shared = run_search(_cfg(tmp_path), tmp_path / "out")
        row = next(r for r in shared["candidates"] if r["candidate"] == summary["certified"])
        assert row["measured_s"] is None and row["cost_s"] == row["model_s"], beside
        assert row["cost_source"] == "modelled" and not shared["cost"]["measured"]


def test_a_measured_cost_is_compared_with_f32s_seed_by_seed(tmp_path, searched):
    # The certified candidate and the reference as if trained alone on CUDA: the candidate 2 ms
    # per iteration on every seed, the reference a time per seed. The certified line gives the
    # per-seed speed-up's geometric mean and interval, and says when that interval does not
    # lie above 1.
    import shutil

    tmp, summary = searched
    shutil.copytree(tmp / "out" / "runs", tmp_path / "out" / "runs")
    runs = tmp_path / "out" / "runs"

    def time_runs(name, times):
        for seed_dir in sorted((runs / name).glob("seed*")):
            seed = int(seed_dir.name[len("seed") :])
            metrics = json.loads((seed_dir / "metrics.json").read_text())
            metrics.update(device="cuda:0", time_per_iter_s=times(seed))
            (seed_dir / "metrics.json").write_text(json.dumps(metrics))
            (seed_dir / "search_sharing.json").write_text(json.dumps({"ran_beside": 0}))

    time_runs(summary["certified"], lambda seed: 0.002)
    for ref_times, expect_faster in (([0.0040, 0.0044, 0.0036, 0.0041], True),
                                     ([0.0019, 0.0023, 0.0021, 0.0018], False)):  # fmt: skip
        time_runs(summary["reference"], lambda seed, t=ref_times: t[seed % len(t)])
        again = run_search(_cfg(tmp_path), tmp_path / "out")
        rows = {r["candidate"]: r for r in again["candidates"]}
        best, ref = rows[summary["certified"]], rows[summary["reference"]]
        ratios = [ref["runs"][s]["time_per_iter_s"] / 0.002 for s in best["runs"]]
        logs = [math.log(r) for r in ratios]
        n, mean = len(logs), sum(logs) / len(logs)
        sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (n - 1))
        half = t_quantile(0.5 + again["confidence"] / 2, n - 1) * sd / math.sqrt(n)
        speed = best["measured_speedup"]
        assert speed["n"] == n == len(best["runs"]) >= 2
        assert speed["ratio"] == pytest.approx(math.exp(mean), rel=1e-12)
        assert speed["low"] == pytest.approx(math.exp(mean - half), rel=1e-9)
        assert speed["high"] == pytest.approx(math.exp(mean + half), rel=1e-9)
        assert ref["measured_speedup"] is None
        text = (tmp_path / "out" / "search.md").read_text()
        line = next(x for x in text.splitlines() if x.startswith("**Certified cheapest:"))
        # f32's own row is the reference: no Δ, verdict or certification of itself
        ref_line = next(x for x in text.splitlines() if x.startswith(f"| `{ref['candidate']}` |"))
        assert ref_line.split(" | ")[4:8] == ["-", "-", "reference", "-"], ref_line
        text = f"; per seed {ratio_text(speed)}"
        assert (speed["low"] > 1) is expect_faster
        if expect_faster:
            assert line.endswith(f"measured on this machine's GPU{text}."), line
        else:
            assert line.endswith(f"{text}: not measurably faster than f32 on this GPU."), line


def test_a_cost_texture_that_is_not_a_config_name_lists_the_names():
    from mptex.search.driver import _cost_texture

    for given in ("/nonexist.yaml", "nosuch"):
        with pytest.raises(SearchError) as err:
            _cost_texture({"cost": {"texture": given}}, {})
        assert str(err.value) == (
            "search.cost.texture: expected the name of one of mptex's "
            f"texture configs ['cpu', 'default', 'tiny'], got {given!r}"
        )
    assert set(_cost_texture({"cost": {"texture": "tiny"}}, {})) == {"texture"}
