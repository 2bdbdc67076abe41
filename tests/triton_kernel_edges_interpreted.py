"""Run the grid encoding's and the training loss's Triton kernels on saved edge cases under
Triton's CPU interpreter, for tests/test_triton_kernel_edges.py.

Usage: python tests/triton_kernel_edges_interpreted.py CASES.pt RESULTS.pt
   or: python tests/triton_kernel_edges_interpreted.py --compile-check (sm_80, no GPU needed)

Run in a fresh process (``TRITON_INTERPRET=1`` must be set before the kernels' modules are
first imported). Each case is a dict with ``name`` and ``kind``:

- ``"grid"``: ``n_dims``, ``kwargs`` (HashGridEncoding's), ``dtype``, ``x``, ``params``, ``v``
  (the cotangent), ``want_x``, ``want_params``: the encoding with ``backend="triton"``; result
  ``out``, ``grad_x`` and ``grad_params`` (None where not wanted), and ``x`` and ``params`` as
  they are after the backward;
- ``"grid_call"``: ``x``, ``params``, ``geometry`` (``grid_geometry``'s positional arguments)
  and ``out_dtype``: ``hash_grid_encode_triton`` itself;
- ``"loss_call"`` and ``"kd_call"``: ``function`` (a name in ``mptex.train._loss_triton``) and
  ``args``.

A call that raises gives ``{"error": "<type>: <message>"}`` instead of its results.
"""

import os


def compile_check() -> None:
    """Compile the grid's forward and backward for sm_80 (not interpreted); exit 3 (skip) if
    this triton has no CUDA backend. Asserts that each level's cells are converted from the
    floored positions through a signed 64-bit integer (``cvt.rzi.s64.f32``, then the low 32
    bits), never straight to uint32: PTX's ``cvt.rzi.u32.f32`` saturates a negative value to 0,
    where tcnn's ``(uint32_t)(int)floorf`` wraps it to 2^32 - k (points below 0 would read
    other cells on a GPU than under the interpreter, which wraps either way)."""
    import re

    import triton
    from triton.compiler import ASTSource
    from triton_interpreted import ARG_TYPES
    from triton_subprocess import cuda_target

    target = cuda_target(80)
    import mptex._grid_triton as grid_triton

    assert not grid_triton.INTERPRETED
    constants = dict(N_DIMS=3, N_FEATURES=2, INTERP=1, HALF=False, BF16=False, BLOCK=128)
    for kernel, extra in (
        (grid_triton._forward_kernel, {}),
        (grid_triton._backward_kernel, dict(WANT_PARAMS=True, WANT_X=True)),
    ):
        consts = {**constants, **extra}
        signature = {n: "constexpr" if n in consts else ARG_TYPES[n] for n in kernel.arg_names}
        ptx = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=consts),
            target=target,
            options={"enable_fp_fusion": False},
        ).asm["ptx"]
        conversions = set(re.findall(r"cvt\.rzi\.[a-z0-9]+\.f32", ptx))
        assert conversions == {"cvt.rzi.s64.f32"}, (kernel.fn.__name__, conversions)
    print("ok")


def _grid(case):
    import torch

    from mptex import HashGridEncoding

    enc = HashGridEncoding(case["n_dims"], backend="triton", dtype=case["dtype"], **case["kwargs"])
    with torch.no_grad():
        enc.params.copy_(case["params"])
    enc.params.requires_grad_(case["want_params"])
    x = case["x"].clone().requires_grad_(case["want_x"])
    out = enc(x)
    inputs = [t for t, wanted in ((x, case["want_x"]), (enc.params, case["want_params"])) if wanted]
    grads = torch.autograd.grad((out.float() * case["v"]).sum(), inputs) if inputs else ()
    grads = list(grads)
    return dict(
        out=out.detach(),
        grad_x=grads.pop(0) if case["want_x"] else None,
        grad_params=grads.pop(0) if case["want_params"] else None,
        x=x.detach().clone(),
        params=enc.params.detach().clone(),
    )


def _grid_call(case):
    from mptex._grid_torch import grid_geometry
    from mptex._grid_triton import hash_grid_encode_triton

    geometry = grid_geometry(*case["geometry"])
    out = hash_grid_encode_triton(case["x"], case["params"], geometry, case["out_dtype"])
    return dict(out=out.detach())


def _call(case):
    import mptex.train._loss_triton as lt

    return dict(value=getattr(lt, case["function"])(*case["args"]))


def run_cases(cases_path: str, results_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import warnings

    import torch

    import mptex._grid_triton as grid_triton
    import mptex.train._loss_triton as loss_triton

    assert grid_triton.INTERPRETED and loss_triton.INTERPRETED, "not interpreted"
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy on NaN inputs
    run = {"grid": _grid, "grid_call": _grid_call, "loss_call": _call, "kd_call": _call}
    results = {}
    for case in torch.load(cases_path):
        try:
            results[case["name"]] = run[case["kind"]](case)
        except Exception as exc:  # the error a caller would see, for the tests to compare
            results[case["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, results_path)


if __name__ == "__main__":
    from triton_subprocess import script_main

    script_main(compile_check, run_cases)
