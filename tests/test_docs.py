"""The docs site builds with ``mkdocs build --strict``: every page in the nav exists, every
relative link and anchor resolves, and the API reference's docstrings parse."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="needs the docs extra (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="needs the docs extra (pip install -e '.[docs]')")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    for page in ("index.html", "getting-started/index.html", "api/index.html",
                 "archive/index.html", "gpu/index.html"):  # fmt: skip
        assert (site / page).is_file(), page
    api = (site / "api" / "index.html").read_text()
    for name in ("MLPTexture3D", "HashGridEncoding", "FullyFusedMLP", "PrecisionPolicy"):
        assert f'id="mptex.{name}"' in api, name


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: its text without Markdown (code spans keep
    their text, links their label), lower-cased, every character that is not a letter, digit,
    underscore, hyphen or space dropped, and each space (not each run of spaces) made a hyphen.
    mkdocs collapses runs of spaces and hyphens into one, so ``a -m b`` is ``a--m-b`` on GitHub
    and ``a-m-b`` on the docs site."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(c for c in text.strip().lower() if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def _headings(page: Path) -> set[str]:
    """The GitHub anchors of ``page``'s headings (outside fenced code), a repeated one with
    GitHub's ``-1``, ``-2`` suffixes."""
    slugs: list[str] = []
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _github_slug(match.group(1))
            repeats = sum(s == slug or re.fullmatch(re.escape(slug) + r"-\d+", s) is not None
                          for s in slugs)  # fmt: skip
            slugs.append(f"{slug}-{repeats}" if repeats else slug)
    return set(slugs)


def test_every_anchor_link_resolves_on_github_too():
    # mkdocs --strict checks the anchors under the docs site's slugs; the same pages are read
    # on GitHub, whose slugs differ for some headings (runs of spaces and hyphens, non-ASCII
    # letters). A link must land on its heading in both places.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.is_file() or anchor not in _headings(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, broken
    assert _github_slug("Default ablation (`mptex-train -m +experiment=quick`)") == (
        "default-ablation-mptex-train--m-experimentquick"  # two hyphens: " -m"
    )
