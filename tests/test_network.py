"""FullyFusedMLP: the torch twin against the brute-force reference of the same arithmetic model,
tcnn's layout and initialisation, the switches, and (with tinycudann) tcnn itself."""

from __future__ import annotations

import fused_mlp_reference as ref
import numpy as np
import pytest
import torch

from mptex._fused_mlp_torch import (
    FusedMLPSpec,
    _slice_bounds,
    pcg32_floats,
    split_k_weight_grad,
    xavier_uniform_params,
)
from mptex.network import FullyFusedMLP, fused_params_from_linear, linear_weights_from_fused


def _case(n, n_in, n_out, width, n_hidden, seed=0, grad_scale=1e-3, **kw):
    """Twin outputs and gradients and the reference's, for one random problem."""
    gen = torch.Generator().manual_seed(seed)
    net = FullyFusedMLP(
        n_in, n_out, {"n_neurons": width, "n_hidden_layers": n_hidden}, backend="torch", **kw
    )
    with torch.no_grad():  # trained-looking weights: wider than the init, away from 0
        net.params.mul_(3.0)
    x = torch.rand(n, n_in, generator=gen).requires_grad_(True)
    grad_out = (torch.randn(n, n_out, generator=gen) * grad_scale).half()
    out = net(x)
    out.backward(grad_out)
    expected = ref.network(
        x.detach().tolist(), net.params.detach().tolist(), n_out, width, n_hidden,
        loss_scale=kw.get("loss_scale", 128.0), grad_out=grad_out.float().tolist(),
        accumulate=kw.get("accumulate", "half"), split_k=kw.get("split_k", True),
    )  # fmt: skip
    return net, x, out, expected


def _assert_bit_exact(net, x, out, expected):
    # The model is deterministic: the twin must reproduce the reference bit for bit.
    ref_out, ref_grad_x, ref_grad_params = expected
    assert out.dtype == torch.float16
    assert torch.equal(out.float(), torch.tensor(ref_out, dtype=torch.float32))
    assert torch.equal(x.grad, torch.tensor(ref_grad_x, dtype=torch.float32))
    assert net.params.grad.dtype == torch.float32
    assert torch.equal(net.params.grad, torch.tensor(ref_grad_params, dtype=torch.float32))


@pytest.mark.parametrize(
    "width, n_hidden, n_in",
    [(16, 2, 5), (32, 2, 24), (32, 2, 32), (32, 1, 5), (64, 1, 7), (128, 1, 3)],
)
def test_twin_matches_reference_per_width(width, n_hidden, n_in):
    # n_in 24 and 32 pad to the width (fused input-gradient path, k_block 16); 5 and 7 pad to
    # 16 < width (CUTLASS path, k_block 8); 5 -> 16 columns of which 11 are the constant 1.
    net, x, out, expected = _case(40, n_in, 3, width, n_hidden)
    _assert_bit_exact(net, x, out, expected)
    assert net.params.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_twin_matches_reference_with_wide_output():
    # 20 outputs pad to 32: the last layer is CUTLASS's (k_block 8) in tcnn
    _assert_bit_exact(*_case(30, 4, 20, 16, 1))


@pytest.mark.parametrize("loss_scale", [128.0, 1.0, 4096.0])
def test_twin_matches_reference_at_each_loss_scale(loss_scale):
    _assert_bit_exact(*_case(30, 5, 3, 16, 1, grad_scale=1e-5, loss_scale=loss_scale))


def test_loss_scale_changes_what_survives_in_half():
    # Small output gradients: the scaled half backward flushes more entries at scale 1 than at
    # 128 (scaled_zero_frac); the final / scale in half gives part of that back (zero_frac).
    net = FullyFusedMLP(5, 3, {"n_neurons": 16, "n_hidden_layers": 1}, backend="torch")
    net.collect_stats = True
    x = torch.rand(200, 5, generator=torch.Generator().manual_seed(0))
    grad_out = torch.full((200, 3), 2.0**-22).half()  # a half subnormal
    zeros = {}
    for scale in (1.0, 128.0):
        net.spec.loss_scale = scale
        net.params.grad = None
        net(x).backward(grad_out)
        zeros[scale] = net.last_stats[0]["scaled_zero_frac"]
    assert zeros[1.0] > zeros[128.0]


