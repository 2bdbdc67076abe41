"""mptex as a wheel: it lists every package, ships its configs, and runs from any folder."""

import importlib
import json
import os
import re
import site as site_module
import subprocess
import sys
from pathlib import Path

import pytest
from pyproject_toml import pyproject

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_and_maps_the_configs():
    setuptools = pyproject()["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mptex").rglob("__init__.py")
    }
    listed = set(setuptools["packages"])
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == {"mptex.configs", "mptex.experiments"}
    assert setuptools["package-dir"] == {
        "mptex.configs": "configs",
        "mptex.experiments": "experiments",
    }
    # every config file is matched by the package-data globs (at most two folders deep)
    deepest = max(
        len(p.relative_to(ROOT / "configs").parts) for p in ROOT.glob("configs/**/*.yaml")
    )
    assert deepest <= 3


def test_config_dirs_of_a_checkout_are_beside_the_package():
    from mptex._paths import CONFIG_DIR, EXPERIMENTS_DIR

    assert CONFIG_DIR == ROOT / "configs" and EXPERIMENTS_DIR == ROOT / "experiments"


@pytest.mark.slow
def test_a_wheel_install_runs_the_main_job_from_an_empty_folder(tmp_path):
    # Build the wheel, install it (alone: its dependencies come from this environment) into a
    # fresh venv, and run the quick experiment, at test size, from a folder that is not the
    # checkout: the configs and experiments must come from inside the installed package.
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("mptex-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python, train = venv / "bin" / "python", venv / "bin" / "mptex-train"
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if sys.prefix != sys.base_prefix:
        # Run from a venv, --system-site-packages gives the new one its base interpreter's
        # packages, not this environment's: a .pth adds those, after the venv's own.
        (site / "site-packages" / "_this_environment.pth").write_text(
            "\n".join(site_module.getsitepackages()) + "\n"
        )
    env = {**os.environ, "OMP_WAIT_POLICY": "passive", "PYTHONPATH": ""}
    # --force-reinstall: pip skips a wheel whose version it finds installed already, and an
    # mptex of this version is visible from the new venv where this environment has the
    # checkout installed editable (or the build's mptex.egg-info is on the PYTHONPATH).
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--force-reinstall", str(wheel)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    empty = tmp_path / "empty"
    empty.mkdir()
    where = subprocess.run(
        [str(python), "-c", "import mptex, mptex._paths as p; print(mptex.__file__); "
         "print(p.CONFIG_DIR); print(p.EXPERIMENTS_DIR)"],
        cwd=empty, env=env, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert [Path(p) for p in where] == [
        site / "site-packages" / "mptex" / "__init__.py",
        site / "site-packages" / "mptex" / "configs",
        site / "site-packages" / "mptex" / "experiments",
    ]
    small = ["precision=f32", "train.seed=0", "train.iterations=2", "train.val_interval=1",
             "train.n_val_images=1", "scene.resolution=24", "scene.n_train_views=2",
             "scene.n_val_views=1", "hydra.sweep.dir=sweep"]  # fmt: skip
    run = subprocess.run([str(train), "-m", "+experiment=quick", *small], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = (empty / "sweep").glob("*/metrics.json")
    assert json.loads(metrics.read_text())["status"] == "completed"
    assert (empty / "sweep" / "report.md").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["sweep"]  # nothing else written here


# re's parser module (3.11 on), where the newer syntax has opcodes of its own.
_RE_PARSER = getattr(re, "_parser", None)
_NEEDS_PARSER = pytest.mark.skipif(
    _RE_PARSER is None, reason="Python 3.10's re has no possessive repeats or atomic groups to find"
)


def _newer_regex_syntax(parsed) -> set[str]:
    """The opcodes of ``re._parser``'s parse tree that Python 3.10's ``re`` cannot compile:
    possessive repeats (``a++``, ``a?+``) and atomic groups (``(?>...)``), new in 3.11."""
    from re import _constants as c

    newer = {c.POSSESSIVE_REPEAT: "possessive repeat", c.ATOMIC_GROUP: "atomic group"}
    found = set()
    for op, arg in parsed:
        if op in newer:
            found.add(newer[op])
        for item in arg if isinstance(arg, (tuple, list)) else ():
            if isinstance(item, _RE_PARSER.SubPattern):
                found |= _newer_regex_syntax(item)
            elif isinstance(item, (tuple, list)):  # a branch's alternatives
                for sub in item:
                    if isinstance(sub, _RE_PARSER.SubPattern):
                        found |= _newer_regex_syntax(sub)
    return found


@_NEEDS_PARSER
def test_the_newer_regex_syntax_is_found():
    assert _newer_regex_syntax(_RE_PARSER.parse(r"x(?:a[0-9]++|b?+)c")) == {"possessive repeat"}
    assert _newer_regex_syntax(_RE_PARSER.parse(r"(?>ab|c)*")) == {"atomic group"}
    assert _newer_regex_syntax(_RE_PARSER.parse(r"(?P<v>(?:v[ \t]+[-+.0-9eE]+\r?\n)+)")) == set()


@_NEEDS_PARSER
def test_no_module_level_regex_needs_a_newer_python_than_the_package_declares():
    # pyproject declares Python >= 3.10; a pattern compiled at import with 3.11's syntax would
    # make the module fail to import there ("multiple repeat").
    import mptex

    root = Path(mptex.__file__).parent
    offenders = {}
    for path in sorted(root.rglob("*.py")):
        if path.name == "__main__.py":  # runs the command line
            continue
        module = importlib.import_module(
            ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        )
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern) and isinstance(value.pattern, str):
                found = _newer_regex_syntax(_RE_PARSER.parse(value.pattern, value.flags))
                if found:
                    offenders[f"{module.__name__}.{name}"] = sorted(found)
    assert offenders == {}
