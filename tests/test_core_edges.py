"""Edge cases of the texture, its MLPs and the hash-grid encoding, against written-out references.

* ``MLPTexture3D`` and ``check_texture_config``: ``sample`` against its definition written out
  in float32 (normalise into the box, clamp, encode, MLP, sigmoid, scale) after the bounds
  change in place or are replaced; malformed bounds and positions give one line naming the
  argument; the bounds are copies of the caller's tensors; state-dict conversion between
  nvdiffrec's and tcnn's layouts, compared matrix by matrix; the config's defaults
  (nvdiffrec's texture, tcnn's grid).
* ``FullyFusedMLP`` and the layout conversions: tcnn's defaults (``network.cu``), argument checks,
  the flat layout read element by element, and split-K's effect on a weight gradient computed
  by hand.
* ``PrecisionMLP`` and its layers: hand-computed roundings (a half or bfloat16 GEMM's bias, the
  E5M2 output gradient, current FP8 scaling), float64 products of the rounded operands,
  Kaiming-uniform bounds, the named activations' values, argument checks.
* ``HashGridEncoding``: tcnn's config defaults (``grid.h``), every range check at and beyond its
  limit, the float32 position limit, unchecked values, the memory check before building.
"""

import math

import numpy as np
import pytest
import torch

from mptex import MLPTexture3D, convert_state_dict
from mptex.encoding import HashGridEncoding
from mptex.fp8 import ScalingRecipe
from mptex.mlp import FP8Linear, PrecisionMLP, QuantizedLinear, reduced_linear
from mptex.network import FullyFusedMLP, fused_params_from_linear, linear_weights_from_fused
from mptex.texture import check_texture_config

SMALL = {
    "otype": "HashGrid", "n_levels": 4, "n_features_per_level": 2, "log2_hashmap_size": 12,
    "base_resolution": 4, "per_level_scale": 2.0,
}  # fmt: skip
AABB = [[-1.0, -2.0, 0.0], [3.0, 2.0, 1.0]]


def _texture(**kw):
    torch.manual_seed(0)
    texture = MLPTexture3D(AABB, precision="f32", encoder=SMALL, backend="torch", **kw)
    with torch.no_grad():  # features of order 1, so that the outputs depend on the position
        texture.encoder.params.uniform_(-1, 1)
    return texture


def _points(n=64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = torch.tensor(AABB[0]), torch.tensor(AABB[1])
    return lo + (hi - lo) * torch.rand(n, 3, generator=gen)


def _sample_by_definition(texture, texc, aabb, min_max):
    """nvdiffrec's sample() written out from its definition with the given bounds (float64
    lists, not the texture's buffers): normalise into the box, clamp to [0, 1], encode, MLP,
    sigmoid, scale into [min, max]."""
    lo, hi = torch.tensor(aabb[0]), torch.tensor(aabb[1])
    unit = ((texc - lo) / (hi - lo)).clamp(0, 1)
    out = torch.sigmoid(texture.net(texture.encoder(unit)).float())
    mn, mx = torch.tensor(min_max[0]), torch.tensor(min_max[1])
    return out * (mx - mn) + mn


# ----------------------------------------------------------------------------- texture config
def test_texture_config_defaults_are_nvdiffrecs_and_tcnns():
    checked = check_texture_config({"encoder": {}})
    # nvdiffrec's texture: 3 channels (kd), 32 neurons, 2 hidden layers.
    assert (checked["channels"], checked["internal_dims"], checked["hidden"]) == (3, 32, 2)
    # tcnn's grid defaults (grid.h): 16 levels, 2 features, 2**19 entries, base 16, scale 2.
    encoder = checked["encoder"]
    assert encoder["per_level_scale"] == 2.0 and encoder["base_resolution"] == 16
    assert (encoder["n_levels"], encoder["n_features_per_level"]) == (16, 2)
    assert encoder["log2_hashmap_size"] == 19 and encoder["interpolation"] == "Linear"


@pytest.mark.parametrize("key", ["channels", "internal_dims", "hidden"])
def test_texture_config_refuses_a_zero_size(key):
    with pytest.raises(ValueError, match=rf"^texture\.{key}: "):
        check_texture_config({key: 0})
    assert check_texture_config({key: 1})[key] == 1


# ----------------------------------------------------------------------------- bounds
@pytest.mark.parametrize(
    "aabb, message",
    [
        # A bool is no coordinate (True would read as 1).
        ([[False, False, False], [True, True, True]], "AABB: expected two rows of numbers"),
        (torch.zeros(3, 3), "AABB: expected shape [2, 3], got [3, 3]"),
        (np.zeros((1, 2, 3)), "AABB: expected shape [2, 3], got [1, 2, 3]"),
        ([[0.0, 0.0, 0.0], [math.inf, 1.0, 1.0]], "AABB: expected finite values, got "
         "[[0.0, 0.0, 0.0], [inf, 1.0, 1.0]]"),
        ([[0.0, math.nan, 0.0], [1.0, 1.0, 1.0]], "AABB: expected finite values"),
        # Three rows, each [1, 3]: the shape as given, not the rows flattened.
        ([[[0.0] * 3], [[1.0] * 3], [[2.0] * 3]], "AABB: expected shape [2, 3], got [3, 1, 3]"),
    ],
)  # fmt: skip
def test_malformed_aabb_is_one_line_naming_it(aabb, message):
    with pytest.raises(ValueError) as err:
        MLPTexture3D(aabb, encoder=SMALL, backend="torch")
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_malformed_min_max_is_one_line_naming_it():
    for min_max, message in (
        ([[0, 0, 0], [1, True, 1]], "min_max: expected two rows of numbers"),
        ([[0, 0, 0], [1, math.inf, 1]], "min_max: expected finite values"),
        (torch.zeros(4, 3), "min_max: expected shape [2, 3], got [4, 3]"),
    ):
        with pytest.raises(ValueError) as err:
            MLPTexture3D(AABB, min_max=min_max, encoder=SMALL, backend="torch")
        assert str(err.value).startswith(message)


def test_bounds_are_copies_of_the_callers_tensors():
    # A float32 CPU tensor converts to itself: the texture must still keep its own copy, or
    # the caller's later edits of its tensor would move the texture's box.
    aabb = torch.tensor(AABB)
    min_max = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    texture = MLPTexture3D(aabb, min_max=min_max, encoder=SMALL, backend="torch")
    aabb.mul_(10)
    min_max.zero_()
    assert torch.equal(texture.AABB, torch.tensor(AABB))
    assert torch.equal(texture.min_max, torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0]]))


