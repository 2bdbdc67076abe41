"""MLPTexture3D: nvdiffrec's constructor and sample(), per-arm forward/gradients, nvdiffrec
equivalence (against a copy of its module), state dicts across backends, and a small fit per arm."""

import copy
import math
from pathlib import Path

import fused_mlp_reference as ref
import numpy as np
import pytest
import torch
from conftest import TOL
from fp8_reference import seen_input, seen_weight

from mptex import MLPTexture3D, PrecisionPolicy, PrecisionStepper, convert_state_dict
from mptex.encoding import HashGridEncoding
from mptex.texture import NVDIFFREC_ENCODER_CONFIG

CPU_ARMS = [n for n in PrecisionPolicy.names() if PrecisionPolicy.named(n).mlp == "linear"]
# FP8 arms: forward tested with an independent quantiser in tests/test_fp8.py (their activation
# scales come from the batch).
DTYPE_ARMS = [n for n in CPU_ARMS if not PrecisionPolicy.named(n).fp8_gemm]
SMALL = {
    "otype": "HashGrid", "n_levels": 4, "n_features_per_level": 2, "log2_hashmap_size": 12,
    "base_resolution": 4, "per_level_scale": 2.0,
}  # fmt: skip
AABB = [[-1.0, -2.0, 0.0], [3.0, 2.0, 1.0]]


def _texture(arm, seed=0, encoder=SMALL, **kw):
    torch.manual_seed(seed)
    texture = MLPTexture3D(AABB, precision=arm, encoder=encoder, backend="torch", **kw)
    with torch.no_grad():  # a trained-looking table: features of order 1, not tcnn's 1e-4 init
        texture.encoder.params.uniform_(-1, 1)
    return texture


def _points(n=1000, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = torch.tensor(AABB[0]), torch.tensor(AABB[1])
    return lo + (hi - lo) * torch.rand(n, 3, generator=gen)


def _lowest_dtype(policy):
    return max([policy.encoder_dtype, *policy.mlp_dtypes], key=lambda d: torch.finfo(d).eps)


def test_nvdiffrec_defaults_and_attributes():
    texture = MLPTexture3D(AABB, backend="torch")
    assert texture.policy.name == "nvdiffrec" and texture.channels == 3
    assert texture.internal_dims == 32 and len(texture.net.layers) == 3
    assert texture.encoder.dtype == torch.float16 and texture.encoder.n_output_dims == 32
    expected = HashGridEncoding.from_tcnn_config(3, NVDIFFREC_ENCODER_CONFIG, backend="torch")
    assert texture.encoder.n_params == expected.n_params
    assert NVDIFFREC_ENCODER_CONFIG["per_level_scale"] == pytest.approx(1.447269237440378)
    assert texture.encoder.params.dtype == torch.float32 and texture.encoder.params.requires_grad
    assert all(isinstance(layer, torch.nn.Linear) for layer in texture.net.layers)
    # nvdiffrec's keys: its checkpoints load here, and ours in nvdiffrec.
    assert list(texture.state_dict()) == [
        "encoder.params", "net.net.0.weight", "net.net.2.weight", "net.net.4.weight",
    ]  # fmt: skip


def test_sample_shapes_range_and_aabb_clamp():
    min_max = [[0.0, -1.0, 0.5, 0, 0, 0, -1, -1, -1], [1.0, 1.0, 0.6, 1, 1, 1, 1, 1, 1]]
    texture = _texture("f32", channels=9, min_max=min_max)
    texc = _points(2 * 5 * 7).view(2, 5, 7, 3)
    out = texture.sample(texc)
    assert out.shape == (2, 5, 7, 9) and out.dtype == torch.float32
    lo, hi = torch.tensor(min_max[0]), torch.tensor(min_max[1])
    assert torch.all(out >= lo) and torch.all(out <= hi)
    assert torch.equal(texture(texc), out)
    # Outside the box, positions clamp to its faces (nvdiffrec's clamp of the normalised coords).
    outside = torch.tensor([[-5.0, 0.0, 0.5], [9.0, 9.0, 9.0]])
    clamped = torch.tensor([[-1.0, 0.0, 0.5], [3.0, 2.0, 1.0]])
    assert torch.equal(texture.sample(outside), texture.sample(clamped))
    default = _texture("f32")  # min_max None: plain sigmoid in [0, 1]
    assert torch.equal(default.min_max, torch.tensor([[0.0] * 3, [1.0] * 3]))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="AABB"):
        MLPTexture3D([[0, 0], [1, 1]], encoder=SMALL)
    with pytest.raises(ValueError, match="min_max"):
        MLPTexture3D(AABB, channels=3, min_max=[[0] * 4, [1] * 4], encoder=SMALL)
    with pytest.raises(ValueError, match="channels"):
        MLPTexture3D(AABB, channels=0, encoder=SMALL)
    with pytest.raises(ValueError, match="encoder"):
        MLPTexture3D(AABB, encoder=HashGridEncoding(2, n_levels=2, log2_hashmap_size=8))
    with pytest.raises(ValueError, match="name"):
        MLPTexture3D(AABB, precision="f12", encoder=SMALL)
    with pytest.raises(ValueError, match="texc"):
        _texture("f32").sample(torch.zeros(4, 2))
    # The caller's argument names, not the MLP's; no bool counts as a size.
    for kwargs, message in (
        ({"internal_dims": 0}, "internal_dims: expected a positive integer, got 0"),
        ({"hidden": True}, "hidden: expected a positive integer, got True"),
        ({"min_max": [[0, 0, 0], [1, -1, 1]]}, "min_max: expected min <= max for every "
                                               "channel, got [[0.0, 0.0, 0.0], [1.0, -1.0, 1.0]]"),
        ({"AABB": [[0, 0, 0], [1, 0, 1]]}, "AABB: expected min < max on every axis, "
                                           "got [[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]"),
    ):  # fmt: skip
        with pytest.raises(ValueError) as err:
            MLPTexture3D(**{"AABB": AABB, "encoder": SMALL, **kwargs})
        assert str(err.value) == message
    with pytest.raises(ValueError) as err:  # not silently ignored
        MLPTexture3D(AABB, encoder=HashGridEncoding.from_tcnn_config(3, SMALL), backend="nope")
    assert str(err.value) == "backend: a ready encoder keeps its own backend ('auto'); got 'nope'"
    with pytest.raises(ValueError) as err:
        MLPTexture3D(AABB, encoder={**SMALL, "n_levels": 2.5})
    assert str(err.value) == "encoder.n_levels: expected a whole number, got 2.5"
    with pytest.warns(UserWarning, match=r"^encoder: ignoring 'n_level' \(did you mean") as seen:
        MLPTexture3D(AABB, encoder={**SMALL, "n_level": 3})
    assert seen[0].filename == __file__  # the caller's line
    texture = _texture("f32")
    with pytest.raises(ValueError) as err:  # one line: the dtype, not the tensor's values
        texture.sample(torch.zeros(40, 3, dtype=torch.int64))
    assert str(err.value) == (
        "texc: expected a floating-point torch.Tensor [..., 3], got a torch.int64 tensor"
    )
    with pytest.raises(ValueError) as err:  # before any arithmetic mixes the devices
        texture.sample(torch.zeros(4, 3, device="meta"))
    assert str(err.value) == "texc: is on meta but the texture is on cpu"


