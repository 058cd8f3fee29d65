"""Host-side planning: everything about a sparse structure that is computed once.

The index structure of a :class:`~jaxcsr.CSRMatrix` is static, so all sorting,
counting and transposing happens here, on the host, with numpy. The functions in
this module take and return plain numpy arrays; they never touch a device and can
be unit-tested without running a kernel.

Conventions
-----------
* Index arrays are ``int32`` (``int64`` only when a size does not fit in 32 bits).
* "CSR order" of the nonzeros is rows ascending, and within a row the order the
  nonzeros had in the input (a *stable* sort by row). For inputs whose columns are
  ascending within each row (``from_indices``, ``from_dense``, sorted scipy
  matrices) this is the usual rows-then-columns order.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np

__all__ = [
    "Structure",
    "TransposePlan",
    "check_csr_arrays",
    "check_shape",
    "check_segment_ids",
    "coo_to_csr",
    "index_dtype_for",
    "plan_structure",
    "plan_transpose",
    "plan_work_items",
    "plan_tile_schedule",
    "TileSchedule",
    "WorkItems",
    "row_ids",
    "segment_ids_to_csr",
]


def index_dtype_for(*sizes: int) -> np.dtype:
    """Smallest of int32/int64 that can hold every value in ``[0, max(sizes)]``."""
    return np.dtype(np.int32 if max(sizes, default=0) < 2**31 - 1 else np.int64)


def _as_host_int_array(value: Any, name: str) -> np.ndarray:
    """Converts ``value`` to a host numpy integer array or raises a named error."""
    try:
        arr = np.asarray(value)
    except Exception as err:  # jax tracers raise TracerArrayConversionError here
        if type(err).__name__.startswith("Tracer") or "Tracer" in str(err):
            raise ValueError(
                f"{name} is a traced JAX value; a CSRMatrix structure is planned on "
                "the host and must be built outside jax.jit/vmap/grad. Build the "
                "matrix once outside the traced function and pass it in as an "
                "argument (it is a pytree)."
            ) from err
        raise TypeError(f"{name} must be an array of integers, got {type(value)!r}") from err
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of integers, got dtype object")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    return arr


def _check_size(value: Any, name: str) -> int:
    try:
        size = operator.index(value)
    except TypeError as err:
        raise TypeError(f"{name} must be an int, got {value!r}") from err
    if size < 0:
        raise ValueError(f"{name} must be >= 0, got {size}")
    return size


def _check_range(arr: np.ndarray, bound: int, name: str, bound_name: str) -> None:
    if arr.size == 0:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name} must be >= 0; {name}[{bad}] = {int(arr[bad])}")
    if hi >= bound:
        bad = int(np.flatnonzero(arr >= bound)[0])
        raise ValueError(
            f"{name} must be < {bound_name} = {bound}; {name}[{bad}] = {int(arr[bad])}"
        )


def check_segment_ids(
    idx: Any, num_rows: Any, *, names: tuple[str, str] = ("idx", "num_rows")
) -> tuple[np.ndarray, int]:
    """Validates segment ids for :meth:`CSRMatrix.from_indices`.

    Args:
      idx: 1-D integer array-like of segment (row) ids, one per input position.
      num_rows: number of segments; every id must lie in ``[0, num_rows)``.
      names: the two arguments' names as the caller spells them, for messages.

    Returns:
      ``(idx, num_rows)`` as a host numpy array and an int.

    Raises:
      TypeError: ``idx`` is not integer, ``num_rows`` not an int.
      ValueError: ``idx`` not 1-D, traced, or out of range; ``num_rows < 0``.
    """
    idx_name, size_name = names
    num_rows = _check_size(num_rows, size_name)
    arr = _as_host_int_array(idx, idx_name)
    if arr.ndim != 1:
        raise ValueError(f"{idx_name} must be 1-D, got shape {arr.shape}")
    _check_range(arr, num_rows, idx_name, size_name)
    return arr, num_rows


def segment_ids_to_csr(idx: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of the one-valued matrix ``A[idx[j], j] = 1``.

    Returns:
      ``(indptr, order)``: ``indptr`` of length ``num_rows + 1`` and ``order``, the
      input position of each nonzero in CSR order (a stable argsort of ``idx``).
      ``order`` is also the CSR column-index array, since column ``j`` is input ``j``.
    """
    itype = index_dtype_for(idx.size, num_rows)
    order = np.argsort(idx, kind="stable").astype(itype)
    counts = np.bincount(idx, minlength=num_rows)
    indptr = np.zeros(num_rows + 1, dtype=itype)
    np.cumsum(counts, out=indptr[1:])
    return indptr, order


