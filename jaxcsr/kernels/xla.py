"""The XLA backend: CSR x dense products from XLA operations and jaxlib's own kernels.

Runs on every platform, plans nothing beyond the portable core
(:class:`~jaxcsr.structure.Structure`) and is what runs when no kernel is planned or
chosen. It also answers for the parts of the primitive that every backend shares:
the sampled product :func:`sddmm` (the values' gradient) and the search for the
entry attaining a max/min (:data:`ARG_SEARCH`).

One of four strategies runs a sum, chosen from the static structure and the operand
width (:func:`choose_strategy`); all compute ``out[i] = sum_k data[k] * x[indices[k]]``
over the nonzeros ``k`` of row ``i`` and accumulate in float32 for 16-bit floats.

``"scatter"``
    Matrices with at most one nonzero per column (``from_indices``): a scatter-add
    of X's rows to their rows by ``row_of_col`` (the segment ids themselves), in
    input order (``jax.ops.segment_sum``). No gather.
``"gather"``
    Matrices with at most one nonzero per row (the transpose of a ``from_indices``
    matrix): a row gather of X (``x[row_of_col]``, the same array), zero for empty rows.
``"csr_kernel"``
    jaxlib's CPU CSR x dense kernel (the one behind ``jax.experimental.sparse`` BCSR
    on CPU), which fuses the gather of X's rows with the row reduction. CPU only.
``"segment"``
    ``segment_sum(data[:, None] * x[indices], rows, indices_are_sorted=True)``: the
    portable fallback for general matrices off CPU.

``reduce="max"``/``"min"`` (:func:`spmm_extreme`) swaps the semiring over the same
structure classes; :func:`extreme_positions` finds the entry attaining each output
(the arg output and the gradient of max/min).

The thresholds follow crossovers measured on 2 CPU cores (float32): jaxlib's CSR
kernel costs about as much for one feature as for eight, so narrow operands scatter;
with sorted segment ids it wins from :data:`CSR_KERNEL_MIN_WIDTH` features, with
unsorted ids (X's rows gathered at random) only from
:data:`UNSORTED_CSR_KERNEL_MIN_WIDTH`, and never for ids planned on the device,
whose sort it would pay at every call; general matrices run it from
:data:`CSR_KERNEL_MIN_WIDTH` and the gather + sorted segment sum below. The timings
are in ``benchmarks/results/cpu-epyc/strategies/strategies.md`` (``python -m
benchmarks.studies.strategies``).

Every function here takes non-empty operands (rows, columns, entries and features
all > 0): the primitive answers empty products itself.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxcsr.dtypes import accumulation_dtype, product_dtype
from jaxcsr.kernels.semiring import column_values, entry_values, weighted, zero_empty_rows
from jaxcsr.structure import Structure
from jaxcsr.take_attaining import first_attaining

try:  # registers jaxlib's sparse FFI targets (cpu_csr_sparse_dense_ffi)
    import jax.experimental.sparse._lowerings

    HAS_CPU_CSR_KERNEL = True
except Exception:  # pragma: no cover - depends on the installed jaxlib
    HAS_CPU_CSR_KERNEL = False

Strategy = Literal["scatter", "gather", "csr_kernel", "segment"]
STRATEGIES: tuple[str, ...] = ("scatter", "gather", "csr_kernel", "segment")

_CPU_CSR_KERNEL = "cpu_csr_sparse_dense_ffi"
# dtypes jaxlib's CPU CSR kernel is instantiated for.
_CSR_KERNEL_DTYPES = tuple(
    np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.complex64, np.complex128)
)

# XLA's scatters, bound at import: a caller may swap jax.ops' functions for jaxcsr's
# (tests/upstream_suites.py does), which must not reach back into this backend.
_scatter_sum = jax.ops.segment_sum
_scatter_max = jax.ops.segment_max
_scatter_min = jax.ops.segment_min
_NO_HIT = int(jnp.iinfo(jnp.int32).max)
"""A row without a position attaining its value (an empty row) in the arg searches."""


# ------------------------------------------------------------ backend contract
def plan(structure: Structure) -> None:
    """The XLA path reads only the portable core: nothing to plan."""
    del structure


def covers(view: Structure) -> bool:
    """Every view runs here."""
    del view
    return True


def product(
    x: jax.Array,
    data: jax.Array | None,
    structure: Structure,
    xla_plan: None,
    *,
    reduce: str,
    out_dtype,
    interpret: bool,
    platform: str,
) -> jax.Array:
    """Backend entry: the viewed matrix times ``x`` with ``reduce``, in ``out_dtype``."""
    del xla_plan, interpret
    if reduce == "sum":
        strategy = choose_strategy(structure, on_cpu=platform == "cpu", width=x.shape[1])
        out = spmm(x, data, structure, strategy=strategy)
    else:
        out = spmm_extreme(x, data, structure, reduce=reduce)
    return out.astype(out_dtype)


def describe(view: Structure, n_features: int | None = None) -> dict[str, str]:
    """The strategy a sum runs on CPU and off it (``n_features=None``: a wide operand)."""
    return {
        f"xla on {where}": choose_strategy(view, on_cpu=where == "cpu", width=n_features)
        for where in ("cpu", "gpu/tpu")
    }


CSR_KERNEL_MIN_WIDTH = 8
"""Narrowest operand (features) for which jaxlib's CPU CSR kernel beats the scatter."""
UNSORTED_CSR_KERNEL_MIN_WIDTH = 128
"""... and for unsorted segment ids, whose CSR order gathers X's rows at random."""


