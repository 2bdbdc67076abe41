"""The docs site builds with ``mkdocs build --strict``: every page in the nav exists, every
relative link and anchor resolves, and the API reference's docstrings parse."""

import os
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
