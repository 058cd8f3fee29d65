"""Pallas GPU kernel (Triton backend): an atomic-free, deterministic CSR x dense product.

Design (details, tile table and machine-code checks in ``docs/gpu.md``):

* **Lanes.** A program owns ``block_m`` *lanes*; a lane reduces one short row (at
  most :data:`CHUNK` nonzeros) or one chunk of a long row. Each step loads a
  ``(block_k, block_m)`` tile of column indices and gathers the ``(block_k, block_m,
  block_n)`` rows of ``x`` with one integer-array indexer, then reduces over
  ``block_k`` in float32 registers. ``block_k`` nonzeros of every lane are in flight
  at once instead of one dependent load per nonzero.
* **Fixed-order passes, no atomics.** Pass 1 reduces the chunks of rows longer than
  :data:`CHUNK` into float32 *partials* (one row each); pass 1b reduces the partials
  of rows with more than :data:`CHUNK` of them in groups of :data:`CHUNK` (same
  buffer, later slots). Pass 2 writes every output row exactly once, in the result
  dtype: a short row from its gathered nonzeros, a long row by reducing its partials
  (one program per long row, the partials tiled over all of its lanes). No
  zero-initialised output, no output aliasing, no padding slice; and since every sum
  has a fixed order, results are bit-for-bit deterministic run to run for ``sum``,
  ``max`` and ``min`` alike.
* **Host plan** (:func:`plan_lanes`, once per matrix, independent of the feature
  width): short rows are ordered by length so a program's lanes do similar work,
  unless CSR order does nearly as much useful work per distinct gathered column
  (consecutive rows that share columns stay together for cache reuse). Array
  lengths depend only on ``(m, nnz)``: matrices of one shape and nnz share one
  compilation.
* ``reduce="max"``/``"min"`` reduce int32 *order keys* (:func:`float_to_key`: float
  bits with the magnitude of negatives flipped, so integer order is float order;
  NaN maps to the winning key), so NaN propagates through any reduction order.

The tile table (:data:`TILE_TABLE`) was chosen from the Hopper machine-code check
(``tests/test_gpu_sass.py``): no spills, 128-bit loads, registers under the target.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # JAX 0.11 marks the Pallas Triton backend deprecated; it may go away.
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - exercised by a subprocess test
    pltriton = None  # type: ignore[assignment]

from jaxcsr.structure import Structure, array_namespace

__all__ = [
    "CHUNK",
    "GROUP",
    "TILE_TABLE",
    "GpuPlan",
    "MAX_GATHERED",
    "LaneStats",
    "Lanes",
    "TileConfig",
    "available",
    "default_for",
    "float_to_key",
    "key_to_float",
    "lane_capacities",
    "lane_stats",
    "plan",
    "plan_lanes",
    "product",
    "spmm",
    "tile_config",
]

CHUNK = 64
"""Most nonzeros one lane reduces: longer rows are cut into chunks of this many."""
GROUP = 32
"""Lanes the host plan groups by length (the widest ``block_m`` of the tile table)."""
CSR_ORDER_MIN_UTILISATION = 0.9
"""CSR row order is kept when its useful lane work per gathered column is at least
this fraction of the length-sorted order's (see :func:`lane_stats`)."""


def available() -> bool:
    """Whether this jax ships the Pallas Triton backend the kernel is written in."""
    return pltriton is not None


