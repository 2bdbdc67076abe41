"""The README's and the docs' examples run as written.

Every fenced block tagged ``bash``, ``sh`` or ``python`` in README.md and in the docs pages
(``docs/**/*.md``) is an example and carries a marker on the line before it (blank lines between
are allowed):

* ``<!-- runnable -->``: run by :func:`test_runnable_block_runs`, in reading order (README.md,
  then the docs pages in the order of mkdocs.yml's nav, then pages outside the nav), in one
  temporary directory (a reader follows the pages in order, so a later block may use an earlier
  block's output: the export guide exports the run the training page made);
* ``<!-- not runnable: <reason> -->``: not run (it installs packages, needs a GPU or a
  cluster, ...); the reason is required.

Blocks without a language tag are transcripts of output and are not examples.

The runnable blocks run against this checkout: ``mptex-train``, ``mptex-report``,
``mptex-check`` and ``mptex-export`` on ``PATH`` are shims that run this checkout's code, and
every ``mptex-train`` call gets :data:`SMALL` (every ``mptex-export`` call
:data:`SMALL_EXPORT`), replacing the same keys the command sets, so that each command
finishes in seconds: the test checks that the command as written composes, runs and exits 0,
not the numbers it would give at full size (the pages state those sizes and times).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _nav_pages(node) -> list[str]:
    """The pages of mkdocs.yml's nav, in order."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return [p for item in node for p in _nav_pages(item)]


def pages() -> list[Path]:
    """README.md, the docs pages in nav order, then the pages outside the nav, sorted."""
    import yaml

    nav = [
        ROOT / "docs" / p
        for p in _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    ]
    rest = sorted(set((ROOT / "docs").rglob("*.md")) - set(nav))
    # a nav entry without its file is tests/test_docs.py's failure (mkdocs build --strict)
    return [README, *(p for p in nav if p.is_file()), *rest]


# Appended to every mptex-train call of a runnable block (a key the command also sets is
# replaced): few iterations, small views, one seed.
SMALL = [
    "train.iterations=2",
    "train.val_interval=1",
    "train.n_val_images=1",
    "train.threads=1",
    "train.seed=0",
    "scene.resolution=24",
    "scene.n_train_views=2",
    "scene.n_val_views=1",
    "export.resolution=256",
]
# Appended to every mptex-export call (flags written ``--flag=value`` in the README are replaced).
SMALL_EXPORT = ["--resolution=256"]

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(runnable|not runnable:\s*(?P<reason>.*\S))\s*-->$")
_LANGUAGES = ("bash", "sh", "python")


def readme_blocks(text: str) -> list[dict]:
    """Fenced example blocks of a Markdown text: language, code, line number, marker, reason.

    Returns:
        one dict per block tagged with a language of ``_LANGUAGES``: ``lang``, ``code``,
        ``line`` (1-based line of the opening fence), ``marker`` (``"runnable"``,
        ``"not runnable"`` or None when the line before is no marker) and ``reason``.
    """
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        lang, start = match.group(1), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        i = end + 1
        if lang not in _LANGUAGES:
            continue
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = _MARKER.match(lines[prev].strip()) if prev >= 0 else None
        kind = None if marker is None else marker.group(1).split(":")[0]
        blocks.append(dict(lang=lang, code="\n".join(lines[start + 1 : end]), line=start + 1,
                           marker=kind, reason=marker and marker.group("reason")))  # fmt: skip
    return blocks


_SHIM = """#!{python}
import sys
sys.path.insert(0, {root!r})
args = sys.argv[1:]
if {small!r}:
    keys = {{o.split("=", 1)[0] for o in {small!r}}}
    args = [a for a in args if a.split("=", 1)[0].lstrip("+") not in keys] + {small!r}
sys.argv = [{name!r}, *args]
from {module} import {function}
sys.exit({function}())
"""
_COMMANDS = {
    "mptex-train": ("mptex.cli.train", "train_main", SMALL),
    "mptex-search": ("mptex.cli.search", "search_main", SMALL),
    "mptex-report": ("mptex.cli.report", "report_main", []),
    "mptex-rescore": ("mptex.cli.rescore", "rescore_main", []),
    "mptex-check": ("mptex.cli.check", "check_main", []),
    "mptex-export": ("mptex.cli.export", "export_main", SMALL_EXPORT),
}


def _shims(bin_dir: Path) -> None:
    bin_dir.mkdir()
    # A script, not a symlink: a venv's python run through a link elsewhere finds no
    # pyvenv.cfg beside it and starts as the base interpreter, without the venv's packages.
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    for name, (module, function, small) in _COMMANDS.items():
        path = bin_dir / name
        path.write_text(_SHIM.format(python=sys.executable, root=str(ROOT), small=small,
                                     name=name, module=module, function=function))  # fmt: skip
        path.chmod(0o755)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_block_is_marked(page):
    blocks = readme_blocks(page.read_text())
    unmarked = [b["line"] for b in blocks if b["marker"] is None]
    assert not unmarked, f"{page.name} blocks without a runnable / not runnable marker: {unmarked}"


def test_the_readme_has_runnable_examples_and_stays_short():
    blocks = readme_blocks(README.read_text())
    assert len(blocks) >= 5 and any(b["marker"] == "runnable" for b in blocks)
    assert len(README.read_text().splitlines()) <= 200  # a front page; depth lives in docs/


def test_marker_parsing_on_a_hand_made_text():
    text = "\n".join([
        "<!-- runnable -->", "```bash", "echo a", "```",
        "<!-- not runnable: needs a GPU (19 min on a CPU) -->", "", "```python", "1/0", "```",
        "```", "transcript", "```",
        "```bash", "echo unmarked", "```",
    ])  # fmt: skip
    blocks = readme_blocks(text)
    assert [(b["lang"], b["marker"], b["reason"]) for b in blocks] == [
        ("bash", "runnable", None),
        ("python", "not runnable", "needs a GPU (19 min on a CPU)"),
        ("bash", None, None),
    ]
    assert blocks[0]["code"] == "echo a" and blocks[2]["line"] == 13


_RUNNABLE = [
    {**b, "page": page}
    for page in pages()
    for b in readme_blocks(page.read_text())
    if b["marker"] == "runnable"
]


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory):
    """One working directory and environment shared by the runnable blocks, in README order."""
    root = tmp_path_factory.mktemp("readme")
    _shims(root / "bin")
    work = root / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}  # fmt: skip
    return work, env


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", _RUNNABLE, ids=[f"{b['page'].relative_to(ROOT)}:{b['line']}" for b in _RUNNABLE]
)
def test_runnable_block_runs(block, readme_env):
    work, env = readme_env
    if block["lang"] == "python":
        command = [sys.executable, "-c", block["code"]]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block["code"]]
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    if result.returncode != 0:
        output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        pytest.fail(f"{block['page'].name} block at line {block['line']} failed "
                    f"(exit {result.returncode}):"
                    f"\n{block['code']}\n{output}")  # fmt: skip


@pytest.mark.slow
def test_the_examples_leave_a_checkout_clean(readme_env):
    # Runs after every runnable block (pytest keeps the file's order): what they wrote must be
    # what a checkout's .gitignore ignores (outputs/, multirun/), so that a reader who follows
    # the pages inside a checkout finds `git status` clean.
    work, env = readme_env
    if not any(work.iterdir()):
        pytest.skip("no runnable block ran in this session (run the whole file)")
    shutil.copy(ROOT / ".gitignore", work / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert [line for line in status if not line.endswith(".gitignore")] == []