def test_float_accumulation_matches_reference():
    _assert_bit_exact(*_case(30, 5, 3, 16, 1, accumulate="float"))


def test_twin_matches_reference_at_4097_samples():
    # 4097 pads to 4352 samples: split_k_factor = 4352 // 4096 = 1 (one slice of 4352).
    assert _slice_bounds(4352, True) == [(0, 4352)]
    _assert_bit_exact(*_case(4097, 3, 1, 16, 1))


@pytest.mark.parametrize("batch", [4096, 8192, 8448, 12288])
@pytest.mark.parametrize("split_k", [True, False])
@pytest.mark.parametrize("accumulate", ["half", "float"])
def test_split_k_weight_grad_matches_reference(batch, split_k, accumulate):
    gen = torch.Generator().manual_seed(batch)
    grad = (torch.randn(batch, 2, generator=gen) * 0.05).half()
    act = torch.rand(batch, 3, generator=gen).half()
    got = split_k_weight_grad(grad, act, accumulate, split_k)
    want = [
        [ref.weight_grad(grad[:, o].float().tolist(), act[:, i].float().tolist(), accumulate,
                         split_k) for i in range(3)]
        for o in range(2)
    ]  # fmt: skip
    assert torch.equal(got.float(), torch.tensor(want, dtype=torch.float32))


def test_split_k_slices_follow_cutlass():
    # tcnn: slices = batch / min(4096, batch); CUTLASS: (K / 32 / slices) * 32, last takes rest
    assert _slice_bounds(4096, True) == [(0, 4096)]
    assert _slice_bounds(8192, True) == [(0, 4096), (4096, 8192)]
    assert _slice_bounds(8448, True) == [(0, 4224), (4224, 8448)]
    assert _slice_bounds(12544, True) == [(0, 4160), (4160, 8320), (8320, 12544)]
    assert _slice_bounds(12288, False) == [(0, 12288)]


def test_half_accumulation_stagnates_and_split_k_prevents_it():
    # Hand-computed: 32768 equal products 2^-4 * 2^-3 = 2^-7, blocks of 8 add b = 2^-4 each.
    # One half accumulator stops at 2048 b = 128 (there b is half an ulp, and the tie rounds to
    # the even 2048 b); split-K's 8 slices of 4096 samples each reach 512 b = 32 exactly, and
    # 8 x 32 = 256 is exact; float accumulation is exact too.
    grad = torch.full((32768, 1), 2.0**-4).half()
    act = torch.full((32768, 1), 2.0**-3).half()
    assert float(split_k_weight_grad(grad, act, "half", split_k=False)) == 128.0
    assert float(split_k_weight_grad(grad, act, "half", split_k=True)) == 256.0
    assert float(split_k_weight_grad(grad, act, "float", split_k=False)) == 256.0
    stats = {}
    split_k_weight_grad(grad, act, "half", split_k=False, stats=stats)
    assert stats["absorbed_frac"] == pytest.approx(2048 / 4096)


def test_params_layout_and_layer_weights_are_views():
    net = FullyFusedMLP(5, 3, {"n_neurons": 32, "n_hidden_layers": 2}, backend="torch")
    assert net.layer_shapes() == [(32, 16), (32, 32), (16, 32)]
    assert net.n_params == 32 * 16 + 32 * 32 + 16 * 32 == net.params.numel()
    w0, w1, w2 = net.layer_weights()
    assert w0[3, 7] == net.params[3 * 16 + 7]
    assert w2[15, 31] == net.params[-1]
    assert w1.data_ptr() == net.params[32 * 16 :].data_ptr()
    assert all(w.dtype == torch.float32 for w in (w0, w1, w2))


