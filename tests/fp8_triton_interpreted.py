"""Run mptex._fp8_triton's kernels on saved cases under Triton's CPU interpreter.

Usage: python tests/fp8_triton_interpreted.py CASES.pt RESULTS.pt
   or: python tests/fp8_triton_interpreted.py --compile-check (compile for sm_90, no GPU needed)

Run in a subprocess by tests/test_fp8_triton.py: the interpreter is chosen when ``triton.jit``
decorates the kernels, so ``TRITON_INTERPRET=1`` must be in the environment before
``mptex._fp8_triton`` is first imported, which a fresh process guarantees whatever the test
process imported before.

Cases (a list of dicts): ``kind`` "op" runs ``fp8_quantize_triton(*case["args"])`` with
``_MAX_PROGRAMS`` set to ``case["max_programs"]``, ``_ONE_PROGRAM_BLOCKS`` to
``case["one_program_blocks"]`` (0 takes the two launches whatever the size) and
``_TILES_PER_CHUNK`` to ``case["tiles_per_chunk"]`` and ``_STATISTICS_BLOCK`` to
``case["statistics_block"]`` (None: the module's); ``kind`` "probe" runs
the cast alone (``_store_q``, the op's own jitted function) on ``case["x"]`` for
``case["fp8_format"]`` and ``case["q_kind"]``, covering inputs the op never casts (values above
the format's range: the op's scale keeps ``x * used`` within it). Results: ``{name: tuple of
outputs}`` ("op") or ``{name: q}`` ("probe").
"""

import os
import re

import triton.language as tl  # annotations only: no kernel is decorated at import

# The kernels' integer arguments (sizes and counts).
_SIZES = (
    "n n_blocks n_partials hlen rows cols q_cols t_cols row_tiles row_blocks t_row_blocks "
    "chunks tiles_per_chunk n_pairs"
)


