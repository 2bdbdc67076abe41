"""The precision search at its edges, against hand-computed values and hand-chosen runs.

Candidate names, their JSON form and the space's order; cost-model terms that the by-hand tests
in test_search.py leave out (weight and output casts, the optimizer's dtype, static loss
scaling, the fused network's casts, padding and stored activations, the FP8 backward); the
certification interval on the margin itself; which candidates the driver screens, combines,
varies and certifies (a pool that returns hand-chosen PSNRs instead of training); what a search
directory remembers; what search.json, search.md, the result's header and the command line say;
and the run pool's reuse, stop and failure handling.

The fake pool's f32 run at seed s has PSNR 30 + s dB, so a candidate's Δ is the table's entry
exactly (0.5 is a binary fraction: 30.5 - 30.0 == 0.5 in floating point).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from mptex.cli import CONFIG_DIR, register_experiments
from mptex.search import (
    Candidate,
    SearchError,
    SearchInterrupted,
    TextureShape,
    certify,
    check_search_config,
    driver,
    enumerate_space,
    iteration_cost,
    pareto_front,
    reference_candidate,
    results,
    run_search,
    shape_from_config,
)
from mptex.search import pool as pool_module
from mptex.search.cost import GPU
from mptex.search.pool import RunPool
from mptex.search.report import _multiplicity, _quality, confidence_text, write_search_report


# ----------------------------------------------------------------------------- candidates
def test_a_static_scale_that_is_not_an_integer_keeps_its_fraction_in_the_name():
    def name(scale):
        return Candidate("f16", ("f16",), loss_scaling="static", static_loss_scale=scale).name

    assert name(128.0) == "e16-f16-s128"
    assert name(0.5) == "e16-f16-s0.5"
    assert name(2.5) == "e16-f16-s2.5"
    assert len({name(0.5), name(0.25), name(0.0625)}) == 3  # distinct run directories


def test_the_space_uses_the_configured_static_scale():
    space = {"loss_scaling": ["static"], "static_loss_scale": 1024.0, "quantized": ["fp8"]}
    kept, _ = enumerate_space(2, 32, space)
    static = [c for c in kept if c.loss_scaling == "static"]
    assert static and {c.static_loss_scale for c in static} == {1024.0}
    assert all(c.name.split("-")[2] == "s1024" for c in static)
    assert {c.policy_dict()["static_loss_scale"] for c in static} == {1024.0}


def test_kept_candidates_come_sorted_by_name():
    kept, _ = enumerate_space(2, 32)
    names = [c.name for c in kept]
    assert names == sorted(names)


def test_every_kept_candidate_round_trips_through_its_json():
    kept, _ = enumerate_space(2, 32, {"encoder_dtypes": ["f16", "bf16", "f32"]})
    assert {c.quant for c in kept} > {"none"} and {c.mlp for c in kept} == {"linear", "fused"}
    for c in kept:
        data = json.loads(json.dumps(c.to_json()))
        assert set(data) == {"encoder", "layers", "master_weights", "loss_scaling",
                             "static_loss_scale", "mlp", "quant"}  # fmt: skip
        assert Candidate.from_json(data) == c
    # A search.json written before candidates had a quantisation reads as unquantised.
    old = Candidate("f16", ("f16", "f32"), True, "dynamic").to_json()
    del old["quant"]
    assert Candidate.from_json(old) == Candidate("f16", ("f16", "f32"), True, "dynamic")


# ----------------------------------------------------------------------------- cost model
# Round numbers (as test_search.py): 1 TB/s, f32 1 TFLOP/s, f16 and bf16 4 TFLOP/s (8 with half
# accumulation), FP8 8 TFLOP/s, 1 us per kernel, 2 us per host sync. N = 1000 queries,
# 2 levels x 2 features (4 inputs), 1000 grid entries, 2 layers 4 -> 16 -> 3 (112 weights).
_GPU = GPU("test", bandwidth=1e12, f32=1e12, f16=4e12, bf16=4e12, f16_half_acc=8e12,
           source="round numbers", launch_s=1e-6, sync_s=2e-6, fp8=8e12)  # fmt: skip
_SHAPE = TextureShape(points=1000, n_levels=2, n_features=2, grid_params=1000, n_layers=2,
                      width=16, n_outputs=3)  # fmt: skip


def _parts(candidate, shape=_SHAPE):
    return {p["name"]: p for p in iteration_cost(candidate, shape, _GPU)["parts"]}


def test_weight_casts_and_the_optimizer_dtype_follow_the_master_weights():
    masters = _parts(Candidate("f32", ("f16", "f16"), True, "dynamic"))
    # Each f16 layer's f32 weight cast to f16 (forward) and its gradient back: 2 x 4 x 16 = 128
    # values x (4 + 2) B for layer 0, 2 x 16 x 3 = 96 x 6 B for layer 1; one kernel each.
    assert masters["layer 0 weight cast"]["bytes"] == 768
    assert masters["layer 1 weight cast"]["bytes"] == 576
    assert masters["layer 0 weight cast"]["kernels"] == 1
    # Adam on f32 masters: 7 x 4 B x 112 weights.
    assert masters["Adam MLP"]["bytes"] == 3136
    naive = _parts(Candidate("f32", ("f16", "f16"), False, "none"))
    # Without masters the parameters are f16 themselves: no cast, Adam in 2 B (7 x 2 x 112).
    assert not any("weight cast" in n for n in naive)
    assert naive["Adam MLP"]["bytes"] == 1568


def test_an_mlp_ending_below_f32_casts_its_output_back():
    # The texture's output goes on in f32: forward and backward over 1000 x 3 values,
    # 2 x 3000 x (2 + 4) B, one kernel.
    ends_f16 = _parts(Candidate("f32", ("f32", "f16"), True, "dynamic"))
    assert (ends_f16["output cast"]["bytes"], ends_f16["output cast"]["kernels"]) == (36000, 1)
    assert "output cast" not in _parts(Candidate("f32", ("f16", "f32"), True, "dynamic"))


def test_a_linear_layers_backward_traffic_by_hand():
    # Layer 0 backward: activations 1000 x (2 x 16 + 2 x 4) values and the weight twice (2 x 64),
    # in the layer's dtype: 160000 + 512 B in f32, half that in f16.
    assert _parts(Candidate("f32", ("f32", "f32")))["layer 0 backward"]["bytes"] == 160512
    f16 = _parts(Candidate("f32", ("f16", "f32"), True, "dynamic"))
    assert f16["layer 0 backward"]["bytes"] == 80256


def test_static_loss_scaling_reads_the_found_inf_flag_too():
    # Scale the loss and unscale + check the f32 gradients ((1000 + 112) x 4 x 2 B): 2 kernels,
    # one host sync (dynamic adds the scale's update, a third kernel).
    part = _parts(Candidate("f16", ("f16", "f32"), True, "static"))["loss scaling (static)"]
    assert (part["bytes"], part["kernels"], part["syncs"]) == (8896, 2, 1)
    assert part["seconds"] == pytest.approx(8896 / 1e12 + 2e-6 + 2e-6, rel=1e-12)


def test_the_fused_network_casts_and_stores_by_hand():
    f32_grid = _parts(Candidate("f32", ("f16",), True, "tcnn", mlp="fused"))
    # An f32 grid's 4 features per query are cast to f16 and their gradient back:
    # 2 x 1000 x 4 x (4 + 2) B; an f16 grid feeds the network directly.
    assert f32_grid["fused input cast"]["bytes"] == 48000
    assert "fused input cast" not in _parts(Candidate("f16", ("f16",), True, "tcnn", mlp="fused"))
    # The f32 weights (112) cast to f16 and the gradient back: 2 x 112 x 6 B.
    assert f32_grid["fused weight cast"]["bytes"] == 1344
    # Padded input and output (16 columns each, f16) 1000 x 32 x 2 B = 64000, plus the one hidden
    # layer's f16 activations 1000 x 16 x 2 B = 32000, written forward and read backward.
    assert f32_grid["fused forward"]["bytes"] == 64000 + 32000
    assert f32_grid["fused backward"]["bytes"] == 64000 + 2 * 32000


def test_fused_padding_keeps_a_multiple_of_16():
    # 8 levels x 2 features = 16 inputs: already a multiple of 16, not padded to 32. MACs per
    # query 16 x 16 + 16 x 16 (3 outputs padded to 16) = 512; forward 2 x 1000 x 512 FLOPs.
    shape = TextureShape(points=1000, n_levels=8, n_features=2, grid_params=1000, n_layers=2,
                         width=16, n_outputs=3)  # fmt: skip
    parts = _parts(Candidate("f16", ("f16",), True, "tcnn", mlp="fused"), shape)
    assert parts["fused forward"]["flops"] == 1024000


def test_fp8_backward_and_activations_by_hand():
    parts = _parts(Candidate("f16", ("f32", "f32"), True, "none", quant="fp8"))
    # The output gradient (1000 x 16) quantised: amax + scale-and-cast, 9 B per value, 2 kernels.
    assert parts["layer 0 gradient quantise"]["bytes"] == 144000
    assert parts["layer 0 gradient quantise"]["kernels"] == 2
    # Input and weight gradients: 4 x 1000 x 64 FLOPs.
    assert parts["layer 0 backward"]["flops"] == 256000
    # ReLU between the layers on f32 values: 5 x 1000 x 16 x 4 B, forward and backward kernels.
    assert (parts["layer 0 activation"]["bytes"], parts["layer 0 activation"]["kernels"]) == (
        320000,
        2,
    )
    assert "layer 1 activation" not in parts


def test_the_texture_shape_of_a_config_by_hand():
    # 2 levels of a 2^4-entry hash table (base resolution 16: 17^3 corners > 16, so each level
    # holds the full 16 entries) x 2 features = 64 grid parameters; hidden 2: 3 layers.
    texture = {"channels": 5, "internal_dims": 16, "hidden": 2,
               "encoder": {"n_levels": 2, "n_features_per_level": 2, "log2_hashmap_size": 4,
                           "base_resolution": 16, "per_level_scale": 2.0}}  # fmt: skip
    assert shape_from_config({"texture": texture}, 100) == TextureShape(
        points=100, n_levels=2, n_features=2, grid_params=64, n_layers=3, width=16, n_outputs=5
    )


# ----------------------------------------------------------------------------- certification
def test_an_interval_that_ends_on_the_margin_certifies():
    # Equal deltas: no spread, the interval is the point itself, ending on ±0.5 exactly.
    for d in (0.5, -0.5):
        cert = certify([d, d, d], 0.5)
        assert cert["low"] == cert["high"] == d and cert["certified"]
    assert not certify([0.5, 0.5, 0.5], 0.25)["certified"]


# ----------------------------------------------------------------------------- the driver
_REF, _ENC, _L0, _L1 = "e32-f32.f32-none", "e16-f32.f32-dyn", "e32-f16.f32-dyn", "e32-f32.f16-dyn"
_ENC_L0, _ENC_L1, _L0_L1, _ALL = ("e16-f16.f32-dyn", "e16-f32.f16-dyn", "e32-f16.f16-dyn",
                                  "e16-f16.f16-dyn")  # fmt: skip


class _Runs:
    """A pool whose runs return at once: f32 at seed s has PSNR 30 + s; a candidate's run is
    ``table[(name, seed)]``, a Δ in dB (0.0 where missing) or fields over the completed run."""

    def __init__(self, table):
        self.table, self.results, self.jobs = table, {}, []
        self.base = {"scene": {"name": "builtin"}}
        self.trained = self.reused = 0

    def run(self, jobs):
        for c, seed in dict.fromkeys(jobs):
            if (c.name, seed) in self.results:
                continue
            self.jobs.append((c.name, seed))
            entry = self.table.get((c.name, seed), 0.0)
            entry = entry if isinstance(entry, dict) else {"psnr": 30.0 + seed + entry}
            self.results[(c.name, seed)] = {"status": "completed", "psnr": 30.0 + seed,
                                            "time_per_iter_s": 0.01, "device": "cpu",
                                            "ran_beside": 0, "iterations": 6,
                                            "wall_time_s": 1.5, "wall_time_total_s": 1.5,
                                            "time_total_complete": True, **entry}  # fmt: skip
            self.trained += 1


def _state(tmp_path, table, costs, space=None, **search):
    """Two layers; the space: grid f16/f32, layers f32/f16, f32 masters, no scaling or dynamic
    (``space`` overrides keys). Modelled costs: f32 10, ``costs`` by name, 100 for the others
    (dearer than f32: never combined, varied or certified)."""
    space = {"encoder_dtypes": ["f16", "f32"], "layer_dtypes": ["f32", "f16"],
             "master_weights": [True], "loss_scaling": ["none", "dynamic"], "fused": False,
             "quantized": [], **(space or {})}  # fmt: skip
    settings = check_search_config({"certify_seeds": 2, "max_combinations": 0,
                                    "max_variants": 0, "workers": 1, "space": space,
                                    **search})  # fmt: skip
    kept, pruned = enumerate_space(2, 32, settings["space"])
    ref = reference_candidate(2)
    kept = set(kept) | {ref}
    costs = {_REF: 10.0, **costs}
    model = {c.name: {"seconds": costs.get(c.name, 100.0), "parts": []} for c in kept}
    result = tmp_path / "configs" / "precision" / "t.yaml"
    return driver.SearchState(
        settings=settings, ref=ref, kept=kept, pruned=pruned, model=model, points=1,
        shape=SimpleNamespace(), name="t", result_path=result, out=tmp_path,
        start=time.perf_counter(), pool=_Runs(table),
    )  # fmt: skip


def _answer(state, monkeypatch):
    """The certified candidate's name (no files written)."""
    monkeypatch.setattr(driver, "write_results", lambda state, certified: certified)
    return driver._search(state).name