def choose_strategy(structure: Structure, *, on_cpu: bool, width: int | None = None) -> Strategy:
    """Picks the strategy for a viewed structure and an operand of ``width`` features.

    ``width=None`` answers for a wide operand (the choice :meth:`CSRMatrix.plan_info`
    reports). See the module docstring for the measurements behind the thresholds.
    """
    csr_kernel = on_cpu and HAS_CPU_CSR_KERNEL
    wide = width is None or width >= CSR_KERNEL_MIN_WIDTH
    if structure.one_per_column:
        if csr_kernel and structure.sorted_ids and wide:
            return "csr_kernel"
        # unsorted ids planned on the device would pay their sort at every call
        unsorted_wide = width is not None and width >= UNSORTED_CSR_KERNEL_MIN_WIDTH
        if csr_kernel and unsorted_wide and not structure.layout.padded:
            return "csr_kernel"
        return "scatter"
    if structure.one_per_row:
        return "gather"
    return "csr_kernel" if csr_kernel and wide else "segment"


def spmm(
    x: jax.Array,
    data: jax.Array | None,
    structure: Structure,
    *,
    strategy: Strategy,
) -> jax.Array:
    """``A @ x`` for the viewed matrix ``A`` and a 2-D ``x`` ``(n, F)``, accumulation dtype.

    Args:
      x: dense operand ``(n, F)``; any numeric dtype.
      data: ``(nnz,)`` values in the view's CSR order, or ``None`` for a one-valued
        matrix (no multiply is done).
      structure: the matrix's :class:`~jaxcsr.structure.Structure` (a view).
      strategy: one of :data:`STRATEGIES`; ``"scatter"`` needs a one-per-column view,
        ``"gather"`` a one-per-row view, ``"csr_kernel"`` runs on CPU only.

    Returns:
      ``(m, F)`` array whose dtype is :func:`~jaxcsr.dtypes.accumulation_dtype` of the
      promoted input dtype; the caller casts it back.
    """
    m, _ = structure.shape
    nnz = structure.nnz
    acc = accumulation_dtype(product_dtype(x.dtype, None if data is None else data.dtype))
    f = x.shape[1]
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "scatter" and not structure.one_per_column:
        raise ValueError("strategy 'scatter' needs a matrix with <= 1 nonzero per column")
    if strategy == "gather" and not structure.one_per_row:
        raise ValueError("strategy 'gather' needs a matrix with <= 1 nonzero per row")
    if strategy == "gather":
        # One entry per row: no sum, so X's rows are gathered in their own dtype (no
        # float32 copy of a 16-bit X); a matrix without empty rows needs no bounds fill.
        if structure.layout.full:
            out = x[structure.row_of_col]
        else:
            out = _rows_of(x, structure.row_of_col)
        out = out.astype(acc)
        if data is not None:
            out = out * structure.row_values(data.astype(acc))[:, None]
        return out
    x = x.astype(acc)
    if data is not None:
        data = data.astype(acc)

    if strategy == "scatter":
        if data is not None:
            x = x * structure.column_values(data)[:, None]
        return _scatter_add(x, structure.row_of_col, m, sorted_ids=structure.sorted_ids)
    if strategy == "csr_kernel":
        if acc not in _CSR_KERNEL_DTYPES:
            raise ValueError(f"strategy 'csr_kernel' does not support dtype {acc}")
        values = jnp.ones((nnz,), acc) if data is None else data
        return jax.ffi.ffi_call(_CPU_CSR_KERNEL, jax.ShapeDtypeStruct((m, f), acc))(
            values, structure.view_indptr(), structure.view_indices(), x
        )
    gathered = x[structure.view_indices()]
    if data is not None:
        gathered = gathered * data[:, None]
    return _scatter_add(gathered, structure.row_ids(), m, sorted_ids=True)