# ----------------------------------------------------------------------------- sample
def test_sample_follows_its_definition_after_the_bounds_change_in_place():
    texture = _texture(min_max=[[0.0, -1.0, 0.5], [1.0, 1.0, 0.75]])
    points = _points()
    texture.sample(points)  # the box's extent is now computed once
    with torch.no_grad():
        texture.AABB[1] += torch.tensor([1.0, 2.0, 3.0])  # in place: the same tensor
        texture.min_max[1, 0] = 4.0
    new_aabb = [[-1.0, -2.0, 0.0], [4.0, 4.0, 4.0]]
    new_min_max = [[0.0, -1.0, 0.5], [4.0, 1.0, 0.75]]
    expected = _sample_by_definition(texture, points, new_aabb, new_min_max)
    # The same float32 operations in the same order (one extent subtraction of exact
    # integers): equal up to float32 rounding of the last scaling.
    torch.testing.assert_close(texture.sample(points), expected, rtol=1.3e-6, atol=1e-6)


def test_sample_follows_its_definition_after_the_bounds_are_replaced():
    texture = _texture()
    points = _points()
    texture.sample(points)
    new_aabb = [[-2.0, -2.0, -2.0], [2.0, 2.0, 2.0]]
    new_min_max = [[-1.0, 0.0, 0.0], [1.0, 2.0, 0.5]]
    # New buffers (as nvdiffrec's code assigns its AABB): tensors whose version counters
    # also start at 0, like the replaced ones'.
    texture.AABB = torch.tensor(new_aabb)
    texture.min_max = torch.tensor(new_min_max)
    expected = _sample_by_definition(texture, points, new_aabb, new_min_max)
    torch.testing.assert_close(texture.sample(points), expected, rtol=1.3e-6, atol=1e-6)


def test_a_zero_dimensional_position_is_refused_with_one_line():
    with pytest.raises(ValueError) as err:
        _texture().sample(torch.tensor(0.5))
    assert str(err.value) == "texc: expected shape [..., 3], got []"


def test_a_nan_position_is_named_as_texc():
    points = _points(8)
    points[3, 1] = math.nan
    with pytest.raises(ValueError) as err:
        _texture().sample(points)
    assert str(err.value) == "texc: contains NaN values"


