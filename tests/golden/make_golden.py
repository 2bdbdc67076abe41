"""Write the golden tensors of the two CPU twins: the fused MLP and the torch hash grid.

The files were written once, by this script, from the implementations of commit 1a81391 (before
the twins were made faster), and are checked in: ``tests/test_fused_mlp_torch.py`` and
``tests/test_grid_torch.py`` hold every later implementation to those bits. Rerunning this
script with a newer implementation proves nothing (it would record the new bits); it is kept
to show what the files hold and how they were made.

    python tests/golden/make_golden.py   # 1 torch thread, MKL_CBWR=AUTO,STRICT

Inputs that are stored whole: the MLP cases' inputs, parameters and cotangents, the small grid
cases' points. Inputs too large to store come from :func:`grid_params` / :func:`grid_points`
(integer arithmetic, exact in float32, the same on every machine). Results too large to store
are kept as SHA-256 digests of their bytes, next to their first rows.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
MLP_FILE = HERE / "fused_mlp_twin.pt"
GRID_FILE = HERE / "grid_torch.pt"
STORE_LIMIT = 8_000  # elements: larger results are stored as a digest and their first rows
HEAD_ROWS = 256
STORED_ROWS = 1000  # MLP inputs of more rows come from grid_points / grid_cotangent


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def pack(tensor: torch.Tensor) -> dict:
    """A result as stored: whole when small, else its digest, shape, dtype and first rows."""
    tensor = tensor.detach().contiguous()
    if tensor.numel() <= STORE_LIMIT:
        return {"full": tensor.clone()}
    return {
        "sha256": digest(tensor),
        "shape": tuple(tensor.shape),
        "dtype": tensor.dtype,
        "head": tensor[:HEAD_ROWS].clone(),
    }


# ------------------------------------------------------------------------------ the MLP
# (name, spec keywords, rows, loss scale of the cotangent). Every activation appears as the
# hidden and as the output activation; split-K with 3 unequal slices (12300 rows -> 12544 padded
# -> slices of 4160, 4160, 4224) in both accumulate modes and with split_k off; input padding to
# 16 < width (CUTLASS input gradient, k_block 8) and to the width (fused, k_block 16); an output
# wider than 16 (last layer k_block 8); batch padding to 256; loss scales 1 and 1024; stats.
ACTIVATION_PAIRS = [
    ("ReLU", "None"),
    ("LeakyReLU", "Sigmoid"),
    ("Exponential", "Tanh"),
    ("Sigmoid", "Softplus"),
    ("Squareplus", "Exponential"),
    ("Softplus", "Squareplus"),
    ("Tanh", "LeakyReLU"),
    ("None", "ReLU"),
]


def mlp_cases() -> list[tuple[str, dict, int, float]]:
    cases = []
    for hidden, output in ACTIVATION_PAIRS:
        for accumulate in ("half", "float"):
            cases.append(
                (
                    f"act-{hidden}-{output}-{accumulate}",
                    dict(n_input_dims=5, n_output_dims=3, width=16, n_hidden_layers=2,
                         activation=hidden, output_activation=output, accumulate=accumulate),
                    300,
                    1e-3,
                )
            )  # fmt: skip
    texture = dict(n_input_dims=24, n_output_dims=3, width=32, n_hidden_layers=2)
    cases += [
        ("texture-half", texture, 300, 1e-3),
        ("texture-float", dict(texture, accumulate="float"), 300, 1e-3),
        ("width64-input-pad16", dict(n_input_dims=7, n_output_dims=3, width=64,
                                     n_hidden_layers=1), 260, 1e-3),
        ("width128", dict(n_input_dims=3, n_output_dims=3, width=128, n_hidden_layers=1), 256,
         1e-3),
        ("wide-output", dict(n_input_dims=4, n_output_dims=20, width=16, n_hidden_layers=1), 300,
         1e-3),
        ("input-equals-width", dict(n_input_dims=32, n_output_dims=3, width=32,
                                    n_hidden_layers=2), 200, 1e-3),
        ("loss-scale-1", dict(texture, loss_scale=1.0), 256, 1e-5),
        ("loss-scale-1024", dict(texture, loss_scale=1024.0), 256, 1e-5),
        ("stats", dict(texture, collect_stats=True), 300, 1e-4),
        ("split-k-half", dict(n_input_dims=1, n_output_dims=1, width=32, n_hidden_layers=2),
         12300, 1e-3),
        ("split-k-float", dict(n_input_dims=1, n_output_dims=1, width=32, n_hidden_layers=2,
                               accumulate="float"), 12300, 1e-3),
        ("split-k-off", dict(n_input_dims=1, n_output_dims=1, width=32, n_hidden_layers=2,
                             split_k=False), 12300, 1e-3),
        ("split-k-texture", dict(texture, collect_stats=True), 9000, 1e-3),
    ]  # fmt: skip
    return cases


def mlp_golden() -> dict:
    from mptex._fused_mlp_torch import FusedMLPSpec, fused_mlp, xavier_uniform_params

    out = {}
    for index, (name, kw, rows, grad_scale) in enumerate(mlp_cases()):
        spec = FusedMLPSpec(**kw)
        gen = torch.Generator().manual_seed(index)
        # trained-looking weights: wider than tcnn's init, away from 0 (as tests/test_network.py)
        params = xavier_uniform_params(spec) * 3.0
        if {spec.activation, spec.output_activation} & {"Exponential", "Softplus"}:
            params = params * 0.3  # keep exp's outputs inside half's range
        if rows <= STORED_ROWS:
            # stored in half: the twin rounds its input to half first, so nothing is lost
            x = torch.rand(rows, spec.n_input_dims, generator=gen).half().float()
            cotangent = torch.randn(rows, spec.n_output_dims, generator=gen) * grad_scale
        else:  # too large to store: exact formulas (see the module docstring)
            x = grid_points(rows, spec.n_input_dims)
            cotangent = grid_cotangent(rows, spec.n_output_dims, 8 * grad_scale)
        cotangent = cotangent.half()
        x_in = x.clone().requires_grad_(True)
        p_in = params.clone().requires_grad_(True)
        result = fused_mlp(x_in, p_in, spec)
        result.backward(cotangent)
        entry = {
            "spec": kw,
            "rows": rows,
            "grad_scale": grad_scale,
            "x": x.half() if rows <= STORED_ROWS else None,
            "params": params,
            "cotangent": cotangent if rows <= STORED_ROWS else None,
            "out": pack(result),
            "grad_x": pack(x_in.grad),
            "grad_params": pack(p_in.grad),
        }
        if spec.collect_stats:
            entry["stats"] = spec.stats
        out[name] = entry
    return out


# ------------------------------------------------------------------------------ the grid
def grid_params(n_params: int, amplitude: float) -> torch.Tensor:
    """Deterministic table values in [-amplitude, amplitude): multiples of 2^-20 * 2a."""
    i = torch.arange(n_params, dtype=torch.int64)
    code = (i * 2654435761 + 12345) % (1 << 20)
    return ((code.float() / (1 << 20)) - 0.5) * (2 * amplitude)


def grid_points(n_points: int, n_dims: int, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    """Deterministic points in [low, high]: 24-bit fractions, exact in float32."""
    i = torch.arange(n_points * n_dims, dtype=torch.int64)
    code = (i * 2246822519 + 3266489917) % (1 << 24)
    return (low + (code.float() / (1 << 24)) * (high - low)).view(n_points, n_dims)


def grid_cotangent(n_points: int, n_out: int, scale: float) -> torch.Tensor:
    i = torch.arange(n_points * n_out, dtype=torch.int64)
    code = (i * 40503 + 977) % 4096
    return ((code.float() / 4096) - 0.5).mul(scale).view(n_points, n_out)


# (name, grid_geometry keywords, points, point range, stored points, param amplitude)
def grid_cases() -> list[tuple]:
    nvdiffrec_like = dict(
        n_input_dims=3,
        n_levels=8,
        n_features_per_level=2,
        log2_hashmap_size=12,
        base_resolution=4,
        per_level_scale=1.6,
    )
    cpu_texture = dict(
        n_input_dims=3,
        n_levels=12,
        n_features_per_level=2,
        log2_hashmap_size=16,
        base_resolution=16,
        per_level_scale=1.3703509847201236,
    )
    return [
        ("3d-linear", nvdiffrec_like, 1000, (0.0, 1.0), True, 1e-2),
        ("3d-outside", nvdiffrec_like, 1000, (-0.5, 1.5), True, 1e-2),
        ("3d-smoothstep-f4", dict(nvdiffrec_like, n_features_per_level=4, n_levels=5,
                                  interpolation="Smoothstep"), 600, (0.0, 1.0), True, 1.0),
        ("3d-nearest-f1", dict(nvdiffrec_like, n_features_per_level=1, n_levels=5,
                               interpolation="Nearest"), 600, (0.0, 1.0), True, 1.0),
        ("2d-dense-f8", dict(n_input_dims=2, n_levels=3, n_features_per_level=8,
                             log2_hashmap_size=6, base_resolution=6, per_level_scale=2.0,
                             grid_type="Dense"), 400, (0.0, 1.0), True, 1.0),
        ("4d-hash", dict(n_input_dims=4, n_levels=4, n_features_per_level=2,
                         log2_hashmap_size=10, base_resolution=3, per_level_scale=1.9),
         400, (0.0, 1.0), True, 1.0),
        # more than one 16384-point chunk: the scatter's order across chunks
        ("cpu-texture-chunks", cpu_texture, 40000, (0.0, 1.0), False, 1e-4),
    ]  # fmt: skip


def grid_golden() -> dict:
    from mptex._grid_torch import grid_geometry, hash_grid_encode

    out = {}
    for name, kw, n_points, (low, high), store_points, amplitude in grid_cases():
        geometry = grid_geometry(**kw)
        params = grid_params(geometry.n_params, amplitude)
        x = grid_points(n_points, geometry.n_input_dims, low, high)
        if low == 0.0 and high == 1.0:
            x[0], x[1] = 1.0, 0.0  # the top corner (dense levels wrap) and the origin
        for dtype in (torch.float32, torch.float16):
            x_in = x.clone().requires_grad_(True)
            p_in = params.clone().requires_grad_(True)
            result = hash_grid_encode(x_in, p_in, geometry, dtype)
            scale = 1e-3 if dtype == torch.float16 else 1.0
            cotangent = grid_cotangent(n_points, geometry.n_output_dims, scale)
            (result.float() * cotangent).sum().backward()
            out[f"{name}-{str(dtype)[6:]}"] = {
                "geometry": kw,
                "n_points": n_points,
                "range": (low, high),
                "amplitude": amplitude,
                "dtype": dtype,
                "x": x if store_points else None,
                "out": pack(result),
                "grad_x": pack(x_in.grad),
                "grad_params": pack(p_in.grad),
            }
    return out


def main() -> None:
    torch.set_num_threads(1)
    which = sys.argv[1:] or ["mlp", "grid"]
    if "mlp" in which:
        torch.save(mlp_golden(), MLP_FILE)
        print(f"{MLP_FILE}: {MLP_FILE.stat().st_size / 1024:.0f} KiB")
    if "grid" in which:
        torch.save(grid_golden(), GRID_FILE)
        print(f"{GRID_FILE}: {GRID_FILE.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