def _rows_of(x: jax.Array, ids: jax.Array) -> jax.Array:
    """``x[ids]`` with 0 for every id outside ``[0, len(x))``, negative ones included
    (a padded layout's dropped ids are read as given: no extra pass over them)."""
    return x.at[ids].get(mode="fill", fill_value=0, wrap_negative_indices=False)


INTERLEAVE = 16
"""Sorted ids, one feature: the scatter takes every ``INTERLEAVE``-th update in turn."""


def _scatter_add(x: jax.Array, ids: jax.Array, m: int, *, sorted_ids: bool) -> jax.Array:
    """``segment_sum(x, ids, m)`` (ids ``>= m`` dropped), for the scatter strategy.

    With sorted ids, consecutive updates read-modify-write the same output row: a
    dependency chain in XLA:CPU's serial scatter loop. For a single feature the updates
    are taken in a strided order (``INTERLEAVE`` apart; a transpose of the padded
    ``(16, n / 16)`` view), which breaks the chain. Wider rows pay more for the
    transpose than they gain, so they keep the input order.
    """
    n = x.shape[0]
    if not (sorted_ids and x.shape[1] == 1 and n >= 2 * INTERLEAVE):
        return _scatter_sum(x, ids, m, indices_are_sorted=sorted_ids, mode="drop")
    pad = -n % INTERLEAVE
    strided = jnp.pad(x[:, 0], (0, pad)).reshape(INTERLEAVE, -1).T.reshape(-1, 1)
    strided_ids = jnp.pad(ids, (0, pad), constant_values=m).reshape(INTERLEAVE, -1).T.reshape(-1)
    return _scatter_sum(strided, strided_ids, m, mode="drop")


def sddmm(ct: jax.Array, x: jax.Array, structure: Structure, *, out_dtype) -> jax.Array:
    """``ct (m, H, F)`` and ``x (n, H, F)`` sampled at the stored entries: ``(nnz, H)``,
    ``sum_f ct[row_k, h, f] * x[col_k, h, f]``.

    The cotangent of the product with respect to the matrix data, in the view's CSR
    order. One-per-column views read X in order (no gather of X); one-per-row views
    read ``ct`` in order.
    """
    acc = accumulation_dtype(jnp.result_type(ct.dtype, x.dtype))
    if structure.one_per_column:  # per column j: ct[row_of_col[j]] . x[j]
        m = structure.shape[0]
        rows = structure.column_rows()
        per_column = jnp.sum(ct[jnp.minimum(rows, m - 1)].astype(acc) * x.astype(acc), axis=-1)
        if structure.layout.padded:  # dropped entries: no row, no gradient
            per_column = jnp.where((rows < m)[:, None], per_column, 0)
        per_entry = per_column if structure.sorted_ids else per_column[structure.indices]
        return per_entry.astype(out_dtype)
    if structure.one_per_row:  # per row i: ct[i] . x[col_of_row[i]]
        cols = jnp.minimum(structure.column_rows(), x.shape[0] - 1)
        per_row = jnp.sum(ct.astype(acc) * x[cols].astype(acc), axis=-1)
        return structure.compact_rows(per_row).astype(out_dtype)
    rows = structure.row_ids()
    prod = ct[rows].astype(acc) * x[structure.view_indices()].astype(acc)
    out = jnp.sum(prod, axis=-1)
    if structure.layout.padded:  # dropped entries: no row, no gradient
        out = jnp.where((rows < structure.shape[0])[:, None], out, 0)
    return out.astype(out_dtype)


# ------------------------------------------------------------ max / min reduce
def _segment_extreme(values, segments, num_segments, reduce, *, indices_are_sorted):
    fn = _scatter_max if reduce == "max" else _scatter_min
    return fn(values, segments, num_segments, indices_are_sorted=indices_are_sorted)


def spmm_extreme(
    x: jax.Array,
    data: jax.Array | None,
    structure: Structure,
    *,
    reduce: str,
) -> jax.Array:
    """``out[i] = max_k data[k] * x[indices[k]]`` over row ``i``'s entries (or ``min``).

    The structure classes of :func:`spmm` with the ``(+, *)`` semiring swapped for
    ``(max, *)``/``(min, *)``: a scatter-max in input order for one-per-column views
    (sorted when the ids were), a row gather for one-per-row views (a single entry
    is its own max), else a sorted segment max of the gathered products (jaxlib's CSR
    kernel only sums). 16-bit floats are reduced in float32, which is exact
    (rounding is monotone) and several times faster on XLA:CPU. NaN propagates
    (XLA's max/min do). Empty rows are 0.

    Returns:
      ``(m, F)`` in the product dtype.
    """
    m, _ = structure.shape
    dtype = product_dtype(x.dtype, None if data is None else data.dtype)
    acc = accumulation_dtype(dtype)
    if structure.one_per_column:
        values = column_values(x, data, structure).astype(acc)
        out = _segment_extreme(
            values, structure.row_of_col, m, reduce, indices_are_sorted=structure.sorted_ids
        )
    elif structure.one_per_row:
        gathered = _rows_of(x, structure.row_of_col)
        weights = None if data is None else structure.row_values(data)
        out = weighted(gathered, weights, dtype)
    else:
        values = entry_values(x, data, structure).astype(acc)
        out = _segment_extreme(values, structure.row_ids(), m, reduce, indices_are_sorted=True)
    return zero_empty_rows(out.astype(dtype), structure)


