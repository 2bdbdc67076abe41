"""Edges of the torch hash grid's level constants, its dispatch and its C kernel's build cache.

What is checked, and against which references:

- ``grid_geometry``: against tcnn's host and kernel formulas as written out independently in
  ``tests/grid_reference.py`` (``levels``: exact rationals rounded once per float32 operation),
  and against values computed by hand (arithmetic in the comments): resolutions
  ``ceil(scale) + 1``, table sizes ``min(next_multiple(res^D, 8), 2^log2_hashmap_size)`` with
  tcnn's cap of ``(2^32 - 1) / 2`` entries, and a level hashed only where ``res^D`` exceeds its
  table size (tcnn's kernel: ``if (hashmap_size < stride) hash``).
- ``hash_grid_encode`` on the level where ``res^D`` equals the table size: bit for bit against the
  per-point brute-force encoding of ``tests/grid_reference.py``, in the C kernel and in the eager
  ops.
- dL/dx when only the points need a gradient: ``torch.autograd.gradcheck`` in float64, and the
  same bits as when the table needs one too.
- Dispatch to the C kernel: the dimensions, feature counts and dtypes it takes, and the same
  bits as the eager ops where it runs.
- The build cache of the C kernel: its folder (``MPTEX_CACHE_DIR``, ``XDG_CACHE_HOME``,
  ``~/.cache``), a file per source, compiler, flags and CPU, no second build of a cached file,
  and the fallback (None, one warning) when the compiler fails. The compiler is replaced by a
  stand-in that writes the output file, so these tests build nothing.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import grid_reference
import numpy as np
import pytest
import torch

import mptex._grid_torch as grid
from mptex import _native_cpu
from mptex._grid_torch import GridGeometry, grid_geometry, hash_grid_encode


def _reference_levels(n_dims, n_levels, log2_size, base, scale, grid_type="Hash"):
    return grid_reference.levels(
        n_dims, n_levels, log2_size, base, scale, dense_grid=grid_type == "Dense"
    )


# ------------------------------------------------------------------------ level constants


@pytest.mark.parametrize(
    "config",
    [
        (3, 4, 2, 19, 16, 2.0, "Hash"),
        (3, 2, 2, 9, 8, 1.0, "Hash"),  # res^3 = 512 = 2^9: the table holds the level densely
        (2, 3, 2, 6, 8, 1.0, "Hash"),  # res^2 = 64 = 2^6
        (3, 5, 4, 12, 5, 1.5, "Dense"),
        # Level 10 of a 1-D dense grid with per_level_scale 3: the host's scale (two float32
        # roundings, 17242304) and the kernel's (one fused multiply-add, 17242302) differ by
        # two units, and the table size is the host's (next multiple of 8 of 17242305).
        (1, 11, 2, 30, 292, 3.0, "Dense"),
    ],
    ids=["16-doubling", "res3-equals-table", "res2-equals-table", "dense-1.5", "dense-host-res"],
)
def test_level_constants_follow_tcnns_host_and_kernel_formulas(config):
    n_dims, n_levels, n_features, log2_size, base, scale, grid_type = config
    geometry = grid_geometry(n_dims, n_levels, n_features, log2_size, base, scale,
                             grid_type=grid_type)  # fmt: skip
    want = _reference_levels(n_dims, n_levels, log2_size, base, scale, grid_type)
    assert geometry.scales == tuple(float(level[0]) for level in want)
    assert geometry.resolutions == tuple(level[1] for level in want)
    assert geometry.table_sizes == tuple(level[2] for level in want)
    assert geometry.offsets[:-1] == tuple(level[3] for level in want)
    assert geometry.offsets[-1] == sum(level[2] for level in want)
    assert geometry.hashed == tuple(level[4] for level in want)


def test_host_and_kernel_scales_of_a_large_level_by_hand():
    geometry = grid_geometry(1, 11, 2, 30, 292, 3.0, grid_type="Dense")
    # Host: float32(float32(2^x * 292) - 1) = 17242304 -> resolution 17242305 -> table size
    # 17242312 (the next multiple of 8). Kernel: fmaf(2^x, 292, -1) = 17242302 -> resolution
    # 17242303 (the one used for indexing).
    assert geometry.scales[10] == 17242302.0
    assert geometry.resolutions[10] == 17242303
    assert geometry.table_sizes[10] == 17242312


def test_level_constants_of_a_doubling_grid_by_hand():
    geometry = grid_geometry(3, 4, 2, 19, 16, 2.0)
    # log2f(2) = 1 and 2^l is exact, so scale_l = 16 * 2^l - 1 exactly and res_l = 16 * 2^l.
    assert geometry.scales == (15.0, 31.0, 63.0, 127.0)
    assert geometry.resolutions == (16, 32, 64, 128)
    # res^3 = 4096, 32768, 262144, 2097152 (multiples of 8), capped at 2^19 = 524288.
    assert geometry.table_sizes == (4096, 32768, 262144, 524288)
    assert geometry.hashed == (False, False, False, True)
    # 0, 4096, 4096 + 32768 = 36864, 36864 + 262144 = 299008, 299008 + 524288 = 823296
    assert geometry.offsets == (0, 4096, 36864, 299008, 823296)
    assert geometry.n_entries == 823296
    assert geometry.n_params == 823296 * 2
    assert geometry.n_levels == 4 and geometry.n_output_dims == 8


def test_a_level_is_hashed_only_where_its_cells_outnumber_its_table():
    # per_level_scale 1: every level has scale 8 - 1 = 7 and resolution 8, 8^3 = 512 entries.
    assert grid_geometry(3, 2, 2, 9, 8, 1.0).hashed == (False, False)  # 512 rows of 2^9 = 512
    assert grid_geometry(3, 2, 2, 9, 8, 1.0).table_sizes == (512, 512)
    assert grid_geometry(3, 1, 2, 8, 8, 1.0).hashed == (True,)  # 512 > 2^8 = 256
    assert grid_geometry(3, 1, 2, 8, 8, 1.0).table_sizes == (256,)
    # resolution 5: 5^3 = 125 -> 128 entries (next multiple of 8); a hash table of 2^6 = 64.
    assert grid_geometry(3, 1, 2, 6, 5, 1.0).table_sizes == (64,)
    assert grid_geometry(3, 1, 2, 6, 5, 1.0).hashed == (True,)
    dense = grid_geometry(3, 1, 2, 6, 5, 1.0, grid_type="Dense")
    assert dense.table_sizes == (128,) and dense.hashed == (False,)


def test_a_dense_level_is_capped_at_tcnns_maximum():
    # resolution 2048 (scale 2047): 2048^3 = 2^33 entries exceed tcnn's cap of
    # (2^32 - 1) // 2 = 2^31 - 1, which rounds up to the multiple of 8 2^31.
    dense = grid_geometry(3, 1, 1, 19, 2048, 1.0, grid_type="Dense")
    assert dense.resolutions == (2048,)
    assert dense.table_sizes == (2**31,)
    assert dense.hashed == (False,)
    hashed = grid_geometry(3, 1, 1, 19, 2048, 1.0)
    assert hashed.table_sizes == (2**19,) and hashed.hashed == (True,)


# ------------------------------------------------------------------------------ encoding


@pytest.fixture
def ops(grid_ops):
    """The grid twin's path under test (conftest's grid_ops)."""
    return grid_ops


@pytest.mark.parametrize("n_dims", [2, 3])
def test_a_level_whose_cells_fill_its_table_is_indexed_densely(n_dims, ops):
    # res^D = 2^log2_hashmap_size (8^2 = 2^6, 8^3 = 2^9): tcnn indexes it densely (x + 8 y
    # [+ 64 z]), not through the hash.
    log2_size = 3 * n_dims
    geometry = grid_geometry(n_dims, 2, 2, log2_size, 8, 1.0)
    gen = torch.Generator().manual_seed(3)
    params = torch.rand(geometry.n_params, generator=gen) * 2 - 1
    x = torch.rand(40, n_dims, generator=gen)
    x[0] = 1.0  # the top corner wraps around to row 0 of a dense level
    out = hash_grid_encode(x, params, geometry, torch.float32)
    ref_levels = _reference_levels(n_dims, 2, log2_size, 8, 1.0)
    want = torch.tensor(
        [grid_reference.encode_point(p.tolist(), params.numpy(), 2, ref_levels) for p in x]
    )
    # Bit for bit: the reference rounds as tcnn's kernel (fmaf per step, corner order).
    assert torch.equal(out, want.float())


def _encode_like_the_reference(geometry, ref_levels, n_points, seed, ops):
    """The twin's forward and the brute-force reference's on the same points, including the
    top corner (x = 1, which wraps to row 0 of a dense level) and points on cell edges."""
    gen = torch.Generator().manual_seed(seed)
    params = torch.rand(geometry.n_params, generator=gen) * 2 - 1
    x = torch.rand(n_points, geometry.n_input_dims, generator=gen)
    x[0] = 1.0
    x[1] = 0.5  # on a cell edge at every even resolution
    out = hash_grid_encode(x, params, geometry, torch.float32)
    want = torch.tensor(
        [grid_reference.encode_point(p.tolist(), params.numpy(), 2, ref_levels) for p in x]
    )
    return out, want.float()


def test_a_level_one_cell_past_its_table_is_hashed_the_one_below_dense(ops):
    # per_level_scale 9/8 from base 8: level 0 has resolution 8 (8^3 = 512 = 2^9: the table
    # holds it densely), level 1 resolution 9 (9^3 = 729 > 512: hashed into 2^9 rows).
    geometry = grid_geometry(3, 2, 2, 9, 8, 1.125)
    ref_levels = _reference_levels(3, 2, 9, 8, 1.125)
    assert geometry.resolutions == (8, 9) == tuple(level[1] for level in ref_levels)
    assert geometry.table_sizes == (512, 512) == tuple(level[2] for level in ref_levels)
    assert geometry.hashed == (False, True) == tuple(level[4] for level in ref_levels)
    out, want = _encode_like_the_reference(geometry, ref_levels, 48, 5, ops)
    assert torch.equal(out, want)  # bit for bit: the reference rounds as tcnn's kernel


@pytest.mark.parametrize(
    "log2_size, size, hashed",
    [(2, 4, False), (1, 2, True)],
    ids=["table-fits-4-cells", "table-of-2-hashed"],
)
def test_a_hash_table_smaller_than_eight_entries_is_not_rounded_up(log2_size, size, hashed, ops):
    # 2-D, resolution 2: 2^2 = 4 cells, 8 entries once aligned to 8; tcnn's hash grid then
    # takes min(8, 2^log2_hashmap_size): 4 entries indexed densely (4 cells fill them), or 2
    # entries hashed (4 > 2).
    geometry = grid_geometry(2, 1, 2, log2_size, 2, 1.0)
    ref_levels = _reference_levels(2, 1, log2_size, 2, 1.0)
    assert (geometry.table_sizes, geometry.hashed) == ((size,), (hashed,))
    assert [(level[2], level[4]) for level in ref_levels] == [(size, hashed)]
    out, want = _encode_like_the_reference(geometry, ref_levels, 24, 6, ops)
    assert torch.equal(out, want)


def test_the_hash_decision_takes_the_kernels_resolution_and_the_hosts_table(monkeypatch, ops):
    # tcnn's kernel hashes a level where its own resolution's cells outnumber the table the
    # host sized: with a kernel 2^x one float32 ulp above the host's (as ex2.approx can be),
    # base 16 and per_level_scale 1 give the host scale 16 - 1 = 15 (resolution 16, 16^3 =
    # 4096 = 2^12 entries) and the kernel scale fmaf(1 + 2^-23, 16, -1) = 15 + 2^-19
    # (resolution 17): 17^3 = 4913 > 4096, hashed; the host's resolution would say dense.
    real = grid._level_exponentials

    def one_ulp_above(inputs, exp2):
        pows = real(inputs, "correctly-rounded")
        if exp2 == "correctly-rounded":
            return pows
        return [np.nextafter(p, np.float32(np.inf)) for p in pows]

    monkeypatch.setattr(grid, "_level_exponentials", one_ulp_above)
    geometry = grid_geometry(3, 1, 2, 12, 16, 1.0, exp2="h100-table")
    assert geometry.scales == (15.0 + 2.0**-19,)
    assert geometry.resolutions == (17,)
    assert (geometry.table_sizes, geometry.hashed) == ((4096,), (True,))
    ref_levels = [(np.float32(15.0 + 2.0**-19), 17, 4096, 0, True)]
    out, want = _encode_like_the_reference(geometry, ref_levels, 24, 7, ops)
    assert torch.equal(out, want)


def test_input_gradient_alone_matches_finite_differences_in_float64():
    # Only the points need a gradient (a frozen table): the backward still has the lookups.
    geometry = grid_geometry(2, 3, 2, 8, 4, 1.5, interpolation="Smoothstep")
    gen = torch.Generator().manual_seed(5)
    params = torch.rand(geometry.n_params, generator=gen, dtype=torch.float64)
    # Points in the middle of the unit square: no cell boundary within gradcheck's step 1e-6
    # at these resolutions (checked by the assert below).
    x = (0.2 + 0.6 * torch.rand(6, 2, generator=gen, dtype=torch.float64)).requires_grad_(True)
    for scale in geometry.scales:
        pos = x.detach() * scale + 0.5
        assert ((pos - pos.floor()).clamp(min=1e-4) == (pos - pos.floor())).all()
        assert ((pos.ceil() - pos).clamp(min=1e-4) == (pos.ceil() - pos)).all()

    def encode(points):
        return hash_grid_encode(points, params, geometry, torch.float64)

    # float64 throughout: gradcheck's default tolerances (atol 1e-5, rtol 1e-3) hold.
    assert torch.autograd.gradcheck(encode, (x,))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_input_gradient_alone_equals_the_one_computed_with_the_table_gradient(out_dtype, ops):
    geometry = grid_geometry(3, 4, 2, 10, 4, 1.5)
    gen = torch.Generator().manual_seed(6)
    params = torch.rand(geometry.n_params, generator=gen) * 2 - 1
    x = torch.rand(50, 3, generator=gen)
    cotangent = torch.rand(50, geometry.n_output_dims, generator=gen)

    def input_gradient(params_need_grad):
        points = x.clone().requires_grad_(True)
        table = params.clone().requires_grad_(params_need_grad)
        out = hash_grid_encode(points, table, geometry, out_dtype)
        (out.float() * cotangent).sum().backward()
        return points.grad

    alone, together = input_gradient(False), input_gradient(True)
    assert torch.equal(alone, together)


# ------------------------------------------------------------------------------ dispatch


def test_the_c_kernel_takes_up_to_four_dimensions_and_64_features():
    if grid.native_kernels() is None:
        pytest.skip("the C kernel does not build here (no C compiler)")

    def native(n_dims, n_features, out_dtype=torch.float32, params_dtype=torch.float32):
        geometry = grid_geometry(n_dims, 2, n_features, 8, 2, 1.5)
        x = torch.rand(3, n_dims)
        params = torch.zeros(geometry.n_params, dtype=params_dtype)
        return grid._native(x, params, geometry, out_dtype) is not None

    assert native(4, 2) and native(1, 2) and native(3, 64) and native(3, 1)
    assert not native(5, 2) and not native(3, 65)
    assert native(3, 2, torch.float16)
    # bfloat16 outputs and float64 tables run in the eager ops.
    assert not native(3, 2, torch.bfloat16)
    assert not native(3, 2, torch.float32, torch.float64)


def test_the_c_kernel_refuses_tables_and_resolutions_beyond_int32():
    def geometry(table_size, resolution):
        return GridGeometry(3, 2, "Linear", (float(resolution - 1),), (resolution,),
                            (table_size,), (0, table_size), (True,))  # fmt: skip

    assert _native_cpu.grid_supported(geometry(2**19, 2**31 - 1))
    assert not _native_cpu.grid_supported(geometry(2**31, 16))
    assert not _native_cpu.grid_supported(geometry(2**19, 2**31))
    # The dense cap of tcnn (2^31 entries) is beyond it: such a level runs in the eager ops.
    assert not _native_cpu.grid_supported(grid_geometry(3, 1, 1, 19, 2048, 1.0,
                                                        grid_type="Dense"))  # fmt: skip


def test_a_refused_geometry_is_one_clear_error():
    geometry = grid_geometry(3, 1, 2, 8, 4, 1.5)
    _native_cpu._check(0, geometry)  # status 0: accepted
    with pytest.raises(RuntimeError, match="C kernel refused the grid geometry"):
        _native_cpu._check(1, geometry)


# --------------------------------------------------------------------- C kernel's build


class _FakeCompiler:
    """Stands in for subprocess.run: records each command and writes its ``-o`` file."""

    def __init__(self):
        self.commands = []

    def __call__(self, command, **kwargs):
        self.commands.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"not a library")
        return subprocess.CompletedProcess(command, 0)


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    fake = _FakeCompiler()
    monkeypatch.setattr(_native_cpu.subprocess, "run", fake)
    monkeypatch.setenv("MPTEX_CACHE_DIR", str(tmp_path / "cache"))
    return fake


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MPTEX_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _native_cpu._cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("MPTEX_CACHE_DIR")
    assert _native_cpu._cache_dir() == tmp_path / "xdg" / "mptex"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _native_cpu._cache_dir() == tmp_path / "home" / ".cache" / "mptex"


def test_a_build_is_cached_per_compiler_flags_and_cpu(fake_compiler, monkeypatch, tmp_path):
    first = _native_cpu._build("cc", ("-O3",))
    assert first.parent == tmp_path / "cache" and first.is_file()
    assert first.name.startswith("mptex_cpu-") and first.suffix == ".so"
    command = fake_compiler.commands[0]
    assert command[:2] == ["cc", "-O3"] and command[-1] == "-lm"
    assert _native_cpu._build("cc", ("-O3",)) == first  # cached: no second build
    assert len(fake_compiler.commands) == 1
    others = {
        _native_cpu._build("cc", ("-O2",)),
        _native_cpu._build("gcc", ("-O3",)),
    }
    cpu_key = _native_cpu._cpu_key()
    monkeypatch.setattr(_native_cpu, "_cpu_key", lambda: cpu_key + " avx512f")
    others.add(_native_cpu._build("cc", ("-O3",)))
    monkeypatch.setattr(_native_cpu, "_cpu_key", lambda: cpu_key)
    monkeypatch.setattr(_native_cpu, "_SOURCE", _native_cpu._SOURCE + "\n")
    others.add(_native_cpu._build("cc", ("-O3",)))
    # Another compiler, other flags, another CPU, another source: five files, five builds.
    assert len(others | {first}) == 5 and len(fake_compiler.commands) == 5


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="Linux's /proc/cpuinfo only")
def test_the_cpu_key_holds_the_cpus_feature_flags():
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line for line in lines if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("no flags line in /proc/cpuinfo (not x86)")
    assert _native_cpu._cpu_key() == platform.machine() + flags


@pytest.mark.skipif(sys.platform == "win32", reason="the stand-in compiler is a shell script")
def test_a_failing_compiler_falls_back_with_one_warning(monkeypatch, tmp_path):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'error: no space left' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("MPTEX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MPTEX_NATIVE", raising=False)
    _native_cpu.native_kernels.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CalledProcessError.*no space left"):
            assert _native_cpu.native_kernels() is None
    finally:
        _native_cpu.native_kernels.cache_clear()


class _Library:
    """Stands in for ctypes.CDLL: any function, whose argtypes and restype can be set."""

    def __init__(self, path):
        self.path = path

    def __getattr__(self, name):
        function = type("Function", (), {})()
        setattr(self, name, function)
        return function


def test_the_compiler_named_by_cc_builds_the_kernel(fake_compiler, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/opt/my-cc")
    monkeypatch.setattr(_native_cpu.ctypes, "CDLL", _Library)
    lib = _native_cpu.build_kernels(("-O1",))
    assert fake_compiler.commands[0][0] == "/opt/my-cc"
    assert Path(lib.path).parent == tmp_path / "cache"


# ----------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("x_shape", "n_params_given", "match"),
    [
        ((4, 2), None, r"x: expected shape \[N, 3\], got \[4, 2\]"),
        ((4, 4), None, r"x: expected shape \[N, 3\], got \[4, 4\]"),
        ((3,), None, r"x: expected shape \[N, 3\], got \[3\]"),
        ((4, 3), 10, r"params: expected 4080 values \(geometry.n_params\), got 10"),
        ((4, 3), 4081, r"params: expected 4080 values \(geometry.n_params\), got 4081"),
    ],
)
def test_points_and_table_of_the_wrong_size_are_one_clear_error(
    x_shape, n_params_given, match, ops
):
    # 3-D, scales 4 * 1.5^l - 1 = 3, 5, 8, 12.5 -> resolutions 4, 6, 9, 14; entries 4^3 = 64,
    # 6^3 = 216, 9^3 = 729 -> 736, 14^3 = 2744 capped at 2^10 = 1024; 64 + 216 + 736 + 1024 =
    # 2040 entries, 4080 values with 2 features.
    geometry = grid_geometry(3, 4, 2, 10, 4, 1.5)
    assert geometry.n_params == 4080
    params = torch.zeros(n_params_given or geometry.n_params)
    with pytest.raises(ValueError, match=match):
        hash_grid_encode(torch.rand(x_shape), params, geometry, torch.float32)


def test_a_table_of_the_right_size_in_any_shape_is_taken(ops):
    geometry = grid_geometry(3, 4, 2, 10, 4, 1.5)
    params = torch.rand(geometry.n_params, generator=torch.Generator().manual_seed(7))
    x = torch.rand(5, 3, generator=torch.Generator().manual_seed(8))
    flat = hash_grid_encode(x, params, geometry, torch.float32)
    rows = hash_grid_encode(x, params.view(-1, 2), geometry, torch.float32)
    assert torch.equal(flat, rows)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(grid_type="hash"), "grid_type must be one of ('Hash', 'Dense'), got 'hash'"),
        (dict(grid_type="Tiled"), "grid_type must be one of ('Hash', 'Dense'), got 'Tiled'"),
        (
            dict(interpolation="linear"),
            "interpolation must be one of ('Nearest', 'Linear', 'Smoothstep'), got 'linear'",
        ),
    ],
)
def test_grid_geometry_refuses_unknown_names(kwargs, message):
    # Tested by name inside (grid_type == "Hash"; the interpolation in the kernels): an unknown
    # name must not silently become a dense grid or linear interpolation.
    with pytest.raises(ValueError) as info:
        grid_geometry(3, 4, 2, 10, 4, 1.5, **kwargs)
    assert str(info.value) == message