# ----------------------------------------------------------------- tile table
@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One kernel configuration: lanes, nonzeros per step, feature columns, warps.

    Each is a power of two; ``block_n`` at least 16 (rows of whole 16-byte vectors) and
    the gathered elements per thread,
    ``block_m * block_k * block_n / (32 * num_warps)``, at most :data:`MAX_GATHERED`.
    :func:`tile_config` gives the tuned one for a width and dtype.
    """

    block_m: int
    block_k: int
    block_n: int
    num_warps: int

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_n", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig: {name} must be a power of two, got {value!r}")
        if self.block_n < 16:
            raise ValueError(f"TileConfig: block_n must be at least 16, got {self.block_n}")
        gathered = self.block_m * self.block_k * self.block_n // (32 * self.num_warps)
        if gathered > MAX_GATHERED:
            raise ValueError(
                f"TileConfig: {gathered} gathered elements per thread, more than "
                f"{MAX_GATHERED}: {self}"
            )


MAX_GATHERED = 64
"""Gathered elements per thread a :class:`TileConfig` may ask for: the bound every entry
of :data:`TILE_TABLE` keeps, whose Hopper machine code the tests check for spills."""


# (feature width rounded up to a power of two, bytes per operand element) -> config.
# block_k * block_m * block_n / (32 * num_warps) gathered elements per thread stay at
# 64 or fewer; block_n covers whole 16-byte vectors. See docs/gpu.md for the SASS table.
TILE_TABLE: dict[tuple[int, int], TileConfig] = {
    (16, 4): TileConfig(32, 16, 16, 4),
    (32, 4): TileConfig(32, 8, 32, 4),
    (64, 4): TileConfig(16, 8, 64, 4),
    (128, 4): TileConfig(8, 8, 128, 4),
    (256, 4): TileConfig(4, 8, 256, 4),
    (16, 2): TileConfig(32, 16, 16, 4),
    (32, 2): TileConfig(32, 8, 32, 4),
    (64, 2): TileConfig(16, 8, 64, 4),
    (128, 2): TileConfig(8, 8, 128, 4),
    (256, 2): TileConfig(4, 8, 256, 4),
}


def tile_config(n_features: int, dtype: Any = jnp.float32) -> TileConfig:
    """The :data:`TILE_TABLE` entry for a feature width and operand dtype.

    Widths round up to a power of two between 16 and 256; wider operands take
    several column blocks of 256.
    """
    width = 16
    while width < min(n_features, 256):
        width *= 2
    return TILE_TABLE[(width, min(np.dtype(dtype).itemsize, 4))]


# ------------------------------------------------------------------ order keys
_FLIP = 0x7FFFFFFF
_INT32_MAX = 2**31 - 1
_INT32_MIN = -(2**31)


def float_to_key(v: jax.Array, reduce: str) -> jax.Array:
    """float32 -> int32 key with the same order; NaN maps to the winning extreme."""
    bits = lax.bitcast_convert_type(v, jnp.int32)
    key = jnp.where(bits < 0, bits ^ _FLIP, bits)
    nan_key = _INT32_MAX if reduce == "max" else _INT32_MIN
    return jnp.where(jnp.isnan(v), jnp.int32(nan_key), key)


def key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of :func:`float_to_key`; the max NaN key decodes to +NaN, the min one to -NaN."""
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ _FLIP, key), jnp.float32)


def _identity_key(reduce: str) -> int:
    """Key of -inf (max) or +inf (min), computed on the host (a Python int)."""
    bits = int(np.array(-np.inf if reduce == "max" else np.inf, np.float32).view(np.int32))
    return bits ^ _FLIP if bits < 0 else bits


# ------------------------------------------------------------------ host plan
@dataclasses.dataclass(frozen=True)
class Lanes:
    """The passes' lanes for one CSR orientation (host-planned, device arrays).

    Pass 1 (chunks of long rows): chunk ``c`` reduces nonzeros
    ``chunk_start[c]:chunk_end[c]`` into partial ``c``. Pass 1b (rows with more than
    :data:`CHUNK` partials): group ``g`` reduces partials ``group_start[g]:group_end[g]``
    into partial ``num_chunk_slots + g``. Pass 2 (one lane per row): lane ``l`` writes
    output row ``row[l]``; the first ``num_short[0]`` lanes are short rows reducing
    nonzeros ``start[l]:end[l]``, the rest long rows reducing partials
    ``start[l]:end[l]`` (chunk partials, or group partials where there are groups).
    Unused slots are empty (``start == end``).

    Lengths: ``row/start/end`` have ``m`` entries, ``chunk_*`` and ``group_*``
    :func:`lane_capacities` -- functions of ``(m, nnz)`` only.
    """

    row: Any
    start: Any
    end: Any
    num_short: Any
    chunk_start: Any
    chunk_end: Any
    group_start: Any
    group_end: Any


jax.tree_util.register_dataclass(
    Lanes, data_fields=[f.name for f in dataclasses.fields(Lanes)], meta_fields=[]
)


