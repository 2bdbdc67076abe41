"""Run mptex._fp8_mm_triton's kernels on saved cases under Triton's CPU interpreter.

Usage: python tests/fp8_mm_triton_interpreted.py CASES.pt RESULTS.pt
   or: python tests/fp8_mm_triton_interpreted.py --compile-check (compile for sm_90, no GPU)

Run in a subprocess by tests/test_fp8_mm_triton.py: the interpreter is chosen when
``triton.jit`` decorates the kernels, so ``TRITON_INTERPRET=1`` must be in the environment
before the module is first imported, which a fresh process guarantees.

Cases (a list of dicts), by ``kind``:

* ``"mm"``: ``fp8_mm_triton(a, b, scale_a, scale_b, bias, rowwise)`` with the split-K
  thresholds ``_SPLIT_MIN_K`` and ``_K_CHUNK`` set to ``case["split_min_k"]`` and
  ``case["k_chunk"]`` (None: the module's); result: the output;
* ``"linear"``: an :class:`mptex.mlp.FP8Linear` with ``gemm_backend="triton"`` and the recipe
  named ``case["recipe"]``, loaded from ``case["state"]``; two training forwards of
  ``case["x"]``, each followed by a backward of ``(y * case["r"]).sum()``; result: the last
  output, the gradients and the state dict;
* ``"texture"``: an :class:`mptex.MLPTexture3D` built with ``case["kwargs"]`` and
  ``fp8_gemm="triton"``, loaded from ``case["state"]``; one sample of ``case["points"]`` and a
  backward of ``(kd * case["r"]).sum()``; result: the sample, the gradients and ``backends()``;
* ``"layout"``: :func:`mptex._fp8_layout_triton.padded_copy` of ``case["x"]`` to
  ``case["rows"] x case["cols"]`` (``case["column_major"]``); result: the copy.
"""

import re


def compile_check() -> None:
    """Compile the kernels for sm_90 in the variants the MLP runs (E4M3 and E5M2 x E4M3, one
    pass and split-K, per-tensor and row-wise, with and without a bias); exit 3 (skip) if this
    triton has no CUDA backend. Asserts: every GEMM is an FP8 ``wgmma`` of the operands'
    formats (not a conversion to f16 or a float32 loop), its accumulation promoted to float32
    after every ``BLOCK_K`` products, and no float32 multiply-add was contracted in the
    epilogues (the scale's products and the bias's add stay apart)."""
    import triton
    from triton.compiler import ASTSource
    from triton_subprocess import cuda_target

    target = cuda_target(90)
    import mptex._fp8_mm_triton as mm

    assert not mm.INTERPRETED
    types = dict(
        a_ptr="*u8", b_ptr="*u8", out_ptr="*fp32", partial_ptr="*fp32", sa_ptr="*fp32",
        sb_ptr="*fp32", bias_ptr="*fp32",
        **dict.fromkeys(["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
                         "k_chunk", "splits"], "i32"),
    )  # fmt: skip
    aligned = ("a_ptr", "b_ptr", "out_ptr", "partial_ptr", "stride_am", "stride_bk")

    def compiled(kernel, constexprs):
        signature = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]]
                 for a in aligned if a in kernel.arg_names}  # fmt: skip
        return triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
            target=target,
            options={"enable_fp_fusion": False},
        ).asm

    def ptx(kernel, constexprs):
        return compiled(kernel, constexprs)["ptx"]

    def no_contraction(text, what):
        assert not re.search(r"\bfma\.rn(\.ftz)?\.f32\b", text), what

    variants = [  # (BLOCK_M, BLOCK_N, BLOCK_K, a E5M2, SPLIT): the MLP's shapes
        (128, 32, 32, False, False),  # forward, hidden layers
        (128, 16, 32, False, False),  # forward, output layer (N = 3 or 9)
        (128, 32, 32, True, False),  # input gradient (K = 3 or 9 padded to 32, or 32)
        (64, 32, 128, True, True),  # weight gradient, split-K
        (64, 16, 128, True, True),
    ]
    for (bm, bn, bk, a_e5m2, split), rowwise, bias in (
        (v, r, b) for v in variants for r in (False, True) for b in (False, True)
    ):
        what = (bm, bn, bk, a_e5m2, split, rowwise, bias)
        asm = compiled(mm._mm_kernel, dict(
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, A_E5M2=a_e5m2, B_E5M2=False, FP8_DOT=True,
            SPLIT=split, ROWWISE=rowwise, HAS_BIAS=bias,
        ))  # fmt: skip
        text = asm["ptx"]
        # the reduced-precision accumulation is promoted to float32 after every BLOCK_K
        # products (Triton's default on sm_90 never promotes)
        promoted = set(re.findall(r"maxNumImpreciseAcc = (\d+)", asm["ttgir"]))
        assert promoted == {str(bk)}, (what, promoted)
        assert re.search(r"\badd(\.rn)?\.f32\b", text), what
        formats = ("e5m2" if a_e5m2 else "e4m3") + ".e4m3"
        mma = set(re.findall(r"\bwgmma\.mma_async\.[\w.]+", text))
        assert mma and all(m.endswith(f".f32.{formats}") for m in mma), (what, mma)
        assert "mma.sync" not in text and "cvt.rn.f16" not in text, what
        no_contraction(text, what)
        if not split:
            continue
        text = ptx(mm._split_sum_kernel, dict(BLOCK=mm._SUM_BLOCK, SPLIT_TILE=mm._SPLIT_TILE,
                                              ROWWISE=rowwise, HAS_BIAS=bias))  # fmt: skip
        no_contraction(text, ("sum",) + what)
    # the padded copy of torch._scaled_mm's operands: bytes only, row- and column-major output
    import mptex._fp8_layout_triton as layout

    types.update(src_ptr="*u8", dst_ptr="*u8", **dict.fromkeys(
        ["src_rows", "src_cols", "rows", "cols", "stride_sr", "stride_sc", "stride_dr",
         "stride_dc"], "i32"))  # fmt: skip
    for unit in ("stride_dc", "stride_dr"):
        text = ptx(layout._padded_copy_kernel, {"BLOCK": layout._BLOCK, unit: 1})
        assert "ld.global" in text and "st.global" in text, unit
    print("ok")


