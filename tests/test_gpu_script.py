"""The CPU side of ``benchmarks/gpu/run.sh``, run in CI where no GPU is: the script's syntax and
plan, the measuring script's arguments and a whole run of it on the CPU (gloo, tiny sizes) whose
JSON ``gradzip simulate`` reads. (tests/gpu themselves are collected with the suite and skipped
without a GPU: ``tests/conftest.py``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from gradzip.lab.simulate.exchange import Method
from gradzip.lab.simulate.gpu_speeds import load_results, measured_speeds
from gradzip.lab.simulate.presets import H100_SXM

ROOT = Path(__file__).resolve().parent.parent
RUN_SH = ROOT / "benchmarks" / "gpu" / "run.sh"
MEASURE = ROOT / "benchmarks" / "gpu" / "measure.py"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, **kwargs)


def test_run_sh_parses_and_plans_within_its_budget(tmp_path):
    assert _run(["bash", "-n", str(RUN_SH)]).returncode == 0
    plan = _run(["bash", str(RUN_SH), "--dry-run"], env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "BUDGET_S": "470"})
    assert plan.returncode == 0, plan.stderr
    assert f"writes into: {tmp_path}" in plan.stdout
    assert "-m pytest tests/gpu" in plan.stdout and "benchmarks/gpu/measure.py --out" in plan.stdout
    assert not any(tmp_path.iterdir()), "a dry run wrote files"
    assert _run(["bash", str(RUN_SH), "--bogus"]).returncode == 2


def test_measure_checks_its_arguments_and_runs_on_the_cpu(tmp_path):
    assert _run([sys.executable, str(MEASURE), "--help"]).returncode == 0
    bad = _run([sys.executable, str(MEASURE), "--dtypes", "fp8"])
    assert bad.returncode == 2 and "--dtypes" in bad.stderr
    done = _run([sys.executable, str(MEASURE), "--check", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    [(path, data)] = load_results([tmp_path])
    assert (tmp_path / "cpu-check.md").exists() and path.name == "cpu-check.json"
    specs = {r["spec"] for r in data["codecs"]}
    assert {"topk", "qsgd", "powersgd", "separate", "uniform:rounding=stochastic"} <= specs
    assert {h["hook"] for h in data["hooks"]} >= {"torch:noop", "torch:allreduce", "torch:fp16", "torch:powersgd:rank=4", "gradzip:none"}
    speeds = measured_speeds([Method("topk:ratio=0.01"), Method("powersgd:approx_rank=4")], H100_SXM, torch.float32, [(path, data)])
    assert set(speeds) == {"topk:ratio=0.01", "powersgd:approx_rank=4"}