def extreme_positions(
    x: jax.Array, data: jax.Array | None, structure: Structure, out: jax.Array
) -> jax.Array:
    """CSR position of the entry that attains ``out[i, f]`` (the row max or min).

    Ties go to the first position in CSR order (the smallest column for every
    constructor but ``from_arrays``); a NaN result points at the row's first NaN.
    Empty rows get the sentinel ``nnz``. For views that are not one-per-column (those
    use :func:`extreme_columns` and :func:`extreme_column_mask`, with no gather).

    Args:
      x, data, structure: the product's operands.
      out: ``(m, F)`` result of :func:`spmm_extreme` (or a kernel), any dtype; it is
        compared in the product dtype.

    Returns:
      ``(m, F)`` int32 positions in ``[0, nnz]``.
    """
    m = out.shape[0]
    values = entry_values(x, data, structure)
    rows = structure.row_ids()
    target = out.astype(values.dtype)[rows]
    hit = first_attaining(values, target, rows, m, sorted_ids=True, empty=_NO_HIT)
    return jnp.minimum(hit, structure.nnz)


def extreme_columns(
    x: jax.Array, data: jax.Array | None, structure: Structure, out: jax.Array
) -> jax.Array:
    """Column attaining ``out[i, f]`` (ties as :func:`extreme_positions`), ``(m, F)`` int32.

    Empty rows get the sentinel ``n`` (the number of columns).
    """
    m, f = out.shape
    n = structure.shape[1]
    if structure.one_per_column:  # search the columns, in input order
        return jnp.minimum(_first_column_hit(x, data, structure, out), n)
    if structure.one_per_row:  # the row's only entry (its own max)
        return jnp.broadcast_to(structure.column_rows().astype(jnp.int32)[:, None], (m, f))
    position = extreme_positions(x, data, structure, out)
    columns = jnp.append(structure.view_indices().astype(jnp.int32), jnp.int32(n))
    return columns[position]


def _first_column_hit(x, data, structure: Structure, out: jax.Array) -> jax.Array:
    """One-per-column view: the first column attaining ``out`` per (row, feature).

    ``(m, F)`` int32; rows without a hit (empty rows) hold the int32 maximum.
    """
    m = out.shape[0]
    values = column_values(x, data, structure)
    rows = structure.column_rows()  # m for an empty column: dropped by the segment_min
    target = out.astype(values.dtype)[jnp.minimum(rows, m - 1)]
    return first_attaining(values, target, rows, m, sorted_ids=structure.sorted_ids, empty=_NO_HIT)


def extreme_column_mask(
    x: jax.Array, data: jax.Array | None, structure: Structure, out: jax.Array
) -> jax.Array:
    """One-per-column view: ``mask[j, f]`` is True where column ``j`` attains
    ``out[row_of_col[j], f]`` (the first such column of its row; ties as
    :func:`extreme_positions`). ``(n, F)`` bool.

    With it the max/min is ``A @ (mask * x)``, a sum whose transpose is a row gather:
    the gradient needs no scatter.
    """
    first = _first_column_hit(x, data, structure, out)
    return _attains(first, structure.column_rows())[0]


def put_attaining(ct: jax.Array, columns: jax.Array, rows: jax.Array) -> jax.Array:
    """One-per-column view: ``(n, F)``, ``ct[rows[k], f]`` where ``columns[rows[k], f]
    == k``, else 0 (``rows``: each column's row, ``m`` for none; ``columns``: ``(m, F)``
    attaining columns, ``n`` for none). One fused pass, no scatter."""
    hit, row = _attains(columns, rows)
    return jnp.where(hit, ct[row], jnp.zeros((), ct.dtype))


def _attains(columns: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(n, F)`` bool: column ``k`` is its row's ``columns[rows[k]]`` (a row outside
    ``[0, m)``: none), and the rows clipped into ``[0, m)``, for reading per-row arrays."""
    n, m = rows.shape[0], columns.shape[0]
    row = jnp.clip(rows, 0, m - 1)
    mine = jnp.arange(n, dtype=columns.dtype)[:, None]
    return ((rows >= 0) & (rows < m))[:, None] & (columns[row] == mine), row