def _screened(state, stage):
    return [name for name, s in state.stages.items() if s == stage]


def _candidate(state, name):
    return next(c for c in state.kept if c.name == name)


_SINGLES = {_ENC: 7.0, _L0: 8.0, _L1: 9.0}


def test_a_screen_on_the_threshold_passes(tmp_path, monkeypatch):
    # |Δ| <= screen_db: the grid's lowering is +0.5, layer 0's -0.5 (both on the line, both
    # pass), layer 1's +0.51 fails. The grid's, the cheapest, certifies (Δ 0 on seeds 1, 2).
    table = {(_ENC, 0): 0.5, (_L0, 0): -0.5, (_L1, 0): 0.51}
    state = _state(tmp_path, table, _SINGLES)
    assert _answer(state, monkeypatch) == _ENC
    rows = {r["candidate"]: r for r in results.summarise(state, state.ref)["candidates"]}
    assert [rows[n]["screen_passed"] for n in (_ENC, _L0, _L1)] == [True, True, False]


def test_a_one_part_screen_prefers_dynamic_to_static_loss_scaling(tmp_path, monkeypatch):
    state = _state(tmp_path, {}, _SINGLES, space={"loss_scaling": ["none", "static", "dynamic"]})
    _answer(state, monkeypatch)
    assert sorted(_screened(state, "screen: one part")) == sorted([_ENC, _L0, _L1])


