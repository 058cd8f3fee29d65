"""Device-side planning: the :class:`~jaxcsr.structure.Structure` of traced ids.

The structures :mod:`jaxcsr.plan` builds on the host, for index arrays that change at
every step (per-batch graphs: jraph's ``receivers``, a padded molecule batch, a
neighbour list). The backends' plans of these structures are the host's functions
(:func:`jaxcsr.structure.array_namespace`); only the structures differ, below.
Everything here is ``jnp``/``lax`` and runs inside ``jit``, ``grad``, ``scan`` and
``vmap``; array lengths depend only on the static sizes and the input length, so
padded batches of one size compile once.

The results equal the host planner's element for element on in-range input (same
stable orders, same row pointers), with one difference: the layout is *padded*
(:attr:`~jaxcsr.structure.Layout.padded`). Ids outside the shape are dropped, as
``jax.ops`` drops them: their entries are placed after the last row and belong to no
row. A structure whose kind depends on the data (at most one entry per column, per
row) cannot be known at trace time, so coordinates always plan the ``"general"`` kind.

What is built is what a product may read; arrays that the running strategy does not
read (the sort, when XLA's scatter runs on a segment form) are removed by XLA as dead
code, so a product that needs no sort pays for none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcsr.plan import index_dtype_for
from jaxcsr.structure import Layout, Structure

__all__ = [
    "coo_structure",
    "row_pointer",
    "segment_structure",
    "sorted_promise_holds",
    "sorted_row_pointer",
]


def row_pointer(keys: jax.Array, num_rows: int, dtype) -> jax.Array:
    """``(num_rows + 1,)`` row pointer from per-entry rows ``keys`` (``num_rows`` =
    dropped): the cumulative counts, a scatter-add that needs no sort."""
    counts = jnp.zeros((num_rows,), dtype).at[keys].add(1, mode="drop")
    return jnp.concatenate([jnp.zeros((1,), dtype), jnp.cumsum(counts, dtype=dtype)])


def sorted_row_pointer(sorted_keys: jax.Array, num_rows: int, dtype) -> jax.Array:
    """:func:`row_pointer` of non-decreasing ``sorted_keys``: for each row, the number
    of keys below it (a binary search per row, no scatter)."""
    rows = jnp.arange(num_rows + 1, dtype=sorted_keys.dtype)
    return jnp.searchsorted(sorted_keys, rows, side="left").astype(dtype)


def _dropped_to(ids: jax.Array, bound: int, dtype) -> jax.Array:
    """``ids`` with every id outside ``[0, bound)`` replaced by ``bound``, in ``dtype``
    (compared in their own dtype first: an int64 id >= 2**31 is dropped, not wrapped)."""
    keep = (ids >= 0) & (ids < bound)
    return jnp.where(keep, ids.astype(dtype), jnp.asarray(bound, dtype))


def sorted_promise_holds(ids: jax.Array, num_rows: int) -> jax.Array:
    """Whether traced ``ids`` keep :func:`segment_structure`'s sorted promise: with every
    id outside ``[0, num_rows)`` read as ``num_rows``, non-decreasing. ``jax.ops``'
    ``indices_are_sorted`` promises less (dropped ids at either end); the segment
    functions test this, one pass over the ids, and sort where it fails."""
    keys = _dropped_to(ids, num_rows, index_dtype_for(num_rows))
    return jnp.all(keys[1:] >= keys[:-1])


def segment_structure(ids: jax.Array, num_rows: int, *, sorted_ids: bool = False) -> Structure:
    """The padded ``"columns"`` structure of ``A[ids[j], j] = 1`` for traced ``ids``.

    Args:
      ids: ``(K,)`` integer segment ids (traced or not); ids outside
        ``[0, num_rows)`` are dropped.
      num_rows: static number of rows ``M``.
      sorted_ids: the caller promises ``ids`` is non-decreasing with every dropped
        id at the end (``>= num_rows``): the sort is skipped and ``indices`` is not
        stored. A broken promise gives wrong results: callers that cannot vouch for
        it test it first (:func:`sorted_promise_holds`).

    Returns:
      The structure of shape ``(M, K)``: ``row_of_col`` is ``ids`` as given
      (:meth:`~jaxcsr.structure.Structure.column_rows` reads ``M`` where dropped),
      ``indptr`` the counts' cumulative sum, ``indices`` the stable argsort.
    """
    (size,) = ids.shape
    dtype = index_dtype_for(size, num_rows)
    keys = _dropped_to(ids, num_rows, dtype)
    if jnp.iinfo(ids.dtype).max > jnp.iinfo(dtype).max:
        ids = keys  # narrowing could wrap an out-of-range id into range: store the keys
    else:
        ids = ids.astype(dtype)
    if sorted_ids:
        ordered, indices = keys, None
    else:
        ordered, indices = jax.lax.sort(
            (keys, jnp.arange(size, dtype=dtype)), num_keys=1, is_stable=True
        )
    # On TPU, whose scatter is slow per index (docs/tpu.md), the row pointer is searched
    # in the sorted keys (a sort the kernel needs anyway); elsewhere the scatter-add of
    # counts needs no sort, and XLA drops the sort where nothing else reads it
    indptr = jax.lax.platform_dependent(
        keys,
        ordered,
        tpu=lambda _, ordered: sorted_row_pointer(ordered, num_rows, dtype),
        default=lambda keys, _: row_pointer(keys, num_rows, dtype),
    )
    layout = Layout((num_rows, size), size, "columns", sorted_ids, padded=True)
    # row_of_col keeps the ids as given (the scatter and the gather drop out-of-range
    # ones themselves); Structure.column_rows() is the sanitised form
    return Structure(indptr, indices, ids, None, None, None, layout)


def coo_structure(
    row: jax.Array, col: jax.Array, shape: tuple[int, int]
) -> tuple[Structure, jax.Array]:
    """The padded ``"general"`` structure of traced coordinates, and its input order.

    Entries are sorted by row, then column (stable: duplicates keep their input
    order), as :func:`jaxcsr.plan.coo_to_csr` sorts them; the transpose is planned
    as :func:`jaxcsr.plan.transpose_csr` plans it. A coordinate outside ``shape``
    drops its entry (row ``m``, column ``n``, after the last row of both views).

    Returns:
      ``(structure, order)`` with ``order[k]`` the input position of CSR entry ``k``.
    """
    m, n = shape
    (size,) = row.shape
    dtype = index_dtype_for(size, m, n)
    valid = (row >= 0) & (row < m) & (col >= 0) & (col < n)
    rows = jnp.where(valid, row, m).astype(dtype)
    cols = jnp.where(valid, col, n).astype(dtype)
    rows, indices, order = jax.lax.sort(
        (rows, cols, jnp.arange(size, dtype=dtype)), num_keys=2, is_stable=True
    )
    t_perm = jnp.argsort(indices, stable=True).astype(dtype)
    layout = Layout(shape, size, "general", padded=True)
    structure = Structure(
        row_pointer(rows, m, dtype),
        indices,
        None,
        row_pointer(indices, n, dtype),
        rows[t_perm],
        t_perm,
        layout,
    )
    return structure, order
