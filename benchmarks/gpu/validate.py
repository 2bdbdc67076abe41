"""mptex's GPU kit: one command that verifies and measures mptex against tinycudann and nvdiffrast.

Usage, on the GPU machine, from the checkout's root (docs/gpu.md has the whole procedure)::

    python3 benchmarks/gpu/validate.py --kit gpu-kit --out results/
    python benchmarks/gpu/validate.py --device cpu --out /tmp/kit-dry-run   # the CPU dry run

``--kit DIR`` (made by ``benchmarks/gpu/pack_kit.sh``) holds wheels: tinycudann and nvdiffrast
built by ``build_wheels.sh`` and the pure-Python packages mptex needs that a bare GPU image may
lack; they are installed with ``pip install --no-index --no-deps --target`` into a scratch folder
first, so the machine needs no network and builds nothing. Then the stages run in order of
value, each in a process of its own with a time box, each writing its result into
``results.json`` and ``results.md`` in ``--out`` before the next starts (a stage that fails or
runs out of time is recorded and the next one runs):

=============  ==============================================================================
env            device, driver, versions; whether tinycudann, nvdiffrast and triton import
loss           the training loss's image term in its Triton kernels vs eager torch at 512²,
               batch 4: dL/dpred bit-equal (the claim), loss values, forward+backward times
golden         recapture the golden tensors of tinycudann and nvdiffrast on the test suite's
               cases and compare them with the committed fixtures (a new library version or GPU
               shows up as arrays no longer bit-equal), then run the twins' golden tests on them
tests          the test suite's tests marked requires_cuda / requires_tcnn / requires_nvdiffrast
arms           every precision arm at nvdiffrec's scale (512², batch 4, nvdiffrec's texture),
               f32 and the judged arms first: ms / iteration (the loop's own synchronised
               median) and its ratio to f32's against the loop's targets, each run's wall time
               and start, peak memory, PSNR (``stage_arms``)
profile        the main arms under torch.profiler: ms / iteration, launches, host
               synchronisations, device time per loop part; host floors; f32's host
               synchronisations counted (``stages_loop.stage_profile``)
nvdiffrec154   nvdiffrec #154 at 512², batch 4: ``nvdiffrec`` vs ``tcnn_fused_swap154``, as
               many seeds as the time box allows, the paired PSNR difference with its interval
grid           tcnn's grid vs the torch twin, same parameters: forward max |err|, parameter-
               gradient relative error, f32 and half, nvdiffrec's config and two others
network        tcnn.Network (FullyFusedMLP) vs the twin: outputs, input and weight gradients
               as median / p99 / max ULP of half
raster         nvdiffrast vs the torch rasterizer: triangle-id agreement, barycentric and
               interpolated-attribute max error, the built-in scene's mesh and a mesh file
fp8            mptex's FP8 GEMM emulation vs ``torch._scaled_mm`` (FP8 tensor cores, compute
               capability 8.9+) on the same float8 operands and scales: the MLP's forward,
               input- and weight-gradient shapes, errors against float64, and their times
throughput     the grid's forward and forward+backward at 2^18 and 2^20 points: torch, Triton
               and tcnn in one process
mainjob        only when named: ``mptex-train -m +experiment=gpu_main`` as a user runs it, its
               wall time against 10 minutes (``stages_loop.stage_mainjob``)
=============  ==============================================================================

A stage that needs tinycudann or nvdiffrast and cannot import it, or FP8 tensor cores the
device does not have, is marked "unavailable" with the reason. ``--device cpu`` (the dry run CI
makes) runs every stage at small sizes, so the script cannot rot between GPU runs; its numbers
are not measurements of anything.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# When the command started (the standard library's imports take milliseconds): every box
# counts from here, so that the imports, torch's start and the kit's installation are inside
# --budget-s, as they are inside the time limit of the command that runs the kit.
STARTED = time.time()
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import stages_loop  # noqa: E402  (benchmarks/gpu/stages_loop.py: the profile and mainjob stages)

RESULTS_JSON, RESULTS_MD, LOG = "results.json", "results.md", "log.txt"


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    seconds: float  # time box on a GPU; --device cpu uses its own small sizes
    # "tcnn", "nvdiffrast", "fp8", "triton": unavailable without them
    needs: tuple[str, ...] = ()


# In order of value: with little GPU time, the first ones run. ``mainjob`` (the main job's
# target is 10 minutes) is not in the default run; it runs in a call of its own, whose box must
# fit the machine's limit on one command: ``--stages mainjob --budget-s 560`` (docs/gpu.md).
# ``arms`` (the loop's speed targets) comes before ``profile`` (what explains them).
STAGES = [
    Stage("env", "Environment", 40),
    Stage("loss", "The training loss fused (Triton) vs eager", 40, ("triton",)),
    Stage(
        "golden",
        "Golden tensors: the libraries vs the committed fixtures",
        60,
        ("tcnn", "nvdiffrast"),
    ),
    Stage("tests", "The test suite's GPU tests", 60),
    Stage("arms", "Every arm at nvdiffrec's scale", 180),
    Stage("profile", "The training loop under the profiler", 150),
    Stage("nvdiffrec154", "nvdiffrec #154 at nvdiffrec's scale", 110),
    Stage("grid", "Hash grid: tcnn vs the torch twin", 45, ("tcnn",)),
    Stage("network", "FullyFusedMLP: tcnn.Network vs the twin", 45, ("tcnn",)),
    Stage("raster", "Rasterizer: nvdiffrast vs the torch twin", 40, ("nvdiffrast",)),
    Stage("fp8", "FP8 GEMMs: emulation, torch._scaled_mm, Triton", 45, ("fp8",)),
    Stage("throughput", "Hash-grid throughput: torch, Triton, tcnn", 50),
    Stage("mainjob", "The GPU main job (experiments/gpu_main.yaml)", 540),
]
DEFAULT_STAGES = [s.name for s in STAGES if s.name != "mainjob"]
STAGE_NAMES = [s.name for s in STAGES]


# --------------------------------------------------------------------------- comparisons
# Grid configs compared: nvdiffrec's (16 hashed-and-dense levels up to 4096, 2^19 entries),
# a coarse one (dense levels then hashed, small table: collisions) and a 2-D smoothstep one.
GRID_CONFIGS = {
    "nvdiffrec": dict(
        n_input_dims=3,
        n_levels=16,
        n_features_per_level=2,
        log2_hashmap_size=19,
        base_resolution=16,
        per_level_scale=1.4472692374403782,
    ),
    "coarse": dict(
        n_input_dims=3,
        n_levels=4,
        n_features_per_level=2,
        log2_hashmap_size=12,
        base_resolution=4,
        per_level_scale=2.0,
    ),
    "2d-smoothstep": dict(
        n_input_dims=2,
        n_levels=8,
        n_features_per_level=4,
        log2_hashmap_size=14,
        base_resolution=8,
        per_level_scale=1.5,
        interpolation="Smoothstep",
    ),
}
# The twin's stated agreement with tcnn 2.0 (tests/test_encoding.py,
# test_torch_backend_matches_tcnn), with tcnn's level scales (exp2="auto" evaluates them with the
# GPU's own ex2.approx.ftz.f32): outputs bit-equal on >= 99.9 % of values, f32 within 2.5e-7 and
# half within 2^-11 elsewhere (the golden tensors of tests/gpu_golden/ are 100 % bit-equal);
# parameter gradients are summed by atomics in an order that varies, in float32 for the f32
# grid (relative norm error 1e-6) and in half for the half grid (4e-3, the coarse config's
# 1.6e-3 measured with 2048 points, and more terms per entry here).
GRID_GRAD_POINTS = 2048
GRID_TOLERANCE = {
    "float32": {"forward_atol": 2.5e-7, "forward_equal": 0.999, "grad_rel": 1e-6},
    "float16": {"forward_atol": 2**-11, "forward_equal": 0.999, "grad_rel": 4e-3},
}


def compare_grid(device: str, native: str, configs: dict, n_points: int, seed: int = 0) -> list:
    """The twin (``backend="torch"``) and ``native`` on the same parameters and points.

    Parameters are drawn from U(-1, 1) (the initial U(-1e-4, 1e-4) would hide relative errors);
    the cotangent is N(0, 1); the forward runs on every point, the parameter gradient on the
    first ``GRID_GRAD_POINTS``. Returns one dict per (config, dtype).
    """
    import torch

    from mptex import HashGridEncoding

    rows = []
    for name, config in configs.items():
        for dtype in (torch.float32, torch.float16):
            cfg = dict(config)
            dims = cfg.pop("n_input_dims")
            enc = HashGridEncoding(
                dims, **cfg, backend="torch", dtype=dtype, device=device, seed=seed
            )
            gen = torch.Generator(device="cpu").manual_seed(seed)
            with torch.no_grad():
                enc.params.copy_(torch.rand(enc.n_params, generator=gen) * 2 - 1)
            x = torch.rand(n_points, dims, generator=gen).to(device)
            v = torch.randn(n_points, enc.n_output_dims, generator=gen).to(device)
            results = {}
            for backend in ("torch", native):
                enc.backend = backend
                with torch.no_grad():
                    out = enc(x)
                # The gradient over the first GRID_GRAD_POINTS points only: tcnn's half table
                # sums its atomics in half, so its rounding error grows with the terms per entry
                # (at 2^18 points the coarse config's is 1.5e-2, measured on an H100).
                out_g = enc(x[:GRID_GRAD_POINTS])
                grad = torch.autograd.grad(
                    (out_g.float() * v[:GRID_GRAD_POINTS]).sum(), enc.params
                )[0]
                results[backend] = (out.float(), grad)
            (out_t, g_t), (out_n, g_n) = results["torch"], results[native]
            tol = GRID_TOLERANCE[str(dtype)[6:]]
            forward_err = float((out_t - out_n).abs().max())
            forward_equal = float((out_t == out_n).float().mean())
            grad_rel = float((g_t - g_n).norm() / g_n.norm().clamp_min(1e-30))
            rows.append(
                {
                    "config": name,
                    "dtype": str(dtype)[6:],
                    "points": n_points,
                    "forward_max_abs_err": forward_err,
                    "forward_atol": tol["forward_atol"],
                    "forward_equal": forward_equal,
                    "grad_rel_err": grad_rel,
                    "grad_rel_tol": tol["grad_rel"],
                    "ok": forward_err <= tol["forward_atol"]
                    and forward_equal >= tol["forward_equal"]
                    and grad_rel <= tol["grad_rel"],
                }
            )
    return rows


# FullyFusedMLP configs: nvdiffrec's texture MLP as tcnn's fused network (32 inputs from the
# grid, 3 outputs), a 9-channel texture of width 64, and tcnn's default network.
NETWORK_CONFIGS = {
    "32x2 (texture)": (32, 3, {"n_neurons": 32, "n_hidden_layers": 2}),
    "64x3, 9 out": (32, 9, {"n_neurons": 64, "n_hidden_layers": 3}),
    "128x5 (tcnn default)": (27, 16, {"n_neurons": 128, "n_hidden_layers": 5}),
}
# The twin's stated agreement with tcnn 2.0: on compute capability 9.0 (H100, H200), where its
# model of the tensor core's half accumulation was measured (tests/gpu_golden/network.npz),
# every output and gradient bit-equal; on other GPUs, whose tensor cores may align and round
# their partial sums otherwise, outputs within rtol = atol = 2e-3 (two half ulps) and gradients
# within 1 % (tests/test_network.py, test_twin_matches_tcnn_network).
NETWORK_TOLERANCE = {
    "output": (2e-3, 2e-3),
    "input_grad": (1e-2, 1e-5),
    "weight_grad": (1e-2, 1e-4),
}
NETWORK_EXACT_CAPABILITY = (9, 0)


def network_tolerance(device: str) -> dict[str, tuple[float, float]]:
    """(rtol, atol) per quantity: zero where the twin's bits were measured equal to tcnn's."""
    import torch

    if (
        device.startswith("cuda")
        and torch.cuda.get_device_capability(device) == NETWORK_EXACT_CAPABILITY
    ):
        return {key: (0.0, 0.0) for key in NETWORK_TOLERANCE}
    return dict(NETWORK_TOLERANCE)


def compare_network(device: str, native: str, configs: dict, n_points: int, seed: int = 0) -> list:
    """The twin and ``native`` on the same weights, inputs U(-1, 1) and half cotangent
    N(0, 1e-3^2) (the scale of a training step's gradient after tcnn's x128)."""
    import torch

    from mptex import FullyFusedMLP
    from mptex.diagnostics import outside_tolerance, ulp_summary

    rows, tolerance = [], network_tolerance(device)
    for name, (n_in, n_out, net_cfg) in configs.items():
        config = {
            "otype": "FullyFusedMLP",
            "activation": "ReLU",
            "output_activation": "None",
            **net_cfg,
        }
        net = FullyFusedMLP(n_in, n_out, config, backend="torch", seed=1337, device=device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x0 = (torch.rand(n_points, n_in, generator=gen) * 2 - 1).to(device)
        cot = (torch.randn(n_points, n_out, generator=gen) * 1e-3).half().to(device)
        results = {}
        for backend in ("torch", native):
            net.backend = backend
            net.params.grad = None
            x = x0.clone().requires_grad_(True)
            out = net(x)
            out.backward(cot)
            results[backend] = (out.detach(), x.grad.detach(), net.params.grad.detach().clone())
        row: dict[str, Any] = {"config": name, "points": n_points, "ok": True}
        for key, a, b in zip(
            ("output", "input_grad", "weight_grad"), results["torch"], results[native]
        ):
            row[key] = ulp_summary(a, b)
            rtol, atol = tolerance[key]
            row[key]["outside_tol"] = outside_tolerance(a.float(), b.float(), rtol, atol)
            row["ok"] = row["ok"] and row[key]["outside_tol"] == 0.0
        rows.append(row)
    return rows


def raster_meshes(device: str, mesh_path: str | None) -> dict:
    """The built-in scene's torus knot and, where given, a mesh file (normalised to unit size)."""
    from mptex.render import load_obj, unit_size
    from mptex.scenes import torus_knot

    meshes = {"builtin (torus knot)": torus_knot(200, 24)}
    if mesh_path:
        meshes[Path(mesh_path).name] = unit_size(load_obj(mesh_path))
    return {name: mesh.to(device) for name, mesh in meshes.items()}