# ----------------------------------------------------------------------------- state dicts
def test_a_deep_linear_mlp_converts_to_the_fused_layout_in_layer_order():
    # hidden=5: six linear layers, nvdiffrec's keys net.net.0 ... net.net.10; layer 10 is the
    # last one (index order, not the keys' text order, where "10" sorts before "2").
    torch.manual_seed(0)
    linear = MLPTexture3D(AABB, precision="f32", hidden=5, encoder=SMALL, backend="torch")
    fused = MLPTexture3D(AABB, precision="tcnn_fused", hidden=5, encoder=SMALL, backend="torch")
    fused.load_state_dict(convert_state_dict(linear.state_dict(), fused))
    matrices = fused.net.net.layer_weights()
    assert len(matrices) == 6
    for i, layer in enumerate(linear.net.layers):
        rows, cols = layer.weight.shape
        assert torch.equal(matrices[i][:rows, :cols], layer.weight.detach()), i
    back = MLPTexture3D(AABB, precision="f32", hidden=5, encoder=SMALL, backend="torch")
    back.load_state_dict(convert_state_dict(fused.state_dict(), back))
    for mine, theirs in zip(back.net.layers, linear.net.layers, strict=True):
        assert torch.equal(mine.weight, theirs.weight)


def test_fused_to_linear_conversion_can_drop_tcnns_input_bias():
    # tcnn's own initialisation fills the first matrix's padding columns (a bias on its
    # constant-1 inputs): refused by default, dropped when asked.
    fused = MLPTexture3D(AABB, precision="tcnn_fused", encoder=SMALL, backend="torch")
    linear = MLPTexture3D(AABB, precision="f32", encoder=SMALL, backend="torch")
    with pytest.raises(ValueError, match="^params: the first layer's padding columns"):
        convert_state_dict(fused.state_dict(), linear)
    state = convert_state_dict(fused.state_dict(), linear, drop_input_bias=True)
    linear.load_state_dict(state)
    w0, w1, w2 = fused.net.net.layer_weights()
    n_in = fused.encoder.n_output_dims  # 4 levels x 2 features = 8 inputs, 16 columns
    assert torch.equal(linear.net.layers[0].weight, w0[:, :n_in])
    assert torch.equal(linear.net.layers[1].weight, w1)
    assert torch.equal(linear.net.layers[2].weight, w2[:3])


def test_positions_of_any_float_dtype_sample_as_float32():
    # sample() takes any floating positions and computes in float32 (the encoder takes float32
    # only): float64 and float16 positions that are exactly float32 values give float32's result.
    texture = _texture()
    points = (_points() * 64).round() / 64  # multiples of 1/64: exact in float16 too
    expected = texture.sample(points)
    assert torch.equal(texture.sample(points.double()), expected)
    assert torch.equal(texture.sample(points.half()), expected)