def test_tcnn_params_vector_round_trips():
    # A vector in tcnn's layout (what tinycudann.Network.params holds) loads and comes back.
    net = FullyFusedMLP(24, 3, {"n_neurons": 32, "n_hidden_layers": 2}, backend="torch")
    vector = torch.randn(net.n_params)
    net.load_state_dict({"params": vector})
    assert torch.equal(net.params.detach(), vector)
    copy = FullyFusedMLP(24, 3, {"n_neurons": 32, "n_hidden_layers": 2}, backend="torch")
    copy.load_state_dict(net.state_dict())
    assert torch.equal(copy.params, net.params)
    x = torch.rand(10, 24)
    assert torch.equal(copy(x), net(x))
    # the matrices sit where tcnn's set_params_impl puts them, row-major [out, in]
    w1 = vector[32 * 32 : 2 * 32 * 32].view(32, 32)
    assert torch.equal(net.layer_weights()[1].detach(), w1)


def test_pcg32_matches_the_reference_and_xavier_bounds():
    assert np.array_equal(pcg32_floats(1337, 500), np.float32(ref.pcg32_next_floats(1337, 500)))
    spec = FusedMLPSpec(24, 3, 32, 2)
    params = xavier_uniform_params(spec, 1337)
    offset = 0
    for rows, cols in spec.shapes():
        bound = float(np.sqrt(np.float32(6.0) / np.float32(rows + cols)))
        chunk = params[offset : offset + rows * cols]
        assert chunk.abs().max() <= bound and chunk.abs().max() > 0.9 * bound
        offset += rows * cols
    assert not torch.equal(params, xavier_uniform_params(spec, 1338))


