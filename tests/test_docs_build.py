"""The documentation site builds with ``mkdocs build --strict``: every page in the nav exists,
every relative link and anchor resolves, the API reference renders from the docstrings and the
codec table is generated from the registry."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs and mkdocstrings[python] are not installed (the docs extra)",
)
def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    codecs = (site / "codecs" / "index.html").read_text()
    from gradzip.compressors import REGISTRY

    assert all(f"<code>{name}</code>" in codecs for name in REGISTRY)