# The twin's stated agreement with nvdiffrast 0.4.0 (tests/test_render_rasterize.py): ids on
# 99.98 % of covered pixels (a remaining pixel may be a sample exactly on a vertex or a clipping
# corner case; the golden meshes had none), barycentrics and z/w within 1e-6 (float32 arithmetic
# of the output kernel, reproduced with its fused multiply-adds), interpolation within 1e-5.
RASTER_TOLERANCE = {"id_agreement": 0.9998, "bary": 1e-6, "depth": 1e-6, "interp": 1e-5}


def compare_raster(device: str, native: str, meshes: dict, resolution: int, n_views: int) -> list:
    """Rasterize each mesh from ``n_views`` random views (nvdiffrec's camera distribution) with
    the torch twin and ``native``; interpolate the vertex positions through ``native``'s
    rasterization with both backends.

    The twin's stated agreement (tests/test_render_rasterize.py, test_torch_matches_nvdiffrast):
    ids equal on >= 99.98 % of covered pixels, barycentrics and z/w within 1e-6 where ids agree,
    interpolation within 1e-5 (``RASTER_TOLERANCE``). The twin reproduces nvdiffrast 0.4.0's
    snapping, edge tie rule, clipping and fixed-point depth; on the golden meshes captured on an
    H100 (tests/gpu_golden/) ids agree everywhere and barycentrics are bit-equal.
    """
    import torch
    import torch.nn.functional as F

    from mptex.render import interpolate, random_views, rasterize

    gen = torch.Generator(device="cpu").manual_seed(0)
    cams = random_views(n_views, generator=gen, device=device)
    rows = []
    for name, mesh in meshes.items():
        clip = F.pad(mesh.v_pos, (0, 1), value=1.0).unsqueeze(0) @ cams.mvp.transpose(1, 2)
        res = (resolution, resolution)
        rast = {b: rasterize(clip, mesh.t_pos_idx, res, backend=b)[0] for b in ("torch", native)}
        ours, ref = rast["torch"], rast[native]
        covered = (ours[..., 3] > 0) | (ref[..., 3] > 0)
        same = (ours[..., 3] == ref[..., 3]) & covered
        agree = float(same.sum() / covered.sum().clamp_min(1))
        bary_err = float((ours[..., :2] - ref[..., :2]).abs()[same].max()) if same.any() else 0.0
        depth_err = float((ours[..., 2] - ref[..., 2]).abs()[same].max()) if same.any() else 0.0
        attr = {
            b: interpolate(mesh.v_pos, ref, mesh.t_pos_idx, backend=b)[0] for b in ("torch", native)
        }
        interp_err = float((attr["torch"] - attr[native]).abs().max())
        rows.append(
            {
                "mesh": name,
                "triangles": int(mesh.t_pos_idx.shape[0]),
                "views": n_views,
                "resolution": resolution,
                "covered_pixels": int(covered.sum()),
                "id_agreement": agree,
                "bary_max_err": bary_err,
                "depth_max_err": depth_err,
                "interp_max_err": interp_err,
                "ok": agree >= RASTER_TOLERANCE["id_agreement"]
                and bary_err <= RASTER_TOLERANCE["bary"]
                and depth_err <= RASTER_TOLERANCE["depth"]
                and interp_err <= RASTER_TOLERANCE["interp"],
            }
        )
    return rows


