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

import numpy as np

from jaxcsr.structure import Layout, Structure
from jaxcsr.validation import INT32_SIZE_LIMIT

__all__ = [
    "coo_to_csr",
    "general_structure",
    "host_csr",
    "index_dtype_for",
    "is_sorted",
    "row_ids",
    "segment_ids_to_csr",
    "structure_from_csr",
    "structure_from_segment_ids",
    "transpose_csr",
]


def index_dtype_for(*sizes: int) -> np.dtype:
    """Smallest of int32/int64 that can hold every value in ``[0, max(sizes)]``."""
    return np.dtype(np.int32 if max(sizes, default=0) < INT32_SIZE_LIMIT else np.int64)


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
    row: np.ndarray, col: np.ndarray, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorts validated COO coordinates (:func:`~jaxcsr.validation.check_coo`) into CSR order.

    Duplicates are kept as separate nonzeros (their products add up, exactly as
    summing them would), so the returned permutation is a bijection on the input.

    Returns:
      ``(indptr, indices, order)`` where ``order[k]`` is the input position of the
      ``k``-th nonzero in CSR order (rows ascending, then columns ascending).
    """
    m, n = shape
    itype = index_dtype_for(row.size, m, n)
    order = np.lexsort((col, row)).astype(itype)  # last key is primary: row, then col
    indptr = np.zeros(m + 1, dtype=itype)
    np.cumsum(np.bincount(row, minlength=m), out=indptr[1:])
    return indptr, col[order].astype(itype), order


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
    """Classifies a validated host CSR (:func:`~jaxcsr.validation.check_csr_arrays`)
    and plans its :class:`~jaxcsr.structure.Structure`.

    At most one entry per column: the ``"columns"`` kind. At most one per row: the
    ``"columns"`` kind of the transpose, viewed transposed. Otherwise ``"general"``,
    with the planned transpose. Values stay in this CSR order in every case.
    """
    m, n = shape
    itype = index_dtype_for(indices.size, m, n)
    indptr, indices = indptr.astype(itype, copy=False), indices.astype(itype, copy=False)
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


def host_csr(structure: Structure) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr, indices)`` of the viewed matrix of a host structure (numpy leaves),
    computed with numpy: the host twin of ``view_indptr``/``view_indices``."""
    layout = structure.layout
    m, n = layout.shape
    if layout.kind == "general":
        if structure.transposed:
            return structure.t_indptr, structure.t_indices
        return structure.indptr, structure.indices
    indices = structure.indices
    if indices is None:  # sorted ids: column k is entry k
        indices = np.arange(layout.nnz, dtype=structure.indptr.dtype)
    if not structure.transposed:
        return structure.indptr, indices
    # C.T of a one-per-column C: row j holds C's entry of column j, if any
    nonempty = structure.row_of_col < m
    indptr = np.zeros(n + 1, structure.indptr.dtype)
    np.cumsum(nonempty, out=indptr[1:])
    return indptr, structure.row_of_col[nonempty]
