"""PrecisionMLP: nvdiffrec architecture, per-layer compute dtypes, f64 reference, gradient flow."""

import pytest
import torch
from conftest import TOL
from fp8_reference import seen_input, seen_weight

from mptex.mlp import CastLinear, PrecisionMLP
from mptex.precision import PrecisionPolicy

CPU_ARMS = [n for n in PrecisionPolicy.names() if PrecisionPolicy.named(n).mlp == "linear"]
# The FP8 arms round every activation with a scale taken from the batch: their forward is
# tested against a float64 reference with an independent quantiser in tests/test_fp8.py.
DTYPE_ARMS = [n for n in CPU_ARMS if not PrecisionPolicy.named(n).fp8_gemm]
FUSED_ARMS = [n for n in PrecisionPolicy.names() if PrecisionPolicy.named(n).mlp == "fused"]
N_IN, N_OUT, HIDDEN, NEURONS = 32, 3, 2, 32


def _lowest_dtype(policy: PrecisionPolicy) -> torch.dtype:
    dtypes = [policy.encoder_dtype, *policy.mlp_dtypes]
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _inputs(policy, n=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes like a trained hash grid's features; an encoder in f16 hands the MLP f16.
    return (torch.rand(n, N_IN, generator=gen) * 2 - 1).to(policy.encoder_dtype)


def _reference(mlp, x):
    """f64 forward with the stored weights, and the entry-wise magnitude bound |W_L|...|W_1||x|."""
    out, bound = x.double(), x.double().abs()
    for i, layer in enumerate(mlp.layers):
        weight = seen_weight(layer, mlp.policy)
        out = seen_input(out, mlp.policy) @ weight.T
        bound = bound @ weight.abs().T
        if i < len(mlp.layers) - 1:
            out = out.relu()
    return out, bound


def test_nvdiffrec_architecture_and_state_dict_keys():
    torch.manual_seed(0)
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, "f32")
    assert len(mlp.layers) == HIDDEN + 1
    assert all(isinstance(layer, torch.nn.Linear) and layer.bias is None for layer in mlp.layers)
    assert [tuple(layer.weight.shape) for layer in mlp.layers] == [(32, 32), (32, 32), (3, 32)]
    assert isinstance(mlp.net[1], torch.nn.ReLU) and isinstance(mlp.net[-1], CastLinear)
    # nvdiffrec's _MLP keeps a Sequential called net: same keys, so its checkpoints load.
    assert list(mlp.state_dict()) == ["net.0.weight", "net.2.weight", "net.4.weight"]
    for layer in mlp.layers:  # kaiming_uniform_(nonlinearity="relu"): U(-sqrt(6/fan_in), +)
        assert layer.weight.abs().max() <= (6 / layer.in_features) ** 0.5
        assert layer.weight.std() > 0.5 * (2 / layer.in_features) ** 0.5


def test_bias_and_activation_options():
    mlp = PrecisionMLP(4, 2, 1, 8, "f32", bias=True, activation="Tanh")
    assert all(layer.bias is not None and torch.all(layer.bias == 0) for layer in mlp.layers)
    assert isinstance(mlp.net[1], torch.nn.Tanh)
    with pytest.raises(ValueError, match="activation"):
        PrecisionMLP(4, 2, 1, 8, "f32", activation="GELU")
    with pytest.raises(ValueError, match="n_hidden_layers"):
        PrecisionMLP(4, 2, 0, 8, "f32")
    with pytest.raises(ValueError, match=r"^bias: policy 'tcnn_fused' runs tcnn's fully fused"):
        PrecisionMLP(4, 2, 1, 16, "tcnn_fused", bias=True)  # would be built without biases
    with pytest.raises(ValueError, match="x: expected shape"):
        mlp(torch.zeros(3, 5))