def test_an_f32_run_that_did_not_complete_leaves_its_seed_without_a_difference(
    tmp_path, monkeypatch
):
    # f32 diverged at seed 2 (its PSNR field still holds a number): no Δ there, so no candidate
    # can be certified, though every candidate's own runs completed with Δ 0.
    state = _state(tmp_path, {(_REF, 2): {"status": "diverged"}}, _SINGLES)
    assert _answer(state, monkeypatch) == _REF
    enc = _candidate(state, _ENC)
    assert state.delta(enc, 2) is None and state.delta(enc, 1) == 0.0
    cert = state.certificate(enc)
    assert cert["certified"] is False and cert["n"] == 1
    # the reason names the run that did not complete: f32's, not the candidate's own
    assert cert["reason"] == (
        "runs not completed: ['completed', 'completed']; f32's: ['completed', 'diverged']"
    )


def test_the_cheapest_passing_combination_of_two_parts_is_screened_and_certified(
    tmp_path, monkeypatch
):
    # Every one-part lowering passes; the combinations are cheaper, the grid + layer 0 one the
    # cheapest (2). One combination screen: that one; it passes and certifies, and is the
    # answer (cheaper than every single).
    costs = {**_SINGLES, _ENC_L0: 2.0, _ENC_L1: 3.0, _L0_L1: 4.0, _ALL: 5.0}
    state = _state(tmp_path, {}, costs, max_combinations=1)
    assert _answer(state, monkeypatch) == _ENC_L0
    assert _screened(state, "screen: combination") == [_ENC_L0]


def test_combinations_are_screened_only_while_cheaper_than_the_cheapest_pass(tmp_path, monkeypatch):
    # The singles pass at 7 (grid), 5 (layer 0), 9 (layer 1): the bar is 5, the cheapest
    # passing one (not the first to pass). No combination is below it (5 is not below 5).
    costs = {_ENC: 7.0, _L0: 5.0, _L1: 9.0, _ENC_L0: 6.0, _L0_L1: 5.0, _ENC_L1: 8.0, _ALL: 5.5}
    state = _state(tmp_path, {}, costs, max_combinations=4)
    assert _answer(state, monkeypatch) == _L0
    assert _screened(state, "screen: combination") == []


def test_the_combination_budget_counts_every_screen_of_a_batch(tmp_path, monkeypatch):
    # Two workers, three combination screens allowed, four cheap combinations that all fail:
    # a batch of two, then one (not two batches of two).
    costs = {**_SINGLES, _ENC_L0: 1.0, _ENC_L1: 2.0, _L0_L1: 3.0, _ALL: 4.0}
    table = {(name, 0): -2.0 for name in (_ENC_L0, _ENC_L1, _L0_L1, _ALL)}
    state = _state(tmp_path, table, costs, max_combinations=3, workers=2)
    _answer(state, monkeypatch)
    assert _screened(state, "screen: combination") == [_ENC_L0, _ENC_L1, _L0_L1]


def test_variants_keep_the_cheapest_passing_candidates_dtypes(tmp_path, monkeypatch):
    # Layer 1's lowering passes (cost 6); the grid's and layer 0's fail. Its variant without
    # loss scaling (cost 4) is screened, passes and certifies. e32-f16.f32-none (cost 3) shares
    # its grid dtype but not its layers: not a variant.
    costs = {**_SINGLES, _L1: 6.0, "e32-f32.f16-none": 4.0, "e32-f16.f32-none": 3.0}
    state = _state(tmp_path, {(_ENC, 0): -2.0, (_L0, 0): -2.0}, costs, max_variants=1)
    assert _answer(state, monkeypatch) == "e32-f32.f16-none"
    assert _screened(state, "screen: variant") == ["e32-f32.f16-none"]
    assert _screened(state, "screen: combination") == []


def test_a_candidate_as_dear_as_f32_is_not_certified(tmp_path, monkeypatch):
    # Layer 1's lowering passes, but the model finds it no cheaper than f32 (10 against 10).
    state = _state(tmp_path, {(_ENC, 0): -2.0, (_L0, 0): -2.0}, {**_SINGLES, _L1: 10.0})
    assert _answer(state, monkeypatch) == _REF
    assert [job for job in state.pool.jobs if job[0] != _REF and job[1] > 0] == []


def test_no_combination_dearer_than_f32_is_screened_when_every_pass_is_dearer(
    tmp_path, monkeypatch
):
    # The grid's (12) and layer 0's (13) lowerings pass but cost more than f32 (10); their
    # combination (11) is cheaper than either, yet dearer than f32: it could never be
    # certified (only candidates cheaper than f32 are), so it is not screened.
    costs = {**_SINGLES, _ENC: 12.0, _L0: 13.0, _ENC_L0: 11.0}
    state = _state(tmp_path, {(_L1, 0): -2.0}, costs, max_combinations=1)
    assert _answer(state, monkeypatch) == _REF
    assert _screened(state, "screen: combination") == []
    assert _ENC_L0 not in {name for name, _ in state.pool.jobs}