def _bound_forms(lo, hi):
    """The same [min, max] bounds in every form a caller may hold them."""
    lo64, hi64 = torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64)
    return {
        "lists": [lo, hi],
        "tuple of tensors": (lo64.float(), hi64.float()),
        "tuple of float64 tensors": (lo64, hi64),
        "stacked tensor": torch.stack([lo64, hi64]),
        "numpy array": np.array([lo, hi]),
        "tuple of numpy rows": (np.array(lo), np.array(hi, dtype=np.float32)),
        "rows of 0-d tensors": [[torch.tensor(v) for v in lo], [torch.tensor(v) for v in hi]],
    }


@pytest.mark.parametrize("form", list(_bound_forms(*AABB)))
def test_bounds_are_converted_the_same_way_in_every_form(form):
    min_max = [[0.0, -1.0, 0.5], [1.0, 1.0, 0.75]]
    texture = MLPTexture3D(_bound_forms(*AABB)[form], min_max=_bound_forms(*min_max)[form],
                           encoder=SMALL, backend="torch")  # fmt: skip
    for buffer, expected in ((texture.AABB, AABB), (texture.min_max, min_max)):
        assert buffer.dtype == torch.float32 and not buffer.requires_grad
        assert buffer.grad_fn is None and buffer.device == texture.encoder.params.device
        assert torch.equal(buffer, torch.tensor(expected))


@pytest.mark.requires_cuda
def test_bounds_on_another_device_than_a_ready_encoder_move_to_the_textures():
    # An AABB of tensors places the texture (tests/test_nvdiffrec_dropin.py); a ready encoder
    # is used as given, so the texture joins the encoder and the bounds move there.
    aabb = (torch.tensor(AABB[0], device="cuda"), torch.tensor(AABB[1], device="cuda"))
    encoder = HashGridEncoding.from_tcnn_config(3, SMALL, backend="torch")
    texture = MLPTexture3D(aabb, min_max=[[0.0] * 3, [1.0] * 3], encoder=encoder)
    assert texture.AABB.device == texture.encoder.params.device == torch.device("cpu")
    assert texture.min_max.device == texture.net.layers[0].weight.device == torch.device("cpu")
    assert texture.cuda().AABB.device.type == "cuda"


