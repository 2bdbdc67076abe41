"""MLPTexture3D used the way nvdiffrec's training script uses its own: constructed from a
geometry's ``(min, max)`` AABB with 9 channels and kd/ks/normal limits, held in a material
module whose parameters go to Adam, sampled at G-buffer positions ``[1, H, W, 3]`` (plain and
jittered), its grid gradient divided in place, validated and baked under ``torch.no_grad``,
then cleaned up and deleted. Only the call shapes are nvdiffrec's; no nvdiffrec code is here."""

import pytest
import torch

from mptex import MLPTexture3D

SMALL = {
    "otype": "HashGrid", "n_levels": 4, "n_features_per_level": 2, "log2_hashmap_size": 12,
    "base_resolution": 4, "per_level_scale": 2.0,
}  # fmt: skip

# nvdiffrec's limits: its script's defaults, and its NeRD scenes' configs, which pin ks's first
# (occlusion) channel to 0 with ks_min[0] == ks_max[0] == 0.
LIMITS = {
    "defaults": {
        "kd": ([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]),
        "ks": ([0.0, 0.08, 0.0], [1.0, 1.0, 1.0]),
        "nrm": ([-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]),
    },
    "nerd": {
        "kd": ([0.03, 0.03, 0.03], [0.8, 0.8, 0.8]),
        "ks": ([0.0, 0.08, 0.0], [0.0, 1.0, 1.0]),
        "nrm": ([-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]),
    },
}


def _mlp_limits(limits, device="cpu"):
    """The 9-channel ``[min, max]`` pair as nvdiffrec's material setup builds it: kd's first 3
    limits, then ks's, then the normal's, concatenated per end into a list of two tensors."""
    rows = {key: [torch.tensor(v, device=device) for v in ends] for key, ends in limits.items()}
    lo = torch.cat((rows["kd"][0][0:3], rows["ks"][0], rows["nrm"][0]), dim=0)
    hi = torch.cat((rows["kd"][1][0:3], rows["ks"][1], rows["nrm"][1]), dim=0)
    return [lo, hi]


class _Geometry(torch.nn.Module):
    """A stand-in for nvdiffrec's DMTet/DLMesh geometry: trainable vertices, an AABB returned
    as a ``(min, max)`` tuple computed without grad, and G-buffer positions that depend on the
    vertices (so the texture's position gradient reaches them, as in the DMTet pass)."""

    def __init__(self, h, w, device="cpu"):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.verts = torch.nn.Parameter((torch.rand(h * w, 3, generator=gen) * 2 - 1).to(device))
        self.shape = (1, h, w, 3)

    @torch.no_grad()
    def getAABB(self):  # noqa: N802 - nvdiffrec's name
        return torch.min(self.verts, dim=0).values, torch.max(self.verts, dim=0).values

    def gb_pos(self):
        return (self.verts * 1.0).view(self.shape)


class _Material(torch.nn.Module):
    """nvdiffrec-style material: a dict-like module whose entries are attributes, so a texture
    stored in it is a submodule and its parameters are the material's."""

    def __init__(self, entries):
        super().__init__()
        for key, value in entries.items():
            setattr(self, key, value)

    def __contains__(self, key):
        return hasattr(self, key)

    def __getitem__(self, key):
        return getattr(self, key)

    def __delitem__(self, key):
        delattr(self, key)


def _split(all_tex):
    """kd, ks, normal from the combined texture, by nvdiffrec's negative-index slicing."""
    return all_tex[..., :-6], all_tex[..., -6:-3], all_tex[..., -3:]