def test_at_most_max_certify_candidates_are_run_at_the_certification_seeds(tmp_path, monkeypatch):
    # All three one-part lowerings pass their screen (Δ 0 at seed 0) and fail certification
    # (Δ -2 at seeds 1 and 2); max_certify = 2: the two cheapest (grid 7, layer 0 8) are run
    # at the certification seeds, layer 1 (9) never, and the answer is f32.
    table = {(name, s): -2.0 for name in (_ENC, _L0, _L1) for s in (1, 2)}
    state = _state(tmp_path, table, _SINGLES, max_certify=2)
    assert _answer(state, monkeypatch) == _REF
    certified = [name for name, seed in state.pool.jobs if name != _REF and seed > 0]
    assert certified == [_ENC, _ENC, _L0, _L0]


def test_each_certification_interval_is_at_the_searchs_share_over_max_certify(
    tmp_path, monkeypatch
):
    # Bonferroni over the max_certify = 2 candidates the search may certify, not over its 3
    # certification seeds: each interval at 1 - 0.05 / 2 = 0.975. Δ at seeds 1, 2, 3 of the
    # grid's lowering: 0.1, 0.2, 0.3 (mean 0.2, sd 0.1), half width t(0.9875, 2) * 0.1 / sqrt(3)
    # with t(q, 2) = (2q - 1) / sqrt(2q(1 - q)) = 6.2053: 0.35826.
    table = {(_ENC, 1): 0.1, (_ENC, 2): 0.2, (_ENC, 3): 0.3}
    state = _state(tmp_path, table, _SINGLES, certify_seeds=3, max_certify=2,
                   adjust="bonferroni")  # fmt: skip
    _answer(state, monkeypatch)
    assert state.confidence == pytest.approx(0.975, abs=1e-15)
    cert = state.certificate(_candidate(state, _ENC))
    q = 0.9875
    half = (2 * q - 1) / (2 * q * (1 - q)) ** 0.5 * 0.1 / 3**0.5
    assert cert["half_width"] == pytest.approx(half, rel=1e-9)
    assert cert["confidence"] == state.confidence and not cert["certified"]


def _compose(*overrides):
    register_experiments()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_a_space_without_f32_layers_still_has_its_reference(tmp_path, monkeypatch):
    # layer_dtypes [f16]: the space holds no all-f32 candidate, yet every candidate is
    # compared with f32, which runs at the screens' and the certification seeds.
    monkeypatch.setattr(driver, "RunPool", lambda base, out, settings, stop: _Runs({}))
    cfg = _compose("+experiment=precision_search", "train=tiny", "texture=tiny",
                   "scene.resolution=16", "search.certify_seeds=2", "search.name=edge_search",
                   f"search.config_dir={tmp_path / 'cfg'}", "search.space.layer_dtypes=[f16]",
                   "search.space.encoder_dtypes=[f32]", "search.space.master_weights=[true]",
                   "search.space.loss_scaling=[dynamic]", "search.space.fused=false",
                   "search.space.quantized=[]")  # fmt: skip
    summary = run_search(cfg, tmp_path / "out")
    assert summary["certified"] == summary["reference"] == "e32-f32.f32.f32-none"
    ref = next(r for r in summary["candidates"] if r["candidate"] == summary["reference"])
    assert sorted(ref["runs"]) == ["0", "1", "2"]
    # every run (the fake pool's: 6 iterations, 1.5 s each) is in the budget
    assert summary["budget"]["iterations"] == 6 * summary["budget"]["runs"]
    assert summary["budget"]["run_wall_s"] == 1.5 * summary["budget"]["runs"]


def test_kd_smoothing_doubles_the_texture_queries_only_with_a_weight():
    from mptex.train.config import validate_config

    full = validate_config(_compose("train=tiny", "texture=tiny", "scene.resolution=16"))

    def points(**train):
        return driver._points({**full, "train": {**full["train"], **train}})

    off = points(kd_smooth=False)
    assert 1 <= off <= 16 * 16  # covered pixels of one 16 x 16 view
    assert points(kd_smooth=True, kd_smooth_weight=0.0) == off
    assert abs(points(kd_smooth=True, kd_smooth_weight=0.03) - 2 * off) <= 1


def test_a_cost_texture_path_out_of_the_texture_configs_is_refused():
    # "../texture/tiny" names an existing file, but a path, not one of the configs' names.
    with pytest.raises(SearchError, match="^search.cost.texture: expected the name"):
        driver._cost_texture({"cost": {"texture": "../texture/tiny"}}, {})


# ----------------------------------------------------------------------------- what is written
def test_the_directory_record_leaves_out_what_does_not_change_a_run():
    settings = check_search_config({})
    full = {"scene": {"name": "builtin"}, "texture": {"hidden": 2},
            "train": {"iterations": 6, "seed": 0, "threads": 1, "progress": False}}  # fmt: skip
    record = results.settings_record(settings, full)
    other = results.settings_record(
        {**settings, "workers": 7, "threads": 3},
        {**full, "train": {**full["train"], "seed": 5, "threads": 4, "progress": True}},
    )
    assert record == other
    assert "workers" not in record["search"] and "threads" not in record["train"]
    changed = {**full, "train": {**full["train"], "iterations": 7}}
    assert results.settings_record(settings, changed) != record


def test_a_gpu_time_of_zero_is_not_a_measurement(tmp_path, monkeypatch):
    cuda = {"device": "cuda:0", "time_per_iter_s": 0.0}
    state = _state(tmp_path, {(_L1, s): dict(cuda, psnr=30.0 + s) for s in (0, 1, 2)}, _SINGLES)
    _answer(state, monkeypatch)
    row = next(r for r in results.summarise(state, state.ref)["candidates"]
               if r["candidate"] == _L1)  # fmt: skip
    assert row["measured_s"] is None and row["cost_source"] == "modelled"
    assert row["cost_s"] == row["model_s"] == 9.0