@pytest.mark.parametrize("arm", DTYPE_ARMS)
def test_forward_matches_f64_reference(arm):
    torch.manual_seed(1)
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, arm)
    x = _inputs(mlp.policy)
    out = mlp(x)
    ref, bound = _reference(mlp, x)
    tol = TOL[_lowest_dtype(mlp.policy)]
    # Relative to the magnitude bound |W||x| rather than to |out|: ReLU-MLP outputs are sums with
    # cancellation, and the classic forward-error bound of a matmul chain is c * eps * |W||x|.
    # Measured err/bound on this case: f32 3e-9, f16 1.2e-5, bf16 1e-4, all well below rtol.
    err = (out.double() - ref).abs()
    assert torch.all(err <= tol["rtol"] * bound + tol["atol"]), (arm, (err / bound).max())
    assert out.shape == (512, N_OUT)


@pytest.mark.parametrize("arm", CPU_ARMS)
def test_param_dtypes_and_output_dtype(arm):
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, arm)
    policy = mlp.policy
    expected_param = policy.mlp_dtypes[0] if not policy.master_weights else torch.float32
    assert all(p.dtype == expected_param for p in mlp.parameters())
    out = mlp(_inputs(policy, 8))
    assert out.dtype == policy.layer_dtypes(len(mlp.layers))[-1]


def test_per_layer_computes_each_layer_in_its_dtype():
    policy = PrecisionPolicy.from_config(
        {"name": "per_layer", "mlp_dtypes": ["f16", "bf16", "f32"], "loss_scaling": "none"}
    )
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, policy)
    seen = []
    hooks = [
        layer.register_forward_hook(lambda m, inp, out: seen.append((inp[0].dtype, out.dtype)))
        for layer in mlp.layers
    ]
    mlp(_inputs(policy, 16))
    for h in hooks:
        h.remove()
    # Input of layer i is whatever the previous layer produced; layer i casts it to its own dtype.
    assert seen == [
        (torch.float16, torch.float16),
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ]
    assert all(layer.weight.dtype == torch.float32 for layer in mlp.layers)
    with pytest.raises(ValueError, match="mlp_dtypes"):
        PrecisionMLP(N_IN, N_OUT, 3, NEURONS, policy)  # 4 layers, 3 dtypes


@pytest.mark.parametrize("arm", CPU_ARMS)
def test_gradients_reach_every_layer_in_the_master_dtype(arm):
    torch.manual_seed(2)
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, arm)
    x = _inputs(mlp.policy, 256).requires_grad_()
    mlp(x).float().square().mean().backward()
    for i, layer in enumerate(mlp.layers):
        grad = layer.weight.grad
        assert grad is not None and grad.dtype == layer.weight.dtype, (arm, i)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, (arm, i)
    assert x.grad is not None and x.grad.dtype == x.dtype


def test_nvdiffrec_scales_the_input_gradient_by_128_in_f32_then_rounds_once_to_f16():
    # nvdiffrec's order: its hook multiplies the f32 gradient w.r.t. enc.float() by 128, and the
    # cast's backward then rounds it once to f16. Gradients in f16's subnormal range (below
    # 2^-14, spacing 2^-24) show the order: rounding first keeps only the subnormal bits, and the
    # x128 after it cannot bring the lost ones back.
    torch.manual_seed(3)
    ours = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, "nvdiffrec")
    plain = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, "f32")
    plain.load_state_dict(ours.state_dict())
    x = _inputs(ours.policy, 64)
    assert x.dtype == torch.float16
    grads = []
    for mlp, xi in ((ours, x.clone()), (plain, x.float())):
        xi.requires_grad_()
        y = mlp(xi)
        y.backward(torch.full_like(y, 2.0**-20))
        grads.append((xi.grad, [layer.weight.grad for layer in mlp.layers]))
    g = grads[1][0]  # the f32 gradient w.r.t. enc.float()
    assert ((g.abs() < 2.0**-14) & (g != 0)).float().mean() > 0.5
    assert torch.equal(grads[0][0], (g * 128).half())
    assert not torch.equal((g * 128).half(), g.half() * 128)
    for g_ours, g_plain in zip(grads[0][1], grads[1][1], strict=True):
        assert torch.equal(g_ours, g_plain)  # weights themselves get the true gradient


