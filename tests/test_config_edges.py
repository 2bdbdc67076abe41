"""Config values at start, against messages and normal forms written out by hand.

Every refused value is one line naming the key, what was expected and the value given; the
bounds are the documented ones, each side of them (nothing clamped); lists given as text, with
duplicates or empty parts, take their documented normal form; the checks that relate groups (the
channels shading needs, a supersampled validation of image references, the views' memory) and
the paths a run records.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_train import tiny_cfg

from mptex.config_schema import (
    REQUIRED,
    ConfigError,
    Integer,
    ListOf,
    Number,
    OneOf,
    Table,
    check_fields,
    check_group,
    check_seed,
    plain,
)
from mptex.export_config import check_export_config
from mptex.train import validate_config
from mptex.train.config import (
    TrainConfig,
    absolute_scene_paths,
    config_key,
    normalized_config,
)


def _refused(check, value, key="group.key") -> str:
    with pytest.raises(ConfigError) as info:
        check(value, key)
    return str(info.value)


# ----------------------------------------------------------------------------- kinds of value
def test_one_sided_and_float_bounds_are_written_as_the_check_applies_them():
    assert Integer(max=5).what == "an integer <= 5"
    assert Integer(max=5, max_open=True).what == "an integer < 5"
    assert Number(min=0.5, max_open=True, max=100.0).what == "a number in [0.5, 100)"
    assert Number(max=2.5, max_open=True).what == "a finite number < 2.5"
    Integer(max=5)(5, "k")
    assert _refused(Integer(max=5, max_open=True), 5) == (
        "group.key: expected an integer < 5, got 5"
    )


def test_a_numpy_integer_becomes_a_python_int_and_a_table_a_new_dict():
    value = Integer(min=0)(np.int64(7), "k")
    assert value == 7 and type(value) is int
    given = {"max_iterations": 4}
    table = Table()(given, "k")
    assert table == given and table is not given


@pytest.mark.parametrize(
    "text, expected",
    [("obj", ["obj"]), ("glb,obj", ["glb", "obj"]), ("obj,,glb,", ["obj", "glb"]),
     (" glb , obj , glb ", ["glb", "obj"]), (["obj", "glb", "obj"], ["obj", "glb"])],
)  # fmt: skip
def test_a_list_as_text_drops_empty_parts_and_keeps_each_first_occurrence(text, expected):
    check = ListOf(OneOf(["obj", "glb"]), unique=True, comma_text=True)
    assert check(text, "k") == expected


def test_a_list_without_unique_keeps_its_duplicates():
    assert ListOf(Integer())([3, 1, 3], "k") == [3, 1, 3]


@dataclasses.dataclass
class _Required:
    name: str = REQUIRED
    count: int = 1


def test_a_required_value_given_as_null_is_not_set():
    for values in ({"name": None}, {"name": REQUIRED}, {}):
        with pytest.raises(ConfigError) as info:
            check_group(_Required, values, "g", context=" for scene 'x'")
        assert str(info.value) == "g.name: required for scene 'x', not set"


def test_a_resolvers_value_error_is_one_line_and_other_interpolation_errors_are_omegaconfs():
    from omegaconf.errors import InterpolationKeyError

    def no_asset(name):
        raise ValueError(f"no asset {name!r} (pip install pybullet)")

    OmegaConf.register_new_resolver("test_config_edges_asset", no_asset, replace=True)
    cfg = OmegaConf.create({"scene": {"path": "${test_config_edges_asset:duck}"}})
    with pytest.raises(ConfigError) as info:
        plain(cfg)
    assert str(info.value) == "scene.path: no asset 'duck' (pip install pybullet)"
    with pytest.raises(InterpolationKeyError):
        plain(OmegaConf.create({"scene": {"path": "${nowhere}"}}))


def test_fields_of_an_instance_are_each_checked_with_their_key():
    with pytest.raises(ConfigError) as info:
        check_fields(_Required(name="x", count=1.5), prefix="policy.")
    assert str(info.value) == "policy.count: expected an integer, got 1.5"


def test_a_generators_seed_takes_the_full_unsigned_64_bit_range():
    assert check_seed("seed", 2**64 - 1) == 2**64 - 1
    assert check_seed("seed", np.uint64(2**63)) == 2**63
    assert check_seed("seed", None, allow_none=True) is None
    with pytest.raises(ValueError) as info:
        check_seed("seed", 2**64)
    assert str(info.value) == "seed: expected an integer in [0, 2**64), got 18446744073709551616"
    with pytest.raises(ValueError) as info:
        check_seed("seed", None)
    assert str(info.value) == "seed: expected an integer in [0, 2**64), got None"


# ----------------------------------------------------------------------------- train
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("lr", 0, "a finite number > 0"),
        ("mlp_lr_scale", 0.0, "a finite number > 0 (the MLP's learning rate over the grid's)"),
        ("betas", [0.9, 1.0], "two numbers in [0, 1)"),
        ("betas", [-0.1, 0.9], "two numbers in [0, 1)"),
        ("batch_size", 0, "an integer >= 1"),
        ("warmup_iter", -1, "an integer >= 0"),
        ("kd_smooth_ramp", -1, "a finite number >= 0"),
        ("kd_jitter_std", -0.01, "a finite number >= 0"),
        ("ambient", 1.5, "a number in [0, 1]"),
        ("ambient", -0.25, "a number in [0, 1]"),
        ("light_dir", [0, 0, 0], "a non-zero [x, y, z] of numbers"),
        ("light_dir", [0.0, -0.0, 0], "a non-zero [x, y, z] of numbers"),
        ("val_background", "random", "one of ['white', 'black']"),
        ("threads", 0, "null (torch's default) or an integer >= 1"),
        ("max_consecutive_skips", 0, "an integer >= 1"),
        ("val_spp", 17, "an integer in [1, 16] (validation samples per pixel along each axis)"),
        ("checkpoint_interval", -1, "an integer >= 0 (0: only at the end)"),
        ("stop_signals", ["SIGTERM", "SIGKILL"], "a list of signal names from ['SIGTERM', "
         "'SIGINT', 'SIGUSR1', 'SIGUSR2', 'SIGHUP', 'SIGQUIT', 'SIGXCPU']"),
    ],
)  # fmt: skip
def test_a_bad_train_value_is_one_line_naming_the_key_and_the_expectation(key, value, message):
    with pytest.raises(ConfigError) as info:
        check_group(TrainConfig, {key: value}, "train")
    assert str(info.value) == f"train.{key}: expected {message}, got {value!r}"


def _refused_step(given, key, step, beside=""):
    """The one line refusing ``given`` (a train group), naming ``key``, whose largest Adam
    step is ``step``."""
    with pytest.raises(ConfigError) as info:
        check_group(TrainConfig, given, "train")
    assert str(info.value) == (
        f"train.{key}: expected {beside}a rate whose largest Adam step, lr * max(1, "
        f"mlp_lr_scale, mlp_lr_ramp_to) / (1 - betas[0]) = {step}, is a float32 number "
        f"(<= 3.40282e+38), got {given[key]!r}"
    )


@pytest.mark.parametrize(
    "given, step, beside",
    [
        # lr / (1 - 0.9) = 10 lr (betas [0.9, 0.999] by default)
        ({"lr": 1e38}, "1e+39", ""),
        ({"lr": 1e37, "mlp_lr_scale": 10}, "1e+39", "with train.mlp_lr_scale=10, "),
        (
            {"lr": 1e30, "mlp_lr_scale": 0.5, "mlp_lr_ramp_to": 1e9},
            "1e+40",
            "with train.mlp_lr_ramp_to=1000000000.0, ",
        ),
        ({"lr": 1e35, "betas": [0.9999, 0.999]}, "1e+39", ""),
    ],
)
def test_a_rate_whose_adam_step_is_beyond_float32_is_refused(given, step, beside):
    _refused_step(given, "lr", step, beside)


@pytest.mark.parametrize(
    "given, key, step",
    [
        # The learning rate left at its default 0.01: the MLP's factor set is what is named,
        # since lr x factor is what overflows (0.01 x 1e300 / (1 - 0.9) = 1e299).
        ({"mlp_lr_scale": 1e300}, "mlp_lr_scale", "1e+299"),
        ({"mlp_lr_ramp_to": 1e300}, "mlp_lr_ramp_to", "1e+299"),
        ({"mlp_lr_scale": 2.0, "mlp_lr_ramp_to": 1e300}, "mlp_lr_ramp_to", "1e+299"),
    ],
)
def test_an_mlp_rate_factor_beyond_float32_names_its_own_key(given, key, step):
    _refused_step(given, key, step)
    # The product is what is checked: a large factor with a rate small enough is taken.
    check_group(TrainConfig, {**given, "lr": 1e-270}, "train")


def test_an_adam_epsilon_beyond_float32_is_refused():
    # Adam adds epsilon to float32 tensors: 1e300 became inf there, every step m / inf = 0,
    # and the run trained nothing without a word. The largest float32 is still taken.
    with pytest.raises(ConfigError) as info:
        check_group(TrainConfig, {"adam_eps": 1e300}, "train")
    assert str(info.value) == (
        "train.adam_eps: expected a number in (0, 3.40282e+38] (a float32 number), got 1e+300"
    )
    largest = 3.4028234663852886e38  # float32's largest finite number
    assert check_group(TrainConfig, {"adam_eps": largest}, "train")["adam_eps"] == largest


def test_a_rate_whose_adam_step_is_within_float32_is_taken():
    # 3.3e37 / (1 - 0.9) = 3.3e38 < 3.40282e38; with betas[0] = 0: the rate itself
    assert check_group(TrainConfig, {"lr": 3.3e37}, "train")["lr"] == 3.3e37
    assert check_group(TrainConfig, {"lr": 3.4e38, "betas": [0, 0.9]}, "train")["lr"] == 3.4e38


@pytest.mark.parametrize("key", ["inject_signal_at", "inject_nonfinite_at"])
@pytest.mark.parametrize(
    "iterations, at, reached",
    [(200, 200, "0 to 199"), (200, 500, "0 to 199"), (1, 1, "0 to 0")],
)
def test_a_test_hook_beyond_the_last_iteration_is_refused_at_start(key, iterations, at, reached):
    # The loop runs iterations 0 .. iterations - 1: a hook at iterations or later never fires.
    with pytest.raises(ConfigError) as info:
        check_group(TrainConfig, {"iterations": iterations, key: at}, "train")
    assert str(info.value) == (
        f"train.{key}: expected null or an iteration the run reaches ({reached}: "
        f"train.iterations={iterations}; the run would never reach {at}), got {at}"
    )


@pytest.mark.parametrize("key", ["inject_signal_at", "inject_nonfinite_at"])
def test_a_test_hook_at_the_last_iteration_or_unset_is_taken(key):
    assert check_group(TrainConfig, {"iterations": 200, key: 199}, "train")[key] == 199
    assert check_group(TrainConfig, {"iterations": 1, key: None}, "train")[key] is None


@pytest.mark.parametrize(
    "key, value",
    [("light_dir", [0, 1, 0]), ("light_dir", [0.0, 0.0, -2.0]), ("betas", [0.0, 0.0]),
     ("ambient", 0), ("ambient", 1), ("val_spp", 16), ("val_spp", 1), ("threads", 1),
     ("max_consecutive_skips", 1), ("batch_size", 1), ("kd_smooth_ramp", 0),
     ("warmup_iter", 0), ("val_background", "black"), ("iterations", 1)],
)  # fmt: skip
def test_a_train_value_at_its_bound_is_taken_unchanged(key, value):
    assert check_group(TrainConfig, {key: value}, "train")[key] == value


def test_repeated_stop_signals_are_installed_once_in_their_first_order():
    checked = check_group(TrainConfig, {"stop_signals": ["SIGUSR1", "SIGTERM", "SIGUSR1"]},
                          "train")  # fmt: skip
    assert checked["stop_signals"] == ["SIGUSR1", "SIGTERM"]


# ----------------------------------------------------------------------------- export
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("resolution", 1, "an integer >= 2"),
        ("formats", [], "a non-empty list of values, each one of ['obj', 'glb']"),
        ("formats", "", "a non-empty list of values, each one of ['obj', 'glb']"),
        ("chunk_size", 0, "an integer >= 1"),
        ("unwrap", "never", "one of ['auto', 'always']"),
        ("padding", -1, "an integer >= 0"),
        ("neural_precision", "f64", "null (no neural export) or one of ['f32', 'f16', 'bf16', "
         "'fp8', 'fp8_rowwise', 'int8']"),
    ],
)  # fmt: skip
def test_a_bad_export_value_is_one_line_naming_the_key_and_the_expectation(key, value, message):
    with pytest.raises(ConfigError) as info:
        check_export_config({key: value})
    assert str(info.value) == f"export.{key}: expected {message}, got {value!r}"


def test_export_lists_take_text_and_drop_repeats():
    checked = check_export_config({"formats": "glb,glb", "decode_precisions": "int8, f16,int8",
                                   "resolution": 2, "padding": 0})  # fmt: skip
    assert checked["formats"] == ["glb"] and checked["decode_precisions"] == ["int8", "f16"]
    assert check_export_config({"decode_precisions": []})["decode_precisions"] == []


# ----------------------------------------------------------------------------- the whole config
def _start_message(*overrides: str, cfg=None) -> str:
    with pytest.raises(ValueError) as info:
        validate_config(tiny_cfg(*overrides) if cfg is None else cfg)
    return str(info.value)


def test_diffuse_shading_needs_nine_channels_and_three_is_the_least():
    assert _start_message("train.shading=diffuse", "texture.channels=8") == (
        "train.shading: 'diffuse' needs texture.channels=9 (kd, ks, normal)"
    )
    assert _start_message("texture.channels=2") == (
        "texture.channels: expected an integer >= 3, got 2"
    )
    full = validate_config(tiny_cfg("train.shading=diffuse", "texture.channels=9"))
    assert full["train"]["shading"] == "diffuse"


def test_a_supersampled_validation_of_image_references_is_refused_from_two():
    scene = {"name": "nerf", "path": "data/lego", "mesh": "data/lego.obj"}
    cfg = {**OmegaConf.to_container(tiny_cfg()), "scene": scene}
    for spp in (2, 3):
        cfg["train"] = {**cfg["train"], "val_spp": spp}
        assert _start_message(cfg=cfg) == (
            "train.val_spp: scene=nerf's validation references are images at their own "
            f"resolution (no sub-pixel samples to render); expected 1, got {spp}"
        )


def test_views_that_exactly_fill_the_free_memory_fit(monkeypatch):
    from mptex.train import config as train_config

    # tiny_cfg: 4 training and 2 validation views of 32 x 32 pixels, 57 bytes each
    needed = 32 * 32 * (4 + 2) * 57
    # and an iteration of train.batch_size=1 view of them, 56 bytes per pixel
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed + 32 * 32 * 56)
    validate_config(tiny_cfg())
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed - 1)
    assert _start_message().startswith("scene.resolution: 4 training and 2 validation views of "
                                       "32 x 32 pixels need 0.0 GiB")  # fmt: skip


def test_an_iteration_that_exactly_fills_the_free_memory_fits(monkeypatch):
    from mptex.train import config as train_config

    # tiny_cfg's views (32 x 32 pixels, 4 + 2 views, 57 bytes each) and an iteration of
    # train.batch_size=8 views of 32 x 32 pixels (56 bytes each: reference, coverage,
    # background, the composite's product, the prediction)
    needed = 32 * 32 * (4 + 2) * 57 + 8 * 32 * 32 * 56
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed)
    validate_config(tiny_cfg("train.batch_size=8"))
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed - 1)
    assert _start_message("train.batch_size=8") == (
        "train.batch_size: an iteration of 8 views of 32 x 32 pixels needs 0.000427 GiB for its "
        "images alone (0.000753 GiB with the views' buffers), only 0.0 GiB is free on cpu "
        "(lower train.batch_size or scene.resolution)"
    )


@pytest.mark.parametrize(
    "tubular, radial, n_train_views, measured",
    [
        # Peak RSS over the process's start, building the builtin scene at 24 x 24 pixels
        # with one validation view, preparing its training views and rendering the
        # validation view (torch rasterizer, one CPU thread, torch 2.13), in bytes.
        (1000, 8, 16, 55_144_448),
        (4000, 8, 16, 65_978_368),
        (16000, 8, 16, 120_369_152),
        (16000, 8, 4, 88_956_928),
        (16000, 8, 1, 88_326_144),
    ],
)
def test_the_knot_memory_estimate_stays_below_measured_peaks(
    tubular, radial, n_train_views, measured
):
    # A lower bound: a knot that fits is never refused (the estimate counts what the
    # rasterizer holds at once, not its clipping, binning or samples). The torch rasterizer
    # sets up one block of triangle instances at a time: 16 views of the 256,000-triangle
    # knot peaked at 3.2 GB when it set them all up at once.
    from mptex.scenes.config import check_scene_config
    from mptex.train.config import _builtin_mesh_bytes

    scene = {"name": "builtin", "tubular_segments": tubular, "radial_segments": radial,
             "resolution": 24, "n_train_views": n_train_views, "n_val_views": 1,
             "raster_backend": "torch"}  # fmt: skip
    estimate = _builtin_mesh_bytes(check_scene_config(scene), torch.device("cpu"))
    assert measured / 10 < estimate < measured


def test_mlp_activations_that_exactly_fill_the_free_memory_fit(monkeypatch):
    from mptex.precision import PrecisionPolicy
    from mptex.train import config as train_config
    from mptex.train.config import _MODULE_BYTES, TRAIN_DEFAULTS, mlp_activation_problem

    texture = {"internal_dims": 32, "hidden": 2, "channels": 3}  # nvdiffrec's encoder: 32 in
    settings = {**TRAIN_DEFAULTS, "batch_size": 1000}
    # (32 + 1) * 32 + (32 + 1) * 32 + (32 + 1) * 3 = 2211 parameters x 16 bytes, and
    # 2 layers x 32 x (1000 views x 100 pixels x 2) points x 4 bytes (f32), and 5 modules
    # (3 linear layers, 2 activations) of an empty torch module's Python objects at least
    needed = 2211 * 16 + 2 * 32 * 200_000 * 4 + 5 * _MODULE_BYTES
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed)
    policy = PrecisionPolicy.from_config("f32")
    assert mlp_activation_problem(texture, policy, settings, 100, torch.device("cpu")) is None
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed - 1)
    message = mlp_activation_problem(texture, policy, settings, 100, torch.device("cpu"))
    assert message.startswith("train.batch_size: an MLP of 3 layers 32 wide keeps 0.0477 GiB")
    # Half the bytes per value in bf16: fits again; no smoothness term: half the points.
    assert mlp_activation_problem(texture, PrecisionPolicy.from_config("bf16"), settings, 100,
                                  torch.device("cpu")) is None  # fmt: skip
    plain = {**settings, "kd_smooth": False}
    assert mlp_activation_problem(texture, policy, plain, 100, torch.device("cpu")) is None
    # On a GPU the modules' Python objects live in the host's memory: not counted against the
    # device's free memory, nor named in the line.
    on_gpu = needed - 5 * _MODULE_BYTES
    monkeypatch.setattr(train_config, "available_bytes", lambda device: on_gpu)
    assert mlp_activation_problem(texture, policy, settings, 100, torch.device("cuda")) is None
    monkeypatch.setattr(train_config, "available_bytes", lambda device: on_gpu - 1)
    message = mlp_activation_problem(texture, policy, settings, 100, torch.device("cuda"))
    assert "GiB with its training state, only " in message and "modules" not in message


def test_missing_groups_and_keys_that_are_not_text_are_refused():
    full = OmegaConf.to_container(tiny_cfg())
    for group in ("scene", "precision", "texture"):
        cfg = {k: v for k, v in full.items() if k != group}
        assert _start_message(cfg=cfg) == f"{group}: missing config group"
    cfg = {**full, "texture": {**full["texture"], 7: "x"}}
    assert _start_message(cfg=cfg) == "texture.7: expected a string key"


def test_hidden_layers_the_arm_has_no_dtypes_for_name_the_relation():
    message = _start_message("precision=per_layer", "precision.mlp_dtypes=[f16,f32,f32]",
                             "texture.hidden=3")  # fmt: skip
    assert message.startswith("precision.mlp_dtypes: ")
    assert message.endswith(" (texture.hidden + 1)")


def test_the_device_auto_is_recorded_as_this_machines_device():
    from mptex._backends import auto_device

    assert validate_config(tiny_cfg("train.device=auto"))["train"]["device"] == auto_device()
    # a bad value is recorded as given, the other keys with their defaults
    recorded = normalized_config({"train": {"device": "auto", "lr": 0}})["train"]
    assert recorded["device"] == auto_device() and recorded["lr"] == 0
    assert recorded["iterations"] == 200 and recorded["betas"] == [0.9, 0.999]


def test_scene_paths_are_recorded_absolute_with_the_home_folder_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    scene = absolute_scene_paths({"name": "nerf", "path": "~/lego", "mesh": "lego.obj",
                                  "near": 0.1, "empty": ""})  # fmt: skip
    assert scene == {"name": "nerf", "path": os.path.join(str(tmp_path), "home", "lego"),
                     "mesh": os.path.join(str(tmp_path), "lego.obj"), "near": 0.1,
                     "empty": ""}  # fmt: skip
    assert absolute_scene_paths({"path": ""}) == {"path": ""}


def test_a_constructors_must_message_is_renamed_to_the_config_key():
    assert config_key("n_levels must be an integer >= 1, got 0") == (
        "texture.encoder.n_levels: must be an integer >= 1, got 0"
    )
    assert config_key("config.n_levels: expected an integer") == (
        "texture.encoder.n_levels: expected an integer"
    )
    assert config_key("unknown_arg: x") == "unknown_arg: x"
