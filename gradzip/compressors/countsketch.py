"""Count sketch with a shared support bitmap (TAGC-style): the arithmetic, no communication.

Source: Polyakov et al., "TAGC: Optimizing Gradient Communication in Distributed Transformer
Training" (EuroMLSys 2025, arXiv 2504.05638), after lossless homomorphic compression. The two
collectives (an OR of the bitmaps, a sum of the sketches) are in
:mod:`gradzip.comm.countsketch`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from gradzip.compressors import register
from gradzip.compressors.base import Compressor, Payload, check_int, check_ratio, kept_count, seeded_generator
from gradzip.compressors.kernels import native, wire
from gradzip.compressors.kernels.placement import to_device

#: the Mersenne prime of the hash polynomials: a product of two residues stays below 2^62 in int64
_PRIME = (1 << 31) - 1


#: the most sketch columns per kept entry (far past where peeling stops needing more)
MAX_WIDTH = 1e4

#: what each rank's sketch holds: its values on the OR-ed support, or only its own kept ones
FILLS = ("union", "own")

#: coefficients per hash polynomial: degree 3, so the family is 4-wise independent
_TERMS = 4


def _poly(coeffs: Tensor, i: Tensor) -> Tensor:
    """``(c_0 i^3 + c_1 i^2 + c_2 i + c_3) mod p`` per row of ``coeffs`` (``rows x 4``) by Horner,
    reduced after every product so that each stays below ``2^62`` in int64."""
    out = coeffs[:, 0:1].expand(-1, i.shape[1])
    for t in range(1, _TERMS):
        out = (out * i + coeffs[:, t : t + 1]) % _PRIME
    return out


@dataclass(frozen=True)
class Hashes:
    """``rows`` hash functions, the same on every rank for the same ``(seed, step, key)``.

    Row ``j`` sends coordinate ``i`` to column ``h_j(i) mod cols`` with sign ``+1`` or ``-1``
    from the low bit of ``g_j(i)``, where ``h_j`` and ``g_j`` are random polynomials of degree 3
    over the integers modulo the prime ``p = 2^31 - 1`` (``i`` taken modulo ``p``): a 4-wise
    independent family. A linear hash ``(a i + b) mod p`` would be only pairwise independent,
    and its collisions are translation-invariant (``i`` and ``i + d`` collide in a row for the
    same ``d`` whatever ``i``), which builds sets of 8 coordinates colliding in every row of 3
    (the corners of a cube) that peeling cannot resolve even far above its threshold.
    """

    coeffs: Tensor  # rows x 8 int64: the column polynomial's coefficients, then the sign's
    cols: int

    @classmethod
    def draw(cls, seed: int, step: int, key: Hashable, rows: int, cols: int) -> Hashes:
        gen = seeded_generator(seed, step, key)
        return cls(torch.randint(1, _PRIME, (rows, 2 * _TERMS), generator=gen, dtype=torch.int64), cols)

    def cells(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Columns (``rows x len(index)`` int64) and signs (fp32, +-1) of the coordinates ``index``."""
        coeffs = to_device(self.coeffs, index.device)  # drawn on the host: the same on every device
        done = native.hash_cells(coeffs, index.reshape(-1), self.cols)  # the same integers, in C on the CPU
        if done is not None:
            return done
        i = (index.reshape(1, -1) % _PRIME).to(torch.int64)
        cols = _poly(coeffs[:, :_TERMS], i) % self.cols
        signs = (_poly(coeffs[:, _TERMS:], i) & 1).to(torch.float32).mul_(2).sub_(1)
        return cols, signs


@dataclass(frozen=True)
class Located:
    """The coordinates of a support (``index``, int64, ascending) and their cells under
    ``hashes`` (``cols``, ``signs``: :meth:`Hashes.cells`), what :func:`sketch` and :func:`peel`
    read: hashed once where one step sketches and decodes the same support."""

    index: Tensor
    hashes: Hashes
    cols: Tensor
    signs: Tensor

    @classmethod
    def of(cls, index: Tensor, hashes: Hashes) -> Located:
        return cls(index, hashes, *hashes.cells(index))