def coo_to_csr(
    row: Any, col: Any, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validates COO coordinates and sorts them into CSR order.

    Duplicates are kept as separate nonzeros (their products add up, exactly as
    summing them would), so the returned permutation is a bijection on the input.

    Returns:
      ``(indptr, indices, order)`` where ``order[k]`` is the input position of the
      ``k``-th nonzero in CSR order (rows ascending, then columns ascending).
    """
    m, n = shape
    row = _as_host_int_array(row, "row")
    col = _as_host_int_array(col, "col")
    if row.ndim != 1 or col.ndim != 1:
        raise ValueError(f"row and col must be 1-D, got shapes {row.shape} and {col.shape}")
    if row.shape != col.shape:
        raise ValueError(f"row and col must have the same length, got {row.size} and {col.size}")
    _check_range(row, m, "row", "shape[0]")
    _check_range(col, n, "col", "shape[1]")
    itype = index_dtype_for(row.size, m, n)
    order = np.lexsort((col, row)).astype(itype)  # last key is primary: row, then col
    indptr = np.zeros(m + 1, dtype=itype)
    np.cumsum(np.bincount(row, minlength=m), out=indptr[1:])
    return indptr, col[order].astype(itype), order


def check_shape(shape: Any) -> tuple[int, int]:
    """Validates a 2-D matrix shape."""
    try:
        m, n = shape
    except (TypeError, ValueError) as err:
        raise ValueError(f"shape must be a pair (rows, cols), got {shape!r}") from err
    return _check_size(m, "shape[0]"), _check_size(n, "shape[1]")


def check_csr_arrays(
    indptr: Any, indices: Any, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Validates raw CSR index arrays (as scipy's ``check_format`` does).

    Raises:
      ValueError: wrong lengths, ``indptr`` not starting at 0, decreasing, or not
        ending at ``len(indices)``, column indices out of ``[0, shape[1])``.
    """
    m, n = shape
    indptr = _as_host_int_array(indptr, "indptr")
    indices = _as_host_int_array(indices, "indices")
    if indptr.ndim != 1 or indptr.size != m + 1:
        raise ValueError(
            f"indptr must be 1-D of length shape[0] + 1 = {m + 1}, got shape {indptr.shape}"
        )
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
    if indptr[0] != 0:
        raise ValueError(f"indptr[0] must be 0, got {int(indptr[0])}")
    steps = np.diff(indptr)
    if np.any(steps < 0):
        bad = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(
            f"indptr must be non-decreasing; indptr[{bad}] = {int(indptr[bad])} > "
            f"indptr[{bad + 1}] = {int(indptr[bad + 1])}"
        )
    if indptr[-1] != indices.size:
        raise ValueError(
            f"indptr[-1] must equal nnz = len(indices) = {indices.size}, got {int(indptr[-1])}"
        )
    _check_range(indices, n, "indices", "shape[1]")
    itype = index_dtype_for(indices.size, m, n)
    return indptr.astype(itype), indices.astype(itype)


@dataclasses.dataclass(frozen=True)
class TransposePlan:
    """The CSR structure of ``A.T`` and how A's nonzeros map onto it.

    Attributes:
      indptr: ``(n + 1,)`` row pointer of ``A.T``.
      indices: ``(nnz,)`` column indices of ``A.T`` (= row indices of ``A``).
      perm: ``(nnz,)``; ``perm[k]`` is the position in A's CSR order of the ``k``-th
        nonzero of ``A.T``, so ``data_T = data[perm]``.
      inverse_perm: ``(nnz,)`` inverse of ``perm``, so ``data = data_T[inverse_perm]``.
    """

    indptr: np.ndarray
    indices: np.ndarray
    perm: np.ndarray
    inverse_perm: np.ndarray


def row_ids(indptr: np.ndarray) -> np.ndarray:
    """Row index of every nonzero, in CSR order."""
    return np.repeat(np.arange(indptr.size - 1, dtype=indptr.dtype), np.diff(indptr))


def plan_transpose(
    indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int]
) -> TransposePlan:
    """Plans ``A.T`` in CSR form (a stable counting sort by column)."""
    _, n = shape
    perm = np.argsort(indices, kind="stable").astype(indptr.dtype)
    t_indptr = np.zeros(n + 1, dtype=indptr.dtype)
    np.cumsum(np.bincount(indices, minlength=n), out=t_indptr[1:])
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.size, dtype=perm.dtype)
    return TransposePlan(t_indptr, row_ids(indptr)[perm], perm, inverse)


@dataclasses.dataclass(frozen=True)
class Structure:
    """Static facts about a CSR structure that decide which strategy runs.

    Attributes:
      row_of_col: ``(n,)`` for matrices with at most one nonzero per column (the
        matrices of ``from_indices``): the row of column ``j``'s nonzero, or ``m``
        (out of range) where column ``j`` is empty. ``None`` otherwise. With it,
        ``A @ X`` is a scatter-add of X's rows, no gather needed.
      col_of_row: ``(m,)`` for matrices with at most one nonzero per row (such as
        the transpose of a ``from_indices`` matrix): the column of row ``i``'s
        nonzero, or ``n`` where row ``i`` is empty. ``None`` otherwise. With it,
        ``A @ X`` is a row gather of X.
      identity_columns: every column holds exactly one nonzero and the CSR column
        indices are ``0, 1, ..., n-1`` in order (segment ids already sorted): the
        product streams X in order.
    """

    row_of_col: np.ndarray | None
    col_of_row: np.ndarray | None
    identity_columns: bool


