"""Pallas TPU kernel (Mosaic): CSR x dense products as one-hot MXU windows.

TPUs have no fast random scatter, so the product is turned into a short list of dense
one-hot products, each over many nonzeros. The nonzeros are streamed in CSR order in
*blocks* of ``block_k`` (one grid step reads one block, or stays on it); the output is
held in VMEM in *tiles* of ``block_m`` rows; and each step multiplies the block into a
*window* of ``window`` consecutive output rows of the current tile, starting at any
multiple of 8:

    out[tile][start : start + window] += onehot(window, block_k) @ values[block]

The one-hot is built in the kernel from the block's row ids (an iota compare). In CSR
order a block of ``block_k`` nonzeros covers about ``block_k / mean degree`` rows, so
on most graphs one window covers a whole block and the product takes about
``nnz / block_k`` steps: per-step overhead and DMA latency are paid per block, not per
128 nonzeros. Blocks whose rows do not fit one window get one step per window.

The host plan (:func:`plan_schedule`, a :class:`Schedule`) lists the steps; it is
scalar-prefetched, and BlockSpec index maps read it to fetch the block of step ``s``
and to place its output tile. The tile sizes (:class:`Tiling`) are a function of the
matrix's ``(rows, nnz)`` only (:func:`choose_tiling`), as is the schedule's length
(:func:`schedule_capacity`), so matrices of equal shape and nnz share one compilation.

Precision: bfloat16 values go to the MXU as they are. float32 values are split into
three bfloat16 parts (``hi + mid + lo`` holds all 24 bits of the mantissa) and multiply
the exact 0/1 one-hot in three MXU passes accumulating in float32, so a float32 sum is
exact to float32 rounding at half the MXU work of ``Precision.HIGHEST``. An inf or NaN
anywhere in a block spreads over its whole window through ``0 * inf``, so the output of
such a product is never finite: :func:`product` checks the (small) output and only
then runs the kernel again with ``ieee=True``, which multiplies the finite values and
adds per-row counts of NaN, +inf and -inf (exact 0/1 products) to give the IEEE result.
Finite inputs pay no per-step check.

``reduce="max"``/``"min"`` uses the same schedule: a segmented scan along the block
(``log2(block_k)`` shifted max/min steps, masked where the row id changes) leaves each
row's maximum at its last nonzero of the block; a one-hot of those last positions
selects them on the MXU (an exact selection, again in three parts for float32) and
they are combined into the window. The scan is computed once per block.

The values are put into CSR order by XLA before the kernel (``data[:, None] *
x[indices]``; for a ``from_indices`` matrix, the planned permutation of the input-order
values; none for sorted ids). The row id of every nonzero, which a product would
otherwise derive on the device at every call, is planned with the schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxcsr.kernels import xla
from jaxcsr.kernels.semiring import column_values, entry_values, zero_empty_rows
from jaxcsr.structure import Structure, array_namespace

__all__ = [
    "Schedule",
    "Tiling",
    "TpuPlan",
    "choose_tiling",
    "covers",
    "default_for",
    "describe",
    "feature_major",
    "padded_rows",
    "plan",
    "plan_schedule",
    "product",
    "row_of_entry",
    "schedule_capacity",
    "spmm",
    "spmm_feature_major",
]

SUBLANES = 8
"""Window starts and tile heights are multiples of the TPU's 8 sublanes."""
MAX_BLOCK_M = 1024
"""Largest output tile (rows held in VMEM at once)."""
VMEM_LIMIT_BYTES = 64 * 2**20
"""Scoped VMEM the kernel may use (a v5e core has 128 MiB)."""
EXTREME_CHUNK = 512
"""Nonzeros per segmented scan and selection product of max/min inside a block."""
MAX_BLOCK_ELEMENTS = 2**19
"""Largest value block, ``block_k * block_n`` elements (2 MiB of float32)."""

# Per-step cost model behind choose_tiling, for a float32 operand of 128 features: a
# fixed cost per grid step, and the larger of the block's DMA and its MXU work.
_STEP_SECONDS = 0.35e-6
_HBM_BYTES_PER_SECOND = 800e9
_MXU_FLOPS_PER_SECOND = 197e12 / 3  # three bfloat16 passes per float32 product
_BLOCK_KS = (256, 512, 1024, 2048)
_WINDOWS = (128, 256)


