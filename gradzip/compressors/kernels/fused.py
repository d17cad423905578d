"""Fused kernels: a codec's elementwise passes compiled into one loop by ``torch.compile``.

A quantizer written as torch operations makes five to ten passes over its tensor (scale,
dither, round, clamp, cast, pack, and back), each about as costly as ``x.abs()``. Compiled by
inductor the same function runs as one loop per output: C++ on the CPU, Triton on CUDA. A
:class:`Kernel` wraps such a function: on the first call for a device type and combination of
input dtypes it compiles it (dynamic shapes, so bucket sizes do not recompile) and records the
time in :data:`compile_seconds`; where compilation is unavailable or fails (for that device type
and those dtypes: the choice is made once for each), on other devices, or with
``GRADZIP_COMPILE=0``, it runs the same function eagerly (:data:`choices` says which).

On the CPU both paths compute the same operations in the same order (inductor keeps IEEE
semantics: no fast-math, no FMA contraction), so their results are bit-identical (the tests
compare them); the kernels hold no sum whose order could differ: reductions are maxima and
minima only. Triton may contract a multiply and an add into one fused multiply-add, which
rounds once instead of twice: compiled CUDA codes can then differ from eager ones where a value
sits on a rounding boundary (tests/gpu bound how often).
"""

from __future__ import annotations

import copy
import os
import threading
import time
import types
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from gradzip.compressors.kernels import wire
from gradzip.compressors.kernels.placement import scalar

#: environment variable: ``0`` runs every kernel eagerly (the default compiles)
ENV = "GRADZIP_COMPILE"

#: seconds spent on each kernel's first call per device type and input dtypes (compilation included)
compile_seconds: dict[str, float] = {}
#: the path each kernel took per device type and input dtypes: ``compiled`` or ``eager``
choices: dict[str, str] = {}
#: device types whose kernels compile (inductor's C++ for the CPU, Triton for CUDA)
COMPILED_DEVICES = ("cpu", "cuda")

_lock = threading.Lock()


def enabled() -> bool:
    """Whether kernels compile: unless ``GRADZIP_COMPILE=0``."""
    return os.environ.get(ENV, "1") != "0"


class Kernel:
    """A torch function of tensors that runs compiled when it can and eagerly otherwise.

    Args:
        fn: takes tensors only (scalars as 0-d or ``(rows, 1)`` tensors, so that a new value
            never recompiles) and returns a tensor or a tuple of tensors.
        name: shown in :data:`compile_seconds` and in the warning when compilation fails.
        eager: what runs when ``fn`` does not compile (compilation off, another device, a
            failure), computing the same values: ``fn`` itself when None. A form written for
            the compiler (one small op per bit lane, for fusion) is slow run op by op.
    """

    def __init__(self, fn: Callable[..., object], name: str, eager: Callable[..., object] | None = None) -> None:
        self.fn = fn
        self.eager = fn if eager is None else eager
        # Its own code object: the compiler caches per code object and would otherwise see
        # kernels sharing one (closures with other constants) as one function whose constants
        # change, and turn those constants into symbols.
        self._unique = types.FunctionType(
            fn.__code__.replace(co_name=f"{name}_{id(self):x}"), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
        )
        self.name = name
        self.compiled: Callable[..., object] | None = None
        self.failed: set[tuple] = set()
        self.ready: set[tuple] = set()

    def __call__(self, *args: Tensor):
        device = args[0].device.type
        key = (device, *(a.dtype for a in args))
        if key in self.failed or not enabled() or device not in COMPILED_DEVICES:
            return self.eager(*args)
        for a in args:
            # The row count varies with the bucket; columns (the group) and constants do not.
            if a.dim() >= 1 and a.shape[0] > 1:
                torch._dynamo.mark_dynamic(a, 0)
        if key in self.ready:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to eager
                return self._fall_back(exc, key, args)
        with _lock:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self._unique, fullgraph=True)
                start = time.perf_counter()
                out = self.compiled(*args)
            except Exception as exc:  # noqa: BLE001
                return self._fall_back(exc, key, args)
            compile_seconds[self._label(key)] = time.perf_counter() - start
            choices[self._label(key)] = "compiled"
            self.ready.add(key)
            return out

    def _label(self, key: tuple) -> str:
        device, *dtypes = key
        return f"{self.name}[{device}:{','.join(str(d).removeprefix('torch.') for d in dtypes)}]"

    def _fall_back(self, exc: Exception, key: tuple, args: tuple[Tensor, ...]):
        self.failed.add(key)
        choices[self._label(key)] = "eager"
        warnings.warn(
            f"gradzip: compiling {self._label(key)} failed ({type(exc).__name__}: {exc}); running it eagerly", stacklevel=3
        )
        return self.eager(*args)


