"""The training loop's helper modules on hand-computed cases and independent references.

Checked here, each against what its docstring defines:

- ``mptex.train.shading``: ``render_batch`` against a per-pixel float64 loop of the diffuse
  formula and of nvdiffrec's smoothness term (over a texture stand-in whose values are closed
  forms); the refusals of an unknown shading and of too few channels; the default ambient; the
  random background drawn from the given generator only.
- ``mptex.train.fused_loss``: which loss needs which part of the fused path (a stand-in kernels
  module), the smoothness term on hand-computed values, and (slow, Triton's CPU interpreter) the
  fused terms' values and gradients against float64 formulas.
- ``mptex.train.memory``: the sampled peak against a written ``statm`` (pages times the page
  size), the fallbacks' units, the allocator's peak on CUDA.
- ``mptex.train.runinfo``: the CPU model read from a written ``cpuinfo``, the device name, the
  recorded versions, ``MKL_CBWR``, the progress bar, the disabled TensorBoard writer.
- ``mptex.train.device_check``: the Hydra callback's exits and its one line; a CUDA index
  beyond the machine's.
- ``mptex.host.to_host`` on nested tuples.
- ``mptex._backends``: availability per backend and device, the messages, the once-only
  fallback warning, the shared tinycudann module, the free-memory reading.
- ``mptex.diagnostics.overhead``: the counter's counts on a hand-made sequence of ops.
- ``mptex.diagnostics.thread_check``: lists of written tensors, random draws, NaN, strides and
  the printed ops.
"""

from __future__ import annotations

import collections
import inspect
import io
import json
import math
import os
import platform
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from mptex import _backends
from mptex.diagnostics import thread_check
from mptex.diagnostics.overhead import OverheadCounter, patch_host_reads
from mptex.host import to_host
from mptex.scenes import build_scene
from mptex.train import device_check, fused_loss, memory, runinfo
from mptex.train.device_check import RequireDeviceCallback
from mptex.train.fused_loss import kd_smoothness, masked_image_loss
from mptex.train.memory import RunPeakRss, measure_memory, peak_memory, start_peak_memory
from mptex.train.shading import (
    composite,
    draw_background,
    light_direction,
    render_batch,
    shade,
)

# ----------------------------------------------------------------------------- shading
_LIGHT = (0.5, 0.8, 0.3)
_SHIFT = (0.01, -0.02, 0.005)  # the stand-in jitter: a fixed shift of every point


def _field64(p):
    """Nine channels in (0, 1), smooth closed-form functions of a position (Python floats)."""
    x, y, z = p
    return [0.5 + 0.4 * math.sin(3 * x + k * y - z + k) for k in range(9)]


class _FieldTexture:
    """A texture stand-in whose values are :func:`_field64` evaluated in float32."""

    def sample(self, points, check=True):
        x, y, z = points.unbind(-1)
        return torch.stack([0.5 + 0.4 * torch.sin(3 * x + k * y - z + k) for k in range(9)], -1)


def _shade64(t, normal, light, ambient):
    """The diffuse formula of ``shade``'s docstring, in float64 on Python floats."""
    n = [normal[i] + 2 * t[6 + i] - 1 for i in range(3)]
    length = math.sqrt(sum(c * c for c in n))
    cos = max(0.0, sum(n[i] / length * light[i] for i in range(3)))
    return [t[i] * (ambient + (1 - ambient) * cos) for i in range(3)]


@pytest.fixture(scope="module")
def scene():
    return build_scene({"name": "builtin", "resolution": 16, "n_train_views": 4}, "cpu")


def _brute_force_render(views, background, ambient):
    """Per pixel: the shaded field over a covered pixel, the background elsewhere; the
    smoothness term summed over covered pixels and divided by every pixel of the batch."""
    norm = math.sqrt(sum(c * c for c in _LIGHT))
    light = [c / norm for c in _LIGHT]
    position = views.position.double().tolist()
    normal = views.gbuffer.normal.double().tolist()
    mask = views.mask.tolist()
    bg = background.double().tolist()
    pred, smooth, pixels = [], 0.0, 0
    for b, rows in enumerate(mask):
        for y, row in enumerate(rows):
            for x, covered in enumerate(row):
                pixels += 1
                if not covered:
                    pred.append(bg[b][y][x])
                    continue
                p = position[b][y][x]
                t = _field64(p)
                pred.append(_shade64(t, normal[b][y][x], light, ambient))
                moved = _field64([p[i] + _SHIFT[i] for i in range(3)])
                smooth += sum(abs(moved[i] - t[i]) for i in range(3)) / 3
    shape = tuple(views.mask.shape) + (3,)
    return torch.tensor(pred, dtype=torch.float64).reshape(shape), smooth / pixels