# nvdiffrec: its MLP casts its input to the first layer's dtype before the gradient scaling
@pytest.mark.parametrize("arm", ["f32", "f16_dynamic", "bf16", "nvdiffrec"])
def test_a_float64_texture_samples_in_float64_end_to_end(arm):
    # .double() (a float64 reference, gradcheck): float64 positions, grid, linear layers
    # (whatever the arm's compute dtype, as the grid with a float64 table), sigmoid and output.
    # Cast midway to float32 (positions, MLP output) and computed in the arm's dtype, the
    # output was float64 in name only: 1e-8-sized errors, and gradcheck failed.
    torch.manual_seed(0)
    texture = MLPTexture3D(AABB, precision=arm, encoder=SMALL, backend="torch").double()
    with torch.no_grad():
        texture.encoder.params.uniform_(-1, 1)
    texc = _points(16).double()
    lo, hi = torch.tensor(AABB, dtype=torch.float64)
    hidden = texture.encoder(((texc - lo) / (hi - lo)).clamp(0, 1))
    layers = texture.net.layers
    for i, layer in enumerate(layers):
        hidden = torch.nn.functional.linear(hidden, layer.weight, layer.bias)
        hidden = hidden.relu() if i < len(layers) - 1 else hidden
    out = texture.sample(texc)
    assert out.dtype == torch.float64
    # float64's few roundings on values of order 1 (the grid's 8-corner sums, 3 layers)
    torch.testing.assert_close(out, torch.sigmoid(hidden), rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(texture.sample, (texc[:4].requires_grad_(),))
    # the float32 texture is unchanged: float32 whatever the positions' dtype
    assert _texture().sample(texc).dtype == torch.float32


# ----------------------------------------------------------------------------- fused network
def test_fused_network_config_defaults_are_tcnns():
    # tcnn's network.cu: n_neurons 128, n_hidden_layers 5, ReLU, no output activation.
    net = FullyFusedMLP(8, 3, {}, backend="torch")
    assert (net.width, net.n_hidden_layers) == (128, 5)
    assert net.network_config == {
        "otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
        "n_neurons": 128, "n_hidden_layers": 5,
    }  # fmt: skip
    # [128, 16], four [128, 128], [16, 128]
    assert net.layer_shapes() == [(128, 16)] + [(128, 128)] * 4 + [(16, 128)]
    assert net.n_params == 128 * 16 + 4 * 128 * 128 + 16 * 128


def test_megakernel_mlp_is_tcnns_name_for_the_fused_network():
    net = FullyFusedMLP(8, 3, {"otype": "MegakernelMLP", "n_neurons": 16}, backend="torch")
    assert net.network_config["otype"] == "FullyFusedMLP"
    other = FullyFusedMLP(8, 3, {"otype": "fullyfusedmlp", "n_neurons": 16}, backend="torch")
    assert torch.equal(net.params, other.params)


@pytest.mark.parametrize("name", ["n_input_dims", "n_output_dims"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_fused_network_sizes_must_be_positive_integers(name, value):
    sizes = {"n_input_dims": 8, "n_output_dims": 3, name: value}
    with pytest.raises(ValueError) as err:
        FullyFusedMLP(**sizes, network_config={"n_neurons": 16}, backend="torch")
    assert str(err.value) == f"{name}: expected a positive integer, got {value!r}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(backend="gpu"), "backend: expected 'auto', 'torch' or 'tcnn', got 'gpu'"),
        (dict(accumulate="fast"), "accumulate: expected one of ('half', 'float'), got 'fast'"),
        (dict(loss_scale=0), "loss_scale: expected a finite positive number, got 0"),
        (dict(loss_scale=-128.0), "loss_scale: expected a finite positive number, got -128.0"),
        (dict(loss_scale=True), "loss_scale: expected a finite positive number, got True"),
        (dict(loss_scale=math.nan), "loss_scale: expected a finite positive number, got nan"),
    ],
)  # fmt: skip
def test_fused_network_switches_are_checked(kwargs, message):
    with pytest.raises(ValueError) as err:
        FullyFusedMLP(8, 3, {"n_neurons": 16}, **{"backend": "torch", **kwargs})
    assert str(err.value) == message


def test_fused_network_input_must_be_a_float_matrix():
    net = FullyFusedMLP(8, 3, {"n_neurons": 16}, backend="torch")
    for x, message in (
        (torch.rand(2, 4, 8), "x: expected shape [N, 8], got [2, 4, 8]"),
        (torch.rand(8), "x: expected shape [N, 8], got [8]"),
        (torch.ones(4, 8).long(), "x: expected a floating-point tensor, got torch.int64"),
    ):
        with pytest.raises(ValueError) as err:
            net(x)
        assert str(err.value) == message


def _chain(n_in, n_out, width, n_hidden, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    dims = [n_in] + [width] * n_hidden + [n_out]
    return [torch.rand(dims[i + 1], dims[i], generator=gen).to(dtype) for i in range(len(dims) - 1)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_fused_params_are_float32_whatever_the_weights_dtype(dtype):
    weights = _chain(5, 3, 16, 1, dtype)
    params = fused_params_from_linear(weights)
    assert params.dtype == torch.float32 and params.shape == (16 * 16 + 16 * 16,)
    # Element by element: [16, 16] with 5 columns of w0, then [16, 16] with 3 rows of w1.
    assert params[2 * 16 + 4] == float(weights[0][2, 4]) and params[2 * 16 + 5] == 0
    assert params[256 + 2 * 16 + 15] == float(weights[1][2, 15]) and params[256 + 3 * 16] == 0


def test_linear_weights_from_fused_are_copies():
    params = fused_params_from_linear(_chain(5, 3, 16, 2))
    kept = params.clone()
    for weight in linear_weights_from_fused(params, 5, 3, 16, 2):
        weight.fill_(7.0)  # the caller's to edit: params must not change
    assert torch.equal(params, kept)


@pytest.mark.parametrize("split_k, expected", [(True, 2.0), (False, 1.0)])
def test_split_k_switch_reaches_the_fused_weight_gradient(split_k, expected):
    # Hand-computed, tcnn's model: identity activations, W0 = I / 8, inputs 1, so every hidden
    # value is 2^-3; the output gradient 2^-11 is scaled by the loss scale 128 to 2^-4. The last
    # layer's weight gradient sums 32768 products 2^-7 in a half accumulator (blocks of 8 add
    # 2^-4): one accumulator stops at 128 (2^-4 is then half an ulp: the tie keeps the even
    # 2048 blocks); split-K's 8 slices of 4096 reach 32 each, 8 x 32 = 256. Unscaled by 128:
    # 1.0 without split-K, the exact 32768 * 2^-14 = 2.0 with it.
    net = FullyFusedMLP(16, 1, {"n_neurons": 16, "n_hidden_layers": 1, "activation": "None"},
                        backend="torch", split_k=split_k)  # fmt: skip
    with torch.no_grad():
        w0, w1 = net.layer_weights()
        w0.copy_(torch.eye(16) / 8)
        w1.zero_()
    out = net(torch.ones(32768, 16))
    out.backward(torch.full_like(out, 2.0**-11))
    grad_w1 = net.params.grad[16 * 16 :].view(16, 16)
    assert torch.equal(grad_w1[0], torch.full((16,), expected))
    assert not grad_w1[1:].any()  # the padded output rows get no gradient


# ----------------------------------------------------------------------------- MLP layers
@pytest.mark.parametrize("dtype, bits", [(torch.float16, 10), (torch.bfloat16, 7)])
def test_reduced_linear_rounds_the_bias_to_the_gemm_dtype_first(dtype, bits):
    # A half (bfloat16) GEMM adds the bias as a half (bfloat16) operand. Hand-computed with
    # u = 2^-bits, one ulp at 1: the bias 1 + u/2 rounds (a tie, to even) to 1; the product
    # 1 * u/2 added to it is again a tie at 1, so the result is 1. Adding the unrounded bias
    # instead would give 1 + u exactly.
    u = 2.0**-bits
    x = torch.tensor([[1.0]])
    w = torch.tensor([[u / 2]])
    b = torch.tensor([1.0 + u / 2])
    out = reduced_linear(x, w, b, dtype)
    assert out.dtype == dtype and float(out) == 1.0
    # The general case against float64 of the rounded operands, rounded once.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 24, generator=gen)
    w, b = torch.randn(5, 24, generator=gen), torch.randn(5, generator=gen)
    exact = x.to(dtype).double() @ w.to(dtype).double().T + b.to(dtype).double()
    # f32 sums of 25 exact products differ from f64 by far less than half an ulp of dtype,
    # except next to a rounding boundary: all but a few outputs are the correctly rounded one.
    assert (reduced_linear(x, w, b, dtype) == exact.to(dtype)).double().mean() > 0.97


def test_quantized_layer_computes_in_its_compute_dtype():
    # Weights already on the int8 grid (per row: integers times a power-of-two scale, the
    # largest 127 of them), so fake quantisation leaves them as they are; the half GEMM is then
    # the float64 product of the half-rounded operands, rounded once to half.
    layer = QuantizedLinear(4, 2, bias=False, weight_quant="int8", compute_dtype=torch.float16)
    grid = torch.tensor([[127.0, -64.0, 3.0, 1.0], [-127.0, 5.0, 0.0, 100.0]])
    with torch.no_grad():
        layer.weight.copy_(grid * 2.0**-7)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    assert out.dtype == torch.float16
    exact = x.half().double() @ (grid * 2.0**-7).double().T
    # Four exact products summed in float32: off the float64 sum by at most 2 float32 ulps,
    # far below half a half ulp except at a rounding boundary; compare within one half ulp.
    torch.testing.assert_close(out.double(), exact.half().double(), rtol=2.0**-10, atol=2.0**-24)
    # Without a compute dtype the layer computes in float32.
    plain = QuantizedLinear(4, 2, bias=False, weight_quant="int8")
    with torch.no_grad():
        plain.weight.copy_(grid * 2.0**-7)
    assert plain(x).dtype == torch.float32
    torch.testing.assert_close(plain(x).double(), x.double() @ (grid * 2.0**-7).double().T,
                               rtol=1.3e-6, atol=1e-6)  # fmt: skip


def test_fp8_layer_rounds_the_output_gradient_to_e5m2():
    # First iteration of the delayed recipe: every scale is 1 (no amax recorded yet). The
    # output gradient 1.125 = 1 + 2^-3 lies midway between E5M2's neighbours 1 and 1.25 (two
    # mantissa bits): the tie rounds to the even 1.0 (E4M3, three bits, would keep 1.125);
    # 0.5 is exact. Weight 1, inputs 1: dL/dx = [1.0, 0.5], dL/dW = 1.0 + 0.5 = 1.5.
    layer = FP8Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    x = torch.ones(2, 1, requires_grad=True)
    out = layer(x)
    assert torch.equal(out, torch.ones(2, 1))
    out.backward(torch.tensor([[1.125], [0.5]]))
    assert x.grad.flatten().tolist() == [1.0, 0.5]
    assert layer.weight.grad.item() == 1.5


def test_fp8_layer_state_ignores_roles_it_does_not_keep():
    source = FP8Linear(3, 2, bias=False)
    source(torch.rand(5, 3)).sum().backward()  # records amaxes: no longer a fresh state
    state = source.get_extra_state()
    target = FP8Linear(3, 2, bias=False)
    target.set_extra_state({**state, "bias": state["input"]})  # a role this layer has not
    for role in FP8Linear.ROLES:
        kept, loaded = source.get_extra_state()[role], target.get_extra_state()[role]
        assert kept.keys() == loaded.keys()
        assert all(torch.equal(kept[k], loaded[k]) for k in kept), role


def test_mlp_weights_are_kaiming_uniform_for_relu():
    # kaiming_uniform_(nonlinearity="relu"): U(-b, b), b = gain * sqrt(3 / fan_in) with
    # gain sqrt(2), so b = sqrt(6 / fan_in) and the standard deviation b / sqrt(3) =
    # sqrt(2 / fan_in). 64 x 64 = 4096 draws: the largest |w| is within 1 % of b (the chance
    # that all 4096 miss the top 1 % is 0.99^4096 < 1e-17), the std within 5 %.
    torch.manual_seed(0)
    mlp = PrecisionMLP(64, 3, 1, 64, "f32")
    weight = mlp.layers[1].weight.detach().double()
    bound = math.sqrt(6 / 64)
    assert 0.99 * bound <= weight.abs().max() <= bound
    assert weight.std().item() == pytest.approx(math.sqrt(2 / 64), rel=0.05)


def test_fp8_gemm_backend_names_are_checked():
    with pytest.raises(ValueError) as err:
        PrecisionMLP(4, 3, 1, 16, "fp8", fp8_gemm="cublas")
    assert str(err.value).startswith("fp8_gemm: expected one of (")
    assert str(err.value).endswith("got 'cublas'")
    mlp = PrecisionMLP(4, 3, 1, 16, "fp8")
    with pytest.raises(ValueError) as err:
        mlp.set_fp8_gemm("cublas")
    assert str(err.value).startswith("fp8_gemm: expected one of (")
    mlp.set_fp8_gemm("emulated")
    assert all(layer.gemm_backend == "emulated" for layer in mlp.layers)
    assert mlp.fp8_gemm_backend() == "emulated"


def test_mlp_input_must_be_a_matrix():
    mlp = PrecisionMLP(4, 3, 1, 16, "f32")
    for x in (torch.rand(2, 5, 4), torch.rand(4)):
        with pytest.raises(ValueError) as err:
            mlp(x)
        assert str(err.value) == f"x: expected shape [N, 4], got {list(x.shape)}"


@pytest.mark.parametrize(
    "activation, expected",
    # Hand-computed, weights 1: out = act(-2) for x = -2 (torch's defaults: LeakyReLU's slope
    # 0.01, so -0.02; tanh(-2) = -0.9640275800758169; sigmoid(-2) = 1 / (1 + e^2)).
    [("ReLU", 0.0), ("LeakyReLU", -0.02), ("Tanh", math.tanh(-2.0)),
     ("Sigmoid", 1 / (1 + math.exp(2.0)))],
)  # fmt: skip
def test_hidden_activations_are_the_named_ones(activation, expected):
    mlp = PrecisionMLP(1, 1, 1, 1, "f32", activation=activation)
    with torch.no_grad():
        for layer in mlp.layers:
            layer.weight.fill_(1.0)
    out = mlp(torch.tensor([[-2.0]]))
    # float32 evaluation of one activation: within 2 float32 ulps of the float64 value.
    assert out.item() == pytest.approx(expected, rel=2.4e-7, abs=1e-30)


def test_rowwise_statistics_describe_the_input_and_the_weight_separately():
    # Row scales are fmax / row amax: the weight's rows both have amax 1 (spread log2(1) = 0),
    # the input's rows amax 1 and 1024 (spread log2(1024) = 10 binades).
    layer = QuantizedLinear(4, 2, bias=False, weight_quant="fp8_rowwise")
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -0.5, 0.25, 0.0], [-1.0, 0.5, 0.0, 0.75]]))
    layer.collect_stats = True
    layer(torch.tensor([[1.0, 0.5, -0.25, 0.125], [1024.0, -512.0, 3.0, 1.0]]))
    stats = layer.quant_statistics()
    assert float(stats["w_scale_spread"]) == 0.0
    assert float(stats["x_scale_spread"]) == 10.0


