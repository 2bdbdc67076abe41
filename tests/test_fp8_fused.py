"""The fused FP8 quantisation op (mptex._fp8_fused): its C kernel bit for bit against its eager
twin (mptex.fp8's functions) over every recipe, format and output dtype, with infinities, NaNs,
zeros and strided inputs; the kernel's float32 -> FP8 cast against torch's own casts over every
float32 exponent and the rounding ties; the op's registration (schema, fake tensors); and bad
arguments with one clear line each."""

import itertools

import pytest
import torch
from golden_io import bits

from mptex import _fp8_fused
from mptex._fp8_fused import RECIPE_CODES, fp8_quantize, fp8_quantize_reference, op_available
from mptex._native_cpu import native_kernels
from mptex.fp8 import E4M3, E5M2, FP8_MAX

needs_kernel = pytest.mark.skipif(
    native_kernels() is None, reason="no C compiler: the op runs its eager twin (no kernel to test)"
)
FORMATS = ((0, E4M3), (1, E5M2))
OUTPUTS = ("q", "scale_inv", "amax", "used", "next_scale", "next_history", "q_t", "t_scale_inv")


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> str | None:
    """None if the op's outputs equal bit for bit (dtype, shape, bits), else which one differs."""
    for name, u, v in zip(OUTPUTS, a, b, strict=True):
        if u.dtype != v.dtype or u.shape != v.shape:
            return f"{name}: {u.dtype} {list(u.shape)} vs {v.dtype} {list(v.shape)}"
        if not torch.equal(bits(u), bits(v)):
            return f"{name}: values differ"
    return None


def _tensor(gen: torch.Generator, shape: tuple[int, ...], special: bool) -> torch.Tensor:
    """Magnitudes over 16 decades with both signs, some zeros; infinities and NaNs if asked."""
    n = int(torch.tensor(shape).prod())
    x = torch.randn(n, generator=gen).sign() * 10.0 ** (torch.rand(n, generator=gen) * 16 - 10)
    x[torch.rand(n, generator=gen) < 0.05] = 0.0
    if special and n:
        picks = torch.randint(0, n, (3,), generator=gen)
        x[picks] = torch.tensor([float("inf"), -float("inf"), float("nan")])[
            torch.randint(0, 3, (3,), generator=gen)
        ]
    return x.reshape(shape)


def _cases(seed: int, trials: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(0, 32), (1, 1), (7, 32), (64, 33), (3, 128), (257, 5)]
    for t in range(trials):
        rows, cols = shapes[t % len(shapes)]
        x = _tensor(gen, (rows, cols), special=t % 3 == 0)
        if t % 4 == 1:  # a transposed (column-major) view, as a weight's or gradient's
            x = _tensor(gen, (cols, rows), special=False).t()
        history = torch.rand(int(torch.randint(1, 20, (), generator=gen)), generator=gen) * 100
        history[torch.rand(history.shape, generator=gen) < 0.3] = 0.0
        scale = torch.tensor(float(2.0 ** torch.randint(-8, 9, (), generator=gen)))
        yield x, scale, history


@needs_kernel
@pytest.mark.parametrize("fmt,dtype", FORMATS)
@pytest.mark.parametrize("recipe", sorted(RECIPE_CODES.values()))
def test_the_kernel_matches_its_twin_bit_for_bit(fmt, dtype, recipe):
    checked = 0
    for i, (x, scale, history) in enumerate(_cases(seed=fmt * 10 + recipe, trials=60)):
        if recipe != 2 and not x.is_contiguous():
            x = x.contiguous()
        for margin, most_recent, record, q_dtype in itertools.product(
            (0, 3), (False, True), (False, True), (dtype, torch.float32, torch.float64)
        ):
            args = (x, scale, history, fmt, recipe, margin, most_recent, record, q_dtype)
            got = torch.ops.mptex.fp8_quantize(*args)
            want = fp8_quantize_reference(*args)
            problem = _same(got, want)
            assert problem is None, f"case {i} {list(x.shape)} {args[3:]}: {problem}"
            checked += 1
    assert checked == 60 * 24


