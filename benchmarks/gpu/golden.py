"""Golden tensors of tinycudann and nvdiffrast: capture them on a GPU, compact them into the
test suite's fixtures, and compare a fresh capture with the committed fixtures.

The committed fixtures (``tests/gpu_golden/``, their README says what each array is) let every
CPU check the twins against the real libraries. On a GPU the kit's ``golden`` stage recaptures
the same cases with the libraries installed there; a new tinycudann or nvdiffrast version, or
another GPU, then shows up as rows whose arrays are no longer bit-equal to the committed ones,
and the twins' tests run against the new capture too.

The cases are the kit's (``validate.GRID_CONFIGS``, ``validate.NETWORK_CONFIGS``, the built-in
torus knot and the real-asset suite's duck) with inputs drawn from fixed seeds:

* grid: per config and dtype (float32, float16), ``params = U(-1, 1)`` of
  ``torch.Generator().manual_seed(0)``, then from the same generator ``x`` (8192 points) and the
  cotangent ``v`` (2048 x n_output_dims, N(0, 1)); the library's forward on ``x`` and its
  parameter gradient of ``sum(out[:2048].float() * v)``.
* network: tcnn's FullyFusedMLP (ReLU, no output activation) with the twin's seed-1337 float32
  weights; ``x = U(-1, 1)`` (8209 points) and a half cotangent N(0, 1e-3^2) from
  ``manual_seed(0)``; outputs and input and weight gradients.
* raster: 4 of nvdiffrec's random views (``random_views``, seed 0) at 512^2 of each mesh.

``capture`` writes the full arrays (the format of ``../shared``'s original capture, which
``tests/gpu_golden/build_*.py`` compact); ``compare_fixture_dirs`` diffs two fixture folders.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIXTURES = REPO / "tests" / "gpu_golden"
PARTS = ("grid", "network", "raster")

GRID_POINTS, GRID_GRAD_POINTS = 2**13, 2**11
NETWORK_POINTS = 8209  # not a multiple of 256: tcnn pads the batch
RASTER_RESOLUTION, RASTER_VIEWS = 512, 4


def capture_grid(
    out: Path, device: str, native: str, configs: dict, cotangents: dict | None = None
) -> None:
    """``grid.npz``: keys ``{config}.{dtype}.{x, v, out, grad_idx, grad_val}``.

    ``cotangents`` (config -> [2048, n_output_dims] array) replaces the drawn ``v``: torch's
    ``randn`` draws other values on other CPU kernels, the committed fixture keeps its own."""
    import numpy as np
    import torch

    from mptex import HashGridEncoding

    arrays = {}
    for name, config in configs.items():
        for dtype in (torch.float32, torch.float16):
            cfg = dict(config)
            dims = cfg.pop("n_input_dims")
            enc = HashGridEncoding(dims, **cfg, backend="torch", dtype=dtype, device=device, seed=0)
            enc.backend = native  # built as the twin, as the committed capture was
            gen = torch.Generator().manual_seed(0)
            params = torch.rand(enc.n_params, generator=gen) * 2 - 1
            x = torch.rand(GRID_POINTS, dims, generator=gen)
            v = torch.randn(GRID_GRAD_POINTS, enc.n_output_dims, generator=gen)
            if cotangents and name in cotangents:
                v = torch.as_tensor(cotangents[name], dtype=torch.float32)
            with torch.no_grad():
                enc.params.copy_(params.to(device))
                encoded = enc(x.to(device)).cpu()
            out_g = enc(x[:GRID_GRAD_POINTS].to(device))
            grad = torch.autograd.grad((out_g.float() * v.to(device)).sum(), enc.params)[0].cpu()
            nonzero = torch.nonzero(grad).flatten()
            key = f"{name}.{str(dtype)[6:]}"
            arrays[f"{key}.x"] = x.numpy()
            arrays[f"{key}.v"] = v.numpy()
            arrays[f"{key}.out"] = encoded.numpy()
            arrays[f"{key}.grad_idx"] = nonzero.numpy().astype(np.int32)
            arrays[f"{key}.grad_val"] = grad[nonzero].numpy()
    np.savez_compressed(out / "grid.npz", **arrays)


def network_key(name: str) -> str:
    """'64x3, 9 out' -> '64x3'."""
    return name.split(" ")[0].replace(",", "")


def capture_network(
    out: Path, device: str, native: str, configs: dict, cotangents: dict | None = None
) -> None:
    """``network.npz``: keys ``{case}.{params, x, cot, out, xgrad, wgrad}``.

    ``cotangents`` (case key -> half array) replaces the drawn cotangent, as in
    ``capture_grid``."""
    import numpy as np
    import torch

    from mptex import FullyFusedMLP

    arrays = {}
    for name, (n_in, n_out, net_cfg) in configs.items():
        config = {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                  **net_cfg}  # fmt: skip
        # The twin's seed-1337 weights, whichever backend runs them.
        net = FullyFusedMLP(n_in, n_out, config, backend="torch", seed=1337, device=device)
        net.backend = native
        gen = torch.Generator().manual_seed(0)
        x0 = torch.rand(NETWORK_POINTS, n_in, generator=gen) * 2 - 1
        cot = (torch.randn(NETWORK_POINTS, n_out, generator=gen) * 1e-3).half()
        key = network_key(name)
        if cotangents and key in cotangents:
            cot = torch.as_tensor(cotangents[key], dtype=torch.float16)
        params = net.params.detach().cpu().clone()
        x = x0.to(device).clone().requires_grad_(True)
        output = net(x)
        output.backward(cot.to(device))
        arrays[f"{key}.params"] = params.numpy()
        arrays[f"{key}.x"] = x0.numpy()
        arrays[f"{key}.cot"] = cot.numpy()
        arrays[f"{key}.out"] = output.detach().cpu().numpy()
        arrays[f"{key}.xgrad"] = x.grad.cpu().numpy()
        arrays[f"{key}.wgrad"] = net.params.grad.cpu().numpy()
    np.savez_compressed(out / "network.npz", **arrays)


def raster_meshes(duck: Path | None) -> dict:
    """The built-in torus knot and, where its file is found, the duck (normalised to unit size)."""
    from mptex.render import load_obj, unit_size
    from mptex.scenes import torus_knot

    meshes = {"torus": torus_knot(200, 24)}
    if duck is not None and Path(duck).is_file():
        meshes["duck"] = unit_size(load_obj(duck))
    return meshes


def capture_raster(
    out: Path, device: str, native: str, duck: Path | None, clips: dict | None = None
) -> list[str]:
    """``raster_{mesh}.npz``: ``clip`` [4, V, 4], ``tri``, ``uv``, ``zw``, ``tri_id`` (id + 1).

    ``clips`` (mesh -> [4, V, 4] float32) replaces the clip-space vertices made here: another
    CPU's matmul rounds them differently in the last bit, which moves snapped vertices.
    Returns the meshes captured (the duck only where its OBJ was found)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from mptex.render import random_views, rasterize

    cams = random_views(RASTER_VIEWS, generator=torch.Generator().manual_seed(0), device="cpu")
    meshes = raster_meshes(duck)
    for name, mesh in meshes.items():
        v_pos, tri = mesh.v_pos.float().cpu(), mesh.t_pos_idx.cpu()
        clip = F.pad(v_pos, (0, 1), value=1.0).unsqueeze(0) @ cams.mvp.float().cpu().transpose(1, 2)
        if clips and name in clips:
            clip = torch.as_tensor(clips[name], dtype=torch.float32)
        res = (RASTER_RESOLUTION, RASTER_RESOLUTION)
        rast = rasterize(clip.contiguous().to(device), tri.to(device), res, backend=native)[0]
        rast = rast.cpu()
        np.savez_compressed(
            out / f"raster_{name}.npz",
            clip=clip.numpy(),
            tri=tri.numpy().astype(np.int32),
            uv=rast[..., :2].numpy(),
            zw=rast[..., 2].numpy(),
            tri_id=rast[..., 3].round().long().numpy().astype(np.int32),
        )
    return list(meshes)