# FP8 GEMM shapes of the texture's MLP (nvdiffrec's: 32 inputs, width 32, 3 outputs) at a batch
# of n + 5 points (the covered pixels are any number, here not a multiple of 16: the rows M
# pass unpadded, the weight gradient's K is padded): the forward of a hidden layer and of the
# output layer, and the backward GEMMs of both (the output layer's input gradient has K = 3).
def fp8_gemm_cases(n: int) -> list[tuple[str, int, int, int, str, str]]:
    """(name, M, K, N, dtype of a, dtype of b)."""
    rows = n + 5
    return [
        ("forward, hidden layer", rows, 32, 32, "e4m3", "e4m3"),
        ("forward, output layer", rows, 32, 3, "e4m3", "e4m3"),
        ("input gradient", rows, 32, 32, "e5m2", "e4m3"),
        ("input gradient, output layer", rows, 3, 32, "e5m2", "e4m3"),
        ("weight gradient", 32, rows, 32, "e5m2", "e4m3"),
        ("weight gradient, output layer", 3, rows, 32, "e5m2", "e4m3"),
    ]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# An FP8 tensor-core GEMM keeps about 14 bits in its accumulation (measured on H800, DeepSeek-V3
# technical report, section 3.3.2) over a block of K before the partial sum is promoted to
# float32; the bound assumes blocks of 128 (that report's promotion interval) and float32 beyond.
# The emulation accumulates in float32 (24 bits) all along.
FP8_ACCUMULATION_BITS = 14
FP8_PROMOTION_BLOCK = 128


def compare_fp8(device: str, n: int, repeats: int = 20) -> list[dict[str, Any]]:
    """Each case's emulated, torch._scaled_mm and (where it runs) Triton GEMM on the same
    quantised operands: errors against float64 as a share of sum |a b| |alpha| (the
    accumulation bound's scale), and median times over ``repeats`` calls."""
    import torch

    from mptex.fp8 import E4M3, E5M2, fp8_scale, quantize_fp8, scaled_mm, triton_gemm_problem

    dtypes = {"e4m3": E4M3, "e5m2": E5M2}
    gen = torch.Generator(device=device).manual_seed(0)
    backends = ["emulated", "scaled_mm"]
    if triton_gemm_problem(device) is None:
        backends.append("triton")
    rows = []
    for name, m, k, n_cols, da, db in fp8_gemm_cases(n):
        a = torch.randn(m, k, device=device, generator=gen) * (1e-4 if da == "e5m2" else 1.0)
        b = torch.randn(k, n_cols, device=device, generator=gen) * 0.3
        qa, sa, _, _ = quantize_fp8(a, fp8_scale(a.abs().max(), dtypes[da]), dtypes[da])
        qb, sb, _, _ = quantize_fp8(b, fp8_scale(b.abs().max(), dtypes[db]), dtypes[db])
        alpha = sa.double() * sb.double()
        reference = (qa.double() @ qb.double()) * alpha
        magnitude = ((qa.double().abs() @ qb.double().abs()) * alpha.abs()).clamp_min(1e-300)
        row: dict[str, Any] = {"case": name, "shape": f"{m} x {k} x {n_cols}", "k": k}
        for backend in backends:
            out = scaled_mm(qa, qb, sa, sb, backend=backend)
            row[f"{backend}_err"] = float(((out.double() - reference).abs() / magnitude).max())
            times = []
            for _ in range(repeats):
                _sync(device)
                tick = time.perf_counter()
                scaled_mm(qa, qb, sa, sb, backend=backend)
                _sync(device)
                times.append(time.perf_counter() - tick)
            row[f"{backend}_us"] = sorted(times)[len(times) // 2] * 1e6
        row["emulated_bound"] = (k + 2) * 2.0**-24
        # The Triton kernels accumulate on the same tensor cores: the same bound.
        row["scaled_mm_bound"] = row["triton_bound"] = (
            min(k, FP8_PROMOTION_BLOCK) * 2.0**-FP8_ACCUMULATION_BITS + (k + 2) * 2.0**-24
        )
        row["ok"] = all(row[f"{b}_err"] <= row[f"{b}_bound"] for b in backends)
        for key in ("triton_err", "triton_us"):
            row.setdefault(key, None)  # not run on this device
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- stage bodies
class StageContext:
    """What a stage's process gets: the options, its deadline, and ``save`` for partial results
    (written at once, so a stage stopped by its time box keeps what it measured)."""

    def __init__(self, args: argparse.Namespace, result_path: Path, deadline: float):
        self.args, self.result_path, self.deadline = args, result_path, deadline
        self.small = args.device == "cpu"
        self.device = args.device
        self.result: dict[str, Any] = {"status": "running", "tables": [], "data": {}}

    def remaining(self) -> float:
        return self.deadline - time.time()

    def table(self, title: str, headers: list[str], rows: list[list[Any]], note: str = "") -> None:
        """Add a table and save: a stage stopped by its box later keeps it (and its data)."""
        self.result["tables"].append(
            {
                "title": title,
                "headers": headers,
                "rows": [[str(c) for c in r] for r in rows],
                "note": note,
            }
        )
        self.save()

    def save(self) -> None:
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.result_path)