def plan_structure(indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int]) -> Structure:
    """Classifies a validated CSR structure (see :class:`Structure`)."""
    m, n = shape
    nnz = indices.size
    col_counts = np.bincount(indices, minlength=n)
    row_of_col = col_of_row = None
    if nnz == 0 or col_counts.max() <= 1:
        row_of_col = np.full(n, m, dtype=indptr.dtype)
        row_of_col[indices] = row_ids(indptr)
    row_counts = np.diff(indptr)
    if nnz == 0 or row_counts.max() <= 1:
        col_of_row = np.full(m, n, dtype=indptr.dtype)
        col_of_row[row_counts > 0] = indices
    identity = bool(nnz == n and np.array_equal(indices, np.arange(n)))
    return Structure(row_of_col, col_of_row, identity)


@dataclasses.dataclass(frozen=True)
class WorkItems:
    """A load-balanced split of a CSR matrix's nonzeros into bounded work items.

    Item ``t`` reduces nonzeros ``start[t]:end[t]`` (at most ``chunk`` of them), all
    in row ``row[t]``. A row longer than ``chunk`` is split over several items
    (their partial sums are combined by atomic adds), so one huge row cannot
    serialise a kernel; empty rows get no item (the output starts at zero). The
    item count is padded to a multiple of ``items_per_program`` with empty items.
    """

    row: np.ndarray
    start: np.ndarray
    end: np.ndarray
    chunk: int
    items_per_program: int

    @property
    def num_programs(self) -> int:
        return self.row.size // self.items_per_program


def plan_work_items(indptr: np.ndarray, chunk: int, items_per_program: int) -> WorkItems:
    """Splits every row into items of at most ``chunk`` nonzeros (host, once)."""
    if chunk < 1 or items_per_program < 1:
        raise ValueError(
            f"chunk and items_per_program must be >= 1, got {chunk}, {items_per_program}"
        )
    lengths = np.diff(indptr).astype(np.int64)
    pieces = -(-lengths // chunk)  # ceil; 0 for empty rows
    row = np.repeat(np.arange(lengths.size, dtype=np.int64), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = indptr[:-1].astype(np.int64)[row] + (np.arange(row.size) - first) * chunk
    end = np.minimum(start + chunk, indptr[1:].astype(np.int64)[row])
    pad = (-row.size) % items_per_program
    if row.size == 0:
        pad = items_per_program
    itype = indptr.dtype
    row = np.concatenate([row, np.zeros(pad, np.int64)]).astype(itype)
    start = np.concatenate([start, np.zeros(pad, np.int64)]).astype(itype)
    end = np.concatenate([end, np.zeros(pad, np.int64)]).astype(itype)
    return WorkItems(row, start, end, chunk, items_per_program)


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """The (output-row tile, nonzero tile) pairs of the block-sparse TPU product.

    Step ``s`` multiplies nonzero tile ``nnz_tile[s]`` (``block_k`` consecutive
    nonzeros in CSR order) into output tile ``out_tile[s]`` (``block_m`` rows).
    Steps of one output tile are consecutive; ``first[s]`` marks the first (the
    accumulator is zeroed there), and every output tile has at least one step, so
    tiles without nonzeros are written as zeros.
    """

    out_tile: np.ndarray
    nnz_tile: np.ndarray
    first: np.ndarray
    block_m: int
    block_k: int


def plan_tile_schedule(indptr: np.ndarray, block_m: int, block_k: int) -> TileSchedule:
    """Covers each output tile's contiguous nonzero range with nonzero tiles (host)."""
    m = indptr.size - 1
    num_out = max(1, -(-m // block_m))
    bounds = np.minimum(np.arange(num_out + 1) * block_m, m)
    start, end = indptr[bounds[:-1]].astype(np.int64), indptr[bounds[1:]].astype(np.int64)
    k0 = start // block_k
    k1 = np.where(end > start, -(-end // block_k), k0 + 1)  # empty tile: one step
    counts = k1 - k0
    out_tile = np.repeat(np.arange(num_out), counts)
    first_pos = np.cumsum(counts) - counts
    nnz_tile = k0[out_tile] + np.arange(out_tile.size) - first_pos[out_tile]
    first = np.zeros(out_tile.size, np.int32)
    first[first_pos] = 1
    max_tile = max(0, -(-int(indptr[-1]) // block_k) - 1)
    nnz_tile = np.minimum(nnz_tile, max_tile)  # an empty matrix still has tile 0
    return TileSchedule(
        out_tile.astype(np.int32), nnz_tile.astype(np.int32), first, block_m, block_k
    )