def test_a_measured_cost_is_the_median_of_its_seeds_gpu_times(tmp_path, monkeypatch):
    # Layer 1's lowering alone passes and certifies, timed alone on the GPU at seeds 0, 1, 2:
    # 0.03, 0.01, 0.02 s per iteration; its cost is their median, 0.02 (not the first, the
    # fastest or the mean of an outlier).
    times = {0: 0.03, 1: 0.01, 2: 0.02}
    table = {(_L1, s): {"device": "cuda:0", "time_per_iter_s": t, "psnr": 30.0 + s}
             for s, t in times.items()}  # fmt: skip
    table.update({(_ENC, 0): -2.0, (_L0, 0): -2.0})
    state = _state(tmp_path, table, _SINGLES)
    assert _answer(state, monkeypatch) == _L1
    candidates = results.summarise(state, state.ref)["candidates"]
    row = next(r for r in candidates if r["candidate"] == _L1)
    assert row["measured_s"] == 0.02 and row["cost_source"] == "measured"
    # search.json lists the candidates by that cost: layer 1's measured 0.02 s before the
    # modelled grid (7), layer 0 (8) and f32 (10), though its model (9) would put it third
    assert [r["candidate"] for r in candidates] == [_L1, _ENC, _L0, _REF]


def test_a_measured_cost_over_an_even_count_of_seeds_is_the_mean_of_the_middle_two(
    tmp_path, monkeypatch
):
    # Three certification seeds and the screens' make four timed runs (the default): 0.04,
    # 0.01, 0.03, 0.02 s per iteration. Their median is (0.02 + 0.03) / 2 = 0.025, not the
    # larger middle value 0.03; f32's four runs, each 0.05, have the median 0.05.
    times = {0: 0.04, 1: 0.01, 2: 0.03, 3: 0.02}
    table = {(_L1, s): {"device": "cuda:0", "time_per_iter_s": t, "psnr": 30.0 + s}
             for s, t in times.items()}  # fmt: skip
    table.update({(_REF, s): {"device": "cuda:0", "time_per_iter_s": 0.05, "psnr": 30.0 + s}
                  for s in times})  # fmt: skip
    table.update({(_ENC, 0): -2.0, (_L0, 0): -2.0})
    state = _state(tmp_path, table, _SINGLES, certify_seeds=3)
    assert _answer(state, monkeypatch) == _L1
    rows = {r["candidate"]: r for r in results.summarise(state, state.ref)["candidates"]}
    assert rows[_L1]["measured_s"] == pytest.approx(0.025, rel=1e-15)
    assert rows[_L1]["cost_s"] == rows[_L1]["measured_s"]
    assert rows[_REF]["measured_s"] == 0.05


def test_earlier_wall_time_is_read_only_when_it_is_a_time(tmp_path):
    for value, expected in ((12.5, 12.5), (0, 0.0), (-3.0, 0.0), ("12", 0.0), (None, 0.0)):
        (tmp_path / "search.json").write_text(json.dumps({"budget": {"search_wall_s": value}}))
        assert results._earlier_wall_s(tmp_path) == expected, value
    (tmp_path / "search.json").write_text("{")
    assert results._earlier_wall_s(tmp_path) == 0.0


@pytest.mark.parametrize("complete", [True, False])
def test_the_budgets_run_time_counts_every_process_of_a_continued_run(tmp_path, complete):
    # _L1's runs were stopped and continued: 1.5 s in their last process, 4.0 s in all; with
    # complete false a process of theirs was killed without a record (its time not known)
    entry = {"wall_time_total_s": 4.0, "time_total_complete": complete}
    table = {(_L1, s): {"psnr": 30.0 + s, **entry} for s in (0, 1, 2)}
    state, written = _written(tmp_path, table, _SINGLES)
    continued = sum(1 for name, _ in state.pool.jobs if name == _L1)
    budget = written["budget"]
    assert continued > 0
    assert budget["run_wall_s"] == 4.0 * continued + 1.5 * (budget["runs"] - continued)
    assert budget["run_wall_complete"] is complete
    said = f"{'' if complete else 'at least '}{budget['run_wall_s']:.0f} s of run time"
    assert f"iterations, {said}," in (tmp_path / "search.md").read_text()


def test_a_runs_summary_holds_its_total_time_where_it_is_known():
    summary = pool_module.run_summary
    timed = {"status": "diverged", "wall_time_s": 1.5, "resume_count": 1}
    total = {"wall_time_total_s": 4.0, "time_total_complete": True}
    assert summary({**timed, **total})["wall_time_total_s"] == 4.0
    # a record from before the totals: a run never resumed took its one process's time; a
    # resumed one, at least its last process's (the "at least" of the budget, as the CPU
    # benchmark's sweep table counts it)
    old = summary({**timed, "resume_count": 0})
    assert (old["wall_time_total_s"], old["time_total_complete"]) == (1.5, True)
    old = summary(timed)
    assert (old["wall_time_total_s"], old["time_total_complete"]) == (1.5, False)


def test_the_reproduce_command_repeats_the_scene_train_and_texture_overrides(monkeypatch):
    from hydra.core.hydra_config import HydraConfig

    task = ["scene=soccer", "train.seed=4", "texture=tiny", "+train.iterations=50",
            "search.workers=2", "precision=f16"]  # fmt: skip
    hydra = SimpleNamespace(overrides=SimpleNamespace(task=task))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra))
    assert results._reproduce("mine", 0, Path("/d")) == (
        "mptex-train --config-dir /d +experiment=quick precision=mine train.seed=0 "
        "scene=soccer texture=tiny +train.iterations=50"
    )


def _written(tmp_path, table, costs, **search):
    """A finished search over hand-chosen runs, its files written; its search.json dict."""
    state = _state(tmp_path, table, costs, **search)
    certified = driver._search(state)["certified"]
    assert certified == json.loads((tmp_path / "search.json").read_text())["certified"]
    return state, json.loads((tmp_path / "search.json").read_text())


def _certified_line(tmp_path):
    text = (tmp_path / "search.md").read_text()
    return next(x for x in text.splitlines() if x.startswith("**Certified cheapest:"))


def test_the_result_header_gives_the_modelled_cost_beside_a_measured_one(tmp_path):
    # The grid's lowering ran alone on a GPU at 2 ms / iteration: its cost is measured; the
    # header's "Modelled cost" is still the model's 4 s.
    cuda = {"device": "cuda:0", "time_per_iter_s": 0.002}
    table = {(_ENC, s): dict(cuda, psnr=30.0 + s) for s in (0, 1, 2)}
    _, summary = _written(tmp_path, table, {**_SINGLES, _ENC: 4.0})
    assert summary["certified"] == _ENC
    header = Path(summary["result_config"]).read_text().splitlines()
    assert header[2].startswith("# Modelled cost 4000000.0 us / iteration on NVIDIA H100 SXM5 "
                                "(f32: 10000000.0 us)")  # fmt: skip


def test_the_certified_line_gives_f32s_cost_over_the_answers(tmp_path):
    # Modelled 10 s for f32 and 4 s for the grid's lowering: 2.50x less, modelled.
    _written(tmp_path, {}, {**_SINGLES, _ENC: 4.0})
    line = _certified_line(tmp_path)
    assert "cost 4000000.0 µs / iteration vs f32's 10000000.0 µs (2.50x less), " in line
    assert line.endswith("modelled on NVIDIA H100 SXM5.")