def _needs(stage: Stage, args: argparse.Namespace) -> str:
    """'' when the stage's native libraries are usable on ``args.device``, else why not."""
    from mptex import _backends

    device = args.device
    if "fp8" in stage.needs:
        from mptex.fp8 import has_fp8_tensor_cores

        if not device.startswith("cuda"):
            return f"torch._scaled_mm needs a CUDA device with FP8 tensor cores (--device {device})"
        if not has_fp8_tensor_cores(device):
            import torch

            major, minor = torch.cuda.get_device_capability(device)
            return (f"no FP8 tensor cores: compute capability {major}.{minor}, "
                    "torch._scaled_mm's FP8 needs 8.9 or later")  # fmt: skip
    if "triton" in stage.needs:
        import importlib.util

        from mptex.train.fused_loss import fused_loss_problem

        # Found, not imported: on a CPU the stage selects Triton's interpreter before the import.
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (the fused loss's kernels; its interpreter on a CPU)"
        problem = fused_loss_problem(device, "logl1") if device.startswith("cuda") else None
        if problem is not None:
            return f"the fused loss needs {problem}"
    natives = {args.native_grid, args.native_mlp, args.native_raster}
    for lib in stage.needs:
        if lib in ("fp8", "triton"):
            continue
        if lib not in natives:  # pointed at the twin (the kit's own tests)
            continue
        if not device.startswith("cuda"):
            return f"{lib} needs a CUDA device (--device {device})"
        module = {"tcnn": "tinycudann", "nvdiffrast": "nvdiffrast.torch"}[lib]
        ok, why = _backends._try_import(module)
        if ok is None:
            return f"{module} is not importable ({why})"
    return ""


def stage_env(ctx: StageContext) -> None:
    import importlib.metadata as md

    import torch

    from mptex import _backends

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    if ctx.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            env["driver"] = f"unknown ({type(exc).__name__})"
    for dist, module in (
        ("tinycudann", "tinycudann"),
        ("nvdiffrast", "nvdiffrast.torch"),
        ("triton", "triton"),
        ("hydra-core", "hydra"),
    ):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = None
        imported, why = _backends._try_import(module)
        env[dist] = version if imported is not None else f"not importable: {why}"
    if env["triton"] and not str(env["triton"]).startswith("not importable"):
        # The fused logl1 loss computes log and pow with torch's CUDA version's libdevice.
        from mptex.train._loss_triton import torch_libdevice

        path, why = torch_libdevice()
        env["libdevice"] = path or f"not found: needs {why}"
    manifest = Path(ctx.args.kit or "", "manifest.json")
    if ctx.args.kit and manifest.is_file():
        kit = json.loads(manifest.read_text())
        env["kit"] = {k: kit.get(k) for k in ("commit", "dirty", "packed")}
        ctx.result["kit_files"] = kit.get("files")
    ctx.result["data"] = env
    ctx.table(
        "Environment",
        ["what", "value"],
        [[k, json.dumps(v) if isinstance(v, dict) else v] for k, v in env.items()],
    )


def stage_loss(ctx: StageContext) -> None:
    import fused_loss  # benchmarks/gpu/fused_loss.py

    shape = fused_loss.DRY_RUN_SHAPE if ctx.small else fused_loss.SHAPE
    rows = fused_loss.compare_fused_loss(ctx.device, shape, repeats=3 if ctx.small else 20)
    ctx.result["data"]["rows"] = rows
    ctx.table(
        f"train.fused_loss: the loss's terms in Triton vs eager torch, {shape} pixels",
        ["term", "elements", "gradient bit-equal", "max abs diff", "loss eager", "loss fused",
         "eager ms", "fused ms", "ok"],
        [[r["loss"], r["elements"], f"{100 * r['bit_equal']:.4f} %", f"{r['max_abs_diff']:.3g}",
          f"{r['eager_value']:.9g}", f"{r['fused_value']:.9g}", f"{r['eager_ms']:.3f}",
          f"{r['fused_ms']:.3f}", r["ok"]] for r in rows],
        "benchmarks/gpu/fused_loss.py: gradient of 100 x the loss; times: median of 20 forward "
        "and backward calls, synchronised; the loss values are float32 sums in different orders",
    )  # fmt: skip
    failed = [r["loss"] for r in rows if not r["ok"]]
    if failed:
        ctx.result["failed_checks"] = [f"{loss}: the gradient is not the eager one"
                                       for loss in failed]  # fmt: skip


def stage_grid(ctx: StageContext) -> None:
    n = 2**10 if ctx.small else 2**18
    rows = compare_grid(ctx.device, ctx.args.native_grid, GRID_CONFIGS, n)
    ctx.result["data"]["rows"] = rows
    ctx.table(
        f"{ctx.args.native_grid} vs the torch twin, same parameters U(-1, 1), {n} points",
        [
            "config",
            "dtype",
            "forward bit-equal",
            "forward max |err|",
            "tolerance",
            "param-grad rel. err",
            "tolerance",
            "ok",
        ],
        [
            [
                r["config"],
                r["dtype"],
                f"{100 * r['forward_equal']:.3f} %",
                f"{r['forward_max_abs_err']:.3g}",
                f"{r['forward_atol']:.3g}",
                f"{r['grad_rel_err']:.3g}",
                f"{r['grad_rel_tol']:.3g}",
                r["ok"],
            ]
            for r in rows
        ],
        "forward: share of outputs bit-equal (>= 99.9 % required) and max over points and "
        "features; gradient: ||g_twin - g_tcnn|| / ||g_tcnn|| (tcnn sums with atomics in a "
        "varying order, in half for the half grid)",
    )
    if not all(r["ok"] for r in rows):
        ctx.result["failed_checks"] = [f"{r['config']} {r['dtype']}" for r in rows if not r["ok"]]


def stage_network(ctx: StageContext) -> None:
    n = 2**10 + 17 if ctx.small else 2**16 + 17  # not a multiple of 256: tcnn pads the batch
    rows = compare_network(ctx.device, ctx.args.native_mlp, NETWORK_CONFIGS, n)
    ctx.result["data"]["rows"] = rows

    def fmt(s):
        return f"{s['median']:.0f} / {s['p99']:.0f} / {s['max']:.0f} ({100 * s['equal']:.1f} % =)"

    ctx.table(
        f"{ctx.args.native_mlp} vs the twin: half ULPs, median / p99 / max (share equal), "
        f"{n} points",
        ["network", "output", "input grad", "weight grad", "outside stated tol", "ok"],
        [
            [
                r["config"],
                fmt(r["output"]),
                fmt(r["input_grad"]),
                fmt(r["weight_grad"]),
                " / ".join(
                    f"{100 * r[k]['outside_tol']:.2g} %"
                    for k in ("output", "input_grad", "weight_grad")
                ),
                r["ok"],
            ]
            for r in rows
        ],
        "gradients are float32 values of half products; their ULPs are counted after rounding "
        "both to half",
    )
    if not all(r["ok"] for r in rows):
        ctx.result["failed_checks"] = [r["config"] for r in rows if not r["ok"]]


def stage_raster(ctx: StageContext) -> None:
    meshes = raster_meshes(ctx.device, ctx.args.mesh)
    res, views = (64, 2) if ctx.small else (512, 8)
    rows = compare_raster(ctx.device, ctx.args.native_raster, meshes, res, views)
    ctx.result["data"]["rows"] = rows
    ctx.table(
        f"{ctx.args.native_raster} vs the torch rasterizer, {views} random views at {res}²",
        [
            "mesh",
            "triangles",
            "covered px",
            "id agreement",
            "bary max err",
            "depth max err",
            "interp max err",
            "ok",
        ],
        [
            [
                r["mesh"],
                r["triangles"],
                r["covered_pixels"],
                f"{100 * r['id_agreement']:.3f} %",
                f"{r['bary_max_err']:.3g}",
                f"{r['depth_max_err']:.3g}",
                f"{r['interp_max_err']:.3g}",
                r["ok"],
            ]
            for r in rows
        ],
        "errors over pixels whose triangle ids agree; interpolation of vertex positions through "
        "the same (nvdiffrast's) rasterization",
    )
    if not ctx.args.mesh:
        ctx.result["data"]["note"] = "no mesh file given (--mesh, or the kit's duck)"
    if not all(r["ok"] for r in rows):
        ctx.result["failed_checks"] = [r["mesh"] for r in rows if not r["ok"]]


def _train_run(cfg) -> dict:
    from mptex.train import train

    with tempfile.TemporaryDirectory() as run_dir:
        return train(cfg, run_dir)


def stage_fp8(ctx: StageContext) -> None:
    n = 2**12 if ctx.small else 2**20
    rows = compare_fp8(ctx.device, n)
    ctx.result["data"]["rows"] = rows

    def cell(value, spec):
        return "–" if value is None else format(value, spec)

    ctx.table(
        f"mptex's emulation vs torch._scaled_mm and the Triton FP8 GEMMs, the same float8 "
        f"operands and scales, {n + 5} points",
        ["GEMM", "M x K x N", "emulated err", "bound", "_scaled_mm err", "Triton err", "bound",
         "emulated µs", "_scaled_mm µs", "Triton µs", "ok"],
        [[r["case"], r["shape"], f"{r['emulated_err']:.3g}", f"{r['emulated_bound']:.3g}",
          f"{r['scaled_mm_err']:.3g}", cell(r["triton_err"], ".3g"),
          f"{r['scaled_mm_bound']:.3g}", f"{r['emulated_us']:.1f}", f"{r['scaled_mm_us']:.1f}",
          cell(r["triton_us"], ".1f"), r["ok"]] for r in rows],
        "err: max |result - float64| / (sum |a b| |scale_a scale_b|); bounds (K + 2) x 2^-24 "
        f"(float32 accumulation) and, for both tensor-core backends, min(K, "
        f"{FP8_PROMOTION_BLOCK}) x 2^-{FP8_ACCUMULATION_BITS} + (K + 2) x 2^-24 (14-bit "
        "accumulation within blocks of 128, then float32: DeepSeek-V3 technical report 3.3.2); "
        "Triton: mptex's texture.fp8_gemm=triton kernels (– where they cannot run); times: "
        "median of 20 calls, each the whole call (the _scaled_mm path's operand copies "
        "included)",
    )  # fmt: skip
    if not all(r["ok"] for r in rows):
        ctx.result["failed_checks"] = [r["case"] for r in rows if not r["ok"]]

    import fp8_rowwise  # benchmarks/gpu/fp8_rowwise.py

    rowwise = fp8_rowwise.compare_fp8_rowwise(ctx.device, n)
    ctx.result["data"]["rowwise"] = rowwise
    ctx.table(
        f"Row-wise scales (one per row of a, one per column of b): mptex's emulation vs "
        f"torch._scaled_mm's row-wise path, {n + 5} points",
        ["GEMM", "M x K x N", "emulated err", "bound", "_scaled_mm err", "bound",
         "bit-equal", "emulated µs", "_scaled_mm µs", "ok"],
        [[r["case"], r["shape"], f"{r['emulated_err']:.3g}", f"{r['emulated_bound']:.3g}",
          "–" if r["scaled_mm_err"] is None else f"{r['scaled_mm_err']:.3g}",
          "–" if r["scaled_mm_bound"] is None else f"{r['scaled_mm_bound']:.3g}",
          "–" if r["bit_equal_frac"] is None else f"{100 * r['bit_equal_frac']:.2f} %",
          f"{r['emulated_us']:.1f}",
          "–" if r["scaled_mm_us"] is None else f"{r['scaled_mm_us']:.1f}", r["ok"]]
         for r in rowwise],
        "benchmarks/gpu/fp8_rowwise.py: the emulation sums exactly and rounds three times in "
        "float32 (3 x 2^-24); bit-equal: share of outputs the two backends agree on",
    )  # fmt: skip
    failed = [r["case"] + " (row-wise)" for r in rowwise if not r["ok"]]
    if failed:
        ctx.result["failed_checks"] = ctx.result.get("failed_checks", []) + failed

    import host_costs  # benchmarks/gpu/host_costs.py

    # The built-in scene's covered points in a batch of four 512² views (a third of the pixels).
    rows = 2**10 if ctx.small else 350_000
    costs = host_costs.host_costs(ctx.device, rows)
    ctx.result["data"]["host_costs"] = costs
    ctx.table(
        f"What a call costs the host and the device, M = {rows} rows",
        ["call", "host µs / call", "device µs / call"],
        [[c["what"], c.get("error") or f"{c['host_us']:.1f}",
          "–" if c.get("device_us") is None else f"{c['device_us']:.1f}"] for c in costs],
        "benchmarks/gpu/host_costs.py: 200 calls issued back to back (host), then the same "
        "queued behind a sleeping kernel and timed by CUDA events (device)",
    )  # fmt: skip


# The GPU loop's speed targets on an H100 or H200 at nvdiffrec's scale: f32's median iteration
# and every arm's within a factor of it, except the arms that are not judged by speed: the
# diverging f16_naive (a non-finite run is stopped, not timed) and the twin-only research arms
# (their fused network runs in mptex's PyTorch twin, which emulates the tensor cores' arithmetic
# element by element to study it, not to train fast).
F32_TARGET_MS = 4.0
ARM_RATIO_TARGET = 1.5
ARMS_NOT_JUDGED = ("f16_naive", "tcnn_fused_f32acc", "tcnn_fused_nosplitk")


def arm_order() -> list[str]:
    """Every registered arm: f32 (the reference) first, then the judged arms, then the arms
    not judged by speed, so that a time box cuts those first."""
    from mptex import PrecisionPolicy

    names = PrecisionPolicy.names()
    judged = [a for a in names if a != "f32" and a not in ARMS_NOT_JUDGED]
    return ["f32", *judged, *[a for a in names if a in ARMS_NOT_JUDGED]]


def speed_checks(runs: list[dict], order: list[str]) -> list[str]:
    """The arms stage's failed checks against the targets above (``runs``: the stage's data)."""
    times = {r["precision"]: r["time_per_iter_s"] for r in runs if r["status"] == "completed"}
    f32 = times.get("f32")
    if f32 is None:
        return ["f32: no completed run to compare with"]
    failed = []
    if f32 * 1e3 > F32_TARGET_MS:
        failed.append(f"f32: {f32 * 1e3:.2f} ms / iteration, over {F32_TARGET_MS} ms")
    for arm in order:
        if arm == "f32" or arm in ARMS_NOT_JUDGED:
            continue
        if arm not in times:
            failed.append(f"{arm}: not timed (no completed run)")
        elif times[arm] > ARM_RATIO_TARGET * f32:
            failed.append(f"{arm}: {times[arm] / f32:.2f}x f32, over {ARM_RATIO_TARGET}x")
    return failed


def fused_loss_checks(runs: list[dict], problem: str | None) -> list[str]:
    """On CUDA every arm's loss runs in its Triton kernels (``train.fused_loss=auto``); a run
    that ran the eager loss instead is not the loop's time: a failed check of the stage, with
    why (``problem``: :func:`~mptex.train.fused_loss.fused_loss_problem`'s answer for the
    arms' loss, or None where the kernels could run but failed their start-up comparison,
    which only warns)."""
    why = (f"the fused loss needs {problem}" if problem is not None
           else "its start-up check failed: the warning is in log.txt")  # fmt: skip
    return [
        f"{r['precision']}: the loss ran eager, not fused ({why})"
        for r in runs
        if r["status"] == "completed" and (r.get("backends") or {}).get("loss") != "triton"
    ]


def with_variant(runs: list[dict], variants: list[dict], variant: str) -> list[dict]:
    """``runs`` with each arm that also ran with ``variant`` (the arms stage's variant rows)
    taking that run's place: the judged runs as they would be with the override, for
    :func:`speed_checks` (e.g. every FP8 GEMM arm with ``texture.fp8_gemm=triton``)."""
    swapped = {v["precision"]: v for v in variants if v["variant"] == variant}
    return [swapped.get(r["precision"], r) for r in runs]


# f32 again with one of the loop's device-side features off (or its texture evaluated twice per
# iteration, as nvdiffrec does), right after f32: what each one gives, measured in the same
# process (rows "f32, <override>"; not judged against the targets); and the FP8 GEMM arms again
# with their GEMMs in the Triton kernels, right after each.
LOOP_VARIANTS = ("train.overlap=false", "train.fused_loss=false", "train.kd_smooth_joint=false")
ARM_VARIANTS = {arm: (stages_loop.TRITON_GEMMS,) for arm in ("fp8", "fp8_current", "fp8_rowwise")}


# Wall seconds of the slowest arms' runs at nvdiffrec's scale, 300 iterations (H200,
# 2026-11-28, docs/gpu-runs/): a run is started only when the box holds 1.3x its expected time,
# the larger of this and the stage's last run, so that a slow arm at the end is not started
# just before the box ends (and the stage killed with it, its verdict unwritten).
KNOWN_WALL_S = {"tcnn_fused_f32acc": 28.0, "tcnn_fused_nosplitk": 120.0, "fp8_rowwise": 17.0}


def arms_plan(order: list[str]) -> list[tuple[str, str, str | None]]:
    """``(label, arm, override)`` in the order the arms stage runs them: f32, then every arm
    judged by speed, then the runs that are not judged (f32 with a loop feature off, the FP8
    GEMM arms with their GEMMs in Triton, the arms not judged by speed), so that a time box
    cuts those first."""
    judged = [(arm, arm, None) for arm in order if arm not in ARMS_NOT_JUDGED]
    variants = [(f"f32, {v}", "f32", v) for v in LOOP_VARIANTS]
    variants += [(f"{arm}, {v}", arm, v) for arm in order for v in ARM_VARIANTS.get(arm, ())]
    rest = [(arm, arm, None) for arm in order if arm in ARMS_NOT_JUDGED]
    return [*judged, *variants, *rest]


def stage_arms(ctx: StageContext) -> None:
    iterations = 3 if ctx.small else ctx.args.arm_iterations
    rows, runs, variants, last_wall = [], [], [], 0.0
    order = arm_order()

    def publish() -> None:
        """The table as it stands and, on a device, the verdict on it: saved after every run, so
        that a stage stopped by its box keeps both."""
        ctx.result["data"]["runs"] = runs
        ctx.result["data"]["variants"] = variants
        ctx.result["tables"] = []
        ctx.table(
            f"Built-in scene, {iterations} iterations per arm, seed 0",
            ["arm", "status", "PSNR (dB)", "ms / iter", "x f32", "run / start / iterations (s)",
             "peak memory (MiB)", "skipped", "backends"],
            rows,
            "ms / iter: the loop's median of device-synchronised iteration times; run / start / "
            "iterations: the run's wall time, its start (scene, texture, set-up) and the sum of "
            "its iterations (metrics.json's time_split_s); one seed, so the PSNR column is not a "
            "comparison between arms (see nvdiffrec154 for one); rows '<arm>, <override>': the "
            "arm again with one override (a loop feature off, the FP8 GEMMs in Triton), not "
            "judged; targets: f32 at most "
            f"{F32_TARGET_MS} ms, every arm but {', '.join(ARMS_NOT_JUDGED)} within "
            f"{ARM_RATIO_TARGET}x f32",
        )  # fmt: skip
        if not ctx.small:  # the dry run's sizes and CPU say nothing about the targets
            judge_arms(ctx, runs, variants, order)

    for label, arm, variant in arms_plan(order):
        expected = max(last_wall, 0.0 if variant else KNOWN_WALL_S.get(arm, 0.0))
        if runs and ctx.remaining() < 1.3 * expected:
            rows.append([label, "not run: time box", *[""] * 7])
            continue
        problem = stages_loop.override_problem(variant, ctx.device)
        if problem:
            rows.append([label, f"not run: {problem}", *[""] * 7])
            continue
        start = time.time()
        try:
            overrides = [f"precision={arm}", *stages_loop.scale_overrides(ctx, iterations)]
            metrics = _train_run(stages_loop.compose_config([*overrides, *filter(None, [variant])]))
        except Exception as exc:  # one arm's failure is a row, not the stage's end
            rows.append([label, f"failed: {type(exc).__name__}: {exc}".splitlines()[0],
                         *[""] * 7])  # fmt: skip
            continue
        last_wall = time.time() - start
        backends = metrics.get("backends") or {}
        keep = ("precision", "psnr", "time_per_iter_s", "peak_memory_bytes", "peak_memory_kind",
                "status", "skipped_steps", "backends", "iterations", "wall_time_s",
                "time_split_s")  # fmt: skip
        if variant is None:
            runs.append({k: metrics.get(k) for k in keep})
        else:
            variants.append({"variant": variant, **{k: metrics.get(k) for k in keep}})
        # an arm stopped before its first timed iteration (a non-finite start) has no time
        seconds = metrics.get("time_per_iter_s")
        psnr, ms = metrics.get("psnr"), None if seconds is None else seconds * 1e3
        f32 = next((r["time_per_iter_s"] for r in runs if r["precision"] == "f32"), None)
        split = metrics.get("time_split_s") or {}
        rows.append(
            [
                label,
                metrics["status"],
                f"{psnr:.2f}" if psnr is not None else "–",
                f"{ms:.2f}" if ms is not None else "–",
                f"{ms / (f32 * 1e3):.2f}" if f32 and ms is not None else "–",
                f"{metrics['wall_time_s']:.1f} / {split.get('start', 0):.1f} / "
                f"{split.get('iterations', 0):.1f}",
                f"{metrics['peak_memory_bytes'] / 2**20:.0f} ({metrics['peak_memory_kind']})",
                metrics["skipped_steps"],
                ", ".join(f"{k}={v}" for k, v in backends.items()),
            ]
        )
        publish()
    publish()  # the rows of the runs the box left out too


def judge_arms(ctx, runs: list[dict], variants: list[dict], order: list[str]) -> None:
    """The arms stage's verdict on the speed targets (:func:`speed_checks`), and what the same
    targets say with the FP8 GEMM arms' variant runs in their places (not judged: the judged
    arms are what ``auto`` runs; this tells whether switching it would pass)."""
    failed = speed_checks(runs, order)
    if ctx.device.startswith("cuda"):
        from mptex.train.fused_loss import fused_loss_problem

        failed += fused_loss_checks(runs, fused_loss_problem(ctx.device, "logl1"))
    overrides = sorted({v for vs in ARM_VARIANTS.values() for v in vs})
    targets_with = {o: speed_checks(with_variant(runs, variants, o), order) for o in overrides}
    ctx.result["data"]["targets_with"] = targets_with
    ctx.table(
        "The speed targets with the FP8 GEMM arms' variant runs in their place (not judged)",
        ["override", "targets missed"],
        [[o, "; ".join(missed) or "none"] for o, missed in targets_with.items()],
        "what the targets would say if 'auto' chose the override for those arms",
    )
    ctx.result.pop("failed_checks", None)  # judged again on every call: the latest stands
    if failed:
        ctx.result.update(failed_checks=failed, failed_what="speed targets missed")
    ctx.save()


def stage_throughput(ctx: StageContext) -> None:
    import torch

    sys.path.insert(0, str(HERE.parent))
    import encoding as bench  # benchmarks/encoding.py

    device = torch.device(ctx.device)
    backends, skipped = bench.usable_backends(device, ["torch", "triton", "tcnn"])
    log2 = [10] if ctx.small else [18, 20]
    rows, throughput = bench.measure(device, backends, log2, repeats=3 if ctx.small else 7)
    ctx.result["data"] = {
        "throughput_pts_per_s": {
            f"{b} {str(d)[6:]} {p} 2^{n}": v for (b, d, p, n), v in throughput.items()
        },
        "skipped": skipped,
    }
    ctx.table(
        "nvdiffrec's grid config, uniform points",
        ["what", "points", "median time", "throughput"],
        rows,
        "; ".join(f"skipped {s}" for s in skipped),
    )
    ratios = bench.ratio_rows(throughput)
    if ratios:
        ctx.table("Triton's throughput relative to the others", bench.RATIO_HEADERS, ratios)


def stage_nvdiffrec154(ctx: StageContext) -> None:
    """nvdiffrec #154 with the real libraries: per seed, ``nvdiffrec`` (its f16 grid and f32
    MLP), the swap as #154 made it (``tcnn_fused_swap154``) and the fix candidate
    (``tcnn_fused_dynamic``: tcnn's fused network under dynamic loss scaling), each paired with
    ``nvdiffrec`` by seed while the time box allows."""
    from mptex.intervals import mean_ci, verdict

    iterations = 3 if ctx.small else ctx.args.n154_iterations
    base, others = "nvdiffrec", ("tcnn_fused_swap154", "tcnn_fused_dynamic")
    arms = (base, *others)
    # The grid as nvdiffrec runs it: tinycudann's (backend "auto" would take Triton on CUDA).
    grid = [f"texture.backend={ctx.args.native_grid}"] if not ctx.small else []
    psnr: dict[str, list[float]] = {a: [] for a in arms}
    rows, backends, seed, seed_wall = [], {}, 0, 0.0
    max_seeds = 2 if ctx.small else 64
    while seed < max_seeds and (seed == 0 or ctx.remaining() > 1.2 * seed_wall):
        start, runs = time.time(), {}
        for arm in arms:
            overrides = ["+experiment=nvdiffrec154", f"precision={arm}", f"train.seed={seed}"]
            scale = stages_loop.scale_overrides(ctx, iterations)
            metrics = _train_run(stages_loop.compose_config(overrides + grid + scale))
            runs[arm] = metrics
            backends[arm] = metrics.get("backends")
        seed_wall = time.time() - start
        if all(runs[a]["psnr"] is not None for a in arms):
            for a in arms:
                psnr[a].append(runs[a]["psnr"])
        rows.append(
            [seed]
            + [
                f"{runs[a]['psnr']:.2f} ({runs[a]['status']})"
                if runs[a]["psnr"] is not None
                else runs[a]["status"]
                for a in arms
            ]
            + [f"{seed_wall:.1f}"]
        )
        seed += 1
        pairs = {}
        for arm in others:
            diffs = [s - n for n, s in zip(psnr[base], psnr[arm])]
            ci = mean_ci(diffs) if len(diffs) >= 2 else None
            pairs[arm] = {"differences": diffs, "ci": ci, "verdict": verdict(ci) if ci else None}
        ctx.result["data"] = {
            "psnr": psnr,
            "pairs": pairs,
            # the first pair, under the keys earlier runs of the kit wrote
            **pairs[others[0]],
            "backends": backends,
            "iterations": iterations,
        }
        ctx.result["tables"] = []
        ctx.table(
            f"Per seed, {iterations} iterations (+experiment=nvdiffrec154)",
            ["seed", *arms, "wall (s)"],
            rows,
            "backends: " + "; ".join(f"{a}: {b}" for a, b in backends.items()),
        )
        paired = [
            [f"{arm} − {base}", len(p["differences"]), f"{p['ci']['mean']:+.2f}",
             f"[{p['ci']['low']:+.2f}, {p['ci']['high']:+.2f}]", p["verdict"]]
            for arm, p in pairs.items() if p["ci"]
        ]  # fmt: skip
        if paired:
            ctx.table(
                f"Paired by seed against {base}",
                ["difference", "seeds", "mean Δ PSNR (dB)", "95 % interval", "verdict"],
                paired,
                "Student-t interval over the per-seed differences (mptex.intervals.mean_ci)",
            )
        ctx.save()


_PYTEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _pytest_rows(ctx: StageContext, args: list[str], env: dict[str, str] | None = None):
    """Run pytest on ``args`` (marks, paths) in a subprocess; (returncode, rows, last line).

    One row per test case: its name, outcome and seconds, from pytest's JUnit XML. When the
    stage's box runs out first, the rows come from pytest's verbose progress instead (the
    tests that finished), and the test that was running is named; the return code is then
    None."""
    with tempfile.TemporaryDirectory(prefix="mptex-pytest-") as scratch:
        report = Path(scratch) / "junit.xml"
        returncode, stdout, cases = _run_pytest(ctx, args, env, report)
    rows = []
    if cases is not None:
        for case in cases:
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = f"{tag}: {(node.get('message') or '').splitlines()[0][:160]}"
            rows.append([f"{case.get('classname')}::{case.get('name')}", outcome,
                         f"{float(case.get('time') or 0):.1f}"])  # fmt: skip
        last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    else:
        lines = stdout.splitlines()
        for line in lines:
            match = _PYTEST_LINE.match(line)
            if match:
                rows.append([match[1], match[2].lower(), "–"])
        # pytest -v writes a test's name when it starts and its outcome when it ends.
        if lines and "::" in lines[-1] and not _PYTEST_LINE.match(lines[-1]):
            rows.append([lines[-1].split()[0], "running when the box ran out", "–"])
        last = f"stopped by the stage's box after {len(rows)} tests"
    ctx.result["data"]["pytest"] = {"returncode": returncode, "tail": stdout[-3000:]}
    return returncode, rows, last


def _run_pytest(ctx: StageContext, args: list[str], env: dict[str, str] | None, report: Path):
    """pytest's (returncode, output, JUnit test cases); returncode None and no cases when the
    stage's box ran out first."""
    import xml.etree.ElementTree as ET

    # -u: the progress must reach the pipe as it is written, or a killed pytest leaves none.
    cmd = [sys.executable, "-u", "-m", "pytest", "-v", "-p", "no:cacheprovider",
           f"--junitxml={report}", *args]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=max(ctx.remaining() - 5, 10),
            env=None if env is None else dict(os.environ, **env),
        )
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout or ""
        return None, stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout, None
    cases = list(ET.parse(report).getroot().iter("testcase")) if report.is_file() else None
    return proc.returncode, proc.stdout, cases


