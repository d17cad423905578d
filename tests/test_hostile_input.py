"""Hostile specs and arguments: every malformed string gets a one-line error, never a traceback
or a hang (hypothesis fuzzing of the spec parser, the codec builder, the hook picker and the CLI)."""

from __future__ import annotations

import contextlib
import io
import os
from unittest import mock

import pytest
import torch
from helpers.tiny_run import write_corpus
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gradzip.compressors import REGISTRY, Compressor, build, parse_spec
from gradzip.lab.cli import build_parser, main
from gradzip.lab.train import launch
from gradzip.lab.train.config import TrainConfig
from gradzip.lab.train.hooks import make_hook

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_N", 150)), deadline=None, suppress_health_check=[HealthCheck.too_slow])

NASTY = [
    "", " ", ":", "+", ",", "=", "::", "++", "a:", ":b=1", "topk:ratio", "topk:ratio=", "topk:=1",
    "topk:ratio=0.1,ratio=0.2", "topk:ratio=nan", "topk:ratio=inf", "topk:ratio=-0", "topk:ratio=1e-400",
    "topk:ratio=0x10", "powersgd:approx_rank=1.5", "powersgd:approx_rank=" + "9" * 400, "powersgd:seed=-1",
    "powersgd:warm_start=maybe", "none:x=1", "fp16+fp16", "TOPK:RATIO=0.5", "top k", "topk:ratio=0.1+",
    "torch:", "torch:fp16:x=1", "torch:powersgd:start_step=1", "torch:powersgd:approx_rank=0", "torch:nope",
    "\x00", "é", "topk:ratio=0.1\n", "a" * 2000, "none:" + ",".join(f"k{i}=1" for i in range(300)),
]

VALUES = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
)


def _render(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@st.composite
def structured_specs(draw) -> str:
    """A registered codec with a mix of its own parameters and others, holding any value."""
    name = draw(st.sampled_from(sorted(REGISTRY)))
    own = [p for p in REGISTRY[name].__init__.__code__.co_varnames if p != "self"]
    keys = draw(st.lists(st.sampled_from(own + ["ratio", "bits", "approx_rank", "seed", "bogus"]), max_size=3, unique=True))
    params = ",".join(f"{k}={_render(draw(VALUES))}" for k in keys)
    return f"{name}:{params}" if params else name


def _build_or_reject(spec) -> Compressor | None:
    try:
        codec = build(spec)
    except ValueError as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)
        return None
    assert isinstance(codec, Compressor)
    return codec


@pytest.mark.parametrize("spec", NASTY)
def test_nasty_specs_get_a_one_line_value_error(spec):
    codec = _build_or_reject(spec)
    if codec is not None:  # the few that are valid must round-trip through their own spec
        assert build(codec.spec).spec == codec.spec
    with contextlib.suppress(ValueError):
        make_hook(TrainConfig(compressor=spec).validate())


@FUZZ
@given(st.one_of(st.text(max_size=60), st.sampled_from(NASTY), structured_specs()))
def test_any_string_builds_or_gets_a_value_error(spec):
    codec = _build_or_reject(spec)
    with contextlib.suppress(ValueError):
        parse_spec(spec)
    if codec is not None and not codec.multi_round:
        # Whatever parameters were accepted, the codec works and keeps finite values finite.
        x = torch.linspace(-3, 3, 50)
        decoded = codec.decompress(codec.compress(x, step=1, key=0), like=x)
        assert decoded.shape == x.shape and torch.isfinite(decoded).all()


@FUZZ
@given(st.one_of(st.text(max_size=40), structured_specs()))
def test_any_hook_spec_is_picked_or_rejected(spec):
    for text in (spec, "torch:" + spec):
        try:
            cfg = TrainConfig(compressor=text).validate()
        except ValueError:
            continue
        make_hook(cfg)  # a spec that validates builds its hook


def test_non_string_specs_are_rejected():
    for spec in (None, 3, 1.5, b"topk", ["topk"]):
        with pytest.raises(ValueError, match="must be a string"):
            parse_spec(spec)


# --- the command line, in process --------------------------------------------------------------


class WouldSpawn(Exception):
    """Raised instead of starting workers: the arguments passed every check."""


def _train_options() -> list[str]:
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    return sorted(
        opt for action in train._actions for opt in action.option_strings if opt not in ("-h", "--help")
    )


