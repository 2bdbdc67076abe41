"""PrecisionPolicy (arms, configs, validation) and PrecisionStepper (skip, back-off, growth)."""

import copy
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mptex.mlp import PrecisionMLP
from mptex.precision import PrecisionPolicy, PrecisionStepper, StepResult, parse_dtype, scale_grad

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
ARMS = [
    "nvdiffrec", "f32", "f16_naive", "f16_static", "f16_dynamic", "amp", "bf16", "per_layer",
    "tcnn_fused", "tcnn_fused_swap154", "tcnn_fused_dynamic", "tcnn_fused_f32acc",
    "tcnn_fused_nosplitk", "tcnn_fused_scale1024", "nvdiffrec_scale1", "fp8", "fp8_current",
    "fp8_rowwise", "int8_qat", "fp8_qat", "fp8_rowwise_qat", "bf16_grid",
]  # fmt: skip


def test_every_arm_is_registered_and_has_a_config_file():
    assert PrecisionPolicy.names() == ARMS
    # configs/precision/ holds one file per arm, and the precision search's results (mptex/search:
    # written by it, marked by its header line, checked in tests/test_configs.py).
    header = "# Written by mptex's precision search"
    written = [p for p in (CONFIG_DIR / "precision").glob("*.yaml")
               if not p.read_text().startswith(header)]  # fmt: skip
    assert sorted(p.stem for p in written) == sorted(ARMS)


@pytest.mark.parametrize("arm", ARMS)
def test_config_file_equals_registered_arm(arm):
    cfg = OmegaConf.load(CONFIG_DIR / "precision" / f"{arm}.yaml")
    assert PrecisionPolicy.from_config(cfg) == PrecisionPolicy.named(arm)
    assert PrecisionPolicy.from_config(
        PrecisionPolicy.named(arm).to_config()
    ) == PrecisionPolicy.named(arm)


def test_hydra_compose_selects_an_arm_by_name():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(overrides=["+precision=f16_dynamic", "precision.growth_interval=7"])
    policy = PrecisionPolicy.from_config(cfg.precision)
    assert policy.name == "f16_dynamic" and policy.growth_interval == 7
    assert policy.mlp_dtypes == (torch.float16,) and policy.loss_scaling == "dynamic"


def test_partial_config_starts_from_the_named_arm():
    policy = PrecisionPolicy.from_config({"name": "per_layer", "mlp_dtypes": ["bf16", "f32"]})
    assert policy.loss_scaling == "dynamic" and policy.mlp_dtypes == (torch.bfloat16, torch.float32)
    assert PrecisionPolicy.from_config("amp") is PrecisionPolicy.named("amp")


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"mlp_dtypes": ["f16", "f8"]}, "mlp_dtypes"),
        ({"mlp_dtypes": []}, "mlp_dtypes"),
        ({"encoder_dtype": "int8"}, "encoder_dtype"),
        ({"loss_scaling": "sometimes"}, "loss_scaling"),
        ({"static_loss_scale": 0}, "static_loss_scale"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"mlp_backend": "jax"}, "mlp_backend"),
        (
            {"master_weights": False, "mlp_dtypes": "f16", "loss_scaling": "dynamic"},
            "master_weights",
        ),
        ({"autocast": True, "mlp_dtypes": ["f16", "f32"]}, "mlp_dtypes"),
        ({"loss_scaling": "tcnn"}, "loss_scaling"),
        ({"mlp": "conv"}, "mlp"),
        ({"mlp_backend": "tcnn"}, "mlp_backend"),
        ({"name": "tcnn_fused", "loss_scaling": "none"}, "loss_scaling"),
        ({"name": "tcnn_fused", "mlp_dtypes": "f32"}, "mlp_dtypes"),
        ({"name": "tcnn_fused", "mlp_backend": "tcnn", "fused_split_k": False}, "mlp_backend"),
        ({"name": "tcnn_fused", "fused_accumulate": "f8"}, "fused_accumulate"),
        ({"name": "tcnn_fused", "fused_loss_scale": 0}, "fused_loss_scale"),
        ({"not_a_field": 1}, "unknown key"),
    ],
)
def test_bad_config_raises_naming_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        PrecisionPolicy.from_config(cfg)


def test_unknown_arm_and_dtype_parsing():
    with pytest.raises(ValueError, match="known arms"):
        PrecisionPolicy.named("f8")
    assert parse_dtype("half") is torch.float16 and parse_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype(torch.float64)


def test_every_arm_runs_here_and_only_explicit_tcnn_needs_tinycudann():
    # tcnn_fused's backend is "auto": the torch twin wherever tinycudann is missing.
    assert all(PrecisionPolicy.named(n).availability() == (True, "") for n in ARMS)
    explicit = PrecisionPolicy.from_config({"name": "tcnn_fused", "mlp_backend": "tcnn"})
    ok, why = explicit.availability()
    if not ok:
        assert "tinycudann" in why
        with pytest.raises(RuntimeError, match="tinycudann"):
            explicit.check_available()