# ------------------------------------------------------------------ host plan
FIRST, SKIP = 1, 2
"""Step flags: ``FIRST`` zeroes (or fills) the output tile; ``SKIP`` adds nothing (an
output tile without nonzeros, or a padding step after the real ones)."""
_FLAG_BITS = 2
_LO_SHIFT = 16


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tile sizes of the kernel.

    Attributes:
      block_k: nonzeros per block (a multiple of 128).
      window: output rows one step's one-hot covers (a multiple of 8).
      block_m: output rows per VMEM tile (a multiple of 8, at least ``window``).
    """

    block_k: int
    window: int
    block_m: int

    def __post_init__(self):
        if self.block_k % 128 or self.window % SUBLANES or self.block_m % SUBLANES:
            raise ValueError(f"tile sizes must be multiples of 128 / 8 / 8, got {self}")
        if not 0 < self.window <= self.block_m < 2**_LO_SHIFT:
            raise ValueError(f"need 0 < window <= block_m < 2**16, got {self}")


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def choose_tiling(num_rows: int, nnz: int) -> Tiling:
    """The tile sizes for a ``(num_rows, nnz)`` structure (a function of those only).

    Picks the ``(block_k, window)`` pair with the lowest modelled time: steps times the
    per-step cost, where a block of ``block_k`` nonzeros spans about ``block_k *
    num_rows / nnz`` rows and takes one step per window it needs.
    """
    block_m = min(MAX_BLOCK_M, _round_up(max(num_rows, 1), SUBLANES))
    rows_per_entry = num_rows / max(nnz, 1)
    best = None
    for block_k in _BLOCK_KS:
        for window in _WINDOWS:
            window = min(window, block_m)
            blocks = max(1, -(-nnz // block_k))
            span = block_k * rows_per_entry + SUBLANES
            steps = blocks * math.ceil(min(span, block_m) / window)
            dma = block_k * 128 * 4 / _HBM_BYTES_PER_SECOND
            mxu = 2 * window * block_k * 128 / _MXU_FLOPS_PER_SECOND
            cost = steps * (_STEP_SECONDS + max(dma, mxu))
            if best is None or cost < best[0] - 1e-12:
                best = (cost, Tiling(block_k, window, block_m))
    assert best is not None
    return best[1]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The steps of the windowed one-hot product.

    Step ``s`` multiplies nonzero block ``block[s]`` into output tile ``tile[s] >> 2``
    at tile-local rows ``[start, start + window)`` with ``start = span[s] & 0xffff``,
    keeping only rows at or after ``span[s] >> 16`` (rows before it belong to the
    previous window of the same block). ``tile[s] & 3`` holds the :data:`FIRST` and
    :data:`SKIP` flags. Steps of one tile are consecutive and every tile has a step, so
    tiles without nonzeros are written as zeros. The arrays have
    :func:`schedule_capacity` steps; those after the real ones are ``SKIP`` steps on the
    last block and tile (no new DMA).
    """

    block: Any
    tile: Any
    span: Any
    tiling: Tiling

    @property
    def num_steps(self) -> int:
        """Steps that do work (host arrays only)."""
        return int(np.sum((np.asarray(self.tile) & SKIP) == 0))


jax.tree_util.register_dataclass(
    Schedule, data_fields=["block", "tile", "span"], meta_fields=["tiling"]
)