def test_fp8_layer_uses_the_recipe_it_is_given():
    # Current scaling, first iteration: the output gradient [1.125, 0.5] is scaled by
    # s = 57344 / 1.125 (E5M2's largest finite value over the amax): 1.125 s = 57344 is exact;
    # 0.5 s = 25486.2 lies in [16384, 32768), where E5M2's spacing is 4096, and rounds to
    # 24576, i.e. 24576 / s = 0.48214285... The delayed recipe's first scale, 1, would give
    # [1.0, 0.5] (the E5M2 test above).
    layer = FP8Linear(1, 1, bias=False, recipe=ScalingRecipe("current"))
    assert layer.recipe.recipe == "current"
    with torch.no_grad():
        layer.weight.fill_(1.0)
    x = torch.ones(2, 1, requires_grad=True)
    layer(x).backward(torch.tensor([[1.125], [0.5]]))
    # float32 scale and its inverse: within a few float32 ulps of the float64 values.
    expected = torch.tensor([1.125, 24576 * 1.125 / 57344], dtype=torch.float64)
    torch.testing.assert_close(x.grad.flatten().double(), expected, rtol=1e-6, atol=0)


def test_quantized_layer_repr_names_its_quantisation():
    layer = QuantizedLinear(4, 2, bias=False, weight_quant="int8")
    assert "weight_quant='int8'" in repr(layer)