def lane_capacities(num_rows: int, nnz: int) -> tuple[int, int, int]:
    """``(chunk slots, group slots, long-row bound)`` for any ``(num_rows, .)`` structure
    with ``nnz`` nonzeros (slots rounded up to whole groups of :data:`GROUP` lanes).

    A long row has more than :data:`CHUNK` nonzeros, so there are at most
    ``nnz // (CHUNK + 1)`` of them, and a row of length ``L`` makes
    ``ceil(L / CHUNK) <= L / CHUNK + 1`` chunks: ``nnz // CHUNK + long rows`` chunk
    slots always suffice. Likewise a row with more than ``CHUNK`` partials (over
    ``CHUNK**2`` nonzeros) makes ``ceil(partials / CHUNK)`` groups.
    """
    long_rows = min(num_rows, nnz // (CHUNK + 1))
    chunks = nnz // CHUNK + long_rows
    groups = chunks // CHUNK + min(num_rows, nnz // (CHUNK * CHUNK + 1))
    return chunks + (-chunks) % GROUP, groups + (-groups) % GROUP, long_rows


def _issued(lengths):
    """Lane slots issued when lanes go ``GROUP`` at a time in this order (each group
    as long as its longest lane; zero lanes past the real ones add nothing)."""
    xp = array_namespace(lengths)
    groups = xp.pad(lengths, (0, (-lengths.shape[0]) % GROUP)).reshape(-1, GROUP)
    return xp.sum(xp.max(groups, axis=1, initial=0)) * GROUP


def _utilisation(lengths: np.ndarray) -> float:
    """Useful / issued lane slots when lanes go ``GROUP`` at a time in this order."""
    if lengths.size == 0 or lengths.sum() == 0:
        return 1.0
    return float(lengths.sum() / int(_issued(lengths)))


_MIN_UTILISATION = fractions.Fraction(str(CSR_ORDER_MIN_UTILISATION))


def _csr_order_by_lanes(issued_csr, issued_sorted):
    """Without column reuse (segment matrices): CSR order wins when its issued slots
    are at most ``1 / CSR_ORDER_MIN_UTILISATION`` times the sorted order's, decided in
    integers so that the host and the device plan choose alike."""
    num, den = _MIN_UTILISATION.numerator, _MIN_UTILISATION.denominator
    return den * issued_sorted >= num * issued_csr


REUSE_SAMPLE = 1 << 20
"""Most nonzeros the column-reuse estimate looks at (whole windows, evenly spread)."""


def _distinct_fraction(rows: np.ndarray, indptr: np.ndarray, indices) -> float:
    """Distinct columns per nonzero over windows of ``GROUP`` consecutive lanes (rows
    in this order): what a program's gathers could find in cache; 1.0 without
    ``indices`` (e.g. segment matrices, whose every column is used once)."""
    lengths = (indptr[1:][rows] - indptr[:-1][rows]).astype(np.int64)
    total = int(lengths.sum())
    if indices is None or total == 0:
        return 1.0
    stride = -(-total // REUSE_SAMPLE)  # estimate from every stride-th window
    if stride > 1:
        keep = (np.arange(rows.size) // GROUP) % stride == 0
        rows, lengths = rows[keep], lengths[keep]
        total = int(lengths.sum())
        if total == 0:
            return 1.0
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.arange(total) - first + np.repeat(indptr[:-1][rows].astype(np.int64), lengths)
    window = np.repeat(np.arange(rows.size, dtype=np.int64) // GROUP, lengths)
    keys = window * (int(np.max(indices, initial=0)) + 1) + np.asarray(indices)[positions]
    keys.sort()  # distinct keys by a sort (numpy 2's hashing np.unique is slower here)
    return float((1 + np.count_nonzero(keys[1:] != keys[:-1])) / total)


@dataclasses.dataclass(frozen=True)
class LaneStats:
    """How well a plan fills its lanes (host-side report, not part of the plan).

    Attributes:
      short_rows / long_rows / chunks: lane counts of the passes.
      csr_order: whether short rows keep CSR order (else sorted by length).
      utilisation: useful / issued nonzero slots of the short-row lanes, in groups
        of :data:`GROUP` lanes (1.0: every lane of a group is as long as the longest),
        for CSR order and for length order.
      distinct: distinct columns per nonzero in those groups, for both orders (lower:
        more column reuse within a program).
    """

    short_rows: int
    long_rows: int
    chunks: int
    csr_order: bool
    utilisation_csr: float
    utilisation_sorted: float
    distinct_csr: float
    distinct_sorted: float

    @property
    def utilisation(self) -> float:
        """Lane utilisation of the order the plan uses."""
        return self.utilisation_csr if self.csr_order else self.utilisation_sorted


def _short_row_order(indptr, indices, short_rows) -> tuple[np.ndarray, tuple]:
    """Lane order of the short rows and the numbers behind the choice.

    Rows go by length (stable) unless CSR order does at least
    :data:`CSR_ORDER_MIN_UTILISATION` as much useful work per gathered byte:
    ``utilisation / distinct`` (lane work that is not wasted, over the columns a
    program fetches). Returns ``(rows, (csr_order, util_csr, util_sorted,
    distinct_csr, distinct_sorted))``.
    """
    lengths = (indptr[1:][short_rows] - indptr[:-1][short_rows]).astype(np.int64)
    order = np.argsort(lengths, kind="stable")
    by_length = short_rows[order]
    util_csr = _utilisation(lengths)
    util_sorted = _utilisation(lengths[order])
    distinct_csr = _distinct_fraction(short_rows, indptr, indices)
    distinct_sorted = _distinct_fraction(by_length, indptr, indices)
    if indices is None:
        csr = _csr_order_by_lanes(int(_issued(lengths)), int(_issued(lengths[order])))
    else:
        csr = util_csr / distinct_csr >= CSR_ORDER_MIN_UTILISATION * util_sorted / distinct_sorted
    numbers = (bool(csr), util_csr, util_sorted, distinct_csr, distinct_sorted)
    return (short_rows if csr else by_length), numbers


def lane_stats(indptr: np.ndarray, indices=None) -> LaneStats:
    """:class:`LaneStats` of :func:`plan_lanes` for this CSR structure."""
    indptr = np.asarray(indptr)
    lengths = np.diff(indptr).astype(np.int64)
    is_long = lengths > CHUNK
    _, numbers = _short_row_order(indptr, indices, np.flatnonzero(~is_long))
    chunks = int((-(-lengths[is_long] // CHUNK)).sum())
    return LaneStats(int((~is_long).sum()), int(is_long.sum()), chunks, *numbers)


def _split(counts, starts, ends, slots: int, size: int):
    """Ranges ``starts[i]:ends[i]`` cut into ``counts[i]`` pieces of at most ``size``,
    in order, laid out range after range in ``slots`` places (numpy or ``jnp``, as the
    arrays are); places past the last piece are ``(0, 0)``. Returns ``(start, end)``."""
    xp, dtype = array_namespace(counts), counts.dtype
    owner_end = xp.cumsum(counts, dtype=dtype)
    piece = xp.arange(slots, dtype=dtype)
    owner = xp.searchsorted(owner_end, piece, side="right")
    real = owner < counts.shape[0]
    owner = xp.minimum(owner, counts.shape[0] - 1)
    start = starts[owner] + (piece - (owner_end - counts)[owner]) * size
    end = xp.minimum(start + size, ends[owner])
    zero = xp.zeros((), dtype)
    return xp.where(real, start, zero), xp.where(real, end, zero)


def plan_lanes(indptr, indices=None, *, nnz: int | None = None) -> Lanes:
    """Plans the passes for a CSR row pointer: numpy arrays for a numpy ``indptr``
    (host, once per matrix), ``jnp`` ones (valid under a trace) otherwise, element for
    element the same.

    Args:
      indptr: ``(m + 1,)`` row pointer.
      indices: host column indices, only to inform the lane order (column reuse,
        :func:`lane_stats`); ``None`` when every column is used once (segment
        matrices) or on the device, where estimating reuse would cost two sorts a call.
      nnz: stored entries (static: the capacities depend on it); defaults to
        ``indptr[-1]``, which a traced ``indptr`` cannot give.
    """
    xp, dtype = array_namespace(indptr), indptr.dtype
    m = indptr.shape[0] - 1
    if nnz is None:
        if xp is not np:
            raise ValueError("plan_lanes: nnz is required for a device indptr")
        nnz = int(indptr[-1])
    if indices is not None and xp is not np:
        raise ValueError("plan_lanes: indices (the column-reuse estimate) are host-only")
    num_chunks, num_groups, _ = lane_capacities(m, nnz)
    if m == 0:
        empty, slots = xp.zeros((0,), dtype), xp.zeros((num_chunks,), dtype)
        groups = xp.zeros((num_groups,), dtype)
        return Lanes(empty, empty, empty, xp.zeros((1,), dtype), slots, slots, groups, groups)
    lengths = xp.diff(indptr)
    is_long = lengths > CHUNK
    num_short = xp.sum(~is_long).astype(dtype)

    # Pass 1: chunks of long rows, row by row (a row's partials are contiguous).
    pieces = xp.where(is_long, -(-lengths // CHUNK), 0).astype(dtype)
    chunk_start, chunk_end = _split(pieces, indptr[:-1], indptr[1:], num_chunks, CHUNK)
    # Pass 1b: rows with more than CHUNK partials reduce them CHUNK at a time into
    # group partials, stored after the chunk slots of the same buffer.
    partial_end = xp.cumsum(pieces, dtype=dtype)
    partial_start = partial_end - pieces
    many = pieces > CHUNK
    groups = xp.where(many, -(-pieces // CHUNK), 0).astype(dtype)
    group_start, group_end = _split(groups, partial_start, partial_end, num_groups, CHUNK)
    group_slot_end = num_chunks + xp.cumsum(groups, dtype=dtype)
    long_start = xp.where(many, group_slot_end - groups, partial_start)
    long_end = xp.where(many, group_slot_end, partial_end)

    # Pass 2: short rows in CSR order or by length (stable), then long rows.
    # (int8 keys: short lengths and the long rows' CHUNK + 1 fit; numpy radix-sorts them)
    by_csr = xp.argsort(is_long, stable=True).astype(dtype)
    key = xp.where(is_long, CHUNK + 1, lengths).astype(xp.int8)
    by_length = xp.argsort(key, stable=True).astype(dtype)
    if indices is None:
        short_lengths = xp.where(is_long, 0, lengths)
        csr = _csr_order_by_lanes(_issued(short_lengths[by_csr]), _issued(short_lengths[by_length]))
    else:
        _, (csr, *_) = _short_row_order(indptr, indices, np.flatnonzero(~is_long))
    row = xp.where(csr, by_csr, by_length)
    short = xp.arange(m, dtype=dtype) < num_short
    start = xp.where(short, indptr[:-1][row], long_start[row])
    end = xp.where(short, indptr[1:][row], long_end[row])
    return Lanes(
        row=row,
        start=start,
        end=end,
        num_short=xp.reshape(num_short, (1,)),
        chunk_start=chunk_start,
        chunk_end=chunk_end,
        group_start=group_start,
        group_end=group_end,
    )


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """What the Triton kernel reads beyond the portable core.

    Attributes:
      lanes: lanes of the planned orientation ``C``.
      t_lanes: lanes of ``C.T`` for ``"general"`` structures; ``None`` for the
        ``"columns"`` kind, whose transpose is a row gather (XLA's own gather does
        what a kernel would: one load per output row).
    """

    lanes: Lanes
    t_lanes: Lanes | None


jax.tree_util.register_dataclass(GpuPlan, data_fields=["lanes", "t_lanes"], meta_fields=[])


def plan(structure: Structure) -> GpuPlan:
    """The plan of a :class:`~jaxcsr.structure.Structure`: numpy arrays for a host one
    (lane order informed by column reuse), ``jnp`` ones (valid under a trace) for one
    planned on the device."""
    indptr, t_indptr = structure.kernel_indptrs()
    nnz = structure.nnz
    if t_indptr is None:  # "columns": one entry per column, so no column is reused
        return GpuPlan(plan_lanes(indptr, nnz=nnz), None)
    host = structure.on_host
    indices, t_indices = (structure.indices, structure.t_indices) if host else (None, None)
    return GpuPlan(plan_lanes(indptr, indices, nnz=nnz), plan_lanes(t_indptr, t_indices, nnz=nnz))


def covers(view: Structure) -> bool:
    """Views the kernel runs: all but one entry per row (a row gather, which XLA runs
    with one load per output row, as a kernel would)."""
    return not view.one_per_row


def default_for(view: Structure, dtype: Any = None, reduce: str | None = "sum") -> bool:
    """Backend entry (``Coverage.default_for``): whether ``impl=None`` runs the kernel on
    a view it covers. Not for float32 sums over unsorted segment ids, where the XLA path
    was faster in most cells measured on an H200; 16-bit dtypes, max/min and general
    matrices keep the kernel, faster there in most cells (the evidence:
    ``benchmarks/results/gpu-h200/README.md``). The rule holds until a GPU measures
    again."""
    return not (
        reduce == "sum"
        and view.one_per_column
        and not view.sorted_ids
        and dtype is not None
        and np.dtype(dtype) == np.float32
    )


def describe(view: Structure, n_features: int | None = None) -> dict[str, str]:
    """How the plan fills the kernel's lanes for ``view``, and the tiles for
    ``n_features`` float32 features (host-side report for ``plan_info``)."""
    if not covers(view):
        return {"pallas_gpu": "xla gather (one entry per row)"}
    indices = None if view.layout.kind == "columns" else np.asarray(view.view_indices())
    stats = lane_stats(np.asarray(view.view_indptr()), indices)
    order = "CSR" if stats.csr_order else "length-sorted"
    distinct = stats.distinct_csr if stats.csr_order else stats.distinct_sorted
    text = (
        f"kernel: {stats.short_rows} short rows ({order}, lane utilisation "
        f"{stats.utilisation:.2f}, distinct columns per nonzero {distinct:.2f}), "
        f"{stats.long_rows} long rows in {stats.chunks} chunks"
    )
    if n_features:
        text += f"; tiles {tile_config(n_features)}"
    if not default_for(view, np.float32, "sum"):
        text += "; impl=None runs float32 sums on the XLA path (default_for)"
    return {"pallas_gpu": text}


def product(
    x: jax.Array,
    data: jax.Array | None,
    structure: Structure,
    gpu_plan: GpuPlan,
    *,
    reduce: str,
    out_dtype: Any,
    interpret: bool,
    platform: str,
) -> jax.Array:
    """Backend entry: the viewed matrix (not one-per-row: :func:`covers`) times ``x``."""
    del platform
    lanes = gpu_plan.t_lanes if structure.transposed else gpu_plan.lanes
    assert lanes is not None, "a transposed view of a planned transpose"
    return spmm(
        x,
        data,
        lanes,
        structure.view_indices(),
        num_rows=structure.shape[0],
        reduce=reduce,
        out_dtype=out_dtype,
        interpret=interpret,
    )


# --------------------------------------------------------------------- kernel
def _gather_reduce(src_ref, positions, valid, col0, block_n, n_features, scale, reduce):
    """Gathers ``src_ref[positions, col0:col0+block_n]`` and reduces over axis 0.

    ``positions``/``valid``/``scale``: ``(block_k, lanes)``; returns ``(lanes,
    block_n)`` float32 sums or int32 keys.
    """
    cols = col0 + jnp.arange(block_n)
    mask = valid[:, :, None]
    if n_features % block_n:
        mask = mask & (cols < n_features)[None, None, :]
    # All-array indexers (Pallas interpret mode does not mix them with pl.ds); the
    # column index is col0 + iota, which Triton still sees as contiguous.
    tile = pltriton.load(
        src_ref.at[positions[:, :, None], cols[None, None, :]], mask=mask, other=0
    ).astype(jnp.float32)
    if scale is not None:
        tile = tile * scale[:, :, None]
    if reduce == "sum":
        return jnp.sum(tile, axis=0)
    keys = jnp.where(mask, float_to_key(tile, reduce), jnp.int32(_identity_key(reduce)))
    return jnp.max(keys, axis=0) if reduce == "max" else jnp.min(keys, axis=0)


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    """Ceiling division of a traced integer by a static one, in ``a``'s dtype (the
    index dtype may be int32 while Python ints default to int64 under x64)."""
    return lax.div(a + (b - 1), jnp.asarray(b, a.dtype))


def _combine(acc, part, reduce):
    if reduce == "sum":
        return acc + part
    return jnp.maximum(acc, part) if reduce == "max" else jnp.minimum(acc, part)


def _init(shape, reduce):
    if reduce == "sum":
        return jnp.zeros(shape, jnp.float32)
    return jnp.full(shape, _identity_key(reduce), jnp.int32)


def _finish(acc, reduce):
    return acc if reduce == "sum" else key_to_float(acc)


def _reduce_lanes(start, end, col0, idx_ref, data_ref, x_ref, *, cfg, n_features, reduce):
    """Reduces each lane's entries ``start:end`` (``(block_m,)``): rows ``idx_ref[k]`` of
    ``x_ref`` (scaled by ``data_ref[k]``), or rows ``k`` themselves when ``idx_ref`` is
    ``None``.

    (Program ids are read by the caller: interpret mode cannot read them inside
    ``pl.when`` branches.)"""
    steps = _cdiv(jnp.max(end - start), cfg.block_k)
    offsets = jnp.arange(cfg.block_k)[:, None]

    def step(k, acc):
        pos = start[None, :] + k * cfg.block_k + offsets
        valid = pos < end[None, :]
        cols = pos if idx_ref is None else pltriton.load(idx_ref.at[pos], mask=valid, other=0)
        scale = None
        if data_ref is not None:
            scale = pltriton.load(data_ref.at[pos], mask=valid, other=0).astype(jnp.float32)
        part = _gather_reduce(x_ref, cols, valid, col0, cfg.block_n, n_features, scale, reduce)
        return _combine(acc, part, reduce)

    return lax.fori_loop(0, steps, step, _init((cfg.block_m, cfg.block_n), reduce))


def _chunk_kernel(start_ref, end_ref, *refs, cfg, gather, has_data, n_features, reduce, slot0):
    """Passes 1 and 1b: each lane reduces one chunk into its float32 partial.

    Pass 1 (``gather``) reads rows of ``x`` by column index; pass 1b reads rows of the
    partial buffer itself and writes partials from slot ``slot0`` on (the buffer is
    aliased: it reads chunk slots and writes group slots).
    """
    if gather:
        idx_ref, *refs = refs
    else:
        idx_ref = None
    data_ref, src_ref, partial_ref = refs if has_data else (None, *refs)
    lanes = pl.program_id(0) * cfg.block_m + jnp.arange(cfg.block_m)
    start, end = pltriton.load(start_ref.at[lanes]), pltriton.load(end_ref.at[lanes])
    col0 = pl.program_id(1) * cfg.block_n
    acc = _reduce_lanes(
        start, end, col0, idx_ref, data_ref, src_ref, cfg=cfg, n_features=n_features, reduce=reduce
    )
    cols = col0 + jnp.arange(cfg.block_n)
    mask = (end > start)[:, None] & (cols < n_features)[None, :]
    slots = (slot0 + lanes)[:, None]
    pltriton.store(partial_ref.at[slots, cols[None, :]], _finish(acc, reduce), mask=mask)


def _row_kernel(
    row_ref, start_ref, end_ref, num_short_ref, idx_ref, *refs, cfg, has_data, n_features, reduce
):
    """Pass 2: every output row once -- short rows from ``x``, long rows from partials."""
    data_ref, x_ref, partial_ref, out_ref = refs if has_data else (None, *refs)
    num_rows = row_ref.shape[0]
    num_short = num_short_ref[0]
    short_programs = _cdiv(num_short, cfg.block_m)
    program = pl.program_id(0)
    col0 = pl.program_id(1) * cfg.block_n
    cols = col0 + jnp.arange(cfg.block_n)
    col_ok = cols < n_features

    @pl.when(program < short_programs)
    def _short_rows():
        lanes = program * cfg.block_m + jnp.arange(cfg.block_m)
        # Lanes past the short rows repeat the program's first lane: they write the
        # same value to the same row (a masked-off store of a duplicate row would
        # not be portable to interpret mode, where masked stores rewrite old values).
        lanes = jnp.where(lanes < num_short, lanes, program * cfg.block_m)
        start, end = pltriton.load(start_ref.at[lanes]), pltriton.load(end_ref.at[lanes])
        rows = pltriton.load(row_ref.at[lanes])
        acc = _reduce_lanes(
            start,
            end,
            col0,
            idx_ref,
            data_ref,
            x_ref,
            cfg=cfg,
            n_features=n_features,
            reduce=reduce,
        )
        out = _finish(acc, reduce)
        if reduce != "sum":  # empty rows hold 0, not the -inf/+inf identity
            out = jnp.where((end > start)[:, None], out, 0.0)
        pltriton.store(
            out_ref.at[rows[:, None], cols[None, :]],
            out.astype(out_ref.dtype),
            mask=jnp.broadcast_to(col_ok[None, :], out.shape),
        )

    lane = num_short + (program - short_programs)

    @pl.when((program >= short_programs) & (lane < num_rows))
    def _long_row():
        row, first, last = row_ref[lane], start_ref[lane], end_ref[lane]
        per_step = cfg.block_k * cfg.block_m
        flat = jnp.arange(cfg.block_k)[:, None] * cfg.block_m + jnp.arange(cfg.block_m)[None, :]

        def step(k, acc):
            pos = first + k * per_step + flat
            part = _gather_reduce(
                partial_ref, pos, pos < last, col0, cfg.block_n, n_features, None, reduce
            )
            return _combine(acc, part, reduce)

        acc = lax.fori_loop(
            0, _cdiv(last - first, per_step), step, _init((cfg.block_m, cfg.block_n), reduce)
        )
        if reduce == "sum":
            acc = jnp.sum(acc, axis=0)
        else:
            acc = jnp.max(acc, axis=0) if reduce == "max" else jnp.min(acc, axis=0)
        pltriton.store(
            out_ref.at[row, cols],
            _finish(acc, reduce).astype(out_ref.dtype),
            mask=col_ok,
        )


def spmm(
    x: jax.Array,
    data: jax.Array | None,
    lanes: Lanes,
    indices: jax.Array,
    *,
    num_rows: int,
    reduce: str = "sum",
    out_dtype: Any = jnp.float32,
    interpret: bool = False,
) -> jax.Array:
    """``A @ x`` for ``x (n, F)`` with ``lanes`` from :func:`plan_lanes`.

    Args:
      x: dense operand ``(n, F)``, float16/bfloat16/float32.
      data: ``(nnz,)`` values or ``None`` (one-valued: no multiply).
      lanes: :class:`Lanes` of the viewed matrix.
      indices: ``(nnz,)`` CSR column indices.
      num_rows: ``m``.
      reduce: ``"sum"``, ``"max"`` or ``"min"``.
      out_dtype: the result dtype (sums are carried in float32 and rounded once).
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      ``(m, F)`` in ``out_dtype``; empty rows are 0 for every reduction.
    """
    n_features = x.shape[1]
    cfg = tile_config(n_features, x.dtype)
    num_blocks = pl.cdiv(n_features, cfg.block_n)
    params = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1)
    common = dict(cfg=cfg, has_data=data is not None, n_features=n_features, reduce=reduce)
    values = [] if data is None else [data]
    num_chunks, num_groups, max_long = lane_capacities(num_rows, indices.shape[0])

    def chunk_pass(starts, ends, operands, *, gather, slot0, aliases):
        return pl.pallas_call(
            functools.partial(
                _chunk_kernel,
                cfg=cfg,
                gather=gather,
                has_data=gather and data is not None,
                n_features=n_features,
                reduce=reduce,
                slot0=slot0,
            ),
            out_shape=jax.ShapeDtypeStruct((num_chunks + num_groups, n_features), jnp.float32),
            grid=(pl.cdiv(starts.shape[0], cfg.block_m), num_blocks),
            input_output_aliases=aliases,
            compiler_params=params,
            interpret=interpret,
            name="jaxcsr_spmm_chunks" if gather else "jaxcsr_spmm_groups",
        )(starts, ends, *operands)

    partials = jnp.zeros((1, n_features), jnp.float32)  # no long rows possible
    if num_chunks:
        partials = chunk_pass(
            lanes.chunk_start,
            lanes.chunk_end,
            [indices, *values, x],
            gather=True,
            slot0=0,
            aliases={},
        )
    if num_groups:
        partials = chunk_pass(
            lanes.group_start,
            lanes.group_end,
            [partials],
            gather=False,
            slot0=num_chunks,
            aliases={2: 0},
        )
    return pl.pallas_call(
        functools.partial(_row_kernel, **common),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_features), out_dtype),
        grid=(pl.cdiv(num_rows, cfg.block_m) + max_long, num_blocks),
        compiler_params=params,
        interpret=interpret,
        name="jaxcsr_spmm_rows",
    )(lanes.row, lanes.start, lanes.end, lanes.num_short, indices, *values, x, partials)
