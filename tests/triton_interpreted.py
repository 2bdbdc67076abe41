"""Run HashGridEncoding(backend="triton") on saved cases under Triton's CPU interpreter.

Usage: python tests/triton_interpreted.py CASES.pt RESULTS.pt
   or: python tests/triton_interpreted.py --compile-check (compile for sm_80, no GPU needed)

Run in a subprocess by tests/test_encoding_triton.py: the interpreter is chosen when
``triton.jit`` decorates the kernels, so ``TRITON_INTERPRET=1`` must be in the environment
before ``mptex._grid_triton`` is first imported, which a fresh process guarantees whatever the
test process imported before. Each case: ``name``, ``n_dims``, ``kwargs`` (constructor),
``dtype``, ``x`` [N, D], ``params``, ``v`` [N, L * F] (the cotangent), ``want_x``. Each result:
``out``, ``grad_x`` (None unless ``want_x``), ``grad_params``.
"""

import os

# Pointer and scalar types of the kernels' arguments, by name.
ARG_TYPES = {
    "x_ptr": "*fp32",
    "params_ptr": "*fp32",
    "out_ptr": "*fp32",
    "grad_out_ptr": "*fp32",
    "grad_params_ptr": "*fp32",
    "d_pos_ptr": "*fp32",
    "scales_ptr": "*fp32",
    "hashed_ptr": "*i32",
    "sizes_ptr": "*i64",
    "offsets_ptr": "*i64",
    "strides_ptr": "*i64",
    "n_points": "i32",
    "n_levels": "i32",
}


def compile_check() -> None:
    """Compile forward and backward for sm_80 in a few variants; exit 3 (skip) if this triton
    has no CUDA backend. Asserts that the forward PTX has exactly the fmas written out (the D
    positions, and the corner fmas outside half mode): no multiply-add was contracted; and
    that the level-scale kernel is one ex2.approx.ftz.f32."""
    import triton
    from triton.compiler import ASTSource
    from triton_subprocess import cuda_target

    target = cuda_target(80)
    import mptex._ex2_cuda as _ex2_cuda
    import mptex._grid_triton as grid_triton

    assert not grid_triton.INTERPRETED
    out_types = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16"}
    for n_dims, interp, mode in ((3, 2, "f16"), (2, 0, "f16"), (4, 1, "f32"), (3, 1, "bf16")):
        half, bf16 = mode == "f16", mode == "bf16"
        constants = dict(
            N_DIMS=n_dims, N_FEATURES=2, INTERP=interp, HALF=half, BF16=bf16, BLOCK=128
        )
        for kernel, extra in (
            (grid_triton._forward_kernel, {}),
            (grid_triton._backward_kernel, dict(WANT_PARAMS=True, WANT_X=True)),
        ):
            consts = {**constants, **extra}
            types = dict(ARG_TYPES, out_ptr=out_types[mode])
            signature = {
                name: "constexpr" if name in consts else types[name] for name in kernel.arg_names
            }
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=signature, constexprs=consts),
                target=target,
                options={"enable_fp_fusion": False},
            )
            if kernel is grid_triton._forward_kernel:
                # the D position fmas, plus tcnn's one fma per corner and feature in float32
                # and bfloat16 mode (half mode's is emulated in float32 adds)
                corner_fmas = 0 if half or interp == 0 else 2**n_dims * 2
                fmas = compiled.asm["ptx"].count("fma.rn")
                assert fmas == n_dims + corner_fmas, (n_dims, interp, mode, fmas)
    # the level scales' exp2f: exactly one ex2.approx.ftz.f32, tcnn's fast-math instruction
    compiled = triton.compile(
        ASTSource(
            fn=_ex2_cuda._ex2_kernel,
            signature={"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
            constexprs={"BLOCK": 128},
        ),
        target=target,
    )
    assert compiled.asm["ptx"].count("ex2.approx.ftz.f32") == 1, "ex2.approx.ftz.f32 expected"


def run_cases(cases_path: str, results_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import mptex._grid_triton as grid_triton
    from mptex import HashGridEncoding

    assert grid_triton.INTERPRETED, "TRITON_INTERPRET=1 did not select the interpreter"
    cases = torch.load(cases_path)
    results = {}
    for case in cases:
        enc = HashGridEncoding(
            case["n_dims"], backend="triton", dtype=case["dtype"], **case["kwargs"]
        )
        with torch.no_grad():
            enc.params.copy_(case["params"])
        x = case["x"].clone().requires_grad_(case["want_x"])
        out = enc(x)
        inputs = (x, enc.params) if case["want_x"] else (enc.params,)
        grads = torch.autograd.grad((out.float() * case["v"]).sum(), inputs)
        results[case["name"]] = dict(
            out=out.detach(),
            grad_x=grads[0] if case["want_x"] else None,
            grad_params=grads[-1],
        )
    torch.save(results, results_path)


if __name__ == "__main__":
    from triton_subprocess import script_main

    script_main(compile_check, run_cases)