def committed_inputs(fixtures: Path = FIXTURES) -> dict[str, dict]:
    """The inputs the committed fixtures store because they cannot be regenerated bit for bit
    on every CPU: ``{"grid": {config: v}, "network": {case: cot}, "raster": {mesh: clip}}``."""
    import numpy as np

    inputs: dict[str, dict] = {"grid": {}, "network": {}, "raster": {}}
    if (fixtures / "grid.npz").is_file():
        with np.load(fixtures / "grid.npz") as grid:
            keys = [k for k in grid.files if k.count(".") == 1 and k.endswith(".v")]
            inputs["grid"] = {k[: -len(".v")]: grid[k] for k in keys}
    if (fixtures / "network.npz").is_file():
        with np.load(fixtures / "network.npz") as network:
            keys = [k for k in network.files if k.endswith(".cot")]
            inputs["network"] = {k[: -len(".cot")]: network[k] for k in keys}
    build_raster = builder("raster")
    for path in sorted(fixtures.glob("raster_*.npz")):
        with np.load(path) as raster:
            name = path.stem[len("raster_") :]
            inputs["raster"][name] = build_raster.clip_from_bytes(raster["clip_bytes"])
    return inputs


def builder(part: str) -> ModuleType:
    """``tests/gpu_golden/build_{part}.py``, which turns full captures into a fixture."""
    path = FIXTURES / f"build_{part}.py"
    spec = importlib.util.spec_from_file_location(f"mptex_golden_build_{part}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare_fixture_dirs(new: Path, committed: Path) -> list[dict[str, Any]]:
    """Every array of every ``*.npz`` fixture in ``committed`` against ``new``'s.

    One row per (file, array): shape equal, the share of elements bit-equal (NaNs equal), and
    for numbers the largest absolute difference (as float64; None for text such as digests)."""
    import numpy as np

    rows = []
    for path in sorted(committed.glob("*.npz")):
        theirs = new / path.name
        with np.load(path) as old:
            fresh = np.load(theirs) if theirs.is_file() else None
            for key in old.files:
                row: dict[str, Any] = {"file": path.name, "array": key}
                if fresh is None or key not in fresh.files:
                    row.update(status="missing in the new capture", equal=0.0, max_abs_diff=None)
                elif fresh[key].shape != old[key].shape or fresh[key].dtype != old[key].dtype:
                    row.update(
                        status=f"{fresh[key].dtype}{list(fresh[key].shape)} vs "
                        f"{old[key].dtype}{list(old[key].shape)}",
                        equal=0.0,
                        max_abs_diff=None,
                    )
                else:
                    a, b = fresh[key], old[key]
                    numeric = a.dtype.kind in "fiub"
                    same = (a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind == "f" else a == b
                    same = np.asarray(same)
                    diff = np.abs(a.astype(np.float64) - b.astype(np.float64)) if numeric else None
                    row.update(
                        status="same" if bool(same.all()) else "differs",
                        equal=float(same.mean()) if same.size else 1.0,
                        max_abs_diff=float(np.nanmax(diff)) if numeric and diff.size else None,
                    )
                rows.append(row)
            if fresh is not None:
                fresh.close()
    return rows
