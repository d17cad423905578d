"""Every edge refuses hostile input before work starts (issue 23): numbers out of range, sizes that
would allocate the world, damaged checkpoint pointers, impossible backends.

The library raises ``ValueError`` naming the parameter; the CLI (called in process, with worker
start-up replaced by an exception, so nothing trains) exits 2 with one line on stderr; buffers
follow the tensor, not a parameter (allocations measured with the profiler).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from gradzip.comm.routes import REGISTRY as ROUTES
from gradzip.comm.traffic import chunk_size_counts, chunk_sizes
from gradzip.compressors import SpecError, build, parse_spec
from gradzip.compressors.spec import parse_value
from gradzip.compressors.values import MAX_INT, check_int, check_number
from gradzip.lab.cli import main
from gradzip.lab.simulate.exchange import twophase_exchange
from gradzip.lab.train import launch
from gradzip.lab.train.checkpoint import find_checkpoint, save_checkpoint

SMALL = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
NINES = "9" * 400
ROOT = Path(__file__).resolve().parents[1]

# --- numbers in specs ----------------------------------------------------------------------------

#: every numeric codec parameter, with a value in range (the rest of the spec stays valid)
NUMERIC_PARAMS = [
    ("topk", "ratio"), ("dgc", "ratio"), ("dgc", "seed"), ("randomk", "ratio"), ("randomk", "seed"),
    ("threshold", "tau"), ("threshold", "max_ratio"), ("terngrad", "clip"), ("terngrad", "seed"),
    ("uniform", "bits"), ("uniform", "group"), ("uniform", "seed"), ("qsgd", "bits"), ("qsgd", "bucket"),
    ("qsgd", "seed"), ("signsgd", "group"), ("efsignsgd", "group"), ("natural", "seed"),
    ("powersgd", "approx_rank"), ("powersgd", "start_step"), ("powersgd", "seed"), ("topk", "start_step"),
]  # fmt: skip


@pytest.mark.parametrize("name, key", NUMERIC_PARAMS)
@pytest.mark.parametrize("value", [NINES, "-" + NINES, "1e400", "-1e400", "nan", "inf", "-inf"], ids=["huge", "-huge", "1e400", "-1e400", "nan", "inf", "-inf"])
def test_huge_and_non_finite_values_name_the_parameter(name, key, value):
    with pytest.raises(ValueError, match=key) as info:
        build(f"{name}:{key}={value}")
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    assert any(mark in message for mark in ("[", "(", ">=", "one of")), message  # the allowed range


def test_huge_ints_name_their_range_instead_of_overflowing():
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        build(f"topk:ratio={NINES}")
    with pytest.raises(ValueError, match=r"clip must be a finite number in \[0, 1.79769e\+308\]"):
        build(f"terngrad:clip={NINES}")
    with pytest.raises(ValueError, match=rf"group must be an integer in \[1, {MAX_INT}\]"):
        build(f"uniform:group={NINES}")
    assert check_int(MAX_INT, name="n", low=0) == MAX_INT
    assert check_number(10**300, name="x", low=0) == 1e300


@pytest.mark.parametrize("value", ["١", "٤", "８", "٠.٥", "²", "1_0", "0x8"])
def test_spec_values_in_other_digits_are_refused(value):
    with pytest.raises(SpecError if not value.isascii() else ValueError, match="bits"):
        build(f"uniform:bits={value}")


def test_spec_numbers_are_ascii_decimal():
    assert parse_value("8") == 8 and parse_value("-3") == -3 and parse_value("0.5") == 0.5 and parse_value("1e-3") == 1e-3
    for text in ("nan", "inf", "-inf", "Infinity", "1_000", "0x10", " 1", "1.5.2"):
        assert isinstance(parse_value(text), str), text
    with pytest.raises(SpecError, match="bits"):
        parse_spec("uniform:bits=١")


HOSTILE_VALUES = st.one_of(
    st.sampled_from([NINES, "-" + NINES, "1e400", "1e-400", "4.9e-324", "nan", "inf", "-inf", "-1", "0", "-0.0",
                     "", "١", "٣٢", "６４", "1_0", "0x10", "true", "1e308", str(2**63), str(2**63 - 1)]),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.floats().map(repr),
)  # fmt: skip


@st.composite
def hostile_specs(draw) -> tuple[str, list[str]]:
    """A spec of one or two ``+``-joined codecs whose numeric parameters hold hostile values,
    some keys given twice; and the keys it holds."""
    parts, keys = [], []
    for _ in range(draw(st.integers(1, 2))):
        name, key = draw(st.sampled_from(NUMERIC_PARAMS))
        items = [f"{key}={draw(HOSTILE_VALUES)}" for _ in range(draw(st.integers(1, 2)))]
        parts.append(f"{name}:{','.join(items)}")
        keys.append(key)
    return "+".join(parts), keys


@SMALL
@given(hostile_specs())
def test_hostile_specs_build_or_name_a_parameter(case):
    spec, keys = case
    try:
        codec = build(spec)
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message, message
        # The parameter is named; or the spec is refused whole (too long, a part that cannot be composed).
        whole = ("composition", "compose", "longer than")
        assert any(key in message for key in keys) or any(w in message for w in whole), (spec, message)
        return
    if codec.multi_round:
        return
    x = torch.linspace(-3, 3, 512)
    payload = codec.compress(x, step=1, key=0)
    # a few times the raw bytes at most: uniform:group=1 sends 9 bytes an element (a code byte, an
    # fp32 scale and offset), and Top-K at ratio 1 before it adds an index to each
    assert payload.nbytes == codec.payload_nbytes(x.numel(), x.dtype) <= 4 * x.numel() * 4 + 64
    assert codec.decompress(payload, like=x).shape == x.shape


# --- memory follows the tensor -----------------------------------------------------------------


def _largest_allocation(fn) -> int:
    """The most bytes any one operator of ``fn()`` allocated on the CPU (profiler's account)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((event.cpu_memory_usage for event in prof.events()), default=0)


@pytest.mark.parametrize(
    "huge, clamped",
    [
        ("uniform:group=1000000000000", "uniform:group=512"),
        ("uniform:bits=4,group=1000000000,rounding=stochastic", "uniform:bits=4,group=512,rounding=stochastic"),
        ("qsgd:bucket=1099511627776", "qsgd:bucket=512"),
        ("qsgd:bits=2,bucket=1000000000,norm=l2", "qsgd:bits=2,bucket=512,norm=l2"),
        ("signsgd:group=1000000000", "signsgd:group=512"),
        ("efsignsgd:group=1000000000", "efsignsgd:group=512"),
        ("topk:ratio=0.5+uniform:group=1000000000", "topk:ratio=0.5+uniform:group=256"),
    ],
)
def test_group_parameters_are_clamped_to_the_tensor(huge, clamped):
    x = torch.randn(512, generator=torch.Generator().manual_seed(0))
    big, small = build(huge), build(clamped)
    payload = big.compress(x, step=3, key=1)
    # The formula uses the clamp the codec uses: the bytes are those of one group of 512.
    assert payload.nbytes == big.payload_nbytes(512) == small.payload_nbytes(512)
    assert [t.shape for t in payload.tensors] == [t.shape for t in small.compress(x, step=3, key=1).tensors]
    decoded = big.decompress(payload, like=x)
    torch.testing.assert_close(decoded, small.decompress(small.compress(x, step=3, key=1), like=x), rtol=0, atol=0)
    # No operator allocates more than a few copies of the 2 KiB tensor (a padded group of
    # 10**9 codes would be gigabytes).
    assert _largest_allocation(lambda: big.decompress(big.compress(x, step=3, key=1), like=x)) <= 16 * x.numel() * 4


def test_payload_formula_clamps_for_any_size():
    for numel in (0, 1, 31, 32, 33, 511, 512, 513):
        for spec in ("uniform:group=1000000000000", "qsgd:bucket=1099511627776", "signsgd:group=1000000000"):
            codec = build(spec)
            x = torch.randn(numel)
            assert codec.compress(x).nbytes == codec.payload_nbytes(numel), (spec, numel)


# --- the command line, in process ---------------------------------------------------------------


class WouldSpawn(Exception):
    """Raised instead of starting workers: the arguments passed every check."""


def _run(argv: list[str]) -> tuple[int | None, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


def _assert_one_line_exit_2(argv: list[str], *needles: str) -> str:
    code, err = _run(argv)
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.startswith("gradzip: error: "), (argv, err)
    for needle in needles:
        assert needle in err, (argv, needle, err)
    return err


@pytest.fixture
def no_workers(tmp_path, monkeypatch):
    """A scratch folder as the working directory; starting workers fails the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "spawn_workers", mock.Mock(side_effect=WouldSpawn))
    monkeypatch.setattr(launch, "under_torchrun", lambda: False)
    return tmp_path


@pytest.mark.parametrize(
    "spec, key",
    [("topk:ratio=", "ratio"), ("dgc:ratio=", "ratio"), ("randomk:ratio=", "ratio"), ("terngrad:clip=", "clip"),
     ("threshold:tau=", "tau"), ("threshold:max_ratio=", "max_ratio")],
)  # fmt: skip
def test_huge_spec_values_are_one_line_in_every_command(no_workers, spec, key):
    spec += NINES
    _assert_one_line_exit_2(["train", "--compressor", spec, "--out", "run"], key)
    _assert_one_line_exit_2(["simulate", "--compressors", spec, "--no-plot", "--out", "sim"], key)
    _assert_one_line_exit_2(["compare", "--compressors", spec, "--network", "loopback", "--out", "cmp"], key)
    _assert_one_line_exit_2(["bench", "--codecs", spec], key)


@pytest.mark.parametrize("spec, why", [("topk:ratio=1.5", "ratio must be in (0, 1]"), ("topkk", "unknown compressor 'topkk'")])
def test_a_bad_entry_of_a_list_option_is_named_with_its_option(no_workers, spec, why):
    _assert_one_line_exit_2(["simulate", "--compressors", f"none,{spec}", "--no-plot", "--out", "sim"],
                            f"--compressors entry '{spec}': {why}")
    _assert_one_line_exit_2(["compare", "--compressors", f"none,{spec}", "--network", "loopback", "--out", "cmp"],
                            f"--compressors entry '{spec}': {why}")
    _assert_one_line_exit_2(["compare", "--compressors", f"local-adamw+{spec}", "--network", "loopback", "--out", "cmp"],
                            f"--compressors entry 'local-adamw+{spec}': {why}")
    _assert_one_line_exit_2(["bench", "--codecs", f"none,{spec}"], f"--codecs entry '{spec}': {why}")


@pytest.mark.parametrize("command", [["train", "--out", "run"], ["compare", "--network", "loopback", "--out", "cmp"]])
@pytest.mark.parametrize("lr, shown", [("1e39", "1e+39"), ("10.5", "10.5")])
def test_a_learning_rate_no_fp32_step_survives_is_refused_before_workers(no_workers, command, lr, shown):
    # 1e39 is a finite Python float that fp32 cannot hold: the workers failed converting it
    _assert_one_line_exit_2([*command, "--lr", lr], "--lr must be a number in (0, 10]", f"got {shown}")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr, start", [(io.StringIO, ""), (_Terminal, "\n")])
def test_an_interrupt_is_said_on_a_line_of_its_own(no_workers, monkeypatch, stderr, start):
    # on a terminal, the progress bar's line has no newline yet: the message must not join it
    launch.spawn_workers.side_effect = KeyboardInterrupt
    err = stderr()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--steps", "2", "--out", "run"])
    assert (code, err.getvalue()) == (130, f"{start}gradzip: interrupted\n")


def test_spec_with_other_digits_is_one_line(no_workers):
    _assert_one_line_exit_2(["train", "--compressor", "uniform:bits=١", "--out", "run"], "bits")


def test_train_backend_without_cuda_is_refused_before_workers(no_workers, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _assert_one_line_exit_2(["train", "--backend", "nccl", "--out", "run"], "--backend nccl", "CUDA")
    # CUDA present but fewer GPUs than local workers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    _assert_one_line_exit_2(["train", "--backend", "nccl", "--world-size", "2", "--out", "run"], "1 GPUs visible")
    launch.spawn_workers.assert_not_called()


@pytest.mark.parametrize("out", ["/proc/gz", "/proc/gz/deeper", "file.txt"])
def test_train_out_that_cannot_be_written_is_refused_before_workers(no_workers, out):
    (no_workers / "file.txt").write_text("x")
    _assert_one_line_exit_2(["train", "--out", out], "--out")
    launch.spawn_workers.assert_not_called()


def test_train_options_nothing_reads_are_warned_about_after_all_checks(no_workers, monkeypatch):
    from helpers.tiny_run import write_corpus

    data = write_corpus(no_workers / "corpus.txt", n_lines=300)
    monkeypatch.setenv("GRADZIP_CACHE", str(no_workers / "cache"))
    argv = ["train", "--data", data, "--vocab-size", "300", "--seq-len", "32", "--out", "run",
            "--compressor", "fp16", "--auto-max-error", "0.3", "--monitor-every", "0", "--norm-warn", "0.5"]  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(WouldSpawn):
        main(argv)
    assert err.getvalue().splitlines() == [
        "gradzip: warning: --auto-max-error has no effect without --compressor auto",
        "gradzip: warning: --norm-warn has no effect without --monitor-every above 0",
    ]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--price-per-gpu-hour", "nan"], "--price-per-gpu-hour"),
        (["--price-per-gpu-hour", "-1"], "--price-per-gpu-hour"),
        (["--bandwidth", "fast"], "bandwidth"),
        (["--bandwidth", "100mbit"], "--bandwidth applies only with --calibrate"),
        (["--link-efficiency", "nan"], "--link-efficiency"),
        (["--link-efficiency", "0.9"], "--link-efficiency applies only with --calibrate"),
        (["--latency-us", "-1"], "--latency-us"),
        (["--latency-us", "5"], "--latency-us applies only with --calibrate"),
        (["--gpus", str(10**30)], "--gpus must be an integer in [1, 9007199254740992]"),
        (["--gpus", "0"], "--gpus"),
        (["--sweep", "8," + NINES], "--sweep"),
        (["--gpus", "٨"], "--gpus"),
        (["--mfu", "inf"], "--mfu"),
        (["--compute-s", "0"], "--compute-s"),
        (["--tokens-per-gpu", "-" + NINES], "--tokens-per-gpu"),
        (["--out", "/proc/gz"], "--out"),
        (["--codec-gbps", "inf"], "codec-gbps"),
        (["--codec-gbps", "fp16=١"], "codec-gbps"),
        (["--calibrate", "runs", "--gpus", "8"], "--gpus applies only without --calibrate"),
        (["--calibrate", "runs", "--no-plot", "--model", "gpt2"], "--model, --no-plot apply only without --calibrate"),
    ],
)
def test_simulate_options_are_checked_before_any_work(no_workers, argv, needle):
    _assert_one_line_exit_2(["simulate", *([] if "--calibrate" in argv else ["--no-plot"]), *argv], needle)


def test_two_phase_chunks_are_counted_arithmetically():
    for numel in (0, 1, 7, 1000):
        for p in (1, 2, 3, 8, 1001):
            assert chunk_size_counts(numel, p) == dict(Counter(chunk_sizes(numel, p)))
    codec = build("efsignsgd")
    # 2**53 GPUs: a tuple per GPU could not be built at all; the counts take two entries.
    cost = ROUTES["twophase"].cost(codec.payload_nbytes, 10**9, torch.float32, 2**53)
    total = cost.payload_bytes
    # 10**9 one-element chunks: each worker encodes the bucket and its own one-element chunk again
    assert total == 10**9 * codec.payload_nbytes(1) and cost.encode_bytes == (10**9 + 1) * 4
    assert twophase_exchange(codec.payload_nbytes, 10**9, torch.float32, 2**53).payload_bytes == total


def test_simulate_answers_for_the_largest_cluster_it_takes(no_workers):
    code, err = _run(["simulate", "--gpus", str(2**53), "--no-plot", "--json", "--out", "sim", "--compressors", "none,fp16,efsignsgd"])
    assert code == 0, err


# --- hostile values for each command's numeric options ------------------------------------------

#: text that is no integer option's valid value, whatever the option
BAD_INTS = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "", " ", "١", "٣٢", "６４", "1_0", "0x10", "1.5", "1e3", "-" + NINES, "--"]),
    st.integers(max_value=-1).map(str),
    st.text(alphabet="٠١٢٣٤٥٦٧٨٩", min_size=1, max_size=5),
)  # fmt: skip
#: text that is no float option's valid value
BAD_FLOATS = st.one_of(
    st.sampled_from(["nan", "-nan", "inf", "-inf", "Infinity", "1e400", "-1e400", "", "١.٥", "1_0.5", "0x1p3", NINES + "e9"]),
    st.floats(max_value=-1e-300).map(repr),
    st.just("nan").map(lambda s: s.upper()),
)  # fmt: skip

#: each command's numeric options (the ones every BAD_* value is invalid for)
NUMERIC_OPTIONS = {
    "train": {
        int: ["--world-size", "--steps", "--batch-size", "--seq-len", "--warmup-steps", "--seed", "--vocab-size",
              "--n-layer", "--n-embd", "--n-head", "--eval-every", "--eval-batches", "--min-compress-bytes", "--threads",
              "--checkpoint-every", "--keep-checkpoints", "--monitor-every", "--verify-every", "--norm-warn-checks",
              "--adapt-every"],
        float: ["--lr", "--weight-decay", "--bucket-cap-mb", "--timeout-s", "--norm-warn", "--auto-max-error"],
    },
    "simulate": {
        int: ["--gpus", "--tokens-per-gpu"],
        float: ["--mfu", "--compute-s", "--bucket-cap-mb", "--price-per-gpu-hour", "--latency-us"],
    },
    "compare": {
        int: ["--world-size", "--steps", "--seed", "--batch-size", "--seq-len", "--eval-every", "--n-layer"],
        float: ["--target-loss", "--timeout-s", "--collective-timeout-s", "--lr", "--bucket-cap-mb"],
    },
    "bench": {int: ["--repeats", "--threads"], float: ["--size-mb"]},
}  # fmt: skip


@st.composite
def hostile_command_lines(draw) -> list[str]:
    command = draw(st.sampled_from(sorted(NUMERIC_OPTIONS)))
    kind = draw(st.sampled_from([int, float]))
    option = draw(st.sampled_from(NUMERIC_OPTIONS[command][kind]))
    value = draw(BAD_INTS if kind is int else BAD_FLOATS)
    extra = {"train": ["--out", "run"], "simulate": ["--no-plot", "--out", "sim"], "compare": ["--network", "loopback", "--out", "cmp"], "bench": []}
    return [command, *extra[command], f"{option}={value}"]


@SMALL
@given(argv=hostile_command_lines())
def test_hostile_numeric_options_exit_2_with_one_line(no_workers, argv):
    code, err = _run(argv)
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.startswith("gradzip: error: "), (argv, err)
    option = argv[-1].split("=", 1)[0]
    assert option in err or option.lstrip("-").replace("-", "_") in err, (argv, err)


# --- the checkpoint pointer ---------------------------------------------------------------------


def _two_checkpoints(out: Path) -> tuple[Path, Path]:
    def save(step: int) -> Path:
        return save_checkpoint(out, step, shared={"step": step}, per_rank={"s": torch.arange(10)}, rank=0, world_size=1)

    return save(2), save(4)


@pytest.mark.parametrize(
    "damage, note",
    [
        (b"\xff\xfe\x00step", "latest: not UTF-8 text"),
        (b"garbage", "latest: names 'garbage', not a step-N folder"),
        (b"../../step-000004", "not a step-N folder"),
        (b"step-\xd9\xa4", "not a step-N folder"),  # step-٤
        (b"", "not a step-N folder"),
        (b"step-000009\n", "step-000009: is missing"),
    ],
)
def test_damaged_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path, damage, note):
    _older, newest = _two_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_bytes(damage)
    folder, notes = find_checkpoint(tmp_path)
    assert folder == newest
    assert len(notes) == 1 and note in notes[0], notes


def test_latest_naming_a_corrupt_folder_falls_back_with_one_note(tmp_path):
    older, newest = _two_checkpoints(tmp_path)
    (newest / "shared.pt").write_bytes(b"not a checkpoint")
    assert find_checkpoint(tmp_path) == (older, ["step-000004: shared.pt has 16 of its " + _size_of(older) + " bytes"])


def _size_of(folder: Path) -> str:
    import json

    return str(json.loads((folder / "complete.json").read_text())["files"]["shared.pt"]["bytes"])


def test_unreadable_latest_falls_back(tmp_path):
    _older, newest = _two_checkpoints(tmp_path)
    latest = tmp_path / "checkpoints" / "latest"
    latest.unlink()
    latest.mkdir()  # a folder where the pointer file should be
    folder, notes = find_checkpoint(tmp_path)
    assert folder == newest and len(notes) == 1 and notes[0].startswith("latest: cannot be read"), notes


# --- end to end, in a subprocess ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--compressor", f"topk:ratio={NINES}", "--out", "run"], "ratio must be in (0, 1]"),
        (["simulate", "--gpus", str(10**30), "--no-plot", "--out", "sim"], "--gpus must be an integer in"),
    ],
)
def test_end_to_end_one_line_and_exit_2(tmp_path, argv, needle):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "gradzip", *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "argv, needles",
    [(["--compressor", "radius:ratio=0"], ["--compressor radius:ratio=0", "ratio"]),
     (["--outer", "diloco:sync_every=4", "--outer-compressor", "radius:ratio=0"], ["--outer-compressor radius:ratio=0", "ratio"]),
     (["--outer", "diloco:sync_every=4", "--outer-compressor", "topk:ratio=0.01,warmup_steps=5"], ["--outer-compressor", "warmup_steps"]),
     (["--outer", ""], ["--outer must be diloco:sync_every=H"]),
     (["--compressor", "separate:embeddings=int4"], ["--compressor separate:embeddings=int4", "embeddings must be one of"]),
     (["--fsdp", "--compressor", "separate:embeddings=int8"], ["embeddings act on DDP buckets", "--fsdp"]),
     (["--optimizer", "local-adamw", "--compressor", "topk:embeddings=int8"], ["local-adamw", "embeddings="]),
     (["--outer", "diloco:sync_every=4", "--outer-compressor", "topk:embeddings=int8"], ["--outer-compressor", "embeddings"]),
     (["--optimizer", "demo:compression_topk=0"], ["--optimizer demo:compression_topk=0: compression_topk"]),
     (["--optimizer", "tsr-adam:approx_rank=0"], ["--optimizer tsr-adam:approx_rank=0: approx_rank"]),
     (["--optimizer", ""], ["--optimizer must be one of", "got ''"]),
     (["--compressor", "auto", "--auto-candidates", "fp16;bogus"], ["--auto-candidates: 'bogus'", "unknown compressor"]),
     (["--compressor", "auto", "--auto-candidates", "topk:ratio=5"], ["--auto-candidates: 'topk:ratio=5'", "ratio"]),
     (["--compressor", "auto", "--auto-candidates", "fp16;radius"], ["--auto-candidates take powersgd", "radius"])],
)  # fmt: skip
def test_codec_errors_name_the_option_they_came_from(no_workers, argv, needles):
    _assert_one_line_exit_2(["train", *argv, "--out", "run"], *needles)


def test_unknown_parameter_lists_each_accepted_name_once():
    with pytest.raises(SpecError) as info:
        build("radius:foo=1")
    accepted = str(info.value).split("it takes ")[1].split(", ")
    assert "start_step" in accepted and len(accepted) == len(set(accepted)), str(info.value)


def test_an_outer_cycle_longer_than_the_run_is_warned_about(no_workers, monkeypatch):
    from helpers.tiny_run import write_corpus

    data = write_corpus(no_workers / "corpus.txt", n_lines=300)
    monkeypatch.setenv("GRADZIP_CACHE", str(no_workers / "cache"))
    argv = ["train", "--data", data, "--vocab-size", "300", "--seq-len", "32", "--out", "run", "--steps", "5",
            "--outer", "diloco:sync_every=6"]  # fmt: skip
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(WouldSpawn):
        main(argv)
    assert err.getvalue().splitlines() == [
        "gradzip: warning: --outer: sync_every=6 is more than --steps 5: the replicas never exchange (each trains alone)"
    ]


def test_an_abbreviated_option_is_refused_not_read_as_another(no_workers):
    # compare has --compressors; argparse's abbreviations once read --compressor as it
    _assert_one_line_exit_2(["compare", "--compressors", "fp16", "--compressor", "topk:ratio=0.1", "--out", "run"],
                            "unrecognized arguments: --compressor")
    _assert_one_line_exit_2(["train", "--world", "2", "--out", "run"], "unrecognized arguments: --world")


@pytest.mark.parametrize("value", ["no", "False", 1, 0.0])
def test_error_feedback_that_is_not_a_bool_is_refused_everywhere(value):
    from gradzip.comm import make_reducer
    from gradzip.ddp import CompressionState

    with pytest.raises(ValueError, match=r"^error_feedback must be True, False or None \(the codec's default\)"):
        CompressionState("topk:ratio=0.1", error_feedback=value)
    with pytest.raises(ValueError, match=r"^error_feedback must be True, False or None"):
        make_reducer("topk:ratio=0.1", error_feedback=value)


def test_a_residual_dtype_that_is_not_floating_is_refused():
    from gradzip.feedback import ErrorFeedback

    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype or None"):
        ErrorFeedback(dtype=torch.int32)
    assert ErrorFeedback(dtype=torch.bfloat16).dtype is torch.bfloat16


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "TSRAdam", "LocalAdamW"])
@pytest.mark.parametrize("eps", [0.0, -1e-8])
def test_adam_family_refuses_an_eps_that_divides_zero_by_zero(name, eps):
    import gradzip.optim as optim

    with pytest.raises(ValueError, match=r"^eps must be a number > 0"):
        getattr(optim, name)(torch.nn.Linear(3, 3).parameters(), eps=eps)


def test_a_list_option_naming_a_spec_twice_or_nothing_is_one_line(no_workers):
    _assert_one_line_exit_2(["simulate", "--compressors", "fp16,topk:ratio=0.1,fp16", "--no-plot", "--out", "sim"],
                            "--compressors lists 'fp16' twice; give each spec once")
    _assert_one_line_exit_2(["compare", "--compressors", "none,none", "--network", "loopback", "--out", "cmp"],
                            "--compressors lists 'none' twice")
    _assert_one_line_exit_2(["bench", "--codecs", ""], "--codecs must name at least one codec")


@pytest.mark.parametrize("entry, why", [("diloco:sync_every=0+topk", "sync_every must be an integer >= 1"),
                                        ("diloco:sync_every=4+bogus", "unknown compressor 'bogus'")])
def test_a_bad_outer_entry_of_compare_is_named_as_the_entry(no_workers, entry, why):
    _assert_one_line_exit_2(["compare", "--compressors", entry, "--network", "loopback", "--out", "cmp"],
                            f"--compressors entry '{entry}': {why}")
