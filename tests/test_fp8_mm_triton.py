"""mptex._fp8_mm_triton (the ``triton`` FP8 GEMM backend) against float64 references and the
emulated backend.

The kernels run in ONE subprocess per module (tests/fp8_mm_triton_interpreted.py, with
``TRITON_INTERPRET=1``), as in tests/test_fp8_triton.py; this process builds the cases and the
expected results.

What is claimed (mptex/_fp8_mm_triton.py states why):

* on operands whose every partial sum is exact in float32 (small integer codes), the result is
  bit for bit the exact product's float32, scaled in the epilogue's order of float32 roundings
  and biased: whatever the strides, the padding of K and N, the split of K;
* on any operands it is the float64 product within float32 accumulation's bound;
* a NaN code makes NaN the outputs it enters and no other;
* :class:`~mptex.mlp.FP8Linear` with it records exactly the emulated backend's scaling state
  and agrees on every output and gradient within that bound; :class:`~mptex.MLPTexture3D`
  takes it from ``fp8_gemm`` and names it in ``backends()``.

Compiled for sm_90 (no GPU needed) every GEMM is an FP8 ``wgmma`` and no epilogue multiply-add is
contracted; on a CUDA device the compiled kernels are compared with float64 within the tensor
cores' accumulation bound.
"""

import pytest
import torch
from fp8_mm_triton_interpreted import run_linear
from golden_io import bits
from triton_subprocess import check_compiles, run_cases

import mptex
from mptex.fp8 import ScalingRecipe, triton_gemm_problem
from mptex.mlp import FP8Linear
from mptex.train.config import config_key, validate_config

pytestmark = [pytest.mark.requires_triton, pytest.mark.slow]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN_CODE = {E4M3: 0x7F, E5M2: 0x7E}


def _ints(shape, dtype, seed, high=8):
    """FP8 codes of integers in [-high, high]: every product and partial sum below is exact in
    float32 (at most K * high^2 < 2^24)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high + 1, shape, generator=gen).float().to(dtype)


def _wide(shape, dtype, seed):
    """FP8 codes of values across the format's range, subnormals included."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-9, 6, shape, generator=gen))
    return x.to(dtype)


def _scales(rows, cols, rowwise, seed):
    """Per tensor (scalars) or per row of a and per column of b; not powers of two, so that the
    epilogue's order of roundings shows."""
    gen = torch.Generator().manual_seed(seed)
    if not rowwise:
        return torch.rand((), generator=gen) + 0.1, torch.rand((), generator=gen) * 5 + 0.1
    return (torch.rand(rows, 1, generator=gen) * 4 + 0.1, torch.rand(1, cols, generator=gen) + 0.1)


