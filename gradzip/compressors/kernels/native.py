"""Native CPU loops for the codecs whose compiled torch form stays compute-bound.

QSGD, TernGrad and natural compression draw a hashed dither per element and pack codes of
several widths; compiled by inductor for AVX2, their loops spilled registers and ran at a fifth
of an elementwise pass. :file:`native.c` writes the same loops in C, one function per codec
direction: those three, the uniform quantizer, the sign codecs with one scale (signs and the
magnitude sum in one read), TernGrad's moments, the sparsifiers' candidate scan (positions
and values written as found instead of a mask to search), and the count sketch's hashes and
peeling rounds (a round of PyTorch gathers per peeling round otherwise). On first use the file is compiled
with the system C compiler (``$CC``, else the compiler Python was built with, else ``cc``) at
``-O3 -march=native -ffp-contract=off`` (no fast-math, no fused multiply-add: the results are
bit-identical to the eager torch functions they mirror, which ``tests/test_native.py`` checks)
into ``$GRADZIP_CACHE/native`` (default ``~/.cache/gradzip/native``), keyed by a hash of the
source, the compiler, the flags and the CPU, written atomically, and loaded with :mod:`ctypes`.

The loops serve contiguous fp32 CPU tensors in whole rows of a multiple of 32 elements (the
word layout of :func:`gradzip.compressors.kernels.fused.fold`), and each wrapper checks the sizes the C
code will read; everything else, and every run where the library cannot be built or
``GRADZIP_NATIVE=0`` or ``GRADZIP_COMPILE=0`` is set, takes the torch functions (compiled or
eager). Each wrapper returns None where its loop cannot run. A failed build warns once and is
not retried in the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from gradzip.compressors.kernels import fused

#: environment variable: ``0`` turns the native loops off (the default uses them)
ENV = "GRADZIP_NATIVE"
#: the C source, shipped with the package
SOURCE = Path(__file__).with_name("native.c")
#: compiler flags; ``-march=native`` is dropped where the compiler refuses it
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c11", "-shared", "-fPIC")

#: columns per vector step of the loops; TernGrad's and natural compression's rows must hold
#: whole steps of all their column slices
LANES = 8

_lock = threading.Lock()
_state: dict[str, object] = {}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_U32 = ctypes.c_uint32
_F32 = ctypes.c_float

#: argument types of the exported functions
_SIGNATURES = {
    "gz_qsgd_encode": (_P, _I64, _I64, _I32, _I32, _U32, _U32, _U32, _P, _P, _P),
    "gz_qsgd_decode": (_P, _P, _P, _I64, _I64, _I32, _I32, _P),
    "gz_terngrad_encode": (_P, _I64, _I64, _F32, _F32, _U32, _U32, _U32, _P, _P),
    "gz_terngrad_decode": (_P, _I64, _I64, _F32, _P),
    "gz_natural_encode": (_P, _I64, _I64, _U32, _U32, _U32, _P, _P),
    "gz_natural_decode": (_P, _P, _I64, _I64, _P),
    "gz_at_least": (_P, _I64, _F32, _P, _P, _I64),
    "gz_row_sums": (_P, _I64, _I64, _I32, _P, _P),
    "gz_row_moments_f32": (_P, _I64, _I64, _P, _P, _P),
    "gz_abs_max": (_P, _I64),
    "gz_min_max": (_P, _I64, _I64, _P, _P),
    "gz_frame": (_P, _P, _I64, _P),
    "gz_uniform_params": (_P, _P, _I64, _F32, _I32, _F32, _I32, _P, _P),
    "gz_uniform_decode_params": (_P, _P, _I64, _F32, _I32, _P, _P, _P),
    "gz_uniform_encode": (_P, _I64, _I64, _F32, _P, _P, _I32, _I32, _I32, _U32, _U32, _U32, _P),
    "gz_uniform_decode": (_P, _I64, _I64, _P, _P, _P, _F32, _I32, _P),
    "gz_sign_encode": (_P, _I64, _I64, _P, _P, _P),
    "gz_sign_decode": (_P, _I64, _I64, _F32, _P),
    "gz_peel": (_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _P),
    "gz_hash_cells": (_P, _I64, _P, _I64, _I64, _P, _P),
}

#: return types other than none
_RESULTS = {"gz_at_least": _I64, "gz_abs_max": _F32, "gz_peel": _I64}


def enabled() -> bool:
    """Whether the native loops may run: unless ``GRADZIP_NATIVE=0`` or ``GRADZIP_COMPILE=0``."""
    return os.environ.get(ENV, "1") != "0" and fused.enabled()


def _compiler() -> list[str]:
    configured = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    command = shlex.split(configured)
    if not command or shutil.which(command[0]) is None:
        command = ["cc"]
    return command


def _cpu_signature() -> str:
    """The CPU's feature flags (a library built with ``-march=native`` runs where they match)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("GRADZIP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradzip")
    return Path(root) / "native"


