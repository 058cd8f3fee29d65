"""Pallas TPU kernel (Mosaic): block-sparse CSR x dense product on the MXU.

TPUs have no fast random scatter, so the product is turned into a short list of dense
tile products. The host plan (:func:`plan_tile_schedule`, in this module; a matrix
carries it when built with ``backends=`` including ``"pallas_tpu"``) lists, for each
output tile of ``BLOCK_M`` rows, the tiles of ``BLOCK_K`` consecutive nonzeros (CSR
order) that cover its nonzero range. The schedule is scalar-prefetched; BlockSpec index
maps read it to fetch the row ids and value tile of step ``s`` and to place output tile
``out_tile[s]``. In the kernel a ``(BLOCK_M, BLOCK_K)`` one-hot tile is built from the
row ids with an iota compare and ``onehot @ values`` accumulates on the MXU in float32.
Grid: (feature blocks "parallel", schedule "arbitrary"); steps of one output tile are
consecutive, the first zeroes the tile, and tiles without nonzeros get one step.

``reduce="max"``/``"min"`` swaps the semiring in the same schedule: the MXU has no
max, so the tile is reduced on the VPU, one output row at a time: column ``i`` of the
transposed one-hot masks row ``i``'s nonzeros down the sublanes of the value tile, the
values of other rows are replaced by the identity and a sublane reduction gives the
row's partial max, combined into the output tile. That is
``BLOCK_M`` masked reductions per step, about as many VPU operations as the one-hot
product has MXU ones; the first step of a tile fills it with -inf/+inf (the caller
zeroes empty rows).

The values are gathered into nonzero order by XLA before the kernel
(``data[:, None] * x[indices]``; for a ``from_indices`` matrix that is the planned
permutation): a row gather is what XLA already does well on TPU, and it keeps the
kernel a pure dense tile loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxcsr.kernels.semiring import entry_values, zero_empty_rows
from jaxcsr.structure import Structure

BLOCK_M = 128
"""Output rows per tile (a multiple of 8)."""
BLOCK_K = 128
"""Nonzeros per tile (a multiple of 128: the row-id block is ``(1, BLOCK_K)``)."""


_REDUCERS = {
    "max": (-jnp.inf, jnp.max, jnp.maximum),
    "min": (jnp.inf, jnp.min, jnp.minimum),
}


# ------------------------------------------------------------------ host plan
FIRST, NEXT, PAD = 1, 0, 2
"""Values of ``TileSchedule.first``: first step of an output tile (zero it), a later
step, or a padding step that does nothing."""


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """The (output-row tile, nonzero tile) pairs of the block-sparse TPU product.

    Step ``s`` multiplies nonzero tile ``nnz_tile[s]`` (``block_k`` consecutive
    nonzeros in CSR order) into output tile ``out_tile[s]`` (``block_m`` rows).
    Steps of one output tile are consecutive; ``first[s]`` is :data:`FIRST` on the
    first (the accumulator is zeroed there), and every output tile has at least one
    step, so tiles without nonzeros are written as zeros.

    The arrays have :func:`schedule_capacity` steps -- a function of ``(m, nnz)``
    only, so matrices of equal shape and nnz share one compilation; the steps after
    the real ones are :data:`PAD` (they revisit the last tiles and add nothing).
    """

    out_tile: Any
    nnz_tile: Any
    first: Any
    block_m: int
    block_k: int

    @property
    def num_steps(self) -> int:
        """Steps that do work (not :data:`PAD`); host arrays only."""
        return int(np.sum(np.asarray(self.first) != PAD))


jax.tree_util.register_dataclass(
    TileSchedule, data_fields=["out_tile", "nnz_tile", "first"], meta_fields=["block_m", "block_k"]
)


def schedule_capacity(num_rows: int, nnz: int, block_m: int, block_k: int) -> int:
    """Upper bound on the steps of any ``(num_rows, nnz)`` structure.

    Consecutive output tiles share at most one nonzero tile and an output tile with
    no nonzeros takes one step, so ``#output tiles + #nonzero tiles`` steps suffice.
    """
    return max(1, -(-num_rows // block_m)) + max(1, -(-nnz // block_k))


def plan_tile_schedule(indptr: np.ndarray, block_m: int = 0, block_k: int = 0) -> TileSchedule:
    """Covers each output tile's contiguous nonzero range with nonzero tiles (host).

    Defaults: :data:`BLOCK_M` and :data:`BLOCK_K`.
    """
    block_m, block_k = block_m or BLOCK_M, block_k or BLOCK_K
    indptr = np.asarray(indptr)
    m = indptr.size - 1
    nnz = int(indptr[-1])
    num_out = max(1, -(-m // block_m))
    bounds = np.minimum(np.arange(num_out + 1) * block_m, m)
    start, end = indptr[bounds[:-1]].astype(np.int64), indptr[bounds[1:]].astype(np.int64)
    k0 = start // block_k
    k1 = np.where(end > start, -(-end // block_k), k0 + 1)  # empty tile: one step
    counts = k1 - k0
    out_tile = np.repeat(np.arange(num_out), counts)
    first_pos = np.cumsum(counts) - counts
    nnz_tile = k0[out_tile] + np.arange(out_tile.size) - first_pos[out_tile]
    max_tile = max(0, -(-nnz // block_k) - 1)
    nnz_tile = np.minimum(nnz_tile, max_tile)  # an empty matrix still has tile 0
    capacity = schedule_capacity(m, nnz, block_m, block_k)
    steps = out_tile.size
    padded = [np.zeros(capacity, np.int32) for _ in range(3)]
    padded[0][:steps], padded[0][steps:] = out_tile, out_tile[-1]
    padded[1][:steps], padded[1][steps:] = nnz_tile, nnz_tile[-1]  # same block: no new DMA
    padded[2][:steps], padded[2][steps:] = NEXT, PAD
    padded[2][first_pos] = FIRST
    return TileSchedule(*padded, block_m, block_k)


def plan_tile_schedule_on_device(
    indptr: jax.Array, nnz: int, block_m: int = 0, block_k: int = 0
) -> TileSchedule:
    """:func:`plan_tile_schedule` in ``jnp`` (valid under a trace), for a structure of
    ``nnz`` entries (static: the capacity depends on it); equal to the host's."""
    block_m, block_k = block_m or BLOCK_M, block_k or BLOCK_K
    m = indptr.shape[0] - 1
    num_out = max(1, -(-m // block_m))
    bounds = np.minimum(np.arange(num_out + 1) * block_m, m)
    start, end = indptr[bounds[:-1]].astype(jnp.int32), indptr[bounds[1:]].astype(jnp.int32)
    k0 = start // block_k
    k1 = jnp.where(end > start, -(-end // block_k), k0 + 1)
    counts = k1 - k0
    steps_end = jnp.cumsum(counts)
    capacity = schedule_capacity(m, nnz, block_m, block_k)
    step = jnp.arange(capacity, dtype=jnp.int32)
    steps = steps_end[-1]
    last = jnp.minimum(step, steps - 1)  # padding steps repeat the last real step
    out_tile = jnp.searchsorted(steps_end, last, side="right").astype(jnp.int32)
    first_pos = steps_end - counts
    nnz_tile = k0[out_tile] + last - first_pos[out_tile]
    nnz_tile = jnp.minimum(nnz_tile, max(0, -(-nnz // block_k) - 1))
    first = jnp.where(step < steps, jnp.where(step == first_pos[out_tile], FIRST, NEXT), PAD)
    return TileSchedule(out_tile, nnz_tile, first.astype(jnp.int32), block_m, block_k)


@dataclasses.dataclass(frozen=True)
class TpuPlan:
    """What the Mosaic kernel reads beyond the portable core.

    Attributes:
      tiles: tile schedule of the planned orientation ``C``.
      t_tiles: schedule of ``C.T`` for ``"general"`` structures; ``None`` for the
        ``"columns"`` kind, whose transpose is a row gather (run by XLA).
    """

    tiles: TileSchedule
    t_tiles: TileSchedule | None


jax.tree_util.register_dataclass(TpuPlan, data_fields=["tiles", "t_tiles"], meta_fields=[])


def plan(structure: Structure) -> TpuPlan:
    """The host plan for a host :class:`~jaxcsr.structure.Structure` (numpy leaves)."""
    indptr, t_indptr = structure.kernel_indptrs()
    t_tiles = None if t_indptr is None else plan_tile_schedule(t_indptr)
    return TpuPlan(plan_tile_schedule(indptr), t_tiles)


def plan_on_device(structure: Structure) -> TpuPlan:
    """:func:`plan` for a structure planned on the device (traced ids)."""
    indptr, t_indptr = structure.kernel_indptrs()
    nnz = structure.nnz
    t_tiles = None if t_indptr is None else plan_tile_schedule_on_device(t_indptr, nnz)
    return TpuPlan(plan_tile_schedule_on_device(indptr, nnz), t_tiles)


# --------------------------------------------------------------------- kernel
def _onehot(rows_ref, base, dtype):
    """``(BLOCK_M, BLOCK_K)``: 1 where nonzero ``k`` belongs to output row ``base + i``."""
    local = rows_ref[...] - base  # (1, BLOCK_K); padding is < 0
    iota = lax.broadcasted_iota(jnp.int32, (BLOCK_M, BLOCK_K), 0)
    return (iota == local).astype(dtype)


def _sum_kernel(out_tile_ref, nnz_tile_ref, first_ref, rows_ref, vals_ref, o_ref, *, precision):
    del nnz_tile_ref
    s = pl.program_id(1)

    @pl.when(first_ref[s] == FIRST)
    def _zero():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(first_ref[s] != PAD)
    def _accumulate():
        _sum_step(out_tile_ref[s], rows_ref, vals_ref, o_ref, precision)


def _sum_step(out_tile, rows_ref, vals_ref, o_ref, precision):
    vals = vals_ref[...]
    onehot = _onehot(rows_ref, out_tile * BLOCK_M, vals.dtype)
    wide = vals.astype(jnp.float32)  # Mosaic's isfinite takes float32 only
    finite = jnp.isfinite(wide)
    # 0 * inf is NaN on the MXU: a one-hot product would spread one non-finite value
    # over the whole tile. Finite values go through the MXU; a tile holding inf/NaN
    # also counts, per row, its NaNs, +infs and -infs with 0/1 indicator products
    # (exact) and adds the IEEE result of those: NaN, +inf, -inf or nothing.
    clean = jnp.where(finite, vals, jnp.zeros_like(vals))
    o_ref[...] += jnp.dot(onehot, clean, preferred_element_type=jnp.float32, precision=precision)

    @pl.when(jnp.max(jnp.where(finite, 0.0, 1.0)) > 0)
    def _non_finite():
        hot = onehot.astype(jnp.float32)

        def count(indicator):
            return jnp.dot(hot, indicator.astype(jnp.float32), preferred_element_type=jnp.float32)

        nan = count(jnp.isnan(wide))
        pos = count(wide == jnp.inf)
        neg = count(wide == -jnp.inf)
        odd = jnp.where(pos > 0, jnp.inf, 0.0) + jnp.where(neg > 0, -jnp.inf, 0.0)
        o_ref[...] += jnp.where(nan > 0, jnp.nan, odd)


def _extreme_kernel(out_tile_ref, nnz_tile_ref, first_ref, rows_ref, vals_ref, o_ref, *, reduce):
    del nnz_tile_ref
    s = pl.program_id(1)
    identity, reducer, combine = _REDUCERS[reduce]

    @pl.when(first_ref[s] == FIRST)
    def _fill():
        o_ref[...] = jnp.full(o_ref.shape, identity, o_ref.dtype)

    @pl.when(first_ref[s] != PAD)
    def _reduce():
        _extreme_step(out_tile_ref[s], rows_ref, vals_ref, o_ref, identity, reducer, combine)


def _extreme_step(out_tile, rows_ref, vals_ref, o_ref, identity, reducer, combine):
    # Transposed one-hot (BLOCK_K, BLOCK_M): column i masks the nonzeros of row i
    # down the sublanes of the (BLOCK_K, block_n) value tile.
    onehot = _onehot(rows_ref, out_tile * BLOCK_M, jnp.float32)
    members = jnp.transpose(onehot)
    vals = vals_ref[...].astype(jnp.float32)
    for i in range(BLOCK_M):  # static: one masked sublane reduction per output row
        masked = jnp.where(members[:, i : i + 1] > 0, vals, identity)
        partial = reducer(masked, axis=0, keepdims=True)
        current = o_ref[i : i + 1, :]
        # a NaN already in the output stays (explicitly: not every max is NaN-safe)
        o_ref[i : i + 1, :] = jnp.where(jnp.isnan(current), current, combine(current, partial))
    # NaN propagates by an explicit count, not by the reduction above: XLA:CPU's
    # vectorised max/min reductions (Pallas interpret mode) can drop a NaN.
    nan = jnp.isnan(vals)

    @pl.when(jnp.max(jnp.where(nan, 1.0, 0.0)) > 0)
    def _propagate_nan():
        count = jnp.dot(onehot, nan.astype(jnp.float32), preferred_element_type=jnp.float32)
        o_ref[...] = jnp.where(count > 0, jnp.nan, o_ref[...])


def spmm(
    values: jax.Array,
    rows: jax.Array,
    schedule: TileSchedule,
    *,
    num_rows: int,
    reduce: str = "sum",
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """``out[rows[k]] += values[k]`` as block-sparse MXU products, in float32.

    With ``reduce="max"``/``"min"``: ``out[r] = max/min of values[k]`` over
    ``rows[k] == r``, on the VPU; rows without nonzeros hold -inf/+inf.

    Args:
      values: ``(nnz, F)`` per-nonzero rows (already gathered and weighted), in CSR
        order; bfloat16 runs natively on the MXU, float32 at HIGHEST precision.
      rows: ``(nnz,)`` int32 row of every nonzero (non-decreasing).
      schedule: a :class:`TileSchedule` from :func:`plan_tile_schedule`.
      num_rows: ``m``.
      reduce: ``"sum"``, ``"max"`` or ``"min"``.
      interpret: ``True`` or ``pltpu.InterpretParams()`` to run on CPU.

    Returns:
      ``(m, F)`` float32.
    """
    nnz, f = values.shape
    out_tile, nnz_tile, first = schedule.out_tile, schedule.nnz_tile, schedule.first
    num_k = max(1, pl.cdiv(nnz, BLOCK_K))
    num_m = max(1, pl.cdiv(num_rows, BLOCK_M))
    pad = num_k * BLOCK_K - nnz
    values = jnp.pad(values, ((0, pad), (0, 0)))
    rows = jnp.pad(rows.astype(jnp.int32), (0, pad), constant_values=-1)
    block_n = 128 if f % 128 == 0 else f
    if reduce == "sum":
        precision = lax.Precision.HIGHEST if values.dtype == jnp.float32 else None
        kernel = functools.partial(_sum_kernel, precision=precision)
    elif reduce in _REDUCERS:
        kernel = functools.partial(_extreme_kernel, reduce=reduce)
    else:
        raise ValueError(f"reduce must be 'sum', 'max' or 'min', got {reduce!r}")
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(f // block_n, out_tile.shape[0]),
        in_specs=[
            pl.BlockSpec((1, BLOCK_K), lambda j, s, ot, kt, fr: (0, kt[s])),
            pl.BlockSpec((BLOCK_K, block_n), lambda j, s, ot, kt, fr: (kt[s], j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, block_n), lambda j, s, ot, kt, fr: (ot[s], j)),
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_m * BLOCK_M, f), jnp.float32),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="jaxcsr_block_spmm",
    )(out_tile, nnz_tile, first, rows[None, :], values)
    return out[:num_rows]


def covers(view: Structure) -> bool:
    """Views the kernel runs: all but one entry per row (a row gather, run by XLA)."""
    return not view.one_per_row


def describe(view: Structure, n_features: int | None = None) -> dict[str, str]:
    """What runs ``view`` (host-side report for ``plan_info``)."""
    del n_features
    return {"pallas_tpu": "kernel" if covers(view) else "xla gather (one entry per row)"}


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

    Gathers X's rows into nonzero order (XLA), runs the block-sparse kernel (float32
    out), zeroes empty rows of max/min and casts to ``out_dtype``.
    """
    del platform
    values = entry_values(x, data, structure)
    if values.dtype == jnp.float16:  # the MXU takes bfloat16 and float32
        values = values.astype(jnp.float32)
    tiles = tpu_plan.t_tiles if structure.transposed else tpu_plan.tiles
    out = spmm(
        values,
        structure.row_ids(),
        tiles,
        num_rows=structure.shape[0],
        reduce=reduce,
        # The TPU interpreter (pltpu.InterpretParams) runs on io_callbacks with ordered
        # effects, which a primitive's lowering cannot host; the primitive uses the
        # generic Pallas interpreter and tests run the kernel under both.
        interpret=interpret,
    )
    if reduce != "sum":  # the kernel leaves -inf/+inf in empty rows
        out = zero_empty_rows(out, structure)
    return out.astype(out_dtype)
