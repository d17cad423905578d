"""The test tiers of conftest.py: a module's default tier, and a unit test cannot start a process."""

from __future__ import annotations

import importlib.util
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest


def _root_conftest():
    # by path: a plain "import conftest" finds whichever conftest.py was imported first (tests/gpu has one)
    spec = importlib.util.spec_from_file_location("_gradzip_root_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ROOT = _root_conftest()
_GPU_DIR, _module_default = _ROOT._GPU_DIR, _ROOT._module_default

# this module mentions subprocess and sys.executable, so without a marker it would be e2e
pytestmark = pytest.mark.unit


def test_a_module_without_markers_takes_the_tier_of_what_it_starts(tmp_path):
    cases = {
        "from gradzip.testing import run_ranks\n": "dist",
        "import subprocess\nfrom gradzip.testing import run_ranks\n": "e2e",
        "cmd = [sys.executable, '-m', 'gradzip']\n": "e2e",
        "import torch\nranks = 2  # run_ranks_like is another name\n": "unit",
    }
    for i, (source, tier) in enumerate(cases.items()):
        path = tmp_path / f"test_{i}.py"
        path.write_text(source)
        assert _module_default(path) == tier, source


def test_modules_under_tests_gpu_take_the_gpu_tier_whatever_they_start():
    # decided by the folder alone (the file is not read)
    assert _module_default(_GPU_DIR / "test_not_written.py") == "gpu"
    assert _module_default(_GPU_DIR.parent / "test_wire.py") == "unit"


def test_a_unit_test_that_starts_a_process_fails_naming_the_marker_it_needs():
    with pytest.raises(RuntimeError, match=r"starts a process: mark it @pytest.mark.dist \(ranks\)"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(RuntimeError, match="starts a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    subprocess.run(["true"], check=True)  # not Python (a compiler, say): allowed