@pytest.mark.parametrize("source", ["views", "training_batch"])
@pytest.mark.parametrize("joint", [True, False])
def test_render_batch_is_the_per_pixel_diffuse_shading_and_smoothness(scene, source, joint):
    gen = torch.Generator().manual_seed(3)
    if source == "views":
        batch = views = scene.views("train", [0, 2])
    else:
        batch = scene.training_batch(2, gen, normals=True)
        views = scene.views("train", batch.index)
    background = torch.rand(*views.mask.shape, 3, generator=torch.Generator().manual_seed(5))
    light = light_direction({"light_dir": list(_LIGHT)})
    shift = torch.tensor(_SHIFT)
    pred, smooth = render_batch(
        _FieldTexture(),
        batch,
        {"shading": "diffuse", "ambient": 0.4},
        background,
        light,
        lambda points: points + shift,
        joint=joint,
    )
    want_pred, want_smooth = _brute_force_render(views, background, 0.4)
    assert int(views.mask.sum()) > 50 and int((~views.mask).sum()) > 50
    # float32 sines, normalisation and products of values in [0, 1]: a few float32 ulps of 1.
    torch.testing.assert_close(pred.double(), want_pred, rtol=0, atol=1e-5)
    # A sum of a few hundred float32 differences of order 1e-2, then one division.
    assert smooth.item() == pytest.approx(want_smooth, rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU")
def test_render_batch_refuses_the_fused_smoothness_term_on_a_cpu(scene):
    views = scene.views("train", [0])
    background = torch.zeros(*views.mask.shape, 3)
    light = light_direction({"light_dir": list(_LIGHT)})
    with pytest.raises(RuntimeError, match="kd_smoothness: fused needs a CUDA device"):
        render_batch(_FieldTexture(), views, {"shading": "kd", "ambient": 0.25}, background,
                     light, lambda points: points, fused=True)  # fmt: skip


def test_an_unknown_shading_is_refused_naming_the_choices():
    tex, normal = torch.full((2, 9), 0.5), torch.tensor([[0.0, 0.0, 1.0]] * 2)
    light = torch.tensor([0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"expected one of \('kd', 'diffuse'\), got 'phong'"):
        shade(tex, normal, "phong", light)


@pytest.mark.parametrize("channels", [3, 6, 7, 8])
def test_diffuse_shading_refuses_fewer_than_nine_channels(channels):
    # With 7 or 8 channels the normal offset slice would broadcast silently; with 3 or 6 it
    # would fail inside torch without naming the setting.
    tex, normal = torch.full((2, channels), 0.5), torch.tensor([[0.0, 0.0, 1.0]] * 2)
    with pytest.raises(ValueError, match="'diffuse' needs texture.channels=9"):
        shade(tex, normal, "diffuse", torch.tensor([0.0, 0.0, 1.0]))


def test_diffuse_shading_defaults_to_a_quarter_ambient():
    # Lit from behind (cos clamped to 0), the colour is kd * ambient: 0.8 * 0.25 = 0.2.
    tex = torch.tensor([[0.8, 0.4, 0.2, 0, 0, 0, 0.5, 0.5, 0.5]])
    out = shade(tex, torch.tensor([[0.0, 0.0, 1.0]]), "diffuse", torch.tensor([0.0, 0.0, -1.0]))
    torch.testing.assert_close(out, torch.tensor([[0.2, 0.1, 0.05]]))


def test_a_random_background_is_uniform_noise_from_the_given_generator_only():
    shape = (2, 3, 4, 3)
    torch.manual_seed(0)
    first = draw_background("random", shape, "cpu", torch.Generator().manual_seed(7))
    torch.manual_seed(1)  # the global generator's state must not matter
    second = draw_background("random", shape, "cpu", torch.Generator().manual_seed(7))
    assert torch.equal(first, second)
    assert torch.equal(first, torch.rand(shape, generator=torch.Generator().manual_seed(7)))
    assert first.min() >= 0 and first.max() < 1 and first.dtype == torch.float32


# ----------------------------------------------------------------------------- fused loss
@pytest.fixture
def fake_kernels(monkeypatch):
    """A CUDA machine with Triton as far as ``fused_loss_problem`` asks: a stand-in kernels
    module whose compile option and libdevice answers the test sets."""
    module = types.ModuleType("mptex.train._loss_triton")
    module.LAUNCH_OPTIONS = {"enable_reflect_ftz": False}
    module.torch_libdevice = lambda: (None, "a libdevice of CUDA 12.8")
    monkeypatch.setitem(sys.modules, "mptex.train._loss_triton", module)
    monkeypatch.setattr(fused_loss, "has_triton", lambda: True)
    return module


def test_only_the_tone_mapped_loss_needs_a_libdevice(fake_kernels):
    problem = fused_loss.fused_loss_problem.__wrapped__  # the answer, uncached
    assert problem("cuda", "logl1") == "a libdevice of CUDA 12.8"
    assert problem("cuda", "l1") is None
    assert problem("cuda", None) is None  # the smoothness term: no log, no pow
    fake_kernels.torch_libdevice = lambda: ("/cuda/nvvm/libdevice/libdevice.10.bc", "")
    assert problem("cuda:0", "logl1") is None
    fake_kernels.LAUNCH_OPTIONS = None
    assert problem("cuda", None) == (
        "a Triton whose CUDA backend has the enable_reflect_ftz compile option"
    )


def test_the_fused_path_names_a_missing_triton(monkeypatch):
    monkeypatch.setattr(fused_loss, "has_triton", lambda: False)
    problem = fused_loss.fused_loss_problem.__wrapped__
    assert problem("cuda", "l1") == "triton (not importable)"
    assert problem(torch.device("meta"), None) == "a CUDA device (got meta)"


def test_the_smoothness_term_on_hand_computed_values():
    # Two points, five channels (only the first three are kd):
    #   point 0: |0.5 - 0.25| + |0 - 0| + |1 - 0.5| = 0.75, / 3 = 0.25
    #   point 1: |0 - 1| + |0.25 - 0| + |0 - 0| = 1.25, / 3 = 0.41666...
    # summed (0.6666...) and divided by the 8 pixels of the batch: 0.083333...
    tex = torch.tensor([[0.25, 0.0, 0.5, 9.0, 9.0], [1.0, 0.0, 0.0, -9.0, 9.0]])
    jitter = torch.tensor([[0.5, 0.0, 1.0, 0.0, 0.0], [0.0, 0.25, 0.0, 0.0, 0.0]])
    value = kd_smoothness(tex, jitter, 8)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx((0.75 + 1.25) / 3 / 8, rel=1e-6)  # float32 rounding


_INTERPRETED = """
import json, torch
from mptex.train.fused_loss import _FusedMaskedLoss, _FusedSmoothness
gen = torch.Generator().manual_seed(0)
pred = torch.rand(2, 3, 4, 3, generator=gen) * 1.2 - 0.1
rgba = torch.rand(2, 3, 4, 4, generator=gen) * 0.9 + 0.05
background = torch.rand(2, 3, 4, 3, generator=gen)
tex = torch.rand(10, 5, generator=gen)
jitter = tex + 0.05 * torch.randn(10, 5, generator=gen)
out = {"pred": pred.tolist(), "rgba": rgba.tolist(), "background": background.tolist(),
       "tex": tex.tolist(), "jitter": jitter.tolist()}
for tonemap in (False, True):
    x = pred.clone().requires_grad_()
    value = _FusedMaskedLoss.apply(x, rgba, background, tonemap)
    value.backward()
    out[f"masked_{tonemap}"] = [value.item(), x.grad.tolist()]
a, b = tex.clone().requires_grad_(), jitter.clone().requires_grad_()
value = _FusedSmoothness.apply(a, b, 24)
value.backward()
out["smooth"] = [value.item(), a.grad.tolist(), b.grad.tolist()]
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.requires_triton
def test_the_fused_terms_values_and_gradients_under_the_interpreter():
    # The autograd functions around the kernels, run by Triton's CPU interpreter in a fresh
    # process (it is chosen when the kernels are decorated), against float64 references.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    pred, rgba, background, tex, jitter = (
        torch.tensor(got[k], dtype=torch.float64)
        for k in ("pred", "rgba", "background", "tex", "jitter")
    )
    # l1: mean |pred a - ref a| over the 72 elements, ref = bg + (rgb - bg) a; its gradient
    # sign(pred a - ref a) a / 72 (alpha >= 0.05 here, and no difference is exactly 0).
    alpha = rgba[..., 3:4]
    diff = pred * alpha - (background + (rgba[..., :3] - background) * alpha) * alpha
    value, grad = got["masked_False"]
    # float32 products and a float32 sum of 72 terms of order 0.1: a few ulps of the mean.
    assert value == pytest.approx(diff.abs().mean().item(), rel=1e-5)
    torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64),
                               torch.sign(diff) * alpha / 72, rtol=1e-6, atol=0)  # fmt: skip
    # logl1 against the eager loss's formula in float64 (autograd of the same definition).
    x = pred.clone().requires_grad_()
    want = masked_image_loss(x, rgba, background, "logl1")
    want.backward()
    value, grad = got["masked_True"]
    assert value == pytest.approx(want.item(), rel=1e-5)
    # float32 log and pow in the kernel against float64: a few float32 ulps per element.
    torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64), x.grad,
                               rtol=1e-5, atol=1e-9)  # fmt: skip
    # Smoothness: sum |jitter[:, :3] - tex[:, :3]| / 3 / 24 pixels; d/djitter = sign / 72
    # on the kd channels, d/dtex its negative, zero on the other two channels.
    delta = jitter[:, :3] - tex[:, :3]
    value, grad_tex, grad_jitter = got["smooth"]
    assert value == pytest.approx(delta.abs().sum().item() / 72, rel=1e-5)
    want_jitter = torch.zeros(10, 5, dtype=torch.float64)
    want_jitter[:, :3] = torch.sign(delta) / 72
    torch.testing.assert_close(torch.tensor(grad_jitter, dtype=torch.float64), want_jitter,
                               rtol=1e-6, atol=0)  # fmt: skip
    torch.testing.assert_close(torch.tensor(grad_tex, dtype=torch.float64), -want_jitter,
                               rtol=1e-6, atol=0)  # fmt: skip


# ----------------------------------------------------------------------------- peak memory
def _write_statm(path, resident_pages):
    # /proc/self/statm: size resident shared text lib data dt, in pages
    path.write_text(f"{3 * resident_pages} {resident_pages} 10 20 0 30 0\n")


def test_run_peak_rss_is_the_largest_resident_page_count_times_the_page_size(tmp_path, monkeypatch):
    statm = tmp_path / "statm"
    monkeypatch.setattr(RunPeakRss, "_STATM", str(statm))
    page = os.sysconf("SC_PAGE_SIZE")
    # The sampling thread waits an hour between samples: only start and stop sample here.
    _write_statm(statm, 300)
    rss = RunPeakRss(interval_s=3600).start()
    assert rss.available and rss.peak == 300 * page  # the second column, sampled at start
    _write_statm(statm, 500)
    rss.stop()
    assert rss.peak == 500 * page  # sampled again at stop
    _write_statm(statm, 900)
    rss.stop()  # a second stop samples nothing more
    assert rss.peak == 500 * page
    assert peak_memory(torch.device("cpu"), rss) == (500 * page, "run_peak_rss")
    # A peak is a maximum: a later, smaller sample leaves it.
    _write_statm(statm, 700)
    falling = RunPeakRss(interval_s=3600).start()
    _write_statm(statm, 200)
    falling.stop()
    assert falling.peak == 700 * page


def test_a_disabled_run_peak_falls_back_to_the_process_lifetime_peak(monkeypatch):
    rss = RunPeakRss(enabled=False).start()
    assert not rss.available and rss.peak == 0 and not rss._thread.is_alive()
    usage = types.SimpleNamespace(ru_maxrss=5)
    monkeypatch.setattr(memory.resource, "getrusage", lambda who: usage)
    assert peak_memory(torch.device("cpu"), rss) == (5 * 1024, "process_peak_rss")  # Linux: KiB
    with monkeypatch.context() as patch:
        patch.setattr(memory.sys, "platform", "darwin")
        assert peak_memory(torch.device("cpu"), rss) == (5, "process_peak_rss")  # macOS: bytes


def test_a_cuda_run_reports_the_allocators_peak(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: asked.append(device) or 12345)  # fmt: skip
    device = torch.device("cuda", 0)
    rss = RunPeakRss(enabled=False)
    assert peak_memory(device, rss) == (12345, "cuda_max_allocated") and asked == [device]


def test_the_start_peak_is_split_off_and_the_run_peak_starts_from_the_memory_then(
    tmp_path, monkeypatch
):
    statm = tmp_path / "statm"
    monkeypatch.setattr(RunPeakRss, "_STATM", str(statm))
    page = os.sysconf("SC_PAGE_SIZE")
    _write_statm(statm, 300)
    rss = RunPeakRss(interval_s=3600).start()
    _write_statm(statm, 2000)
    rss._sample()  # the start's high point (the G-buffers at their largest)
    _write_statm(statm, 400)  # freed again when the start ends
    assert start_peak_memory(torch.device("cpu"), rss) == 2000 * page
    assert rss.peak == 400 * page  # what the process holds now, not the start's peak
    _write_statm(statm, 600)
    rss.stop()
    assert peak_memory(torch.device("cpu"), rss) == (600 * page, "run_peak_rss")
    # A split's last sample counts when it is the largest.
    _write_statm(statm, 300)
    rising = RunPeakRss(interval_s=3600).start()
    _write_statm(statm, 800)
    assert rising.split() == 800 * page and rising.peak == 800 * page
    rising.stop()


def test_without_proc_the_start_peak_is_the_lifetime_peak_so_far(monkeypatch):
    rss = RunPeakRss(enabled=False).start()
    assert rss.split() == 0
    monkeypatch.setattr(memory.resource, "getrusage",
                        lambda who: types.SimpleNamespace(ru_maxrss=7))  # fmt: skip
    assert start_peak_memory(torch.device("cpu"), rss) == 7 * 1024


def test_a_cuda_start_peak_is_the_allocators_peak_since_the_start_began(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append(("reset", device)))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: calls.append(("max", device)) or 999)  # fmt: skip
    device = torch.device("cuda", 1)
    rss = measure_memory(device)
    assert not rss.available and calls == [("reset", device)]  # no sampling thread on CUDA
    assert start_peak_memory(device, rss) == 999
    # read, then reset: the run's own peak starts when the start ends
    assert calls == [("reset", device), ("max", device), ("reset", device)]
    rss.stop()


# ----------------------------------------------------------------------------- run info
_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz
stepping\t: 7

processor\t: 1
model name\t: Another CPU
"""


class _FakePath:
    def __init__(self, text):
        self.text = text

    def read_text(self):
        if self.text is None:
            raise OSError("no /proc here")
        return self.text


def test_cpu_model_is_the_first_model_name_of_cpuinfo(monkeypatch):
    monkeypatch.setattr(runinfo, "Path", lambda path: _FakePath(_CPUINFO))
    assert runinfo.cpu_model() == "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz"


def test_cpu_model_without_cpuinfo_is_platforms_guess(monkeypatch):
    monkeypatch.setattr(runinfo, "Path", lambda path: _FakePath(None))
    monkeypatch.setattr(runinfo.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(runinfo.platform, "processor", lambda: "arm")
    assert runinfo.cpu_model() == "arm"
    monkeypatch.setattr(runinfo.platform, "processor", lambda: "")
    assert runinfo.cpu_model() == "aarch64"


def test_device_name_is_the_cpu_model_core_count_and_capability(monkeypatch):
    monkeypatch.setattr(runinfo, "cpu_model", lambda: "Some CPU")
    monkeypatch.setattr(runinfo.os, "cpu_count", lambda: 7)
    capability = torch.backends.cpu.get_cpu_capability()
    assert runinfo.device_name(torch.device("cpu")) == f"Some CPU (7 cores, {capability})"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    assert runinfo.device_name(torch.device("cuda")) == "Some GPU"


def test_package_versions_name_each_package_and_backend(monkeypatch):
    import hydra
    import numpy as np

    import mptex

    monkeypatch.setattr(runinfo, "has_tcnn", lambda: True)
    monkeypatch.setattr(runinfo, "has_nvdiffrast", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert runinfo.package_versions() == {
        "mptex": mptex.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "numpy": np.__version__,
        "hydra": hydra.__version__, "cuda": "12.8",
        "tcnn_available": True, "nvdiffrast_available": False,
    }  # fmt: skip


def test_reproducible_blas_keeps_the_users_mkl_setting(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    runinfo.reproducible_blas()
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"
    monkeypatch.delenv("MKL_CBWR")
    runinfo.reproducible_blas()
    assert os.environ["MKL_CBWR"] == "AUTO,STRICT"


def test_progress_counts_iterations_and_leaves_out_missing_values(capsys):
    bar = runinfo.Progress(total=10, initial=2, enabled=True)
    assert bar.bar.n == 2 and bar.bar.total == 10
    bar.update(loss=0.5, psnr=None)
    assert bar.bar.n == 3 and bar.bar.postfix == "loss=0.5"
    bar.close()
    off = runinfo.Progress(total=10, initial=0, enabled=False)
    off.update(loss=1.0)
    off.close()
    assert off.bar is None
    # "auto": a bar only on a terminal; pytest's captured stdout is none
    assert runinfo.Progress(total=10, initial=0, enabled="auto").bar is None


def test_tensorboard_writer_only_when_enabled(tmp_path, capsys):
    assert runinfo.tensorboard_writer(tmp_path, False) is None
    assert capsys.readouterr().err == "" and not (tmp_path / "tensorboard").exists()


# ----------------------------------------------------------------------------- device check
def _config(device):
    return OmegaConf.create({"train": {"device": device}})


def test_the_device_callback_lets_auto_and_the_cpu_through():
    callback = RequireDeviceCallback()
    for device in ("auto", "cpu"):
        callback.on_run_start(_config(device))
        callback.on_multirun_start(_config(device))


def test_the_device_callback_refuses_an_unknown_device_in_one_line(monkeypatch, capsys):
    callback = RequireDeviceCallback()
    with pytest.raises(SystemExit) as stop:
        callback.on_run_start(_config("gpu"))
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "mptex-train: error: train.device: expected auto, cpu, cuda or cuda:N, got 'gpu' "
        "(train.device=gpu)"
    ]

    class Exited(Exception):
        pass

    def exit_now(code):
        raise Exited(code)

    # At a multirun's start the refusal leaves at once (the report callback's exit hook would
    # add a second line): os._exit with the same status.
    monkeypatch.setattr(device_check.os, "_exit", exit_now)
    with pytest.raises(Exited) as left:
        callback.on_multirun_start(_config("gpu"))
    assert left.value.args == (2,)
    assert capsys.readouterr().err.endswith("(train.device=gpu)\n")


def test_a_cuda_index_beyond_the_machines_devices_is_refused(monkeypatch):
    # A machine modelled with one CUDA device.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_backends, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_check.device_problem("cuda:0") is None
    assert device_check.device_problem("cuda") is None
    assert device_check.device_problem("cuda:3") == "cuda:3 requested, 1 CUDA device(s) here"


# ----------------------------------------------------------------------------- host copies
def test_to_host_keeps_tuples_and_detaches_inside_them():
    leaf = torch.ones(2, requires_grad=True)
    host = to_host((leaf * 2, [leaf], {"k": (leaf,)}, None))
    assert type(host) is tuple and type(host[1]) is list and type(host[2]["k"]) is tuple
    for tensor in (host[0], host[1][0], host[2]["k"][0]):
        assert not tensor.requires_grad and tensor.device.type == "cpu"
    assert torch.equal(host[0], torch.full((2,), 2.0)) and host[3] is None
    # a namedtuple keeps its type and fields
    Pair = collections.namedtuple("Pair", "value grad")
    pair = to_host(Pair(leaf * 3, None))
    assert type(pair) is Pair and pair.grad is None and not pair.value.requires_grad
    assert torch.equal(pair.value, torch.full((2,), 3.0))


# ----------------------------------------------------------------------------- backends
def test_a_library_that_fails_to_load_is_missing_not_an_error(monkeypatch):
    # tinycudann raises OSError when its CUDA libraries are missing.
    def load(name):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(_backends.importlib, "import_module", load)
    assert _backends._try_import.__wrapped__("tinycudann") == (
        None, "OSError: libcuda.so.1: cannot open shared object file"
    )  # fmt: skip


def test_backend_availability_follows_the_device_each_needs(monkeypatch):
    module = types.ModuleType("stand_in")
    monkeypatch.setattr(_backends, "_try_import", lambda name: (module, ""))
    monkeypatch.setattr(_backends, "_cuda_available", lambda: False)
    # tcnn and nvdiffrast need a CUDA device; triton's interpreter runs on the CPU.
    assert not _backends.has_tcnn() and not _backends.has_nvdiffrast()
    assert _backends.has_triton()
    assert _backends.backend_problem("triton") is None
    assert _backends.backend_problem("tcnn") == "torch.cuda.is_available() is False"
    assert _backends.unavailable_message("triton", "backend") is None


def test_an_unimportable_backend_is_named_with_its_install_line(monkeypatch):
    monkeypatch.setattr(_backends, "_cuda_available", lambda: True)
    monkeypatch.setattr(_backends, "_try_import",
                        lambda name: (None, f"ImportError: no {name}"))  # fmt: skip
    assert _backends.backend_problem("nvdiffrast") == (
        "nvdiffrast is not importable (ImportError: no nvdiffrast.torch); "
        "pip install git+https://github.com/NVlabs/nvdiffrast/"
    )
    # triton needs no CUDA device, and the caller's "instead" replaces the default advice
    assert _backends.unavailable_message("triton", "encoder.backend", "use 'torch'") == (
        "encoder.backend='triton' needs triton: triton is not importable (ImportError: no "
        "triton); it ships with PyTorch's CUDA/ROCm builds, or pip install triton; use 'torch'"
    )
    with pytest.raises(RuntimeError, match=r"^backend='tcnn' needs tinycudann and a CUDA device"):
        _backends.import_tcnn()


def test_the_fallback_warning_comes_once_per_what_and_reason():
    what = f"Stand-in(backend='auto') {id(object())}"  # a key no other test warned with

    def build(reason):
        _backends.warn_fallback_once(what, reason)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno
        build("x is not importable")
        build("x is not importable")
        build("y is not importable")
    assert [(w.category, str(w.message)) for w in caught] == [
        (RuntimeWarning, f"{what}: using the pure-PyTorch backend (x is not importable)"),
        (RuntimeWarning, f"{what}: using the pure-PyTorch backend (y is not importable)"),
    ]
    # The warning points two frames above itself, at the code that asked for the module
    # (here the calls of build, which stands for a module's constructor).
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line + 1), (__file__, line + 3)]


class _Owner:
    """What ``tcnn_module_sharing`` reads of a HashGridEncoding or FullyFusedMLP."""

    def __init__(self, n_params):
        self.params = torch.zeros(n_params)
        self.n_params = n_params
        self._tcnn_module = None


class _Native:
    def __init__(self, n_params):
        self.params = torch.ones(n_params)
        self.moved_to = None

    def to(self, device):
        self.moved_to = device
        return self


def test_the_native_module_is_built_once_per_device_and_shares_the_params():
    owner, built = _Owner(6), []

    def build():
        built.append(_Native(6))
        return built[-1]

    first = _backends.tcnn_module_sharing(owner, build)
    again = _backends.tcnn_module_sharing(owner, build)
    assert first is again is built[0] and len(built) == 1
    assert first.params is owner.params and first.moved_to == torch.device("cpu")
    owner.params = torch.zeros(6, device="meta")  # moved to another device: rebuilt there
    moved = _backends.tcnn_module_sharing(owner, build)
    assert len(built) == 2 and moved is built[1] and moved.params is owner.params
    assert moved.moved_to == torch.device("meta")
    with pytest.raises(RuntimeError, match="tinycudann has 5 params, mptex computed 6"):
        _backends.tcnn_module_sharing(_Owner(6), lambda: _Native(5))


def test_available_bytes_reads_memavailable_then_the_page_counts(monkeypatch):
    meminfo = "MemTotal:       16000 kB\nMemFree:         3000 kB\nMemAvailable:    7000 kB\n"
    monkeypatch.setattr(_backends, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert _backends.available_bytes(None) == 7000 * 1024
    assert _backends.available_bytes("cpu") == 7000 * 1024

    def no_proc(path):
        raise OSError("no /proc")

    pages = {"SC_AVPHYS_PAGES": 11, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(_backends, "open", no_proc, raising=False)
    monkeypatch.setattr(_backends.os, "sysconf", lambda name: pages[name])
    assert _backends.available_bytes(torch.device("cpu")) == 11 * 4096
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _backends.available_bytes("cuda") is None
    assert _backends.available_bytes("meta") is None


# ----------------------------------------------------------------------------- overhead counter
def test_the_counter_on_a_hand_made_sequence_of_ops():
    generator = torch.Generator().manual_seed(3)
    counter = OverheadCounter(torch.device("cpu"), host_generators=[generator])
    originals = (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.new_tensor,
                 torch.tensor, torch.as_tensor)  # fmt: skip
    undo = patch_host_reads([counter])
    try:
        x = torch.arange(6.0)  # the run's data
        repeats = torch.arange(6) % 3  # [0, 1, 2, 0, 1, 2]: 6 elements out
        rgb, alpha = torch.ones(2, 3), torch.full((2, 1), 0.5)
        with counter:
            noise = torch.rand(3, generator=generator)  # host draw: no launch
            noise * 2  # host data only
            noise.tolist()  # a host tensor's read waits for nothing
            torch.tensor([1.0, 2.0])  # host data made without a device: no launch
            torch.equal(x, x)  # op 1, a read
            torch.masked_select(x, x > 2)  # ops 2 (gt) and 3, data-sized
            torch.repeat_interleave(x, repeats, output_size=6)  # ops 4, 5: sized in advance
            torch.repeat_interleave(repeats)  # op 6, data-sized
            (x > 1)[x.long()]  # ops 7 (gt), 8 (_to_copy), 9 (index): a bool tensor, int index
            x.new_tensor([1.0])  # new data beside the run's: a host-to-device copy
            torch.zeros(2)  # op 10: a factory is a launch
            composite(rgb, alpha, x[:3])  # ops 11-13 in mptex: bg + (rgb - bg) * alpha
            counter.phase = "validate"
            x + 1  # op 1 of the validation
            counter.record_launch("a_triton_kernel")  # op 2 of the validation
            noise + 1  # host data only
            x.tolist()  # the run's data read on the host
            torch.as_tensor(x, device="cpu")  # already there: no copy, x stays the run's
            x.tolist()  # so this read is counted too
    finally:
        undo()
    assert (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.new_tensor,
            torch.tensor, torch.as_tensor) == originals  # fmt: skip
    assert dict(counter.host_ops) == {("step", "rand"): 1, ("step", "mul"): 1,
                                      ("validate", "add"): 1}  # fmt: skip
    assert dict(counter.ops) == {
        ("step", "equal"): 1, ("step", "gt"): 2, ("step", "masked_select"): 1,
        ("step", "repeat_interleave"): 2, ("step", "index_select"): 1,
        ("step", "_to_copy"): 1, ("step", "index"): 1, ("step", "zeros"): 1,
        ("step", "sub"): 1, ("step", "mul"): 1, ("step", "add"): 1,
        ("validate", "add"): 1, ("validate", "a_triton_kernel"): 1,
    }  # fmt: skip
    assert dict(counter.syncs) == {
        ("step", "read (.item/bool/float)"): 1,
        ("step", "data-sized (masked_select)"): 1,
        ("step", "data-sized (repeat_interleave)"): 1,
        ("step", "host-to-device (torch.tensor)"): 1,
        ("validate", "copy to host (tolist)"): 2,
    }
    # A sync is sited at its caller's frames in the package (none here), never at the
    # counter's own wrappers.
    assert {site for phase, kind, site in counter.sites} == {"(outside mptex)"}
    # Ops are filed under the innermost file of the package that made them (its path alone),
    # and sited at its function; this test file is outside the package.
    assert dict(counter.op_files) == {
        ("step", "(outside mptex)"): 10, ("step", "mptex/train/shading.py"): 3,
        ("validate", "(outside mptex)"): 2,
    }  # fmt: skip
    sites = {(op, site) for phase, op, site in counter.op_sites if "shading" in site}
    assert {op for op, _ in sites} == {"sub", "mul", "add"}
    assert all(re.fullmatch(r"mptex/train/shading\.py:\d+ composite", site) for _, site in sites)


# ----------------------------------------------------------------------------- thread check
def test_thread_check_copies_written_lists_and_draws_random_numbers_once():
    threads = torch.get_num_threads()
    try:
        a, b = torch.zeros(3), torch.zeros(2)
        generator = torch.Generator().manual_seed(5)
        with thread_check.make_checker(show=0) as checker:
            torch._foreach_add_([a, b], 1.0)  # writes a list of tensors: applied once
            drawn = torch.rand(4, generator=generator)
            after = torch.get_num_threads()
        assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.ones(2))
        want = torch.Generator().manual_seed(5)
        assert torch.equal(drawn, torch.rand(4, generator=want))
        assert torch.equal(torch.rand(2, generator=generator), torch.rand(2, generator=want))
        assert after == 2  # the run goes on with the 2-thread results
        assert checker.ops == 1 and not checker.differing
    finally:
        torch.set_num_threads(threads)


def test_thread_check_compares_nan_as_equal_and_keeps_strides():
    assert thread_check._same(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    assert not thread_check._same(
        torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 2.0])
    )
    assert thread_check._same(3, 4)  # not tensors: nothing to compare
    value = torch.arange(6.0).reshape(2, 3).t()
    copy = thread_check._copy([value])[0]
    assert copy.stride() == value.stride() and torch.equal(copy, value)
    assert copy.data_ptr() != value.data_ptr()


def test_thread_check_tells_nan_and_infinities_from_numbers():
    # NaN equals NaN for this comparison, and nothing else: a NaN or an infinity in one run
    # where the other has a number is a difference.
    nan, inf = float("nan"), float("inf")
    for one, two in ((nan, 1.0), (inf, 2.0), (-inf, 3.0), (nan, inf), (nan, 0.0)):
        assert not thread_check._same(torch.tensor([one]), torch.tensor([two])), (one, two)
    assert thread_check._same(torch.tensor([nan, inf, -inf]), torch.tensor([nan, inf, -inf]))


def test_thread_check_prints_the_first_show_differing_ops(monkeypatch, capsys):
    threads = torch.get_num_threads()
    monkeypatch.setattr(thread_check, "_same", lambda a, b: False)  # every op differs
    x = torch.ones(2)
    try:
        with thread_check.make_checker(show=2) as checker:
            for _ in range(4):
                x + 1
    finally:
        torch.set_num_threads(threads)
    printed = [line for line in capsys.readouterr().out.splitlines() if " differs; " in line]
    assert len(printed) == 2 and printed[0].startswith("op 1: aten.add.Tensor differs")
    assert checker.differing["aten.add.Tensor"] == 4
