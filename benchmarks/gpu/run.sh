#!/usr/bin/env bash
# gradzip on one GPU: tests/gpu, then codec and hook speed (benchmarks/gpu/measure.py).
#
#   bash benchmarks/gpu/run.sh             # on a machine with a CUDA GPU and only this working tree
#   bash benchmarks/gpu/run.sh --dry-run   # print what would run, with its time limits, and stop
#
# Writes into $OUT when it is set, else benchmarks/results/gpu/: <device>.json and <device>.md
# (measure.py), tests.log and run.log. Meant to finish in 8 minutes on a bare H200 machine,
# installs included: the phases share BUDGET_S (default 470 s); each gets a timeout from what is
# left, and the benchmark cuts its own repeats short before its timeout (results are written
# after each section, so a run cut short keeps what it measured).
#
# Python: $PYTHON (default python3). gradzip runs from this checkout through PYTHONPATH, with no
# install (its only needs are torch and numpy). Where that Python has no CUDA-enabled torch, it
# tries `pip install torch==2.13.0` (the default PyPI wheel on Linux x86-64 is CUDA-enabled)
# and pytest; on a machine that reaches no package index it uses what is there, and says so.
# Exit status: 0 when the tests passed and the benchmark wrote its table.

set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEST="${OUT:-$ROOT/benchmarks/results/gpu}"
BUDGET_S="${BUDGET_S:-470}"
START_S=$SECONDS
DRY_RUN=0

case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (takes --dry-run or --help)" >&2; exit 2 ;;
esac

left() { echo $((BUDGET_S - (SECONDS - START_S))); }
say() { echo "[run.sh $((SECONDS - START_S))s] $*"; }

# Each phase's time limit, from what is left of the budget.
test_limit() { local t=$(( $(left) - 200 )); (( t > 270 )) && t=270; (( t < 60 )) && t=60; echo "$t"; }
bench_limit() { local t=$(( $(left) - 10 )); (( t < 60 )) && t=60; echo "$t"; }

TEST_CMD=("$PY" -m pytest tests/gpu -q -p no:cacheprovider -rfEs)
# The benchmark stops starting new repeats before its timeout: of its time less a margin for
# start-up, 60% to the codecs and the rest to the hooks.
set_bench_cmd() {
    local limit=$1
    BENCH_CMD=("$PY" benchmarks/gpu/measure.py --out "$DEST"
               --codec-budget-s $(( (limit - 40) * 6 / 10 )) --hook-budget-s $(( (limit - 40) * 4 / 10 )))
}

if (( DRY_RUN )); then
    set_bench_cmd "$(bench_limit)"
    echo "writes into: $DEST"
    echo "python: $PY (needs torch with CUDA; installs torch==2.13.0 and pytest where missing and reachable)"
    echo "tests (timeout $(test_limit) s): ${TEST_CMD[*]}"
    echo "benchmark (timeout: what the tests leave, at most $(bench_limit) s): ${BENCH_CMD[*]}"
    exit 0
fi

mkdir -p "$DEST"
exec > >(tee -a "$DEST/run.log") 2>&1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# One cache for the test run and the benchmark: kernels compiled by one are loaded by the other.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/gradzip-inductor}"

has_cuda_torch() { "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

say "checkout $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '(not a git checkout)'), budget ${BUDGET_S} s"
command -v nvidia-smi >/dev/null && nvidia-smi -L
if ! has_cuda_torch; then
    say "no CUDA-enabled torch in $PY: pip install torch==2.13.0 numpy pytest"
    timeout 240 "$PY" -m pip install --quiet "torch==2.13.0" numpy pytest || say "pip install failed (no package index reachable?)"
fi
if ! has_cuda_torch; then
    say "no CUDA-enabled torch and no GPU it can see: nothing to measure"
    exit 2
fi
"$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")'
if ! "$PY" -c 'import numpy' 2>/dev/null; then
    timeout 120 "$PY" -m pip install --quiet numpy || { say "numpy missing and not installable"; exit 2; }
fi
TESTS_OK=1
if ! "$PY" -c 'import pytest' 2>/dev/null; then
    timeout 120 "$PY" -m pip install --quiet pytest || say "pytest missing and not installable: tests/gpu not run"
fi

if "$PY" -c 'import pytest' 2>/dev/null; then
    limit=$(test_limit)
    say "tests/gpu (timeout ${limit} s)"
    timeout "$limit" "${TEST_CMD[@]}" 2>&1 | tee "$DEST/tests.log"
    status=${PIPESTATUS[0]}
    (( status == 0 )) || { TESTS_OK=0; say "tests/gpu: exit status $status (124: timed out)"; }
else
    TESTS_OK=0
fi

limit=$(bench_limit)
set_bench_cmd "$limit"
say "benchmark (timeout ${limit} s)"
timeout "$limit" "${BENCH_CMD[@]}"
BENCH=$?
(( BENCH == 0 )) || say "benchmark: exit status $BENCH (124: timed out; the JSON holds what was measured)"
say "done: tests $([ $TESTS_OK = 1 ] && echo passed || echo FAILED), benchmark exit $BENCH; files in $DEST"
(( TESTS_OK == 1 && BENCH == 0 ))