def sketch(values: Tensor, where: Located) -> Tensor:
    """The count sketch (``rows x cols`` fp32) of a sparse vector: ``values`` at ``where.index``."""
    cols, signs, n_cols = where.cols, where.signs, where.hashes.cols
    rows = cols.shape[0]
    # Summed in float64 and saturated at the fp32 range: cells of values near the fp32 maximum
    # would otherwise overflow, and +inf and -inf in one cell make the NaN marker.
    out = torch.zeros(rows * n_cols, dtype=torch.float64, device=values.device)
    offsets = (torch.arange(rows, device=values.device) * n_cols).reshape(-1, 1)
    out.index_add_(0, (cols + offsets).reshape(-1), (signs.double() * values.double().reshape(1, -1)).reshape(-1))
    limit = torch.finfo(torch.float32).max
    return out.clamp_(-limit, limit).float().view(rows, n_cols)


def _first_true_row(mask: Tensor) -> Tensor:
    """Per column of ``mask`` (``rows x n`` bool), the first row that is True (0 where none is).

    A masked select per row, last row first: ``argmax`` over the strided row axis of a mask
    as wide as the support cost ten times as much, and it ran once per peeling round.
    """
    first = torch.zeros(mask.shape[1], dtype=torch.int64, device=mask.device)
    for row in range(mask.shape[0] - 1, -1, -1):
        first = torch.where(mask[row], row, first)
    return first


def peel(table: Tensor, where: Located) -> tuple[Tensor, Tensor]:
    """Values at ``where.index`` (the known support) from a count sketch ``table`` (``rows x
    cols``), and which of them are exact.

    Peeling: a cell that holds exactly one coordinate of the support gives that coordinate's
    value (times its sign); the value is subtracted from its cells in every row, which may
    leave other cells with one coordinate; repeat until nothing changes. Coordinates still
    unresolved (a 2-core of the hash graph) get the median over rows of their cells' signed
    remainders, an estimate biased by the collisions. Arithmetic in float64; the same on every
    rank for the same inputs.

    Returns:
        ``(values, peeled)``: float64 values of ``len(index)`` coordinates, and a bool tensor of
        the same length, True where peeling resolved the coordinate (its value is exact up to
        float rounding).
    """
    rows, n_cols = table.shape
    n = where.index.numel()
    device = where.index.device
    cols, signs = where.cols, where.signs
    flat_cells = (cols + (torch.arange(rows, device=device) * n_cols).reshape(-1, 1)).reshape(rows, -1)
    rest = table.double().reshape(-1).clone()
    signs = signs.double()
    # int32 counts: a cell holds at most len(index) coordinates, and reading half the bytes
    # matters, since every round reads the count of every open coordinate's cells.
    counts = torch.zeros(rows * n_cols, dtype=torch.int32, device=device)
    counts.index_add_(0, flat_cells.reshape(-1), torch.ones(flat_cells.numel(), dtype=torch.int32, device=device))
    values = torch.zeros(n, dtype=torch.float64, device=device)
    left = native.peel(flat_cells, signs, rest, counts, values)  # the same rounds in C, on the CPU
    if left is None:
        left = _peel_rounds(flat_cells, signs, rest, counts, values)
    peeled = torch.ones(n, dtype=torch.bool, device=device)
    if left.numel():
        estimates = signs.index_select(1, left) * rest.take(flat_cells.index_select(1, left))
        values[left] = estimates.median(0).values if rows % 2 else estimates.quantile(0.5, dim=0)
        peeled[left] = False
    return values, peeled