# ----------------------------------------------------------------------------- hash grid
def test_tcnn_config_defaults_are_tcnns():
    # tcnn's grid.h: n_levels 16, n_features_per_level 2, base_resolution 16, per_level_scale
    # 2, interpolation Linear, type Hash for "HashGrid" (and a config without otype).
    for config in ({"otype": "HashGrid", "log2_hashmap_size": 8}, {"log2_hashmap_size": 8}):
        enc = HashGridEncoding.from_tcnn_config(3, config)
        assert enc.config == {
            "n_levels": 16, "n_features_per_level": 2, "log2_hashmap_size": 8,
            "base_resolution": 16, "per_level_scale": 2.0, "interpolation": "Linear",
            "type": "Hash",
        }  # fmt: skip
    # log2_hashmap_size: 19 (one coarse level keeps the table small).
    one = HashGridEncoding.from_tcnn_config(3, {"n_levels": 1, "base_resolution": 4})
    assert one.config["log2_hashmap_size"] == 19


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_input_dims=1), "n_input_dims must be an integer >= 2 and <= 4, got 1"),
        (dict(n_levels=33), "n_levels must be an integer >= 1 and <= 32, got 33"),
        (dict(log2_hashmap_size=31), "log2_hashmap_size must be an integer >= 1 and <= 30, got 31"),
        (dict(base_resolution=0), "base_resolution must be an integer >= 1 and <= 16777216, got 0"),
        (dict(per_level_scale=0.75), "per_level_scale must be a finite number >= 1, got 0.75"),
        (dict(per_level_scale=True), "per_level_scale must be a finite number >= 1, got True"),
    ],
)  # fmt: skip
def test_grid_sizes_out_of_range_name_themselves(kwargs, message):
    with pytest.raises(ValueError) as err:
        HashGridEncoding(**{"n_input_dims": 3, "n_levels": 1, "log2_hashmap_size": 4, **kwargs})
    assert str(err.value) == message