def schedule_capacity(num_rows: int, nnz: int, tiling: Tiling) -> int:
    """Upper bound on the steps of any ``(num_rows, nnz)`` structure.

    A tile and a block meet in at most ``tiles + blocks`` pairs; a pair whose rows span
    ``[ra, rb]`` takes ``ceil((rb + 1 - floor8(ra)) / window)`` steps, and the spans of
    one tile's pairs overlap in at most one row each, so the extra windows add up to at
    most ``(tiles * block_m + 8 * pairs) / window``.
    """
    tiles = max(1, -(-num_rows // tiling.block_m))
    blocks = max(1, -(-nnz // tiling.block_k))
    pairs = tiles + blocks
    return pairs + (tiles * tiling.block_m + SUBLANES * pairs) // tiling.window + 1


def _pack(block, tile, flags, start, lo) -> tuple[Any, Any, Any]:
    """The three step arrays of a :class:`Schedule` from its five per-step fields."""
    return block, (tile << _FLAG_BITS) | flags, start | (lo << _LO_SHIFT)


def plan_schedule(indptr, tiling: Tiling | None = None, *, nnz: int | None = None) -> Schedule:
    """The schedule of a CSR row pointer: numpy arrays for a numpy ``indptr`` (host),
    ``jnp`` ones (valid under a trace) otherwise, element for element the same.

    Args:
      indptr: ``(m + 1,)`` row pointer.
      tiling: defaults to :func:`choose_tiling` of ``(m, nnz)``.
      nnz: the structure's stored entries (static: the tiling and the capacity depend
        on it); defaults to ``indptr[-1]``, which a traced ``indptr`` cannot give. A
        padded structure's dropped entries after ``indptr[-1]`` get no step.
    """
    xp = array_namespace(indptr)
    m = indptr.shape[0] - 1
    if nnz is None:
        if xp is not np:
            raise ValueError("plan_schedule: nnz is required for a device indptr")
        nnz = int(indptr[-1])
    t = choose_tiling(m, nnz) if tiling is None else tiling
    bk, w, bm = t.block_k, t.window, t.block_m
    num_tiles, num_blocks = max(1, -(-m // bm)), max(1, -(-nnz // bk))
    # the host computes in int64 (no overflow near 2**31 entries); int32 on the device
    itype = np.int64 if xp is np else jnp.int32
    indptr = indptr.astype(itype)
    bounds = np.minimum(np.arange(num_tiles + 1) * bm, m)
    t_start, t_end = indptr[bounds[:-1]], indptr[bounds[1:]]
    # pairs of a tile and a block it meets, tile after tile (at least one per tile)
    k0 = xp.minimum(t_start // bk, num_blocks - 1)
    pairs_per_tile = xp.where(t_end > t_start, -(-t_end // bk) - k0, 1)
    pair_end = xp.cumsum(pairs_per_tile)
    num_pairs = pair_end[-1]
    p = xp.arange(num_tiles + num_blocks, dtype=itype)
    pair_tile = xp.minimum(xp.searchsorted(pair_end, p, side="right"), num_tiles - 1)
    pair_block = k0[pair_tile] + p - (pair_end - pairs_per_tile)[pair_tile]
    e0 = xp.maximum(t_start[pair_tile], pair_block * bk)
    e1 = xp.minimum(t_end[pair_tile], (pair_block + 1) * bk)
    empty = e1 <= e0
    base = pair_tile * bm
    ra = xp.searchsorted(indptr, e0, side="right") - 1 - base
    rb = xp.searchsorted(indptr, e1 - 1, side="right") - 1 - base
    # the windows of each pair; steps past the real ones repeat the last as SKIP steps
    a0 = xp.where(empty, 0, ra // SUBLANES * SUBLANES)
    windows = xp.where(empty, 1, -(-(rb + 1 - a0) // w))
    windows = xp.where(p < num_pairs, windows, 0)
    step_end = xp.cumsum(windows)
    steps = step_end[-1]
    s = xp.arange(schedule_capacity(m, nnz, t), dtype=itype)
    last = xp.minimum(s, steps - 1)
    step_pair = xp.searchsorted(step_end, last, side="right")
    lo = a0[step_pair] + (last - (step_end - windows)[step_pair]) * w
    start = xp.minimum(lo, bm - w)
    tile = pair_tile[step_pair]
    prev_tile = xp.concatenate([xp.full((1,), -1, tile.dtype), tile[:-1]])
    real = s < steps
    flags = xp.where(real & (tile != prev_tile), FIRST, 0)
    flags = flags | xp.where(empty[step_pair] | ~real, SKIP, 0)
    fields = (pair_block[step_pair], tile, flags, start, lo)
    return Schedule(*_pack(*(f.astype(xp.int32) for f in fields)), t)


@dataclasses.dataclass(frozen=True)
class TpuPlan:
    """What the Mosaic kernel reads beyond the portable core.

    Attributes:
      tiles: schedule of the planned orientation ``C``.
      rows: ``(1, nnz_padded)`` int32 row of every nonzero of ``C`` in CSR order, -1
        after the last (the one-hot's input; a product would derive it at every call).
      t_tiles, t_rows: the same for ``C.T`` of ``"general"`` structures; ``None`` for
        the ``"columns"`` kind, whose transpose is a row gather (run by XLA).
    """

    tiles: Schedule
    rows: Any
    t_tiles: Schedule | None
    t_rows: Any


jax.tree_util.register_dataclass(
    TpuPlan, data_fields=["tiles", "rows", "t_tiles", "t_rows"], meta_fields=[]
)


def padded_rows(rows, block_k: int):
    """``(1, nnz padded to whole blocks of block_k)`` int32: each nonzero's row, -1 in
    the padding (numpy for numpy ``rows``, else ``jnp``)."""
    xp = array_namespace(rows)
    (nnz,) = rows.shape
    pad = max(1, -(-nnz // block_k)) * block_k - nnz
    return xp.concatenate([rows.astype(xp.int32), xp.full((pad,), -1, xp.int32)])[None, :]


def row_of_entry(indptr, nnz: int):
    """``(nnz,)`` int32: the row of every entry in CSR order, -1 for the entries after
    ``indptr[-1]`` (a padded structure's dropped ids); numpy for a numpy ``indptr``,
    else ``jnp``. On the device the row of entry ``k`` is the number of rows ``r >= 1``
    with ``indptr[r] <= k``: a scatter of one mark per row start and a cumulative sum
    (no scatter of ``nnz`` values, slow on TPU); the host repeats each row id."""
    xp = array_namespace(indptr)
    if xp is np:
        repeated = np.repeat(np.arange(indptr.size - 1, dtype=np.int32), np.diff(indptr))
        return np.concatenate([repeated, np.full(nnz - repeated.size, -1, np.int32)])
    indptr = indptr.astype(jnp.int32)
    marks = jnp.zeros((nnz,), jnp.int32).at[indptr[1:]].add(1, mode="drop")
    rows = jnp.cumsum(marks, dtype=jnp.int32)
    return jnp.where(jnp.arange(nnz, dtype=jnp.int32) < indptr[-1], rows, -1)


def plan(structure: Structure) -> TpuPlan:
    """The plan of a :class:`~jaxcsr.structure.Structure`: numpy arrays for a host one,
    ``jnp`` ones (valid under a trace) for one planned on the device, alike."""
    indptr, t_indptr = structure.kernel_indptrs()
    nnz = structure.nnz
    tiles = plan_schedule(indptr, nnz=nnz)
    rows = padded_rows(row_of_entry(indptr, nnz), tiles.tiling.block_k)
    if t_indptr is None:
        return TpuPlan(tiles, rows, None, None)
    t_tiles = plan_schedule(t_indptr, nnz=nnz)
    t_rows = padded_rows(row_of_entry(t_indptr, nnz), t_tiles.tiling.block_k)
    return TpuPlan(tiles, rows, t_tiles, t_rows)


# --------------------------------------------------------------------- kernel
def _step_fields(tile_ref, span_ref, s):
    """Step ``s``: its tile, flags, window start and first owned row (:class:`Schedule`)."""
    word, span = tile_ref[s], span_ref[s]
    start = pl.multiple_of(span & ((1 << _LO_SHIFT) - 1), SUBLANES)
    return word >> _FLAG_BITS, word & ((1 << _FLAG_BITS) - 1), start, span >> _LO_SHIFT


def _onehot(rows, base, start, lo, window: int):
    """``(window, block_k)`` bool: nonzero ``k`` belongs to tile row ``start + i``
    (and that row is at or after ``lo``). Rows outside the tile never match."""
    local = rows - base  # (1, block_k); padding is -1 - base < 0 <= lo
    rel = jnp.where(local >= lo, local - start, -1)
    return lax.broadcasted_iota(jnp.int32, (window, rows.shape[1]), 0) == rel


def _parts(values: jax.Array, num_parts: int) -> tuple[jax.Array, ...]:
    """bfloat16 parts whose float32 sum is ``values`` exactly: one for bfloat16 (or
    float32 holding bfloat16 values), three for float32."""
    if num_parts == 1:
        return (values.astype(jnp.bfloat16),)
    hi = values.astype(jnp.bfloat16)
    rest = values - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return hi, mid, lo


# bfloat16 x bfloat16 products are exact in one MXU pass; the precision is explicit so
# that jax.default_matmul_precision("highest") in the caller's code does not reach the
# kernel (Mosaic rejects bfloat16 operands at HIGHEST: "Bad lhs type").
_ONE_PASS = lax.Precision.DEFAULT


def _nt_select(part: jax.Array, hot: jax.Array) -> jax.Array:
    """``part @ hot.T`` in float32: ``(N, K) x (W, K) -> (N, W)``."""
    return lax.dot_general(
        part, hot, (((1,), (1,)), ((), ())), precision=_ONE_PASS,
        preferred_element_type=jnp.float32,
    )  # fmt: skip


def _select(
    onehot: jax.Array, values: jax.Array, num_parts: int, *, feature_major: bool = False
) -> jax.Array:
    """``onehot @ values`` in float32 on the MXU, exact for a 0/1 ``onehot``: the sum of
    the parts' products (:func:`_parts`). ``feature_major``: ``values`` is ``(N, K)``
    and the result ``values @ onehot.T``, ``(N, W)``."""
    hot = onehot.astype(jnp.bfloat16)
    out = None
    for part in _parts(values, num_parts):
        if feature_major:
            term = _nt_select(part, hot)
        else:
            term = jnp.dot(hot, part, precision=_ONE_PASS, preferred_element_type=jnp.float32)
        out = term if out is None else out + term
    assert out is not None
    return out


def _non_finite_select(onehot: jax.Array, values: jax.Array, num_parts: int) -> jax.Array:
    """:func:`_select` with IEEE results for inf/NaN (no ``0 * inf``): finite values
    on the MXU, plus per-row counts of NaN, +inf and -inf."""
    wide = values.astype(jnp.float32)  # Mosaic's isfinite takes float32 only
    clean = jnp.where(jnp.isfinite(wide), wide, 0.0)
    out = _select(onehot, clean, num_parts)
    hot = onehot.astype(jnp.bfloat16)

    def count(indicator):
        indicator = indicator.astype(jnp.bfloat16)
        return jnp.dot(hot, indicator, precision=_ONE_PASS, preferred_element_type=jnp.float32)

    nan = count(jnp.isnan(wide))
    pos = count(wide == jnp.inf)
    neg = count(wide == -jnp.inf)
    odd = jnp.where(pos > 0, jnp.inf, 0.0) + jnp.where(neg > 0, -jnp.inf, 0.0)
    return jnp.where(nan > 0, jnp.nan, out + odd)


def _chunks(tiling: Tiling, chunk: int, body, init):
    """``body(offset, carry)`` over the block's chunks of ``chunk`` nonzeros."""

    def step(c, carry):
        return body(pl.multiple_of(c * chunk, chunk), carry)

    return lax.fori_loop(0, tiling.block_k // chunk, step, init)


def _sum_kernel(block_ref, tile_ref, span_ref, rows_ref, vals_ref, o_ref, *, tiling, chunk, select):
    del block_ref
    s = pl.program_id(1)
    tile, flags, start, lo = _step_fields(tile_ref, span_ref, s)
    base = tile * tiling.block_m
    shape = (tiling.window, o_ref.shape[1])

    @pl.when((flags & FIRST) != 0)
    def _zero():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when((flags & SKIP) == 0)
    def _accumulate():
        def body(offset, acc):
            rows = rows_ref[:, pl.ds(offset, chunk)]
            onehot = _onehot(rows, base, start, lo, tiling.window)
            return acc + select(onehot, vals_ref[pl.ds(offset, chunk), :])

        o_ref[pl.ds(start, tiling.window), :] += _chunks(
            tiling, chunk, body, jnp.zeros(shape, jnp.float32)
        )


_REDUCERS = {"max": (-jnp.inf, jnp.maximum), "min": (jnp.inf, jnp.minimum)}


def _row_column(rows: jax.Array) -> jax.Array:
    """``(1, n)`` int32 -> ``(n, 1)`` float32 (exact below 2**24 rows), by one XLU
    transpose of a 128-sublane broadcast."""
    wide = jnp.broadcast_to(rows.astype(jnp.float32), (128, rows.shape[1]))
    return jnp.transpose(wide)[:, :1]


def _segmented_scan(vals: jax.Array, ids: jax.Array, combine, axis: int = 0) -> jax.Array:
    """Inclusive scan of ``combine`` along ``axis`` of ``vals``, restarting where the row
    id changes (``ids``: ``(n, 1)`` down the sublanes, or ``(1, n)`` along the lanes):
    each row's result ends up at its last entry."""
    k = vals.shape[axis]
    pos = lax.broadcasted_iota(jnp.int32, ids.shape, axis)
    shift = 1
    while shift < k:
        prev = pltpu.roll(vals, shift, axis)
        same = (pltpu.roll(ids, shift, axis) == ids) & (pos >= shift)
        vals = jnp.where(same, combine(vals, prev), vals)
        shift *= 2
    return vals


def _following(rows: jax.Array) -> jax.Array:
    """``(1, n)``: the row of the next nonzero, -1 after the last (for :func:`_last`)."""
    return jnp.concatenate([rows[:, 1:], jnp.full((1, 1), -1, rows.dtype)], axis=1)


def _last(rows: jax.Array, following: jax.Array, offset, block_k: int) -> jax.Array:
    """``(1, n)`` bool: the nonzero is its row's last in the block (``rows`` start at
    ``offset`` within a block of ``block_k``)."""
    lane = lax.broadcasted_iota(jnp.int32, rows.shape, 1) + offset
    return (following != rows) | (lane == block_k - 1)


def _extreme_kernel(
    block_ref,
    tile_ref,
    span_ref,
    rows_ref,
    next_ref,
    vals_ref,
    o_ref,
    scan_ref,
    *,
    tiling,
    chunk,
    select,
    reduce,
):
    s = pl.program_id(1)
    identity, combine = _REDUCERS[reduce]
    tile, flags, start, lo = _step_fields(tile_ref, span_ref, s)
    base = tile * tiling.block_m
    width = o_ref.shape[1]

    @pl.when((s == 0) | (block_ref[s] != block_ref[jnp.maximum(s - 1, 0)]))
    def _scan():
        def body(offset, carry):
            carry_row, carry_vals = carry
            col = _row_column(rows_ref[:, pl.ds(offset, chunk)])
            vals = vals_ref[pl.ds(offset, chunk), :].astype(jnp.float32)
            vals = _segmented_scan(vals, col, combine)
            # the previous chunk's last row continues here
            vals = jnp.where(col == carry_row, combine(vals, carry_vals), vals)
            scan_ref[pl.ds(offset, chunk), :] = vals
            return col[chunk - 1 :, :], vals[chunk - 1 :, :]

        init = (jnp.full((1, 1), -2.0, jnp.float32), jnp.zeros((1, width), jnp.float32))
        _chunks(tiling, chunk, body, init)

    @pl.when((flags & FIRST) != 0)
    def _fill():
        o_ref[...] = jnp.full(o_ref.shape, identity, o_ref.dtype)

    @pl.when((flags & SKIP) == 0)
    def _reduce():
        def body(offset, carry):
            acc, present = carry
            rows = rows_ref[:, pl.ds(offset, chunk)]
            onehot = _onehot(rows, base, start, lo, tiling.window)
            last = _last(rows, next_ref[:, pl.ds(offset, chunk)], offset, tiling.block_k)
            pick = onehot & last  # each row's last nonzero of the block
            hit = jnp.max(jnp.where(pick, 1.0, 0.0), axis=1, keepdims=True)
            acc = acc + select(pick, scan_ref[pl.ds(offset, chunk), :])
            return acc, jnp.maximum(present, hit)

        init = (
            jnp.zeros((tiling.window, width), jnp.float32),
            jnp.zeros((tiling.window, 1), jnp.float32),
        )
        part, present = _chunks(tiling, chunk, body, init)
        window = pl.ds(start, tiling.window)
        current = o_ref[window, :]
        merged = jnp.where(jnp.isnan(current), current, combine(current, part))
        o_ref[window, :] = jnp.where(present > 0, merged, current)


def _feature_block(f: int, block_k: int) -> int:
    """Features per grid column: the whole width, or a multiple of 128 that divides it
    and keeps the value block within :data:`MAX_BLOCK_ELEMENTS`."""
    if f % 128:
        return f
    for block_n in (512, 256, 128):
        if f % block_n == 0 and block_k * block_n <= MAX_BLOCK_ELEMENTS:
            return block_n
    return 128


def spmm(
    values: jax.Array,
    rows: jax.Array,
    schedule: Schedule,
    *,
    num_rows: int,
    reduce: str = "sum",
    interpret: bool | pltpu.InterpretParams = False,
    chunk: int | None = None,
    ieee: bool = False,
) -> jax.Array:
    """``out[rows[k]] += values[k]`` as windowed one-hot MXU products, in float32.

    With ``reduce="max"``/``"min"``: ``out[r] = max/min of values[k]`` over
    ``rows[k] == r``; rows without nonzeros hold -inf/+inf.

    Args:
      values: ``(nnz, F)`` per-nonzero rows (already gathered and weighted), in CSR
        order; bfloat16 or float32.
      rows: ``(1, nnz_padded)`` int32 row of every nonzero, -1 past ``nnz`` (a
        :class:`TpuPlan`'s ``rows``).
      schedule: a :class:`Schedule` from :func:`plan_schedule` for those rows.
      num_rows: ``m``.
      reduce: ``"sum"``, ``"max"`` or ``"min"``.
      interpret: ``True`` or ``pltpu.InterpretParams()`` to run on CPU.
      chunk: nonzeros per MXU product inside a block (a multiple of 128 dividing
        ``block_k``). Default: the whole block for sums, :data:`EXTREME_CHUNK` for
        max/min (the fastest measured on a v5e).
      ieee: take inf and NaN values the IEEE way (finite values through the MXU plus
        per-row counts of NaN, +inf and -inf: about twice the MXU work). Without it
        an inf or NaN value makes its whole window NaN (``0 * inf``), so the output
        is not finite exactly when a value was not (or a sum overflowed):
        :func:`product` reruns such products with ``ieee=True``.

    Returns:
      ``(m, F)`` float32.
    """
    t = schedule.tiling
    if chunk is None:
        chunk = t.block_k if reduce == "sum" else EXTREME_CHUNK
    chunk = min(chunk, t.block_k)
    if t.block_k % chunk or chunk % 128:
        raise ValueError(f"chunk must be a multiple of 128 dividing {t.block_k}, got {chunk}")
    num_parts = 1 if values.dtype == jnp.bfloat16 else 3
    select = functools.partial(_non_finite_select if ieee else _select, num_parts=num_parts)
    nnz, f = values.shape
    num_k = rows.shape[1] // t.block_k
    num_m = max(1, -(-num_rows // t.block_m))
    values = jnp.pad(values, ((0, num_k * t.block_k - nnz), (0, 0)))
    block_n = _feature_block(f, t.block_k)
    row_spec = pl.BlockSpec((1, t.block_k), lambda j, s, b, tl, sp: (0, b[s]))
    val_spec = pl.BlockSpec((t.block_k, block_n), lambda j, s, b, tl, sp: (b[s], j))
    out_spec = pl.BlockSpec((t.block_m, block_n), lambda j, s, b, tl, sp: (tl[s] >> _FLAG_BITS, j))
    if reduce == "sum":
        kernel = functools.partial(_sum_kernel, tiling=t, chunk=chunk, select=select)
        in_specs, operands, scratch = [row_spec, val_spec], [rows, values], []
    elif reduce in _REDUCERS:
        kernel = functools.partial(
            _extreme_kernel, tiling=t, chunk=chunk, select=select, reduce=reduce
        )
        in_specs = [row_spec, row_spec, val_spec]
        operands = [rows, _following(rows), values]
        scratch = [pltpu.VMEM((t.block_k, block_n), jnp.float32)]
    else:
        raise ValueError(f"reduce must be 'sum', 'max' or 'min', got {reduce!r}")
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(f // block_n, schedule.block.shape[0]),
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=scratch,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_m * t.block_m, f), jnp.float32),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT_BYTES
        ),
        interpret=interpret,
        name=f"jaxcsr_window_spmm_{reduce}{'_ieee' if ieee else ''}",
    )(schedule.block, schedule.tile, schedule.span, *operands)
    return out[:num_rows]


LANES = 128
"""Vector lanes: the minor dimension of a TPU tile."""


def _placed(window: jax.Array, start, wide: int) -> tuple[Any, jax.Array]:
    """``window`` (``(r, w)``) in a ``(r, wide)`` block shifted right by ``start % 128``
    (a lane rotation), and the 128-aligned lane offset where the block goes: adding the
    block at that offset adds ``window`` at ``start`` (a multiple of 8)."""
    shift = start % LANES
    rows, w = window.shape
    block = jnp.concatenate([window, jnp.zeros((rows, wide - w), window.dtype)], axis=1)
    return pl.multiple_of(start - shift, LANES), pltpu.roll(block, shift, 1)


def _feature_major_kernel(
    block_ref,
    tile_ref,
    span_ref,
    rows_ref,
    next_ref,
    vals_ref,
    o_ref,
    scan_ref,
    *,
    tiling,
    num_parts,
    reduce,
):
    s = pl.program_id(0)
    tile, flags, start, lo = _step_fields(tile_ref, span_ref, s)
    base = tile * tiling.block_m
    wide = _round_up(tiling.window, LANES) + LANES
    extreme = reduce in _REDUCERS
    rows = rows_ref[...]
    if extreme:
        identity, combine = _REDUCERS[reduce]

        @pl.when((s == 0) | (block_ref[s] != block_ref[jnp.maximum(s - 1, 0)]))
        def _scan():  # once per block: each row's max/min at its last entry
            vals = vals_ref[...].astype(jnp.float32)
            scan_ref[...] = _segmented_scan(vals, rows, combine, axis=1)

    @pl.when((flags & FIRST) != 0)
    def _first():
        fill = identity if extreme else 0.0
        o_ref[...] = jnp.full(o_ref.shape, fill, o_ref.dtype)

    @pl.when((flags & SKIP) == 0)
    def _accumulate():
        onehot = _onehot(rows, base, start, lo, tiling.window)
        if not extreme:
            part = _select(onehot, vals_ref[...], num_parts, feature_major=True)
            aligned, placed = _placed(part, start, wide)
            o_ref[:, pl.ds(aligned, wide)] += placed
            return
        pick = onehot & _last(rows, next_ref[...], 0, tiling.block_k)  # rows' last entries
        part = _select(pick, scan_ref[...], num_parts, feature_major=True)
        hits = _nt_select(jnp.ones((1, tiling.block_k), jnp.bfloat16), pick.astype(jnp.bfloat16))
        aligned, placed = _placed(part, start, wide)
        _, present = _placed(hits, start, wide)
        current = o_ref[:, pl.ds(aligned, wide)]
        merged = jnp.where(jnp.isnan(current), current, combine(current, placed))
        o_ref[:, pl.ds(aligned, wide)] = jnp.where(present > 0, merged, current)


def spmm_feature_major(
    values_t: jax.Array,
    rows: jax.Array,
    schedule: Schedule,
    *,
    num_rows: int,
    reduce: str = "sum",
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """:func:`spmm` for narrow widths, feature-major: ``values_t`` is ``(N, nnz)``,
    read lane-dense along the nonzeros.

    A TPU stores an ``(nnz, N)`` array with fewer than 128 features column-major, so
    ``values.T`` is free and a ``(N, block_k)`` block is one dense DMA, where
    :func:`spmm`'s ``(block_k, N)`` block would pad each row to 128 lanes. Each step
    multiplies the block by its one-hot window on the MXU, ``(N, block_k) @ (block_k,
    window)``: the MXU streams ``N`` rows instead of ``window``, and the window is
    added to the output tile (held transposed, ``(N, rows)``) by a lane rotation.
    ``reduce="max"``/``"min"``: the segmented scan runs along the lanes of the block,
    once per block, and the one-hot of each row's last entry selects the results. Same
    schedule and rows as :func:`spmm`, and the same contract for non-finite values
    (an output that is not finite is recomputed by ``spmm(..., ieee=True)``).

    Args:
      values_t: ``(N, nnz)`` bfloat16 or float32, the nonzeros in CSR order.
      rows, schedule, num_rows, reduce, interpret: as for :func:`spmm`.

    Returns:
      ``(m, N)`` float32; rows without nonzeros hold 0 (sum) or -inf/+inf (max/min).
    """
    if reduce != "sum" and reduce not in _REDUCERS:
        raise ValueError(f"reduce must be 'sum', 'max' or 'min', got {reduce!r}")
    t = schedule.tiling
    n, nnz = values_t.shape
    num_k = rows.shape[1] // t.block_k
    num_m = max(1, -(-num_rows // t.block_m))
    tile_lanes = _round_up(t.block_m, LANES) + LANES
    values_t = jnp.pad(values_t, ((0, 0), (0, num_k * t.block_k - nnz)))
    num_parts = 1 if values_t.dtype == jnp.bfloat16 else 3
    kernel = functools.partial(_feature_major_kernel, tiling=t, num_parts=num_parts, reduce=reduce)
    row_spec = pl.BlockSpec((1, t.block_k), lambda s, b, tl, sp: (0, b[s]))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(schedule.block.shape[0],),
        in_specs=[row_spec, row_spec, pl.BlockSpec((n, t.block_k), lambda s, b, tl, sp: (0, b[s]))],
        out_specs=pl.BlockSpec((n, tile_lanes), lambda s, b, tl, sp: (0, tl[s] >> _FLAG_BITS)),
        scratch_shapes=[pltpu.VMEM((n, t.block_k), jnp.float32)],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, num_m * tile_lanes), jnp.float32),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=VMEM_LIMIT_BYTES
        ),
        interpret=interpret,
        name=f"jaxcsr_window_spmm_feature_major_{reduce}",
    )(schedule.block, schedule.tile, schedule.span, rows, _following(rows), values_t)
    out = out.reshape(n, num_m, tile_lanes)[:, :, : t.block_m].reshape(n, num_m * t.block_m)
    return out[:, :num_rows].T


def feature_major(n_features: int) -> bool:
    """Whether a product runs :func:`spmm_feature_major`: fewer than 128 features (an
    ``(nnz, N)`` array with ``N < 128`` is stored column-major on a TPU, so its
    transpose is free), any reduction."""
    return n_features < LANES


def covers(view: Structure) -> bool:
    """Views the kernel runs: all but one entry per row (a row gather, run by XLA)."""
    return not view.one_per_row


DEVICE_PLAN_MIN_IDS_PER_ROW = 28
"""Traced sorted ids run the kernel by default from this many ids per segment on.

The schedule planned on the device inside each call costs a fixed time per output
row, and the kernel saves a smaller one per id against XLA's scatter of sorted ids:
the kernel pays back from this many ids per row on a v5e (the per-row and per-id
costs, measured on tolokers, musae_github and twitter_ego at N = 16 and 128:
``benchmarks/results/tpu-v5e/README.md``)."""


def default_for(view: Structure, dtype: Any = None, reduce: str | None = "sum") -> bool:
    """Backend entry (``Coverage.default_for``): whether ``impl=None`` runs the kernel on
    a view it covers, whatever the dtype and reduction. Segment ids planned on the
    device (traced) run XLA's scatter when unsorted -- a sort and gather per call cost
    more on a TPU than XLA's scatter on ids that arrive grouped by segment
    (``benchmarks/results/tpu-v5e/``) -- and when sorted (``indices_are_sorted=True``)
    with fewer than :data:`DEVICE_PLAN_MIN_IDS_PER_ROW` ids per segment."""
    del dtype, reduce
    if not (view.layout.padded and view.one_per_column):
        return True
    rows, ids = view.shape
    return view.sorted_ids and ids >= DEVICE_PLAN_MIN_IDS_PER_ROW * rows


def describe(view: Structure, n_features: int | None = None) -> dict[str, str]:
    """What runs ``view`` (host-side report for ``plan_info``)."""
    if not covers(view):
        return {"pallas_tpu": "xla gather (one entry per row)"}
    t = choose_tiling(view.shape[0], view.nnz)
    layout = ""
    if n_features is not None and feature_major(n_features):
        layout = "; feature-major"
    return {
        "pallas_tpu": f"kernel (blocks of {t.block_k} nonzeros, windows of {t.window} rows, "
        f"tiles of {t.block_m} rows{layout})"
    }


def product(
    x: jax.Array,
    data: jax.Array | None,
    structure: Structure,
    tpu_plan: TpuPlan,
    *,
    reduce: str,
    out_dtype: Any,
    interpret: bool,
    platform: str,
) -> jax.Array:
    """Backend entry: the viewed matrix (not one-per-row: :func:`covers`) times ``x``.

    Puts the values in CSR order (XLA; nothing to move for sorted ids), runs the
    windowed kernel (float32 out; again with ``ieee=True`` if the output is not
    finite), zeroes empty rows of max/min and casts to ``out_dtype``.
    """
    if reduce != "sum" and data is not None:
        # Weighted max/min: on a TPU v5e the kernel's maximum differed in its last bits
        # from XLA's recomputed products for 2-4 % of the outputs, so the arg search of
        # the gradient missed them (benchmarks/results/tpu-v5e/README.md). Until the
        # cause is found, weighted extremes run on XLA (unweighted ones were bit-equal).
        return xla.product(
            x,
            data,
            structure,
            None,
            reduce=reduce,
            out_dtype=out_dtype,
            interpret=interpret,
            platform=platform,
        )
    del platform
    if structure.sorted_ids:  # CSR order is the input order
        values = column_values(x, data, structure)
    else:
        values = entry_values(x, data, structure)
    if values.dtype == jnp.float16:  # the MXU takes bfloat16 and float32
        values = values.astype(jnp.float32)
    if structure.transposed:
        tiles, rows = tpu_plan.t_tiles, tpu_plan.t_rows
    else:
        tiles, rows = tpu_plan.tiles, tpu_plan.rows
    assert tiles is not None and rows is not None, "a transposed view of a planned transpose"
    num_rows = structure.shape[0]
    # The TPU interpreter (pltpu.InterpretParams) runs on io_callbacks with ordered
    # effects, which a primitive's lowering cannot host; the primitive uses the
    # generic Pallas interpreter and tests run the kernel under both.
    run = functools.partial(
        spmm, values, rows, tiles, num_rows=num_rows, reduce=reduce, interpret=interpret
    )

    def finished(out):  # max/min: empty rows hold 0, not the kernel's -inf/+inf
        return out if reduce == "sum" else zero_empty_rows(out, structure)

    if feature_major(values.shape[1]):
        out = finished(
            spmm_feature_major(
                values.T, rows, tiles, num_rows=num_rows, reduce=reduce, interpret=interpret
            )
        )
    else:
        out = finished(run())
    # Not finite only if some value was not (or a float32 sum overflowed): then the
    # IEEE kernel runs (spmm's ``ieee``); finite inputs pay one pass over the output.
    out = lax.cond(jnp.all(jnp.isfinite(out)), lambda: out, lambda: finished(run(ieee=True)))
    return out.astype(out_dtype)
