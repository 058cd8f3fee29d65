"""The portable core of a matrix: its index arrays, stored once, and what derives from them.

Every backend reads this core; backends that need more (a kernel's schedule) plan it
themselves (:mod:`jaxcsr.kernels`). A :class:`Structure` describes one *planned
orientation* ``C`` of shape ``layout.shape`` and is viewed either as ``C`` or, with
``transposed=True``, as ``C.T`` -- so a matrix and its transpose share one set of
arrays, and :meth:`Structure.transpose` is free.

Two kinds (``layout.kind``):

``"columns"``
    ``C`` has at most one stored entry per column: every ``from_indices`` matrix
    (column ``j`` is input position ``j``). Stored: ``indptr`` ``(m + 1,)``,
    ``indices`` ``(nnz,)`` (CSR order -> column; omitted when the ids were already
    sorted, where it is ``0, 1, ..., n - 1``) and ``row_of_col`` ``(n,)`` (column ->
    row, ``m`` for an empty column). ``C @ X`` is a scatter-add of X's rows by
    ``row_of_col``; ``C.T @ Y`` is the row gather ``Y[row_of_col]``. A matrix with at
    most one entry per *row* is stored as the transposed view of this kind.
``"general"``
    Anything else: ``indptr``, ``indices`` and the planned transpose -- ``t_indptr``
    ``(n + 1,)``, ``t_indices`` ``(nnz,)`` and ``t_perm`` ``(nnz,)`` with
    ``data_T = data[t_perm]``.

Array lengths depend only on ``(m, n, nnz)`` and the kind, so matrices of equal shape,
nnz and kind share one compilation. Everything else (row ids, the transposed view's
``indptr``, per-column values) is derived on the device when a product needs it.

A structure planned on the device from traced ids (:mod:`jaxcsr.device_plan`) is
*padded* (``layout.padded``): ``nnz`` is then the length of the input, and entries
whose ids were out of range (dropped, as ``jax.ops`` drops them) sit after the last
row, from ``indptr[-1]`` on. They belong to no row: their row id is the view's row
count, and for the ``"columns"`` kind their column is empty. There ``row_of_col``
holds the ids as given, any value outside ``[0, m)`` meaning "dropped", so that a
scatter or gather reads them with no extra pass; :meth:`Structure.column_rows` is
the sanitised form (``m`` where dropped) that everything else reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KINDS", "Layout", "Structure", "array_namespace"]

KINDS: tuple[str, ...] = ("columns", "general")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static (hashable) facts about a planned orientation ``C``.

    Attributes:
      shape: ``(m, n)`` of ``C``.
      nnz: stored entries.
      kind: ``"columns"`` (at most one entry per column) or ``"general"``.
      sorted_ids: ``"columns"`` kind whose CSR column indices are ``0, ..., n - 1``
        (segment ids given sorted): ``indices`` is not stored and X streams in order.
      padded: planned on the device: ``nnz`` is the arrays' length and the entries
        from ``indptr[-1]`` on belong to no row (dropped ids).
    """

    shape: tuple[int, int]
    nnz: int
    kind: str
    sorted_ids: bool = False
    padded: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def full(self) -> bool:
        """``"columns"`` kind with exactly one entry in every column (``nnz == n``), known
        when planned (a padded layout may have dropped some)."""
        return self.kind == "columns" and self.nnz == self.shape[1] and not self.padded


def array_namespace(array: Any) -> Any:
    """The array module a planner computes with: numpy for a numpy (host) array,
    jax.numpy for a device or traced one. A plan is one function over either."""
    return np if isinstance(array, np.ndarray) else jnp