def test_grid_sizes_at_their_limits_are_accepted():
    # One level of resolution 2 (base 1, scale 1: level scale 0): tiny tables whatever the
    # hash size; 32 levels; a 2-D grid.
    small = dict(n_levels=1, base_resolution=1, per_level_scale=1.0)
    assert HashGridEncoding(3, **small, log2_hashmap_size=30).n_params > 0
    assert HashGridEncoding(2, **small, log2_hashmap_size=4).n_output_dims == 2
    assert HashGridEncoding(3, **{**small, "n_levels": 32}, log2_hashmap_size=4).n_output_dims == 64


def test_the_finest_resolution_may_reach_but_not_pass_2_to_the_24():
    # base 2^20, scale 2: the finest of n levels is 2^(20 + n - 1): 2^24 at n = 5, 2^25 at 6.
    at_limit = HashGridEncoding(3, n_levels=5, base_resolution=2**20, per_level_scale=2.0,
                                log2_hashmap_size=4)  # fmt: skip
    assert at_limit.n_output_dims == 10
    with pytest.raises(ValueError, match=r"^per_level_scale must keep the finest resolution"):
        HashGridEncoding(3, n_levels=6, base_resolution=2**20, per_level_scale=2.0,
                         log2_hashmap_size=4)  # fmt: skip


def test_positions_up_to_the_float32_limit_are_accepted():
    # Level scale base * 1 - 1 = 1 (base 2): the limit is 2^24 / 1; 2^24 itself is encoded,
    # the next float32 above it is refused.
    enc = HashGridEncoding(3, n_levels=1, base_resolution=2, per_level_scale=1.0,
                           log2_hashmap_size=4)  # fmt: skip
    assert torch.isfinite(enc(torch.full((1, 3), 2.0**24))).all()
    with pytest.raises(ValueError, match=r"^x must lie within \|x\| <= 1\.678e\+07"):
        enc(torch.full((1, 3), 2.0**24 * (1 + 2.0**-23)))
    # A level scale of 0 (base 1): every position maps to the same corner; no limit applies.
    flat = HashGridEncoding(3, n_levels=1, base_resolution=1, per_level_scale=1.0,
                            log2_hashmap_size=4)  # fmt: skip
    assert flat(torch.full((2, 3), 1e6)).shape == (2, 2)


