"""Hydra's compose API builds every config in configs/ (every option of every group)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from mptex.cli import CONFIG_DIR
from mptex.precision import PrecisionPolicy
from mptex.scenes import SUITE
from mptex.train import TRAIN_DEFAULTS, validate_config

GROUPS = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())
# The real-asset suite's scenes read their meshes from pybullet_data (the assets extra).
OPTIONS = [
    pytest.param(g, f.stem, marks=[pytest.mark.requires_assets] if g == "scene" and f.stem in SUITE
                 else [])
    for g in GROUPS
    for f in sorted((CONFIG_DIR / g).glob("*.yaml"))
]  # fmt: skip
# Options that need a value the user must give (mandatory `???` keys).
REQUIRED = {
    ("scene", "mesh"): ["scene.path=/tmp/x.obj"],
    ("scene", "nerf"): ["scene.path=/tmp/x", "scene.mesh=/tmp/x.obj"],
}


def test_groups_are_the_designed_ones():
    assert {"scene", "precision", "texture", "train"} <= set(GROUPS)


@pytest.mark.parametrize("group, option", OPTIONS)
def test_every_group_option_composes(group, option):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"{group}={option}", *REQUIRED.get((group, option), [])])
    assert {"scene", "precision", "texture", "train"} <= set(cfg)
    if group == "precision" and option in PrecisionPolicy.names():
        assert PrecisionPolicy.from_config(cfg.precision) == PrecisionPolicy.named(option)
    elif group == "precision":  # a precision search's result (mptex/search): a valid policy
        assert (
            (CONFIG_DIR / group / f"{option}.yaml")
            .read_text()
            .startswith("# Written by mptex's precision search")
        )
        PrecisionPolicy.from_config(cfg.precision)
    if group == "train":
        assert set(cfg.train) == set(TRAIN_DEFAULTS)
    validate_config(cfg)  # every shipped value is valid here (tcnn_fused runs on the twin)


def test_default_config_matches_the_train_defaults_table():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config")
    assert dict(cfg.train) == {**TRAIN_DEFAULTS, "betas": list(TRAIN_DEFAULTS["betas"])}
    assert (cfg.scene.name, cfg.precision.name) == ("builtin", "f32")


@pytest.mark.parametrize("experiment", ["quick", "precision_ablation", "nvdiffrec154"])
def test_every_experiment_composes_with_a_sweep_over_arms(experiment):
    from mptex.cli import EXPERIMENTS_DIR, register_experiments

    assert experiment in register_experiments()
    assert (EXPERIMENTS_DIR / f"{experiment}.yaml").is_file()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}"],
                      return_hydra_config=True)  # fmt: skip
    arms = str(cfg.hydra.sweeper.params.precision).split(",")
    assert set(arms) <= set(PrecisionPolicy.names()) and "tcnn_fused" in arms


def test_real_assets_sweeps_the_suite_with_the_protocol():
    # The protocol of docs/benchmarks.md, "Real assets", on every scene of the sweep: one
    # setting for all (no per-scene tuning), trained on a pool of 256 views and validated on the
    # 64-view orbit, each pixel supersampled 4 x 4.
    from mptex.cli import register_experiments

    assert "real_assets" in register_experiments()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        sweep = compose(config_name="config", overrides=["+experiment=real_assets"],
                        return_hydra_config=True)  # fmt: skip
        cfg = compose(config_name="config", overrides=["+experiment=real_assets", "scene=duck"])
    params = sweep.hydra.sweeper.params
    assert str(params.scene).split(",") == ["duck", "torus", "aliengo", "soccer"]
    assert set(str(params.precision).split(",")) <= set(PrecisionPolicy.names())
    assert len(str(params["train.seed"]).split(",")) >= 5
    assert (cfg.train.iterations, cfg.train.lr, cfg.train.lr_schedule) == (2400, 0.03, "cosine")
    assert (cfg.train.val_spp, cfg.train.val_interval) == (4, 800)
    assert (cfg.train.mlp_lr_scale, cfg.train.mlp_lr_ramp_to) == (0.1, 0.4)
    assert list(map(list, cfg.texture.min_max)) == [[-0.01] * 3, [1.01] * 3]
    assert (cfg.scene.name, cfg.scene.n_val_views, cfg.scene.n_train_views) == ("duck", 64, 256)
    # 2^17 hash entries per level and Adam's beta2 at 0.99 (docs/archive/hash-table-size.md,
    # docs/archive/adam-beta2.md): the rest of the
    # grid is texture=cpu's, unchanged.
    assert cfg.texture.encoder.log2_hashmap_size == 17 and list(cfg.train.betas) == [0.9, 0.99]
    assert (cfg.texture.encoder.n_levels, cfg.texture.encoder.base_resolution) == (12, 16)


@pytest.mark.requires_assets
@pytest.mark.parametrize("scene", ["duck", "torus", "aliengo", "soccer"])
def test_the_real_asset_sweeps_jobs_validate(scene):
    # Each scene of the sweep finds its mesh in pybullet_data and takes the protocol's values.
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=real_assets", f"scene={scene}"])
    validate_config(cfg)


@pytest.mark.parametrize("scene", ["builtin", "mesh"])
def test_one_scene_path_serves_a_sweep_over_builtin_and_mesh(scene):
    # `scene=builtin,mesh scene.path=spot.obj` (README): every scene of the sweep takes the key.
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"scene={scene}", "scene.path=/tmp/spot.obj"])
    assert cfg.scene.path == "/tmp/spot.obj"
    if scene == "builtin":
        from mptex.scenes.build import _validate

        assert _validate(cfg.scene)["name"] == "builtin"  # path accepted, unused