def _iota(size: int, dtype) -> jax.Array:
    return jnp.arange(size, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Structure:
    """Device index arrays of a planned orientation, viewed as ``C`` or ``C.T``.

    Leaves (``None`` where the kind stores nothing): ``indptr``, ``indices``,
    ``row_of_col`` (``"columns"``), ``t_indptr``, ``t_indices``, ``t_perm``
    (``"general"``). Static: ``layout`` (:class:`Layout`) and ``transposed``.

    Every method answers for the *viewed* matrix; values (``data``) are always in the
    viewed matrix's CSR order.
    """

    indptr: Any
    indices: Any
    row_of_col: Any
    t_indptr: Any
    t_indices: Any
    t_perm: Any
    layout: Layout
    transposed: bool = False

    # ------------------------------------------------------------ shape, class
    @property
    def shape(self) -> tuple[int, int]:
        m, n = self.layout.shape
        return (n, m) if self.transposed else (m, n)

    @property
    def nnz(self) -> int:
        return self.layout.nnz

    @property
    def on_host(self) -> bool:
        """Whether the leaves are numpy arrays: planned once on the host, not on the
        device inside a trace (:func:`array_namespace` of them is numpy)."""
        return array_namespace(self.indptr) is np

    @property
    def one_per_column(self) -> bool:
        """The view stores at most one entry per column: ``A @ X`` is a scatter-add."""
        return self.layout.kind == "columns" and not self.transposed

    @property
    def one_per_row(self) -> bool:
        """The view stores at most one entry per row: ``A @ X`` is a row gather."""
        return self.layout.kind == "columns" and self.transposed

    @property
    def sorted_ids(self) -> bool:
        """The view's CSR column indices are ``0, ..., n - 1`` (X streams in order)."""
        return self.layout.sorted_ids and not self.transposed

    @property
    def index_dtype(self):
        return self.indptr.dtype

    def column_rows(self) -> jax.Array:
        """``"columns"`` kind: the row of every column of ``C``, ``m`` for an empty one
        (``row_of_col``, with a padded layout's out-of-range ids replaced by ``m``)."""
        if not self.layout.padded:
            return self.row_of_col
        m = self.layout.shape[0]
        rows = self.row_of_col
        return jnp.where((rows >= 0) & (rows < m), rows, jnp.asarray(m, rows.dtype))

    def nonempty_rows(self) -> jax.Array:
        """``(rows,)`` bool: the viewed matrix's rows that store an entry. For a padded
        one-per-column view, one scatter of flags (no counts, no cumulative sum)."""
        if self.layout.padded and self.one_per_column:
            m = self.layout.shape[0]
            flags = jnp.zeros((m,), bool)
            return flags.at[self.row_of_col].set(True, mode="drop", wrap_negative_indices=False)
        return self.degrees() > 0

    def transpose(self) -> Structure:
        """The same arrays viewed as the transpose (no device work)."""
        return dataclasses.replace(self, transposed=not self.transposed)

    def kernel_indptrs(self) -> tuple[Any, Any]:
        """Row pointers a kernel backend plans for: ``C``'s, and ``C.T``'s for the
        ``"general"`` kind (``None`` for ``"columns"``: its transpose is a row gather,
        which XLA runs)."""
        return self.indptr, (self.t_indptr if self.layout.kind == "general" else None)

    # ---------------------------------------------------------- the CSR view
    def view_indptr(self) -> jax.Array:
        """``(rows + 1,)`` row pointer of the viewed matrix."""
        if not self.transposed:
            return self.indptr
        if self.layout.kind == "general":
            return self.t_indptr
        n = self.layout.shape[1]
        if self.layout.full:
            return _iota(n + 1, self.index_dtype)
        counts = self._nonempty_columns().astype(self.index_dtype)
        return jnp.concatenate([jnp.zeros((1,), self.index_dtype), jnp.cumsum(counts)])

    def view_indices(self) -> jax.Array:
        """``(nnz,)`` column indices of the viewed matrix, in its CSR order."""
        if not self.transposed:
            return self._planned_indices()
        if self.layout.kind == "general":
            return self.t_indices
        if self.layout.full:
            return self.row_of_col
        return self.column_rows()[self._nonempty_column_ids()]

    def row_ids(self) -> jax.Array:
        """``(nnz,)`` row of every stored entry of the viewed matrix, CSR order."""
        nnz, dtype = self.nnz, self.index_dtype
        if self.layout.kind == "general":
            if self.transposed:
                return self.indices[self.t_perm]
            # A's rows are A.T's column indices, moved back to A's order.
            return jnp.zeros((nnz,), dtype).at[self.t_perm].set(self.t_indices, unique_indices=True)
        if self.transposed:
            if self.layout.full:
                return _iota(nnz, dtype)
            if self.layout.padded:  # the dropped entries after the last row: sentinel
                rows = self.layout.shape[1]
                return jnp.where(self._stored(), self._nonempty_column_ids(), rows).astype(dtype)
            return self._nonempty_column_ids()
        if self.layout.sorted_ids:
            return self.column_rows()
        return self.column_rows()[self.indices]

    def degrees(self) -> jax.Array:
        """Stored entries per row of the viewed matrix, ``(rows,)``."""
        if self.one_per_row:
            return self._nonempty_columns().astype(self.index_dtype)
        return jnp.diff(self.view_indptr())

    # -------------------------------------------------------- value orders
    def transpose_values(self, values: jax.Array) -> jax.Array:
        """Per-entry ``values`` in this view's CSR order -> the transposed view's order."""
        if self.layout.kind == "general":
            if not self.transposed:
                return values[self.t_perm]
            return jnp.zeros_like(values).at[self.t_perm].set(values, unique_indices=True)
        if self.layout.sorted_ids:
            return values
        slot = self._transposed_slot()  # C's entry k sits at C.T position slot[k]
        if not self.transposed:
            return jnp.zeros_like(values).at[slot].set(values, unique_indices=True)
        return values[slot]

    def column_values(self, values: jax.Array) -> jax.Array:
        """One-per-column view: per-entry ``values`` -> per column ``(n, ...)``, 0 if empty."""
        assert self.one_per_column
        if self.layout.sorted_ids:
            return values
        n = self.layout.shape[1]
        out = jnp.zeros((n, *values.shape[1:]), values.dtype)
        return out.at[self.indices].set(values, unique_indices=True)

    def row_values(self, values: jax.Array) -> jax.Array:
        """One-per-row view: per-entry ``values`` -> per row ``(rows, ...)``, 0 if empty."""
        assert self.one_per_row
        if self.layout.full:
            return values
        nonempty = self._nonempty_columns()
        rank = jnp.clip(jnp.cumsum(nonempty) - 1, 0, max(self.nnz - 1, 0))
        if self.nnz == 0:
            return jnp.zeros((nonempty.shape[0], *values.shape[1:]), values.dtype)
        picked = values[rank]
        mask = nonempty.reshape((-1,) + (1,) * (values.ndim - 1))
        return jnp.where(mask, picked, jnp.zeros((), values.dtype))

    def compact_rows(self, per_row: jax.Array) -> jax.Array:
        """One-per-row view: per-row values ``(rows, ...)`` -> per entry, CSR order."""
        assert self.one_per_row
        if self.layout.full:
            return per_row
        out = per_row[self._nonempty_column_ids()]
        if self.layout.padded:
            mask = self._stored().reshape((-1,) + (1,) * (per_row.ndim - 1))
            out = jnp.where(mask, out, jnp.zeros((), out.dtype))
        return out

    def entry_rows(self) -> Structure:
        """The ``"columns"`` structure of the one-valued ``(rows, nnz)`` matrix
        ``R[row(k), k] = 1`` over the view's stored entries ``k`` (CSR order, so its
        ids are sorted): ``R @ v`` sums per-entry values over each row. Derived on the
        device (valid under ``jit``)."""
        m = self.shape[0]
        layout = Layout((m, self.nnz), self.nnz, "columns", True, self.layout.padded)
        return Structure(self.view_indptr(), None, self.row_ids(), None, None, None, layout)

    # ------------------------------------------------------------- internals
    def _planned_indices(self) -> jax.Array:
        if self.layout.sorted_ids:
            return _iota(self.nnz, self.index_dtype)
        return self.indices

    def _nonempty_columns(self) -> jax.Array:
        rows = self.row_of_col
        if self.layout.padded:
            return (rows >= 0) & (rows < self.layout.shape[0])
        return rows < self.layout.shape[0]

    def _nonempty_column_ids(self) -> jax.Array:
        """``C.T``'s CSR order: the non-empty columns ascending (then, padded, the
        columns of dropped entries ascending: every column is an entry there)."""
        if self.layout.padded:
            slot = self._column_slots()
            ids = _iota(self.nnz, self.index_dtype)
            return jnp.zeros_like(ids).at[slot].set(ids, unique_indices=True)
        (ids,) = jnp.nonzero(self._nonempty_columns(), size=self.nnz)
        return ids.astype(self.index_dtype)

    def _column_slots(self) -> jax.Array:
        """``"columns"`` kind: position of column ``j``'s entry in ``C.T``'s CSR order
        (for empty columns of a padded layout: after the stored entries)."""
        nonempty = self._nonempty_columns().astype(self.index_dtype)
        rank = jnp.cumsum(nonempty) - 1
        if not self.layout.padded:
            return rank
        stored = rank[-1] + 1 if self.nnz else 0
        return jnp.where(nonempty > 0, rank, stored + jnp.cumsum(1 - nonempty) - 1)

    def _stored(self) -> jax.Array:
        """``(nnz,)`` bool: positions of the view's CSR order that hold an entry (all
        but the dropped entries after the last row of a padded layout)."""
        return _iota(self.nnz, self.index_dtype) < self.view_indptr()[-1]

    def _transposed_slot(self) -> jax.Array:
        """``"columns"`` kind: position in ``C.T``'s CSR order of ``C``'s entry ``k``."""
        if self.layout.full:
            return self.indices
        return self._column_slots()[self._planned_indices()]

    def arrays(self) -> dict[str, Any]:
        """The stored leaves by name (``None`` omitted)."""
        names = ("indptr", "indices", "row_of_col", "t_indptr", "t_indices", "t_perm")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


jax.tree_util.register_dataclass(
    Structure,
    data_fields=["indptr", "indices", "row_of_col", "t_indptr", "t_indices", "t_perm"],
    meta_fields=["layout", "transposed"],
)