def test_a_cost_is_called_measured_only_where_f32s_is_measured_too(tmp_path):
    cuda = {"device": "cuda:0", "time_per_iter_s": 0.002}
    table = {(_ENC, s): dict(cuda, psnr=30.0 + s) for s in (0, 1, 2)}
    _written(tmp_path, table, _SINGLES)
    assert _certified_line(tmp_path).endswith("modelled on NVIDIA H100 SXM5.")


def test_a_certified_difference_that_excludes_zero_is_explained(tmp_path):
    # Δ -0.2 on both certification seeds: the interval is [-0.2, -0.2], inside ±0.5 (certified)
    # but below 0 (the report's verdict "worse").
    _, summary = _written(tmp_path, {(_ENC, 1): -0.2, (_ENC, 2): -0.2}, _SINGLES)
    assert summary["certified"] == _ENC
    text = (tmp_path / "search.md").read_text()
    assert "(The report's verdict is `worse`: the interval excludes 0" in text


def test_the_table_marks_a_certificate_that_failed_and_only_larger_psnrs_are_above_f32(
    tmp_path,
):
    # The grid's lowering passes its screen but not its certification (Δ -1.0, -1.2); layer 0's
    # certifies. Layer 1's is 2 dB above f32 at the screen (not equivalent: listed as above it).
    table = {(_ENC, 1): -1.0, (_ENC, 2): -1.2, (_L1, 0): 2.0}
    _, summary = _written(tmp_path, table, _SINGLES)
    assert summary["certified"] == _L0
    lines = (tmp_path / "search.md").read_text().splitlines()
    row = {name: next(x for x in lines if x.startswith(f"| `{name}` |")) for name in (_ENC, _L0)}
    assert row[_ENC].split(" | ")[7] == "no" and row[_L0].split(" | ")[7] == "yes"
    above = next(x for x in lines if x.startswith("Above f32 by more than"))
    assert f"`{_L1}`" in above and f"`{_ENC}`" not in above and f"`{_L0}`" not in above


def test_a_lowering_far_below_f32_is_not_listed_as_above_it(tmp_path):
    _written(tmp_path, {(_L1, 0): -2.0}, _SINGLES)
    assert "Above f32 by more than" not in (tmp_path / "search.md").read_text()


def test_the_pruning_reasons_are_listed_most_frequent_first(tmp_path):
    # Two layers, no masters allowed too: 8 x invalid (mixed layers), 4 x invalid (GradScaler),
    # 2 x redundant (f32 layers), 1 x redundant (no f16 value).
    _, summary = _written(tmp_path, {}, _SINGLES, space={"master_weights": [True, False]})
    lines = (tmp_path / "search.md").read_text().splitlines()
    counts = [int(x[2:].split(" × ")[0]) for x in lines if " × " in x and x.startswith("- ")]
    assert counts == [8, 4, 2, 1]


def test_the_plotted_quality_is_the_certified_mean_where_there_is_one():
    row = {"certificate": {"mean": 0.2, "low": 0.1}, "delta_db": {"0": 0.4}}
    assert _quality(row, 0) == 0.2
    assert _quality({"certificate": None, "delta_db": {"0": 0.4}}, 0) == 0.4
    assert _quality({"certificate": {"certified": False, "reason": "x"}, "delta_db": {}}, 0) is None


def test_the_cheapest_untrained_kinds_are_listed_even_for_one_untrained_candidate(tmp_path):
    _, summary = _written(tmp_path, {}, _SINGLES)
    summary["not_trained"] = {
        "count": 1,
        "cheapest_by_kind": [
            {"kind": "bfloat16 hash grid", "candidate": "ebf16-f32.f32-none", "model_s": 5.0}
        ],
    }
    text = write_search_report(tmp_path, summary).read_text()
    assert "Not trained: 1 kept candidates." in text
    assert "- bfloat16 hash grid: `ebf16-f32.f32-none`, 5000000.0 µs / it (0.50 of f32's)" in text


def test_one_candidate_at_most_needs_no_adjustment():
    one = {"confidence": 0.95, "adjust": "bonferroni", "max_certify": 1}
    assert confidence_text(one) == "95%"
    assert _multiplicity(one).startswith("one candidate at most is tried")
    three = {"confidence": 1 - 0.05 / 3, "adjust": "bonferroni", "max_certify": 3}
    assert confidence_text(three) == "98.33% (Bonferroni over max_certify = 3)"


def test_pareto_front_keeps_one_of_points_equal_in_cost_and_distance():
    # (1.0, +0.2) and (1.0, -0.2) are as far from f32 at the same cost: the first is kept.
    assert pareto_front([(1.0, 0.2), (1.0, -0.2), (2.0, 0.0)]) == [0, 2]


def test_the_fused_network_keeps_its_outer_loss_scales_over_an_f32_grid():
    # tcnn's network computes in f16 whatever the grid's dtype: a static or dynamic scale over
    # its own is not redundant there, also with an f32 grid.
    kept, pruned = enumerate_space(2, 32, {"encoder_dtypes": ["f32"], "quantized": []})
    names = {c.name for c in kept}
    assert {"e32-fused-tcnn", "e32-fused-s128", "e32-fused-dyn"} <= names
    # only the fused network with no scale at all, which tcnn's network always has
    assert [p["candidate"] for p in pruned if "fused" in p["candidate"]] == ["e32-fused-none"]


@pytest.mark.parametrize(
    "space, key, says",
    [
        ({"static_loss_scale": 0}, "static_loss_scale", "0"),
        ({"encoder_dtypes": []}, "encoder_dtypes", "[]"),
    ],
)
def test_a_bad_space_value_is_one_line_naming_its_key(space, key, says):
    with pytest.raises(ValueError) as info:
        enumerate_space(2, 32, space)
    message = str(info.value)
    assert message.startswith(f"search.space.{key}: ") and "\n" not in message, message
    assert says in message


def test_an_iterations_flops_are_its_gemms_by_hand():
    # 4 -> 16 -> 3, N = 1000: forward 2 N (64 + 48), backward twice that: 6 x 1000 x 112.
    cost = iteration_cost(Candidate("f32", ("f32", "f32")), _SHAPE, _GPU)
    assert cost["flops"] == 6 * 1000 * (4 * 16 + 16 * 3) == 672000
    assert cost["bytes"] == sum(p["bytes"] for p in cost["parts"])
    assert cost["syncs"] == 0