@needs_kernel
def test_the_kernel_takes_infinities_nans_and_zeros_per_recipe():
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[1.0, -inf, 2.0], [nan, 1.0, -3.0], [0.0, -0.0, 0.0], [448.0, 1e-9, -5.0]])
    history = torch.tensor([4.0, 0.0, 9.0])
    for fmt, dtype in FORMATS:
        for recipe in (0, 1, 2):
            for x in (rows, rows[2:], rows[3:], rows[:1]):
                x = x.contiguous() if recipe != 2 else x
                for record in (False, True):
                    args = (x, torch.tensor(0.5), history, fmt, recipe, 1, False, record, dtype)
                    got = torch.ops.mptex.fp8_quantize(*args)
                    problem = _same(got, fp8_quantize_reference(*args))
                    assert problem is None, f"{args[3:]} on {x.tolist()}: {problem}"


@needs_kernel
def test_the_delayed_history_keeps_finite_amaxes_only():
    """By hand: a finite amax enters at the front; an infinite one leaves the history as it
    was; the next scale is fp8_max over the history's max (or its front with most_recent)."""
    history = torch.tensor([2.0, 8.0, 4.0])
    x = torch.tensor([1.0, -16.0])
    out = torch.ops.mptex.fp8_quantize(x, torch.tensor(1.0), history, 0, 0, 0, False, True, E4M3)
    assert out[5].tolist() == [16.0, 2.0, 8.0]
    assert out[4].item() == 448.0 / 16.0
    out = torch.ops.mptex.fp8_quantize(x, torch.tensor(1.0), history, 0, 0, 0, True, True, E4M3)
    assert out[4].item() == 448.0 / 16.0
    x = torch.tensor([1.0, float("inf")])
    out = torch.ops.mptex.fp8_quantize(x, torch.tensor(1.0), history, 0, 0, 0, True, True, E4M3)
    assert out[5].tolist() == [2.0, 8.0, 4.0]
    assert out[4].item() == 448.0 / 2.0


def _float32_sweep() -> torch.Tensor:
    """Every float32 sign, exponent and top 7 mantissa bits, with low bits that make exact
    ties, values just above and below them, and the extremes."""
    high = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = (high[:, None] | low[None, :]).reshape(-1)
    return _as_float32(bits)