@pytest.mark.parametrize("limits", list(LIMITS))
def test_nvdiffrecs_construction_and_sample_with_its_limits(limits):
    # The exact constructor call: the default (nvdiffrec's) hash grid, 9 channels, the limits
    # as a list of two 9-vectors. The NeRD limits' empty ks range is a constant 0 channel.
    geometry = _Geometry(8, 8)
    mlp_min, mlp_max = _mlp_limits(LIMITS[limits])
    tex = MLPTexture3D(geometry.getAABB(), channels=9, min_max=[mlp_min, mlp_max])
    assert tex.channels == 9 and tex.internal_dims == 32
    assert torch.equal(tex.AABB[0], geometry.getAABB()[0])
    assert torch.equal(tex.AABB[1], geometry.getAABB()[1])
    assert torch.equal(tex.min_max[0], mlp_min) and torch.equal(tex.min_max[1], mlp_max)

    gb_pos = geometry.gb_pos()
    jitter = gb_pos + torch.normal(mean=0, std=0.01, size=gb_pos.shape)
    all_tex_jitter, all_tex = tex.sample(jitter), tex.sample(gb_pos)
    assert all_tex.shape == (1, 8, 8, 9) and all_tex.dtype == torch.float32
    assert all_tex_jitter.shape == all_tex.shape
    assert bool(((all_tex >= mlp_min) & (all_tex <= mlp_max)).all())
    kd, ks, nrm = _split(all_tex)
    assert kd.shape[-1] == ks.shape[-1] == nrm.shape[-1] == 3
    pinned = mlp_min == mlp_max
    assert bool((all_tex[..., pinned] == mlp_min[pinned]).all())
    assert int(pinned.sum()) == (1 if limits == "nerd" else 0)


