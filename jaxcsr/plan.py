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

import operator
from typing import Any

import numpy as np

from jaxcsr.structure import Layout, Structure

__all__ = [
    "INT32_SIZE_LIMIT",
    "check_csr_arrays",
    "check_index_range",
    "check_segment_ids",
    "check_shape",
    "check_size",
    "as_host_int_array",
    "coo_to_csr",
    "index_dtype_for",
    "row_ids",
    "segment_ids_to_csr",
    "structure_from_csr",
    "structure_from_segment_ids",
    "transpose_csr",
]


INT32_SIZE_LIMIT = 2**31 - 1
"""Sizes (rows, columns, stored entries) from here on need int64 indices."""


def index_dtype_for(*sizes: int) -> np.dtype:
    """Smallest of int32/int64 that can hold every value in ``[0, max(sizes)]``."""
    return np.dtype(np.int32 if max(sizes, default=0) < INT32_SIZE_LIMIT else np.int64)


def check_index_range(size: int, name: str) -> int:
    """Rejects a size that needs int64 indices while JAX runs without 64-bit types
    (JAX would truncate the indices to int32), before anything is allocated."""
    import jax  # only its configuration

    if size >= INT32_SIZE_LIMIT and not jax.config.jax_enable_x64:
        raise ValueError(
            f"{name} = {size} needs 64-bit indices (sizes must be < 2**31 - 1 = "
            f"{INT32_SIZE_LIMIT} with int32 indices); enable jax_enable_x64 for int64 "
            "indices, or split the matrix"
        )
    return size


def as_host_int_array(value: Any, name: str) -> np.ndarray:
    """Converts ``value`` to a host numpy integer array or raises a named error.

    An empty list or tuple is an empty int32 array (as ``jax.ops`` accepts).
    """
    try:
        arr = np.asarray(value)
    except Exception as err:  # jax tracers raise TracerArrayConversionError here
        if type(err).__name__.startswith("Tracer") or "Tracer" in str(err):
            raise ValueError(
                f"{name} is a traced JAX value; a CSRMatrix structure is planned on "
                "the host and must be built outside jax.jit/vmap/grad. Either build "
                "the matrix once outside the traced function and pass it in as an "
                "argument (it is a pytree), or close over a numpy array of ids (it "
                "stays concrete inside jit). Ids that change at every step are not "
                "static: use jax.ops.segment_sum for those."
            ) from err
        raise TypeError(f"{name} must be an array of integers, got {type(value)!r}") from err
    if arr.size == 0 and arr.dtype == np.float64 and not isinstance(value, np.ndarray):
        arr = arr.astype(np.int32)
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of integers, got dtype object")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    return arr


def check_size(value: Any, name: str) -> int:
    """Validates a size argument: a non-negative int (bools rejected), named in errors."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be an int, got the bool {value!r}")
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
    num_rows = check_index_range(check_size(num_rows, size_name), size_name)
    arr = as_host_int_array(idx, idx_name)
    if arr.ndim != 1:
        raise ValueError(f"{idx_name} must be 1-D, got shape {arr.shape}")
    check_index_range(arr.size, f"len({idx_name})")
    _check_range(arr, num_rows, idx_name, size_name)
    return arr, num_rows


def segment_ids_to_csr(
    idx: np.ndarray, num_rows: int, *, sorted_ids: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """CSR of the one-valued matrix ``A[idx[j], j] = 1``.

    ``sorted_ids``: whether ``idx`` is non-decreasing, if the caller already knows
    (then the sort is skipped); ``None`` checks.

    Returns:
      ``(indptr, order)``: ``indptr`` of length ``num_rows + 1`` and ``order``, the
      input position of each nonzero in CSR order (a stable argsort of ``idx``).
      ``order`` is also the CSR column-index array, since column ``j`` is input ``j``.
    """
    itype = index_dtype_for(idx.size, num_rows)
    if sorted_ids is None:
        sorted_ids = is_sorted(idx)
    if sorted_ids:
        order = np.arange(idx.size, dtype=itype)
    else:
        order = np.argsort(idx, kind="stable").astype(itype, copy=False)
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
    row = as_host_int_array(row, "row")
    col = as_host_int_array(col, "col")
    if row.ndim != 1 or col.ndim != 1:
        raise ValueError(f"row and col must be 1-D, got shapes {row.shape} and {col.shape}")
    if row.shape != col.shape:
        raise ValueError(f"row and col must have the same length, got {row.size} and {col.size}")
    check_index_range(row.size, "len(row)")
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
    m, n = check_size(m, "shape[0]"), check_size(n, "shape[1]")
    return check_index_range(m, "shape[0]"), check_index_range(n, "shape[1]")


def check_csr_arrays(
    indptr: Any, indices: Any, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Validates raw CSR index arrays (as scipy's ``check_format`` does).

    Raises:
      ValueError: wrong lengths, ``indptr`` not starting at 0, decreasing, or not
        ending at ``len(indices)``, column indices out of ``[0, shape[1])``.
    """
    m, n = shape
    indptr = as_host_int_array(indptr, "indptr")
    indices = as_host_int_array(indices, "indices")
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


