"""Suite-wide settings and the three test tiers (see tests/README.md).

Codec kernels run eagerly here, since compiling each one costs seconds (``GRADZIP_COMPILE=0``,
inherited by spawned ranks); ``tests/test_fused.py`` turns compilation on and checks every
compiled kernel bit for bit against its eager run.

Every test gets exactly one tier marker: ``unit`` (one process, fast), ``slow`` (one process,
seconds per test), ``dist`` (spawns gloo ranks), ``e2e`` (runs the CLI, or a stand-in, in child
processes) or ``gpu`` (needs CUDA and NCCL: the modules under ``tests/gpu/``, skipped where torch
sees no GPU). A test's tier is the one it is marked
with (on itself, its class or its module's ``pytestmark``). In a module where no test is marked,
every test takes the module's default: ``gpu`` under ``tests/gpu/``, ``e2e`` if the module starts
Python child processes (``subprocess``, ``sys.executable``), ``dist`` if it spawns ranks
(``run_ranks``), else ``unit``.
In a module where some test is marked, an unmarked test is ``unit``. A ``unit`` or ``slow`` test
that starts a process fails with a message naming the marker it needs.
"""

from __future__ import annotations

import multiprocessing.process
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradzip import testing

os.environ.setdefault("GRADZIP_COMPILE", "0")
# One intra-op thread here and in every child: the tensors are small, and with ranks or the CLI's
# workers on the same cores a second thread mostly waits for a core (with other jobs on the machine,
# one test ran 5x slower with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# Ranks fork from one server that imported these once, instead of each rank importing them again
# (seconds per rank): what the test modules that run ranks import, and the trainer's GPT-2.
testing.preload("pytest", "hypothesis", "gradzip.fsdp", "gradzip.lab.train.loop", "transformers.models.gpt2.modeling_gpt2")

TIERS = {
    "unit": "one process, no spawned ranks or CLI runs (the fast tier)",
    "slow": "one process, seconds per test: torch.compile of the codec kernels, the main job's model, long loops",
    "dist": "spawns gloo ranks on this machine (gradzip.testing.run_ranks)",
    "e2e": "runs the gradzip CLI, or a stand-in for it, end to end in child processes",
    "gpu": "needs CUDA and NCCL (tests/gpu/); skipped where torch sees no GPU",
}
_MODULE_DEFAULTS = (("e2e", re.compile(r"\bsubprocess\b|\bsys\.executable\b")), ("dist", re.compile(r"\brun_ranks\b")))
_TIER = pytest.StashKey[str]()
_INDUCTOR_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_inductor")
_GPU_DIR = Path(__file__).resolve().parent / "gpu"


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def _marked_tiers(item: pytest.Item) -> list[str]:
    return list(dict.fromkeys(m.name for m in item.iter_markers() if m.name in TIERS))


def _module_default(path: Path) -> str:
    if _GPU_DIR in Path(path).resolve().parents:
        return "gpu"
    source = path.read_text(encoding="utf-8")
    return next((tier for tier, pattern in _MODULE_DEFAULTS if pattern.search(source)), "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked_modules = {item.path for item in items if _marked_tiers(item)}
    defaults: dict[Path, str] = {}
    for item in items:
        tiers = _marked_tiers(item)
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(tiers)}; a test takes one tier")
        if tiers:
            tier = tiers[0]
        elif item.path in marked_modules:
            tier = "unit"
        else:
            tier = defaults.setdefault(item.path, _module_default(item.path))
        if not tiers:
            item.add_marker(tier)
        item.stash[_TIER] = tier
        if tier == "gpu" and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (tests/gpu run on a GPU machine)"))


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a one-process test (``unit``, ``slow``), starting a Python process (spawned ranks, the
    CLI, a script) fails; a C compiler run (the native loops) and torch.compile's own workers do not."""
    if request.node.stash.get(_TIER, "unit") not in ("unit", "slow"):
        return
    where = request.node.nodeid

    def refuse() -> None:
        if not _compiling():
            raise RuntimeError(f"{where} starts a process: mark it @pytest.mark.dist (ranks) or @pytest.mark.e2e (CLI runs)")

    start = multiprocessing.process.BaseProcess.start
    popen_init = subprocess.Popen.__init__

    def checked_start(self):
        refuse()
        start(self)

    def checked_popen_init(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if argv and os.fspath(argv[0]) == sys.executable:
            refuse()
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", checked_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen_init)


def _compiling() -> bool:
    """Whether torch.compile (inductor, which runs its compile workers as processes) is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_INDUCTOR_DIR):
            return True
        frame = frame.f_back
    return False