def test_numpy_integers_are_sizes_and_seeds_and_become_python_ints():
    # A size or seed from np.arange or an array is an integer (stored as a Python int: JSON,
    # Hydra and tinycudann's config take it); a bool or a whole float still is not.
    import json

    from mptex.network import FullyFusedMLP
    from mptex.train.monitor import PrecisionMonitor

    texture = MLPTexture3D(AABB, channels=np.int64(3), internal_dims=np.int32(16),
                           hidden=np.int64(2), encoder=SMALL)  # fmt: skip
    assert type(texture.channels) is int and type(texture.internal_dims) is int
    assert texture.sample(torch.rand(4, 3)).shape == (4, 3)
    grid = HashGridEncoding(np.int64(3), n_levels=np.int64(2), n_features_per_level=np.int64(2),
                            log2_hashmap_size=np.int64(8), seed=np.uint8(7))  # fmt: skip
    assert grid.n_output_dims == 4 and type(grid.n_output_dims) is int
    net = FullyFusedMLP(np.int64(4), np.int64(3),
                        {"n_neurons": np.int64(16), "n_hidden_layers": np.int64(1)},
                        seed=np.int64(5))  # fmt: skip
    assert json.loads(json.dumps(net.network_config))["n_hidden_layers"] == 1
    assert type(net.seed) is int
    assert PrecisionMonitor(texture, every=np.int64(10)).every == 10
    with pytest.raises(ValueError, match="network_config.n_neurons"):  # 64.0 is no width
        FullyFusedMLP(4, 3, {"n_neurons": 64.0})
    for bad in (True, np.bool_(True), 16.0):
        with pytest.raises(ValueError, match="internal_dims: expected a positive integer"):
            MLPTexture3D(AABB, internal_dims=bad, encoder=SMALL)


def test_aabb_of_a_vertex_parameter_does_not_train_the_vertices():
    # nvdiffrec's DLMesh holds v_pos as a Parameter and its mesh.aabb() is a (min, max) tuple
    # computed from it: the texture must take the values, not the autograd graph.
    gen = torch.Generator().manual_seed(0)
    v_pos = torch.nn.Parameter(torch.rand(50, 3, generator=gen) * 2 - 1)
    texture = MLPTexture3D((v_pos.min(dim=0).values, v_pos.max(dim=0).values),
                           precision="f16_dynamic", encoder=SMALL, backend="torch")  # fmt: skip
    opt = torch.optim.Adam(texture.parameters(), lr=1e-2)
    stepper = texture.policy.stepper(opt)
    points = v_pos.detach()  # the only path from the loss to v_pos would be the AABB
    for _ in range(2):  # a graph kept in the AABB fails here at the second backward
        opt.zero_grad()
        stepper(texture.sample(points).square().mean())
    assert v_pos.grad is None
    twin = copy.deepcopy(texture)
    assert torch.equal(twin.sample(points), texture.sample(points))


def test_explicit_tcnn_mlp_fails_at_construction_without_tcnn():
    explicit = {"name": "tcnn_fused", "mlp_backend": "tcnn"}
    if PrecisionPolicy.from_config(explicit).availability()[0]:
        pytest.skip("tinycudann and CUDA are present")
    with pytest.raises(RuntimeError, match="tinycudann"):
        MLPTexture3D(AABB, precision=explicit, encoder=SMALL)


@pytest.mark.parametrize("arm", ["fp8", "fp8_rowwise"])
def test_fp8_arms_record_whether_their_gemms_ran_on_tensor_cores(monkeypatch, arm):
    # On a CPU the emulation; where torch._scaled_mm can run the recipe's GEMMs (patched here:
    # per tensor from compute capability 8.9, row-wise with a float32 result on 9.x and CUDA
    # 12.9+), scaled_mm. Arms without FP8 layers record no such key.
    import mptex.fp8

    assert "fp8_gemm" not in MLPTexture3D(AABB, precision="f32", encoder=SMALL).backends()
    texture = MLPTexture3D(AABB, precision=arm, encoder=SMALL)
    assert texture.backends() == {"encoder": "torch", "mlp": "torch", "fp8_gemm": "emulated"}
    monkeypatch.setattr(mptex.fp8, "has_fp8_tensor_cores",
                        lambda device, rowwise=False: not rowwise)  # fmt: skip
    expected = "emulated" if arm == "fp8_rowwise" else "scaled_mm"
    assert texture.backends()["fp8_gemm"] == expected