def test_amp_runs_under_cpu_autocast_with_f32_layers():
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, "amp")
    assert all(layer.compute_dtype is None for layer in mlp.layers)
    assert mlp(_inputs(mlp.policy, 8)).dtype == torch.float16


@pytest.mark.parametrize("arm", FUSED_ARMS)
def test_fused_arms_use_the_fused_network_with_their_switches(arm):
    policy = PrecisionPolicy.named(arm)
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, 16, policy)
    assert mlp.layers == [] and mlp.resolved_backend() in ("torch", "tcnn")
    spec = mlp.net.spec
    assert (spec.accumulate, spec.split_k, spec.loss_scale) == (
        policy.fused_accumulate,
        policy.fused_split_k,
        policy.fused_loss_scale,
    )
    out = mlp(torch.rand(300, N_IN))
    assert out.shape == (300, N_OUT) and out.dtype == torch.float16
    out.float().square().mean().backward()
    assert mlp.net.params.grad.dtype == torch.float32 and mlp.net.params.grad.abs().sum() > 0


def test_tcnn_fused_refused_without_tcnn():
    policy = PrecisionPolicy.from_config({"name": "tcnn_fused", "mlp_backend": "tcnn"})
    if policy.availability()[0]:
        pytest.skip("tinycudann and CUDA are present")
    with pytest.raises(RuntimeError, match="tinycudann"):
        PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, policy)


@pytest.mark.requires_tcnn
def test_tcnn_fused_trains_on_cuda():
    mlp = PrecisionMLP(N_IN, N_OUT, HIDDEN, NEURONS, "tcnn_fused").cuda()
    x = torch.rand(1024, N_IN, device="cuda", dtype=torch.float16)
    out = mlp(x)
    assert out.shape == (1024, N_OUT) and out.dtype == torch.float16
    out.float().square().mean().backward()
    assert mlp.net.params.grad is not None and mlp.net.params.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_linear_is_a_half_gemm_with_float32_accumulation(dtype):
    # reduced_linear must compute what a half GEMM with f32 accumulation computes: the exact
    # (f64) product of the rounded operands, rounded once to ``dtype``. A product of two f16
    # (bf16) significands is exact in f32, so the only extra error is the f32 sum's, at most
    # K * 2^-24 * sum|a||b| (K terms); the output may then land on either side of a rounding
    # boundary that close, i.e. within 1 ulp of ``dtype`` of the f64 value rounded.
    from mptex.mlp import reduced_linear

    gen = torch.Generator().manual_seed(0)
    k = 10_007  # a weight-gradient-like reduction over the batch
    x = torch.randn(48, k, generator=gen)
    w = torch.randn(16, k, generator=gen) * 0.1
    out = reduced_linear(x, w, None, dtype)
    assert out.dtype == dtype
    xr, wr = x.to(dtype).double(), w.to(dtype).double()
    exact = xr @ wr.T
    sum_bound = k * 2.0**-24 * (xr.abs() @ wr.abs().T)
    ulp = exact.abs().to(dtype).double() * torch.finfo(dtype).eps  # one ulp of dtype at |exact|
    assert ((out.double() - exact).abs() <= 0.5 * ulp + sum_bound + ulp).all()
    # And most outputs are the correctly rounded value itself.
    assert (out == exact.to(dtype)).double().mean() > 0.99
    # The gradients are rounded to dtype once (the casts), then handed back in f32.
    xx, ww = x[:, :64].clone().requires_grad_(), w[:, :64].clone().requires_grad_()
    reduced_linear(xx, ww, None, dtype).float().sum().backward()
    assert xx.grad.dtype == ww.grad.dtype == torch.float32
    assert torch.equal(xx.grad, xx.grad.to(dtype).float())
    assert torch.equal(ww.grad, ww.grad.to(dtype).float())