def _build() -> Path:
    """Compile :data:`SOURCE` into the cache unless it is there; returns the library's path."""
    compiler = _compiler()
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, " ".join(compiler).encode(), " ".join(FLAGS).encode(), _cpu_signature().encode()]))
    target = _cache_dir() / f"gradzip_native_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        errors = ""
        for flags in (FLAGS, tuple(f for f in FLAGS if f != "-march=native")):
            result = subprocess.run(
                [*compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=120, check=False
            )
            if result.returncode == 0:
                # Atomic: another process sees the old name absent or the whole library.
                os.replace(built, target)
                return target
            errors = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else [f"exit {result.returncode}"]
        raise RuntimeError(f"{' '.join(compiler)} failed on {SOURCE.name}: {errors[0] if errors else ''}")


def library() -> ctypes.CDLL | None:
    """The loaded native library, built on first use; None where it cannot be (warned once)."""
    lib = _state.get("lib")
    if lib is not None or "error" in _state:
        return lib
    with _lock:
        if "lib" in _state or "error" in _state:
            return _state.get("lib")
        try:
            lib = ctypes.CDLL(str(_build()))
            for name, argtypes in _SIGNATURES.items():
                function = getattr(lib, name)
                function.argtypes = argtypes
                function.restype = _RESULTS.get(name)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _state["error"] = str(exc)
            warnings.warn(f"gradzip: native codec loops unavailable ({exc}); using the torch kernels", stacklevel=3)
            return None
        _state["lib"] = lib
        return lib


def status() -> str:
    """One line on the native loops: on (and where the library is), or off and why."""
    if os.environ.get(ENV, "1") == "0":
        return f"native loops off ({ENV}=0)"
    if not fused.enabled():
        return f"native loops off ({fused.ENV}=0)"
    lib = library()
    if lib is None:
        return f"native loops unavailable ({_state.get('error', 'unknown')})"
    return f"native loops on ({Path(lib._name).name})"


def _ready(*tensors: Tensor) -> ctypes.CDLL | None:
    """The library when every tensor is a contiguous fp32 or int32 CPU tensor and it may run."""
    if not enabled():
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.int32) or not t.is_contiguous():
            return None
        if t.numel() and t.data_ptr() == 0:
            # a tensor without storage (torch's zero tensors)
            return None
    return library()


def _fits(t: Tensor, rows: int, cols: int | None = None) -> bool:
    """Whether ``t`` holds exactly ``rows`` (and ``cols`` per row) elements, the sizes the C
    loops read: a mismatch is left to the torch kernels (and their errors), never read past."""
    return t.numel() == rows * (1 if cols is None else cols) and (cols is None or t.shape[-1] == cols)


