"""mptex's Triton kernels, read as source: constructs whose arithmetic depends on the Triton
version are not used.

The GPU machines mptex is measured on run torch 2.11, whose Triton is 3.6, while this suite
interprets the kernels with a newer Triton; the kernels must compute the same bits on both.
"""

import ast
from pathlib import Path

import mptex

PACKAGE = Path(mptex.__file__).resolve().parent


def _kernels():
    """(file, function) for every ``@triton.jit`` function in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
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
