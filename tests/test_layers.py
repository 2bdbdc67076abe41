"""The package's layers: imports point down only, and no two modules import each other.

Layers, bottom up (pyproject.toml's ``[tool.importlinter]`` states them for import-linter):
core (the grid, the network and their twins, precision, the texture, small shared modules) <
render, scenes < train < bake, search, diagnostics < report < cli.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pyproject_toml import pyproject

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_layers_contract():
    pytest.importorskip("importlinter", reason="needs import-linter (the test extra)")
    code = "import sys, importlinter.cli as c; sys.exit(c.lint_imports(no_cache=True))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout


def _cycles(graph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                imported = graph.find_modules_directly_imported_by(child) & modules
                work.append((child, iter(sorted(imported))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_no_import_cycles_between_modules():
    grimp = pytest.importorskip("grimp", reason="needs import-linter (the test extra)")
    graph = grimp.build_graph("mptex", exclude_type_checking_imports=True)
    # A package's __init__ re-exporting its modules is not a cycle with them: count modules only.
    modules = {
        m for m in graph.modules if not (ROOT / m.replace(".", "/") / "__init__.py").is_file()
    }
    assert _cycles(graph, modules) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    class Graph:
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, module):
            return set(self.edges.get(module, ()))

    assert _cycles(Graph(), {"a", "b", "c", "d"}) == [["a", "b", "c"]]


def test_every_module_is_in_a_layer():
    # A module that no layer names is not checked by the contract: new ones must be placed.
    config = pyproject()["tool"]["importlinter"]
    (contract,) = config["contracts"]
    placed = {name.strip() for layer in contract["layers"] for name in re.split(r"[|:]", layer)}
    top = {p.stem for p in (ROOT / "mptex").glob("*.py") if p.stem != "__init__"}
    top |= {p.parent.name for p in (ROOT / "mptex").glob("*/__init__.py")}
    assert sorted(top - placed) == []


def _benchmark_imports(source: str, benchmark_modules: set[str]) -> list[str]:
    """Imports of benchmarks/ scripts in a test's source: ``import x`` / ``from x import``
    of a script's module name, or a spec loaded from a path under benchmarks/."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in benchmark_modules]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in benchmark_modules | {"benchmarks"}:
                found.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
            "spec_from_file_location", "run_path", "import_module",
        ):  # fmt: skip
            if "benchmarks" in ast.unparse(node) or any(
                f'"{name}"' in ast.unparse(node) for name in benchmark_modules
            ):
                found.append(ast.unparse(node))
    return found


def test_no_test_imports_a_benchmark_script():
    # Benchmarks are scripts users run; tests run them as such (a subprocess), and what a test
    # needs to import lives in the package.
    bench = {p.stem for p in (ROOT / "benchmarks").rglob("*.py")} | {"benchmarks"}
    offenders = {
        path.name: hits
        for path in sorted((ROOT / "tests").glob("*.py"))
        if (hits := _benchmark_imports(path.read_text(), bench))
    }
    assert not offenders, offenders


def test_the_benchmark_import_finder_finds_planted_imports():
    bench = {"cpu_speed", "fit_arms", "benchmarks"}
    planted = (
        "import cpu_speed\nfrom fit_arms import fit\nfrom benchmarks.gpu import validate\n"
        "import importlib.util\n"
        "s = importlib.util.spec_from_file_location('m', ROOT / 'benchmarks' / 'x.py')\n"
    )
    assert len(_benchmark_imports(planted, bench)) == 4
    assert _benchmark_imports("import mptex\nfrom pathlib import Path\n", bench) == []