def _check_bits(bits: int) -> int:
    """Raises: ValueError unless ``bits`` is a code width the loops have (1, 2, 4 or 8)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be one of 1, 2, 4, 8; got {bits!r}")
    return bits


def _u32(value: int | Tensor) -> int:
    return int(value) & 0xFFFFFFFF


Encoder = Callable[[Tensor, list[Tensor], int], "tuple[Tensor, ...] | None"]
Decoder = Callable[[list[Tensor], list[Tensor], int], "Tensor | None"]


def qsgd_encoder(levels: int, bits: int) -> Encoder:
    """QSGD's fused fp32 encoding with ``norm=max`` (:func:`gradzip.compressors.qsgd._qsgd_encoder`
    with its row statistics): ``(x (rows, G), [key_low, key_high], first) -> (sign words (rows,
    G / 32), level words (rows, G * bits / 32), scales (rows,))``, or None.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8.
    """
    _check_bits(bits)

    def encode(x: Tensor, params: list[Tensor], first: int) -> tuple[Tensor, ...] | None:
        lib = _ready(x)
        if lib is None or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 32:
            return None
        rows, group = x.shape
        signs = torch.empty(rows, group // 32, dtype=torch.int32)
        codes = torch.empty(rows, group * bits // 32, dtype=torch.int32)
        scales = torch.empty(rows, dtype=torch.float32)
        key_low, key_high = params
        lib.gz_qsgd_encode(
            x.data_ptr(), rows, group, levels, bits, _u32(first), _u32(key_low), _u32(key_high),
            signs.data_ptr(), codes.data_ptr(), scales.data_ptr(),
        )  # fmt: skip
        return signs, codes, scales

    return encode


def qsgd_decoder(levels: int, bits: int) -> Decoder:
    """QSGD's fp32 decoding: ``([sign words, level words], [scales (rows, 1) fp32], G) -> (rows, G)``.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8.
    """
    _check_bits(bits)

    def decode(codes: list[Tensor], params: list[Tensor], group: int) -> Tensor | None:
        signs, words = codes
        (scales,) = params
        lib = _ready(signs, words, scales)
        rows = signs.shape[0]
        shapes_fit = _fits(signs, rows, group // 32) and _fits(words, rows, group * bits // 32) and _fits(scales, rows)
        if lib is None or scales.dtype != torch.float32 or group % 32 or not shapes_fit:
            return None
        out = torch.empty(rows, group, dtype=torch.float32)
        lib.gz_qsgd_decode(signs.data_ptr(), words.data_ptr(), scales.data_ptr(), rows, group, levels, bits, out.data_ptr())
        return out

    return decode


def terngrad_encoder(with_max: bool) -> Encoder:
    """TernGrad's fp32 encoding: ``(x (rows, G), [factor, bound, key_low, key_high], first) ->
    (code words (rows, G / 16),)`` and, ``with_max``, the rows' ``max |x|`` (rows,)."""

    def encode(x: Tensor, params: list[Tensor], first: int) -> tuple[Tensor, ...] | None:
        factor, bound, key_low, key_high = params
        lib = _ready(x)
        rows, group = x.shape
        if lib is None or x.dtype != torch.float32 or factor.dtype != torch.float32 or group % (16 * LANES):
            return None
        codes = torch.empty(rows, group // 16, dtype=torch.int32)
        row_max = torch.empty(rows, dtype=torch.float32) if with_max else None
        lib.gz_terngrad_encode(
            x.data_ptr(), rows, group, float(factor), float(bound), _u32(first), _u32(key_low), _u32(key_high),
            codes.data_ptr(), None if row_max is None else row_max.data_ptr(),
        )  # fmt: skip
        return (codes,) if row_max is None else (codes, row_max)

    return encode


def terngrad_decode(codes: list[Tensor], params: list[Tensor], group: int) -> Tensor | None:
    """TernGrad's fp32 decoding: ``([code words (rows, G / 16)], [scaler 0-d fp32], G) -> (rows, G)``."""
    (words,) = codes
    (scaler,) = params
    lib = _ready(words)
    rows = words.shape[0]
    if lib is None or scaler.dtype != torch.float32 or group % (16 * LANES) or not _fits(words, rows, group // 16):
        return None
    out = torch.empty(rows, group, dtype=torch.float32)
    lib.gz_terngrad_decode(words.data_ptr(), rows, group, float(scaler), out.data_ptr())
    return out


def natural_encode(x: Tensor, params: list[Tensor], first: int) -> tuple[Tensor, ...] | None:
    """Natural compression's fp32 encoding: ``(x (rows, G), [key_low, key_high], first) ->
    (sign words (rows, G / 32), exponent words (rows, G / 4))``."""
    lib = _ready(x)
    rows, group = x.shape
    if lib is None or x.dtype != torch.float32 or group % (32 * LANES):
        return None
    key_low, key_high = params
    signs = torch.empty(rows, group // 32, dtype=torch.int32)
    exponents = torch.empty(rows, group // 4, dtype=torch.int32)
    lib.gz_natural_encode(x.data_ptr(), rows, group, _u32(first), _u32(key_low), _u32(key_high), signs.data_ptr(), exponents.data_ptr())
    return signs, exponents


def natural_decode(codes: list[Tensor], params: list[Tensor], group: int) -> Tensor | None:
    """Natural compression's fp32 decoding: ``([sign words, exponent words], [], G) -> (rows, G)`` fp32."""
    signs, exponents = codes
    lib = _ready(signs, exponents)
    rows = signs.shape[0]
    shapes_fit = _fits(signs, rows, group // 32) and _fits(exponents, rows, group // 4)
    if lib is None or group % (32 * LANES) or not shapes_fit:
        return None
    out = torch.empty(rows, group, dtype=torch.int32)
    lib.gz_natural_decode(signs.data_ptr(), exponents.data_ptr(), rows, group, out.data_ptr())
    return out.view(torch.float32)


def at_least(flat: Tensor, threshold: float, *, expected: int) -> tuple[Tensor, Tensor] | None:
    """Positions (int64, ascending) and values of the elements of a 1-D fp32 tensor with
    ``|x| >= threshold`` (NaN excluded), found in one pass; room is made for ``expected`` of
    them and the scan repeated once with room for all if more pass. None where the loop
    cannot run."""
    lib = _ready(flat)
    if lib is None or flat.dtype != torch.float32 or flat.dim() != 1:
        return None
    numel = flat.numel()
    capacity = min(numel, max(expected, 1024))
    positions, values = torch.empty(capacity, dtype=torch.int64), torch.empty(capacity, dtype=torch.float32)
    count = lib.gz_at_least(flat.data_ptr(), numel, threshold, positions.data_ptr(), values.data_ptr(), capacity)
    if count > capacity:
        positions, values = torch.empty(count, dtype=torch.int64), torch.empty(count, dtype=torch.float32)
        count = lib.gz_at_least(flat.data_ptr(), numel, threshold, positions.data_ptr(), values.data_ptr(), count)
    return positions[:count], values[:count]


#: sums.KINDS as the C loop numbers them
_KIND_CODES = {"plain": 0, "abs": 1, "square": 2}


def row_sums(flat: Tensor, group: int, kinds: tuple[str, ...], wide: torch.dtype = torch.float64) -> list[Tensor] | None:
    """The pairwise row sums of :func:`gradzip.compressors.kernels.sums.row_sums` for the rows of
    ``group`` elements (a power of two, >= 64) of a 1-D fp32 tensor of whole rows, one
    ``(rows,)`` tensor in ``wide`` per kind: one kind in fp64, or ``("plain", "square")`` in
    fp32 from one read (TernGrad's moments)."""
    lib = _ready(flat)
    if lib is None or flat.dtype != torch.float32 or flat.dim() != 1 or group < 64 or group & (group - 1):
        return None
    if flat.numel() % group or wide not in (torch.float32, torch.float64):
        return None
    if kinds not in ((("plain", "square"),) if wide == torch.float32 else (("plain",), ("abs",), ("square",))):
        return None
    rows = flat.numel() // group
    out = [torch.empty(rows, dtype=wide) for _ in kinds]
    if wide == torch.float32:
        scratch = torch.empty(group // 4, dtype=torch.float32)
        lib.gz_row_moments_f32(flat.data_ptr(), rows, group, out[0].data_ptr(), out[1].data_ptr(), scratch.data_ptr())
        return out
    scratch = torch.empty(group // 8, dtype=torch.float64)
    lib.gz_row_sums(flat.data_ptr(), rows, group, _KIND_CODES[kinds[0]], out[0].data_ptr(), scratch.data_ptr())
    return out


def abs_max(flat: Tensor) -> Tensor | None:
    """``max |x|`` of a 1-D fp32 tensor as a 0-d fp32 tensor (NaN if any element is NaN), in
    one pass; None where the loop cannot run."""
    lib = _ready(flat)
    if lib is None or flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() == 0:
        return None
    return torch.tensor(lib.gz_abs_max(flat.data_ptr(), flat.numel()), dtype=torch.float32)


def min_max(flat: Tensor, group: int) -> tuple[Tensor, Tensor] | None:
    """Per group of ``group`` elements of a 1-D fp32 tensor (the last may be shorter): its
    minimum and maximum, ``(ceil(n / group),)`` fp32 each, both NaN for a group holding a NaN."""
    lib = _ready(flat)
    if lib is None or flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() == 0:
        return None
    count = -(-flat.numel() // group)
    low, high = torch.empty(count, dtype=torch.float32), torch.empty(count, dtype=torch.float32)
    lib.gz_min_max(flat.data_ptr(), flat.numel(), group, low.data_ptr(), high.data_ptr())
    return low, high


def frame(low: Tensor, high: Tensor) -> list[float] | None:
    """The uniform quantizer's frame statistics of fp32 group minima and maxima (see
    :func:`gradzip.compressors.uniform._frame_statistics`), as three floats."""
    lib = _ready(low, high)
    if lib is None or low.dtype != torch.float32 or high.dtype != torch.float32 or high.numel() != low.numel():
        return None
    out = torch.empty(3, dtype=torch.float64)
    lib.gz_frame(low.data_ptr(), high.data_ptr(), low.numel(), out.data_ptr())
    return out.tolist()


def uniform_params(low: Tensor, high: Tensor, prescale: float, steps: int, stochastic: bool) -> tuple[Tensor, Tensor] | None:
    """The uniform quantizer's fp32 encoding parameters per group, ``(offset, inverse)`` (see
    :func:`gradzip.compressors.uniform._uniform_params`)."""
    lib = _ready(low, high)
    if lib is None or low.dtype != torch.float32 or high.dtype != torch.float32 or high.numel() != low.numel():
        return None
    count = low.numel()
    offset, inverse = torch.empty(count, dtype=torch.float32), torch.empty(count, dtype=torch.float32)
    unit = 2.0**16 if stochastic else 1.0
    lib.gz_uniform_params(low.data_ptr(), high.data_ptr(), count, prescale, steps, unit, not stochastic, offset.data_ptr(), inverse.data_ptr())
    return offset, inverse


def uniform_decode_params(low: Tensor, high: Tensor, prescale: float, steps: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """The uniform quantizer's fp32 decoding parameters per group, ``(min, step, max)`` prescaled."""
    lib = _ready(low, high)
    if lib is None or low.dtype != torch.float32 or high.dtype != torch.float32 or high.numel() != low.numel():
        return None
    count = low.numel()
    out = [torch.empty(count, dtype=torch.float32) for _ in range(3)]
    lib.gz_uniform_decode_params(low.data_ptr(), high.data_ptr(), count, prescale, steps, *(t.data_ptr() for t in out))
    return out[0], out[1], out[2]


def uniform_encoder(steps: int, bits: int, stochastic: bool) -> Encoder:
    """The uniform quantizer's fp32 encoding: ``(x (rows, G), [prescale, offset (rows, 1),
    inverse (rows, 1), key_low, key_high], first) -> (code words (rows, G * bits / 32),)``;
    for rows of whole vector steps per lane (``G * bits / 32`` a multiple of 8).

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8.
    """
    _check_bits(bits)

    def encode(x: Tensor, params: list[Tensor], first: int) -> tuple[Tensor, ...] | None:
        prescale, offset, inverse, key_low, key_high = params
        lib = _ready(x, offset, inverse)
        rows, group = x.shape
        words = group * bits // 32
        shapes_fit = _fits(offset, rows) and _fits(inverse, rows)
        fp32 = x.dtype == offset.dtype == inverse.dtype == torch.float32
        if lib is None or not fp32 or group % 32 or words % LANES or not shapes_fit:
            return None
        codes = torch.empty(rows, words, dtype=torch.int32)
        lib.gz_uniform_encode(
            x.data_ptr(), rows, group, float(prescale), offset.data_ptr(), inverse.data_ptr(), steps, bits,
            stochastic, _u32(first), _u32(key_low), _u32(key_high), codes.data_ptr(),
        )  # fmt: skip
        return (codes,)

    return encode


def uniform_decoder(bits: int) -> Decoder:
    """The uniform quantizer's fp32 decoding: ``([code words], [min, step, max (rows, 1),
    unscale], G) -> (rows, G)``.

    Raises:
        ValueError: if ``bits`` is not 1, 2, 4 or 8.
    """
    _check_bits(bits)

    def decode(codes: list[Tensor], params: list[Tensor], group: int) -> Tensor | None:
        (words,) = codes
        low_w, step, high_w, unscale = params
        lib = _ready(words, low_w, step, high_w)
        rows = words.shape[0]
        shapes_fit = _fits(words, rows, group * bits // 32) and all(_fits(p, rows) for p in (low_w, step, high_w))
        fp32 = low_w.dtype == step.dtype == high_w.dtype == torch.float32
        if lib is None or not fp32 or words.shape[1] % LANES or group % 32 or not shapes_fit:
            return None
        out = torch.empty(rows, group, dtype=torch.float32)
        lib.gz_uniform_decode(
            words.data_ptr(), rows, group, low_w.data_ptr(), step.data_ptr(), high_w.data_ptr(), float(unscale), bits, out.data_ptr()
        )
        return out

    return decode


def sign_encoder(sums: list[Tensor]) -> Encoder:
    """The sign codecs' fp32 encoding: ``(x (rows, G), [], first) -> (sign words (rows, G /
    32),)``, appending the rows' sums of ``|x|`` (``(rows,)`` fp64, in the order of
    :mod:`gradzip.compressors.kernels.sums`) to ``sums``."""

    def encode(x: Tensor, params: list[Tensor], first: int) -> tuple[Tensor, ...] | None:
        lib = _ready(x)
        rows, group = x.shape
        if lib is None or x.dtype != torch.float32 or group % (32 * LANES) or group & (group - 1):
            return None
        signs = torch.empty(rows, group // 32, dtype=torch.int32)
        row_sums = torch.empty(rows, dtype=torch.float64)
        scratch = torch.empty(group // 8, dtype=torch.float64)
        lib.gz_sign_encode(x.data_ptr(), rows, group, signs.data_ptr(), row_sums.data_ptr(), scratch.data_ptr())
        sums.append(row_sums)
        return (signs,)

    return encode


def sign_decode(codes: list[Tensor], params: list[Tensor], group: int) -> Tensor | None:
    """The sign codecs' fp32 decoding with one scale: ``([sign words], [scale 0-d], G) -> (rows, G)``."""
    (words,) = codes
    (scale,) = params
    lib = _ready(words)
    rows = words.shape[0]
    if lib is None or scale.dtype != torch.float32 or scale.dim() != 0 or group % (32 * LANES) or not _fits(words, rows, group // 32):
        return None
    out = torch.empty(rows, group, dtype=torch.float32)
    lib.gz_sign_decode(words.data_ptr(), rows, group, float(scale), out.data_ptr())
    return out


def peel(cells: Tensor, signs: Tensor, rest: Tensor, counts: Tensor, values: Tensor) -> Tensor | None:
    """The count sketch's peeling rounds (:func:`gradzip.compressors.countsketch.peel`), bit for
    bit: ``cells`` (rows x n int64 flat cell ids) and ``signs`` (rows x n float64) of the support's
    coordinates; ``rest`` (float64) and ``counts`` (int32), the table's remainders and how many
    open coordinates each cell holds, both changed in place; ``values`` (n float64) written where
    a coordinate peels. Returns the coordinates left open (int64, ascending), or None where the
    loop cannot run (then nothing was changed)."""
    if not enabled() or cells.dim() != 2 or signs.shape != cells.shape:
        return None
    typed = ((cells, torch.int64), (signs, torch.float64), (rest, torch.float64), (counts, torch.int32),
             (values, torch.float64))
    for t, dtype in typed:
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            return None
    rows, n = cells.shape
    if values.numel() != n or rest.numel() != counts.numel():
        return None
    if n and (int(cells.min()) < 0 or int(cells.max()) >= rest.numel()):
        return None  # a cell the C loop would read out of bounds: left to the torch rounds
    lib = library()
    if lib is None:
        return None
    open_, pick, row = (torch.empty(n, dtype=torch.int64) for _ in range(3))
    data = [t.data_ptr() if t.numel() else None for t in (cells, signs, rest, counts, values, open_, pick, row)]
    left = lib.gz_peel(data[0], data[1], rows, n, data[2], data[3], data[4], data[5], data[6], data[7])
    return open_[:left].clone()


def hash_cells(coeffs: Tensor, index: Tensor, ncols: int) -> tuple[Tensor, Tensor] | None:
    """The count sketch's columns (rows x n int64) and signs (rows x n fp32, +-1) of the
    coordinates ``index`` (n non-negative int64) under ``coeffs`` (rows x 8 int64 in [1, 2^31 - 1),
    :class:`gradzip.compressors.countsketch.Hashes`), the same integers as its torch form; None
    where the loop cannot run."""
    if not enabled() or coeffs.dim() != 2 or coeffs.shape[1] != 8 or ncols < 1:
        return None
    for t in (coeffs, index):
        if t.device.type != "cpu" or t.dtype != torch.int64 or not t.is_contiguous():
            return None
    if index.numel() and int(index.min()) < 0:
        return None
    lib = library()
    if lib is None:
        return None
    rows, n = coeffs.shape[0], index.numel()
    cols = torch.empty(rows, n, dtype=torch.int64)
    signs = torch.empty(rows, n, dtype=torch.float32)
    if n:
        lib.gz_hash_cells(coeffs.data_ptr(), rows, index.data_ptr(), n, ncols, cols.data_ptr(), signs.data_ptr())
    return cols, signs
