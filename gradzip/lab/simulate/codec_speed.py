"""Codec throughput measured on this machine, for ``--codec-gbps measure``.

Each codec encodes and decodes one fp32 tensor of ``numel`` elements a few times; the median
time gives bytes of dense gradient per second. Both directions allocate their outputs, as the
reducers do. PowerSGD is timed through its arithmetic (``P = M Q``, QR of ``P``, ``Q = M^T P``;
decode ``P Q^T``) on a square-ish matrix, since it has no single-shot ``compress``; 1-bit Adam
through sign packing and one scale. Figures from a CPU say nothing about a GPU: for a GPU
cluster give ``--codec-gbps``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from gradzip.compressors.kernels import wire
from gradzip.lab.simulate.exchange import Method
from gradzip.lab.simulate.step import CodecSpeed

#: elements of the timed tensor (4 MiB of fp32): large enough to stream, small enough to be quick
DEFAULT_NUMEL = 1 << 20


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first call pays for allocation and dispatch set-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_codec_speed(method: Method, *, numel: int = DEFAULT_NUMEL, repeats: int = 5, seed: int = 0) -> CodecSpeed:
    """Time ``method``'s encode and decode on an fp32 tensor of ``numel`` elements on the CPU.

    Args:
        method: the codec (or ``onebit-adam``).
        numel: elements of the test tensor (>= 1024).
        repeats: timed runs; the median counts.
        seed: seeds the test tensor's generator.

    Returns:
        a :class:`CodecSpeed` in dense bytes per second, ``source`` naming the measurement.

    Raises:
        ValueError: if ``numel < 1024`` or ``repeats < 1``.
    """
    if numel < 1024:
        raise ValueError(f"numel must be >= 1024; got {numel}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    if method.onebit_adam:
        encode, decode = _sign_fns(x)
    elif method.codec.multi_round:
        n = 1 << (numel.bit_length() // 2)
        x = x[: n * (numel // n)]
        encode, decode = _lowrank_fns(x.view(n, -1), method.codec.approx_rank, gen)
    else:
        codec = method.codec
        payload = codec.compress(x, step=0, key=0)

        def encode():
            return codec.compress(x, step=0, key=0)

        def decode():
            return codec.decompress(payload, like=x)

    dense = x.numel() * x.element_size()
    enc_s = _median_s(encode, repeats)
    dec_s = _median_s(decode, repeats)
    # A codec faster than the clock's resolution still gets a finite rate.
    tiny = 1e-9
    return CodecSpeed(dense / max(enc_s, tiny), dense / max(dec_s, tiny), f"measured on this CPU, {x.numel()} fp32 elements")


def _sign_fns(x: torch.Tensor):
    packed = wire.pack_bits(x >= 0, 1)
    scale = x.abs().mean()

    def encode():
        return wire.pack_bits(x >= 0, 1), x.abs().mean()

    def decode():
        return (wire.unpack_bits(packed, 1, x.numel()).float() * 2 - 1) * scale

    return encode, decode


def _lowrank_fns(matrix: torch.Tensor, approx_rank: int, gen: torch.Generator):
    from gradzip.comm.powersgd import product  # the reducer's own products (layout matters on CPU)

    q = torch.randn(matrix.shape[1], approx_rank, generator=gen)
    p_hat = torch.linalg.qr(product(matrix, q)).Q
    q_new = product(matrix.T, p_hat)

    def encode():
        p = torch.linalg.qr(product(matrix, q)).Q
        return product(matrix.T, p)

    def decode():
        return p_hat @ q_new.T

    return encode, decode
