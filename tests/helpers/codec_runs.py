"""Helpers of the tests that compare a codec's paths (eager, compiled, native) bit for bit."""

from __future__ import annotations

import torch

from gradzip.compressors import build


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as an integer tensor of its element size (so that -0.0, NaN payloads and
    every other bit pattern compare exactly)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def run_codec(spec: str, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The payload tensors of ``spec`` for ``x`` (step 3, key "layer") and their decoding."""
    codec = build(spec)
    payload = codec.compress(x, step=3, key="layer")
    return payload.tensors, codec.decompress(payload, like=x)
