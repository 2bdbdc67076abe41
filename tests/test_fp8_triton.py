"""mptex._fp8_triton (``mptex::fp8_quantize`` on CUDA) against its twin and the C kernel.

The kernels run in ONE subprocess per module (tests/fp8_triton_interpreted.py, with
``TRITON_INTERPRET=1``): the interpreter is chosen when the kernels are decorated, so it cannot
be switched on safely inside a pytest process that may already have imported them. This
process builds the cases, computes the expected outputs and compares.

What is claimed (mptex/_fp8_triton.py states why): every output is bit for bit the C kernel's
(``mptex_fp8_quantize``, reached through the op's CPU kernel) and the eager twin's
(:func:`mptex._fp8_fused.fp8_quantize_reference`), NaN bit patterns included (a NaN amax is
the quiet NaN without payload, whatever NaN the input held; a NaN code's value keeps its sign
and significand bits, as torch converts it). The cast alone
is also compared, on inputs the op never casts, with torch's own conversion. On a GPU the same
arithmetic is compiled: the compile check holds the PTX to correctly rounded divisions, no
flush to zero and no contracted multiply-add, and ``test_matches_cpu_on_cuda`` compares the
compiled kernels where a CUDA device exists.
"""

import itertools
import json

import pytest
import torch
from golden_io import bits
from test_fp8 import _skip_without_cpu_rowwise_scaled_mm
from test_fp8_fused import OUTPUTS
from triton_subprocess import (
    check_compiles,
    require_faithful_interpreter,
    run_cases,
    run_script,
)

import mptex
from mptex._fp8_fused import fp8_quantize_reference

pytestmark = [pytest.mark.requires_triton, pytest.mark.slow]

FORMATS = {0: torch.float8_e4m3fn, 1: torch.float8_e5m2}
FMAX = {0: 448.0, 1: 57344.0}
RECIPES = {0: "delayed", 1: "current", 2: "rowwise"}
NAN, INF = float("nan"), float("inf")
# 512 programs of 1024 elements: this many elements make a program loop over two blocks.
ABOVE_CAP = 512 * 1024 + 3001


def _q_dtypes(fmt):
    return (FORMATS[fmt], torch.float32, torch.float64)