CLI_VALUES = st.one_of(
    st.text(max_size=16),
    st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1", "1e309", "1e-320", "9" * 40, "", " ", "--", "/", ".",
                     "/dev/null", "/proc/self/mem", "gloo", "nccl", "topk:ratio=", "fp16+fp16", "torch:nope"]),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.floats().map(str),
)


@st.composite
def train_argvs(draw) -> list[str]:
    argv = []
    for _ in range(draw(st.integers(1, 4))):
        option = draw(st.sampled_from(_train_options()))
        argv.append(option)
        if option not in ("--no-exchange", "--quiet"):
            argv.append(draw(CLI_VALUES))
    return argv


def _run_cli(argv: list[str]) -> tuple[str, int | None]:
    """``("spawn", None)`` if the CLI would start workers, else ``(stderr, exit code)``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except WouldSpawn:
            return "spawn", None
    return err.getvalue(), code


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = write_corpus(root / "corpus.txt", n_lines=300)
    cwd = os.getcwd()
    os.chdir(root)  # any folder an argument names is relative to this scratch place
    with mock.patch.dict(os.environ, {"GRADZIP_CACHE": str(root / "cache")}), \
            mock.patch.object(launch, "spawn_workers", side_effect=WouldSpawn), \
            mock.patch.object(launch, "under_torchrun", return_value=False):
        yield data
    os.chdir(cwd)


@FUZZ
@given(argv=train_argvs())
def test_train_arguments_get_one_line_errors(cli_env, argv):
    base = ["train", "--data", cli_env, "--vocab-size", "300", "--seq-len", "32"]
    err, code = _run_cli(base + argv)
    event("valid" if err == "spawn" else "rejected")
    if err == "spawn":
        return
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.startswith("gradzip: "), (argv, err)
    assert "Traceback" not in err


@FUZZ
@given(argv=st.lists(st.one_of(st.text(max_size=12), st.sampled_from(["list", "--json", "--version", "-"])), max_size=4))
def test_any_argv_exits_cleanly(cli_env, argv):
    if "-h" in argv or "--help" in argv or any(a.startswith("--h") for a in argv):
        return  # help is long by design
    err, code = _run_cli(argv)
    if err == "spawn":
        return
    assert code in (0, 2), (argv, code, err)
    assert err.count("\n") <= 1 and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("spec", ["int8", "powersgd:factor_bits=8"])
def test_int8_sums_are_refused_past_127_workers_before_any_starts(spec):
    assert TrainConfig(compressor=spec, world_size=127).validate().world_size == 127
    with pytest.raises(ValueError, match="at most 127 workers"):
        TrainConfig(compressor=spec, world_size=128).validate()
    # named among auto's candidates too; auto's default list leaves int8 out there instead
    with pytest.raises(ValueError, match=f"--auto-candidates: {spec} sums int8 codes over at most 127 workers"):
        TrainConfig(compressor="auto", auto_candidates=f"fp16;{spec}", world_size=128).validate()
    assert TrainConfig(compressor="auto", world_size=128).validate().world_size == 128


@pytest.mark.parametrize("argv, message", [
    (["train", "--no-exchange", "--compressor", "topk:ratio=0.01"],
     "--no-exchange sends nothing, so no --compressor applies; got --compressor topk:ratio=0.01"),
    (["train", "--compressor", "torch:powersgd:approx_rank=-1"],
     "--compressor torch:powersgd:approx_rank=-1: approx_rank must be an integer >= 1; got -1"),
    (["train", "--compressor", "torch:foo"],
     "--compressor torch:foo: unknown PyTorch hook 'torch:foo'; known: torch:allreduce, torch:fp16, torch:bf16, "
     "torch:powersgd"),
    (["bench", "--codecs", "torch:fp16"], "--codecs entry 'torch:fp16': PyTorch's DDP hooks run in gradzip train and "
     "compare, not in bench"),
    (["simulate", "--compressors", "none,kimad"], "--compressors entry 'kimad': kimad is a schedule that picks codecs "
     "as a run trains; simulate takes codecs"),
    (["simulate", "--compressors", "auto"], "--compressors entry 'auto': auto is a schedule"),
    (["compare", "--bandwidth", "100mbt", "--compressors", "none"], "--bandwidth must look like 20mbit"),
    (["simulate", "--codec-gbps", "-3"], "--codec-gbps must be a number of GB/s > 0"),
])
def test_options_that_cannot_apply_are_named_in_one_line(cli_env, argv, message):
    err, code = _run_cli(argv)
    assert code == 2 and err.count("\n") == 1, (code, err)
    assert err.startswith(f"gradzip: error: {message}"), err