def test_nvdiffrecs_training_iteration_pattern():
    # Material module -> Adam over its parameters with LambdaLR; per step: jittered and plain
    # samples, kd-gradient regulariser, backward, the grid gradient divided by 8 in place,
    # step. No precision stepper: the default arm needs none, as nvdiffrec's loop has none.
    torch.manual_seed(0)
    geometry = _Geometry(6, 5)
    tex = MLPTexture3D(geometry.getAABB(), channels=9,
                       min_max=_mlp_limits(LIMITS["nerd"]), encoder=SMALL)  # fmt: skip
    material = _Material({"kd_ks_normal": tex})
    params = list(material.parameters())
    assert {id(p) for p in params} == {id(p) for p in tex.parameters()}
    assert any(p is tex.encoder.params for p in params)
    assert sum(p.numel() for p in params) == tex.encoder.n_params + sum(
        layer.weight.numel() for layer in tex.net.layers
    )
    optimizer = torch.optim.Adam(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda x: 0.9 ** (x / 10))
    geo_optimizer = torch.optim.Adam(list(geometry.parameters()), lr=1e-3)
    start = [p.detach().clone() for p in params]
    target = torch.rand(1, 6, 5, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optimizer.zero_grad()
        geo_optimizer.zero_grad()
        gb_pos = geometry.gb_pos()
        assert "kd_ks_normal" in material
        jittered = material["kd_ks_normal"].sample(
            gb_pos + torch.normal(mean=0, std=0.01, size=gb_pos.shape)
        )
        all_tex = material["kd_ks_normal"].sample(gb_pos)
        kd = _split(all_tex)[0]
        kd_grad = torch.sum(torch.abs(_split(jittered)[0] - kd), dim=-1, keepdim=True) / 3
        loss = torch.nn.functional.mse_loss(kd, target) + kd_grad.mean() * 0.03
        loss.backward()
        material["kd_ks_normal"].encoder.params.grad /= 8.0
        optimizer.step()
        scheduler.step()
        geo_optimizer.step()
    assert all(not torch.equal(p, s) for p, s in zip(params, start))
    # The position gradient reached the vertices (the DMTet pass trains them through it).
    assert geometry.verts.grad is not None and torch.isfinite(geometry.verts.grad).all()
    assert geometry.verts.grad.abs().sum() > 0
    # nvdiffrec's per-step clamp loop never touches this texture; clamp_ exists and is a no-op.
    before = [p.detach().clone() for p in params]
    with torch.no_grad():
        tex.clamp_()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_validation_and_uv_bake_under_no_grad_then_cleanup_and_delete():
    tex = MLPTexture3D(_Geometry(4, 4).getAABB(), channels=9,
                       min_max=_mlp_limits(LIMITS["defaults"]), encoder=SMALL)  # fmt: skip
    material = _Material({"kd_ks_normal": tex, "bsdf": "pbr"})
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        # Validation render: jittered and plain samples without a graph.
        gb_pos = torch.rand(1, 7, 9, 3, generator=gen) * 2 - 1
        out = material["kd_ks_normal"].sample(gb_pos)
        material["kd_ks_normal"].sample(gb_pos + torch.normal(0, 0.01, size=gb_pos.shape))
        assert out.shape == (1, 7, 9, 9) and not out.requires_grad
        # UV bake: world positions interpolated over a texture-resolution G-buffer, including
        # empty texels at the origin, and the normal slice normalised.
        baked = material["kd_ks_normal"].sample(torch.zeros(1, 16, 16, 3))
        kd, ks, nrm = _split(baked)
        assert kd.shape == ks.shape == nrm.shape == (1, 16, 16, 3)
        assert torch.isfinite(torch.nn.functional.normalize(nrm, dim=-1)).all()
    material["kd_ks_normal"].cleanup()
    del material["kd_ks_normal"]
    assert "kd_ks_normal" not in material and list(material.parameters()) == []


@pytest.mark.parametrize("hidden", [1, 2, 3])
def test_positional_sizes_give_nvdiffrecs_layer_layout(hidden):
    # MLPTexture3D(AABB, channels, internal_dims, hidden, min_max): hidden + 1 bias-free layers
    # at net.net.0, net.net.2, ... (ReLUs between), [out, in] weights.
    aabb = (torch.tensor([-1.0, -2.0, 0.0]), torch.tensor([1.0, 2.0, 3.0]))
    tex = MLPTexture3D(aabb, 9, 64, hidden, _mlp_limits(LIMITS["defaults"]), encoder=SMALL)
    shapes = {k: tuple(v.shape) for k, v in tex.state_dict().items() if k.startswith("net.")}
    widths = [tex.encoder.n_output_dims] + [64] * hidden + [9]
    assert shapes == {
        f"net.net.{2 * i}.weight": (widths[i + 1], widths[i]) for i in range(hidden + 1)
    }


class _ReportsMeta(torch.Tensor):
    """A CPU tensor that reports the meta device: the device rule checked without a GPU."""

    @property
    def device(self):
        return torch.device("meta")


def test_the_texture_is_created_on_the_aabbs_device():
    # nvdiffrec calls no .cuda() on its texture: the AABB's device places it. An AABB of
    # numbers leaves it on the default device.
    lo, hi = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([1.0, 1.0, 1.0])
    aabb = (lo.as_subclass(_ReportsMeta), hi.as_subclass(_ReportsMeta))
    tex = MLPTexture3D(aabb, channels=9, min_max=_mlp_limits(LIMITS["nerd"]), encoder=SMALL)
    tensors = [*tex.parameters(), *tex.buffers()]
    assert len(tensors) == 6 and all(t.device.type == "meta" for t in tensors)
    plain = MLPTexture3D([lo.tolist(), hi.tolist()], channels=9, encoder=SMALL)
    assert all(t.device.type == "cpu" for t in [*plain.parameters(), *plain.buffers()])


@pytest.mark.requires_cuda
def test_cuda_aabb_gives_a_cuda_texture_that_samples_cuda_gbuffers():
    geometry = _Geometry(8, 8, device="cuda")
    tex = MLPTexture3D(geometry.getAABB(), channels=9,
                       min_max=_mlp_limits(LIMITS["nerd"], device="cuda"))  # fmt: skip
    assert all(p.is_cuda for p in tex.parameters()) and tex.AABB.is_cuda and tex.min_max.is_cuda
    gb_pos = geometry.gb_pos()
    out = tex.sample(gb_pos + torch.normal(mean=0, std=0.01, size=gb_pos.shape, device="cuda"))
    assert out.is_cuda and out.shape == (1, 8, 8, 9) and out.dtype == torch.float32
    optimizer = torch.optim.Adam(tex.parameters(), lr=1e-2)
    out.mean().backward()
    tex.encoder.params.grad /= 8.0
    optimizer.step()
    tex.cleanup()
