"""Building a :class:`~jaxcsr.sharding.operand.ShardedCSR`: :func:`shard` from a
matrix this host holds whole, :func:`shard_rows` from row lengths and a loader of each
process's own rows; the checks that every process was given the same matrix."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcsr import plan
from jaxcsr.matrix import CSRMatrix
from jaxcsr.sharding.blocks import RowBlocks, from_blocks, local_blocks, place_index
from jaxcsr.sharding.operand import ShardedCSR
from jaxcsr.sharding.row_blocks import block_sizes, relayout_plan
from jaxcsr.sharding.spec import BlockLayout, HostBlockLayout, Spec
from jaxcsr.validation import (
    as_host_int_array,
    check_index_range,
    check_numeric_dtype,
    check_range,
    check_size,
    is_traced,
)

__all__ = ["shard", "shard_rows"]


def _check_same_everywhere(parts: list[np.ndarray], message: str) -> None:
    """With several processes, compares a digest of ``parts`` across processes (one
    small all-gather) before any block is placed, so that processes that were given
    different inputs get ``ValueError(message)`` rather than a wrong product or a
    hang."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(np.ascontiguousarray(part, np.int64).tobytes())
    words = np.frombuffer(digest.digest(), np.uint32)
    every = np.asarray(multihost_utils.process_allgather(words)).reshape(-1, words.size)
    if not (every == every[0]).all():
        raise ValueError(f"{message} (digests of {jax.process_count()} processes disagree)")


def _check_mesh(mesh, axis: str, form) -> None:
    """``balance`` is checked by :func:`block_sizes`, before anything is placed."""
    if form not in (None, "segment", "spmm"):
        raise ValueError(f"form must be None, 'segment' or 'spmm', got {form!r}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {mesh.axis_names}")


def shard(
    A: CSRMatrix, mesh, axis: str, *, balance: str = "nnz", form: str | None = None
) -> ShardedCSR:
    """Splits ``A``'s rows over mesh axis ``axis`` (host planning, once).

    The blocks are planned from ``A``'s host structure (:attr:`CSRMatrix.host_structure`):
    nothing is read back from the device. ``A``'s values are laid out on the device.
    With several processes every process passes the same ``A`` (checked) and plans
    only its own devices' blocks; :func:`shard_rows` builds the blocks from each
    process's own rows instead, for matrices no host should hold whole.

    Args:
      A: a :class:`~jaxcsr.matrix.CSRMatrix` as a constructor returned it (concrete,
        not traced, with its host structure).
      mesh: a ``jax.sharding.Mesh``.
      axis: the mesh axis name to split rows over.
      balance: ``"nnz"`` (default: contiguous row blocks minimising the largest
        block's nonzeros; rows stay whole, so one row with a large share of the
        nonzeros bounds the balance) or ``"rows"`` (the output's even row split: no
        relayout of the result, possibly unbalanced work).
      form: ``"segment"`` or ``"spmm"``; default: ``"segment"`` for
        :meth:`~jaxcsr.CSRMatrix.from_indices` matrices, else ``"spmm"``.
        ``"segment"`` takes any matrix with at most one entry per column; ``"spmm"``
        forces the gathered-``x`` form. Either way ``S.shape == A.shape``.

    Returns:
      A :class:`ShardedCSR`; each device holds only its block (and the block plans of
      ``A``'s backends).
    """
    if not isinstance(A, CSRMatrix):
        raise TypeError(f"A must be a jaxcsr.CSRMatrix, got {type(A).__name__}")
    _check_mesh(mesh, axis, form)
    if is_traced(A):
        raise ValueError(
            "A holds traced values: jaxcsr.shard plans on the host, so call it outside "
            "jax.jit/grad on a matrix with concrete values (or none), then pass traced "
            "values in with S.with_data(values), laid out as S.data_order says"
        )
    if A.host_structure is None:
        raise ValueError(
            "A has no host structure (it was rebuilt from its leaves, e.g. returned by a "
            "jitted function); shard the matrix a CSRMatrix constructor returned"
        )
    segment = A.columns_are_inputs if form is None else form == "segment"
    if segment and not A.structure.one_per_column:
        raise ValueError("form='segment' needs at most one entry per column (from_indices)")
    indptr, indices = plan.host_csr(A.host_structure)
    indptr = indptr.astype(np.int64)
    _check_same_everywhere(
        [np.asarray(A.shape), indptr, indices],
        "jaxcsr.shard: the matrices passed to shard differ between processes; every "
        "process must build the same matrix (same ids and shape)",
    )
    blocks = RowBlocks(
        indptr,
        block_sizes(indptr, int(mesh.shape[axis]), balance),
        lambda lo, hi: (indices[indptr[lo] : indptr[hi]].astype(np.int64), None),
        n=A.shape[1],
        segment=segment,
    )
    every = range(blocks.shards)  # this host holds A whole: its metadata is complete
    orders = {p: (blocks.input_order(p), blocks.data_order(p)) for p in every}
    S = _sharded(blocks, mesh, axis, balance, A.backends, orders)
    if A.data is None:
        return S
    # laid out on the device: the values never visit the host
    order = jnp.asarray(np.concatenate([orders[p][1] for p in every]))
    picked = jnp.where(order >= 0, A.data[jnp.maximum(order, 0)], 0).astype(A.data.dtype)
    return S.with_data(jax.device_put(picked, S.input_sharding))