def test_tcnn_fused_runs_on_the_twin_and_records_its_backends():
    texture = MLPTexture3D(AABB, precision="tcnn_fused", encoder=SMALL, backend="torch")
    assert texture.backends() == {"encoder": "torch", "mlp": "torch"}
    points = torch.rand(500, 3)
    out = texture.sample(points)
    assert out.dtype == torch.float32 and out.shape == (500, 3)
    out.mean().backward()
    assert texture.net.net.params.grad.abs().sum() > 0
    assert texture.encoder.params.grad.abs().sum() > 0


def test_swap154_keeps_only_the_encoder_hook():
    # #154: the /128 on the positions' gradient stays, nothing multiplies the grid's gradient.
    grads = {}
    for arm in ("tcnn_fused", "tcnn_fused_swap154"):
        torch.manual_seed(0)
        texture = MLPTexture3D(AABB, precision=arm, encoder=SMALL, backend="torch")
        points = torch.rand(300, 3, generator=torch.Generator().manual_seed(1))
        points.requires_grad_(True)
        texture.sample(points).mean().backward()
        grads[arm] = (points.grad.clone(), texture.encoder.params.grad.clone())
    torch.testing.assert_close(grads["tcnn_fused_swap154"][0], grads["tcnn_fused"][0] / 128)
    assert torch.equal(grads["tcnn_fused_swap154"][1], grads["tcnn_fused"][1])


def test_encoder_instance_and_hydra_style_configs_are_accepted():
    from omegaconf import OmegaConf

    encoder = HashGridEncoding(3, n_levels=2, log2_hashmap_size=8, base_resolution=4)
    assert MLPTexture3D(AABB, precision="f32", encoder=encoder).encoder is encoder
    cfg = OmegaConf.create(
        {"precision": {"name": "f16_dynamic", "growth_interval": 5}, "enc": SMALL}
    )
    texture = MLPTexture3D(AABB, precision=cfg.precision, encoder=cfg.enc, backend="torch")
    assert texture.policy.growth_interval == 5 and texture.encoder.n_output_dims == 8


def _reference_f64(texture, texc):
    """f64 sample() with the same parameters; encoder features from an f32 twin of the encoder.
    Also returns the magnitude bound |W_L|...|W_1||features| of the MLP's output."""
    enc32 = HashGridEncoding.from_tcnn_config(3, SMALL, backend="torch")
    enc32.load_state_dict(texture.encoder.state_dict())
    lo, hi = texture.AABB.double()
    unit = ((texc.double() - lo) / (hi - lo)).clamp(0, 1)
    with torch.no_grad():
        h = enc32(unit.float()).double()
    bound = h.abs()
    for i, layer in enumerate(texture.net.layers):
        weight = seen_weight(layer, texture.policy)
        h = seen_input(h, texture.policy) @ weight.T
        bound = bound @ weight.abs().T
        h = h.relu() if i < len(texture.net.layers) - 1 else h
    mm = texture.min_max.double()
    return torch.sigmoid(h) * (mm[1] - mm[0]) + mm[0], bound


@pytest.mark.parametrize("arm", DTYPE_ARMS)
def test_forward_matches_f64_reference(arm):
    texture = _texture(arm)
    texc = _points()
    with torch.no_grad():
        out = texture.sample(texc)
    ref, bound = _reference_f64(texture, texc)
    tol = TOL[_lowest_dtype(texture.policy)]
    # sigmoid is 1/4-Lipschitz; the MLP's error is bounded relative to |W||x| (cancellation in
    # the sums makes |out|-relative tolerances meaningless); an f16 encoder adds its own output
    # rounding (~eps * |features|), which the same bound covers. The f32 arm also differs from
    # the f64 encoder features by f32 rounding only, covered by TOL's atol.
    err = (out.double() - ref).abs()
    assert torch.all(err <= 0.25 * (tol["rtol"] * bound + tol["atol"])), (arm, err.max())


@pytest.mark.parametrize("arm", CPU_ARMS)
def test_gradients_reach_every_parameter(arm):
    texture = _texture(arm)
    optimizer = torch.optim.Adam(texture.parameters(), lr=1e-2)
    stepper = PrecisionStepper(texture.policy, optimizer)
    texc = _points(512).requires_grad_()
    stepper.backward(texture.sample(texc).square().mean())
    stepper.unscale_()
    named = dict(texture.named_parameters())
    assert set(named) == {
        "encoder.params",
        "net.net.0.weight",
        "net.net.2.weight",
        "net.net.4.weight",
    }
    for name, param in named.items():
        assert param.grad is not None and param.grad.dtype == param.dtype, (arm, name)
        assert torch.isfinite(param.grad).all() and torch.count_nonzero(param.grad) > 0, (arm, name)
    assert texc.grad is not None and torch.isfinite(texc.grad).all()


