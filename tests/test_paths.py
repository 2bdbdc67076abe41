"""Every public function that takes a path takes ``str | os.PathLike``.

Two checks: an audit of the signatures of every public name (the ``__all__`` of every public
module), and calls with ``str`` paths of the functions that handle a path themselves (the
bake writers, image, OBJ and checkpoint IO, the report and the experiment registry).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re

import numpy as np
import pytest
import torch
from test_report import _marked, _metrics, _side_by_side, _write
from test_scenes import _write_nerf_dataset

import mptex
from mptex.bake.export import write_glb, write_obj_asset, write_png16, write_texture_images
from mptex.cli import EXPERIMENTS_DIR, register_experiments
from mptex.render import load_image, load_obj, save_image, write_obj
from mptex.report import collect_runs, find_sweeps, write_report
from mptex.report.plots import image_panels
from mptex.scenes import load_nerf_split, torus_knot
from mptex.train import load_checkpoint, load_texture, save_checkpoint, write_metrics

PATH_TYPE = "str | os.PathLike"
# Parameter names that hold a path (a folder or a file) in mptex's public API.
_PATH_NAME = re.compile(r"(^|_)(path|dir|directory|folder|root)$|^out$")
# Names that match but hold no path, each with what it holds.
_NOT_PATHS = {
    "light_dir": "a light direction tensor",
}


def _public_callables():
    """(qualified name, function) of every public function, class constructor and public
    method reachable from the ``__all__`` of a public mptex module."""
    seen = {}
    for info in pkgutil.walk_packages(mptex.__path__, "mptex."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                seen[id(obj)] = (f"{obj.__module__}.{name}", obj)
            elif inspect.isclass(obj) and obj.__module__.startswith("mptex"):
                for attr, member in vars(obj).items():
                    member = getattr(member, "__func__", member)  # class/static methods
                    if inspect.isfunction(member) and (attr == "__init__" or attr[0] != "_"):
                        seen[id(member)] = (f"{obj.__module__}.{name}.{attr}", member)
    return sorted(seen.values(), key=lambda item: item[0])


def test_every_public_path_parameter_takes_str_and_pathlike():
    wrong, checked = [], 0
    for qualname, function in _public_callables():
        for param in inspect.signature(function).parameters.values():
            annotation = param.annotation if isinstance(param.annotation, str) else ""
            is_path = "Path" in annotation or _PATH_NAME.search(param.name)
            if not is_path or param.name in _NOT_PATHS:
                continue
            checked += 1
            # A parameter holding several paths takes a sequence of the same type.
            if not annotation.startswith((PATH_TYPE, f"Sequence[{PATH_TYPE}]")):
                wrong.append(f"{qualname}({param.name}: {annotation or 'unannotated'})")
    assert not wrong, f"expected {PATH_TYPE}: {wrong}"
    assert checked >= 25  # the audit saw the API (bake, render, report, train, scenes, ...)


def test_bake_writers_take_str_paths(tmp_path):
    folder = str(tmp_path)
    image = torch.rand(8, 8, 6, generator=torch.Generator().manual_seed(0))
    images = write_texture_images(folder, image)
    assert images == {"kd": "texture_kd.png", "ks": "texture_ks.png"}
    mesh = torus_knot(12, 4)
    assert write_obj_asset(folder, mesh, images) == {"obj": "mesh.obj", "mtl": "mesh.mtl"}
    assert load_obj(os.path.join(folder, "mesh.obj")).kd_texture.shape == (8, 8, 3)
    write_png16(os.path.join(folder, "x16.png"), image[..., :3])
    assert load_image(os.path.join(folder, "x16.png")).shape == (8, 8, 3)
    pytest.importorskip("trimesh", reason="GLB export needs trimesh")
    write_glb(os.path.join(folder, "mesh.glb"), mesh, image[..., :3])
    assert (tmp_path / "mesh.glb").stat().st_size > 0


def test_image_and_obj_io_take_str_paths(tmp_path):
    path = str(tmp_path / "a.png")
    save_image(path, torch.full((2, 3, 3), 0.5))
    assert load_image(path).shape == (2, 3, 3)
    obj = str(tmp_path / "knot.obj")
    knot = torus_knot(12, 4)
    write_obj(obj, knot)
    assert torch.equal(load_obj(obj).t_pos_idx, knot.t_pos_idx)


def test_checkpoint_io_takes_str_paths(tmp_path):
    texture = mptex.MLPTexture3D([[-1.0] * 3, [1.0] * 3], precision="f32", backend="torch",
                                 encoder={"n_levels": 2, "log2_hashmap_size": 8})  # fmt: skip
    state = {
        "texture": texture.state_dict(), "aabb": texture.AABB,
        "config": {"texture": {"encoder": {"n_levels": 2, "log2_hashmap_size": 8},
                               "backend": "torch"}},
        "precision": "f32",
    }  # fmt: skip
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint(path, state)
    assert set(load_checkpoint(path)) == set(state)
    points = torch.rand(16, 3) * 2 - 1
    assert torch.equal(load_texture(path).sample(points), texture.sample(points))
    assert write_metrics(str(tmp_path), {"psnr": 1.0}).name == "metrics.json"


def test_report_takes_str_paths(tmp_path):
    for arm, seed in (("f32", 0), ("bf16", 0)):
        job = _write(tmp_path, f"{arm}_{seed}", _metrics(arm, seed))
        _side_by_side(job / "images" / "val_000.png", _marked(), _marked(value=50))
    folder = str(tmp_path)
    assert find_sweeps(folder) == [tmp_path.resolve()]
    assert len(collect_runs(folder)) == 2
    reference, _ = image_panels(folder, [{"run_dir": "f32_0"}])
    np.testing.assert_array_equal(reference, _marked())
    assert "report.md" in write_report(folder)


def test_nerf_split_and_experiment_registry_take_str_paths(tmp_path):
    mesh_path = tmp_path / "mesh.obj"
    write_obj(mesh_path, torus_knot(12, 4))
    _write_nerf_dataset(tmp_path / "data", mesh_path)
    cameras, rgba = load_nerf_split(str(tmp_path / "data"), "train")
    assert len(cameras) == rgba.shape[0] > 0
    assert "quick" in register_experiments(str(EXPERIMENTS_DIR))
