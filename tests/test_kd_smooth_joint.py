"""``train.kd_smooth_joint``: the texture evaluated once on the covered points and their jittered
copies together instead of twice; the same values, noise and gradients as two evaluations, one
forward and one backward through the texture."""

from __future__ import annotations

import pytest
import torch

from mptex.fp8 import FP8_MAX
from mptex.mlp import FP8Linear
from mptex.scenes import build_scene
from mptex.texture import MLPTexture3D
from mptex.train.shading import render_batch

GRID = dict(otype="HashGrid", n_levels=4, n_features_per_level=2, log2_hashmap_size=12,
            base_resolution=16, per_level_scale=2.0)  # fmt: skip
LIGHT = torch.nn.functional.normalize(torch.tensor([0.5, 0.8, 0.3]), dim=0)


@pytest.fixture(scope="module")
def scene():
    return build_scene({"name": "builtin", "resolution": 24, "n_train_views": 6}, "cpu")


def _texture(scene, precision="f32", channels=3):
    torch.manual_seed(0)
    texture = MLPTexture3D(scene.aabb, channels=channels, encoder=GRID, internal_dims=16,
                           precision=precision)  # fmt: skip
    with torch.no_grad():  # features of order 1, so that the MLP's output moves with its input
        texture.encoder.params.uniform_(-1, 1)
    return texture


def _jitter(calls):
    def jitter(points):
        calls.append(points)
        noise = torch.randn(points.shape, generator=torch.Generator().manual_seed(4))
        return points + 0.01 * noise

    return jitter


def _render(texture, scene, joint, shading="kd"):
    batch = scene.training_batch(3, torch.Generator().manual_seed(1), normals=True)
    background = torch.rand(batch.coverage.shape[:-1] + (3,),
                            generator=torch.Generator().manual_seed(2))  # fmt: skip
    calls, samples = [], []
    real = texture.sample
    texture.sample = lambda points, **kw: samples.append(points.shape[0]) or real(points, **kw)
    try:
        pred, kd_grad = render_batch(texture, batch, {"shading": shading, "ambient": 0.25},
                                     background, LIGHT, _jitter(calls), joint=joint)  # fmt: skip
    finally:
        del texture.sample
    texture.zero_grad(set_to_none=True)
    (pred.square().mean() + kd_grad).backward()
    grads = {name: p.grad.clone() for name, p in texture.named_parameters()}
    return pred.detach(), kd_grad.detach(), grads, calls, samples, batch.points.shape[0]


@pytest.mark.parametrize("shading", ["kd", "diffuse"])
def test_one_evaluation_gives_the_two_evaluations_values_and_gradients(scene, shading):
    channels = 9 if shading == "diffuse" else 3
    texture = _texture(scene, channels=channels)
    pred_j, kd_j, grads_j, calls_j, samples_j, n = _render(texture, scene, True, shading)
    pred_s, kd_s, grads_s, calls_s, samples_s, _ = _render(texture, scene, False, shading)
    # One texture forward on [2N, 3] against two on [N, 3]; the jitter called once on the same
    # points either way (the noise is drawn once, from the same generator state).
    assert samples_j == [2 * n] and samples_s == [n, n] and n > 100
    assert len(calls_j) == len(calls_s) == 1 and torch.equal(calls_j[0], calls_s[0])
    # The MLP's rows are independent: each output is the same float32 dot products, whatever
    # else is in the batch (a BLAS may block a taller GEMM differently: a few float32 ulps).
    assert kd_j.item() > 0
    torch.testing.assert_close(pred_j, pred_s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kd_j, kd_s, rtol=1e-5, atol=1e-7)
    # The gradients sum the same per-point terms, in another order: float32 reassociation.
    assert grads_j.keys() == grads_s.keys()
    for name in grads_s:
        scale = grads_s[name].abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(grads_j[name], grads_s[name], rtol=1e-4, atol=1e-5 * scale)


def test_without_the_smoothness_term_nothing_changes(scene):
    texture = _texture(scene)
    batch = scene.training_batch(2, torch.Generator().manual_seed(1))
    background = torch.zeros(batch.coverage.shape[:-1] + (3,))
    settings = {"shading": "kd", "ambient": 0.25}
    joint = render_batch(texture, batch, settings, background, LIGHT, None, joint=True)
    separate = render_batch(texture, batch, settings, background, LIGHT, None, joint=False)
    assert torch.equal(joint[0], separate[0]) and joint[1] is separate[1] is None


@pytest.mark.parametrize("precision", ["f32", "fp8_current", "fp8_rowwise"])
@pytest.mark.parametrize("joint", [True, False])
def test_a_batch_that_covers_no_pixel_renders_the_background(scene, precision, joint):
    # Views that miss the mesh: no point reaches the texture but an empty batch, the image is
    # the background, the smoothness term 0, and the backward runs (zero gradients).
    import dataclasses

    texture = _texture(scene, precision)
    batch = scene.training_batch(2, torch.Generator().manual_seed(1))
    empty = dataclasses.replace(
        batch, coverage=torch.zeros_like(batch.coverage), covered=batch.covered[:0],
        points=batch.points[:0],
    )  # fmt: skip
    background = torch.rand(batch.coverage.shape[:-1] + (3,),
                            generator=torch.Generator().manual_seed(2))  # fmt: skip
    pred, kd_grad = render_batch(texture, empty, {"shading": "kd", "ambient": 0.25}, background,
                                 LIGHT, _jitter([]), joint=joint)  # fmt: skip
    assert torch.equal(pred, background) and kd_grad.item() == 0.0
    (pred.square().mean() + kd_grad).backward()
    for name, param in texture.named_parameters():
        assert param.grad is None or not torch.count_nonzero(param.grad), name


def _fp8_layers(texture):
    layers = [m for m in texture.net.modules() if isinstance(m, FP8Linear)]
    assert layers
    return layers


@pytest.mark.parametrize("recipe", ["fp8", "fp8_current"])
def test_a_per_tensor_fp8_recipe_records_one_call_per_iteration_with_one_scale(scene, recipe):
    # The documented difference: the points and their jittered copies are one tensor, quantised
    # with one scale; the delayed recipe's history moves once per training forward, so once
    # per iteration instead of twice.
    joint, separate = _texture(scene, recipe), _texture(scene, recipe)
    n = _render(joint, scene, True)[-1]
    _render(separate, scene, False)
    for layer_j, layer_s in zip(_fp8_layers(joint), _fp8_layers(separate), strict=True):
        for role in ("input", "grad"):
            assert layer_j.scaling[role].calls.item() == 1.0
            assert layer_s.scaling[role].calls.item() == 2.0
    first_j, first_s = (
        _fp8_layers(joint)[0].scaling["input"],
        _fp8_layers(separate)[0].scaling["input"],
    )
    if recipe == "fp8":
        # The first layer's input (the grid's features): the joint amax is the larger of the
        # two halves' amaxes, which the separate evaluations recorded.
        assert first_j.history[0].item() == first_s.history[:2].max().item() > 0
        assert first_j.history[1].item() == 0.0 and first_s.history[1].item() > 0
    else:
        assert first_j.last_scale.item() == pytest.approx(
            FP8_MAX[torch.float8_e4m3fn] / first_j.last_amax.item(), rel=1e-6
        )
    assert n > 100