def test_a_bf16_grid_zeroes_and_casts_what_its_consumers_read_by_hand():
    # N = 1000, 4 features, 1000 grid entries (the _SHAPE of these tests).
    bf16 = _parts(Candidate("bf16", ("f32", "f32")))
    f16 = _parts(Candidate("f16", ("f32", "f32")))
    # The gradient zeroed each step is the one the backward adds to: f32 for the bf16 grid
    # (4 B an entry), f16 for tcnn's half grid (2 B).
    assert bf16["grid gradient zero"]["bytes"] == 1000 * 4
    assert f16["grid gradient zero"]["bytes"] == 1000 * 2
    # FP8 GEMMs take f32 inputs: the bf16 features are cast (read 2 B, write 4 B), forward
    # and backward, over N x 4 values.
    fp8 = _parts(Candidate("bf16", ("f32", "f32"), quant="fp8"))
    assert fp8["layer 0 input cast"]["bytes"] == 2 * 1000 * 4 * (2 + 4)
    # tcnn's network takes f16 inputs: the bf16 features are cast too (2 B -> 2 B).
    fused = _parts(Candidate("bf16", ("f16",), True, "tcnn", mlp="fused"))
    assert fused["fused input cast"]["bytes"] == 2 * 1000 * 4 * (2 + 2)
    assert "fused input cast" not in _parts(Candidate("f16", ("f16",), True, "tcnn", mlp="fused"))


# ----------------------------------------------------------------------------- the run pool
def _pool(tmp_path, workers=1, received=()):
    settings = {"workers": workers, "threads": 3}
    return RunPool({"train": {}}, tmp_path, settings, SimpleNamespace(received=list(received)))


def _fake_training(monkeypatch, status="completed"):
    calls = []

    def train_run(cfg, run_dir):
        calls.append(run_dir)
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return {"status": status, "psnr": 30.0}

    monkeypatch.setattr(pool_module, "_train_run", train_run)
    return calls


def test_a_runs_config_is_the_base_with_its_candidate_and_seed(tmp_path):
    pool = _pool(tmp_path)
    c = Candidate("f16", ("f16", "f32"), True, "dynamic")
    cfg = pool.config(c, 4)
    assert cfg["precision"] == c.policy_dict()
    assert cfg["train"] == {"seed": 4, "threads": 3, "progress": False, "n_val_images": 0,
                            "resume": "auto"}  # fmt: skip
    assert pool.base == {"train": {}}  # the base is left as it was


def test_a_run_already_in_the_pool_is_not_trained_again(tmp_path, monkeypatch):
    calls = _fake_training(monkeypatch)
    pool, ref = _pool(tmp_path), reference_candidate(2)
    pool.run([(ref, 0), (ref, 0)])
    pool.run([(ref, 0)])
    assert len(calls) == 1 and (pool.trained, pool.reused) == (1, 0)


def test_a_single_run_with_two_workers_trains_in_process_and_alone(tmp_path, monkeypatch):
    _fake_training(monkeypatch)

    def no_process(*args, **kwargs):
        raise AssertionError("a worker process for one run")

    monkeypatch.setattr(pool_module, "_run_in_process", no_process)
    pool, ref = _pool(tmp_path, workers=2), reference_candidate(2)
    pool.run([(ref, 0)])
    assert pool.results[(ref.name, 0)]["ran_beside"] == 0


def test_a_run_that_stopped_stops_the_search(tmp_path, monkeypatch):
    _fake_training(monkeypatch, status="interrupted")
    pool, ref = _pool(tmp_path), reference_candidate(2)
    with pytest.raises(SearchInterrupted, match=r"by a signal \(1 run\(s\) checkpointed\)"):
        pool.run([(ref, 0)])
    assert pool.results[(ref.name, 0)]["status"] == "interrupted"


def test_a_received_stop_trains_nothing_but_finished_runs_are_read_back(tmp_path, monkeypatch):
    calls = _fake_training(monkeypatch)
    pool, ref = _pool(tmp_path, received=["SIGTERM"]), reference_candidate(2)
    done = pool.run_dir(ref, 1)
    done.mkdir(parents=True)
    (done / "metrics.json").write_text(json.dumps({"status": "completed", "psnr": 31.0}))
    pool.run([(ref, 1)])  # nothing to train: no stop
    assert pool.results[(ref.name, 1)]["psnr"] == 31.0 and pool.reused == 1
    with pytest.raises(SearchInterrupted, match="^stopped by SIGTERM; the same command"):
        pool.run([(ref, 0)])
    assert calls == []


def test_a_run_that_raises_is_a_failed_result(monkeypatch):
    import mptex.train

    def train(cfg, run_dir):
        raise RuntimeError("boom")

    monkeypatch.setattr(mptex.train, "train", train)
    result = pool_module._train_run({}, "unused")
    assert (result["status"], result["error"], result["psnr"]) == (
        "failed",
        "RuntimeError: boom",
        None,
    )


def test_a_failed_run_is_a_result_and_the_search_goes_on(tmp_path, monkeypatch):
    # A run that raised (its metrics say failed) is not a stopped one: nothing is interrupted,
    # and a later search trains it again (only completed and diverged runs are read back).
    calls = _fake_training(monkeypatch, status="failed")
    pool, ref = _pool(tmp_path), reference_candidate(2)
    pool.run([(ref, 0), (ref, 1)])
    assert [pool.results[(ref.name, s)]["status"] for s in (0, 1)] == ["failed", "failed"]
    assert (pool.trained, pool.reused, len(calls)) == (2, 0, 2)


@pytest.mark.parametrize("text", ['{"status": "compl', "[]", "null", '"completed"'])
def test_a_metrics_json_that_is_no_runs_record_is_trained_again(tmp_path, monkeypatch, text):
    # A torn file, or JSON that is not an object: no finished run to read back.
    calls = _fake_training(monkeypatch)
    pool, ref = _pool(tmp_path), reference_candidate(2)
    pool.run_dir(ref, 0).mkdir(parents=True)
    (pool.run_dir(ref, 0) / "metrics.json").write_text(text)
    pool.run([(ref, 0)])
    assert len(calls) == 1 and (pool.trained, pool.reused) == (1, 0)
    assert pool.results[(ref.name, 0)]["status"] == "completed"


def test_a_runs_directory_is_its_candidates_name_and_seed(tmp_path):
    pool, ref = _pool(tmp_path), reference_candidate(2)
    assert pool.run_dir(ref, 3) == tmp_path / "runs" / "e32-f32.f32-none" / "seed3"


def test_a_stopped_search_names_the_first_signal_it_received(tmp_path, monkeypatch):
    _fake_training(monkeypatch)
    pool, ref = _pool(tmp_path, received=["SIGTERM", "SIGINT"]), reference_candidate(2)
    with pytest.raises(SearchInterrupted, match="^stopped by SIGTERM; the same command"):
        pool.run([(ref, 0)])