def _failed_tests(returncode: int | None, rows: list[list[str]]) -> list[str]:
    if returncode in (0, 5):  # 5: nothing collected
        return []
    # ("running": the test a stage's box stopped, in a run that ended that way only)
    failed = [r[0] for r in rows if not r[1].startswith(("passed", "skipped", "running"))]
    if returncode is None:
        return [*failed, "pytest: stopped by the stage's box"]
    return failed or ["pytest"]


def stage_tests(ctx: StageContext) -> None:
    marks = "requires_cuda or requires_tcnn or requires_nvdiffrast"
    returncode, rows, last = _pytest_rows(ctx, ["-m", marks, str(REPO / "tests")])
    ctx.table(f"pytest -m '{marks}'", ["test", "outcome", "s"], rows, last)
    failed = _failed_tests(returncode, rows)
    if failed:
        ctx.result["failed_checks"] = failed


def _capture_golden(ctx: StageContext, golden, full: Path, fixtures: Path) -> list:
    """Capture the golden cases into ``full`` and compact them into ``fixtures``; the raster
    capture's meshes."""
    duck = ctx.args.mesh
    if duck is None:  # the CPU dry run: the duck of pybullet_data where it is installed
        from mptex.scenes.assets import suite_available, suite_path

        duck = suite_path("duck") if suite_available() else None
    # Same inputs as the committed capture, where they are stored rather than regenerated.
    stored = golden.committed_inputs()
    golden.capture_grid(full, ctx.device, ctx.args.native_grid, GRID_CONFIGS, stored["grid"])
    golden.capture_network(
        full, ctx.device, ctx.args.native_mlp, NETWORK_CONFIGS, stored["network"]
    )
    meshes = golden.capture_raster(full, ctx.device, ctx.args.native_raster, duck, stored["raster"])
    for part in golden.PARTS:
        golden.builder(part).compact(full, fixtures)
    return meshes