def is_sorted(ids: np.ndarray) -> bool:
    """Whether ``ids`` is non-decreasing."""
    return bool(ids.size < 2 or np.all(ids[1:] >= ids[:-1]))


def row_ids(indptr: np.ndarray) -> np.ndarray:
    """Row index of every nonzero, in CSR order."""
    return np.repeat(np.arange(indptr.size - 1, dtype=indptr.dtype), np.diff(indptr))


def transpose_csr(
    indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of ``A.T`` (a stable counting sort by column).

    Returns:
      ``(t_indptr, t_indices, perm)``: ``A.T``'s row pointer ``(n + 1,)`` and column
      indices ``(nnz,)``, and ``perm`` with ``data_T = data[perm]`` (the position in
      A's CSR order of each entry of ``A.T``).
    """
    _, n = shape
    perm = np.argsort(indices, kind="stable").astype(indptr.dtype, copy=False)
    t_indptr = np.zeros(n + 1, dtype=indptr.dtype)
    np.cumsum(np.bincount(indices, minlength=n), out=t_indptr[1:])
    return t_indptr, row_ids(indptr)[perm], perm


def structure_from_segment_ids(idx: np.ndarray, num_rows: int) -> Structure:
    """The ``"columns"`` structure of ``A[idx[j], j] = 1`` (validated ids), host arrays.

    Sorting ``idx`` (stable, skipped when already sorted) is the only ``O(K log K)``
    step; nothing about the transpose is stored (it is the row gather ``Y[idx]``).
    """
    sorted_ids = is_sorted(idx)
    indptr, order = segment_ids_to_csr(idx, num_rows, sorted_ids=sorted_ids)
    layout = Layout((num_rows, idx.size), idx.size, "columns", sorted_ids)
    row_of_col = idx.astype(indptr.dtype, copy=False)
    indices = None if sorted_ids else order
    return Structure(indptr, indices, row_of_col, None, None, None, layout)


def _columns_structure(
    indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int]
) -> Structure:
    """``"columns"`` structure of a CSR with at most one entry per column."""
    m, n = shape
    row_of_col = np.full(n, m, dtype=indptr.dtype)
    row_of_col[indices] = row_ids(indptr)
    sorted_ids = bool(indices.size == n and np.array_equal(indices, np.arange(n)))
    layout = Layout(shape, int(indices.size), "columns", sorted_ids)
    return Structure(indptr, None if sorted_ids else indices, row_of_col, None, None, None, layout)


def structure_from_csr(
    indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int]
) -> Structure:
    """Classifies a validated host CSR and plans its :class:`~jaxcsr.structure.Structure`.

    At most one entry per column: the ``"columns"`` kind. At most one per row: the
    ``"columns"`` kind of the transpose, viewed transposed. Otherwise ``"general"``,
    with the planned transpose. Values stay in this CSR order in every case.
    """
    m, n = shape
    nnz = indices.size
    if nnz == 0 or np.bincount(indices, minlength=n).max() <= 1:
        return _columns_structure(indptr, indices, shape)
    if np.diff(indptr).max() <= 1:
        t_indptr, t_indices, _ = transpose_csr(indptr, indices, shape)
        return _columns_structure(t_indptr, t_indices, (n, m)).transpose()
    return general_structure(indptr, indices, shape)


def general_structure(indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int]) -> Structure:
    """The ``"general"`` structure (CSR plus its planned transpose) of any validated CSR,
    whatever its column or row counts (row blocks of a sharded matrix all take this
    kind, so that they share one static layout)."""
    t_indptr, t_indices, perm = transpose_csr(indptr, indices, shape)
    layout = Layout(shape, int(indices.size), "general")
    return Structure(indptr, indices, None, t_indptr, t_indices, perm, layout)