@pytest.mark.parametrize("arm", PrecisionPolicy.names())
def test_an_empty_batch_trains_through_every_arm(arm):
    # A batch whose views cover no pixel reaches the texture as [0, 3] points: an empty
    # output, and a backward and a step with zero gradients (no reduction of an empty tensor
    # may raise on the way, e.g. a row-wise FP8 layer's statistics).
    texture = _texture(arm)
    optimizer = torch.optim.Adam(texture.parameters(), lr=1e-2)
    stepper = PrecisionStepper(texture.policy, optimizer)
    out = texture.sample(torch.empty(0, 3, requires_grad=True))
    assert out.shape == (0, 3)
    stepper.backward(out.square().sum())
    stepper.unscale_()
    for name, param in texture.named_parameters():
        assert param.grad is None or not torch.count_nonzero(param.grad), (arm, name)


def test_positions_without_grad_do_not_crash():
    texture = _texture("nvdiffrec")
    texture.sample(_points(64)).sum().backward()  # nvdiffrec's hook would divide None by 128
    assert texture.encoder.params.grad is not None


class _NvdiffrecMLP(torch.nn.Module):
    """nvdiffrec's ``_MLP`` (render/mlptexture.py), rewritten from its published description:
    bias-free Linear+ReLU stack, Kaiming-uniform init, input cast to f32, and a full backward hook
    on the Sequential multiplying the input gradient by ``loss_scale``."""

    def __init__(self, n_input_dims, n_output_dims, n_hidden_layers, n_neurons, loss_scale):
        super().__init__()
        modules = [torch.nn.Linear(n_input_dims, n_neurons, bias=False), torch.nn.ReLU()]
        for _ in range(n_hidden_layers - 1):
            modules += [torch.nn.Linear(n_neurons, n_neurons, bias=False), torch.nn.ReLU()]
        modules.append(torch.nn.Linear(n_neurons, n_output_dims, bias=False))
        self.net = torch.nn.Sequential(*modules)
        for m in self.net:
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.kaiming_uniform_(m.weight, nonlinearity="relu")
        self.net.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * loss_scale,))

    def forward(self, x):
        return self.net(x.to(torch.float32))


class _NvdiffrecTexture(torch.nn.Module):
    """nvdiffrec's ``MLPTexture3D`` with our torch HashGridEncoding in half mode in place of
    ``tcnn.Encoding`` (same dtype contract), and its encoder hook dividing the input grad by 128."""

    def __init__(self, AABB, channels, internal_dims, hidden, min_max, enc_cfg):
        super().__init__()
        self.AABB, self.min_max, self.channels = AABB, min_max, channels
        self.encoder = HashGridEncoding.from_tcnn_config(
            3, enc_cfg, backend="torch", dtype=torch.float16
        )
        self.encoder.register_full_backward_hook(lambda mod, gin, gout: (gin[0] / 128.0,))
        self.net = _NvdiffrecMLP(self.encoder.n_output_dims, channels, hidden, internal_dims, 128.0)

    def sample(self, texc):
        t = (texc.view(-1, 3) - self.AABB[0][None, ...]) / (
            self.AABB[1][None, ...] - self.AABB[0][None, ...]
        )
        t = torch.clamp(t, min=0, max=1)
        out = self.net.forward(self.encoder(t.contiguous()))
        out = (
            torch.sigmoid(out) * (self.min_max[1][None, :] - self.min_max[0][None, :])
            + self.min_max[0][None, :]
        )
        return out.view(*texc.shape[:-1], self.channels)


def test_nvdiffrec_equivalence_outputs_and_gradients():
    aabb = torch.tensor(AABB)
    min_max = torch.tensor([[0.0, 0.2, -1.0], [1.0, 0.8, 1.0]])
    theirs = _NvdiffrecTexture(aabb, 3, 32, 2, min_max, SMALL)
    with torch.no_grad():
        theirs.encoder.params.uniform_(-1, 1)
    ours = MLPTexture3D(
        aabb, 3, 32, 2, min_max, precision="nvdiffrec", encoder=SMALL, backend="torch"
    )
    ours.load_state_dict(theirs.state_dict())  # same keys, nvdiffrec's

    texc = _points(777).view(7, 111, 3)
    cotangent = torch.randn(7, 111, 3, generator=torch.Generator().manual_seed(5))
    results = []
    for module in (theirs, ours):
        module.zero_grad()
        positions = texc.clone().requires_grad_()
        out = module.sample(positions)
        (out * cotangent).sum().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        results.append((out.detach(), positions.grad, grads))
    (out_t, pos_t, grads_t), (out_o, pos_o, grads_o) = results
    assert torch.equal(out_o, out_t)
    assert torch.equal(pos_o, pos_t)
    assert len(grads_o) == len(grads_t) == 4
    for g_o, g_t in zip(grads_o, grads_t, strict=True):
        assert torch.equal(g_o, g_t)
    # nvdiffrec's recipe leaves the table's gradient x128 (Adam does not care): check we kept it.
    f32 = MLPTexture3D(aabb, 3, 32, 2, min_max, precision="f32", encoder=SMALL, backend="torch")
    f32.load_state_dict(theirs.state_dict())
    (f32.sample(texc) * cotangent).sum().backward()
    ratio = grads_o[0].norm() / f32.encoder.params.grad.norm()
    assert ratio.item() == pytest.approx(128.0, rel=1e-2)