def run_linear(case: dict, backend: str) -> tuple:
    """A ``"linear"`` case on a GEMM backend: ``(last output, [dL/dx, dL/dW, dL/db or None],
    state dict)``. The test process runs it with the emulated backend for comparison."""
    from mptex.fp8 import ScalingRecipe
    from mptex.mlp import FP8Linear

    recipe = ScalingRecipe(case["recipe"])
    layer = FP8Linear(*case["dims"], bias=case["bias"], recipe=recipe, gemm_backend=backend)
    layer.load_state_dict(case["state"])
    x = case["x"].clone().requires_grad_()
    for _ in range(2):
        y = layer(x)
        (y * case["r"]).sum().backward()
    grads = [x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad]
    return y.detach(), grads, layer.state_dict()


def run_cases(cases_path: str, results_path: str) -> None:
    import torch

    import mptex
    import mptex._fp8_mm_triton as mm

    assert mm.INTERPRETED
    defaults = {"_SPLIT_MIN_K": mm._SPLIT_MIN_K, "_K_CHUNK": mm._K_CHUNK}
    results = {}
    for case in torch.load(cases_path, weights_only=False):  # written by the test
        kind = case["kind"]
        if kind == "mm":
            mm._SPLIT_MIN_K = case.get("split_min_k") or defaults["_SPLIT_MIN_K"]
            mm._K_CHUNK = case.get("k_chunk") or defaults["_K_CHUNK"]
            try:
                results[case["name"]] = mm.fp8_mm_triton(
                    case["a"], case["b"], case["sa"], case["sb"], case["bias"], case["rowwise"]
                )
            finally:
                mm._SPLIT_MIN_K, mm._K_CHUNK = defaults.values()
        elif kind == "linear":
            results[case["name"]] = run_linear(case, "triton")
        elif kind == "layout":
            from mptex._fp8_layout_triton import padded_copy

            # The output allocated full of 0x5a bytes: every byte the copy leaves unwritten
            # shows (fresh memory is often zero, like the padding).
            real_empty = torch.empty

            def poisoned(shape, dtype, device, empty=real_empty):
                return empty(shape, dtype=torch.uint8, device=device).fill_(0x5A).view(dtype)

            torch.empty = poisoned
            try:
                results[case["name"]] = padded_copy(case["x"], case["rows"], case["cols"],
                                                    case["column_major"])  # fmt: skip
            finally:
                torch.empty = real_empty
        else:
            texture = mptex.MLPTexture3D(**case["kwargs"], fp8_gemm="triton")
            texture.load_state_dict(case["state"])
            kd = texture.sample(case["points"])
            (kd * case["r"]).sum().backward()
            grads = {name: p.grad for name, p in texture.named_parameters()}
            results[case["name"]] = (kd.detach(), grads, texture.backends())
    torch.save(results, results_path)


if __name__ == "__main__":
    from triton_subprocess import script_main

    script_main(compile_check, run_cases)
