"""PrecisionPolicy and PrecisionStepper at their edges: every dtype spelling, the combinations
that cannot train, a full config under a misspelled name, GradScaler's own defaults, the
non-finite check's corner cases, and steps decided by a fused optimizer."""

import inspect
import math

import pytest
import torch

from mptex.mlp import PrecisionMLP
from mptex.precision import (
    LOSS_SCALING_MODES,
    PrecisionPolicy,
    PrecisionStepper,
    all_finite,
    dtype_name,
    grid_gradient_factor,
    parse_dtype,
)


@pytest.mark.parametrize(
    "spelling, dtype",
    [
        ("f32", torch.float32), ("FP32", torch.float32), ("Float32", torch.float32),
        ("float", torch.float32), ("f16", torch.float16), ("fp16", torch.float16),
        ("FP16", torch.float16), ("float16", torch.float16), ("Half", torch.float16),
        ("bf16", torch.bfloat16), ("BF16", torch.bfloat16), ("bfloat16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
    ],
)  # fmt: skip
def test_every_dtype_spelling_parses_whatever_its_case(spelling, dtype):
    assert parse_dtype(spelling) is dtype
    assert PrecisionPolicy(encoder_dtype=spelling).encoder_dtype is dtype


def test_dtype_names_are_the_short_config_names():
    assert [dtype_name(d) for d in (torch.float32, torch.float16, torch.bfloat16)] == [
        "f32", "f16", "bf16",
    ]  # fmt: skip
    config = PrecisionPolicy.named("per_layer").to_config()
    assert config["encoder_dtype"] == "f16" and config["mlp_dtypes"] == ["f16", "f16", "f32"]
    assert PrecisionPolicy.named("bf16_grid").to_config()["mlp_dtypes"] == ["bf16"]


@pytest.mark.parametrize("mode", LOSS_SCALING_MODES)
def test_only_nvdiffrecs_hooks_leave_a_factor_on_the_grid_gradient(mode):
    # nvdiffrec's x128 hook is never divided back on the table's gradient; every other scheme
    # unscales before the optimizer reads it.
    assert grid_gradient_factor(mode, 256.0) == (256.0 if mode == "nvdiffrec" else 1.0)


@pytest.mark.parametrize(
    "cfg, field",
    [
        # f16 parameters are a single dtype: a per-layer list has no parameter dtype.
        ({"master_weights": False, "mlp_dtypes": ["f16", "f16"]}, "master_weights"),
        # GradScaler refuses f16 gradients under a static scale as under a dynamic one.
        ({"master_weights": False, "mlp_dtypes": "f16", "loss_scaling": "static"},
         "master_weights"),
        ({"master_weights": False, "mlp_dtypes": "f16", "autocast": True}, "master_weights"),
        # tcnn's fused network computes in f16 on f32 masters, never under autocast.
        ({"name": "tcnn_fused", "master_weights": False}, "mlp_dtypes"),
        ({"name": "tcnn_fused", "autocast": True}, "mlp_dtypes"),
        # float accumulators exist in the torch twin only, as split-K's switch does.
        ({"name": "tcnn_fused", "mlp_backend": "tcnn", "fused_accumulate": "float"},
         "mlp_backend"),
        # Quantised MLPs are linear layers on f32 masters without autocast.
        ({"name": "tcnn_fused", "weight_quant": "int8"}, "weight_quant"),
        ({"name": "int8_qat", "autocast": True}, "weight_quant"),
        ({"name": "fp8", "master_weights": False}, "fp8_gemm"),
        # Every value between FP8 GEMMs is f32, not just one of them.
        ({"name": "fp8", "mlp_dtypes": ["f32", "f16", "f32"]}, "mlp_dtypes"),
    ],
)  # fmt: skip
def test_combinations_that_cannot_train_name_their_field_first(cfg, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        PrecisionPolicy.from_config(cfg)


@pytest.mark.parametrize("name", [["a", "b"], {"arm": "f32"}, 5])
def test_a_name_that_is_not_a_string_is_refused_naming_the_field(name):
    with pytest.raises(ValueError) as info:
        PrecisionPolicy.from_config({"name": name})
    assert str(info.value) == (
        f"name: expected a non-empty string (the arm's name in reports), got {name!r}"
    )


@pytest.mark.parametrize("field", ["static_loss_scale", "init_scale", "fused_loss_scale"])
def test_a_loss_scale_is_a_positive_float32_number(field):
    largest = float(torch.finfo(torch.float32).max)  # 3.40282e+38
    policy = PrecisionPolicy.from_config({"name": "f16_static", field: largest})
    assert getattr(policy, field) == largest
    for value in (1e39, 0.0, -1.0):
        with pytest.raises(ValueError) as info:
            PrecisionPolicy.from_config({"name": "f16_static", field: value})
        assert str(info.value) == (
            f"{field}: expected a number in (0, 3.40282e+38] (a float32 factor), got {value!r}"
        )


def test_the_fused_network_takes_an_outer_static_scale():
    policy = PrecisionPolicy.from_config({"name": "tcnn_fused", "loss_scaling": "static"})
    assert policy.loss_scaling == "static" and policy.mlp == "fused"


def test_a_full_config_under_a_misspelled_name_is_a_policy_of_its_own():
    # Every field is given, so none would silently be f32's: the name is only a label.
    full = {**PrecisionPolicy.named("f16_dynamic").to_config(), "name": "f16_dyanmic"}
    policy = PrecisionPolicy.from_config(full)
    assert policy.name == "f16_dyanmic" and policy.loss_scaling == "dynamic"


def test_layer_dtypes_broadcast_one_dtype_and_check_a_list_against_the_layers():
    assert PrecisionPolicy.named("f16_dynamic").layer_dtypes(3) == [torch.float16] * 3
    per_layer = PrecisionPolicy.named("per_layer")
    assert per_layer.layer_dtypes(3) == [torch.float16, torch.float16, torch.float32]
    with pytest.raises(ValueError, match=r"^mlp_dtypes: policy 'per_layer' lists 3 dtypes"):
        per_layer.layer_dtypes(4)


def test_dynamic_scaling_defaults_are_grad_scalers_own():
    # The policy documents GradScaler's defaults; read them from its signature.
    defaults = inspect.signature(torch.amp.GradScaler.__init__).parameters
    policy = PrecisionPolicy()
    for name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
        assert getattr(policy, name) == defaults[name].default, name
    assert policy.static_loss_scale == 128.0  # tcnn's constant


def test_all_finite_ignores_missing_and_empty_tensors():
    assert all_finite([]) and all_finite([None]) and all_finite([None, torch.empty(0)])
    assert all_finite([torch.empty(0, 3), torch.ones(2)])


def test_all_finite_is_false_when_any_one_tensor_holds_an_inf_or_nan():
    for bad in (math.inf, -math.inf, math.nan):
        tensors = [torch.ones(3), torch.tensor([1.0, bad]), torch.zeros(2, dtype=torch.float16)]
        assert not all_finite(tensors), bad
    # The largest finite values do not overflow the check (an inf-norm, not a 2-norm).
    big = [torch.full((1000,), 65504.0, dtype=torch.float16), torch.full((4,), 3.0e38)]
    assert all_finite(big)


def _mlp_and_adam(arm, fused):
    torch.manual_seed(0)
    policy = PrecisionPolicy.named(arm)
    mlp = PrecisionMLP(8, 3, 2, 16, policy)
    return mlp, torch.optim.Adam(mlp.parameters(), lr=1e-2, fused=fused)


def _loss(mlp, seed=0):
    x = torch.rand(64, 8, generator=torch.Generator().manual_seed(seed))
    return mlp(x.to(mlp.policy.encoder_dtype)).float().square().mean()


def test_an_unscaled_arm_reports_a_unit_loss_scale():
    _, optimizer = _mlp_and_adam("f32", fused=False)
    stepper = PrecisionStepper("f32", optimizer)
    assert stepper.loss_scale == 1.0 and stepper.state_dict() == {}


def test_a_scaled_stepper_ignores_an_empty_state():
    # An unscaled arm's state_dict is {}: loading it leaves the scale as it was.
    _, optimizer = _mlp_and_adam("f16_dynamic", fused=False)
    stepper = PrecisionStepper("f16_dynamic", optimizer)
    stepper.load_state_dict({})
    assert stepper.loss_scale == 2.0**16


def test_a_master_weight_arm_does_not_check_its_parameters_after_the_step(monkeypatch):
    # Only f16 parameters (master_weights false) can be turned non-finite by Adam's own
    # arithmetic; f32 masters are not read back after a step.
    import mptex.precision as precision

    def unexpected(tensors):
        raise AssertionError("parameters checked after the step")

    monkeypatch.setattr(precision, "all_finite", unexpected)
    mlp, optimizer = _mlp_and_adam("f32", fused=False)
    assert not PrecisionStepper("f32", optimizer)(_loss(mlp)).skipped


@pytest.mark.parametrize("arm", ["f16_dynamic", "f16_static", "f32"])
def test_a_fused_optimizer_steps_once_per_clean_step_and_never_on_an_inf(arm):
    # A fused Adam takes found_inf itself: the step happens on the device, once; the host must
    # not step it again. Adam's step counter says how many steps were taken.
    mlp, optimizer = _mlp_and_adam(arm, fused=True)
    stepper = PrecisionStepper(arm, optimizer)
    assert not stepper(_loss(mlp)).skipped
    params = list(mlp.parameters())
    assert all(float(optimizer.state[p]["step"]) == 1.0 for p in params)
    before = [p.detach().clone() for p in params]
    optimizer.zero_grad()
    stepper.backward(_loss(mlp, seed=1))
    mlp.layers[1].weight.grad[0, 0] = float("inf")
    assert stepper.step().skipped
    assert all(float(optimizer.state[p]["step"]) == 1.0 for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_that_makes_adams_half_second_moment_inf_diverges(fused):
    # Adam in f16 (f16_naive, master weights off) squares the gradient into exp_avg_sq: a
    # finite gradient of 1e4 gives 0.001 * 1e8 = 1e5 > 65504, an inf second moment, and the
    # weight's update m / inf = 0 leaves it finite and frozen for the rest of the run. The
    # check after the step must see that state, host-decided (fused=False) or on the device.
    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer = torch.optim.Adam([weight], lr=1e-2, fused=fused)
    stepper = PrecisionStepper("f16_naive", optimizer)
    weight.grad = torch.tensor([1.0, 1.0, 1.0, 1e4], dtype=torch.float16)
    result = stepper.step()
    assert torch.isfinite(weight).all()  # the weights alone would pass
    assert torch.isinf(optimizer.state[weight]["exp_avg_sq"][3])
    assert result.diverged and not result.skipped
    # The same step with a gradient of 1.0 everywhere: a finite state, no divergence.
    fresh = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    fresh.grad = torch.ones(4, dtype=torch.float16)
    clean = PrecisionStepper("f16_naive", torch.optim.Adam([fresh], lr=1e-2, fused=fused))
    assert not clean.step().diverged


@pytest.mark.parametrize("arm", ["f32", "nvdiffrec", "bf16"])
def test_the_finite_check_of_an_unscaled_arm_leaves_the_gradients_bits(arm):
    # The check runs GradScaler's unscale kernel at the factor 1: the gradients keep their
    # bits, and the optimizer steps with them. Plain SGD makes the step exact to check: with
    # lr 0.5 (a power of two) p - lr * g is the product and one rounding, as torch computes it.
    torch.manual_seed(0)
    mlp = PrecisionMLP(8, 3, 2, 16, PrecisionPolicy.named(arm))
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.5)
    stepper = PrecisionStepper(arm, optimizer)
    loss = _loss(mlp)
    stepper.backward(loss)
    params = list(mlp.parameters())
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    assert not stepper.step(loss).skipped
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    expected = [b - 0.5 * g for b, g in zip(before, grads, strict=True)]
    assert all(torch.equal(p, e) for p, e in zip(params, expected, strict=True))