def _peel_rounds(flat_cells: Tensor, signs: Tensor, rest: Tensor, counts: Tensor, values: Tensor) -> Tensor:
    """:func:`peel`'s rounds in torch operations (any device): ``rest``, ``counts`` and
    ``values`` changed in place; returns the coordinates left open (ascending)."""
    n = flat_cells.shape[1]
    device = flat_cells.device
    # Each round looks only at the coordinates still open (``left``, their cells ``open_cells``),
    # so a round costs what is left, not the whole support (near the peeling threshold the rounds
    # are many and the tail is long). index_select and take rather than advanced indexing: the
    # same elements, at a fraction of the cost on the CPU.
    left = torch.arange(n, device=device)
    open_cells = flat_cells
    while left.numel():
        pure = counts.take(open_cells) == 1  # rows x open coordinates
        found = pure.any(0)
        found_at = found.nonzero().squeeze(1)
        if not found_at.numel():
            break
        row = _first_true_row(pure.index_select(1, found_at))
        pick = left.index_select(0, found_at)
        picked_cells = open_cells.index_select(1, found_at)  # rows x peeled now
        peeled_values = signs.reshape(-1).take(row * n + pick) * rest.take(picked_cells.gather(0, row.reshape(1, -1))[0])
        values.index_copy_(0, pick, peeled_values)
        still_open = (~found).nonzero().squeeze(1)
        left = left.index_select(0, still_open)
        open_cells = open_cells.index_select(1, still_open)
        # Take the peeled coordinates out of every row's cells.
        cells = picked_cells.reshape(-1)
        rest.index_add_(0, cells, -(signs.index_select(1, pick) * peeled_values.reshape(1, -1)).reshape(-1))
        counts.index_add_(0, cells, torch.full((cells.numel(),), -1, dtype=torch.int32, device=device))
    return left


