"""The worked example of docs/extending.md runs: its codec registers, builds from a spec, sends
exactly ``payload_nbytes`` bytes, and the page's own tests pass."""

import re
from pathlib import Path

import torch

import gradzip
from gradzip.compressors import REGISTRY, Compressor

PAGE = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def _block(label: str) -> str:
    """The python code block that follows ``<!-- example: label -->`` on the page."""
    match = re.search(rf"<!-- example: {label} -->\s*```python\n(.*?)\n```", PAGE.read_text(), re.S)
    assert match, f"docs/extending.md has no python block after <!-- example: {label} -->"
    return match.group(1)


def test_extending_example_codec_and_its_tests_run():
    name = "absmax8"
    assert name not in REGISTRY
    try:
        exec(compile(_block("codec"), str(PAGE), "exec"), {"__name__": "docs_example_codec"})
        assert name in REGISTRY and issubclass(REGISTRY[name], Compressor)
        codec = gradzip.build(name)
        assert codec.spec == name and gradzip.build(f"{name}:start_step=3").start_step == 3
        gen = torch.Generator().manual_seed(0)
        for numel in (0, 1, 5, 4099):
            for dtype in (torch.float32, torch.float16, torch.float64):
                payload = codec.compress(torch.randn(numel, generator=gen).to(dtype), step=1, key="b")
                assert payload.nbytes == sum(t.numel() * t.element_size() for t in payload.tensors)
                assert payload.nbytes == codec.payload_nbytes(numel, dtype)
        tests = {}
        exec(compile(_block("test"), str(PAGE), "exec"), tests)
        names = [n for n in tests if n.startswith("test_")]
        assert names, "the page's test block defines no test"
        for test_name in names:
            tests[test_name]()
    finally:
        REGISTRY.pop(name, None)