def test_scale_grad_is_identity_forward_and_skips_non_grad_inputs():
    x = torch.randn(5)
    assert scale_grad(x, 128.0) is x  # nvdiffrec's hook would divide None here and crash
    xr = x.clone().requires_grad_()
    y = scale_grad(xr, 1 / 128)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(xr.grad, torch.full_like(x, 1 / 128))


# ---------------------------------------------------------------------- stepper


def _model_and_optimizer(arm, **overrides):
    torch.manual_seed(0)
    policy = PrecisionPolicy.from_config({"name": arm, **overrides})
    mlp = PrecisionMLP(8, 3, 2, 16, policy)
    return mlp, torch.optim.Adam(mlp.parameters(), lr=1e-2)


def _loss(mlp, scale=1.0, seed=0):
    x = torch.rand(64, 8, generator=torch.Generator().manual_seed(seed))
    return mlp(x.to(mlp.policy.encoder_dtype)).float().square().mean() * scale


def _snapshot(mlp, optimizer):
    return [p.detach().clone() for p in mlp.parameters()], copy.deepcopy(optimizer.state_dict())


def _assert_bitwise_equal(a, b):
    params_a, opt_a = a
    params_b, opt_b = b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for key, state in opt_a["state"].items():
        for name, value in state.items():  # step, exp_avg, exp_avg_sq
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b["state"][key][name]))


@pytest.mark.parametrize("arm", ["f16_static", "f16_dynamic", "amp", "per_layer"])
def test_inf_gradient_skips_the_step_and_leaves_everything_bit_identical(arm):
    mlp, optimizer = _model_and_optimizer(arm, init_scale=1024.0)
    stepper = PrecisionStepper(mlp.policy, optimizer)
    optimizer.zero_grad()
    assert stepper(_loss(mlp)) == StepResult(skipped=False, loss_scale=stepper.loss_scale)
    before = _snapshot(mlp, optimizer)
    scale_before = stepper.loss_scale

    optimizer.zero_grad()
    stepper.backward(_loss(mlp, seed=1))
    mlp.layers[1].weight.grad[0, 0] = float("inf")  # injected overflow
    result = stepper.step()

    assert result.skipped
    _assert_bitwise_equal(before, _snapshot(mlp, optimizer))
    if mlp.policy.loss_scaling == "static":
        assert result.loss_scale == scale_before == 128.0
    else:  # backed off by GradScaler's factor
        assert result.loss_scale == scale_before * 0.5

    optimizer.zero_grad()
    assert not stepper(_loss(mlp, seed=2)).skipped  # and training carries on
    assert not all(torch.equal(p, q) for p, q in zip(before[0], mlp.parameters(), strict=True))


def test_nan_loss_is_skipped_too():
    mlp, optimizer = _model_and_optimizer("f16_dynamic")
    stepper = PrecisionStepper(mlp.policy, optimizer)
    before = _snapshot(mlp, optimizer)
    result = stepper(_loss(mlp) * float("nan"))
    assert result.skipped and result.loss_scale == 2.0**15
    _assert_bitwise_equal(before, _snapshot(mlp, optimizer))


@pytest.mark.parametrize("arm", ["f32", "nvdiffrec", "bf16"])
def test_a_non_finite_loss_with_finite_gradients_skips_the_step_of_an_unscaled_arm(arm):
    # A NaN added to the loss leaves every gradient finite: stepper(loss) and step(loss) check
    # the loss too, as the training loop's step_async(loss) does; step() without it cannot.
    mlp, optimizer = _model_and_optimizer(arm)
    stepper = PrecisionStepper(mlp.policy, optimizer)
    before = _snapshot(mlp, optimizer)
    result = stepper(_loss(mlp) + torch.tensor(float("nan")))
    assert result == StepResult(skipped=True, loss_scale=1.0, diverged=True)
    assert all(bool(torch.isfinite(p.grad).all()) for p in mlp.parameters())
    _assert_bitwise_equal(before, _snapshot(mlp, optimizer))
    loss = _loss(mlp) + torch.tensor(float("inf"))
    optimizer.zero_grad()
    stepper.backward(loss)
    assert stepper.step(loss).skipped
    _assert_bitwise_equal(before, _snapshot(mlp, optimizer))
    assert not stepper.step().skipped  # the same finite gradients, the loss not given


def test_dynamic_scale_grows_after_the_growth_interval():
    mlp, optimizer = _model_and_optimizer("f16_dynamic", init_scale=64.0, growth_interval=3)
    stepper = mlp.policy.stepper(optimizer)
    scales = []
    for it in range(7):
        optimizer.zero_grad()
        result = stepper(_loss(mlp, seed=it))
        assert not result.skipped
        scales.append(result.loss_scale)
    assert scales == [64.0, 64.0, 128.0, 128.0, 128.0, 256.0, 256.0]
    state = stepper.state_dict()
    fresh = PrecisionStepper(mlp.policy, optimizer)
    fresh.load_state_dict(state)
    assert fresh.loss_scale == 256.0


