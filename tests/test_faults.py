"""Faults and bad input. Nothing is corrupted, every error is one line naming the key
or the file, exit code 2 for bad input, and a run killed at any moment resumes to a complete,
valid result.

Most cases run in-process (``train`` fails at start, before any iteration); a handful go
through the real ``mptex-train`` / ``mptex-check`` to check the exit code and stderr.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_runs import TINY, tiny_cfg

import mptex.train.loop as loop
from mptex import (
    FullyFusedMLP,
    HashGridEncoding,
    MLPTexture3D,
    PrecisionPolicy,
    PrecisionStepper,
    _backends,
)
from mptex.cli.check import check_main
from mptex.render import rasterize
from mptex.scenes import build_scene
from mptex.train import ConfigError, load_checkpoint, save_checkpoint, train, validate_config
from mptex.train.checkpoint import CHECKPOINT_KEYS, CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def read_metrics(run_dir: Path) -> dict:
    def refuse(constant):  # strict JSON: NaN/Infinity literals are a defect
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads((run_dir / "metrics.json").read_text(), parse_constant=refuse)


def start_error(run_dir: Path, *overrides: str) -> str:
    """The one-line error of a run refused at start; checks metrics.json recorded it: as the
    record, or, in the directory of a run that got past its start, added to that run's record
    under ``start_failures`` (the record otherwise as it was)."""
    before = read_metrics(run_dir) if (run_dir / "metrics.json").exists() else None
    with pytest.raises(ConfigError) as info:
        train(tiny_cfg(*overrides), run_dir)
    message = str(info.value)
    assert "\n" not in message
    metrics = read_metrics(run_dir)
    if before is None or before.get("failed_at") == "start":
        assert metrics["status"] == "failed" and metrics["failed_at"] == "start"
        assert metrics["error"] == message
    else:
        tries = metrics.pop("start_failures")
        assert tries == [
            *before.pop("start_failures", []),
            {"error": message, "failed_at": "start"},
        ]
        assert metrics == before
    return message


def finite_weights(ckpt: dict) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ckpt["texture"].values())


# ----------------------------------------------------------------------------- 2: config values
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["precision.master_weights=no"], "precision.master_weights"),
        (["precision.autocast=off"], "precision.autocast"),
        (["precision.init_scale=big"], "precision.init_scale"),
        (["precision=f16_dynamic", "precision.growth_interval=2.5"], "precision.growth_interval"),
        (["+precision.foo=1"], "precision.foo"),
        (["precision=tcnn_fused", "precision.fused_split_k=no"], "precision.fused_split_k"),
        (["precision=tcnn_fused", "precision.fused_loss_scale=inf"], "precision.fused_loss_scale"),
        (["precision=per_layer", "precision.mlp_dtypes=[f16,f32]"], "precision.mlp_dtypes"),
        (["texture.encoder.n_levels=4.7"], "texture.encoder.n_levels"),
        (["texture.encoder.base_resolution=16.9"], "texture.encoder.base_resolution"),
        (["texture.encoder.per_level_scale=abc"], "texture.encoder.per_level_scale"),
        (["texture.encoder.per_level_scale=inf"], "texture.encoder.per_level_scale"),
        (["+texture.foo=1"], "texture.foo"),
        (["+texture.encoder.foo=1"], "texture.encoder.foo"),
        (["texture.hidden=0"], "texture.hidden"),
        (["texture.internal_dims=-3"], "texture.internal_dims"),
        (["texture.channels=true"], "texture.channels"),
        (["texture.backend=cuda"], "texture.backend"),
        (["texture.backend=triton", "train.device=cpu"], "texture.backend"),
        (["train.lr_decay=inf"], "train.lr_decay"),
        (["train.lr=nan"], "train.lr"),
        (["train.betas=[a,b]"], "train.betas"),
        (["train.adam_eps=0"], "train.adam_eps"),
        (["train.adam_eps=-1e-15"], "train.adam_eps"),
        (["train.kd_smooth=no"], "train.kd_smooth"),
        (["train.tensorboard=off"], "train.tensorboard"),
        (["train.seed=99999999999999999999"], "train.seed"),
        (["train.seed=-1"], "train.seed"),
        (["train.init_seed=-1"], "train.init_seed"),
        (["train.init_seed=1.5"], "train.init_seed"),
        (["train.iterations=4.5"], "train.iterations"),
        (["train.val_spp=0"], "train.val_spp"),
        (["train.val_spp=2.5"], "train.val_spp"),
        (["train.val_spp=17"], "train.val_spp"),
        (["train.mlp_lr_ramp_to=0"], "train.mlp_lr_ramp_to"),
        (["train.mlp_lr_ramp_to=fast"], "train.mlp_lr_ramp_to"),
        (["train.mlp_lr_ramp_iter=0"], "train.mlp_lr_ramp_iter"),
        (["+train.foo=1"], "train.foo"),
        (["scene.near=-1"], "scene.near"),
        (["scene.far=0.05"], "scene.far"),
        (["scene.fovy_deg=180"], "scene.fovy_deg"),
        (["scene.fovy_deg=0"], "scene.fovy_deg"),
        (["scene.cam_radius=inf"], "scene.cam_radius"),
        (["scene.raster_backend=foo"], "scene.raster_backend"),
        (["scene.seed=99999999999999999999"], "scene.seed"),
        (["scene.resolution=true"], "scene.resolution"),
        (["+scene.foo=1"], "scene.foo"),
    ],
)  # fmt: skip
def test_bad_config_values_are_refused_at_start(overrides, key):
    # validate_config (no scene built, no allocation) catches every type error; geometry and
    # constructor ranges come from the start of train(), tested below.
    from mptex.train import validate_config

    with pytest.raises(ValueError) as info:
        validate_config(tiny_cfg(*overrides))
        from mptex.scenes import build_scene

        build_scene(tiny_cfg(*overrides).scene)
    assert str(info.value).startswith(f"{key}:") or str(info.value).startswith(f"{key} "), info


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["texture.encoder.n_levels=0"], "texture.encoder.n_levels"),
        (["texture.encoder.log2_hashmap_size=31"], "texture.encoder.log2_hashmap_size"),
        (["texture.encoder.base_resolution=-16"], "texture.encoder.base_resolution"),
        (["texture.min_max=[[0,0],[1,1]]"], "texture.min_max"),
        (["texture.encoder.n_levels=16", "texture.encoder.log2_hashmap_size=30",
          "texture.encoder.per_level_scale=1.5"], "texture.encoder.log2_hashmap_size"),
        (["scene.near=5"], "scene"),  # every view clipped: nothing to train on
        (["scene.fovy_deg=0.001"], "scene"),
    ],
)  # fmt: skip
def test_constructor_errors_name_the_config_key(tmp_path, overrides, key):
    message = start_error(tmp_path, *overrides)
    assert message.startswith(f"{key}:") or message.startswith(f"{key} must"), message


def test_api_refuses_bad_arguments_naming_them():
    cases = [
        (lambda: HashGridEncoding(3, n_levels=16, log2_hashmap_size=30), "log2_hashmap_size"),
        # drawn on the CPU before it moves: the CPU's memory is checked on any device
        (lambda: HashGridEncoding(3, n_levels=16, log2_hashmap_size=30, device="meta"),
         "log2_hashmap_size"),
        (lambda: HashGridEncoding.from_tcnn_config(3, None), "config"),
        (lambda: HashGridEncoding(3, base_resolution=16.9), "base_resolution"),
        (lambda: HashGridEncoding(3, n_levels=4.7), "n_levels"),
        (lambda: HashGridEncoding(3, per_level_scale=float("inf")), "per_level_scale"),
        (lambda: HashGridEncoding(3, per_level_scale="abc"), "per_level_scale"),
        (lambda: HashGridEncoding(3, n_levels=32, per_level_scale=2.0), "per_level_scale"),
        (lambda: MLPTexture3D([[0, 0], [1, 1, 1]], encoder={"n_levels": 1}), "AABB"),
        (lambda: MLPTexture3D([[1, 0, 0], [0, 1, 1]], encoder={"n_levels": 1}), "AABB"),
        (lambda: MLPTexture3D([[0, 0, 0], [0, 1, 1]], encoder={"n_levels": 1}), "AABB"),
        (lambda: PrecisionPolicy(master_weights="no"), "master_weights"),
        (lambda: PrecisionPolicy.from_config({"name": "f16_dynamic", "init_scale": "big"}),
         "init_scale"),
    ]  # fmt: skip
    for build, argument in cases:
        with pytest.raises(ValueError) as info:
            build()
        assert str(info.value).startswith(argument), (argument, str(info.value))


_SMALL_GRID = {"n_levels": 2, "log2_hashmap_size": 8}


def _no_cuda(monkeypatch):
    monkeypatch.setattr(_backends, "_cuda_available", lambda: False)
    return "torch.cuda.is_available() is False"


def _cuda_without_libraries(monkeypatch):
    # A CUDA machine where neither native library imports (the other cause, named as such).
    monkeypatch.setattr(_backends, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_backends, "_try_import",
                        lambda name: (None, f"ImportError: No module named {name!r}"))  # fmt: skip
    return "is not importable (ImportError: No module named"


def test_device_auto_and_the_device_checks_read_cuda_through_one_seam(monkeypatch):
    # Tests model a CUDA machine (or one without) by replacing _backends._cuda_available; what
    # `device: auto` resolves to and the device check must follow it as the backends do.
    from mptex._backends import auto_device, cuda_device_problem

    _no_cuda(monkeypatch)
    assert auto_device() == "cpu"
    assert cuda_device_problem(torch.device("cuda:0"), "train.device: 'cuda:0'") == (
        "train.device: 'cuda:0' requested but CUDA is not available"
    )
    monkeypatch.setattr(_backends, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert auto_device() == "cuda"
    assert cuda_device_problem(torch.device("cuda:0"), "cuda:0") is None
    assert cuda_device_problem(torch.device("cuda:1"), "cuda:1") == (
        "cuda:1 requested, 1 CUDA device(s) here"
    )


# Each call that asks for a native backend, the key it asked with, and what runs instead.
_UNAVAILABLE = [
    (lambda: MLPTexture3D([[-1] * 3, [1] * 3], encoder=_SMALL_GRID,
                          precision={"name": "tcnn_fused", "mlp_backend": "tcnn"}),
     "precision.mlp_backend='tcnn' needs tinycudann and a CUDA device: ",
     "; the arm tcnn_fused runs on the CPU with mlp_backend='torch'"),
    (lambda: MLPTexture3D([[-1] * 3, [1] * 3], encoder=_SMALL_GRID, backend="tcnn"),
     "backend='tcnn' needs tinycudann and a CUDA device: ", "; backend='torch' runs on any device"),
    (lambda: HashGridEncoding(3, _SMALL_GRID, backend="tcnn"),
     "backend='tcnn' needs tinycudann and a CUDA device: ", "; backend='torch' runs on any device"),
    (lambda: FullyFusedMLP(8, 3, {"n_neurons": 16}, backend="tcnn"),
     "backend='tcnn' needs tinycudann and a CUDA device: ", "; backend='torch' runs on any device"),
    (lambda: rasterize(torch.zeros(1, 3, 4), torch.zeros(1, 3, dtype=torch.int32), (4, 4),
                       backend="nvdiffrast"),
     "backend='nvdiffrast' needs nvdiffrast and a CUDA device: ",
     "; backend='torch' runs on any device"),
    (lambda: build_scene({"name": "builtin", "raster_backend": "nvdiffrast"}),
     "scene.raster_backend='nvdiffrast' needs nvdiffrast and a CUDA device: ",
     "; scene.raster_backend='torch' runs on any device"),
    (lambda: validate_config(tiny_cfg("precision=tcnn_fused", "precision.mlp_backend=tcnn")),
     "precision.mlp_backend='tcnn' needs tinycudann and a CUDA device: ",
     "; the arm tcnn_fused runs on the CPU with mlp_backend='torch'"),
    (lambda: validate_config(tiny_cfg("texture.backend=tcnn")),
     "texture.backend='tcnn' needs tinycudann and a CUDA device: ",
     "; texture.backend='torch' runs on any device"),
]  # fmt: skip


@pytest.mark.parametrize("machine", [_no_cuda, _cuda_without_libraries])
@pytest.mark.parametrize("call, start, end", _UNAVAILABLE)
def test_an_unavailable_backend_names_the_key_that_asked_for_it(call, start, end, machine,
                                                                 monkeypatch):  # fmt: skip
    cause = machine(monkeypatch)
    with pytest.raises((RuntimeError, ValueError)) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message.startswith(start) and message.endswith(end), message
    assert cause in message


def test_api_refuses_bad_positions_instead_of_encoding_nan():
    encoding = HashGridEncoding(3, n_levels=2, log2_hashmap_size=8, base_resolution=4, seed=0)
    with pytest.raises(ValueError, match=r"^x must lie within"):
        encoding(torch.full((2, 3), 3e38))
    # Points just outside [0, 1] keep tcnn's (wrapping) semantics and stay finite.
    assert torch.isfinite(encoding(torch.tensor([[1.5, -0.5, 2.0]]))).all()
    texture = MLPTexture3D([[-1] * 3, [1] * 3], precision="f32", encoder={"n_levels": 2})
    with pytest.raises(ValueError, match="^texc"):
        texture.sample([[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="^texc"):
        texture.sample(torch.tensor([[0.0, float("nan"), 0.0]]))
    # Far-away finite (and infinite) positions clamp to the AABB, as nvdiffrec's sample does.
    far = texture.sample(torch.tensor([[3e38, -3e38, float("inf")]]))
    assert torch.isfinite(far).all()


# ----------------------------------------------------------------------------- 3: files
def _mesh_files(folder: Path, obj: str | bytes, mtl: str | bytes | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.obj"
    path.write_bytes(obj if isinstance(obj, bytes) else obj.encode())
    if mtl is not None:
        (folder / "m.mtl").write_bytes(mtl if isinstance(mtl, bytes) else mtl.encode())
    return path


CUBE = (
    "mtllib m.mtl\nusemtl red\n"
    + "".join(f"v {x} {y} {z}\n" for x in (0, 1) for y in (0, 1) for z in (0, 1))
    + "f 1 2 4\nf 1 4 3\nf 5 7 8\nf 5 8 6\nf 1 5 6\nf 1 6 2\nf 3 4 8\nf 3 8 7\n"
)
# The cube with one texture coordinate on every corner (a textured material needs vt).
CUBE_VT = "vt 0 0\n" + re.sub(r"(?m)^(f) (\d+) (\d+) (\d+)$", r"\1 \2/1 \3/1 \4/1", CUBE)


@pytest.mark.parametrize(
    "obj, mtl, names",
    [
        (bytes(range(256)) * 4, None, "m.obj"),
        (CUBE.replace("v 0 0 0", "v nan 0 0"), "newmtl red\nKd 1 0 0\n", "m.obj"),
        (CUBE.replace("usemtl red", "usemtl café"), None, "m.obj"),  # no MTL file
        (CUBE_VT, "newmtl red\nmap_Kd tex.png\n", "tex.png"),  # corrupt PNG, see below
        (CUBE, b"newmtl red\nKd 1 0 \x00\n", "m.mtl"),
        ("mtllib m.mtl\nusemtl red\nv 0 0 0\nv 0 0 0\nv 0 0 0\nf 1 2 3\n",
         "newmtl red\nKd 1 0 0\n", "same point"),  # one repeated point
        ("v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 3\nusemtl x\n", None, "m.obj"),
        (CUBE.replace("v 1 1 1", "v 1 1"), "newmtl red\nKd 1 0 0\n", "m.obj"),
    ],
    ids=["random_bytes", "nan_vertex", "missing_mtl", "corrupt_png", "binary_mtl", "one_point",
         "undefined_material", "short_vertex"],
)  # fmt: skip
def test_corrupt_mesh_files_are_one_line_naming_the_file(tmp_path, obj, mtl, names):
    path = _mesh_files(tmp_path / "mesh", obj, mtl)
    (tmp_path / "mesh" / "tex.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    message = start_error(
        tmp_path / "run", "scene=mesh", f"scene.path={path}", "scene.resolution=16"
    )
    assert names in message and ("scene.path" in message or message.startswith(str(tmp_path)))
    assert str(tmp_path) in message  # the file is named


def test_latin1_mtl_loads_and_a_flat_mesh_is_refused_naming_the_file(tmp_path):
    path = _mesh_files(tmp_path / "mesh", CUBE.replace("red", "caf\xe9").encode("latin-1"),
                       "newmtl caf\xe9\nKd 1 0 0\n".encode("latin-1"))  # fmt: skip
    metrics = train(tiny_cfg("scene=mesh", f"scene.path={path}", "scene.resolution=16",
                             "train.iterations=1"), tmp_path / "ok")  # fmt: skip
    assert metrics["status"] == "completed"
    flat = _mesh_files(tmp_path / "flat", "mtllib m.mtl\nusemtl a\n"
                       "v 0 0 0\nv 1 0 0\nv 0 1 0\nf 1 2 3\n", "newmtl a\nKd 1 1 1\n")  # fmt: skip
    message = start_error(tmp_path / "run", "scene=mesh", f"scene.path={flat}")
    assert message.startswith(f"scene.path: {flat}: the mesh has zero extent along z")


def test_a_relative_mesh_path_is_recorded_absolute(tmp_path, monkeypatch):
    # As typed, it would be found only from the directory the run started in: export, rescore
    # and a resume from anywhere else would not find the mesh.
    _mesh_files(tmp_path / "mesh", CUBE, "newmtl red\nKd 1 0 0\n")
    monkeypatch.chdir(tmp_path)
    cfg = tiny_cfg("scene=mesh", "scene.path=mesh/m.obj", "scene.resolution=16",
                   "train.iterations=2")  # fmt: skip
    train(cfg, tmp_path / "run")
    recorded = read_metrics(tmp_path / "run")["config"]["scene"]["path"]
    assert recorded == str(tmp_path / "mesh" / "m.obj")
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["config"][
        "scene"]["path"] == recorded  # fmt: skip
    resumed = train(
        tiny_cfg(
            "scene=mesh",
            "scene.path=mesh/m.obj",
            "scene.resolution=16",
            "train.iterations=3",
            "train.resume=true",
        ),
        tmp_path / "run",
    )
    assert resumed["status"] == "completed"  # the same path, typed relative again
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    ckpt["config"]["scene"]["path"] = "mesh/m.obj"  # as a run recorded it before
    torch.save(ckpt, tmp_path / "run" / "checkpoint.pt")
    resumed = train(
        tiny_cfg(
            "scene=mesh",
            "scene.path=mesh/m.obj",
            "scene.resolution=16",
            "train.iterations=4",
            "train.resume=true",
        ),
        tmp_path / "run",
    )
    assert resumed["status"] == "completed" and resumed["resumed_from"] == 3


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("good")
    train(tiny_cfg("train.iterations=2"), run_dir)
    return run_dir / "checkpoint.pt"


@pytest.mark.parametrize("damage", ["random", "truncated", "missing_keys", "not_a_dict", "empty"])
def test_corrupt_checkpoint_on_resume_is_one_line_naming_the_file(tmp_path, good_checkpoint,
                                                                 damage):  # fmt: skip
    path = tmp_path / "checkpoint.pt"
    data = good_checkpoint.read_bytes()
    if damage == "random":
        path.write_bytes(os.urandom(4096))
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "missing_keys":
        ckpt = load_checkpoint(good_checkpoint)
        del ckpt["config"]
        torch.save(ckpt, path)
    elif damage == "not_a_dict":
        torch.save([1, 2, 3], path)
    else:
        path.write_bytes(b"")
    message = start_error(tmp_path, "train.iterations=4", "train.resume=true")
    assert message.startswith(f"{path}: ")


# ----------------------------------------------------------------------------- 1: no corruption
def test_nonfinite_gradient_leaves_parameters_and_adam_state_bit_identical():
    for arm in ("f32", "bf16", "nvdiffrec"):
        texture = MLPTexture3D([[-1] * 3, [1] * 3], precision=arm,
                               encoder={"n_levels": 2, "log2_hashmap_size": 8})  # fmt: skip
        optimizer = torch.optim.Adam(texture.parameters(), lr=1e-2)
        stepper = PrecisionStepper(texture.policy, optimizer)
        points = torch.rand(64, 3) * 2 - 1
        assert not stepper(texture.sample(points).sum()).diverged
        before = {k: v.clone() for k, v in texture.state_dict().items()}
        adam = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
        optimizer.zero_grad()
        loss = texture.sample(points).sum()
        stepper.backward(loss)
        texture.net.layers[1].weight.grad[0, 0] = float("inf")  # one weight, finite loss
        result = stepper.step()
        assert result.skipped and result.diverged, arm
        for k, v in texture.state_dict().items():
            assert torch.equal(v, before[k]), (arm, k)
        for state, saved in zip(optimizer.state.values(), adam, strict=True):
            assert all(torch.equal(state[k], saved[k]) for k in saved), arm


def _inject_inf_gradient_at(monkeypatch, iteration: int) -> None:
    """Make the gradient of one MLP weight inf in backward number ``iteration`` (loss finite)."""
    build = loop.build_texture

    def patched(*args, **kwargs):
        texture = build(*args, **kwargs)
        calls = {"n": 0}

        def hook(grad):
            calls["n"] += 1
            if calls["n"] == iteration + 1:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        texture.net.layers[0].weight.register_hook(hook)
        return texture

    monkeypatch.setattr(loop, "build_texture", patched)


@pytest.mark.parametrize("at, planned", [(5, 8), (3, 4)])
def test_inf_gradient_ends_the_run_at_that_iteration_keeping_the_last_good_checkpoint(
    tmp_path, monkeypatch, at, planned
):
    _inject_inf_gradient_at(monkeypatch, at)
    m = train(tiny_cfg("precision=f32", f"train.iterations={planned}",
                       "train.checkpoint_interval=2"), tmp_path)  # fmt: skip
    assert m["status"] == "diverged" and m["diverged_at"] == at and m["iterations"] == at
    assert math.isfinite(m["psnr"])  # the weights are those before the bad step
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["iteration"] == at - at % 2 and finite_weights(ckpt)
    assert read_metrics(tmp_path)["status"] == "diverged"


@pytest.mark.parametrize("during", ["last iteration", "final validation"])
def test_a_stop_signal_as_a_run_diverges_is_recorded_with_the_part_it_came_in(
    tmp_path, monkeypatch, during
):
    # The inf gradient of backward 3 (0-based) ends the 4-iteration run as diverged at 3, its
    # last iteration. A SIGTERM in that iteration's forward (train.inject_signal_at=3), or in
    # the final validation finish() then runs for it, stops nothing: it is recorded with the
    # part of the run it came in.
    _inject_inf_gradient_at(monkeypatch, 3)
    overrides = ["precision=f32", "train.iterations=4"]
    if during == "last iteration":
        overrides.append("train.inject_signal_at=3")
    else:
        real = loop.evaluate

        def evaluate(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*args, **kwargs)

        monkeypatch.setattr(loop, "evaluate", evaluate)
    m = train(tiny_cfg(*overrides), tmp_path)
    assert m["status"] == "diverged" and m["diverged_at"] == 3
    expected = {"signal": "SIGTERM", "during": during}
    assert m["stop_requested"] == read_metrics(tmp_path)["stop_requested"] == expected


def test_f16_naive_one_iteration_is_diverged_with_no_nan_checkpoint(tmp_path):
    m = train(tiny_cfg("precision=f16_naive", "train.iterations=1"), tmp_path)
    assert m["status"] == "diverged" and m["diverged_at"] == 0
    assert read_metrics(tmp_path)["psnr"] is None
    assert not (tmp_path / "checkpoint.pt").exists()


def test_save_refuses_non_finite_weights_and_keeps_the_last_good_file(tmp_path, good_checkpoint):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(good_checkpoint.read_bytes())
    bad = load_checkpoint(path)
    bad["texture"]["net.net.0.weight"][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="non-finite"):
        save_checkpoint(path, bad)
    assert path.read_bytes() == good_checkpoint.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


def test_nan_psnr_is_never_completed(tmp_path, monkeypatch):
    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda *a: {**real(*a), "psnr": float("nan")})
    m = train(tiny_cfg("train.iterations=2"), tmp_path)
    assert m["status"] == "diverged" and read_metrics(tmp_path)["psnr"] is None


# ----------------------------------------------------------------------------- 5: resume
def test_auto_resume_says_when_it_starts_over_a_checkpoint_without_a_record(tmp_path, capsys):
    # A kill before any metrics.json leaves checkpoint.pt alone: train.resume=auto starts over
    # (its rule), and says so in one line; after a stop signal it continues, without the line.
    train(tiny_cfg("train.iterations=2"), tmp_path)
    (tmp_path / "metrics.json").unlink()
    capsys.readouterr()
    again = train(tiny_cfg("train.iterations=2"), tmp_path)
    assert again["resumed_from"] is None
    assert capsys.readouterr().err.splitlines() == [
        f"mptex: {tmp_path / 'checkpoint.pt'} is of a run that ended without a record "
        "(killed?); train.resume=auto starts over, train.resume=true continues from it"
    ]
    record = read_metrics(tmp_path)
    record["status"] = "interrupted"
    (tmp_path / "metrics.json").write_text(json.dumps(record))
    train(tiny_cfg("train.iterations=3"), tmp_path)
    assert "without a record" not in capsys.readouterr().err


def test_auto_resume_says_it_only_beside_a_checkpoint_it_starts_over(tmp_path, capsys,
                                                                     monkeypatch):  # fmt: skip
    line = "ended without a record"
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    train(tiny_cfg("train.iterations=2"), tmp_path)  # an empty directory: nothing to say
    assert line not in capsys.readouterr().err
    # A refused start's record tells no more of how the checkpoint's run ended than none does.
    refused = {**read_metrics(tmp_path), "status": "failed", "failed_at": "start"}
    (tmp_path / "metrics.json").write_text(json.dumps(refused))
    assert train(tiny_cfg("train.iterations=2"), tmp_path)["resumed_from"] is None
    assert line in capsys.readouterr().err
    # A Slurm requeue continues the checkpoint without a record: nothing to say.
    (tmp_path / "metrics.json").unlink()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert train(tiny_cfg("train.iterations=3"), tmp_path)["resumed_from"] == 2
    assert line not in capsys.readouterr().err


def test_resume_after_a_kill_between_final_checkpoint_and_metrics(tmp_path):
    first = train(tiny_cfg("train.iterations=3"), tmp_path)
    (tmp_path / "metrics.json").unlink()
    (tmp_path / ".checkpoint.pt.x1y2.tmp").write_bytes(b"half")  # a killed write
    (tmp_path / ".metrics.json.abc.tmp").write_bytes(b"{")
    again = train(tiny_cfg("train.iterations=3", "train.resume=true"), tmp_path)
    assert again["status"] == "completed" and again["iterations"] == 3
    assert again["final_loss"] == first["final_loss"]
    assert again["time_per_iter_s"] == first["time_per_iter_s"] > 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_resume_with_fewer_planned_iterations_is_an_error(tmp_path):
    # Refused in one line; the completed run's record stays, with the attempt added to it.
    train(tiny_cfg("train.iterations=4"), tmp_path)
    assert read_metrics(tmp_path)["status"] == "completed"
    message = start_error(tmp_path, "train.iterations=2", "train.resume=true")
    assert message.startswith("train.iterations: expected at least the 4 iterations")
    assert read_metrics(tmp_path)["status"] == "completed"


def test_views_that_cannot_fit_in_memory_are_refused_at_start(tmp_path, monkeypatch):
    # The views' buffers of a resolution (and a supersampled validation) the device cannot
    # hold: one line at start, not the allocator's failure (or the kernel's OOM kill) later.
    from mptex.train import config as train_config

    monkeypatch.setattr(train_config, "available_bytes", lambda device: 2**30)  # 1 GiB free
    message = start_error(tmp_path, "scene.resolution=2048", "train.val_spp=4")
    # 2048^2 x (2 + 1 x 4^2) pixels x 57 bytes (G-buffer and reference RGBA)
    assert message == (
        "scene.resolution: 2 training and 1 validation views of 2048 x 2048 pixels (validation "
        "at train.val_spp=4 x that) need 4.0 GiB for their buffers alone, only 1.0 GiB is free "
        "on cpu (lower scene.resolution, the view counts or train.val_spp)"
    )
    train(tiny_cfg("train.iterations=1"), tmp_path / "fits")  # the tiny scene fits in 1 GiB


def test_an_iteration_that_cannot_fit_in_memory_is_refused_at_start(tmp_path, monkeypatch):
    # train.batch_size=10**9 passed the start checks (the views fit) and ran out of memory in
    # the first iteration, whose images are batch_size x the resolution. The estimate is a
    # lower bound: 56 bytes per pixel of the batch (reference RGBA, coverage, background, the
    # composite's product, the prediction, all float32 and alive at once), where one
    # iteration of train.batch_size=2048 at 24 x 24 measured 614 MB more peak RSS on a CPU
    # than one of 32 (about 530 bytes per pixel: the image, the loss, the activations too).
    from mptex.train import config as train_config

    monkeypatch.setattr(train_config, "available_bytes", lambda device: 2 << 30)
    message = start_error(tmp_path, "train.batch_size=1000000000")
    # 10**9 x 24 x 24 x 56 bytes = 3.0e4 GiB
    assert message == (
        "train.batch_size: an iteration of 1000000000 views of 24 x 24 pixels needs 3e+04 GiB "
        "for its images alone (3e+04 GiB with the views' buffers), only 2.0 GiB is free on "
        "cpu (lower train.batch_size or scene.resolution)"
    )
    train(tiny_cfg("train.iterations=1", "train.batch_size=64"), tmp_path / "fits")


def test_a_knot_whose_rasterization_cannot_fit_is_refused_at_start(tmp_path, monkeypatch):
    # scene.tubular_segments=100000 with radial_segments=8 passed the start checks and ended
    # in the allocator's traceback while the views were rasterized (5.2 GB at the peak). The
    # tiny run draws 2 views in one call: 1.6e6 triangles x 12 bytes, 8e5 vertices x (12 +
    # 2 x 16) bytes and one block of 65536 triangle instances x 59 bytes = 58,266,624 bytes, a
    # lower bound (tests/test_config_edges).
    from mptex.train import config as train_config

    monkeypatch.setattr(train_config, "available_bytes", lambda device: 2**25)  # 32 MiB
    overrides = ("scene.tubular_segments=100000", "scene.radial_segments=8")
    message = start_error(tmp_path, *overrides, "scene.raster_backend=torch")
    assert message == (
        "scene.tubular_segments: the builtin knot of 100000 x 8 segments (1600000 triangles), "
        "rasterized 2 views at a time, needs 0.0543 GiB for the mesh and the rasterizer's "
        "per-triangle work alone, only 0.0 GiB is free on cpu (lower scene.tubular_segments or "
        "scene.radial_segments)"
    )
    message = start_error(
        tmp_path / "radial", "scene.tubular_segments=8", "scene.radial_segments=100000"
    )
    assert message.startswith("scene.radial_segments: the builtin knot of 8 x 100000 segments")
    train_config.validate_config(tiny_cfg("scene.tubular_segments=1000", "scene.radial_segments=8"))


def test_mlp_activations_that_cannot_fit_are_refused_before_the_texture_is_built(
    tmp_path, monkeypatch
):
    # texture.hidden=10**6 passed the parameter estimate (4.35 GB of training state) and
    # ended in a MemoryError minutes later, in the first iteration: each hidden layer's
    # backward keeps its input at every covered point. The tiny run's views cover 128 and 183
    # pixels: an iteration of 1 view has 128 x 2 points at least (the kd smoothness term's
    # jittered copies), 10**6 layers x 16 x 256 x 4 bytes = 16,384,000,000 bytes, a lower
    # bound: one iteration at texture.hidden=8000 measured 798 MB more peak RSS on a CPU than
    # at 2, where this counts 201 MB (activations, training state, 2 x 7998 more modules of
    # 2212 bytes: an empty torch module's Python objects under Python 3.11).
    from mptex.train import config as train_config

    monkeypatch.setattr(train_config, "available_bytes", lambda device: 8 << 30)
    message = start_error(tmp_path, "texture.hidden=1000000")
    pattern = (
        r"texture\.hidden: an MLP of 1000001 layers 16 wide keeps 15\.3 GiB of activations for "
        r"the backward of an iteration \(256 points at least: train\.batch_size=1 views, the "
        r"fewest covered pixels of a training view 128\), ([0-9.]+) GiB with its training "
        r"state and its 2000001 modules, only 8\.0 GiB is free on cpu \(lower texture\.hidden, "
        r"texture\.internal_dims or train\.batch_size\)"
    )
    total = re.fullmatch(pattern, message)
    assert total is not None, message
    # The activations and 1e6 x (16 x 16 + 16) parameters' training state (weights, gradients,
    # Adam's two moments: 16 bytes each) come to 19.3 GiB; the modules' share depends on the
    # interpreter (2212 bytes an empty module under Python 3.11: 4.1 GiB), a few KiB each.
    state = (16_384_000_000 + 1_000_000 * 272 * 16) / 2**30
    assert state + 1 <= float(total.group(1)) <= state + 2_000_001 * 8192 / 2**30
    assert not (tmp_path / "checkpoint.pt").exists()


def test_an_mlp_that_cannot_fit_in_memory_is_refused_at_start(tmp_path, monkeypatch):
    # A width or depth the device cannot hold the MLP's training state for: one line at start,
    # not the allocator's failure while the texture is built.
    from mptex.train import config as train_config

    # The tiny texture's 4 levels x 2 features in, 3 channels out, width 8192, hidden 3:
    # (8 + 1) * 8192 + 2 * (8192 + 1) * 8192 + (8192 + 1) * 3 = 134,332,419 parameters,
    # x 16 bytes (weight, gradient, Adam's two moments) = 2,149,318,704 bytes = 2.0017 GiB.
    needed = 2_149_318_704
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed - 1)
    message = start_error(tmp_path, "texture.internal_dims=8192", "texture.hidden=3")
    assert message == (
        "texture.internal_dims: an MLP of 4 layers 8192 wide (1.34e+08 parameters) needs 2 GiB "
        "for its weights, gradients and Adam's moments alone, only 2.0 GiB is free on cpu "
        "(lower texture.internal_dims or texture.hidden)"
    )
    monkeypatch.setattr(train_config, "available_bytes", lambda device: needed)
    train_config.validate_config(tiny_cfg("texture.internal_dims=8192", "texture.hidden=3"))
    # Deeper than wide: the depth is named. 10**9 layers of width 16 (the tiny texture's).
    message = start_error(tmp_path / "deep", "texture.hidden=1000000000")
    assert message.startswith("texture.hidden: an MLP of 1000000001 layers 16 wide (2.72e+11 ")
    # Its output layer the largest: the channels are named. (16 + 1) x 10**8 of 1.7e9.
    message = start_error(tmp_path / "wide_out", "texture.channels=100000000")
    assert message == (
        "texture.channels: an MLP of 3 layers 16 wide with 100000000 output channels (1.7e+09 "
        "parameters) needs 25.3 GiB for its weights, gradients and Adam's moments alone, only "
        "2.0 GiB is free on cpu (lower texture.channels)"
    )


def test_an_fp8_amax_history_that_cannot_fit_is_refused_at_start(tmp_path, monkeypatch):
    # Each FP8 layer keeps 3 scaling states (input, weight, gradient), each a float32 history
    # of fp8_amax_history_len amaxes: 10**12 of them in the tiny texture's 3 layers need
    # 9 x 4e12 bytes, and the allocator's multi-line error came while the texture was built.
    from mptex.train import config as train_config

    monkeypatch.setattr(train_config, "available_bytes", lambda device: 2 << 30)
    message = start_error(tmp_path, "precision=fp8", "precision.fp8_amax_history_len=1000000000000")
    assert message == (
        "precision.fp8_amax_history_len: 9 FP8 scaling states (input, weight and gradient of "
        "3 layers) of 1000000000000 float32 amaxes each need 3.35e+04 GiB, only 2.0 GiB is "
        "free on cpu (Transformer Engine's default: 1024)"
    )
    # 2 GiB hold 2**31 / 36 = 59,652,323 amaxes per state; the default fits
    train_config.validate_config(tiny_cfg("precision=fp8", "precision.fp8_amax_history_len=1024"))


def test_a_crash_while_starting_is_recorded_then_raised(tmp_path, monkeypatch):
    # Not a config error (e.g. the scene's buffers do not fit in memory): metrics.json says
    # where and why, and the error reaches the caller as it came.
    from mptex.train import loop

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory:\nyou tried to allocate 1 TB")

    monkeypatch.setattr(loop, "build_scene", out_of_memory)
    with pytest.raises(RuntimeError, match="^DefaultCPUAllocator"):
        train(tiny_cfg("train.iterations=2"), tmp_path)
    metrics = read_metrics(tmp_path)
    assert metrics["status"] == "failed" and metrics["failed_at"] == "start"
    assert metrics["error"] == ("RuntimeError: DefaultCPUAllocator: not enough memory: you "
                                "tried to allocate 1 TB")  # fmt: skip
    assert metrics["config"]["train"]["device"] == "cpu"  # recorded as checked
    # a scene path as a started run records it: absolute, so the report compares it
    from mptex.train.config import normalized_config

    assert normalized_config({"scene": {"name": "mesh", "path": "m.obj"}})["scene"]["path"] == (
        os.path.abspath("m.obj")
    )


def test_resume_with_another_seed_is_an_error_naming_it(tmp_path):
    # The report pairs runs by train.seed: a resume under another seed would relabel a run whose
    # initial weights and random streams are the first seed's. Other train keys may change.
    train(tiny_cfg("train.iterations=2", "train.seed=0"), tmp_path)
    path = tmp_path / "checkpoint.pt"
    message = start_error(tmp_path, "train.iterations=4", "train.resume=true", "train.seed=5",
                          "train.init_seed=1")  # fmt: skip
    assert message == (f"train.resume: checkpoint {path} was trained with another train config "
                       "(different: train.init_seed, train.seed)")  # fmt: skip
    resumed = train(tiny_cfg("train.iterations=3", "train.resume=true", "train.seed=0",
                             "train.lr=0.002"), tmp_path)  # fmt: skip
    assert resumed["status"] == "completed" and resumed["resumed_from"] == 2
    # init_seed null is train.seed's: the same initial weights as an explicit init_seed=0
    resumed = train(tiny_cfg("train.iterations=4", "train.resume=true", "train.seed=0",
                             "train.init_seed=0"), tmp_path)  # fmt: skip
    assert resumed["status"] == "completed" and resumed["resumed_from"] == 3


def test_resume_on_another_kind_of_device_is_an_error(tmp_path):
    # A run's random streams are its device's (a CUDA generator's state is not a CPU one's):
    # a checkpoint of a GPU run does not resume on the CPU, in one line at start.
    train(tiny_cfg("train.iterations=2"), tmp_path)
    path = tmp_path / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=False)
    ckpt["config"]["train"]["device"] = "cuda:0"  # as a GPU run writes it
    torch.save(ckpt, path)
    message = start_error(tmp_path, "train.iterations=4", "train.resume=true")
    assert message == (
        f"train.resume: checkpoint {path} was trained on cuda, this run is on "
        "cpu: a resume continues on the device it started on (train.device)"
    )


def test_output_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        train(tiny_cfg("train.iterations=1"), tmp_path)
    finally:
        os.umask(old)
    for name in ("checkpoint.pt", "metrics.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name


# ----------------------------------------------------------------------------- 4: mptex-check
def test_check_exit_codes(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("channels: [3\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("channels: 3\nfoo: 1\n")
    small = ["--points", "128"]
    assert check_main([*small, "--texture-config", str(broken)]) == 2
    assert check_main([*small, "--texture-config", str(unknown)]) == 2
    assert check_main([*small, "--out", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert check_main([*small, "--cotangent-scale", "-1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 4 and all(e.startswith("mptex-check: error: --") for e in errors)
    assert "texture.foo" in errors[1]
    # A value only the texture's constructor checks: named with the file and the full key.
    # and a backend key the setups' flags override, said.
    for text, code, said in (
        ("encoder:\n  n_levels: 0\n", 2, "error: --texture-config: {}: texture.encoder."
         "n_levels: must be an integer >= 1 and <= 32, got 0"),
        ("backend: tcnn\nencoder:\n  n_levels: 2\n  log2_hashmap_size: 8\n", 0,
         "--texture-config: {}: its backend 'tcnn' is not used; --backend-a and --backend-b "
         "choose the grid's backend"),
    ):  # fmt: skip
        path = tmp_path / f"case{code}.yaml"
        path.write_text(text)
        assert check_main([*small, "--texture-config", str(path)]) == code
        assert capsys.readouterr().err.strip() == f"mptex-check: {said.format(path)}"
    assert check_main(["--a", "f32", "--b", "f16_naive", "--points", "512"]) == 1
    assert check_main(["--a", "f32", "--b", "f16_dynamic", "--points", "512"]) == 0


# ----------------------------------------------------------------------------- the real CLI
def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    flags = [a for a in args if a.startswith("-") and "=" not in a]  # before the overrides
    args = [a for a in args if a not in flags]
    cmd = [sys.executable, "-m", "mptex.cli", *flags, f"hydra.run.dir={tmp_path}",
           f"hydra.sweep.dir={tmp_path}", *TINY, *args]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, start",
    [
        (["texture.encoder.n_levels=0"], "texture.encoder.n_levels"),
        (["train.resume=true"], "{dir}/checkpoint.pt: not a readable checkpoint"),
    ],
)
def test_cli_errors_are_one_line_with_exit_2(tmp_path, args, start):
    (tmp_path / "checkpoint.pt").write_bytes(os.urandom(100))
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(f"mptex-train: error: {start.format(dir=tmp_path)}")
    assert read_metrics(tmp_path)["status"] == "failed"


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.iteratons=5"], "Could not override 'train.iteratons': no such key (did you "
                                "mean train.iterations?)"),
        (["train.nothing_like_it=5"], "Could not override 'train.nothing_like_it'. To append to "
                                      "your config use +train.nothing_like_it=5"),
        (["-m", "precision=f32,f99"], "In 'config': Could not find 'precision/f99' Available "
                                      "options in 'precision': amp bf16 "),
        (["hydra/launcher=nope"], "In 'hydra/config': Could not find 'hydra/launcher/nope'"),
        # composed, but a value the run refuses: the sweep's other jobs do not train first
        (["-m", "train.seed=0,1,x"], "train.seed: expected an integer in [0, 2**63 - 1), got "
                                     "'x'"),
        (["-m", "precision=f32,bf16", "train.lr=0.01,-1"], "train.lr: expected a finite "
                                                           "number > 0, got -1"),
    ],
)  # fmt: skip
def test_overrides_hydra_cannot_compose_are_one_line_with_exit_2(tmp_path, args, message):
    # Checked before any job starts: a sweep with one bad value runs none and writes no report.
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(f"mptex-train: error: {message}")
    assert "Config search path" not in proc.stderr
    assert not list(tmp_path.rglob("metrics.json")) and not list(tmp_path.rglob("report.md"))


def test_the_override_check_leaves_what_hydra_accepts_to_hydra():
    from mptex.cli.app import override_problem, register_experiments

    register_experiments()
    for argv in (
        ["-m", "precision=glob(f16*)"],  # expanded by Hydra's config loader only
        ["-m", "precision=choice(f32,bf16)", "train.seed=range(0,3)"],
        ["~train.tensorboard", "++train.lr=0.02", "hydra.job.chdir=true"],
        ["scene=mesh", "scene.path='/tmp/a,b.obj'", "hydra.run.dir=out/${now:%H}"],
        ["-m", "+experiment=real_assets", "hydra/launcher=submitit_slurm"],
        ["--cfg", "job", "precision=f99"],  # Hydra's own flags: Hydra's to report
    ):
        assert override_problem(argv) is None, argv
    assert override_problem(["train.lr=[1,"]).startswith("override syntax: no viable")
    # a key the config lacks but nearly has: named, as a typo is the likelier cause
    assert override_problem(["train.iteratons=5"]) == (
        "Could not override 'train.iteratons': no such key (did you mean train.iterations?)"
    )
    assert override_problem(["nothing.like.it=1"]).endswith("+nothing.like.it=1")


def test_a_ctrl_c_while_the_check_composes_is_an_interrupt_not_a_config_problem(monkeypatch):
    # Hydra and OmegaConf can turn a KeyboardInterrupt in the middle of a composition into
    # another error (an empty ConfigCompositionException, an AttributeError of a half-built
    # node): the check must not report it as the config's problem (it printed "error: " and
    # exited 2) or take it for something it cannot read and go on.
    import hydra

    from mptex.cli.app import override_problem, register_experiments

    register_experiments()

    def interrupted(kind):
        def compose_interrupted(*args, **kwargs):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as exc:
                raise kind("") from exc

        return compose_interrupted

    from hydra.errors import ConfigCompositionException

    for kind in (ConfigCompositionException, AttributeError):
        monkeypatch.setattr(hydra, "compose", interrupted(kind))
        with pytest.raises(KeyboardInterrupt):
            override_problem(["-m", "train.seed=0,1"])

    # an error of its own (no interrupt behind it) is still the config's or Hydra's
    def failing(*args, **kwargs):
        raise ConfigCompositionException("Could not override 'train.iteratons'.")

    monkeypatch.setattr(hydra, "compose", failing)
    assert override_problem(["train.iteratons=5"]).startswith("Could not override")


def test_a_ctrl_c_outside_a_training_loop_is_one_line_and_exit_3(tmp_path, monkeypatch, capsys):
    # Before a run's handler takes SIGINT over (Hydra composing, the scene's start) or after
    # it gives it back: one line, not a traceback, and the status of an interrupted command.
    from hydra.core.global_hydra import GlobalHydra

    from mptex.cli.app import EXIT_CODES, run_hydra_app

    def task(cfg):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mptex-train", "train=tiny", f"hydra.run.dir={tmp_path}"])
    try:
        with pytest.raises(SystemExit) as info:
            run_hydra_app(task, "mptex-train")
    finally:
        GlobalHydra.instance().clear()
    assert info.value.code == EXIT_CODES["interrupted"] == 3
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "mptex-train: interrupted by SIGINT outside a training loop: no checkpoint was written "
        "for it; files written before it are as they were"
    ]


def test_a_ctrl_c_that_hydra_reports_as_its_own_error_is_still_exit_3(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    # A Ctrl-C in the middle of Hydra's work can surface as another exception (a half-built
    # node's AttributeError), which Hydra prints and ends with status 1: the command still
    # ends as an interrupted one, with its line after Hydra's.
    from hydra.core.global_hydra import GlobalHydra

    from mptex.cli.app import EXIT_CODES, run_hydra_app

    def task(cfg):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt as exc:
            raise AttributeError("'NoneType' object has no attribute '_get_node'") from exc

    def failing_task(cfg):  # Hydra's status 1 without a Ctrl-C stays 1
        raise AttributeError("a failure of its own")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mptex-train", "train=tiny", f"hydra.run.dir={tmp_path}"])
    # As a command started in a terminal: Python's own SIGINT handler (a shell's background job
    # starts with SIGINT ignored, which the command leaves as it is).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        codes = []
        for each in (task, failing_task):
            try:
                with pytest.raises(SystemExit) as info:
                    run_hydra_app(each, "mptex-train")
            finally:
                GlobalHydra.instance().clear()
            codes.append(info.value.code)
            err = capsys.readouterr().err
            if each is task:
                assert "AttributeError" in err, err
                assert err.splitlines()[-1] == (
                    "mptex-train: interrupted by SIGINT outside a training loop: no checkpoint "
                    "was written for it; files written before it are as they were"
                )
            else:
                assert "interrupted" not in err, err
        assert codes == [EXIT_CODES["interrupted"], 1]
        # the command's own handler is gone with it
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_required_scene_path_left_unset_is_named_as_unset(tmp_path):
    # Not as a file "<cwd>/???" that was not found.
    from hydra import compose, initialize_config_dir

    from mptex.cli import CONFIG_DIR
    from mptex.train import ConfigError, train

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["scene=mesh"])
    with pytest.raises(ConfigError) as info:
        train(cfg, tmp_path)
    assert str(info.value) == "scene.path: required for scene 'mesh', not set"


def test_a_sweep_checks_each_value_with_the_runs_own_check_before_its_first_job():
    from mptex.cli.app import override_problem, register_experiments
    from mptex.cli.train import _sweep_value_problem

    register_experiments()
    check = _sweep_value_problem
    # The shipped experiments pass; an arm this machine cannot run is left to its job (the
    # report lists it as unavailable); a single run checks itself when it starts.
    for argv in (["-m", "+experiment=quick"], ["-m", "+experiment=nvdiffrec154"],
                 ["-m", "+experiment=precision_search"], ["train.seed=x"],
                 ["-m", "+experiment=gpu_main", "train.device=cpu"]):  # fmt: skip
        assert override_problem(argv, check) is None, argv
    assert override_problem(["-m", "train.iterations=5,0"], check) == (
        "train.iterations: expected an integer >= 1 (optimizer steps; 0 would train nothing), got 0"
    )
    # the scene group too, which a run checks when it builds its scene
    assert override_problem(["-m", "scene=mesh", "train.seed=0,1"], check) == (
        "scene.path: required for scene 'mesh', not set"
    )
    # What a run needs from a machine is not checked here: the jobs may run on other machines
    # (a GPU node of a cluster), whose devices and backends the launcher's machine lacks.
    for argv in (["-m", "train.device=cpu,cuda", "train.seed=0,1"],
                 ["-m", "precision=tcnn_fused", "precision.mlp_backend=tcnn", "train.seed=0,1"],
                 ["-m", "texture.backend=triton", "train.seed=0,1"]):  # fmt: skip
        assert override_problem(argv, check) is None, argv
    # an experiment's sweeper params set each job's values of their keys: not checked here;
    # the command line's other values are
    assert override_problem(["-m", "+experiment=quick", "train.iterations=5,-5"], check) == (
        "train.iterations: expected an integer >= 1 (optimizer steps; 0 would train nothing), "
        "got -5"
    )


def test_a_local_sweep_looks_for_its_scenes_files_before_its_first_job(tmp_path, monkeypatch):
    from mptex.cli.app import override_problem, register_experiments
    from mptex.cli.train import _sweep_value_problem

    register_experiments()
    monkeypatch.chdir(tmp_path)  # relative paths are the user's, as the jobs' (no chdir);
    # the check resolves them, and says the resolved path
    (tmp_path / "a.obj").write_text("")
    sweep = ["-m", "scene=mesh", "scene.path=a.obj,b.obj"]
    # the launchers that run the jobs here: the second value's file is missing
    for launcher in ("basic", "local_parallel", "submitit_local"):
        argv = [*sweep, f"hydra/launcher={launcher}"]
        assert override_problem(argv, _sweep_value_problem) == (
            f"scene.path: file not found: {tmp_path / 'b.obj'}"
        ), launcher
    # every file there: nothing to say
    (tmp_path / "b.obj").write_text("")
    assert override_problem(sweep, _sweep_value_problem) is None
    # a cluster's nodes may see other files than the machine that submits: left to the job
    slurm = ["-m", "scene=mesh", "scene.path=a.obj,c.obj", "hydra/launcher=submitit_slurm"]
    assert override_problem(slurm, _sweep_value_problem) is None
    # a NeRF-synthetic dataset: its folder, its mesh, each split's transforms file
    (tmp_path / "data").mkdir()
    nerf = ["-m", "scene=nerf", "scene.path=data", "scene.mesh=a.obj", "train.seed=0,1"]
    assert override_problem(nerf, _sweep_value_problem) == (
        f"scene.train_split: {tmp_path / 'data'}/transforms_train.json not found"
    )
    nerf_missing = ["-m", "scene=nerf", "scene.path=data,gone", "scene.mesh=a.obj"]
    (tmp_path / "data" / "transforms_train.json").write_text("{}")
    (tmp_path / "data" / "transforms_test.json").write_text("{}")  # the default val_split
    assert override_problem(nerf_missing, _sweep_value_problem) == (
        f"scene.path: dataset folder not found: {tmp_path / 'gone'}"
    )


def test_cli_f16_naive_one_iteration_says_diverged(tmp_path):
    proc = run_cli(tmp_path, "precision=f16_naive", "train.iterations=1")
    assert proc.returncode == 0, proc.stderr
    assert "diverged at iteration 0" in proc.stdout
    assert not (tmp_path / "checkpoint.pt").exists()


# ----------------------------------------------------------------------------- kill -9
_CHILD = textwrap.dedent(
    """
    import io, os, sys, time
    import torch
    from hydra import compose, initialize_config_dir
    from mptex.cli import CONFIG_DIR
    from mptex.train import train

    run_dir, slow = sys.argv[1], float(sys.argv[2])
    if slow:  # write half of each checkpoint, say so, pause: a kill lands mid-write
        real_save = torch.save
        def save(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2]); f.flush()
            print("WRITING", flush=True)
            time.sleep(slow)
            f.write(data[len(data) // 2 :])
        torch.save = save
    resume = os.path.exists(os.path.join(run_dir, "checkpoint.pt"))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=sys.argv[3:] + [f"train.resume={str(resume).lower()}"])
    print("STARTED", flush=True)
    train(cfg, run_dir)
    """
)
KILL_RUN = [*TINY, "train.iterations=12", "train.checkpoint_interval=1", "train.val_interval=4",
            "train.stats_interval=0"]  # fmt: skip


def _child(run_dir: Path, script: Path, slow: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(run_dir), str(slow), *KILL_RUN]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, marker: str) -> None:
    for line in proc.stdout:
        if line.strip() == marker:
            return
    raise AssertionError(f"child ended before {marker}: {proc.stderr.read()}")


def _assert_files_valid(run_dir: Path) -> None:
    if (run_dir / "checkpoint.pt").exists():
        ckpt = load_checkpoint(run_dir / "checkpoint.pt", required=CHECKPOINT_KEYS)
        assert finite_weights(ckpt)
    if (run_dir / "metrics.json").exists():
        assert read_metrics(run_dir)["status"] in ("failed", "completed", "diverged")


def test_kill_9_at_random_moments_then_resume_completes_bit_exactly(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    run_dir = tmp_path / "run"
    rng = random.Random(13)
    # Two kills at random moments of the training, one in the middle of a checkpoint write.
    for slow in (0.0, 0.0, 1.0):
        proc = _child(run_dir, script, slow)
        _wait_for(proc, "WRITING" if slow else "STARTED")
        time.sleep(0.2 if slow else rng.uniform(0.5, 2.0))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        _assert_files_valid(run_dir)
    proc = _child(run_dir, script)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    _assert_files_valid(run_dir)
    metrics = read_metrics(run_dir)
    assert metrics["status"] == "completed" and metrics["iterations"] == 12
    assert metrics["final_loss"] is not None and metrics["time_per_iter_s"] is not None
    assert not list(run_dir.glob(".*.tmp"))
    # The same run without kills: same weights, bit for bit (CPU).
    reference = tmp_path / "reference"
    proc = _child(reference, script)
    assert proc.communicate(timeout=120) and proc.returncode == 0
    a = load_checkpoint(run_dir / "checkpoint.pt")["texture"]
    b = load_checkpoint(reference / "checkpoint.pt")["texture"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rng_states_are_restored_from_wherever_the_checkpoint_was_loaded():
    # A resume on a GPU loads the checkpoint with map_location there, which puts the saved RNG
    # byte tensors on the GPU, while every torch generator takes its state as a CPU byte tensor.
    # Stand-ins for tensors on another device: objects torch rejects, whose .cpu() is the state.
    from unittest import mock

    from mptex.train.rng import rng_state, set_rng_state

    gen = torch.Generator().manual_seed(3)
    saved = rng_state({"views": gen})
    want = torch.rand(4, generator=gen), torch.rand(4)
    elsewhere = {k: mock.Mock(cpu=mock.Mock(return_value=v)) if torch.is_tensor(v) else v
                 for k, v in saved.items()}  # fmt: skip
    gen.manual_seed(99)
    torch.manual_seed(99)
    set_rng_state(elsewhere, {"views": gen})
    assert torch.equal(torch.rand(4, generator=gen), want[0])
    assert torch.equal(torch.rand(4), want[1])


def test_cuda_rng_states_are_saved_per_device_and_restored_on_the_devices_here(monkeypatch):
    # On CUDA a checkpoint keeps every device's generator state; a resume puts back those of
    # the devices this machine has (here one of the two saved), each from a CPU byte tensor
    # whatever device map_location put it on. torch.cuda's functions are stand-ins.
    from unittest import mock

    from mptex.train.rng import rng_state, set_rng_state

    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": restored.append((state, device)))  # fmt: skip
    saved = rng_state({})
    assert saved["cuda"] == states
    on_gpu = [mock.Mock(cpu=mock.Mock(return_value=s)) for s in saved["cuda"]]
    set_rng_state({**saved, "cuda": on_gpu}, {})
    assert len(restored) == 1 and restored[0][1] == 0
    assert torch.equal(restored[0][0], states[0])
    # a checkpoint of a CPU run has no CUDA states: nothing is set
    restored.clear()
    set_rng_state({k: v for k, v in saved.items() if k != "cuda"}, {})
    assert restored == []


@pytest.mark.parametrize(
    "per_iter, timing", [(0.01234, "0.0123 s/iteration"), (None, "no iteration timed")]
)
def test_a_runs_last_line_times_an_iteration_only_where_one_was_timed(per_iter, timing):
    # A run that diverged at its first iteration times none: the line
    # says so instead of a time of 0.
    from mptex.cli.train import _summary_line

    metrics = {"status": "completed", "psnr": 21.017, "baseline_psnr": 21.514, "iterations": 0,
               "time_per_iter_s": per_iter}  # fmt: skip
    assert _summary_line(metrics) == (
        "mptex-train: completed: PSNR 21.02 dB (constant-colour baseline 21.51 dB), "
        f"0 iterations, {timing}"
    )
    diverged = {**metrics, "status": "diverged", "diverged_at": 0, "psnr": float("nan")}
    assert _summary_line(diverged).startswith("mptex-train: diverged at iteration 0: PSNR nan dB")