def test_the_twin_is_close_to_float64_math():
    # Sanity of the emulation itself: half arithmetic, errors of a few half ulps.
    net = FullyFusedMLP(8, 3, {"n_neurons": 32, "n_hidden_layers": 2}, backend="torch")
    x = torch.rand(300, 8)
    w = [m.detach().double() for m in net.layer_weights()]
    h = torch.cat([x.double(), torch.ones(300, 8, dtype=torch.float64)], 1)
    h = torch.relu(h @ w[0].t())
    h = torch.relu(h @ w[1].t())
    exact = (h @ w[2].t())[:, :3]
    # half rounding of inputs, weights and 3 layers of activations: a few 2^-11 relative
    torch.testing.assert_close(net(x).double(), exact, rtol=8e-3, atol=4e-3)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"n_neurons": 24}, "n_neurons"),
        ({"n_neurons": 256}, "n_neurons"),
        ({"n_hidden_layers": 0}, "n_hidden_layers"),
        ({"activation": "Sine"}, "activation"),
        ({"output_activation": "SiLU"}, "output_activation"),
        ({"otype": "CutlassMLP"}, "otype"),
        ({"n_neurons": 32, "bias": True}, "unknown"),
    ],
)
def test_bad_config_raises_value_error(config, key):
    with pytest.raises(ValueError, match=key):
        FullyFusedMLP(8, 3, config, backend="torch")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seed=2**64), "seed: expected an integer in [0, 2**64), got 18446744073709551616"),
        (dict(seed=-1), "seed: expected an integer in [0, 2**64), got -1"),
        (dict(seed=True), "seed: expected an integer in [0, 2**64), got True"),
        (dict(loss_scale=float("inf")), "loss_scale: expected a finite positive number, got inf"),
        (dict(loss_scale="8"), "loss_scale: expected a finite positive number, got '8'"),
        (dict(split_k="no"), "split_k: expected True or False, got 'no'"),
        (dict(network_config=None), "network_config: expected a mapping of tcnn network keys, "
                                    "got None"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_naming_them(kwargs, message):
    # pcg32 would take a seed modulo 2**64 (2**64 the same network as 0), and a string loss
    # scale or split_k would be converted rather than refused.
    kwargs = {"network_config": {"n_neurons": 16}, **kwargs}
    with pytest.raises(ValueError) as err:
        FullyFusedMLP(8, 3, backend="torch", **kwargs)
    assert str(err.value) == message


def test_tcnn_backend_refuses_twin_only_switches():
    with pytest.raises(ValueError, match="accumulate"):
        FullyFusedMLP(8, 3, {"n_neurons": 16}, backend="tcnn", accumulate="float")


def test_stats_are_recorded_per_layer_when_asked():
    net = FullyFusedMLP(8, 3, {"n_neurons": 16, "n_hidden_layers": 2}, backend="torch")
    x = torch.rand(100, 8)
    net(x).float().mean().backward()
    assert net.last_stats == {}
    net.collect_stats = True
    net(x).float().mean().backward()
    stats = net.last_stats
    assert sorted(stats) == [0, 1, 2]
    for layer in stats.values():
        for key in ("absorbed_frac", "zero_frac", "subnormal_frac", "flushed_by_unscale_frac"):
            assert 0.0 <= layer[key] <= 1.0


@pytest.mark.requires_tcnn
def test_twin_matches_tcnn_network():
    import tinycudann as tcnn

    config = {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
              "n_neurons": 32, "n_hidden_layers": 2}  # fmt: skip
    native = tcnn.Network(24, 3, config, seed=1337)
    twin = FullyFusedMLP(24, 3, config, backend="torch").cuda()
    # same initialisation (pcg32 + xavier), then the same params for the comparison
    torch.testing.assert_close(twin.params.detach(), native.params.detach().float(), rtol=0, atol=0)
    x = torch.rand(5000, 24, device="cuda", requires_grad=True)
    x_twin = x.detach().clone().requires_grad_(True)
    out_native, out_twin = native(x), twin(x_twin)
    grad = (torch.randn_like(out_native.float()) * 1e-3).half()
    out_native.backward(grad)
    out_twin.backward(grad)
    # The MMA model is a model: tcnn's hardware order may differ by an accumulator rounding.
    # Outputs: within 2 half ulps; gradients are measured (the GPU issue), here within 1 %.
    torch.testing.assert_close(out_twin, out_native, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(twin.params.grad, native.params.grad.float(), rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(x_twin.grad, x.grad, rtol=1e-2, atol=1e-5)


# ----------------------------------------------------------------------------- layouts
def _linear_weights(n_in, n_out, width, n_hidden, seed=0):
    """nvdiffrec's _MLP weights: Kaiming-uniform [out, in] matrices, no biases."""
    gen = torch.Generator().manual_seed(seed)
    dims = [n_in] + [width] * n_hidden + [n_out]
    return [
        (torch.rand(dims[i + 1], dims[i], generator=gen) * 2 - 1) * (6 / dims[i]) ** 0.5
        for i in range(len(dims) - 1)
    ]


def test_linear_weights_land_where_tcnn_reads_them():
    w0, w1, w2 = _linear_weights(5, 3, 32, 2)
    params = fused_params_from_linear([w0, w1, w2])
    assert params.shape == (32 * 16 + 32 * 32 + 16 * 32,) and params.dtype == torch.float32
    # Written out element by element from tcnn's set_params_impl: row-major [out, in] matrices
    # in order, the first 16 columns wide, the last 16 rows tall, padding zero.
    for r in range(32):
        for c in range(16):
            assert params[r * 16 + c] == (w0[r, c] if c < 5 else 0.0)
    hidden = params[32 * 16 : 32 * 16 + 32 * 32]
    assert all(hidden[r * 32 + c] == w1[r, c] for r in range(32) for c in range(32))
    last = params[32 * 16 + 32 * 32 :]
    for r in range(16):
        for c in range(32):
            assert last[r * 32 + c] == (w2[r, c] if r < 3 else 0.0)


@pytest.mark.parametrize(
    "n_in, n_out, width, n_hidden", [(5, 3, 32, 2), (32, 3, 32, 2), (16, 16, 16, 1), (7, 9, 64, 3)]
)
def test_layouts_round_trip_exactly(n_in, n_out, width, n_hidden):
    weights = _linear_weights(n_in, n_out, width, n_hidden)
    params = fused_params_from_linear(weights)
    back = linear_weights_from_fused(params, n_in, n_out, width, n_hidden)
    assert len(back) == len(weights)
    assert all(torch.equal(b, w) for b, w in zip(back, weights, strict=True))
    assert torch.equal(fused_params_from_linear(back), params)


def test_fused_to_linear_refuses_a_padding_bias_unless_told():
    # tcnn's xavier init fills the padding columns, which act on the constant-1 inputs.
    net = FullyFusedMLP(5, 3, {"n_neurons": 32, "n_hidden_layers": 2}, backend="torch")
    with pytest.raises(ValueError, match=r"^params: the first layer's padding columns 5\.\.15"):
        linear_weights_from_fused(net.params, 5, 3, 32, 2)
    weights = linear_weights_from_fused(net.params, 5, 3, 32, 2, drop_input_bias=True)
    assert torch.equal(weights[0], net.layer_weights()[0][:, :5])
    assert torch.equal(weights[2], net.layer_weights()[2][:3])
    with pytest.raises(ValueError, match=r"^params: expected \[2048\]"):
        linear_weights_from_fused(net.params[:-1], 5, 3, 32, 2)


@pytest.mark.parametrize(
    "weights, match",
    [
        ([torch.zeros(32, 5)], r"^weights: expected at least 2"),
        ([torch.zeros(24, 5), torch.zeros(3, 24)], r"^weights\[0\]: FullyFusedMLP supports"),
        ([torch.zeros(32, 5), torch.zeros(3, 16)], r"^weights\[1\]: expected \[\*, 32\]"),
        ([torch.zeros(32, 5), torch.zeros(16, 32), torch.zeros(3, 32)], r"^weights\[1\]"),
        ([torch.zeros(32, 5), torch.zeros(3)], r"^weights\[1\]: expected a 2-D"),
    ],
)
def test_linear_to_fused_refuses_chains_tcnn_cannot_hold(weights, match):
    with pytest.raises(ValueError, match=match):
        fused_params_from_linear(weights)


@pytest.mark.parametrize("n_in", [5, 32])
def test_converted_network_computes_the_linear_mlp_up_to_half_arithmetic(n_in):
    weights = _linear_weights(n_in, 3, 32, 2)
    x = torch.rand(300, n_in, generator=torch.Generator().manual_seed(1))
    exact = x.double()
    for i, w in enumerate(weights):
        exact = exact @ w.double().t()
        exact = torch.relu(exact) if i < len(weights) - 1 else exact
    net = FullyFusedMLP(n_in, 3, {"n_neurons": 32, "n_hidden_layers": 2}, backend="torch")
    with torch.no_grad():
        net.params.copy_(fused_params_from_linear(weights))
    # The fused network rounds to half (inputs, weights, accumulators): the stated first-order
    # bound of the model's roundings, elementwise (fused_mlp_reference.forward_error_bound).
    bound = torch.from_numpy(ref.forward_error_bound([w.numpy() for w in weights], x.numpy()))

    def within_bound() -> bool:
        error = (net(x).detach().double() - exact).abs()
        assert float(error.max()) > 0  # half arithmetic did round: the bound is what is tested
        return bool((error <= bound).all())

    assert within_bound()
    # The bound is tight enough to catch a wrong layout (measured: 4-13x over it).
    with torch.no_grad():
        net.layer_weights()[1].copy_(weights[1].t())
    assert not within_bound()
    if n_in % 16:  # padding that is not zero is a bias on the constant-1 inputs
        with torch.no_grad():
            net.params.copy_(fused_params_from_linear(weights))
            net.layer_weights()[0][:, n_in:] = 0.05
        assert not within_bound()