def _as_float32(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return signed.to(torch.int32).view(torch.float32)


@needs_kernel
@pytest.mark.parametrize("fmt,dtype", FORMATS)
def test_the_kernels_cast_rounds_as_torchs_over_every_exponent(fmt, dtype):
    """With scale 1 and no value above the format's max the op is the bare cast: its codes must
    be torch's for every float32 exponent (normals, the format's subnormals and underflow,
    ties to even) and for NaNs."""
    x = _float32_sweep()
    x = x[~(x.abs() > FP8_MAX[dtype])]  # NaNs kept
    assert x.numel() > 100_000
    q = torch.ops.mptex.fp8_quantize(
        x, torch.tensor(1.0), torch.zeros(1), fmt, 0, 0, False, False, dtype
    )[0]
    assert torch.equal(q.view(torch.uint8), x.to(dtype).view(torch.uint8))
    # Its float32 and float64 values are the codes' values.
    for q_dtype in (torch.float32, torch.float64):
        v = torch.ops.mptex.fp8_quantize(
            x, torch.tensor(1.0), torch.zeros(1), fmt, 0, 0, False, False, q_dtype
        )[0]
        assert torch.equal(bits(v), bits(x.to(dtype).to(q_dtype)))


def test_the_op_is_registered_with_a_fake_kernel():
    x = torch.randn(12, 30)
    for recipe, record, q_pad, t_pad in ((0, True, 0, 0), (0, False, 0, 0), (1, False, 0, 0),
                                         (2, True, 0, 0), (2, False, 16, 0), (0, True, 16, 16),
                                         (1, False, 0, 16), (2, True, 16, 16)):  # fmt: skip
        for q_dtype in (E4M3, torch.float32):
            torch.library.opcheck(
                torch.ops.mptex.fp8_quantize.default,
                (
                    x,
                    torch.tensor(2.0),
                    torch.zeros(4),
                    0,
                    recipe,
                    0,
                    False,
                    record,
                    q_dtype,
                    q_pad,
                    t_pad,
                ),  # fmt: skip
                test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
            )


@needs_kernel
@pytest.mark.parametrize("fmt,dtype", FORMATS)
def test_padded_rows_are_the_unpadded_values_then_zeros(fmt, dtype):
    """``q_pad``: q row-major, each row's values then zeros up to a multiple of q_pad columns,
    the other outputs unchanged; the kernel bit for bit its twin, on row-major and transposed
    inputs, infinities and NaNs included."""
    for i, (x, scale, history) in enumerate(_cases(seed=50 + fmt, trials=24)):
        for q_pad, record, q_dtype in itertools.product(
            (16, 5, 1), (False, True), (dtype, torch.float32, torch.float64)
        ):
            args = (x, scale, history, fmt, 2, 2, False, record, q_dtype)
            got = torch.ops.mptex.fp8_quantize(*args, q_pad)
            problem = _same(got, fp8_quantize_reference(*args, q_pad))
            assert problem is None, f"case {i} {list(x.shape)} pad {q_pad}: {problem}"
            plain = torch.ops.mptex.fp8_quantize(*args)
            rows, cols = x.shape
            width = -(-cols // q_pad) * q_pad
            q = got[0]
            assert q.shape == (rows, width) and q.is_contiguous()
            assert torch.equal(bits(q[:, :cols]), bits(plain[0]))
            assert not torch.count_nonzero(bits(q[:, cols:]))  # +0 codes / values
            for name, u, v in zip(OUTPUTS[1:], got[1:], plain[1:], strict=True):
                assert torch.equal(bits(u), bits(v)), name


@needs_kernel
@pytest.mark.parametrize("fmt,dtype", FORMATS)
@pytest.mark.parametrize("recipe", [0, 1])
def test_per_tensor_layouts_are_the_codes_padded_and_transposed(fmt, dtype, recipe):
    """A per-tensor recipe with ``q_pad`` and ``t_pad``: q row-major with zero columns up to a
    multiple of q_pad, ``q_t[k, m] = q[m, k]`` with zero columns up to a multiple of t_pad, the
    other outputs those of the call without them (a delayed call's history included); the
    kernel bit for bit its twin, infinities and NaNs included."""
    for i, (x, scale, history) in enumerate(_cases(seed=70 + 10 * fmt + recipe, trials=24)):
        x = x.contiguous()
        rows, cols = x.shape
        for q_pad, t_pad, record, q_dtype in itertools.product(
            (0, 16, 5), (0, 16, 3), (False, True), (dtype, torch.float32, torch.float64)
        ):
            args = (x, scale, history, fmt, recipe, 2, False, record, q_dtype)
            got = torch.ops.mptex.fp8_quantize(*args, q_pad, t_pad)
            problem = _same(got, fp8_quantize_reference(*args, q_pad, t_pad))
            assert problem is None, f"case {i} {[rows, cols]} pads {q_pad, t_pad}: {problem}"
            plain = torch.ops.mptex.fp8_quantize(*args)
            q, q_t = got[0], got[6]
            width = -(-cols // q_pad) * q_pad if q_pad else cols
            assert q.shape == (rows, width) and q.is_contiguous()
            assert torch.equal(bits(q[:, :cols]), bits(plain[0]))
            assert not torch.count_nonzero(bits(q[:, cols:]))  # +0 codes / values
            if t_pad:
                length = -(-rows // t_pad) * t_pad
                assert q_t.shape == (cols, length) and q_t.is_contiguous()
                assert torch.equal(bits(q_t[:, :rows]), bits(plain[0].t()))
                assert not torch.count_nonzero(bits(q_t[:, rows:]))
            else:
                assert q_t.shape == (0,) and q_t.dtype == q.dtype
            assert got[7].shape == (0,)  # the transpose's scale is scale_inv
            for name, u, v in zip(OUTPUTS[1:6], got[1:6], plain[1:6], strict=True):
                assert torch.equal(bits(u), bits(v)), name


@needs_kernel
@pytest.mark.parametrize("fmt,dtype", FORMATS)
def test_rowwise_transposes_are_the_columns_quantised_as_rows(fmt, dtype):
    """Row-wise with ``t_pad``: ``q_t`` and ``t_scale_inv`` are what the op gives for ``x.t()``
    with ``q_pad = t_pad`` and no record (one scale per column of x), the other outputs those
    of the call without ``t_pad`` (the statistics of the rows alone); the kernel bit for bit
    its twin, on row-major and transposed inputs, infinities and NaNs included."""
    for i, (x, scale, history) in enumerate(_cases(seed=90 + fmt, trials=24)):
        for q_pad, t_pad, record, q_dtype in itertools.product(
            (0, 16), (16, 5, 1), (False, True), (dtype, torch.float32, torch.float64)
        ):
            args = (x, scale, history, fmt, 2, 2, False, record, q_dtype)
            got = torch.ops.mptex.fp8_quantize(*args, q_pad, t_pad)
            problem = _same(got, fp8_quantize_reference(*args, q_pad, t_pad))
            assert problem is None, f"case {i} {list(x.shape)} pads {q_pad, t_pad}: {problem}"
            plain = torch.ops.mptex.fp8_quantize(*args, q_pad)
            columns = torch.ops.mptex.fp8_quantize(x.t(), *args[1:7], False, q_dtype, t_pad)
            assert got[6].is_contiguous() and got[7].shape == (x.shape[1], 1)
            assert torch.equal(bits(got[6]), bits(columns[0]))
            assert torch.equal(bits(got[7]), bits(columns[1]))
            for name, u, v in zip(OUTPUTS[:6], got[:6], plain[:6], strict=True):
                assert torch.equal(bits(u), bits(v)), name


def test_the_dispatcher_uses_the_twin_where_there_is_no_kernel():
    x = torch.randn(8, 4, dtype=torch.float64)
    assert not op_available(x)
    args = (x, torch.tensor(1.0), torch.zeros(2), 0, 2, 0, False, True, E4M3)
    assert _same(fp8_quantize(*args), fp8_quantize_reference(*args)) is None


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(fp8_format=2), "fp8_format: expected 0 \\(E4M3\\) or 1 \\(E5M2\\), got 2"),
        (dict(recipe=3), "recipe: expected 0 \\(delayed\\), 1 \\(current\\) or 2 \\(rowwise\\)"),
        (dict(q_dtype=torch.float16), "q_dtype: expected torch.float8_e4m3fn"),
        (dict(x=torch.zeros(2, 3, 4)), "x: the rowwise recipe takes a \\[M, K\\] matrix"),
        (dict(q_pad=-1), "q_pad: expected 0, or > 0 with a \\[M, K\\] matrix x, got -1"),
        (dict(recipe=1, x=torch.zeros(6), q_pad=16), "q_pad: expected 0, or > 0 with a \\[M, K\\]"),
        (dict(recipe=1, t_pad=-1), "t_pad: expected 0, or > 0 with a \\[M, K\\] matrix x, got -1"),
        (dict(recipe=0, x=torch.zeros(6), t_pad=16), "t_pad: expected 0, or > 0 with a \\[M, K\\]"),
    ],
)
def test_bad_arguments_name_themselves(change, message):
    args = dict(
        x=torch.zeros(2, 3), scale=torch.tensor(1.0), history=torch.zeros(2), fp8_format=0,
        recipe=2, margin=0, most_recent=False, record=False, q_dtype=E4M3, q_pad=0, t_pad=0,
    )  # fmt: skip
    args.update(change)
    for quantize in (fp8_quantize, fp8_quantize_reference, torch.ops.mptex.fp8_quantize):
        with pytest.raises((ValueError, RuntimeError), match=message):
            quantize(**args) if quantize is not torch.ops.mptex.fp8_quantize else quantize(
                *args.values()
            )


def test_recipe_codes_cover_the_scaling_recipes():
    from mptex.fp8 import ScalingRecipe

    for name in RECIPE_CODES:
        ScalingRecipe(recipe=name)
    assert _fp8_fused.RECIPE_CODES == {"delayed": 0, "current": 1, "rowwise": 2}