def test_nvdiffrec_checkpoint_loads_into_the_fused_layout():
    aabb = torch.tensor(AABB)
    min_max = torch.tensor([[0.0, 0.2, -1.0], [1.0, 0.8, 1.0]])
    theirs = _NvdiffrecTexture(aabb, 3, 32, 2, min_max, SMALL)  # 8 features: padded to 16
    with torch.no_grad():
        theirs.encoder.params.uniform_(-1, 1)
    checkpoint = theirs.state_dict()
    fused = MLPTexture3D(aabb, 3, 32, 2, min_max, precision="tcnn_fused", encoder=SMALL,
                         backend="torch")  # fmt: skip
    assert list(fused.state_dict()) == ["encoder.params", "net.net.params"]
    converted = convert_state_dict(checkpoint, fused)
    fused.load_state_dict(converted, strict=True)
    assert torch.equal(fused.encoder.params, checkpoint["encoder.params"])

    texc = _points(500)
    with torch.no_grad():
        expected = theirs.sample(texc)
        got = fused.sample(texc)
        unit = ((texc - aabb[0]) / (aabb[1] - aabb[0])).clamp(0, 1)
        features = theirs.encoder(unit).float()  # the same half features feed both networks
    # The MLP output differs by the fused network's half arithmetic, at most the model's
    # first-order rounding bound (fused_mlp_reference.forward_error_bound; the f32 MLP's own
    # error is 2^13 times smaller); the sigmoid's slope is at most 1/4, times the output range.
    weights = [checkpoint[f"net.net.{i}.weight"].numpy() for i in (0, 2, 4)]
    bound = torch.from_numpy(ref.forward_error_bound(weights, features.numpy()))
    bound = bound.float() * (min_max[1] - min_max[0]) / 4
    assert bool(((got - expected).abs() <= bound).all())
    assert not torch.equal(got, expected)  # two arithmetics, as the bound says


def test_state_dict_layouts_round_trip():
    linear = _texture("f32")
    fused = MLPTexture3D(AABB, precision="tcnn_fused", encoder=SMALL, backend="torch")
    fused.load_state_dict(convert_state_dict(linear.state_dict(), fused))
    back = MLPTexture3D(AABB, precision="nvdiffrec", encoder=SMALL, backend="torch")
    restored = convert_state_dict(fused.state_dict(), back)
    assert list(restored) == list(linear.state_dict())
    for key, value in linear.state_dict().items():
        assert torch.equal(restored[key], value), key
    same = convert_state_dict(linear.state_dict(), back)  # one layout: a copy
    assert same.keys() == linear.state_dict().keys()
    # tcnn's own init fills the padding columns (a bias nvdiffrec's _MLP has not).
    with pytest.raises(ValueError, match="^params: the first layer's padding"):
        convert_state_dict(MLPTexture3D(AABB, precision="tcnn_fused", encoder=SMALL).state_dict(),
                           back)  # fmt: skip


@pytest.mark.parametrize("arm", ["fp8", "fp8_current"])
def test_fp8_scaling_state_is_filled_in_or_dropped(arm):
    # An nvdiffrec-layout checkpoint has no FP8 scaling state: the FP8 texture keeps its own
    # fresh one; an FP8 checkpoint's scaling state is dropped for an arm that keeps none.
    linear = _texture("f32")
    fp8 = _texture(arm, seed=1)
    state = convert_state_dict(linear.state_dict(), fp8)
    extra = sorted(k for k in state if k.endswith("._extra_state"))
    assert extra == ["net.net.0._extra_state", "net.net.2._extra_state", "net.net.4._extra_state"]
    fp8.load_state_dict(state, strict=True)  # raised "Missing key(s)" before the fill-in
    for key, value in linear.state_dict().items():
        assert torch.equal(fp8.state_dict()[key], value), key
    fp8.sample(_points(200)).sum().backward()  # records amaxes: no longer a fresh state
    back = MLPTexture3D(AABB, precision="f32", encoder=SMALL, backend="torch")
    back.load_state_dict(convert_state_dict(fp8.state_dict(), back), strict=True)
    for key, value in linear.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    # Into another FP8 texture, the checkpoint's own scaling state is kept, not replaced.
    other = _texture(arm, seed=2)
    kept = convert_state_dict(fp8.state_dict(), other)
    key = "net.net.0._extra_state"
    torch.testing.assert_close(kept[key], fp8.state_dict()[key], rtol=0, atol=0)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(kept[key], other.state_dict()[key], rtol=0, atol=0)