def compile_check() -> None:
    """Compile the three kernels for sm_90 in the constexpr variants that matter (formats, q
    kinds, recipes, margin, row-wise layouts); exit 3 (skip) if this triton has no CUDA
    backend. Asserts that every float32 division is ``div.rn.f32`` (no ``div.full`` or
    ``div.approx``), that nothing is flushed to zero (no ``.ftz``), that no multiply-add was
    contracted (no ``fma`` on floats), that no FP8 conversion instruction is used (the cast is
    done on the bits), and the number of divisions of the per-tensor kernel (fp8_max / amax,
    / 2**margin, 1 / used, and the history's fp8_max / reduced and / 2**margin)."""
    import triton
    from triton.compiler import ASTSource
    from triton_subprocess import cuda_target

    target = cuda_target(90)
    import mptex._fp8_triton as fp8_triton

    assert not fp8_triton.INTERPRETED
    q_types = {0: "*u8", 1: "*fp32", 2: "*fp64"}
    types = dict(
        x_ptr="*fp32",
        partial_ptr="*i32",
        scale_ptr="*fp32",
        history_ptr="*fp32",
        scale_inv_ptr="*fp32",
        amax_ptr="*fp32",
        used_ptr="*fp32",
        next_scale_ptr="*fp32",
        next_history_ptr="*fp32",
        stats_ptr="*fp32",
        pairs_ptr="*i32",
        col_partial_ptr="*i32",
        t_scale_inv_ptr="*fp32",
        **dict.fromkeys(_SIZES.split(), "i32"),
        **dict.fromkeys(["stride_xr", "stride_xc", "stride_qr", "stride_qc"], "i32"),
    )

    def build(kernel, constexprs, q_kind=0, aligned=()):
        # the row-wise statistics' pointer: floats from one block of rows, else int32 pairs
        stats = "*i32" if constexprs.get("STATS") == 2 else "*fp32"
        signature = {
            name: "constexpr" if name in constexprs
            else dict(types, q_ptr=q_types[q_kind], q_t_ptr=q_types[q_kind],
                      stats_ptr=stats)[name]
            for name in kernel.arg_names
        }  # fmt: skip
        # what the launcher's specialisation tells the compiler about 16-aligned arguments
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
            target=target,
            options={"enable_fp_fusion": False},
        )
        return compiled.asm["ptx"]

    def check(ptx, what, divisions=None):
        f32_divs = re.findall(r"\bdiv\.[a-z.]*f32\b", ptx)
        assert all(d == "div.rn.f32" for d in f32_divs), (what, sorted(set(f32_divs)))
        assert "div.full" not in ptx and "div.approx" not in ptx, what
        assert "rcp.approx" not in ptx, what
        assert ".ftz" not in ptx, what
        assert not re.search(r"\bfma\.rn\.f(32|64)\b", ptx), what
        assert not re.search(r"\bcvt\.[a-z0-9.]*(e4m3|e5m2)", ptx), what
        if divisions is not None:
            assert len(f32_divs) == divisions, (what, len(f32_divs), divisions)
        return len(f32_divs)

    tile_rows = fp8_triton._ROW_TILE // 32  # a tile 32 columns wide
    ptx = build(fp8_triton._amax_partials_kernel, dict(BLOCK=fp8_triton._BLOCK))
    check(ptx, "partials", divisions=0)
    variants = 0
    for e5m2, q_kind, margin, current, record, most_recent in (
        *((e5m2, q_kind, 2, False, True, False) for e5m2 in (False, True) for q_kind in (0, 1, 2)),
        (False, 0, 2, False, True, True),
        (False, 0, 0, False, True, False),
        (False, 0, 2, False, False, False),
        (True, 1, 2, True, False, False),
        (False, 2, 0, True, False, False),
    ):
        formats = _formats(fp8_triton, e5m2, q_kind, margin)
        constexprs = dict(
            formats,
            CURRENT=current,
            RECORD=record,
            MOST_RECENT=most_recent,
            BLOCK=fp8_triton._BLOCK,
            PARTIALS=fp8_triton._MAX_PROGRAMS,
            HISTORY_BLOCK=fp8_triton._HISTORY_BLOCK,
        )
        # fp8_max / amax and 1 / used; / 2**margin (current); with a record, fp8_max / reduced
        # and its / 2**margin
        want = 2 + (margin != 0) * current + record * (1 + (margin != 0))
        # both ways to the amax: the partials, and the one program's own pass
        for own_amax in (False, True):
            what = ("scale_cast", e5m2, q_kind, margin, current, record, most_recent, own_amax)
            variant = dict(constexprs, OWN_AMAX=own_amax, LAID_OUT=False, HAS_T=False, ROWS=1,
                           COLS=16)  # fmt: skip
            check(build(fp8_triton._scale_cast_kernel, variant, q_kind), what, want)
            # the same scale, cast into the padded row-major q and its transpose (or q alone)
            tiles = dict(LAID_OUT=True, HAS_T=variants % 2 == 0, ROWS=tile_rows, COLS=32)
            what = (*what, "laid out", tiles["HAS_T"])
            check(build(fp8_triton._scale_cast_kernel, dict(variant, **tiles), q_kind), what,
                  want)  # fmt: skip
            variants += 2
    # Row-wise: as the launcher specialises them, a row-major x (unit column strides, the rest
    # divisible by 16), a transposed one, and no specialisation at all. The divisions are per
    # row, repeated where the layout spreads a row over several threads.
    n_div = {}
    for i, (e5m2, q_kind, layout) in enumerate((
        *((e5m2, q_kind, "rows") for e5m2 in (False, True) for q_kind in (0, 1, 2)),
        (False, 0, "columns"),
        (True, 2, "generic"),
    )):  # fmt: skip
        cols = 32
        constexprs = dict(
            _formats(fp8_triton, e5m2, q_kind, 2), ROWS=fp8_triton._ROW_TILE // cols, COLS=cols,
            PARTIALS_BLOCK=fp8_triton._PARTIALS_BLOCK, OWN_AMAX=True, chunks=1, STATS=i % 3,
            PAIRS_BLOCK=fp8_triton._STATISTICS_BLOCK,
        )  # fmt: skip
        aligned = ["x_ptr", "q_ptr", "scale_inv_ptr", "amax_ptr", "used_ptr", "next_scale_ptr"]
        if layout == "rows":
            constexprs.update(stride_xc=1, stride_qc=1)
            aligned += ["rows", "cols", "stride_xr", "stride_qr"]
        elif layout == "columns":
            constexprs.update(stride_xr=1, stride_qr=1)
            aligned += ["rows", "cols", "stride_xc", "stride_qc"]
        what = ("rowwise", e5m2, q_kind, layout)
        n_div[what] = check(build(fp8_triton._rowwise_kernel, constexprs, q_kind, aligned), what)
        variants += 1
    # Long rows, in chunks: the partials kernel (no division) and the cast from the partials, a
    # transposed x (unit row strides) and a row-major one.
    for layout, rows_tile in (("columns", 8), ("rows", 4)):
        cols = fp8_triton._ROW_TILE // rows_tile
        tile = dict(ROWS=rows_tile, COLS=cols)
        unit = dict(stride_xr=1) if layout == "columns" else dict(stride_xc=1)
        check(build(fp8_triton._row_partials_kernel, dict(tile, **unit)), ("partials", layout), 0)
        for stats, (e5m2, q_kind) in enumerate(((False, 0), (True, 1), (False, 2))):
            constexprs = dict(_formats(fp8_triton, e5m2, q_kind, 2), **tile, **unit,
                              PARTIALS_BLOCK=fp8_triton._PARTIALS_BLOCK,
                              OWN_AMAX=False, STATS=stats + (stats == 2),
                              PAIRS_BLOCK=fp8_triton._STATISTICS_BLOCK)  # fmt: skip
            if layout == "columns":
                constexprs.update(stride_qr=1)
            what = ("row chunks", e5m2, q_kind, layout)
            n_div[what] = check(build(fp8_triton._rowwise_kernel, constexprs, q_kind), what)
            variants += 1
    # Both ways at once (rows that fit a tile): one program with the columns' cast, or many
    # storing the column maxima; the statistics as floats, as pairs, or none.
    for i, (e5m2, q_kind, cast_t) in enumerate(((False, 0, True), (True, 1, False),
                                                (False, 2, True), (True, 0, False))):  # fmt: skip
        constexprs = dict(_formats(fp8_triton, e5m2, q_kind, 2), ROWS=tile_rows, COLS=32,
                          STATS=(1 if cast_t else 2) if i < 2 else 0, CAST_T=cast_t)  # fmt: skip
        what = ("rowwise both", e5m2, q_kind, cast_t)
        n_div[what] = check(build(fp8_triton._rowwise_both_kernel, constexprs, q_kind), what)
        variants += 1
    # the statistics' reduction: integer max and min, no float arithmetic
    statistics = dict(BLOCK=fp8_triton._STATISTICS_BLOCK)
    check(build(fp8_triton._row_statistics_kernel, statistics), "row statistics", 0)
    assert all(n >= 3 for n in n_div.values()), n_div
    print(f"compiled {variants} variants and the partials kernel for sm_90; row-wise f32")
    print(f"divisions (all div.rn.f32): {sorted(set(n_div.values()))}")


