"""The XLA path: CSR x dense products from XLA operations and jaxlib's own kernels.

No host callbacks. One of four strategies runs, chosen from the static structure
(:func:`choose_strategy`); all compute ``out[i] = sum_k data[k] * x[indices[k]]``
over the nonzeros ``k`` of row ``i`` and accumulate in float32 for 16-bit floats.

``"scatter"``
    Matrices with at most one nonzero per column (``from_indices``): a scatter-add
    of X's rows to their rows, in input order (``jax.ops.segment_sum``). No gather.
``"gather"``
    Matrices with at most one nonzero per row (the transpose of a ``from_indices``
    matrix): a row gather of X (``x[col]``), zero for empty rows.
``"csr_kernel"``
    jaxlib's CPU CSR x dense kernel (the one behind ``jax.experimental.sparse`` BCSR
    on CPU), which fuses the gather of X's rows with the row reduction. CPU only.
``"segment"``
    ``segment_sum(data[:, None] * x[indices], rows, indices_are_sorted=True)``: the
    portable fallback for general matrices off CPU.

``reduce="max"``/``"min"`` (:func:`spmm_extreme`) swaps the semiring over the same
structure classes; :func:`extreme_positions` finds the entry attaining each output
(the arg output and the gradient of max/min).

Measured on 2 CPU cores (twitter-ego, 81k rows, 2.7M nonzeros, float32; see
``benchmarks/``): for unsorted segment ids the scatter beats the CSR kernel at
every feature width tried (16/64/256); when the ids are already sorted the CSR
kernel streams X in order and beats both; for general matrices the CSR kernel is
10x or more faster than the gather + segment_sum idiom because XLA's CPU row
gather is slow.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


class Pattern(NamedTuple):
    """Device index arrays of a CSR structure and its planned transpose.

    See :class:`jaxcsr.plan.Structure` and :class:`jaxcsr.plan.TransposePlan` for
    the meaning of each array. ``row_of_col``/``col_of_row`` may be ``None``.
    """

    indptr: jax.Array
    indices: jax.Array
    t_indptr: jax.Array
    t_indices: jax.Array
    t_perm: jax.Array
    t_inverse_perm: jax.Array
    items: tuple[jax.Array, jax.Array, jax.Array]  # WorkItems (row, start, end) of A
    t_items: tuple[jax.Array, jax.Array, jax.Array]  # ... and of A.T
    tiles: tuple[jax.Array, jax.Array, jax.Array]  # TileSchedule of A (TPU kernel)
    t_tiles: tuple[jax.Array, jax.Array, jax.Array]  # ... and of A.T
    row_of_col: jax.Array | None
    col_of_row: jax.Array | None

    def transpose(self) -> Pattern:
        return Pattern(
            self.t_indptr,
            self.t_indices,
            self.indptr,
            self.indices,
            self.t_inverse_perm,
            self.t_perm,
            self.t_items,
            self.items,
            self.t_tiles,
            self.tiles,
            self.col_of_row,
            self.row_of_col,
        )

    def flat(self) -> list[jax.Array]:
        """The arrays that are present, in a fixed order (see :meth:`unflat`)."""
        out = [*self[:6], *self.items, *self.t_items, *self.tiles, *self.t_tiles]
        return out + [a for a in (self.row_of_col, self.col_of_row) if a is not None]

    @classmethod
    def unflat(cls, arrays, has_row_of_col: bool, has_col_of_row: bool) -> Pattern:
        arrays = list(arrays)
        fixed, rest = arrays[:6], arrays[18:]
        groups = [tuple(arrays[i : i + 3]) for i in range(6, 18, 3)]
        row_of_col = rest.pop(0) if has_row_of_col else None
        col_of_row = rest.pop(0) if has_col_of_row else None
        return cls(*fixed, *groups, row_of_col, col_of_row)


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype sums are carried in: float32 for 16-bit floats, int32 for small ints."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    if jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4:
        return np.dtype(np.int32)
    return dtype


def choose_strategy(
    *,
    has_row_of_col: bool,
    has_col_of_row: bool,
    identity_columns: bool,
    on_cpu: bool,
) -> Strategy:
    """Picks the strategy for a structure (see the module docstring for the data)."""
    csr_kernel = on_cpu and HAS_CPU_CSR_KERNEL
    if identity_columns and csr_kernel:
        return "csr_kernel"
    if has_row_of_col:
        return "scatter"
    if has_col_of_row:
        return "gather"
    return "csr_kernel" if csr_kernel else "segment"


def row_ids(pattern: Pattern) -> jax.Array:
    """Row of every nonzero in CSR order.

    Read from the planned transpose (whose column indices are A's rows) rather than
    expanded from ``indptr`` with a cumulative sum, which XLA would constant-fold
    for seconds when the matrix is a closed-over constant.
    """
    return pattern.t_indices[pattern.t_inverse_perm]


def _data_by_column(data: jax.Array, p: Pattern, nnz: int) -> jax.Array:
    """For <= 1 nonzero per column: each column's value, 0 for empty columns."""
    nonempty = jnp.diff(p.t_indptr) > 0
    pos = p.t_indptr[:-1].clip(max=max(nnz - 1, 0))
    return jnp.where(nonempty, data[p.t_perm[pos]], 0)


def _data_by_row(data: jax.Array, p: Pattern, nnz: int) -> jax.Array:
    """For <= 1 nonzero per row: each row's value, 0 for empty rows."""
    nonempty = jnp.diff(p.indptr) > 0
    pos = p.indptr[:-1].clip(max=max(nnz - 1, 0))
    return jnp.where(nonempty, data[pos], 0)


def spmm(
    x: jax.Array,
    data: jax.Array | None,
    pattern: Pattern,
    *,
    shape: tuple[int, int],
    strategy: Strategy,
) -> jax.Array:
    """``A @ x`` for a 2-D ``x`` of shape ``(shape[1], F)``, in the accumulation dtype.

    Args:
      x: dense operand ``(n, F)``; any numeric dtype.
      data: ``(nnz,)`` nonzero values in CSR order, or ``None`` for a one-valued
        matrix (no multiply is done).
      pattern: the structure's device index arrays.
      shape: ``(m, n)``.
      strategy: one of :data:`STRATEGIES`; ``"scatter"`` needs ``row_of_col``,
        ``"gather"`` needs ``col_of_row``, ``"csr_kernel"`` runs on CPU only.

    Returns:
      ``(m, F)`` array whose dtype is :func:`accumulation_dtype` of the promoted
      input dtype; the caller casts it back.
    """
    m, _ = shape
    nnz = pattern.indices.shape[0]
    out_dtype = x.dtype if data is None else jnp.result_type(data.dtype, x.dtype)
    acc = accumulation_dtype(out_dtype)
    f = x.shape[1]
    if m == 0 or f == 0 or nnz == 0:
        return jnp.zeros((m, f), acc)
    x = x.astype(acc)
    if data is not None:
        data = data.astype(acc)

    if strategy == "scatter":
        if pattern.row_of_col is None:
            raise ValueError("strategy 'scatter' needs a matrix with <= 1 nonzero per column")
        if data is not None:
            x = x * _data_by_column(data, pattern, nnz)[:, None]
        return jax.ops.segment_sum(x, pattern.row_of_col, m, mode="drop")
    if strategy == "gather":
        if pattern.col_of_row is None:
            raise ValueError("strategy 'gather' needs a matrix with <= 1 nonzero per row")
        out = x.at[pattern.col_of_row].get(mode="fill", fill_value=0)
        if data is not None:
            out = out * _data_by_row(data, pattern, nnz)[:, None]
        return out
    if strategy == "csr_kernel":
        if acc not in _CSR_KERNEL_DTYPES:
            raise ValueError(f"strategy 'csr_kernel' does not support dtype {acc}")
        values = jnp.ones((nnz,), acc) if data is None else data
        return jax.ffi.ffi_call(_CPU_CSR_KERNEL, jax.ShapeDtypeStruct((m, f), acc))(
            values, pattern.indptr, pattern.indices, x
        )
    if strategy == "segment":
        gathered = x[pattern.indices]
        if data is not None:
            gathered = gathered * data[:, None]
        return jax.ops.segment_sum(gathered, row_ids(pattern), m, indices_are_sorted=True)
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def sddmm(ct: jax.Array, x: jax.Array, pattern: Pattern, *, out_dtype: np.dtype) -> jax.Array:
    """``(ct @ x.T)`` sampled at the nonzeros: ``sum_f ct[row_k, f] * x[col_k, f]``.

    This is the cotangent of the product with respect to the matrix data.
    """
    nnz = pattern.indices.shape[0]
    if nnz == 0:
        return jnp.zeros((0,), out_dtype)
    acc = accumulation_dtype(jnp.result_type(ct.dtype, x.dtype))
    rows = row_ids(pattern)
    prod = ct[rows].astype(acc) * x[pattern.indices].astype(acc)
    return jnp.sum(prod, axis=1).astype(out_dtype)


# ------------------------------------------------------------ max / min reduce
EXTREMES: tuple[str, ...] = ("max", "min")


def product_dtype(x_dtype, data_dtype) -> np.dtype:
    """dtype of ``data * x`` (of ``x`` for one-valued matrices)."""
    if data_dtype is None:
        return np.dtype(x_dtype)
    return np.dtype(jnp.result_type(data_dtype, x_dtype))


def _weighted(values: jax.Array, weights: jax.Array | None, dtype) -> jax.Array:
    """``weights[:, None] * values`` in ``dtype`` (``values`` alone without weights).

    Products of 16-bit floats are formed in float32 and rounded once, as the Pallas
    kernels do, so comparing them with a kernel's max is exact.
    """
    if weights is None:
        return values.astype(dtype)
    acc = accumulation_dtype(dtype)
    return (weights.astype(acc)[:, None] * values.astype(acc)).astype(dtype)


def entry_values(x: jax.Array, data: jax.Array | None, pattern: Pattern) -> jax.Array:
    """``data[k] * x[indices[k]]`` for every nonzero ``k`` (CSR order), ``(nnz, F)``."""
    dtype = product_dtype(x.dtype, None if data is None else data.dtype)
    return _weighted(x[pattern.indices], data, dtype)


def column_values(x: jax.Array, data: jax.Array | None, pattern: Pattern) -> jax.Array:
    """For <= 1 nonzero per column: ``data_j * x[j]`` in input order, ``(n, F)``.

    No gather: column ``j``'s value multiplies X's row ``j`` (0 for empty columns).
    """
    dtype = product_dtype(x.dtype, None if data is None else data.dtype)
    weights = None if data is None else _data_by_column(data, pattern, pattern.indices.shape[0])
    return _weighted(x, weights, dtype)


def row_degrees(pattern: Pattern) -> jax.Array:
    """Stored entries per row, ``(m,)``."""
    return jnp.diff(pattern.indptr)


def zero_empty_rows(out: jax.Array, pattern: Pattern) -> jax.Array:
    """``out`` with the rows that store no entry set to 0 (max/min's empty rows)."""
    return jnp.where(row_degrees(pattern)[:, None] > 0, out, jnp.zeros((), out.dtype))


def _segment_extreme(values, segments, num_segments, reduce, *, indices_are_sorted):
    fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
    return fn(values, segments, num_segments, indices_are_sorted=indices_are_sorted)


def spmm_extreme(
    x: jax.Array,
    data: jax.Array | None,
    pattern: Pattern,
    *,
    shape: tuple[int, int],
    strategy: Strategy,
    reduce: str,
) -> jax.Array:
    """``out[i] = max_k data[k] * x[indices[k]]`` over row ``i``'s nonzeros (or ``min``).

    The structure classes of :func:`spmm` with the ``(+, *)`` semiring swapped for
    ``(max, *)``/``(min, *)``: a scatter-max in input order for at most one nonzero
    per column (sorted when the ids were, ``strategy == "csr_kernel"``), a row gather
    for at most one per row, else a sorted segment max of the gathered products
    (jaxlib's CSR kernel only sums). 16-bit floats are reduced in float32, which is
    exact (rounding is monotone) and several times faster on XLA:CPU. NaN propagates
    (XLA's max/min do). Empty rows are 0.

    Returns:
      ``(m, F)`` in the product dtype.
    """
    if reduce not in EXTREMES:
        raise ValueError(f"reduce must be one of {EXTREMES}, got {reduce!r}")
    m, _ = shape
    nnz = pattern.indices.shape[0]
    dtype = product_dtype(x.dtype, None if data is None else data.dtype)
    f = x.shape[1]
    if m == 0 or f == 0 or nnz == 0:
        return jnp.zeros((m, f), dtype)
    acc = accumulation_dtype(dtype)
    if pattern.row_of_col is not None:
        values = column_values(x, data, pattern).astype(acc)
        out = _segment_extreme(
            values, pattern.row_of_col, m, reduce, indices_are_sorted=strategy == "csr_kernel"
        )
    elif pattern.col_of_row is not None:
        gathered = x.at[pattern.col_of_row].get(mode="fill", fill_value=0)
        weights = None if data is None else _data_by_row(data, pattern, nnz)
        out = _weighted(gathered, weights, dtype)
    else:
        values = entry_values(x, data, pattern).astype(acc)
        out = _segment_extreme(values, row_ids(pattern), m, reduce, indices_are_sorted=True)
    return zero_empty_rows(out.astype(dtype), pattern)


def extreme_positions(
    x: jax.Array, data: jax.Array | None, pattern: Pattern, out: jax.Array
) -> jax.Array:
    """CSR position of the entry that attains ``out[i, f]`` (the row max or min).

    Ties go to the first position in CSR order (the smallest column for every
    constructor but ``from_arrays``); a NaN result points at the row's first NaN.
    Empty rows get the sentinel ``nnz``. With at most one nonzero per column (every
    ``from_indices`` matrix) the search runs over X's rows in input order, with no
    gather of X; otherwise over the gathered products.

    Args:
      x, data, pattern: the product's operands.
      out: ``(m, F)`` result of :func:`spmm_extreme` (or a kernel), any dtype; it is
        compared in the product dtype.

    Returns:
      ``(m, F)`` int32 positions in ``[0, nnz]``.
    """
    m, f = out.shape
    nnz = pattern.indices.shape[0]
    if nnz == 0 or m == 0 or f == 0:
        return jnp.full((m, f), nnz, jnp.int32)
    if pattern.row_of_col is not None:  # search the columns, in input order
        n = x.shape[0]
        first = _first_column_hit(x, data, pattern, out)
        nonempty_column = pattern.t_indptr[:-1].clip(max=nnz - 1)
        position_of_column = jnp.append(pattern.t_perm[nonempty_column], nnz).astype(jnp.int32)
        return position_of_column[jnp.minimum(first, n)]
    values = entry_values(x, data, pattern)
    rows = row_ids(pattern)
    return jnp.minimum(_first_hit(values, out.astype(values.dtype)[rows], rows, m, True), nnz)


def _first_column_hit(x, data, pattern: Pattern, out: jax.Array) -> jax.Array:
    """For <= 1 nonzero per column: the first column attaining ``out`` per (row, feature).

    ``(m, F)`` int32; rows without a hit (empty rows) hold the int32 maximum.
    """
    m = out.shape[0]
    values = column_values(x, data, pattern)
    rows = pattern.row_of_col  # m for an empty column: dropped by the segment_min
    target = out.astype(values.dtype)[jnp.minimum(rows, m - 1)]
    return _first_hit(values, target, rows, m, False)


def extreme_column_mask(
    x: jax.Array, data: jax.Array | None, pattern: Pattern, out: jax.Array
) -> jax.Array:
    """For <= 1 nonzero per column: ``mask[j, f]`` is True where column ``j`` attains
    ``out[row_of_col[j], f]`` (the first such column of its row; ties as
    :func:`extreme_positions`). ``(n, F)`` bool.

    With it the max/min is ``A @ (mask * x)``, a sum whose transpose is a row gather:
    the gradient needs no scatter.
    """
    m = out.shape[0]
    n, f = x.shape
    if m == 0 or n == 0 or f == 0 or pattern.indices.shape[0] == 0:
        return jnp.zeros((n, f), bool)
    first = _first_column_hit(x, data, pattern, out)
    rows = pattern.row_of_col
    winner = first[jnp.minimum(rows, m - 1)]
    return (winner == jnp.arange(n, dtype=jnp.int32)[:, None]) & (rows < m)[:, None]


def _first_hit(values, target, rows, m, indices_are_sorted) -> jax.Array:
    """Smallest index ``k`` per (row, feature) with ``values[k] == target[k]``.

    Rows with no hit hold the int32 maximum; NaN matches NaN.
    """
    hit = values == target
    if jnp.issubdtype(values.dtype, jnp.inexact):
        hit = hit | (jnp.isnan(values) & jnp.isnan(target))
    index = jnp.arange(values.shape[0], dtype=jnp.int32)[:, None]
    candidates = jnp.where(hit, index, jnp.iinfo(jnp.int32).max)
    return jax.ops.segment_min(candidates, rows, m, indices_are_sorted=indices_are_sorted)