# ----------------------------------------------------------------------------- the command
def _summary(cert):
    return {"candidates": [{"candidate": "e32-f32.f32-none", "certificate": cert}],
            "certified": "e32-f32.f32-none", "seeds": [1, 2],
            "budget": {"runs": 3, "search_wall_s": 4.0}, "reproduce": "mptex-train x",
            "result_config": "r.yaml"}  # fmt: skip


def test_the_command_prints_the_interval_or_a_dash(tmp_path, monkeypatch, capsys):
    import mptex.search
    from mptex.cli.search import run_search_command

    for cert, shown in (({"low": -0.123, "high": 0.05, "certified": True}, "[-0.12, +0.05] dB"),
                        ({"certified": False, "n": 1, "reason": "runs not completed"}, "-"),
                        (None, "-")):  # fmt: skip
        monkeypatch.setattr(mptex.search, "run_search", lambda cfg, out, c=cert: _summary(c))
        run_search_command({}, tmp_path)
        first = capsys.readouterr().out.splitlines()[0]
        assert first == (f"mptex-search: precision search: certified e32-f32.f32-none "
                         f"(PSNR - PSNR(f32) {shown}, seeds [1, 2]); 3 runs, 4 s")  # fmt: skip


@pytest.mark.parametrize(
    "error, code, word",
    [(SearchInterrupted("stopped"), 3, "interrupted"), (SearchError("search.x: bad"), 2, "error")],
)
def test_the_command_exits_3_when_stopped_and_2_on_a_bad_search(
    tmp_path, monkeypatch, capsys, error, code, word
):  # fmt: skip
    import mptex.search
    from mptex.cli.search import run_search_command

    def fails(cfg, out):
        raise error

    monkeypatch.setattr(mptex.search, "run_search", fails)
    with pytest.raises(SystemExit) as info:
        run_search_command({}, tmp_path)
    assert info.value.code == code
    assert capsys.readouterr().err == f"mptex-search: {word}: {error}\n"


# ------------------------------------------------------------- a worker process that dies
def test_a_run_in_its_own_process_sends_its_summary_back(tmp_path):
    from search_pool_children import send_summary

    result = pool_module._run_in_process({"train": {"seed": 3}}, str(tmp_path), send_summary)
    assert result == {"status": "completed", "psnr": 30.0, "error": None,
                      "run_dir": str(tmp_path), "cfg": {"train": {"seed": 3}}}  # fmt: skip


@pytest.mark.parametrize("child, how", [("killed", "killed by SIGKILL"),
                                        ("exits_3", "exited with status 3")])  # fmt: skip
def test_a_process_that_ends_without_a_summary_is_a_lost_run_saying_how(tmp_path, child, how):
    import search_pool_children

    body = getattr(search_pool_children, child)
    result = pool_module._run_in_process({}, str(tmp_path), body)
    assert (result["status"], result["error"], result["psnr"]) == ("lost", how, None)


def _lost(how):
    return {**pool_module.run_summary({}), "status": "lost", "error": how}


def _search_stop(monkeypatch, pool, jobs, run_in_process):
    """The line of the SearchInterrupted that ``pool.run(jobs)`` raises, its runs trained by
    ``run_in_process`` in place of worker processes."""
    monkeypatch.setattr(pool_module, "_run_in_process", run_in_process)
    with pytest.raises(SearchInterrupted) as info:
        pool.run(jobs)
    return str(info.value)


def test_a_lost_worker_costs_only_its_run_and_the_same_command_trains_it_again(
    tmp_path, monkeypatch
):
    ref = reference_candidate(2)
    pool = _pool(tmp_path, workers=2)
    lost_dir = str(pool.run_dir(ref, 1))
    calls = []

    def run_in_process(cfg, run_dir):  # seed 1's process is killed; the others finish
        calls.append(run_dir)
        if run_dir == lost_dir:
            return _lost("killed by SIGKILL")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return {**pool_module.run_summary({}), "status": "completed", "psnr": 30.0}

    stop = _search_stop(monkeypatch, pool, [(ref, 0), (ref, 1), (ref, 2)], run_in_process)
    assert stop == (
        f"the worker process of 1 run(s) ended without a result ({lost_dir}: killed by SIGKILL; "
        "the out-of-memory killer sends SIGKILL: fewer search.workers use less memory); the "
        f"finished runs are kept, and the same command continues the search in {tmp_path}"
    )
    # the two that finished are results, with their sharing record; the lost one is neither
    assert sorted(pool.results) == [(ref.name, 0), (ref.name, 2)] and pool.trained == 2
    assert (pool.run_dir(ref, 2) / "search_sharing.json").exists()
    assert not (pool.run_dir(ref, 1) / "search_sharing.json").exists()
    # the same runs again: only the lost one trains (alone, in this process)
    _fake_training(monkeypatch)
    pool.run([(ref, 0), (ref, 1), (ref, 2)])
    assert pool.results[(ref.name, 1)]["status"] == "completed" and pool.trained == 3


def test_a_worker_ended_by_a_relayed_stop_signal_is_part_of_the_stop(tmp_path, monkeypatch):
    # The search's handler relays a stop signal to its workers; one still starting (its run's
    # handlers not yet installed) dies of it: the search says it stopped, naming that run too.
    ref = reference_candidate(2)
    pool = _pool(tmp_path, workers=2, received=[])

    def run_in_process(cfg, run_dir):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if run_dir.endswith("seed0"):
            pool.stop.received.append("SIGTERM")
            return {**pool_module.run_summary({}), "status": "interrupted"}
        return _lost("killed by SIGTERM")

    assert _search_stop(monkeypatch, pool, [(ref, 0), (ref, 1)], run_in_process) == (
        f"stopped by SIGTERM (1 run(s) checkpointed; 1 ended without a result: "
        f"{pool.run_dir(ref, 1)}: killed by SIGTERM); the same command continues the search "
        f"in {tmp_path}"
    )


def test_a_worker_that_exits_without_a_result_gets_no_out_of_memory_hint(tmp_path, monkeypatch):
    ref = reference_candidate(2)
    pool = _pool(tmp_path, workers=2)

    def run_in_process(cfg, run_dir):
        return _lost("exited with status 1")

    assert _search_stop(monkeypatch, pool, [(ref, 0), (ref, 1)], run_in_process) == (
        f"the worker process of 2 run(s) ended without a result ({pool.run_dir(ref, 0)}: exited "
        f"with status 1; {pool.run_dir(ref, 1)}: exited with status 1); the finished runs are "
        f"kept, and the same command continues the search in {tmp_path}"
    )
    assert pool.results == {} and pool.trained == 0