def stage_golden(ctx: StageContext) -> None:
    """Recapture the golden cases with the native libraries, compact them as the committed
    fixtures were, diff the two folders, and run the twins' golden tests on the new capture."""
    sys.path.insert(0, str(HERE))
    import golden  # benchmarks/gpu/golden.py

    fixtures = (
        Path(ctx.args.results_dir) / "golden"
        if ctx.args.results_dir
        else Path(tempfile.mkdtemp(prefix="mptex-golden-"))
    )
    shutil.rmtree(fixtures, ignore_errors=True)
    fixtures.mkdir(parents=True)
    # The full capture (about 25 MB) in scratch, removed once compacted; the compact fixtures
    # (what a commit of a new golden set would take) come back in the results folder.
    with tempfile.TemporaryDirectory(prefix="mptex-golden-capture-") as full:
        meshes = _capture_golden(ctx, golden, Path(full), fixtures)
    rows = golden.compare_fixture_dirs(fixtures, golden.FIXTURES)
    ctx.result["data"].update(arrays=rows, meshes=meshes, fixtures=str(fixtures))
    same = sum(r["status"] == "same" for r in rows)
    ctx.table(
        f"The new capture vs the committed fixtures (tests/gpu_golden/): {same} of {len(rows)} "
        "arrays bit-equal",
        ["fixture", "array", "status", "share bit-equal", "max |diff|"],
        [[r["file"], r["array"], r["status"], f"{100 * r['equal']:.3f} %",
          "–" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}"] for r in rows],
        "the fixtures hold only the libraries' outputs; their inputs are regenerated from seeds",
    )  # fmt: skip
    tests = sorted(str(p) for p in (REPO / "tests").glob("test_gpu_golden_*.py"))
    if ctx.small:
        ctx.result["data"]["note"] = "dry run: the golden tests run in the CPU suite instead"
        return
    returncode, test_rows, last = _pytest_rows(
        ctx, tests, env={"MPTEX_GPU_GOLDEN_DIR": str(fixtures)}
    )
    ctx.table("The twins' golden tests on the new capture", ["test", "outcome", "s"], test_rows,
              last)  # fmt: skip
    failed = _failed_tests(returncode, test_rows)
    if failed:
        ctx.result["failed_checks"] = failed


STAGE_BODIES: dict[str, Callable[[StageContext], None]] = {
    "env": stage_env,
    "loss": stage_loss,
    "golden": stage_golden,
    "grid": stage_grid,
    "network": stage_network,
    "raster": stage_raster,
    "fp8": stage_fp8,
    "arms": stage_arms,
    "throughput": stage_throughput,
    "nvdiffrec154": stage_nvdiffrec154,
    "tests": stage_tests,
    "profile": stages_loop.stage_profile,
    "mainjob": stages_loop.stage_mainjob,
}


def _kit_libdevice(kit: Path) -> None:
    """Where this machine has no CUDA toolkit of torch's CUDA release, point the fused logl1
    loss at the kit's libdevice of that release (``libdevice/cuda-X.Y/``, from pack_kit.sh) by
    ``MPTEX_LIBDEVICE``, for this stage and the processes it starts."""
    if os.environ.get("MPTEX_LIBDEVICE"):
        return
    import torch

    release = ".".join((torch.version.cuda or "").split(".")[:2])
    packed = kit / "libdevice" / f"cuda-{release}" / "libdevice.10.bc"
    if not release or not packed.is_file():
        return
    from mptex.train._loss_triton import torch_libdevice
    from mptex.train.fused_loss import fused_loss_problem

    if torch_libdevice()[0] is None:
        os.environ["MPTEX_LIBDEVICE"] = str(packed.resolve())
        torch_libdevice.cache_clear()
        fused_loss_problem.cache_clear()  # an answer that may have read the search's


def run_stage(args: argparse.Namespace) -> int:
    """Body of a stage's own process: run it, write its result file, exit 0 (the result says
    whether the stage failed)."""
    stage = next(s for s in STAGES if s.name == args.stage)
    if args.kit and args.device.startswith("cuda"):
        _kit_libdevice(Path(args.kit))
    ctx = StageContext(args, Path(args.result_file), args.deadline)
    why = _needs(stage, args)
    if why:
        ctx.result.update(status="unavailable", reason=why)
    else:
        try:
            STAGE_BODIES[stage.name](ctx)
            failed = ctx.result.get("failed_checks")
            ctx.result["status"] = "failed" if failed else "ok"
            if failed:
                # what the checks were (a stage of targets names them), then which failed
                what = ctx.result.pop("failed_what", "outside the stated tolerance")
                ctx.result["reason"] = f"{what}: " + ", ".join(failed)
        except Exception as exc:
            traceback.print_exc()
            ctx.result.update(
                status="failed", reason=f"{type(exc).__name__}: {exc}".splitlines()[0]
            )
    ctx.save()
    return 0


# --------------------------------------------------------------------------- the driver
def install_kit(kit: Path, site: Path, log) -> list[str]:
    """``pip install --no-index --no-deps --target site`` every wheel in ``kit``."""
    wheels = sorted(glob.glob(str(kit / "*.whl")))
    if not wheels:
        raise SystemExit(f"validate.py: --kit {kit}: no *.whl in it (make it with pack_kit.sh)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(site),
        *wheels,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise SystemExit(f"validate.py: installing the kit's wheels failed:\n{proc.stderr[-2000:]}")
    return [Path(w).name for w in wheels]


def markdown(results: dict) -> str:
    lines = [
        "# mptex GPU kit results",
        "",
        f"- command: `{results['command']}`",
        f"- started: {results['started']}",
        f"- device: {results['device']}",
    ]
    env = (results["stages"].get("env") or {}).get("data") or {}
    for key in (
        "gpu",
        "driver",
        "capability",
        "python",
        "torch",
        "cuda",
        "tinycudann",
        "nvdiffrast",
        "triton",
    ):
        if key in env:
            lines.append(f"- {key}: {env[key]}")
    if results.get("installed"):
        lines.append(f"- installed from the kit: {', '.join(results['installed'])}")
    for stage in STAGES:
        res = results["stages"].get(stage.name)
        if res is None:
            continue
        lines += [
            "",
            f"## {stage.title} (`{stage.name}`)",
            "",
            f"status: **{res['status']}**"
            + (f": {res['reason']}" if res.get("reason") else "")
            + f" ({res.get('seconds', 0):.0f} s of a {res.get('box', 0):.0f} s box)",
        ]
        for table in res.get("tables", []):
            lines += [
                "",
                f"**{table['title']}**",
                "",
                "| " + " | ".join(table["headers"]) + " |",
                "|" + "|".join("---" for _ in table["headers"]) + "|",
            ]
            lines += [
                "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
                for row in table["rows"]
            ]
            if table.get("note"):
                lines += ["", table["note"]]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    for name, text in (
        (RESULTS_JSON, json.dumps(results, indent=1, default=str)),
        (RESULTS_MD, markdown(results)),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def drive(args: argparse.Namespace) -> int:
    """Install the kit and run the chosen stages, each in a process of its own, in a scratch
    folder that is removed at the end, whatever ends the stages: the kit's installs, and as
    the stages' ``TMPDIR`` every temporary folder they make (the tests' folders, the full golden
    capture, the main job's sweep with its checkpoints). What a stage keeps goes to ``--out``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mptex-gpu-kit-"))
    try:
        with open(out / LOG, "a", buffering=1) as log:
            return _drive(args, out, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _drive(args: argparse.Namespace, out: Path, work: Path, log) -> int:
    t0 = STARTED
    (work / "tmp").mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(work / "tmp"))
    installed: list[str] = []
    if args.kit:
        installed = install_kit(Path(args.kit), work / "site", log)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(work / "site"), str(REPO), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    if args.mesh is None and args.kit:
        found = sorted(Path(args.kit).glob("assets/*/*.obj"))
        if found:
            args.mesh = str(found[0].resolve())
            args.passthrough += ["--mesh", args.mesh]
    results = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": args.device,
        "budget_s": args.budget_s,
        "installed": installed,
        "stages": {},
    }
    chosen = [s for s in STAGES if s.name in args.stages]
    # Stages that keep files (the golden stage's new fixtures, the main job's report) put them
    # beside the results.
    args.passthrough += ["--results-dir", str(out.resolve())]
    for i, stage in enumerate(chosen):
        left = args.budget_s - (time.time() - t0)
        # Later stages keep their boxes; what earlier stages left unused goes to this one.
        later = sum(s.seconds for s in chosen[i + 1 :])
        box = min(max(stage.seconds, left - later), left) if not args.device == "cpu" else left
        if box < 5:
            results["stages"][stage.name] = {
                "status": "not run",
                "reason": "budget spent",
                "box": 0,
                "seconds": 0,
                "tables": [],
            }
            write_results(out, results)
            continue
        print(f"[validate] {stage.name}: {stage.title} (box {box:.0f} s)", flush=True)
        # In --out while the stage runs (its tables as it makes them): if the whole command is
        # stopped from outside, what the stage measured so far is still there.
        result_file = out / f"running-{stage.name}.json"
        result_file.unlink(missing_ok=True)  # one a command stopped earlier left behind
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--stage",
            stage.name,
            "--result-file",
            str(result_file),
            "--deadline",
            str(time.time() + box),
            *args.passthrough,
        ]
        start = time.time()
        log.write(f"\n===== {stage.name} =====\n$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=box + 15)  # grace: the stage stops itself at its deadline
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        res = json.loads(result_file.read_text()) if result_file.is_file() else {"tables": []}
        result_file.unlink(missing_ok=True)  # in results.json from here on
        if timed_out:
            # The checks the stage had already failed (saved with its tables) stay in the reason.
            failed = res.get("failed_checks") or []
            res.update(status="timed out", reason=f"stopped after its {box:.0f} s box"
                       + (f"; {res.get('failed_what', 'failed')}: {', '.join(failed)}"
                          if failed else ""))  # fmt: skip
        elif proc.returncode != 0 or res.get("status") in (None, "running"):
            res.update(
                status="failed",
                reason=f"the stage's process exited {proc.returncode} (traceback in {LOG})",
            )
        res.update(seconds=time.time() - start, box=box)
        results["stages"][stage.name] = res
        write_results(out, results)
        print(
            f"[validate] {stage.name}: {res['status']}"
            + (f": {res['reason']}" if res.get("reason") else ""),
            flush=True,
        )
    results["wall_s"] = time.time() - t0
    write_results(out, results)
    print((out / RESULTS_MD).read_text())
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="results folder: results.json, results.md, log.txt")
    parser.add_argument("--kit", help="folder of wheels (and assets/) to install first")
    parser.add_argument(
        "--device", default=None, help="cuda (default where available) or cpu (the dry run)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="wall-clock budget of all stages together (default 480 = 8 min)",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        default=DEFAULT_STAGES,
        choices=STAGE_NAMES,
        help="stages to run, in the kit's order (default: all but mainjob)",
    )
    parser.add_argument(
        "--mesh", default=None, help="OBJ for the raster stage (default: the kit's assets/, if any)"
    )
    parser.add_argument("--arm-iterations", type=int, default=300)
    parser.add_argument(
        "--n154-iterations",
        type=int,
        default=500,
        help="iterations per nvdiffrec #154 run (+experiment=nvdiffrec154: 500)",
    )
    # What the stages compare against: tcnn / nvdiffrast; the tests point them at the twin.
    parser.add_argument("--native-grid", default="tcnn", help=argparse.SUPPRESS)
    parser.add_argument("--native-mlp", default="tcnn", help=argparse.SUPPRESS)
    parser.add_argument("--native-raster", default="nvdiffrast", help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--results-dir", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else None
        if args.device is None:
            parser.error("--device: no CUDA device here; pass --device cpu for the dry run")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device: expected cuda, cuda:N or cpu, got {args.device!r}")
    if args.stage is None and not args.out:
        parser.error("--out: the results folder is required")
    if args.budget_s <= 0:
        parser.error(f"--budget-s: expected a positive number of seconds, got {args.budget_s}")
    for name in ("arm_iterations", "n154_iterations"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer")
    # Options a stage's process needs, passed on unchanged.
    args.passthrough = [
        "--device",
        args.device,
        "--arm-iterations",
        str(args.arm_iterations),
        "--n154-iterations",
        str(args.n154_iterations),
        "--native-grid",
        args.native_grid,
        "--native-mlp",
        args.native_mlp,
        "--native-raster",
        args.native_raster,
    ]
    if args.mesh:
        args.passthrough += ["--mesh", args.mesh]
    if args.kit:
        args.passthrough += ["--kit", str(Path(args.kit).resolve())]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage:
        return run_stage(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
