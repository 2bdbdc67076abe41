"""The real-asset suite (mptex.scenes.assets): configs, paths, errors, and each asset as a scene."""

import pytest
from hydra import compose, initialize_config_dir

import mptex.scenes.assets as assets
from mptex.cli import CONFIG_DIR
from mptex.scenes import MESH_SCENES, SCENE_DEFAULTS, SUITE, build_scene, suite_path

SMALL = ["scene.resolution=24", "scene.n_train_views=2", "scene.n_val_views=2"]


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_suite_has_the_characters_the_issue_asks_for():
    characters = " ".join(a.character for a in SUITE.values())
    for character in ("saturated", "pattern", "photographic", "n-gon"):
        assert character in characters
    assert len(SUITE) >= 4 and set(SUITE) <= set(MESH_SCENES)


@pytest.mark.parametrize("name", sorted(SUITE))
def test_scene_yaml_keys_match_python_defaults(name):
    cfg = _compose([f"scene={name}"])
    assert set(cfg.scene.keys()) == set(SCENE_DEFAULTS[name]) and cfg.scene.name == name


@pytest.mark.requires_assets
@pytest.mark.parametrize("name", sorted(SUITE))
def test_each_asset_builds_a_textured_scene(name):
    cfg = _compose([f"scene={name}", *SMALL])
    assert cfg.scene.path == suite_path(name) and cfg.scene.path.endswith(SUITE[name].file)
    scene = build_scene(cfg.scene)
    assert scene.name == name
    views = scene.val_views()
    coverage = views.mask.float().mean().item()
    assert 0.05 < coverage < 0.95  # the object is in view and not cut by the frame
    rgb = views.rgba[..., :3][views.mask]
    assert rgb.std(dim=0).max() > 0.05  # a texture, not one colour


def test_missing_pybullet_data_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(assets, "suite_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"^real-asset suite: scene 'duck' .* pip install pybullet==3\.2\.7"
    ) as err:
        suite_path("duck")
    assert "\n" not in str(err.value)


def test_unknown_asset_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown asset 'teapot'; expected one of \['aliengo'"):
        suite_path("teapot")


def test_mptex_train_without_pybullet_data_fails_at_start_naming_the_key(tmp_path, monkeypatch):
    from mptex.train import ConfigError, train

    monkeypatch.setattr(assets, "suite_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        train(_compose(["scene=duck", "train.iterations=1"]), tmp_path)
    assert str(err.value).startswith("scene.path: real-asset suite: scene 'duck'")
    assert "\n" not in str(err.value) and not (tmp_path / "metrics.json").exists()


def test_same_suite_asset_compares_the_file_within_pybullet_data():
    here = "/opt/venv/lib/python3.12/site-packages/pybullet_data/torus/torus_textured.obj"
    there = "C:/Users/me/env/Lib/site-packages/pybullet_data/torus/torus_textured.obj"
    assert assets.same_suite_asset("torus", here, there)
    assert not assets.same_suite_asset("torus", here, "/data/other/torus/torus_textured.obj")
    assert not assets.same_suite_asset("duck", here, there)  # another asset's file
    assert not assets.same_suite_asset("mesh", here, here)  # not a suite asset
    assert not assets.same_suite_asset("torus", here, None)


@pytest.mark.requires_assets
def test_a_suite_asset_run_resumes_where_pybullet_data_lies_elsewhere(tmp_path):
    # A run's config stores the asset's path as its machine resolved it: a run preempted on one
    # machine resumes on another whose pybullet_data is elsewhere; another file is refused.
    import torch

    from mptex.train import ConfigError, train

    small = ["scene=duck", *SMALL, "train=tiny", "texture=tiny"]
    train(_compose([*small, "train.iterations=2"]), tmp_path)
    path = tmp_path / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=False)
    ckpt["config"]["scene"]["path"] = "/cluster/node7/venv/site-packages/pybullet_data/duck.obj"
    torch.save(ckpt, path)
    resumed = train(_compose([*small, "train.iterations=3", "train.resume=true"]), tmp_path)
    assert resumed["status"] == "completed" and resumed["iterations"] == 3
    assert resumed["resumed_from"] == 2
    ckpt = torch.load(path, weights_only=False)
    ckpt["config"]["scene"]["path"] = "/cluster/node7/data/duck.obj"
    ckpt["config"]["scene"]["resolution"] += 1
    torch.save(ckpt, path)
    with pytest.raises(ConfigError) as err:
        train(_compose([*small, "train.iterations=4", "train.resume=true"]), tmp_path)
    assert str(err.value) == (
        f"train.resume: checkpoint {path} was trained with another scene config (different: "
        "scene.path, scene.resolution)"
    )


def test_an_asset_scene_with_another_mesh_is_refused(tmp_path):
    # The run, the report and a search would name another mesh's results after the asset.
    from mptex.train import ConfigError, train

    other = tmp_path / "cube.obj"
    other.write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 3\n")
    with pytest.raises(ConfigError) as err:
        train(_compose(["scene=duck", f"scene.path={other}", "train.iterations=1"]),
              tmp_path / "run")  # fmt: skip
    assert str(err.value) == (
        f"scene.path: scene 'duck' is the real-asset suite's duck.obj in pybullet_data, got "
        f"'{other}'; another mesh is scene=mesh scene.path=<file>"
    )


@pytest.mark.requires_assets
def test_an_asset_scene_from_python_takes_the_suite_file():
    # {"name": "duck"} from Python, as configs/scene/duck.yaml resolves it for mptex-train
    scene = build_scene({"name": "duck", "resolution": 24, "n_train_views": 2, "n_val_views": 1})
    assert scene.name == "duck" and scene.mesh.v_pos.shape[0] > 0