def _formats(fp8_triton, e5m2, q_kind, margin):
    return dict(
        E5M2=e5m2,
        FMAX=57344.0 if e5m2 else 448.0,
        HAS_MARGIN=margin != 0,
        DIVISOR_BITS=fp8_triton._divisor_bits(margin),
        Q_KIND=q_kind,
    )


_store_q = None  # mptex._fp8_triton's, set by run_cases once TRITON_INTERPRET is set


def _probe(x_ptr, q_ptr, n, E5M2: tl.constexpr, Q_KIND: tl.constexpr):
    """q = the op's cast of x * 1 (``_store_q``), jitted by run_cases under the interpreter."""
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    _store_q(q_ptr + offs, x, tl.full((), 1.0, tl.float32), mask, E5M2, Q_KIND)


def run_cases(cases_path: str, results_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import warnings

    import torch
    import triton

    import mptex._fp8_triton as fp8_triton

    assert fp8_triton.INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"

    global _store_q
    _store_q = fp8_triton._store_q
    probe_kernel = triton.jit(_probe)

    # numpy warns of the divisions by zero and the inf * 0 the C kernel's arithmetic does
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    cases = torch.load(cases_path)
    overrides = (("_MAX_PROGRAMS", "max_programs"), ("_ONE_PROGRAM_BLOCKS", "one_program_blocks"),
                 ("_TILES_PER_CHUNK", "tiles_per_chunk"),
                 ("_STATISTICS_BLOCK", "statistics_block"))  # fmt: skip
    defaults = {attr: getattr(fp8_triton, attr) for attr, _ in overrides}
    results = {}
    for case in cases:
        if case["kind"] == "probe":
            x = case["x"]
            q_dtype = {0: torch.uint8, 1: torch.float32, 2: torch.float64}[case["q_kind"]]
            q = torch.empty_like(x, dtype=q_dtype)
            probe_kernel[(triton.cdiv(x.numel(), 1024),)](
                x, q, x.numel(), E5M2=bool(case["fp8_format"]), Q_KIND=case["q_kind"]
            )
            results[case["name"]] = q
            continue
        for attr, key in overrides:
            value = case.get(key)
            setattr(fp8_triton, attr, defaults[attr] if value is None else value)
        try:
            results[case["name"]] = fp8_triton.fp8_quantize_triton(*case["args"])
        finally:
            for attr, value in defaults.items():
                setattr(fp8_triton, attr, value)
    torch.save(results, results_path)


if __name__ == "__main__":
    from triton_subprocess import script_main

    script_main(compile_check, run_cases)