def _mm_case(name, a, b, rowwise=False, bias=False, split=None, seed=0):
    sa, sb = _scales(a.shape[0], b.shape[1], rowwise, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return dict(
        kind="mm",
        name=name,
        a=a,
        b=b,
        sa=sa,
        sb=sb,
        rowwise=rowwise,
        bias=torch.randn(b.shape[1], generator=gen) if bias else None,
        split_min_k=split and split[0],
        k_chunk=split and split[1],
    )


# Split-K at test sizes: K above 64 splits, in chunks of 128 (the kernel's BLOCK_K).
SPLIT = (64, 128)

EXACT = [
    # forward of a hidden layer: x [M, 32] row-major, W^T a column-major view of [32, 32]
    _mm_case("forward_hidden", _ints((300, 32), E4M3, 1), _ints((32, 32), E4M3, 2).t()),
    # the output layer: N = 9 padded to 16 by masks, with a bias
    _mm_case(
        "forward_output_bias", _ints((257, 32), E4M3, 3), _ints((9, 32), E4M3, 4).t(), bias=True
    ),
    # the input gradient of the output layer: K = 9 padded to 32, E5M2 x E4M3
    _mm_case("input_grad_k9", _ints((300, 9), E5M2, 5), _ints((9, 32), E4M3, 6)),
    # two K steps (200 = 128 + 72 masked), two N tiles (70 = 64 + 6), a column-major a and a
    # b that is every other column of a wider tensor
    _mm_case("k_steps_strided", _ints((200, 100), E4M3, 7).t(), _ints((200, 140), E4M3, 8)[:, ::2]),
    _mm_case(
        "rowwise_bias",
        _ints((130, 32), E4M3, 9),
        _ints((20, 32), E4M3, 10).t(),
        rowwise=True,
        bias=True,
        seed=3,
    ),
    # weight gradients: dY^T [out, N] (a transposed view) x X [N, in], split over N = 1000
    _mm_case(
        "split_weight_grad",
        _ints((1000, 32), E5M2, 11).t(),
        _ints((1000, 32), E4M3, 12),
        split=SPLIT,
    ),
    _mm_case(
        "split_output_layer",
        _ints((1000, 9), E5M2, 13).t(),
        _ints((1000, 32), E4M3, 14),
        split=SPLIT,
    ),
    _mm_case(
        "split_rowwise_bias",
        _ints((1000, 32), E5M2, 15).t(),
        _ints((1000, 70), E4M3, 16),
        rowwise=True,
        bias=True,
        split=SPLIT,
        seed=5,
    ),
    # 71 chunks: more partials than the summing kernel's tile of 64
    _mm_case(
        "split_many", _ints((9000, 16), E5M2, 29).t(), _ints((9000, 8), E4M3, 30), split=SPLIT
    ),
    # one chunk of 128 and a last one of 8
    _mm_case(
        "split_ragged", _ints((136, 16), E5M2, 17).t(), _ints((136, 16), E4M3, 18), split=SPLIT
    ),
    _mm_case("empty_k", _ints((40, 0), E4M3, 19), _ints((0, 24), E4M3, 20), bias=True),
]
BOUNDED = [
    _mm_case("wide_forward", _wide((513, 32), E4M3, 21), _wide((32, 32), E4M3, 22).t(), bias=True),
    _mm_case("wide_input_grad", _wide((513, 32), E5M2, 23), _wide((32, 9), E4M3, 24)),
    _mm_case(
        "wide_split",
        _wide((3000, 32), E5M2, 25).t(),
        _wide((3000, 9), E4M3, 26),
        rowwise=True,
        split=SPLIT,
    ),
    _mm_case("wide_unsplit_long_k", _wide((3000, 32), E5M2, 27).t(), _wide((3000, 9), E4M3, 28)),
]


def _with_nan(case, name, row, col):
    a = case["a"].clone()
    a.view(torch.uint8)[row, col] = NAN_CODE[a.dtype]
    return {**case, "name": name, "a": a, "base": case}


NAN_CASES = [
    _with_nan(EXACT[0], "nan_forward", 5, 3),
    _with_nan(EXACT[5], "nan_split", 7, 400),  # row 7 of dY^T: output row 7
]

LINEAR = [
    dict(
        kind="linear",
        name=f"linear_{recipe}_{'bias' if bias else 'nobias'}",
        dims=(32, 9),
        bias=bias,
        recipe=recipe,
        x=torch.randn(700, 32) * 3,
        r=torch.randn(700, 9),
    )
    for recipe in ("delayed", "current", "rowwise")
    for bias in (False, True)
]
for _i, _case in enumerate(LINEAR):
    torch.manual_seed(_i)
    _case["state"] = FP8Linear(
        *_case["dims"], bias=_case["bias"], recipe=ScalingRecipe(_case["recipe"])
    ).state_dict()

TINY_ENCODER = dict(
    otype="HashGrid",
    n_levels=2,
    n_features_per_level=2,
    log2_hashmap_size=8,
    base_resolution=4,
    per_level_scale=2.0,
)
TEXTURE_KWARGS = dict(
    AABB=[[-1.0] * 3, [1.0] * 3],
    precision="fp8_current",
    internal_dims=32,
    encoder=TINY_ENCODER,
    backend="torch",
)
torch.manual_seed(0)
TEXTURE = dict(
    kind="texture",
    name="texture",
    kwargs=TEXTURE_KWARGS,
    state=mptex.MLPTexture3D(**TEXTURE_KWARGS).state_dict(),
    points=torch.rand(300, 3) * 2 - 1,
    r=torch.randn(300, 3),
)


def _layout_cases():
    """torch._scaled_mm's operand copies: every byte value (every FP8 code, NaNs included) in
    operands row-major and transposed (a strided view), padded in rows, columns or both, to a
    row-major or a column-major output; and no rows; and a width that is a whole number of
    the kernel's 64-byte tiles, over several rows of tiles (the tiles' numbering wraps at
    exactly the column tile count)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(40)
    cases = []
    for i, ((r, c), (rows, cols), transposed, column_major) in enumerate([
        ((5, 3), (16, 16), False, False), ((5, 3), (16, 16), False, True),
        ((40, 32), (48, 32), True, True), ((32, 40), (32, 48), True, False),
        ((70, 9), (70, 16), False, False), ((9, 70), (16, 70), True, True),
        ((130, 65), (144, 80), False, True), ((0, 32), (0, 32), False, False),
        ((3, 200), (3, 208), True, False), ((100, 64), (136, 64), False, False),
    ]):  # fmt: skip
        source = codes[i : i + r * c].reshape((c, r) if transposed else (r, c))
        x = (source.t() if transposed else source).view(torch.float8_e4m3fn if i % 2
                                                        else torch.float8_e5m2)  # fmt: skip
        cases.append(dict(kind="layout", name=f"layout-{i}", x=x, rows=rows, cols=cols,
                          column_major=column_major))  # fmt: skip
    return cases


LAYOUT = _layout_cases()
CASES = EXACT + BOUNDED + NAN_CASES + LINEAR + [TEXTURE] + LAYOUT
assert len({c["name"] for c in CASES}) == len(CASES), "case names must be unique"


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """{case name: kernel result} from one interpreter subprocess."""
    if not mptex.has_triton():
        pytest.skip("needs triton importable")
    folder = tmp_path_factory.mktemp("fp8_mm_triton")
    return run_cases("fp8_mm_triton_interpreted.py", CASES, folder, 900, weights_only=False)


def _epilogue(acc, case):
    """The kernel's epilogue on a float32 accumulator, in torch's float32 ops."""
    if case["rowwise"]:
        out = (acc * case["sa"]) * case["sb"]
    else:
        out = acc * (case["sa"] * case["sb"])
    return out if case["bias"] is None else out + case["bias"]


@pytest.mark.parametrize("case", EXACT, ids=lambda c: c["name"])
def test_exact_sums_bit_for_bit(interpreted, case):
    a, b = case["a"].double(), case["b"].double()
    acc = (a @ b).float()  # exact: integer partial sums below 2^24
    want = _epilogue(acc, case)
    got = interpreted[case["name"]]
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(bits(got), bits(want)), (got - want).abs().max()


def _magnitude(case):
    """The scaled sum of |products| of each output, and |bias| (0 without)."""
    a, b = case["a"].double(), case["b"].double()
    if case["rowwise"]:
        scale = case["sa"].double().abs() * case["sb"].double().abs()
    else:
        scale = (case["sa"] * case["sb"]).double().abs()
    bias = 0 if case["bias"] is None else case["bias"].double().abs()
    return (a.abs() @ b.abs()) * scale, bias


def _bound(case):
    """float32 accumulation in any order: (K + 2) units of 2^-24 of the scaled sum of
    |products|; plus the epilogue's roundings (two products and the bias's add)."""
    magnitude, bias = _magnitude(case)
    return (case["a"].shape[1] + 5) * 2.0**-24 * magnitude + 2.0**-24 * bias


def _reference(case):
    a, b = case["a"].double(), case["b"].double()
    if case["rowwise"]:
        out = (a @ b) * case["sa"].double() * case["sb"].double()
    else:
        out = (a @ b) * (case["sa"] * case["sb"]).double()
    return out if case["bias"] is None else out + case["bias"].double()


@pytest.mark.parametrize("case", BOUNDED, ids=lambda c: c["name"])
def test_any_operands_within_float32_accumulation(interpreted, case):
    got = interpreted[case["name"]].double()
    err = (got - _reference(case)).abs()
    assert (err <= _bound(case)).all(), (err / _bound(case).clamp_min(1e-300)).max()
    assert err.max() > 0 or case["a"].shape[1] < 64, "long wide sums should round somewhere"


@pytest.mark.parametrize("case", NAN_CASES, ids=lambda c: c["name"])
def test_a_nan_reaches_only_the_outputs_it_enters(interpreted, case):
    got = interpreted[case["name"]]
    row = case["a"].float().isnan().any(dim=1)
    assert row.sum() == 1 and got[row].isnan().all()
    base = case["base"]
    want = _epilogue((base["a"].double() @ base["b"].double()).float(), base)
    assert torch.equal(bits(got[~row]), bits(want[~row]))


def _flat(state, prefix=""):
    """A state dict's tensors, nested dicts (the scaling states' extra state) flattened."""
    if torch.is_tensor(state):
        return {prefix: state}
    return {
        k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}{key}.").items()
    }


@pytest.mark.parametrize("case", LINEAR, ids=lambda c: c["name"])
def test_fp8_linear_matches_the_emulated_backend(interpreted, case):
    got_y, got_grads, got_state = interpreted[case["name"]]
    want_y, want_grads, want_state = run_linear(case, "emulated")
    # The quantisations are the same op on the same tensors: the scaling state bit for bit.
    got_flat, want_flat = _flat(got_state), _flat(want_state)
    assert got_flat.keys() == want_flat.keys() and len(want_flat) > 20
    for key, value in want_flat.items():
        assert torch.equal(bits(got_flat[key]), bits(value)), key
    # The GEMMs differ only in the order of float32 sums (K = 32 and 9; 700 rows for the
    # weight gradient, accumulated twice): relative to the largest value.
    for got, want, what in [(got_y, want_y, "y"), *zip(got_grads, want_grads, "xwb")]:
        if want is None:
            assert got is None
            continue
        tol = 4e-5 * want.abs().max().item() if what == "w" else 4e-6 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=what)
    if case["bias"]:  # from the unquantised output gradient, the same ops
        assert torch.equal(bits(got_grads[2]), bits(want_grads[2]))


def test_texture_runs_its_fp8_gemms_where_fp8_gemm_says(interpreted):
    kd, grads, backends = interpreted["texture"]
    assert backends["fp8_gemm"] == "triton"
    texture = mptex.MLPTexture3D(**TEXTURE_KWARGS, fp8_gemm="emulated")
    texture.load_state_dict(TEXTURE["state"])
    want = texture.sample(TEXTURE["points"])
    (want * TEXTURE["r"]).sum().backward()
    assert texture.backends()["fp8_gemm"] == "emulated"
    torch.testing.assert_close(kd, want.detach(), rtol=0, atol=1e-5)
    for name, p in texture.named_parameters():
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-4 * scale, msg=name)


@pytest.mark.parametrize("case", LAYOUT, ids=lambda c: c["name"])
def test_padded_copy_is_the_torch_copy_byte_for_byte(interpreted, case):
    # One launch for what the scaled_mm path did with zeros and a copy: the same bytes and the
    # same layout (row-major, or column-major: the transposed tensor contiguous).
    from mptex.fp8 import _gemm_operand

    got = interpreted[case["name"]]
    x, rows, cols = case["x"], case["rows"], case["cols"]
    want = torch.zeros((cols, rows) if case["column_major"] else (rows, cols), dtype=x.dtype)
    want = want.t() if case["column_major"] else want
    want[: x.shape[0], : x.shape[1]] = x
    assert got.dtype == x.dtype and got.shape == (rows, cols)
    assert got.stride() == want.stride()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if x.shape != (rows, cols):  # without the interpreter: the PyTorch copy, the same bytes
        assert torch.equal(_gemm_operand(x, rows, cols, case["column_major"]).view(torch.uint8),
                           want.view(torch.uint8))  # fmt: skip


def test_padded_copy_takes_one_byte_elements_within_its_output():
    from mptex._fp8_layout_triton import padded_copy

    with pytest.raises(ValueError, match="x: expected a \\[r, c\\] matrix of one-byte"):
        padded_copy(torch.zeros(3, 3), 16, 16, False)
    with pytest.raises(ValueError, match="within \\[2, 16\\]"):
        padded_copy(torch.zeros(3, 3, dtype=torch.uint8), 2, 16, False)


def test_kernels_compile_to_fp8_tensor_core_instructions():
    # The interpreter multiplies the codes' float32 values; compiled for sm_90 (triton's wheel
    # ships ptxas) the GEMMs must be Hopper's FP8 wgmma, and the epilogues uncontracted.
    check_compiles("fp8_mm_triton_interpreted.py", timeout=600)


def test_unusable_backend_fails_at_start_naming_the_key():
    cfg = dict(
        scene={"name": "builtin"},
        precision={"name": "fp8"},
        texture={"fp8_gemm": "triton"},
        train={"device": "cpu"},
    )
    problem = triton_gemm_problem("cpu")  # this process decorated no kernel interpreted
    assert problem is not None and "TRITON_INTERPRET=1" in problem
    with pytest.raises(ValueError, match=r"^texture\.fp8_gemm: 'triton' cannot run on cpu: "):
        validate_config(cfg)
    with pytest.raises(ValueError, match=r"^texture\.fp8_gemm: expected one of \['auto', "):
        validate_config({**cfg, "texture": {"fp8_gemm": "cublas"}})
    # An arm without FP8 GEMMs has nothing for the key to choose.
    validate_config({**cfg, "precision": {"name": "f32"}})
    with pytest.raises(ValueError, match=r"^fp8_gemm: expected one of") as info:
        mptex.MLPTexture3D(TEXTURE_KWARGS["AABB"], precision="fp8", fp8_gemm="cublas")
    assert config_key(str(info.value)).startswith("texture.fp8_gemm: expected one of")


def test_a_checkpoint_trained_on_triton_gemms_evaluates_where_they_cannot_run():
    # texture.fp8_gemm is how a run computed, not what it learned: an export or a rescore on a
    # CPU of a GPU run evaluates the weights with the device's default, and says so.
    from mptex.train.checkpoint import texture_from_checkpoint

    texture = mptex.MLPTexture3D(**TEXTURE_KWARGS)
    config = {"texture": {"encoder": TINY_ENCODER, "backend": "torch", "fp8_gemm": "triton"}}
    ckpt = dict(aabb=TEXTURE_KWARGS["AABB"], config=config, texture=texture.state_dict(),
                precision=TEXTURE_KWARGS["precision"])  # fmt: skip
    with pytest.warns(UserWarning, match=r"texture\.fp8_gemm: the checkpoint's 'triton' cannot"):
        loaded = texture_from_checkpoint(ckpt, "cpu")
    assert loaded.backends()["fp8_gemm"] == "emulated"
    points = TEXTURE["points"][:20]
    assert torch.equal(loaded.sample(points), texture.sample(points))
    with pytest.raises(ValueError, match=r"^fp8_gemm: expected one of"):
        loaded.net.set_fp8_gemm("cublas")


@pytest.mark.requires_cuda
def test_compiled_kernels_within_the_tensor_cores_bound_on_cuda(monkeypatch):
    # On FP8 tensor cores (compute capability 8.9+) against float64: the accumulation bound of
    # torch._scaled_mm's check in the GPU kit (14-bit accumulation within blocks of 128), and no
    # host synchronisation; split-K at the cases' thresholds, as interpreted.
    if triton_gemm_problem("cuda") is not None:
        pytest.skip(triton_gemm_problem("cuda"))
    import mptex._fp8_mm_triton as mm

    defaults = (mm._SPLIT_MIN_K, mm._K_CHUNK)
    for case in EXACT + BOUNDED + NAN_CASES:
        if case["a"].shape[1] == 0:
            continue
        split = (case["split_min_k"], case["k_chunk"]) if case["split_min_k"] else defaults
        monkeypatch.setattr(mm, "_SPLIT_MIN_K", split[0])
        monkeypatch.setattr(mm, "_K_CHUNK", split[1])
        args = [case[k].cuda() for k in ("a", "b", "sa", "sb")]
        bias = None if case["bias"] is None else case["bias"].cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = mm.fp8_mm_triton(*args, bias, case["rowwise"])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got = out.cpu()
        want, k = _reference(case), case["a"].shape[1]
        magnitude, bias = _magnitude(case)
        bound = (min(k, 128) * 2.0**-14 + (k + 5) * 2.0**-24) * magnitude + 2.0**-24 * bias
        finite = ~want.isnan()
        assert torch.equal(got.isnan(), ~finite), case["name"]
        assert ((got.double() - want).abs()[finite] <= bound[finite]).all(), case["name"]