def shard_rows(
    row_lengths: Any,
    load_rows: Callable[[int, int], Any],
    mesh,
    axis: str,
    *,
    num_cols: int,
    dtype: Any = None,
    form: str = "spmm",
    balance: str = "nnz",
    backends: Any = None,
) -> ShardedCSR:
    """:func:`shard` for a matrix that no process holds whole: each process reads only
    the rows of its own devices' blocks.

    Every process passes the same ``row_lengths`` (checked across processes) and a
    ``load_rows`` that can read any rows; the blocks are planned from the row lengths
    alone, and ``load_rows`` is called only for this process's blocks, so host memory
    per process is ``O(m)`` plus its share of the entries.

    Args:
      row_lengths: ``(m,)`` stored entries per row (what ``np.diff(indptr)`` gives).
      load_rows: ``load_rows(lo, hi)`` returns the column indices of rows ``lo:hi``
        in row order (``row_lengths[lo:hi].sum()`` integers in ``[0, num_cols)``),
        or, with ``dtype``, a pair ``(columns, values)``. For the segment form a column
        is an input position: the index ``k`` of the edge in the values ``S @ v``
        takes.
      mesh, axis, balance: as in :func:`shard`.
      num_cols: the matrix's columns (``n``; the segment form: the number of edges).
      dtype: the values' dtype; ``None``: a one-valued matrix (no values loaded).
      form: ``"spmm"`` (default) or ``"segment"`` (at most one entry per column,
        checked within each block), as in :func:`shard`.
      backends: backend names to plan each block for (``None``: the defaults).

    Returns:
      A :class:`ShardedCSR` of shape ``(m, num_cols)``. Its layout metadata
      (:attr:`~ShardedCSR.input_order`, :attr:`~ShardedCSR.data_order`) covers this
      process's blocks only, and :meth:`~ShardedCSR.layout_values` fills only them.
    """
    _check_mesh(mesh, axis, form)
    if form is None:
        raise ValueError("form must be 'segment' or 'spmm', got None")
    lengths = as_host_int_array(row_lengths, "row_lengths")
    if lengths.ndim != 1 or (lengths.size and lengths.min() < 0):
        raise ValueError("row_lengths must be a 1-D array of non-negative counts")
    if not callable(load_rows):
        raise TypeError(f"load_rows must be callable, got {type(load_rows).__name__}")
    n = check_size(num_cols, "num_cols")
    if dtype is not None:
        check_numeric_dtype(dtype, "dtype")
        dtype = np.dtype(dtype)
    indptr = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    check_index_range(max(int(indptr[-1]), n, lengths.size), "the matrix")
    segment = form == "segment"
    _check_same_everywhere(
        [indptr, np.array([n, segment, -1 if dtype is None else dtype.num])],
        "jaxcsr.shard_rows: row_lengths, num_cols, form or dtype differ between "
        "processes; every process must describe the same matrix",
    )

    def columns(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
        return _loaded_rows(load_rows, lo, hi, int(indptr[hi] - indptr[lo]), n, dtype, segment)

    blocks = RowBlocks(
        indptr,
        block_sizes(indptr, int(mesh.shape[axis]), balance),
        columns,
        n=n,
        segment=segment,
    )
    sharding = NamedSharding(mesh, P(axis))
    orders = {p: (blocks.input_order(p), blocks.data_order(p)) for p in local_blocks(sharding)}
    S = _sharded(blocks, mesh, axis, balance, backends, orders)
    if dtype is None:
        return S
    return S.with_data(from_blocks(lambda p: blocks.values(p, dtype), blocks.shards, sharding))


def _loaded_rows(load_rows, lo, hi, size, n, dtype, segment):
    """Checks what ``load_rows(lo, hi)`` returned (before anything is planned)."""
    got = load_rows(lo, hi)
    if dtype is not None:
        if not (isinstance(got, tuple) and len(got) == 2):
            raise TypeError(f"load_rows({lo}, {hi}) must return (columns, values) with dtype")
        cols, values = got
    else:
        cols, values = got, None
    cols = as_host_int_array(cols, f"load_rows({lo}, {hi})'s columns")
    if cols.shape != (size,):
        raise ValueError(
            f"load_rows({lo}, {hi}) must return {size} columns (row_lengths[{lo}:{hi}]"
            f".sum()), got shape {cols.shape}"
        )
    check_range(cols, n, f"load_rows({lo}, {hi})'s columns", "num_cols")
    if segment and np.any(np.diff(np.sort(cols)) == 0):
        raise ValueError(
            f"form='segment' needs at most one entry per column; load_rows({lo}, {hi}) "
            "repeats a column"
        )
    if values is not None:
        values = np.asarray(values)
        if values.shape != (size,):
            raise ValueError(
                f"load_rows({lo}, {hi}) must return {size} values, got shape {values.shape}"
            )
        values = values.astype(dtype)
    return cols.astype(np.int64), values


def _sharded(blocks: RowBlocks, mesh, axis, balance, backends, orders) -> ShardedCSR:
    """The :class:`ShardedCSR` of ``blocks`` (without values: ``with_data`` adds them).
    ``orders``: the blocks whose layout metadata this host keeps."""
    shards, m, n = blocks.shards, blocks.indptr.size - 1, blocks.n
    sharding = NamedSharding(mesh, P(axis))
    leaves, index_tree = place_index(blocks, backends, sharding)
    replicated = NamedSharding(mesh, P())
    host_layout = HostBlockLayout(
        blocks.row_starts.astype(np.int32), blocks.block_nnz.astype(np.int32), orders
    )
    layout = BlockLayout(
        row_starts=jax.device_put(host_layout.row_starts, replicated),
        block_nnz=jax.device_put(host_layout.block_nnz, replicated),
        input_order=from_blocks(lambda p: orders[p][0], shards, sharding),
        data_order=from_blocks(lambda p: orders[p][1], shards, sharding),
    )
    send, recv, shifts, aligned = relayout_plan(
        blocks.row_starts, m, blocks.block_rows, shards, balance
    )
    spec = Spec(
        mesh=mesh,
        axis=axis,
        shape=(m, n),
        layout_size=shards * blocks.block_cols if blocks.segment else n,
        form="segment" if blocks.segment else "spmm",
        balance=balance,
        block_rows=blocks.block_rows,
        block_cols=blocks.block_cols if blocks.segment else n,
        shifts=shifts,
        aligned=aligned,
        index_tree=index_tree,
        has_data=False,
    )
    if not aligned:
        send, recv = jax.device_put(send, sharding), jax.device_put(recv, sharding)
    else:
        send = recv = None
    return ShardedCSR(leaves, None, send, recv, layout, spec, host_layout)