def _wide(shape, seed):
    """Signed magnitudes spread over 2^-24 .. 2^24 (a randn sign, a log-uniform size)."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.randn(shape, generator=gen).sign()
    return sign * torch.exp2(torch.rand(shape, generator=gen) * 48 - 24)


def _fp8_grid(fmt):
    """All finite non-negative values of the format, ascending (float32)."""
    codes = torch.arange(0x80, dtype=torch.uint8).view(FORMATS[fmt]).float()
    return codes[torch.isfinite(codes)].sort().values


def _ties(fmt):
    """The format's values, the midpoints between neighbours (ties: even wins), values one
    float32 ulp either side of a midpoint, both signs, and fp8_max (the amax: unscaled = 1)."""
    grid = _fp8_grid(fmt)
    mid = (grid[1:] + grid[:-1]) / 2  # exact in float32
    near = torch.cat([mid.nextafter(torch.tensor(INF)), mid.nextafter(torch.tensor(0.0))])
    values = torch.cat([grid, mid, near, torch.tensor([FMAX[fmt]])])
    return torch.cat([values, -values])


def _subnormal(fmt):
    """The format's subnormal range in steps of a quarter of its unit, and float32 subnormals,
    with fp8_max so that the scale is 1 (their rounding is the cast's, not the scale's)."""
    unit = 2.0 ** (-9 if fmt == 0 else -16)
    steps = torch.arange(0, 40, dtype=torch.float32) * (unit / 4)
    f32_sub = torch.tensor([1e-45, 1e-40, 3e-39, 1.1754942e-38, 1.1754944e-38])
    values = torch.cat([steps, f32_sub, torch.tensor([FMAX[fmt]])])
    return torch.cat([values, -values])


def _nan_payloads():
    """A quiet NaN with a payload and a negative signalling one (float32 bits)."""
    return torch.tensor([0x7FC00123, 0xFF800001 - 2**32], dtype=torch.int32).view(torch.float32)


def _with_specials(x, specials):
    """x with ``specials`` (values, or a float32 tensor: its bits) at spread positions."""
    x = x.clone()
    flat = x.view(-1)
    specials = torch.as_tensor(specials, dtype=torch.float32)
    index = torch.tensor([(i * 7919) % flat.numel() for i in range(specials.numel())])
    flat[index] = specials
    return x


def _rows(values, k, lead=None):
    """values as rows of k (zero padded) as a transposed view (strides (1, M)); with ``lead``,
    each row starts with it (the rows' common amax)."""
    width = k if lead is None else k - 1
    rows = -(-values.numel() // width)
    padded = torch.zeros(rows * width)
    padded[: values.numel()] = values
    matrix = padded.view(rows, width)
    if lead is not None:
        matrix = torch.cat([torch.full((rows, 1), lead), matrix], dim=1)
    return matrix.t().contiguous().t()


def _op(name, x, fmt, recipe, q_dtype, margin=0, most_recent=False, record=True, **kwargs):
    """An op case: ``kwargs`` may give ``scale``, ``history``, ``max_programs``,
    ``one_program_blocks`` (0: the per-tensor recipes' two launches at any size),
    ``tiles_per_chunk`` (long rows: fewer column tiles per chunk, more chunks),
    ``statistics_block`` (the row-wise statistics' pairs reduced fewer at a time), ``q_pad``
    (q row-major, its rows zero-padded to a multiple of it) and ``t_pad`` (per tensor: the
    transpose too, its rows zero-padded to a multiple of it)."""
    scale, history = kwargs.get("scale"), kwargs.get("history")
    if scale is None:
        scale = torch.tensor(2.0**-12)
    if history is None:
        history = _wide(16, 99).abs()
    args = (x, scale, history, fmt, recipe, margin, most_recent, record, q_dtype)
    if kwargs.get("q_pad") or kwargs.get("t_pad"):
        args += (kwargs.get("q_pad", 0), kwargs.get("t_pad", 0))
    keys = ("max_programs", "one_program_blocks", "tiles_per_chunk", "statistics_block")
    overrides = {key: kwargs.get(key) for key in keys}
    return dict(kind="op", name=name, args=args, **overrides)


def _cases():
    cases = []
    # The full matrix on wide data: formats, recipes, margins, most_recent, record, q dtypes.
    # Per-tensor: 3001 elements (3 blocks, the last one partial), in one launch and in two
    # (every other combination). Row-wise: a transposed view with K = 67, or a row-major one
    # with K = 200 (two column blocks).
    scales = (2.0**-12, 1.0, 3e-4)  # 1.0 overflows: the fallback fp8_max / amax
    matrix = itertools.product((0, 1), (0, 1, 2), (0, 2), (False, True), (False, True))
    for i, (fmt, recipe, margin, most_recent, record) in enumerate(matrix):
        for q_dtype in _q_dtypes(fmt):
            if recipe == 2:
                x = _wide((67, 45), i).t() if i % 2 else _wide((37, 200), i)
            else:
                x = _wide(3001, i)
            name = f"wide-{fmt}-{RECIPES[recipe]}-m{margin}-mr{int(most_recent)}-r{int(record)}"
            flags = dict(margin=margin, most_recent=most_recent, record=record,
                         one_program_blocks=0 if i % 2 else None)  # fmt: skip
            scale = torch.tensor(scales[i % 3])
            cases.append(_op(f"{name}-{q_dtype}", x, fmt, recipe, q_dtype, scale=scale, **flags))
    # Value sets, for every format, recipe and q dtype, margins and flags in turn.
    for fmt in (0, 1):
        sets = {
            "ties": _ties(fmt),
            "subnormal": _subnormal(fmt),
            "zeros": torch.tensor([0.0, -0.0] * 700),
            "tiny-amax": torch.tensor([1e-40, -3e-39, 0.0, 5e-45] * 50),
            "huge": torch.tensor([3.4e38, -1e38, 2.0, 1e-30] * 50),
            "nan": _with_specials(_wide(2000, 5), [NAN]),
            "neg-nan": _with_specials(_wide(2000, 6), [-NAN, 1e30]),
            "nan-payload": _with_specials(_wide(2000, 9), _nan_payloads()),
            "inf": _with_specials(_wide(2000, 7), [INF, -INF]),
            "neg-inf": _with_specials(_wide(2000, 8), [-INF]),
        }
        for j, (tag, values) in enumerate(sets.items()):
            for recipe, q_dtype in itertools.product((0, 1, 2), _q_dtypes(fmt)):
                k = j + recipe
                margin, most_recent = (0, 2)[k % 2], bool(k // 2 % 2)
                if recipe != 2:
                    x = values
                elif tag in ("ties", "subnormal"):
                    x = _rows(values, 16, lead=FMAX[fmt])
                else:
                    x = _rows(values, 32)
                scale = torch.tensor(1.0)  # delayed: used = 1 where amax <= fp8_max
                flags = dict(margin=margin, most_recent=most_recent, scale=scale)
                name = f"{tag}-{fmt}-{RECIPES[recipe]}-{q_dtype}"
                cases.append(_op(name, x, fmt, recipe, q_dtype, **flags))
                if recipe != 2 and q_dtype == FORMATS[fmt]:  # the amax from the partials too
                    cases.append(_op(f"{name}-two-launches", x, fmt, recipe, q_dtype,
                                     one_program_blocks=0, **flags))  # fmt: skip
        # Rows that hold an inf, a NaN, zeros only, tiny values, or ordinary values.
        mixed = _wide((6, 40), 11)
        mixed[0, 3], mixed[1, 5], mixed[2] = INF, NAN, 0.0
        mixed[3] = 1e-41
        mixed[4, 0] = -INF
        for q_dtype in _q_dtypes(fmt):
            cases.append(_op(f"mixed-rows-{fmt}-{q_dtype}", mixed, fmt, 2, q_dtype, margin=2))
    # Shapes: empty, one element, 0-d, 1025 (a partial second block), non-contiguous x, above
    # the program cap, and a small cap (each program loops over several blocks).
    f8 = FORMATS[0]
    for recipe, fmt, q_dtype in ((0, 0, f8), (1, 1, torch.float32), (1, 0, torch.float64)):
        for tag, x in (
            ("empty", torch.empty(0)),
            ("one", torch.tensor([-3.25])),
            ("0d", torch.tensor(7.0)),
            ("1025", _wide(1025, 12)),
            ("transposed", _wide((40, 70), 13).t()),
        ):
            cases.append(_op(f"{tag}-{RECIPES[recipe]}-{fmt}-{q_dtype}", x, fmt, recipe, q_dtype))
    # The row-wise statistics over several blocks of rows (128 rows of 32 each): a NaN row, an
    # inf row (its used scale 0, the smallest), both, neither, zero rows only; recording or
    # not; the blocks' pairs reduced 4 at a time (a loop with a partial last step).
    many = _wide((1000, 32), 25)
    nan_row, inf_row, both = many.clone(), many.clone(), many.clone()
    nan_row[300, 7] = NAN
    inf_row[700, 2] = -INF
    both[130, 0], both[999, 31] = INF, NAN
    for tag, x in (("plain", many), ("nan-row", nan_row), ("inf-row", inf_row),
                   ("nan-and-inf", both), ("zeros", torch.zeros(600, 32))):  # fmt: skip
        for record in (True, False):
            cases.append(_op(f"statistics-{tag}-r{int(record)}", x, 0, 2, f8, record=record))
        cases.append(_op(f"statistics-{tag}-by-4", x, 1, 2, torch.float32, margin=2,
                         statistics_block=4))  # fmt: skip
    for tag, x in (
        ("empty-rows", torch.empty(0, 32)),
        ("empty-cols", torch.empty(5, 0)),
        ("one", torch.tensor([[-3.25]])),
        ("long-rows", _wide((9, 1000), 14)),
        ("one-column", _wide((300, 1), 15)),
        ("rows-2049", _wide((2049, 32), 16)),
    ):
        cases.append(_op(f"{tag}-rowwise", x, 0, 2, f8, margin=2))
    # Few long rows (the weight gradient's operands), their columns split in chunks over two
    # kernels: a transposed view (5 rows of 40000: 79 tiles of 8 x 512, 5 chunks) and a
    # row-major one (3 rows of 70000: 69 tiles of 4 x 1024, 5 chunks; with one tile per chunk,
    # 69 chunks, more than one block of partials; with 4 programs at most, 4 chunks). Row 0
    # is tiny, row 1 holds an inf in a middle chunk, row 2 a NaN in the last chunk, row 3 its
    # amax in the last column, row 4 (of the transposed view) only zeros.
    tall = _wide((40000, 5), 23)
    tall[:, 0] *= 1e-30
    tall[20000, 1], tall[-1, 2], tall[-1, 3], tall[:, 4] = INF, NAN, 1e9, 0.0
    wide = _wide((3, 70000), 24)
    wide[0] *= 1e-30
    wide[1, 35000], wide[2, -1] = INF, NAN
    for fmt, q_dtype in itertools.product((0, 1), (FORMATS[0], torch.float32, torch.float64)):
        q_dtype = FORMATS[fmt] if q_dtype == FORMATS[0] else q_dtype
        cases.append(_op(f"long-rows-transposed-{fmt}-{q_dtype}", tall.t(), fmt, 2, q_dtype,
                         margin=2 * fmt))  # fmt: skip
    cases.append(_op("long-rows-row-major", wide, 0, 2, f8))
    cases.append(_op("long-rows-69-chunks", wide, 1, 2, torch.float32, tiles_per_chunk=1))
    cases.append(_op("long-rows-4-programs", wide, 0, 2, f8, margin=3, max_programs=4))
    # q's rows padded (the layout torch._scaled_mm takes): short rows, transposed or not, in
    # one block of rows and in several (the statistics' reduction too), long rows in chunks,
    # no columns at all, a padding that is a whole tile.
    padded = [
        ("short", _wide((37, 200), 26), 16), ("short-t", _wide((67, 45), 27).t(), 16),
        ("blocks", both, 16), ("long-t", tall.t(), 16), ("long", wide, 48),
        ("no-cols", torch.empty(5, 0), 16), ("tile", _wide((9, 120), 28), 128),
    ]  # fmt: skip
    for tag, x, pad in padded:
        for record in (True, False):
            cases.append(_op(f"padded-{tag}-r{int(record)}", x, 0, 2, f8, margin=2,
                             record=record, q_pad=pad))  # fmt: skip
        cases.append(_op(f"padded-{tag}-f32", x, 1, 2, torch.float32, q_pad=pad))
    # Row-wise and column-wise in one call (t_pad: x.t() quantised row-wise too), padded, and
    # unpadded (t_pad 1): rows that fit a tile in one launch (up to 16 blocks of rows), in
    # two (one program per block, or 4 programs looping over them), and rows that do not.
    for tag, x, pad in padded[:4]:
        cases.append(_op(f"both-{tag}", x, 1, 2, FORMATS[1], margin=1, q_pad=pad, t_pad=16))
        cases.append(_op(f"both-{tag}-two", x, 0, 2, f8, q_pad=pad, t_pad=16,
                         one_program_blocks=0))  # fmt: skip
    cases.append(_op("both-unpadded", padded[0][1], 0, 2, torch.float64, record=False, t_pad=1))
    tall_both = _wide((3001, 32), 29)
    tall_both[1500, 3], tall_both[7, 31] = INF, NAN
    cases.append(_op("both-tall", tall_both, 0, 2, f8, margin=2, q_pad=16, t_pad=16))
    cases.append(_op("both-tall-4-programs", tall_both, 1, 2, torch.float32, t_pad=5,
                     max_programs=4))  # fmt: skip
    cases.append(_op("both-tall-t", tall_both[:, :5].t(), 0, 2, f8, t_pad=16))
    # Per tensor, q row-major and padded and its transpose (the operands of torch._scaled_mm
    # for the two GEMMs a tensor enters): one launch and two, a program over several row tiles
    # (4 programs), rows wider than a column tile, odd pads, no rows, a transposed x; with an
    # inf and a NaN, and a row of the amax.
    layouts = [
        ("one", _wide((40, 32), 40), 16, 16), ("two", _wide((3001, 32), 41), 16, 16),
        ("wide", _wide((37, 200), 42), 16, 3), ("odd", _wide((257, 5), 43), 5, 3),
        ("t-only", _wide((70, 3), 44), 0, 16), ("q-only", _wide((300, 3), 45), 16, 0),
        ("no-rows", torch.empty(0, 32), 16, 16), ("transposed", _wide((45, 67), 46).t(), 0, 16),
    ]  # fmt: skip
    layouts[1][1][2000, 7] = 3e4
    layouts[2][1][5, 150], layouts[3][1][100, 2] = INF, NAN
    for (tag, x, q_pad, t_pad), recipe in itertools.product(layouts, (0, 1)):
        pads = dict(q_pad=q_pad, t_pad=t_pad)
        cases.append(_op(f"layout-{tag}-{recipe}", x, 0, recipe, f8, margin=1, **pads))
        cases.append(_op(f"layout-{tag}-{recipe}-f64", x, 1, recipe, torch.float64, **pads))
    cases.append(_op("layout-cap4", _wide((3001, 32), 47), 1, 1, torch.float32, q_pad=16,
                     t_pad=16, max_programs=4, one_program_blocks=0))  # fmt: skip
    big = _with_specials(_wide(ABOVE_CAP, 17), [1e7])  # amax at a spot past the first pass
    cases.append(_op("above-cap-delayed", big, 0, 0, f8, margin=2, scale=torch.tensor(1e-5)))
    cases.append(_op("above-cap-current", big, 1, 1, torch.float32))
    small_cap = _wide(10_000, 18)
    for recipe in (0, 1):
        cases.append(_op(f"cap4-{RECIPES[recipe]}", small_cap, 0, recipe, f8, max_programs=4,
                         one_program_blocks=0))  # fmt: skip
    # The largest tensor of one launch (a program loops over many blocks for its amax) and the
    # smallest of two.
    for extra, tag in ((0, "one-launch-largest"), (1, "two-launches-smallest")):
        x = _wide(16 * 1024 + extra, 22)
        x[-1] = 3e5  # the amax in the last block
        cases.append(_op(tag, x, 0, 1, f8))
    # The delayed recipe's history and scale: lengths 1 and 1500 (beyond one history block),
    # NaN and inf entries, all zeros; a subnormal scale (1 / used overflows), zero, NaN.
    x = _wide(3001, 19)
    histories = {
        "h1": torch.tensor([0.5]),
        "h1500": _wide(1500, 20).abs(),
        "h-nan": torch.tensor([1.0, NAN, 2.0]),
        "h-inf": torch.tensor([1.0, 2.0, INF]),
        "h-zeros": torch.zeros(8),
    }
    for (tag, history), most_recent in itertools.product(histories.items(), (False, True)):
        for fmt, margin in ((0, 0), (1, 2)):
            name = f"{tag}-mr{int(most_recent)}-{fmt}-m{margin}"
            cases.append(_op(name, x, fmt, 0, FORMATS[fmt], margin, most_recent, history=history))
    cases.append(_op("h-nan-amax", _with_specials(x, [NAN]), 0, 0, f8, history=torch.ones(4)))
    for tag, scale in (("subnormal", 2.0**-140), ("zero", 0.0), ("nan", NAN), ("inf", INF)):
        cases.append(_op(f"scale-{tag}", x, 0, 0, torch.float32, scale=torch.tensor(scale)))
    cases.append(
        _op("scale-inf-zeros", torch.zeros(100), 1, 0, FORMATS[1], scale=torch.tensor(INF))
    )
    # NaN signs and payloads of x * used and 1 / used: x86's rules (used's NaN first, then
    # x's, else the negative default NaN), whatever the device's arithmetic returns.
    nans = torch.cat([_nan_payloads(), torch.tensor([-NAN, NAN, INF, -INF, 1.0, -0.0])])
    scales = torch.cat([_nan_payloads(), torch.tensor([-NAN, NAN, 1.0])])
    for i, scale in enumerate(scales):
        for q_dtype in (f8, torch.float32):
            name = f"nan-signs-{i}-{q_dtype}"
            cases.append(_op(name, nans, 0, 0, q_dtype, scale=scale.clone()))
    # A margin past float32's range: 2**130 is inf, the scale 0.
    for recipe in (0, 1, 2):
        x = _wide((20, 30), 21) if recipe == 2 else _wide(600, 21)
        cases.append(_op(f"margin130-{RECIPES[recipe]}", x, 1, recipe, torch.float32, 130))
    # The cast alone, on every format's codes and on float32 bit patterns that decide its
    # rounding: sign, every exponent, the top 6 significand bits (the kept bits and the round
    # bit of both formats), and sticky bits none, the lowest, a middle one, all.
    low = torch.tensor([0, 1, 0x1000, 0x1FFFF], dtype=torch.int64)
    sign_exp_top = torch.arange(2 * 256 * 64, dtype=torch.int64) << 17
    patterns = (sign_exp_top[:, None] | low[None, :]).view(-1)
    probe_x = (patterns - (patterns >= 2**31) * 2**32).to(torch.int32).view(torch.float32)
    for fmt in (0, 1):
        codes = torch.arange(256, dtype=torch.uint8).view(FORMATS[fmt]).float()
        values = torch.cat([probe_x, codes, torch.tensor([NAN, -NAN, INF, -INF, 0.0, -0.0])])
        for q_kind in (0, 1, 2):
            probe = dict(kind="probe", name=f"probe-{fmt}-{q_kind}", x=values, q_kind=q_kind)
            cases.append(dict(probe, fp8_format=fmt))
    return cases


CASES = _cases()
OP_NAMES = [c["name"] for c in CASES if c["kind"] == "op"]
PROBE_NAMES = [c["name"] for c in CASES if c["kind"] == "probe"]
assert len(set(OP_NAMES + PROBE_NAMES)) == len(CASES), "case names must be unique"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """{case name: (case, kernel outputs)} from one interpreter subprocess."""
    if not mptex.has_triton():
        pytest.skip("needs triton importable")
    results = run_cases("fp8_triton_interpreted.py", CASES, tmp_path_factory.mktemp("fp8_triton"),
                        600)  # fmt: skip
    return {case["name"]: (case, results[case["name"]]) for case in CASES}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what):
    """Equal dtype, shape and bits (NaNs included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
    assert torch.equal(bits(got), bits(want)), what


@pytest.mark.parametrize("name", OP_NAMES)
def test_matches_twin(interpreted, name):
    case, got = interpreted[name]
    want = fp8_quantize_reference(*case["args"])
    for output, g, w in zip(OUTPUTS, got, want):
        assert_same_bits(g, w, (name, output))
    x = case["args"][0]
    if len(case["args"]) > 9 and case["args"][9]:  # q_pad: row-major
        assert got[0].is_contiguous(), "q is row-major"
    else:
        assert got[0].stride() == torch.empty_like(x).stride(), "q is laid out as x"


@pytest.mark.parametrize("name", OP_NAMES)
def test_matches_c_kernel(interpreted, name):
    from mptex._native_cpu import native_kernels

    if native_kernels() is None:
        pytest.skip("no C kernel (no compiler, or MPTEX_NATIVE=0)")
    case, got = interpreted[name]
    want = torch.ops.mptex.fp8_quantize(*case["args"])
    for output, g, w in zip(OUTPUTS, got, want):
        assert_same_bits(g, w, (name, output))


def _values(codes: torch.Tensor, fmt: int, q_kind: int) -> torch.Tensor:
    """The C kernel's fp8_to_f32 (torch's conversion, NaN bits included) in q_kind's dtype."""
    values = codes.view(FORMATS[fmt])
    return values.float() if q_kind == 1 else values.double()


@pytest.mark.parametrize("name", PROBE_NAMES)
def test_cast_matches_torch(interpreted, name):
    # torch's float32 -> float8 conversion (CPU) rounds to nearest even, saturates E4M3 at 448
    # (infinity included) and overflows E5M2 to infinity, as the C kernel's fp8_from_f32. Before
    # torch 2.13 its E4M3 cast gave NaN past 464 instead: the reference clamps to 448 first
    # (NaN kept), which changes nothing where the cast saturates.
    case, got = interpreted[name]
    fmt, q_kind = case["fp8_format"], case["q_kind"]
    x = case["x"]
    if FORMATS[fmt] == torch.float8_e4m3fn:
        x = x.clamp(-448.0, 448.0)
    codes = x.to(FORMATS[fmt]).view(torch.uint8)
    want = codes if q_kind == 0 else _values(codes, fmt, q_kind)
    assert_same_bits(got, want, name)


def test_nan_codes_keep_sign_and_significand():
    # what the probe expects of a NaN code (the C kernel's fp8_nan_f32): torch's quiet NaN,
    # the sign and the code's significand bits on top of the float's
    codes = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    assert bits(_values(codes, 0, 1)).tolist() == [0x7FF00000, 0xFFF00000 - 2**32]
    codes = torch.tensor([0x7D, 0xFE], dtype=torch.uint8)
    assert bits(_values(codes, 1, 2)).tolist() == [0x7FFC << 48, (0xFFF8 << 48) - 2**64]


def test_cases_cover_the_program_cap_and_ties():
    from mptex import _fp8_triton

    assert -(-ABOVE_CAP // _fp8_triton._BLOCK) > _fp8_triton._MAX_PROGRAMS
    # the per-tensor launches: one (a small tensor) and two, either side of the threshold
    assert _fp8_triton._ONE_PROGRAM_BLOCKS == 16
    assert "one-launch-largest" in OP_NAMES and "two-launches-smallest" in OP_NAMES
    # long rows: chunks in one block of partials and in two (the kernels' settings as the
    # cases assume them)
    assert (_fp8_triton._LONG_ROWS, _fp8_triton._TILES_PER_CHUNK) == (32, 16)
    assert _fp8_triton._ROW_TILE == 4096 and 5 < _fp8_triton._PARTIALS_BLOCK < 69
    # the ties cases hold exact midpoints, some rounding down and some up (ties to even)
    for fmt in (0, 1):
        grid = _fp8_grid(fmt)
        mid = (grid[1:] + grid[:-1]) / 2
        q = _ties(fmt)[len(grid) : len(grid) + len(mid)].to(FORMATS[fmt]).float()
        assert 0 < (q < mid).sum() < len(mid)


def _flat(obj, path=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _flat(value, f"{path}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _flat(value, f"{path}[{i}]")
    else:
        yield path, obj


def test_training_through_the_triton_kernels_has_the_c_kernels_bits(tmp_path):
    # The FP8 arms trained as on a GPU with FP8 tensor cores (torch._scaled_mm, its CPU kernel
    # here), every quantisation once through the C kernel and once through the Triton kernels
    # under the interpreter (each in its form for large tensors: a row-wise tensor and its
    # transpose in two launches; the padded GEMM operands copied by the layout kernel): the
    # same weights, Adam state,
    # FP8 scaling state and losses, bit for bit. The FP8 QAT arms' rounding goes through the
    # same op.
    arms = ["fp8", "fp8_current", "fp8_rowwise", "fp8_qat", "fp8_rowwise_qat"]
    require_faithful_interpreter()  # before the C run, which the interpreted one is checked by
    _skip_without_cpu_rowwise_scaled_mm()  # fp8_rowwise's GEMMs on this CPU's torch._scaled_mm
    for mode in ("c", "triton"):
        proc = run_script("fp8_triton_training.py", str(tmp_path / mode), mode, *arms,
                          interpret=mode == "triton", timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    for arm in arms:
        c, t = (json.loads((tmp_path / m / f"{arm}.json").read_text()) for m in ("c", "triton"))
        assert c["status"] == t["status"] == "completed" and t["quantisations"] > 0, (c, t)
        assert t["losses"] == c["losses"]
        assert (t["both_split"] > 0) == (arm == "fp8_rowwise"), t
        # torch._scaled_mm's padded operands (the QAT arms have no FP8 GEMM)
        assert (t["padded_copies"] > 0) == ("qat" not in arm) and c["padded_copies"] == 0, t
        states = [torch.load(tmp_path / mode / f"{arm}.pt", weights_only=False)
                  for mode in ("c", "triton")]  # fmt: skip
        for part in ("texture", "optimizer", "stepper"):
            got, want = (dict(_flat(state[part])) for state in states)
            assert got.keys() == want.keys()
            for key, value in want.items():
                if torch.is_tensor(value):
                    assert_same_bits(got[key], value, (arm, part, key))
                else:
                    assert got[key] == value, (arm, part, key)


def test_kernels_compile_for_sm90():
    # The interpreter runs the kernels as Python (numpy's IEEE float32 arithmetic); this
    # compiles them to PTX and a cubin for sm_90 (no GPU needed: triton's wheel ships ptxas)
    # and checks what the interpreter cannot: every float32 division is div.rn.f32 (Triton's
    # `/` is div.full.f32, approximate), nothing is flushed to zero, no multiply-add was
    # contracted, no FP8 conversion instruction is used.
    check_compiles("fp8_triton_interpreted.py", timeout=600)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("recipe", [0, 1, 2])
@pytest.mark.parametrize("fmt", [0, 1])
def test_matches_cpu_on_cuda(recipe, fmt):
    # The compiled kernels (through the op's CUDA registration) against the CPU op, bit for
    # bit, with no host synchronisation.
    x = _with_specials(_wide((300, 67), 30 + recipe), [1e-40, -2e-39])
    x[7, :3] = torch.tensor([INF, NAN, -INF])  # one row (row-wise) or the whole tensor
    x[8, :4] = torch.cat([_nan_payloads(), torch.tensor([-NAN, 1.0])])
    # per-tensor: one launch (x[:6], 402 values) and two (the rest); row-wise: long rows too
    # (9 and 32 rows of 2^17 + 5 columns, the weight gradient's operands, in chunks), and the
    # tall matrix itself (with the pads below: both ways in two launches)
    tall = _wide((2**17 + 5, 32), 33)
    tall[-1, 3], tall[7, 5] = NAN, INF
    cases = ([x, x[:6], x[10:], x.t(), tall.t(), tall[:, :9].t(), tall] if recipe == 2
             else [x, x[:6], x[10:], _wide(ABOVE_CAP, 31)])  # fmt: skip
    scales = torch.cat([torch.tensor([2.0**-10]), _nan_payloads()])  # NaNs: x86's NaN rules
    # also q padded and its transpose (torch._scaled_mm's layouts), 2-D cases only. Every case,
    # scale and layout with the FP8 codes and no margin; the float32 / float64 values and the
    # margin (other compiled variants of the same arithmetic) on the first case: each variant
    # is a compile of about a second on the GPU machine.
    layouts = [(), (16, 16)]
    runs = [(xc, FORMATS[fmt], 0, scale, pads)
            for xc, scale, pads in itertools.product(cases, scales, layouts)]  # fmt: skip
    runs += [(x, q_dtype, margin, scale, ())
             for q_dtype, margin in itertools.product(_q_dtypes(fmt), (0, 2))
             if (q_dtype, margin) != (FORMATS[fmt], 0) for scale in scales]  # fmt: skip
    for xc, q_dtype, margin, scale, pads in runs:
        if pads and xc.ndim != 2:
            continue
        history = _wide(20, 32).abs()
        args = (scale, history, fmt, recipe, margin, False, True, q_dtype, *pads)
        want = torch.ops.mptex.fp8_quantize(xc, *args)
        on_gpu = [xc.cuda(), *(a.cuda() if torch.is_tensor(a) else a for a in args)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # the op must not synchronise with the host
        try:
            got = torch.ops.mptex.fp8_quantize(*on_gpu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for output, g, w in zip(OUTPUTS, got, want):
            assert_same_bits(g.cpu(), w, (recipe, fmt, q_dtype, margin, output))
