"""mptex's Triton kernels, read as source: constructs whose arithmetic depends on the Triton
version are not used.

The GPU machines mptex is measured on run torch 2.11, whose Triton is 3.6, while this suite
interprets the kernels with a newer Triton; the kernels must compute the same bits on both.
"""

import ast
from pathlib import Path

import pytest

import mptex

PACKAGE = Path(mptex.__file__).resolve().parent


def _modules():
    """(file, parsed module) for every module of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _kernels():
    """(file, function) for every ``@triton.jit`` function in the package."""
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                yield path, node


def test_the_package_has_triton_kernels_to_read():
    names = {f.name for _, f in _kernels()}
    # the hash grid's, the fused loss's, the FP8 quantisation's and GEMM's kernels
    assert {"_forward_kernel", "_backward_kernel", "_kd_grad_kernel", "_mm_kernel"} <= names


def test_no_kernel_negates_a_value_with_a_unary_minus():
    # Triton up to 3.7 compiles a float's unary minus to 0 - x, which is +0 for x = +0, where
    # torch's neg (a flip of the sign bit) gives -0; from 3.8 it is that flip. A kernel checked
    # bit for bit against torch multiplies by -1 (where its twin does) or flips the sign bit.
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} in {kernel.name}: {ast.unparse(node)}"
        for path, kernel in _kernels()
        for node in ast.walk(kernel)
        if isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and not isinstance(node.operand, ast.Constant)
    ]
    assert not found, found


def _launches():
    """(file, call) for every launch of a Triton kernel in the package: a call of
    ``<name>_kernel[grid](...)``."""
    for path, tree in _modules():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id.endswith("_kernel")
            ):
                yield path, node


# The dicts of launch options that launches spread into their keywords (``**``), each holding
# ``enable_fp_fusion``: the fused loss's (mptex.train._loss_triton), checked below.
_OPTION_SPREADS = ("LAUNCH_OPTIONS", "_options")


def _spread_name(expr: ast.expr) -> str | None:
    """The name spread by ``**expr``: a dict's (``NAME``) or its maker's (``NAME(...)``)."""
    target = expr.func if isinstance(expr, ast.Call) else expr
    return target.id if isinstance(target, ast.Name) else None


def test_every_launch_states_whether_multiply_adds_are_contracted():
    # Triton's default for enable_fp_fusion (contract a * b + c into one rounding) changes from
    # on to off in Triton 3.10, and 3.9 warns at every process's first launch that leaves it
    # unset. A kernel whose bits are compared with a twin must not depend on that default, and
    # a kernel with nothing to contract should not make every CUDA run warn.
    launches = list(_launches())
    assert len(launches) >= 15  # the grid's, the loss's, the FP8 kernels', the level scales'
    unstated = []
    for path, call in launches:
        keywords = {k.arg for k in call.keywords if k.arg is not None}
        spread_names = {_spread_name(k.value) for k in call.keywords if k.arg is None}
        if "enable_fp_fusion" not in keywords and not spread_names & set(_OPTION_SPREADS):
            unstated.append(f"{path.relative_to(PACKAGE.parent)}:{call.lineno} "
                            f"{call.func.value.id}")  # fmt: skip
    assert not unstated, unstated


def test_the_fused_losss_launch_options_turn_contraction_off():
    from mptex.train import _loss_triton

    options = _loss_triton._launch_options()
    if not options:
        pytest.skip("this Triton cannot compile the fused loss (None) or interprets it ({})")
    assert options["enable_fp_fusion"] is False
    assert _loss_triton._options(False)["enable_fp_fusion"] is False