def test_unchecked_values_leave_a_nan_position_to_its_own_row():
    # check_values=False skips the finiteness check: the NaN row gives NaN, the others their
    # values (sample(check=False) relies on it).
    enc = HashGridEncoding(3, n_levels=2, base_resolution=4, log2_hashmap_size=8)
    x = torch.rand(4, 3, generator=torch.Generator().manual_seed(0))
    checked = enc(x)
    x[1, 1] = math.nan
    out = enc(x, check_values=False)
    assert out[1].isnan().all()
    assert torch.equal(out[[0, 2, 3]], checked[[0, 2, 3]])
    texture = _texture()
    texc = _points(4)
    texc[2, 0] = math.nan
    values = texture.sample(texc, check=False)
    assert values[2].isnan().all() and not values[[0, 1, 3]].isnan().any()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"fixed_point_pos": 0}, "encoding_config.fixed_point_pos: mptex implements tcnn's "
                                 "default False only, got 0"),
        ({"stochastic_interpolation": "false"}, "encoding_config.stochastic_interpolation: "
                                                "mptex implements tcnn's default False only, "
                                                "got 'false'"),
        ({"per_level_scale": True}, "encoding_config.per_level_scale: expected a number, got "
                                    "True"),
    ],
)  # fmt: skip
def test_tcnn_config_values_of_the_wrong_type_are_refused(config, message):
    with pytest.raises(ValueError) as err:
        HashGridEncoding(3, {"n_levels": 2, "log2_hashmap_size": 8, **config})
    assert str(err.value) == message


def test_a_grid_too_large_for_memory_is_refused_before_it_is_built(monkeypatch):
    from mptex import _backends

    monkeypatch.setattr(_backends, "available_bytes", lambda device: 1000)
    with pytest.raises(ValueError) as err:
        HashGridEncoding(3, n_levels=4, log2_hashmap_size=12, base_resolution=16)
    # 4 levels x up to 2^12 entries x 2 features x 4 bytes x 2 (table + initial draw).
    assert str(err.value).startswith(
        "log2_hashmap_size: 4 levels of up to 2**12 entries x 2 features need 0.0 GiB to build, "
        "only 0.0 GiB is available on cpu"
    )


def test_a_bfloat16_grid_is_refused_on_tcnn_before_tcnn_is_looked_for():
    # tcnn has no bfloat16 grid: the argument error comes first, with or without tinycudann.
    with pytest.raises(ValueError) as err:
        HashGridEncoding(3, n_levels=1, log2_hashmap_size=4, dtype=torch.bfloat16, backend="tcnn")
    assert str(err.value) == (
        "dtype: tcnn has no bfloat16 grid; torch.bfloat16 runs on backend 'torch', 'triton' or "
        "'auto', got backend 'tcnn'"
    )


def test_a_float64_grid_encodes_in_float64():
    enc = HashGridEncoding(3, n_levels=2, base_resolution=4, log2_hashmap_size=8, seed=0)
    with torch.no_grad():
        enc.params.uniform_(-1, 1)
    x = torch.rand(32, 3, generator=torch.Generator().manual_seed(0))
    single = enc(x)
    enc.double()  # (for gradcheck) float64 params, float64 positions, float64 output
    double = enc(x.double())
    assert double.dtype == torch.float64
    # The same interpolation of the same float32 values: float32's few roundings (weights,
    # products, a sum of 8 corners of |value| <= 1) stay below 1e-6 absolute.
    torch.testing.assert_close(double, single.double(), rtol=0, atol=1e-6)
    assert torch.autograd.gradcheck(lambda p: enc(p), (x.double()[:4].requires_grad_(),))


def test_a_dense_grids_left_out_type_and_scale_follow_its_otype():
    # tcnn's dense-grid default scale reaches resolution 256 from the base:
    # float32 exp(log(256 / 16) / (2 - 1)) = 16; a hash grid's is 2.
    dense = check_texture_config({"encoder": {"otype": "DenseGrid", "n_levels": 2}})["encoder"]
    assert (dense["type"], dense["per_level_scale"]) == ("Dense", 16.0)
    built = MLPTexture3D(torch.tensor([[0.0] * 3, [1.0] * 3]), encoder=dense)
    raw = MLPTexture3D(
        torch.tensor([[0.0] * 3, [1.0] * 3]), encoder={"otype": "DenseGrid", "n_levels": 2}
    )
    assert built.encoder.config == raw.encoder.config
    # given values stay as given
    given = {"otype": "HashGrid", "type": "Hash", "per_level_scale": 1.5}
    assert check_texture_config({"encoder": given})["encoder"]["per_level_scale"] == 1.5
    # a dense grid of one level has no default scale (the constructor says so): left out
    one = check_texture_config({"encoder": {"otype": "DenseGrid", "n_levels": 1}})["encoder"]
    assert "per_level_scale" not in one and "type" not in one