def test_state_dict_conversion_errors_name_the_problem():
    fused = MLPTexture3D(AABB, precision="tcnn_fused", encoder=SMALL, backend="torch")
    linear = _texture("f32").state_dict()
    narrow = _texture("f32", internal_dims=16).state_dict()
    cases = [
        ({"encoder.params": linear["encoder.params"]}, "^state_dict: no MLP weights"),
        ({**linear, "net.net.params": torch.zeros(3)}, "^state_dict: holds both layouts"),
        (narrow, r"^state_dict: its MLP has .* = \(8, 3, 16, 2\), the texture's is "
                 r"\(8, 3, 32, 2\)"),
        ({**linear, "net.net.0.bias": torch.zeros(32)}, "^state_dict: net.net.0.bias: tcnn"),
    ]  # fmt: skip
    for state_dict, match in cases:
        with pytest.raises(ValueError, match=match):
            convert_state_dict(state_dict, fused)
    # In the texture's own layout too: sizes that differ are named here, not by load_state_dict.
    with pytest.raises(ValueError) as err:
        convert_state_dict(narrow, _texture("f32"))
    assert str(err.value) == "state_dict: net.net.0.weight is [16, 8], the texture's [32, 8]"
    with pytest.raises(ValueError, match=r"^state_dict: expected a texture's state dict"):
        convert_state_dict(None, fused)
    with pytest.raises(ValueError, match=r"^texture: expected an MLPTexture3D"):
        convert_state_dict(linear, None)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_nvdiffrec_copy_crashes_without_position_grad_and_ours_does_not():
    theirs = _NvdiffrecTexture(
        torch.tensor(AABB), 3, 32, 2, torch.tensor([[0.0] * 3, [1.0] * 3]), SMALL
    )
    with pytest.raises(TypeError):  # the hook divides a None input gradient
        theirs.sample(_points(16)).sum().backward()
    _texture("nvdiffrec").sample(_points(16)).sum().backward()


def test_state_dict_round_trips_between_arms_and_devices_of_the_encoder():
    a, b = _texture("f32", seed=0), _texture("f16_dynamic", seed=1)
    b.load_state_dict(a.state_dict())
    for key, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], value)
    # The half arm carries tcnn's half-mode roundings (table values, interpolation weights and
    # each corner's fma rounded to half, then the half MLP): half ulps of outputs below 1,
    # 2^-11; measured up to 4.3e-4 over four seeds.
    torch.testing.assert_close(b.sample(_points()), a.sample(_points()), rtol=1e-3, atol=2**-11)
    a.clamp_()  # nvdiffrec's no-op
    a.cleanup()


@pytest.mark.requires_tcnn
def test_state_dict_round_trips_between_torch_and_tcnn_encoders():
    torch_tex = _texture("nvdiffrec").cuda()
    torch.manual_seed(0)
    tcnn_tex = MLPTexture3D(AABB, precision="nvdiffrec", encoder=SMALL, backend="tcnn").cuda()
    tcnn_tex.load_state_dict(torch_tex.state_dict())
    assert tcnn_tex.state_dict().keys() == torch_tex.state_dict().keys()
    points = _points().cuda()
    out_tcnn, out_torch = tcnn_tex.sample(points), torch_tex.sample(points)
    # Both run the grid in half: outputs differ by half rounding of the accumulation order.
    torch.testing.assert_close(out_tcnn, out_torch, rtol=1e-2, atol=1e-3)
    cotangent = torch.randn_like(out_torch)
    (out_tcnn * cotangent).sum().backward()
    (out_torch * cotangent).sum().backward()
    named = dict(torch_tex.named_parameters())
    assert [n for n, _ in tcnn_tex.named_parameters()] == list(named)
    for name, a in tcnn_tex.named_parameters():
        b = named[name]
        assert a.grad is not None and b.grad is not None, f"{name}: no gradient reached it"
        assert a.grad.dtype == b.grad.dtype == torch.float32, name
        # tcnn accumulates the half gradient table with half atomics in the order threads
        # arrive; on this config (tcnn's golden tensors, tests/gpu_golden/: the coarse config,
        # U(-1, 1) table) that puts entries at most 0.5 % of the table's largest gradient from
        # the twin's; 2 % leaves room for this test's larger cotangents.
        scale = b.grad.abs().max().item()
        diff = (a.grad - b.grad).abs()
        worst = int(diff.argmax())
        assert bool(torch.isfinite(a.grad).all()), f"{name}: tcnn's gradient is not finite"
        assert diff.max().item() <= 2e-2 * scale, (
            f"{name}: {int((diff > 2e-2 * scale).sum())} of {diff.numel()} entries differ by "
            f"more than 2 % of the largest ({scale:.4g}); worst at {worst}: tcnn "
            f"{a.grad.flatten()[worst].item():.6g}, twin {b.grad.flatten()[worst].item():.6g}; "
            f"||tcnn|| / ||twin|| = {(a.grad.norm() / b.grad.norm()).item():.6g}"
        )
    torch_tex.load_state_dict(tcnn_tex.state_dict())
    tcnn_tex.cleanup()