@register
class CountSketch(Compressor):
    """Threshold sparsification sent as a shared support bitmap and a count sketch of the values.

    Source: Polyakov et al., "TAGC: Optimizing Gradient Communication in Distributed Transformer
    Training" (EuroMLSys 2025, arXiv 2504.05638), after lossless homomorphic compression.

    Each rank keeps the ``k = clamp(round(ratio * numel), 1, numel)`` largest-magnitude nonzero
    entries of its (error-compensated) flat tensor (exactly ``k``, ties broken by
    ``torch.topk``; fewer where fewer are nonzero). It sends (1) the bitmap of the kept coordinates,
    packed one bit per element, combined across ranks by a bitwise OR into the support, and (2) a
    count sketch (``rows x cols`` fp32, ``cols = ceil(width * k)``) of its values divided by
    world_size, summed across ranks; the hashes (:class:`Hashes`) are drawn from
    ``(seed, step, key)``. Which values the sketch holds is ``fill``:

    - ``fill="union"`` (the default): the bitmaps are OR-ed first, as TAGC's code does, and each
      rank sketches its values at every coordinate of the support, not only at its own kept ones
      (at those of another rank's, TAGC's sparsified gradient holds zeros). The decode is the
      mean of the compensated tensors on the support, and each residual keeps only what lies
      off the support. The same bytes, two rounds in sequence.
    - ``fill="own"``: each rank sketches only its own kept values (TAGC's values), and the bitmap
      and the sketch travel together in one round. The decode is the mean of the sparsified
      tensors; each residual keeps what its own thresholding dropped.

    Every rank decodes the support from the summed sketch by peeling (:func:`peel`) and gets
    bit-identical results. :meth:`compress` and :meth:`decompress` (one payload, no exchange)
    sketch the rank's own kept values.

    Exact recovery: where the support's hash graph peels completely (with 3 rows, about when
    ``rows * cols > 1.23 * |support|``; the support is the union over ranks, up to
    ``world_size * k``) the decode is exact up to float rounding. Otherwise the coordinates left
    (all ranks see the same ones; the reducer's metrics count them as ``unpeeled``) get median
    estimates, which collisions bias. Aggregatable (the sketch is linear and the bitmap an OR);
    biased (thresholding), with error feedback of what is not sent; collision errors after
    aggregation are not fed back.

    TAGC's defaults (its reference training script): 80% of the entries dropped (``ratio=0.2``
    here), a sketch of ``numel / 2`` cells (its ``compress_ratio=2``; here ``rows * cols`` with
    ``width = 5/6`` at ``ratio=0.2`` and 3 rows), and only the large layers compressed: GPT-2's
    MLP and embedding matrices, attention and everything smaller sent dense. Its policy tests the
    size of each FSDP unit; ``min_numel`` does the same for DDP buckets (a bucket with fewer
    elements is sent dense), and under FSDP :func:`gradzip.fsdp.compress_reduce_scatter` takes a
    codec per module (each module's buffer goes through this codec's reducer whole, and each
    rank keeps its rows). The default ``min_numel=0`` compresses every bucket.

    What differs from TAGC: ``fill="union"`` (above; both are measured on the demo job in
    ``benchmarks/results/remedies_main_job``). TAGC's code sums packed uint8 bitmaps, which
    carries into neighbouring bits; here the bitmaps are OR-ed (``ReduceOp.BOR`` on gloo; MAX on
    one byte per element on backends without BOR). The kept set is exactly the top ``k`` by magnitude. TAGC's threshold
    is the largest value on a fixed ladder (1e-20 to 0.5) that drops less than the fraction, so
    it keeps more: a third of the demo model's gradient at 0.8 dropped, whose union over 3
    ranks (54% of the coordinates) a sketch of half the entries cannot peel (16% decoded
    exactly). TAGC's sketch is the lossless-homomorphic-compression layout in blocks of 1,024
    elements; here a count sketch of ``rows`` hash rows with 4-wise independent hashes.

    Args:
        ratio: fraction of entries each rank keeps, in (0, 1].
        rows: hash rows of the sketch, an integer in [1, 15] (odd counts give a true median).
        width: sketch columns per kept entry, a number in (0, 1e4]; the default 5/6 gives
            TAGC's sketch of ``numel / 2`` cells at ``ratio=0.2`` and 3 rows (raise it with a
            smaller ``ratio``: the support peels completely only below about
            ``rows * cols / 1.23`` coordinates).
        min_numel: flat tensors (buckets) with fewer elements are sent dense, an integer >= 0.
        seed: seed of the hashes (the same on every rank), an integer >= 0.
        start_step: steps of plain all_reduce before compression starts (>= 0).
        fill: ``"union"`` or ``"own"``: which values each rank sketches (above).

    Payload per flat tensor of ``numel`` elements: ``ceil(numel / 8) + rows * cols * 4`` bytes
    (bitmap and fp32 sketch), whatever ``fill``; on backends without BOR the bitmap is ``numel``
    bytes. A tensor below ``min_numel``, before ``start_step``, or whose payload would not be
    smaller than its raw bytes travels dense (``numel * itemsize``): at the defaults (2.125 bytes per element)
    every fp16 or bf16 tensor does; give those a smaller ``ratio`` or ``width``.

    Raises:
        ValueError: naming the parameter, for ``ratio`` outside (0, 1], ``rows`` outside
            [1, 15], ``width`` outside (0, 1e4], ``seed < 0``, ``start_step < 0``,
            ``min_numel < 0`` or ``fill`` not ``"union"`` or ``"own"``.
    """

    name = "countsketch"
    host_reads = "the kept coordinates (a nonzero), the peeling rounds of the decode and the non-finite checks"
    aggregatable = True
    unbiased = False
    needs_shared_seed = True
    error_feedback = True
    own_reducer = "gradzip.comm.countsketch:CountSketchReducer"  # the bitmap is OR-ed, the sketch summed

    def __init__(
        self,
        *,
        ratio: float = 0.2,
        rows: int = 3,
        width: float = 5 / 6,
        seed: int = 0,
        start_step: int = 0,
        min_numel: int = 0,
        fill: str = "union",
    ) -> None:
        super().__init__(ratio=ratio, rows=rows, width=width, seed=seed, start_step=start_step, min_numel=min_numel,
                         fill=fill)
        self.ratio = check_ratio(ratio)
        self.rows = check_int(rows, name="rows", low=1, high=15)
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width <= MAX_WIDTH:
            raise ValueError(f"width must be a number in (0, {MAX_WIDTH:g}]; got {width!r}")
        self.width = float(width)
        self.seed = check_int(seed, name="seed", low=0)
        self.start_step = check_int(start_step, name="start_step", low=0)
        self.min_numel = check_int(min_numel, name="min_numel", low=0)
        if fill not in FILLS:
            raise ValueError(f"fill must be one of {', '.join(FILLS)}; got {fill!r}")
        self.fill = fill

    def cols(self, numel: int) -> int:
        """Sketch columns for a tensor of ``numel`` elements: ``ceil(width * k)``."""
        return max(1, math.ceil(self.width * kept_count(numel, self.ratio)))

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32, *, packed: bool = True) -> int:
        """``ceil(numel / 8) + rows * cols * 4`` (``numel + ...`` with an unpacked bitmap); 0 for
        an empty tensor."""
        if numel == 0:
            return 0
        bitmap = wire.packed_nbytes(numel, 1) if packed else numel
        return bitmap + self.rows * self.cols(numel) * 4

    def hashes(self, numel: int, *, step: int, key: Hashable) -> Hashes:
        """The hashes of a tensor of ``numel`` elements at ``step``."""
        return Hashes.draw(self.seed, step, key, self.rows, self.cols(numel))

    def keep(self, x: Tensor) -> Tensor:
        """The kept mask of flat ``x``: its ``k`` largest magnitudes that are nonzero.

        Exactly ``k`` (ties broken by ``torch.topk``): keeping every entry tied with the
        ``k``-th would let a constant tensor put its whole support into a sketch sized for ``k``.
        """
        magnitude = x.abs()
        k = kept_count(x.numel(), self.ratio)
        mask = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        mask[torch.topk(magnitude.float(), k, sorted=False).indices] = True
        return mask & (magnitude > 0)

    def encode(self, x: Tensor, *, step: int, key: Hashable, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
        """``(mask, bitmap, table)`` of flat ``x``: the kept mask, its packed bitmap (uint8) and
        the sketch (``rows x cols`` fp32) of the kept values times ``scale``."""
        mask = self.keep(x.reshape(-1))
        return mask, wire.pack_bits(mask, 1), self.sketch_on(x, mask, step=step, key=key, scale=scale)

    def locate(self, support: Tensor, *, step: int, key: Hashable) -> Located:
        """The coordinates of ``support`` (a bool mask of a flat tensor's numel) and their cells at
        ``step``: pass it to :meth:`sketch_on` and :meth:`decode_peeled` to hash them once."""
        index = support.reshape(-1).nonzero().reshape(-1)
        return Located.of(index, self.hashes(support.numel(), step=step, key=key))

    def sketch_on(self, x: Tensor, support: Tensor | Located, *, step: int, key: Hashable, scale: float = 1.0) -> Tensor:
        """The sketch (``rows x cols`` fp32) of flat ``x``'s values times ``scale`` at the
        coordinates of ``support`` (a bool mask, ``x``'s numel, or its :meth:`locate`), sized for
        ``x``'s numel."""
        flat = x.reshape(-1)
        where = support if isinstance(support, Located) else self.locate(support, step=step, key=key)
        return sketch(flat[where.index].float() * scale, where)

    def decode(self, support: Tensor, table: Tensor, *, step: int, key: Hashable, like: Tensor) -> Tensor:
        """The vector with support ``support`` (a bool mask, ``like``'s numel) whose sketch is
        ``table``, in ``like``'s shape and dtype (saturated at its range); coordinates that do
        not peel take median estimates."""
        return self.decode_peeled(support, table, step=step, key=key, like=like)[0]

    def decode_peeled(self, support: Tensor | Located, table: Tensor, *, step: int, key: Hashable,
                      like: Tensor) -> tuple[Tensor, int]:
        """:meth:`decode` and how many coordinates of the support did not peel; ``support`` may be
        its :meth:`locate` at ``step``."""
        where = support if isinstance(support, Located) else self.locate(support, step=step, key=key)
        index = where.index
        values, peeled = peel(table, where)
        out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        limit = torch.finfo(like.dtype).max
        out[index] = values.clamp(-limit, limit).to(like.dtype)
        return out.view(like.shape), int(index.numel() - peeled.sum())

    def compress(self, x: Tensor, *, step: int = 0, key: Hashable = 0) -> Payload:
        """One rank's payload ``(bitmap, sketch)``; ``ctx`` keeps ``(step, key)`` for the hashes."""
        _, bitmap, table = self.encode(x, step=step, key=key)
        return Payload((bitmap, table.reshape(-1)), ctx=(step, key))

    def decompress(self, payload: Payload, *, like: Tensor) -> Tensor:
        """Decode one payload (or the OR of bitmaps with the sum of sketches) into ``like``'s
        shape and dtype."""
        step, key = payload.ctx
        bitmap, table = payload.tensors
        support = wire.unpack_bits(bitmap, 1, like.numel()).bool()
        return self.decode(support, table.view(self.rows, -1), step=step, key=key, like=like)