#: elements per row for the kernels of codecs without per-group parameters
BLOCK = 1 << 13


def warm_up(codec, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> float:
    """Run a copy of ``codec`` once on a ``dtype`` tensor of 2**19 + 37 elements on ``device``
    (2 MB in fp32: above the sizes below which codecs skip their kernels, several rows and a
    short tail), so that the kernels it uses compile now rather than on its first real bucket.

    Returns:
        the seconds it took (compilation included); 0.0 when compilation is off.
    """
    if not enabled():
        return 0.0
    start = time.perf_counter()
    x = torch.randn((1 << 19) + 37, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    probe = copy.deepcopy(codec)
    probe.decompress(probe.compress(x, step=0, key="warm-up"), like=x)
    return time.perf_counter() - start


#: codes are packed into 32-bit words: every lane a vector lane, no 8-bit conversion
WORD_BITS = 32
#: row lengths that fold into whole words at every code width (1, 2, 4 and 8 bits)
ROW_MULTIPLE = WORD_BITS


def fold(codes: Tensor, bits: int) -> Tensor:
    """Pack ``(rows, cols)`` integer codes below ``2**bits`` into ``(rows, cols * bits / 32)``
    int32 words, planar within each row: word ``j`` holds codes ``j, j + W, j + 2W, ...`` (``W =
    cols * bits / 32``), the first in the lowest bits. ``cols`` must be a multiple of ``32 /
    bits``. On the wire the words are their little-endian bytes (:func:`words_to_bytes`).

    Planar rather than interleaved (:func:`gradzip.compressors.kernels.wire.pack_bits`) so that every lane is a
    contiguous slice, and in 32-bit words rather than bytes so that no lane changes width:
    compiled, the loop runs on vectors of 32-bit lanes throughout (inductor's conversion of
    32-bit lanes to 8-bit ones for AVX2 took several times the whole loop's time).
    """
    per = WORD_BITS // bits
    # Lanes hold disjoint bits, so their sum is their OR; summed in int64 (no overflow), then
    # wrapped to int32 as two's complement: one pass over the codes instead of one per lane.
    lanes = codes.to(torch.int64).view(codes.shape[0], per, -1) << _shifts(per, bits, codes.device)
    words = lanes.sum(1)
    return (words - ((words >> (WORD_BITS - 1)) << WORD_BITS)).to(torch.int32)


def unfold(words: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`fold`: ``(rows, W)`` int32 words to ``(rows, W * 32 / bits)`` int32 codes."""
    per = WORD_BITS // bits
    lanes = (words.unsqueeze(1) >> _shifts(per, bits, words.device).to(torch.int32)) & ((1 << bits) - 1)
    return lanes.reshape(words.shape[0], -1)


def _shifts(per: int, bits: int, device: torch.device) -> Tensor:
    """``(1, per, 1)`` int64: lane ``i``'s shift, ``i * bits``."""
    return torch.arange(0, per * bits, bits, dtype=torch.int64, device=device).view(1, per, 1)


def lane_codes(words: Tensor, lane: int, bits: int) -> Tensor:
    """The codes in lane ``lane`` of int32 ``words`` (``bits`` wide), as int32."""
    # The mask clears the copies of the sign bit that an arithmetic shift brings in.
    return (words >> (lane * bits)) & ((1 << bits) - 1)


def words_to_bytes(words: Tensor) -> Tensor:
    """Contiguous int32 words as their bytes, uint8 ``(4 * numel,)`` (no copy).

    The bytes are in the machine's order, little-endian on every platform torch supports
    (x86-64, AArch64, POWER little-endian); :func:`bytes_to_words` reads them back the same way.
    """
    return words.contiguous().view(-1).view(torch.uint8)


def bytes_to_words(packed: Tensor) -> Tensor:
    """1-D uint8 of a multiple of 4 bytes as int32 words (a view when its start is 4-byte
    aligned, otherwise a copy of the bytes)."""
    assert packed.dim() == 1 and packed.numel() % 4 == 0
    if not packed.is_contiguous() or packed.storage_offset() % 4:
        packed = packed.clone()
    return packed.view(torch.int32)


def padded(flat: Tensor, size: int) -> Tensor:
    """``flat`` followed by zeros up to ``size`` elements (a copy; for short tails only)."""
    out = flat.new_zeros(size)
    out[: flat.numel()] = flat
    return out


def positions(rows: Tensor, first: Tensor, columns: Tensor | None = None) -> Tensor:
    """Flat positions (int32, wrapping past 2**31) of the elements of a ``(rows, cols)`` block
    whose first element sits at ``first`` (a 0-d int32 tensor).

    ``columns``, when given, is :func:`column_numbers`: a compiled loop loads it as a vector,
    where an ``arange`` in the loop would assemble each vector of column numbers lane by lane
    (which took most of a dithering encoder's time).
    """
    count, cols = rows.shape
    columns = torch.arange(cols, dtype=torch.int32, device=rows.device) if columns is None else columns.to(torch.int32)
    row_starts = torch.arange(count, dtype=torch.int32, device=rows.device).view(-1, 1) * cols
    return first + row_starts + columns


#: column numbers up to this are exact in fp32
_EXACT_FP32_INT = 1 << 24


def column_numbers(cols: int, device: torch.device | str = "cpu") -> Tensor:
    """``arange(cols)`` as a ``(1, cols)`` tensor: the ``columns`` of :func:`positions`. fp32
    (exact below 2**24; int32 for longer rows), since a compiled loop loads vectors of floats
    and converts them faster than it loads vectors of integers (see :func:`float_bits`)."""
    dtype = torch.float32 if cols <= _EXACT_FP32_INT else torch.int32
    return torch.arange(cols, dtype=dtype, device=device).view(1, cols)


def float_bits(t: Tensor) -> Tensor:
    """An int32 tensor's bits as float32 (a view), to hand to a kernel that views them back
    with :func:`int_bits`.

    Compiled for AVX2, inductor loads vectors of 32-bit integers through a scratch copy (twice
    the time of a whole elementwise pass for a kernel that only adds 1) and vectors of floats
    directly; a float load and a bit cast in the loop cost about half of that.
    """
    return t.view(torch.float32)


def int_bits(t: Tensor) -> Tensor:
    """The int32 bits of what :func:`float_bits` handed over (int32 tensors as they are)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _first(position: int, device: torch.device) -> Tensor:
    """``position`` modulo 2**32 as a 0-d signed int32 tensor on ``device``."""
    position &= 0xFFFFFFFF
    return scalar(position - (1 << 32) if position >= 1 << 31 else position, torch.int32, device)


def _row_params(params: tuple[Tensor, ...], first: int, rows: int) -> list[Tensor]:
    """Per-row parameters (1-D, one per row) as ``(rows, 1)`` columns; 0-d ones as they are."""
    return [p[first : first + rows].view(rows, 1) if p.dim() else p for p in params]


_wrapped: dict[tuple, Kernel] = {}


def _lanes(
    fn: Callable[..., tuple[Tensor, ...]],
    views: list[Tensor],
    params: list[Tensor],
    pos: Tensor | None,
    out_bits,
    packed: bool,
    sliced: bool = True,
) -> tuple[Tensor, ...]:
    """``fn``'s outputs, each folded into int32 words as :func:`fold` does when ``packed``.

    Folding evaluates ``fn`` on column slices (``fn`` is elementwise, so the codes are the
    same) and ORs the slices' codes, so that the compiler fuses the codes into the loop over
    output words instead of writing them to memory and reading them back per lane. With one
    output, the slices are its lanes. With several, the row is cut into ``P`` slices of ``W =
    cols / P`` columns, ``P`` the most lanes any output has (:func:`slice_count`), and ``fn``
    runs once per slice for all outputs: word ``c W + j`` of an output of ``per`` lanes holds
    the codes of slices ``c, c + P / per, ...`` at column ``j``, so every output is built from
    ``(rows, W)`` pieces and the whole encoding is one loop over ``(rows, W)`` that reads the
    input once (the pieces of an output are then concatenated, a copy of the packed words only).

    Unless ``sliced``, ``fn`` runs once on whole rows and each output is folded with
    :func:`fold`: the same words (the slices above are laid out as :func:`fold` lays out lanes),
    in a few ops rather than a few per lane, which is what an eager run wants.
    """
    extra = [] if pos is None else [pos]
    if not packed:
        return tuple(fn(*views, *params, *extra))
    if not sliced:
        outs = fn(*views, *params, *extra)
        return tuple(c if bits is None else fold(c, bits) for c, bits in zip(outs, out_bits, strict=True))
    if len(out_bits) == 1:
        (bits,) = out_bits
        if bits is None:
            return tuple(fn(*views, *params, *extra))
        per = WORD_BITS // bits
        width = views[0].shape[1] // per
        return (_fold_slices([_slice_codes(fn, views, params, pos, lane, width)[0] for lane in range(per)], bits),)
    slices = slice_count(out_bits)
    width = views[0].shape[1] // slices
    codes = [_slice_codes(fn, views, params, pos, s, width) for s in range(slices)]
    outs = []
    for index, bits in enumerate(out_bits):
        if bits is None:
            pieces = [c[index] for c in codes]
        else:
            span = slices // (WORD_BITS // bits)
            pieces = [_fold_slices([c[index] for c in codes[first::span]], bits) for first in range(span)]
        outs.append(torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0])
    return tuple(outs)


def slice_count(out_bits: tuple[int | None, ...]) -> int:
    """The column slices a row is cut into for outputs of ``out_bits`` (see :func:`_lanes`):
    the most lanes a word of any packed output holds, 1 when none is packed."""
    count = 1
    for bits in out_bits:
        if bits is not None and WORD_BITS // bits > count:
            count = WORD_BITS // bits
    return count


def _slice_codes(
    fn: Callable[..., tuple[Tensor, ...]], views: list[Tensor], params: list[Tensor], pos: Tensor | None, index: int, width: int
) -> tuple[Tensor, ...]:
    """``fn`` on columns ``index * width`` to ``(index + 1) * width`` of every view."""
    cols = slice(index * width, (index + 1) * width)
    extra = [] if pos is None else [pos[:, cols]]
    return fn(*[v[:, cols] for v in views], *params, *extra)


def _fold_slices(codes: list[Tensor], bits: int) -> Tensor:
    """ORs the codes of lane ``i`` shifted by ``i * bits`` into int32 words."""
    folded = None
    for lane, code in enumerate(codes):
        code = code.to(torch.int32)
        code = code << (lane * bits) if lane else code
        folded = code if folded is None else folded | code
    return folded


#: per-row statistics computed in the encoding loop: ``(reduce, params)``, see :func:`encode_rows`
RowStats = tuple[Callable[[Tensor], tuple[Tensor, ...]], Callable[..., tuple[Tensor, ...]]]


def _encode_body(
    fn: Callable[..., tuple[Tensor, ...]],
    views: list[Tensor],
    params: list[Tensor],
    pos: Tensor | None,
    out_bits: tuple[int | None, ...],
    packed: bool,
    row_stats: RowStats | None,
    sliced: bool = True,
) -> tuple[Tensor, ...]:
    """The codes of ``fn`` (see :func:`_lanes`), then the row statistics when there are any."""
    stats: tuple[Tensor, ...] = ()
    if row_stats is not None:
        reduce, make_params = row_stats
        stats = reduce(views[0])
        params = list(make_params(*stats, *params))
    codes = _lanes(fn, views, params, pos, out_bits, packed, sliced)
    return (*codes, *(s.reshape(-1) for s in stats))


def _encoder(
    fn: Callable[..., tuple[Tensor, ...]],
    count: int,
    out_bits: tuple[int | None, ...],
    packed: bool,
    with_positions: bool,
    row_stats: RowStats | None = None,
) -> Kernel:
    """The compiled form of an encoding function over ``count`` elementwise inputs."""
    key = ("encode", fn, count, out_bits, packed, with_positions, row_stats)
    if key not in _wrapped:

        def form(sliced: bool) -> Callable[..., tuple[Tensor, ...]]:
            def encode(*args: Tensor) -> tuple[Tensor, ...]:
                views = list(args[:count])
                params = list(args[count : len(args) - 2] if with_positions else args[count:])
                pos = positions(views[0], args[-2], args[-1]) if with_positions else None
                return _encode_body(fn, views, params, pos, out_bits, packed, row_stats, sliced)

            return encode

        name = f"{fn.__qualname__.split('.')[0]}{'' if packed else '_loose'}{'' if row_stats is None else '_with_stats'}"
        _wrapped[key] = Kernel(form(sliced=True), name, eager=form(sliced=False))
    return _wrapped[key]


def _decoder(fn: Callable[..., Tensor], in_bits: tuple[int | None, ...], packed: bool) -> Kernel:
    """The compiled form of a decoding function; packed code inputs are int32 words laid out
    as :func:`_lanes` folds them, and ``fn`` runs on each column slice's codes (the lanes are
    unpacked in the loop that writes the slice's values, not written out as codes first)."""
    key = ("decode", fn, in_bits, packed)
    if key not in _wrapped:
        count = len(in_bits)
        slices = slice_count(in_bits)

        def decode(*args: Tensor) -> Tensor:
            codes, params = args[:count], args[count:]
            if not packed or slices == 1:
                return fn(*[c if bits is None else int_bits(c) for c, bits in zip(codes, in_bits, strict=True)], *params)
            outs = []
            for s in range(slices):
                parts = []
                for code, bits in zip(codes, in_bits, strict=True):
                    if bits is None:
                        width = code.shape[1] // slices
                        parts.append(code[:, s * width : (s + 1) * width])
                        continue
                    span = slices // (WORD_BITS // bits)
                    width = code.shape[1] // span
                    piece, lane = s % span, s // span
                    parts.append(lane_codes(int_bits(code[:, piece * width : (piece + 1) * width]), lane, bits))
                outs.append(fn(*parts, *params))
            return torch.cat(outs, 1)

        def decode_eager(*args: Tensor) -> Tensor:
            # Concatenated over the slices, a packed input's lanes are :func:`unfold`'s codes,
            # and ``fn`` is elementwise: one call on whole rows gives the same values.
            codes, params = args[:count], args[count:]
            if not packed:
                return fn(*[c if bits is None else int_bits(c) for c, bits in zip(codes, in_bits, strict=True)], *params)
            return fn(*[c if bits is None else unfold(int_bits(c), bits) for c, bits in zip(codes, in_bits, strict=True)], *params)

        _wrapped[key] = Kernel(decode, f"{fn.__qualname__.split('.')[0]}{'' if packed else '_loose'}", eager=decode_eager)
    return _wrapped[key]


def encode_rows(
    fn: Callable[..., tuple[Tensor, ...]],
    elementwise: tuple[Tensor, ...],
    params: tuple[Tensor, ...],
    *,
    group: int,
    out_bits: tuple[int | None, ...],
    with_positions: bool = False,
    row_stats: RowStats | None = None,
    native: Callable[[Tensor, list[Tensor], int], tuple[Tensor, ...] | None] | None = None,
) -> tuple[Tensor, ...]:
    """Encode rows of ``group`` elements with ``fn``, compiled, and pack its codes.

    Args:
        fn: takes the ``(rows, cols)`` views of ``elementwise``, then ``params`` as
            ``(rows, 1)`` columns (0-d ones unchanged), and returns one ``(rows, cols)``
            tensor per output: int32 codes (32-bit lanes shift fast), or for ``bits=None``
            the values to send in their wire dtype.
        elementwise: 1-D tensors of one length ``n`` (the input, its dither).
        params: 1-D tensors of ``ceil(n / group)`` entries, one per row, or 0-d tensors.
        group: elements per row.
        out_bits: bits of each output's codes, ``None`` for an output sent as it is.
        with_positions: pass ``fn`` one more argument, the flat positions of its elements
            (int32, the views' shape; see :func:`positions`).
        row_stats: ``(reduce, make_params)`` to compute per-row parameters in the same loop
            (the input is then read once): ``reduce`` takes the ``(rows, cols)`` view of the
            first input and returns ``(rows, 1)`` statistics (maxima, minima: exact in any
            order), ``make_params(*statistics, *params)`` returns the parameters ``fn`` takes.
            ``params`` are then 0-d only.
        native: a loop of :mod:`gradzip.compressors.kernels.native` computing what the compiled
            ``fn`` computes on the whole rows, tried first when ``group`` is a multiple of 32:
            ``(input (rows, group), row parameters, first position) -> outputs`` as the
            compiled kernel returns them, or None where it cannot run.

    Returns:
        1-D outputs of ``ceil(n * bits / 8)`` bytes (``n`` elements for ``bits=None``), then
        with ``row_stats`` each statistic, ``ceil(n / group)`` entries. With ``group`` a
        multiple of 32 (:data:`ROW_MULTIPLE`), whole rows are packed into words by :func:`fold`
        (planar) and sent as the words' bytes, the last partial row as
        :func:`gradzip.compressors.kernels.wire.pack_bits` does; otherwise everything as ``pack_bits`` does.
    """
    from gradzip.compressors.kernels.elementwise import pack_codes

    numel = elementwise[0].numel()
    rows, tail = divmod(numel, group)
    whole = rows * group
    aligned = group % ROW_MULTIPLE == 0
    main = None
    if rows:
        views = [e[:whole].view(rows, group) for e in elementwise]
        extra = [_first(0, elementwise[0].device), column_numbers(group, elementwise[0].device)] if with_positions else []
        row_params = _row_params(params, 0, rows)
        outputs = native(views[0], row_params, 0) if native is not None and aligned else None
        if outputs is None:
            kernel = _encoder(fn, len(elementwise), out_bits, aligned, with_positions, row_stats)
            outputs = kernel(*views, *row_params, *extra)
        main = [
            words_to_bytes(o) if aligned and i < len(out_bits) and out_bits[i] is not None else o.reshape(-1)
            for i, o in enumerate(outputs)
        ]
    rest = None
    if tail:
        # A short row: eager (the same function, so the same codes), packed as pack_bits does.
        views = [e[whole:].view(1, tail) for e in elementwise]
        pos = positions(views[0], _first(whole, views[0].device)) if with_positions else None
        rest = [o.reshape(-1) for o in _encode_body(fn, views, _row_params(params, rows, 1), pos, out_bits, False, row_stats)]
    stats = []
    if row_stats is not None:
        for i in range(len(out_bits), len(main if main is not None else rest)):
            parts = [p[i] for p in (main, rest) if p is not None]
            stats.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    outs = []
    for i, bits in enumerate(out_bits):
        if bits is not None and not aligned:
            parts = [p[i] for p in (main, rest) if p is not None]
            outs.append(pack_codes((torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.uint8), bits))
            continue
        parts = []
        if main is not None:
            parts.append(main[i])
        if rest is not None:
            parts.append(rest[i] if bits is None else pack_codes(rest[i].to(torch.uint8), bits))
        outs.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    return (*outs, *stats)


def decode_rows(
    fn: Callable[..., Tensor],
    codes: tuple[tuple[Tensor, int | None], ...],
    params: tuple[Tensor, ...],
    *,
    group: int,
    numel: int,
    native: Callable[[list[Tensor], list[Tensor], int], Tensor | None] | None = None,
) -> Tensor:
    """Decode what :func:`encode_rows` packed: ``fn`` over ``ceil(numel / group)`` rows, compiled.

    Args:
        fn: takes each code tensor as ``(rows, group)`` codes, then ``params`` as ``(rows, 1)``
            columns (0-d ones unchanged), and returns ``(rows, group)`` values.
        codes: ``(tensor, bits)`` pairs as :func:`encode_rows` returned them.
        params: 1-D tensors of one entry per row, or 0-d tensors.
        group: elements per row.
        numel: elements to decode.
        native: a loop of :mod:`gradzip.compressors.kernels.native` computing what the compiled ``fn``
            computes, tried first when ``group`` is a multiple of 32 and every code tensor is
            packed: ``(int32 words (rows, group * bits / 32) per code tensor, row parameters,
            group) -> (rows, group)`` values, or None where it cannot run.

    Returns:
        ``(numel,)`` values (contiguous). A short last row is padded in its codes (a copy of
        the codes, not of the output).
    """
    from gradzip.compressors.kernels.elementwise import unpack_codes

    rows, tail = divmod(numel, group)
    aligned = group % ROW_MULTIPLE == 0
    total = rows + (1 if tail else 0)
    views = []
    for tensor, bits in codes:
        flat = tensor.reshape(-1)
        if bits is None or not aligned:
            if bits is not None:
                flat = unpack_codes(flat, bits, numel)
            if tail:
                flat = padded(flat[:numel], total * group)
            views.append(flat[: total * group].view(total, group))
            continue
        width = group * bits // WORD_BITS
        needed = rows * width * 4 + wire.packed_nbytes(tail, bits)
        if flat.numel() < needed:
            raise ValueError(f"packed codes hold {flat.numel()} bytes, fewer than the {needed} that {numel} {bits}-bit codes take")
        words = bytes_to_words(flat[: rows * width * 4]) if rows else flat.new_empty(0).view(torch.int32)
        if tail:
            # Repack the short row the way whole rows are packed, padded to a whole row.
            last = padded(unpack_codes(flat[rows * width * 4 :], bits, tail), group).view(1, group)
            words = torch.cat([words, fold(last, bits).view(-1)])
        views.append(words.view(total, width))
    row_params = _row_params(params, 0, total)
    values = None
    if native is not None and aligned and all(bits is not None for _t, bits in codes):
        values = native(views, row_params, group)
    if values is None:
        kernel = _decoder(fn, tuple(bits for _t, bits in codes), aligned)
        views = [v if bits is None or not aligned else float_bits(v) for v, (_t, bits) in zip(views, codes, strict=True)]
        values = kernel(*views, *row_params)
    return values.view(-1)[:numel]


def reduce_rows(kernel: Callable[..., object], flat: Tensor, *, group: int) -> tuple[Tensor, ...]:
    """Per-row reductions over rows of ``group`` elements and the tail row.

    Args:
        kernel: takes a ``(rows, cols)`` view and returns a tuple of ``(rows,)`` tensors.
        flat: 1-D tensor.
        group: elements per row.

    Returns:
        ``ceil(n / group)`` entries per output.
    """
    numel = flat.numel()
    rows, tail = divmod(numel, group)
    parts = []
    if rows:
        parts.append(kernel(flat[: rows * group].view(rows, group)))
    if tail:
        parts.append(kernel(flat[rows * group :].view(1, tail)))
    if len(parts) == 1:
        return tuple(parts[0])
    return tuple(torch.cat(outs) for outs in zip(*parts, strict=True))


def _abs_max(rows: Tensor) -> tuple[Tensor]:
    return (rows.abs().amax(1),)


def _min_max(rows: Tensor) -> tuple[Tensor, Tensor]:
    return _positive_zero(rows.amin(1)), _positive_zero(rows.amax(1))


def _positive_zero(t: Tensor) -> Tensor:
    """``t`` with -0.0 as +0.0: which zero a minimum or maximum returns among zeros of both
    signs depends on the order of the reduction, which differs between eager, compiled and
    native code."""
    return torch.where(t == 0, torch.zeros_like(t), t)


#: per-row ``max |x|`` (exact in any order, so compiled and eager agree)
abs_max_rows = Kernel(_abs_max, "abs_max_rows")
#: per-row minimum and maximum (zeros as +0.0), in one pass when compiled
min_max_rows = Kernel(_min_max, "min_max_rows")