@pytest.mark.slow
def test_every_arm_fits_a_3d_function(capsys):
    from mptex.diagnostics import fit

    threads = torch.get_num_threads()
    # One thread: small matmuls gain little from two, and with other jobs on a 2-core CI machine
    # two spinning OpenMP threads slow this test down ten-fold.
    torch.set_num_threads(1)
    try:
        results = {arm: fit.fit_arm(arm, steps=150, batch=2048, n_eval=8192) for arm in CPU_ARMS}
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print("\nfit after 150 steps (PSNR dB, skipped, final loss scale):")
        for arm, r in results.items():
            print(f"  {arm:12s} {r['psnr']:7.2f} {r['skipped']:3d} {r['final_loss_scale']:g}")
    # Recorded, not bent: f16_naive diverges (f16 gradients underflow and f16 Adam's eps is 0).
    for arm, r in results.items():
        assert r["diverged"] or math.isfinite(r["psnr"]), arm
    assert results["f32"]["psnr"] > 20.0  # far above a constant colour (~10 dB here)
    assert abs(results["f32"]["psnr"] - results["f16_dynamic"]["psnr"]) < 0.5


def test_texture_config_builds_nvdiffrecs_texture():
    from hydra import compose, initialize_config_dir

    config_dir = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(
            overrides=["+texture=default", "+precision=nvdiffrec", "texture.backend=torch"]
        )
    assert dict(cfg.texture.encoder) == NVDIFFREC_ENCODER_CONFIG
    texture = MLPTexture3D(AABB, **cfg.texture, precision=cfg.precision)
    assert texture.policy == PrecisionPolicy.named("nvdiffrec")
    assert texture.encoder.n_output_dims == 32 and texture.channels == 3


@pytest.mark.golden_bits
def test_output_sigmoid_has_the_same_bits_for_any_thread_count():
    # Above 32768 elements ATen gives each thread a chunk whose scalar tail computes exp unlike
    # the vectorised body, so torch.sigmoid's bits depend on the thread count (on this project's
    # AVX-512 machine: 18 of these 40 sizes differed). The texture's sigmoid must not, and must
    # equal torch.sigmoid computed by one thread (forward and gradient).
    from mptex.texture import _sigmoid

    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for n in range(32769, 32769 + 40 * 97, 97):
            x = torch.randn(n // 3, 3, generator=gen) * 4
            grads, outs = [], []
            for t in (1, 2):
                torch.set_num_threads(t)
                xx = x.clone().requires_grad_()
                y = _sigmoid(xx)
                y.backward(torch.ones_like(y))
                outs.append(y.detach())
                grads.append(xx.grad)
            assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), n
            torch.set_num_threads(1)
            ref = x.clone().requires_grad_()
            torch.sigmoid(ref).backward(torch.ones_like(ref))
            assert torch.equal(outs[0], torch.sigmoid(x)) and torch.equal(grads[0], ref.grad)
    finally:
        torch.set_num_threads(threads)


def test_an_fp8_gemm_backend_this_device_cannot_run_is_named_as_the_argument():
    # Resolved per call for the device the texture runs on, so the error comes at sample().
    texture = MLPTexture3D(AABB, precision="fp8", fp8_gemm="scaled_mm", encoder=SMALL)
    with pytest.raises(ValueError) as err:
        texture.sample(torch.rand(8, 3))
    assert str(err.value) == ("fp8_gemm: 'scaled_mm' needs a CUDA device with FP8 tensor cores "
                              "(compute capability 8.9 or later), got cpu")  # fmt: skip
