"""mptex's calls into nvdiffrast, made on the CPU against a stand-in with nvdiffrast's interface.

On CUDA with nvdiffrast importable, ``rasterize``, ``interpolate`` and ``texture`` hand their
tensors to ``nvdiffrast.torch`` (``backend="auto"`` or ``"nvdiffrast"``): the G-buffers of every
training and validation view, the bake's atlas, the materials' colours. That branch runs only on
a GPU. Here a stand-in module takes its place: it checks what nvdiffrast 0.4.0's C++ entry
points check before they launch anything (``NVDR_CHECK_DEVICE``, ``NVDR_CHECK_CONTIGUOUS``,
``NVDR_CHECK_F32``, ``NVDR_CHECK_I32`` and the shape checks of ``torch_rasterize.cpp``,
``torch_interpolate.cpp`` and ``torch_texture.cpp``), and the arguments of its Python functions
(``ops.py``), then computes the result with mptex's torch backend, so that what the callers do
with nvdiffrast's outputs is checked too: the same bits as ``backend="torch"`` where the
inputs are float32.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import mptex._backends as backends
from mptex.bake.bake import _rasterize_atlas
from mptex.render import Mesh, interpolate, orbit_views, rasterize, texture
from mptex.render.material import Material, shade_kd
from mptex.scenes import render_gbuffer, torus_knot

# The modules (mptex.render exports functions of the same names).
rasterize_module = importlib.import_module("mptex.render.rasterize")
texture_module = importlib.import_module("mptex.render.texture")


class _Context:
    """``nvdiffrast.torch.RasterizeCudaContext(device=None)``."""

    def __init__(self, device=None):
        self.device = device


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"nvdiffrast would refuse: {what}")


def _same_device(*tensors: torch.Tensor) -> None:
    _need(len({t.device for t in tensors}) == 1, "NVDR_CHECK_DEVICE: tensors on different devices")


def _contiguous(*tensors: torch.Tensor) -> None:
    _need(all(t.is_contiguous() for t in tensors), "NVDR_CHECK_CONTIGUOUS")


class _Nvdiffrast:
    """What mptex calls of ``nvdiffrast.torch``, with its checks; records each call."""

    RasterizeCudaContext = _Context

    def __init__(self):
        self.calls: list[str] = []

    def rasterize(self, glctx, pos, tri, resolution, ranges=None, grad_db=True):
        self.calls.append("rasterize")
        _need(isinstance(glctx, _Context), "glctx: a RasterizeCudaContext")
        _same_device(pos, tri)
        _contiguous(pos, tri)
        _need(pos.dtype == torch.float32, f"pos: float32 (got {pos.dtype})")
        _need(tri.dtype == torch.int32, f"tri: int32 (got {tri.dtype})")
        # A [V, 4] pos is range mode, which needs ranges; mptex draws instanced.
        instanced = pos.dim() == 3 and pos.shape[2] == 4 and pos.shape[0] > 0
        _need(instanced, f"instanced mode: pos [>0, V, 4] (got {list(pos.shape)})")
        _need(tri.dim() == 2 and tri.shape[1] == 3, "tri: [>0, 3]")
        height, width = tuple(resolution)
        _need(height > 0 and width > 0, "resolution")
        return rasterize_module._rasterize_torch(pos, tri, height, width)

    def interpolate(self, attr, rast, tri, rast_db=None, diff_attrs=None):
        self.calls.append("interpolate")
        _same_device(attr, rast, tri)
        _contiguous(attr, rast, tri)
        _need(attr.dtype == torch.float32 and rast.dtype == torch.float32,
              f"attr, rast: float32 (got {attr.dtype}, {rast.dtype})")  # fmt: skip
        _need(tri.dtype == torch.int32, "tri: int32")
        _need(rast.dim() == 4 and rast.shape[3] == 4, "rast: [>0, >0, >0, 4]")
        if attr.dim() > 2:  # instance mode: one attribute set per image, or one for all
            _need(attr.shape[0] in (1, rast.shape[0]), "attr: minibatch size 1 or rast's")
        out, _ = interpolate(attr, rast, tri, backend="torch")
        return out, torch.empty(0, device=attr.device)

    def texture(self, tex, uv, uv_da=None, mip_level_bias=None, mip=None,
                filter_mode="auto", boundary_mode="wrap", max_mip_level=None):  # fmt: skip
        self.calls.append("texture")
        _same_device(tex, uv)
        _contiguous(tex, uv)
        _need(tex.dtype == torch.float32 and uv.dtype == torch.float32,
              f"tex, uv: float32 (got {tex.dtype}, {uv.dtype})")  # fmt: skip
        _need(uv.dim() == 4 and uv.shape[3] == 2 and min(uv.shape[:3]) > 0,
              f"uv: [>0, >0, >0, 2] (got {list(uv.shape)})")  # fmt: skip
        _need(tex.dim() == 4 and min(tex.shape) > 0, "tex: [>0, >0, >0, >0]")
        _need(tex.shape[0] in (1, uv.shape[0]), "tex: minibatch size 1 or uv's")
        _need(filter_mode in ("auto", "nearest", "linear", "linear-mipmap-nearest",
                              "linear-mipmap-linear"), f"filter_mode {filter_mode!r}")  # fmt: skip
        _need(boundary_mode in ("wrap", "clamp", "zero", "cube"), f"boundary {boundary_mode!r}")
        return texture(tex, uv, filter_mode="linear", boundary_mode=boundary_mode,
                       backend="torch")  # fmt: skip


@pytest.fixture
def nvdiffrast(monkeypatch):
    """``backend="nvdiffrast"`` routed to the stand-in, on CPU tensors."""
    fake = _Nvdiffrast()
    resolve = rasterize_module._resolve_backend

    def resolved(backend, device, what):
        return "nvdiffrast" if backend == "nvdiffrast" else resolve(backend, device, what)

    monkeypatch.setattr(rasterize_module, "_resolve_backend", resolved)
    monkeypatch.setattr(texture_module, "_resolve_backend", resolved)
    monkeypatch.setattr(rasterize_module, "import_nvdiffrast", lambda *a, **k: fake)
    monkeypatch.setattr(backends, "import_nvdiffrast", lambda *a, **k: fake)
    monkeypatch.setattr(rasterize_module, "_NVDR_CONTEXTS", {})
    return fake


def _equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


def test_the_g_buffers_are_nvdiffrasts_calls_with_its_inputs(nvdiffrast):
    mesh = torus_knot()
    cams = orbit_views(3, radius=3.0)
    want = render_gbuffer(mesh, cams.mvp, (24, 32), backend="torch")
    got = render_gbuffer(mesh, cams.mvp, (24, 32), backend="nvdiffrast")
    assert nvdiffrast.calls == ["rasterize", "interpolate", "interpolate"]
    for name in ("rast", "position", "normal", "mask"):
        _equal(getattr(got, name), getattr(want, name))
    assert bool(got.mask.any())


def test_a_single_image_and_a_non_contiguous_input_reach_nvdiffrast_as_it_takes_them(nvdiffrast):
    # [V, 4] positions (one image) go in instanced mode; a transposed tri and a strided attr
    # are copied to the contiguous layout nvdiffrast requires.
    pos = torch.tensor([[-0.8, -0.8, 0.5, 1.0], [0.8, -0.8, 0.5, 1.0], [0.0, 0.8, 0.5, 1.0]])
    tri = torch.tensor([[0], [1], [2]], dtype=torch.int32).t()
    attr = torch.arange(18, dtype=torch.float32).reshape(3, 6)[:, ::2]
    rast, _ = rasterize(pos, tri, (8, 8), backend="nvdiffrast")
    out, _ = interpolate(attr, rast, tri, backend="nvdiffrast")
    want_rast, _ = rasterize(pos, tri, (8, 8), backend="torch")
    _equal(rast, want_rast)
    _equal(out, interpolate(attr, want_rast, tri, backend="torch")[0])
    # one context per device, made once
    rasterize(pos, tri, (8, 8), backend="nvdiffrast")
    assert list(rasterize_module._NVDR_CONTEXTS) == [pos.device]


def test_the_bakes_atlas_is_nvdiffrasts_calls_with_its_inputs(nvdiffrast):
    mesh = torus_knot()
    want = _rasterize_atlas(mesh, 32, "torch")
    got = _rasterize_atlas(mesh, 32, "nvdiffrast")
    assert nvdiffrast.calls[:2] == ["rasterize", "interpolate"]
    for a, b in zip(got, want, strict=True):
        _equal(a, b)


def test_the_materials_colours_are_nvdiffrasts_calls_with_its_inputs(nvdiffrast):
    # A texture laid out as an image loader may give it (a view of a larger array) and a
    # plain kd material: interpolate for the UVs, then texture for the textured pixels.
    image = torch.rand(4, 6, 4, generator=torch.Generator().manual_seed(0))[..., :3]
    mats = [Material("tex", torch.ones(3), image), Material("kd", torch.tensor([0.1, 0.2, 0.3]))]
    idx = torch.arange(3, dtype=torch.int32)[:, None].expand(3, 3).contiguous()
    mesh = Mesh(v_pos=torch.zeros(3, 3), t_pos_idx=idx,
                v_tex=torch.tensor([[0.3, 0.6], [0.0, 0.0], [0.7, 0.2]]), t_tex_idx=idx,
                materials=mats, t_mat_idx=torch.tensor([0, 1, 0], dtype=torch.int32))  # fmt: skip
    rast = torch.zeros(1, 1, 4, 4)
    rast[0, 0, :, :2] = torch.tensor([[0.2, 0.3], [0.5, 0.1], [0.6, 0.3], [0.0, 0.0]])
    rast[0, 0, :, 3] = torch.tensor([1.0, 2.0, 3.0, 0.0])
    want = shade_kd(mesh, rast, backend="torch")
    got = shade_kd(mesh, rast, backend="nvdiffrast")
    assert nvdiffrast.calls == ["interpolate", "texture"]
    _equal(got, want)
