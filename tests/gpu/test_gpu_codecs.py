"""Every single-round codec on CUDA against its CPU result, its bytes against the formula, its
compiled (Triton) kernels against its eager ones, and the codecs that declare no host reads
under PyTorch's sync check.

Equal bit for bit, eagerly, except where a codec says otherwise:

- Top-K and threshold keep the same set in another order (the selection's): their kept
  magnitudes are compared sorted, and in fp32 (no ties) the decoded tensors bit for bit.
- DGC draws its sample from the device's generator: the same law, other positions than on the
  CPU, so only its guarantees are checked (between 0.8 k and k kept, the largest among them).

Compiled CUDA kernels may contract a multiply and an add into one rounding
(:mod:`gradzip.compressors.kernels.fused`): their decoded tensors may differ from the eager ones
in at most 1 element in 10,000, by at most one quantization step.
"""

from __future__ import annotations

import pytest
import torch
from helpers.codec_runs import bits_of

from gradzip.compressors import REGISTRY, build
from gradzip.compressors.kernels import fused

NUMEL = (1 << 20) + 37  # whole kernel rows and a short tail
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SINGLE_ROUND = sorted(name for name in REGISTRY if not build(name).multi_round)
UNORDERED = {"topk", "threshold"}
DEVICE_DRAWN = {"dgc"}
#: codecs whose elementwise work runs through the fused kernels
KERNEL_CODECS = ["efsignsgd", "natural", "qsgd", "signsgd", "terngrad", "uniform", "uniform:rounding=stochastic"]


def _gradient(dtype: torch.dtype) -> torch.Tensor:
    """Gaussian values with heavier tails (a gradient's shape), on the CPU."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(NUMEL, generator=gen) * (1 + 4 * torch.rand(NUMEL, generator=gen).pow(8))
    return x.to(dtype)


def _run(name: str, x: torch.Tensor):
    codec = build(name)
    payload = codec.compress(x, step=3, key="bucket0")
    return codec, payload, codec.decompress(payload, like=x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SINGLE_ROUND)
def test_codec_on_cuda_equals_its_cpu_result(name, dtype):
    x = _gradient(dtype)
    _, cpu_payload, cpu_decoded = _run(name, x)
    codec, payload, decoded = _run(name, x.cuda())
    assert all(t.is_cuda for t in payload.tensors), [t.device for t in payload.tensors]
    assert payload.nbytes == codec.payload_nbytes(NUMEL, dtype), "payload bytes differ from the formula"
    assert decoded.is_cuda and decoded.dtype == dtype and decoded.shape == x.shape
    decoded = decoded.cpu()
    if name in DEVICE_DRAWN:
        k = codec.values_numel(NUMEL)
        kept = decoded.ne(0)
        assert 0.8 * k <= int(kept.sum()) <= k
        assert decoded.abs()[kept].min() >= x.abs()[~kept].max(), "DGC kept a smaller value than one it dropped"
        return
    if name in UNORDERED:
        values = payload.tensors[0].cpu()
        assert torch.equal(values.abs().sort().values, cpu_payload.tensors[0].abs().sort().values)
        if dtype == torch.float32:
            assert torch.equal(bits_of(decoded), bits_of(cpu_decoded))
        return
    for ours, theirs in zip(payload.tensors, cpu_payload.tensors, strict=True):
        assert torch.equal(bits_of(ours.cpu()), bits_of(theirs)), f"{name}: payload differs from the CPU's"
    assert torch.equal(bits_of(decoded), bits_of(cpu_decoded)), f"{name}: decoded differs from the CPU's"


@pytest.mark.parametrize("name", KERNEL_CODECS)
def test_compiled_cuda_kernels_agree_with_eager(monkeypatch, name):
    x = _gradient(torch.float32).cuda()
    _, _, eager = _run(name, x)
    monkeypatch.setenv(fused.ENV, "1")
    _, _, compiled = _run(name, x)
    chosen = {label: how for label, how in fused.choices.items() if "[cuda:" in label}
    assert chosen and set(chosen.values()) == {"compiled"}, f"{name}: kernels not compiled on CUDA: {chosen}"
    differ = compiled.ne(eager)
    assert int(differ.sum()) <= NUMEL // 10_000, f"{name}: {int(differ.sum())} elements differ from eager"
    if differ.any():
        step = (eager - compiled).abs()[differ].max()
        assert step <= x.abs().max() / 2, f"{name}: compiled differs from eager by {float(step)}"


@pytest.mark.parametrize("name", [n for n in SINGLE_ROUND if not build(n).host_reads])
def test_codecs_without_host_reads_do_not_sync(no_host_sync, name):
    x = _gradient(torch.float32).cuda()
    _run(name, x)  # first call: tables and pinned buffers made
    with no_host_sync():
        codec, payload, decoded = _run(name, x)
    torch.cuda.synchronize()
    assert decoded.isfinite().all()