def test_the_finite_check_gives_cuda_only_the_dtypes_its_kernel_takes(monkeypatch):
    # CUDA's _amp_foreach_non_finite_check_and_unscale_ dispatches float32, float64 and float16
    # (its CPU kernel takes bfloat16 too): a policy with bfloat16 parameters and no float32
    # masters must check them through float32 copies, and still see an inf among them.
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def as_on_cuda(tensors, found, inv_scale):
        for t in tensors:
            if t.dtype not in (torch.float32, torch.float64, torch.float16):
                raise NotImplementedError(f"not implemented for '{t.dtype}' (as on CUDA)")
        return original(tensors, found, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", as_on_cuda)
    mlp, optimizer = _model_and_optimizer("bf16", master_weights=False, loss_scaling="none")
    assert {p.dtype for p in mlp.parameters()} == {torch.bfloat16}
    stepper = PrecisionStepper(mlp.policy, optimizer)
    assert not stepper(_loss(mlp)).skipped
    optimizer.zero_grad()
    stepper.backward(_loss(mlp, seed=1))
    mlp.layers[1].weight.grad[0, 0] = float("inf")
    assert stepper.step().skipped


def test_unscaled_arms_step_plainly():
    for arm in ("f32", "f16_naive", "bf16", "nvdiffrec"):
        mlp, optimizer = _model_and_optimizer(arm)
        stepper = PrecisionStepper(arm, optimizer)
        before = [p.detach().clone() for p in mlp.parameters()]
        # f16 Adam (eps = 1e-8 rounds to 0 in f16) turns these finite gradients into NaN
        # weights at the first step: the stepper reports it as a divergence.
        broken = arm == "f16_naive"
        assert stepper(_loss(mlp)) == StepResult(skipped=False, loss_scale=1.0, diverged=broken)
        assert all(bool(torch.isfinite(p).all()) != broken for p in mlp.parameters())
        assert stepper.state_dict() == {}
        assert all(not torch.equal(a, b) for a, b in zip(before, mlp.parameters(), strict=True))


def test_f16_naive_loses_small_gradients_that_f16_dynamic_keeps():
    """A loss of order 1e-6 (a late-training residual, or a small regulariser weight) has output
    gradients below f16's smallest subnormal (6e-8): without loss scaling they flush to zero."""
    tiny = 1e-6
    grads = {}
    for arm in ("f16_naive", "f16_dynamic", "f32"):
        mlp, optimizer = _model_and_optimizer(arm)
        if arm == "f16_naive":  # same starting weights as the others, rounded to f16
            reference, _ = _model_and_optimizer("f32")
            mlp.load_state_dict({k: v.half() for k, v in reference.state_dict().items()})
        stepper = PrecisionStepper(mlp.policy, optimizer)
        optimizer.zero_grad()
        stepper.backward(_loss(mlp, scale=tiny))
        stepper.unscale_()
        grads[arm] = [layer.weight.grad.float() for layer in mlp.layers]
    assert all(torch.count_nonzero(g) == 0 for g in grads["f16_naive"])
    for g_dyn, g_ref in zip(grads["f16_dynamic"], grads["f32"], strict=True):
        assert torch.count_nonzero(g_dyn) > 0.9 * torch.count_nonzero(g_ref)
        # f16 rounding of activations and output gradients: up to 1.6e-3 relative on entries
        # above a tenth of the largest; measured within 3.8e-4 * (|g| + max |g|) everywhere.
        torch.testing.assert_close(g_dyn, g_ref, rtol=1e-3, atol=1e-3 * g_ref.abs().max().item())


def test_a_misspelled_arm_name_in_a_partial_config_is_an_error():
    # Its unspecified fields would be the dataclass's (f32) under a name that reads as f16.
    with pytest.raises(ValueError) as err:
        PrecisionPolicy.from_config({"name": "f16_dyanmic", "growth_interval": 100})
    assert str(err.value) == (
        "name: 'f16_dyanmic' is not a registered arm (did you mean 'f16_dynamic'?); a policy of "
        "its own under a new name gives every field"
    )
    full = {**PrecisionPolicy.named("f16_dynamic").to_config(), "name": "f16_dynamic2"}
    assert PrecisionPolicy.from_config(full).loss_scaling == "dynamic"  # every field: its own
    own = PrecisionPolicy.from_config({"name": "my_arm", "encoder_dtype": "f16"})  # not close
    assert own.name == "my_arm" and own.mlp_dtypes == (torch.float32,)
    # a variant's own name (an extension of an arm's, or longer) is no typo
    for name in ("bf16_nogrid", "f16_dynamic_100", "nvdiffrec_f32", "tcnn_fused_128",
                 "per_layer2", "bf16_2", "fp8_rowwise_v2"):  # fmt: skip
        assert PrecisionPolicy.from_config({"name": name, "mlp_dtypes": ["bf16"]}).name == name
