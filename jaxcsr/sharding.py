"""Row-sharded products over a ``jax.sharding.Mesh`` with ``shard_map``.

:func:`shard` splits a :class:`~jaxcsr.matrix.CSRMatrix` into contiguous row blocks,
one per device along a mesh axis, balanced by nonzeros (planned on the host, once).
Each block is an ordinary matrix of the same static layout -- padded to equal rows
(plus one trash row that absorbs padding entries) and equal nonzeros -- so every
device runs the backend's normal kernel on its block inside one ``shard_map``.

The blocks are planned on the host by :mod:`jaxcsr.row_blocks`. Two forms:

* **SpMM** (any matrix but ``from_indices``): ``x`` holds one row per column of ``A``
  (node features). It is gathered to every device (all-gather; its transpose, a
  reduce-scatter, is what JAX derives for the gradient).
* **Segment** (``from_indices``: one entry per column, columns are per-edge values):
  each device holds only its own edges. ``S``'s columns are the edges *laid out*
  shard by shard (``S.input_order``; padding slots are empty columns), and values in
  that layout, sharded as ``S.input_sharding``, need no communication at all.

The result has exactly ``A``'s rows, sharded evenly along the axis (JAX's layout).
Row blocks balanced by nonzeros are not the even row split, so each device sends the
rows it computed for another device's part with ``ppermute`` (a halo between
neighbours, ``S.communication`` counts it). ``balance="rows"`` uses the even row split
itself: no relayout, no communication in the segment form, but the nonzeros may be
unbalanced (``S.imbalance``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcsr import plan
from jaxcsr.matrix import CSRMatrix, SparseOperand, matmul
from jaxcsr.ops import Index
from jaxcsr.row_blocks import (
    block_positions,
    block_sizes,
    relayout_plan,
    relayout_rows,
    rows_per_part,
)
from jaxcsr.structure import Structure
from jaxcsr.validation import (
    as_host_int_array,
    check_index_range,
    check_numeric_dtype,
    check_range,
    check_size,
    is_traced,
)

__all__ = ["ShardedCSR", "shard", "shard_rows"]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static description of a sharded matrix (hashable: part of the pytree).

    Holds only what the traced product reads: capacities, not the structure's own
    block sizes (those are device leaves, :class:`_Layout`), so matrices whose blocks
    fall into the same capacities share one compilation."""

    mesh: Any
    axis: str
    shape: tuple[int, int]  # A's shape (m, n)
    layout_size: int  # rows of laid-out per-edge values: shards * block_cols (segment) or n
    form: str  # "segment" or "spmm"
    balance: str
    block_rows: int  # row capacity per block, without the trash row
    block_cols: int  # columns per block: the nonzero capacity K_b (segment) or n (spmm)
    shifts: tuple[int, ...]  # device offsets of the output relayout: -d..d (0: local)
    aligned: bool  # blocks are the even row split: no relayout
    index_tree: Any
    has_data: bool


class _Layout(NamedTuple):
    """Where the structure's rows and entries went (device leaves, not static: they
    differ between structures that share a compilation). Read on the host through
    :class:`ShardedCSR`'s properties."""

    row_starts: jax.Array  # (shards + 1,) first row of each block, replicated
    block_nnz: jax.Array  # (shards,) nonzeros of each block, replicated
    input_order: jax.Array  # (shards * K_b,) input position per laid-out column, -1: pad
    data_order: jax.Array  # (shards * K_b,) position in A.data per laid-out value, -1: pad


@dataclasses.dataclass(frozen=True)
class _HostLayout:
    """Numpy copies of the layout metadata (not leaves). ``orders`` maps each block
    this host knows (all of them for :func:`shard`; this process's own for
    :func:`shard_rows`) to its ``(input_order, data_order)`` slots."""

    row_starts: np.ndarray
    block_nnz: np.ndarray
    orders: dict[int, tuple[np.ndarray, np.ndarray]]

    def order(self, name: str) -> np.ndarray:
        shards = self.block_nnz.size
        missing = sorted(set(range(shards)) - set(self.orders))
        if missing:
            raise ValueError(
                f"S.{name} of blocks {missing} is not on this host (shard_rows loaded only "
                f"this process's blocks, {sorted(self.orders)})"
            )
        which = ("input_order", "data_order").index(name)
        return np.concatenate([self.orders[p][which] for p in range(shards)])

    def block_order(self, p: int, name: str) -> np.ndarray:
        return self.orders[p][("input_order", "data_order").index(name)]


def _on_host(leaf: Any, name: str) -> np.ndarray:
    if is_traced(leaf):
        raise ValueError(
            f"S.{name} is host metadata of the sharded layout; read it outside jax.jit "
            "(inside, S's layout arrays are traced)"
        )
    return np.asarray(leaf)


@jax.tree_util.register_pytree_node_class
class ShardedCSR(SparseOperand):
    """A :class:`~jaxcsr.matrix.CSRMatrix` split into row blocks over a mesh axis.

    Build it with :func:`shard`. ``S @ x`` (or ``jaxcsr.matmul(S, x, reduce=...,
    return_arg=...)``) equals ``A @ x`` row for row, sharded along the axis, inside or
    outside ``jax.jit``, differentiable w.r.t. ``x`` and the values.
    """

    def __init__(
        self, index_leaves, data, send, recv, layout: _Layout, plan_: _Plan, host_layout=None
    ):
        self._host_layout = host_layout  # numpy copies of layout (not leaves): see _meta
        self._index_leaves = tuple(index_leaves)
        self._data = data
        self._send, self._recv = send, recv  # the relayout's row maps (None: aligned)
        self._plan = plan_
        self._layout = layout

    # ------------------------------------------------------------------ pytree
    def tree_flatten(self):
        children = (self._index_leaves, self._data, self._send, self._recv, self._layout)
        return children, self._plan

    @classmethod
    def tree_unflatten(cls, plan_, children):
        return cls(*children, plan_)

    # -------------------------------------------------------------- properties
    @property
    def shape(self) -> tuple[int, int]:
        """``A.shape``: ``S @ x`` takes what ``A @ x`` takes (per-edge values in input
        order, for the segment form)."""
        return self._plan.shape

    @property
    def layout_size(self) -> int:
        """Rows of per-edge values laid out shard by shard (segment form: ``shards *
        block capacity``, padding slots included; SpMM form: ``shape[1]``), what
        :meth:`layout_values` returns and :meth:`matmul_laid_out` takes."""
        return self._plan.layout_size

    @property
    def dtype(self) -> np.dtype | None:
        """dtype of the values; ``None`` for a one-valued matrix."""
        return None if self._data is None else np.dtype(self._data.dtype)

    @property
    def mesh(self):
        return self._plan.mesh

    @property
    def axis(self) -> str:
        return self._plan.axis

    @property
    def num_shards(self) -> int:
        return self._layout.block_nnz.shape[0]

    @property
    def form(self) -> str:
        """``"segment"`` (``from_indices``) or ``"spmm"``."""
        return self._plan.form

    @property
    def row_starts(self) -> tuple[int, ...]:
        """First row of each device's block (and ``m``). Host metadata: outside ``jit``."""
        return tuple(int(r) for r in self._meta("row_starts"))

    @property
    def block_nnz(self) -> tuple[int, ...]:
        """Nonzeros of each device's block (at most the capacity, ``shape[1] /
        num_shards`` in the segment form). Host metadata: outside ``jit``."""
        return tuple(int(k) for k in self._meta("block_nnz"))

    @property
    def imbalance(self) -> float:
        """``max / mean`` nonzeros per shard (1.0: perfect; 1.0 for an empty matrix)."""
        nnz = np.array(self.block_nnz, np.float64)
        return float(nnz.max() / nnz.mean()) if nnz.sum() else 1.0

    @property
    def data(self) -> jax.Array | None:
        """Values laid out shard by shard ``(shards * block nnz,)``, or None."""
        return self._data

    @property
    def input_sharding(self) -> NamedSharding:
        """How the segment form's laid-out per-edge values (first axis
        :attr:`layout_size`) and :attr:`data` are placed: split along the axis, each
        shard's contiguous."""
        return NamedSharding(self.mesh, P(self.axis))

    @property
    def output_sharding(self) -> NamedSharding:
        """The product's layout: rows split evenly along the axis."""
        return NamedSharding(self.mesh, P(self.axis))

    @property
    def input_order(self) -> np.ndarray:
        """Segment form: for each laid-out column, the input position (``idx`` index)
        of its edge, ``-1`` for padding. ``S @ v`` lays input-order values out with it
        inside the product; :meth:`layout_values` does it once, on the host."""
        return self._meta("input_order")

    @property
    def data_order(self) -> np.ndarray:
        """For each laid-out value, its position in ``A.data`` (``-1``: padding)."""
        return self._meta("data_order")

    def _meta(self, name: str) -> np.ndarray:
        """Host metadata of the layout: the numpy copy ``shard`` kept (it also serves
        processes that hold only some of the devices), else read from the device."""
        if self._host_layout is None:
            return _on_host(getattr(self._layout, name), name)
        if name in ("input_order", "data_order"):
            return self._host_layout.order(name)
        return getattr(self._host_layout, name)

    def __repr__(self) -> str:
        if is_traced(self._layout.block_nnz):
            return f"ShardedCSR(shape={self.shape}, form={self.form!r}, traced layout)"
        return (
            f"ShardedCSR(shape={self.shape}, form={self.form!r}, shards={self.num_shards} "
            f"along {self.axis!r}, balance={self._plan.balance!r}, nnz per shard "
            f"{list(self.block_nnz)}, imbalance {self.imbalance:.3f})"
        )

    # ------------------------------------------------------------------ layout
    def layout_values(self, values: Any) -> jax.Array:
        """Per-edge values in input order ``(K, ...)`` -> laid out ``(layout_size, ...)``
        (zeros in padding slots), placed as :attr:`input_sharding`. Host-side, once:
        for :meth:`matmul_laid_out`, and for per-edge inputs (senders, edge features)
        from which a jitted step computes its messages already in the layout. With
        several processes each fills only its own devices' blocks."""
        if self.form != "segment":
            raise ValueError("layout_values is for the segment form (from_indices)")
        return self._lay_out(values, "input_order", "values", self.shape[1])

    def layout_data(self, data: Any) -> jax.Array:
        """``A.data``-ordered values ``(nnz,)`` -> :attr:`data`'s layout, placed."""
        return self._lay_out(data, "data_order", "data", sum(self.block_nnz))

    def _lay_out(self, values, order_name, name, expected):
        values = np.asarray(values)
        if values.ndim == 0 or values.shape[0] != expected:
            raise ValueError(f"{name} must have {expected} rows, got shape {values.shape}")
        if self._host_layout is None:
            whole = self._meta(order_name).reshape(self.num_shards, -1)
            orders = {p: whole[p] for p in range(self.num_shards)}
        else:
            orders = {
                p: self._host_layout.block_order(p, order_name) for p in self._host_layout.orders
            }

        def block(p: int) -> np.ndarray:
            order = orders[p]
            out = np.zeros((order.size, *values.shape[1:]), values.dtype)
            out[order >= 0] = values[order[order >= 0]]
            return out

        return _from_blocks(block, self.num_shards, self.input_sharding)

    def with_data(self, data: Any) -> ShardedCSR:
        """Same structure, new laid-out values ``(len(S.data_order),)`` (may be traced)."""
        data = jnp.asarray(data)
        size = self._layout.data_order.shape[0]
        if data.shape != (size,):
            raise ValueError(f"data must have shape ({size},) (laid out), got {data.shape}")
        plan_ = dataclasses.replace(self._plan, has_data=True)
        return ShardedCSR(
            self._index_leaves,
            data,
            self._send,
            self._recv,
            self._layout,
            plan_,
            self._host_layout,
        )

    # ------------------------------------------------------------- products
    def __matmul__(self, x: Any) -> jax.Array:
        return matmul(self, x)

    def matmul(self, x: Any, *, reduce: str = "sum", return_arg: bool = False):
        """``A @ x`` with ``reduce`` (see :func:`jaxcsr.matmul`), row-sharded."""
        return matmul(self, x, reduce=reduce, return_arg=return_arg)

    def matmul_laid_out(self, values: Any, *, reduce: str = "sum", return_arg: bool = False):
        """Segment form: ``A @ v`` for per-edge values already laid out, ``(layout_size,
        ...)`` (:meth:`layout_values`, or computed in the layout inside a jitted step):
        no communication before the product. ``return_arg`` gives laid-out positions
        (sentinel ``layout_size``). The SpMM form has no layout: use ``S @ x``."""
        if self.form != "segment":
            raise ValueError("matmul_laid_out is for the segment form; use S @ x")
        return matmul(_LaidOut(self), values, reduce=reduce, return_arg=return_arg)

    def product(
        self, x: jax.Array, *, reduce: str, return_arg: bool, impl: str | None, interpret: bool
    ) -> Any:
        """:meth:`~jaxcsr.matrix.SparseOperand.product`: every device runs its block's
        default backend inside one ``shard_map``. The segment form first lays the
        input-order values out: every device gathers its edges' values by its slice of
        :attr:`input_order` from ``x`` replicated (an all-gather of ``x`` when it is
        sharded; ``communication()["layout"]``), and ``return_arg`` gives input
        positions."""
        if impl is not None or interpret:
            raise ValueError("impl/interpret: a ShardedCSR runs each block's default")
        return _sharded_product(self, x, reduce, return_arg, in_order=self.form == "segment")

    def operand_hint(self) -> str:
        if self.form != "segment":
            return ""
        return (
            f" (per-edge values in input order); values already laid out "
            f"({self.layout_size} rows, S.layout_values) go to S.matmul_laid_out"
        )

    def communication(self, n_features: int, dtype: Any = jnp.float32) -> dict[str, int]:
        """Bytes one device (the busiest) receives per product (forward; the backward
        moves the same amounts the other way): ``gather_x`` (SpMM: its share of the
        all-gather of ``x`` when ``x`` is sharded, 0 when replicated), ``layout``
        (segment form, ``S @ v`` with ``v`` in input order: its share of the
        all-gather of ``v`` when ``v`` is sharded, 0 when replicated or through
        :meth:`matmul_laid_out`) and ``relayout`` (rows of its block that belong to
        another device's part of the output)."""
        itemsize = np.dtype(dtype).itemsize
        shards, (m, n) = self.num_shards, self.shape
        share = (shards - 1) * -(-n // shards)  # rows of an all-gather of (n, ...)
        gather = 0 if self.form == "segment" else share
        layout = share if self.form == "segment" else 0
        rows = relayout_rows(self.row_starts, m)
        return {
            "gather_x": gather * n_features * itemsize,
            "layout": layout * n_features * itemsize,
            "relayout": int(rows.max(initial=0)) * n_features * itemsize,
        }


class _LaidOut(SparseOperand):
    """A segment-form :class:`ShardedCSR` viewed as the ``(m, layout_size)`` matrix of
    its laid-out columns: what :meth:`ShardedCSR.matmul_laid_out` multiplies."""

    def __init__(self, S: ShardedCSR):
        self._S = S

    @property
    def shape(self) -> tuple[int, int]:
        return (self._S.shape[0], self._S.layout_size)

    @property
    def dtype(self) -> np.dtype | None:
        return self._S.dtype

    def product(self, x, *, reduce, return_arg, impl, interpret):
        if impl is not None or interpret:
            raise ValueError("impl/interpret: a ShardedCSR runs each block's default")
        return _sharded_product(self._S, x, reduce, return_arg)

    def operand_hint(self) -> str:
        n = self._S.shape[1]
        return f" (values laid out); per-edge values in input order ({n} rows) go to S @ v"


class _RowBlocks:
    """The padded row blocks of one matrix, each built when first asked for.

    ``columns(lo, hi)`` gives the column indices (and values, or ``None``) of rows
    ``lo:hi`` in row order; it is called only for the blocks a caller reads, so a
    process that places only its own devices' blocks reads only its rows."""

    def __init__(self, indptr: np.ndarray, sizes, columns: Callable, *, n: int, segment: bool):
        self.indptr = indptr  # (m + 1,) int64, the whole matrix's
        self.row_starts, self.block_nnz, self.block_rows, self.block_cols = sizes
        self.shards = len(self.row_starts) - 1
        self.n, self.segment = n, segment
        self._columns = columns
        self._loaded: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    def entries(self, p: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Columns and values of block ``p``'s stored entries (unpadded)."""
        if p not in self._loaded:
            lo, hi = int(self.row_starts[p]), int(self.row_starts[p + 1])
            self._loaded[p] = self._columns(lo, hi)
        return self._loaded[p]

    def _padded(self, values: np.ndarray, fill, dtype) -> np.ndarray:
        out = np.full(self.block_cols, fill, dtype)
        out[: len(values)] = values
        return out

    def data_order(self, p: int) -> np.ndarray:
        """``(K_b,)`` position in the whole matrix's CSR order per slot, -1: padding."""
        return block_positions(self.indptr, self.row_starts, p, self.block_cols).astype(np.int32)

    def input_order(self, p: int) -> np.ndarray:
        """``(K_b,)`` segment form: the input position (column) per slot, -1: padding."""
        columns = self.entries(p)[0] if self.segment else np.zeros(0, np.int32)
        return self._padded(columns, -1, np.int32)

    def values(self, p: int, dtype) -> np.ndarray:
        values = self.entries(p)[1]
        assert values is not None, "a block of a matrix with values"
        return self._padded(values, 0, dtype)

    def structure(self, p: int) -> Structure:
        """Host structure of block ``p``: its rows, empty rows up to the row capacity,
        then the trash row that holds the padding entries (one layout for every
        block)."""
        starts, k_b = self.row_starts, self.block_cols
        lo = int(self.indptr[starts[p]])
        own = self.indptr[starts[p] : starts[p + 1] + 1] - lo
        empty = np.full(self.block_rows - (starts[p + 1] - starts[p]), own[-1])
        local_indptr = np.concatenate([own, empty, [k_b]]).astype(np.int32)
        if self.segment:  # the block's columns are its own entries, in order
            ids = plan.row_ids(local_indptr)
            return plan.structure_from_segment_ids(ids, self.block_rows + 1)
        cols = self._padded(self.entries(p)[0], 0, np.int32)
        return plan.general_structure(local_indptr, cols, (self.block_rows + 1, self.n))


def _from_blocks(block: Callable[[int], np.ndarray], shards: int, sharding) -> jax.Array:
    """A ``(shards * len(b), ...)`` array sharded as ``sharding`` whose rows are the
    blocks ``block(p)``; only this process's devices' blocks are computed."""
    p0 = _local_blocks(sharding)[0]
    first = block(p0)  # its shape is every block's; computed once

    def rows(index) -> np.ndarray:
        size = first.shape[0]
        if size == 0:  # empty blocks (no entries): nothing to compute
            return first
        lo, hi, _ = index[0].indices(shards * size)
        return np.concatenate(
            [first if p == p0 else block(p) for p in range(lo // size, hi // size)]
        )

    return jax.make_array_from_callback((shards * first.shape[0], *first.shape[1:]), sharding, rows)


def _place_index(blocks: _RowBlocks, backends, sharding) -> tuple[list[jax.Array], Any]:
    """Plans every block of this process's devices for ``backends`` (each block once)
    and places its arrays on its device, stacked along a leading shard axis. Returns
    the leaves and the treedef (every block has one static layout)."""
    planned: dict[int, list[np.ndarray]] = {}
    trees = set()

    def leaves_of(p: int) -> list[np.ndarray]:
        if p not in planned:
            leaves, tree = jax.tree_util.tree_flatten(Index.planned(blocks.structure(p), backends))
            planned[p] = [np.asarray(x)[None] for x in leaves]
            trees.add(tree)
        return planned[p]

    count = len(leaves_of(_local_blocks(sharding)[0]))

    def leaf(k: int, p: int) -> np.ndarray:
        return leaves_of(p)[k]

    leaves = [
        _from_blocks(functools.partial(leaf, k), blocks.shards, sharding) for k in range(count)
    ]
    assert len(trees) == 1, "row blocks must share one static layout"
    return leaves, trees.pop()


def _local_blocks(sharding: NamedSharding) -> list[int]:
    """The blocks (rows of a ``(shards, ...)`` array) this process's devices hold."""
    return sorted({int(p) for d in sharding.addressable_devices for p in _block_ids(sharding, d)})


def _block_ids(sharding: NamedSharding, device) -> range:
    """The blocks (rows of a ``(shards, ...)`` array) that ``device`` holds."""
    shards = int(sharding.mesh.shape[sharding.spec[0]])
    index = sharding.addressable_devices_indices_map((shards,))[device]
    assert index is not None
    return range(shards)[index[0]]


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
    blocks = _RowBlocks(
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

    blocks = _RowBlocks(
        indptr,
        block_sizes(indptr, int(mesh.shape[axis]), balance),
        columns,
        n=n,
        segment=segment,
    )
    sharding = NamedSharding(mesh, P(axis))
    orders = {p: (blocks.input_order(p), blocks.data_order(p)) for p in _local_blocks(sharding)}
    S = _sharded(blocks, mesh, axis, balance, backends, orders)
    if dtype is None:
        return S
    return S.with_data(_from_blocks(lambda p: blocks.values(p, dtype), blocks.shards, sharding))


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
    if segment and np.unique(cols).size != cols.size:
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


def _sharded(blocks: _RowBlocks, mesh, axis, balance, backends, orders) -> ShardedCSR:
    """The :class:`ShardedCSR` of ``blocks`` (without values: ``with_data`` adds them).
    ``orders``: the blocks whose layout metadata this host keeps."""
    shards, m, n = blocks.shards, blocks.indptr.size - 1, blocks.n
    sharding = NamedSharding(mesh, P(axis))
    leaves, index_tree = _place_index(blocks, backends, sharding)
    replicated = NamedSharding(mesh, P())
    host_layout = _HostLayout(
        blocks.row_starts.astype(np.int32), blocks.block_nnz.astype(np.int32), orders
    )
    layout = _Layout(
        row_starts=jax.device_put(host_layout.row_starts, replicated),
        block_nnz=jax.device_put(host_layout.block_nnz, replicated),
        input_order=_from_blocks(lambda p: orders[p][0], shards, sharding),
        data_order=_from_blocks(lambda p: orders[p][1], shards, sharding),
    )
    send, recv, shifts, aligned = relayout_plan(
        blocks.row_starts, m, blocks.block_rows, shards, balance
    )
    plan_ = _Plan(
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
    return ShardedCSR(leaves, None, send, recv, layout, plan_, host_layout)


# ---------------------------------------------------------------------- product
def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` in ``sharding`` (``reshard`` on explicit mesh axes, a constraint else)."""
    if _explicit(sharding.mesh):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _sharded_product(
    S: ShardedCSR, x: jax.Array, reduce: str, return_arg: bool, in_order: bool = False
):
    """``in_order``: segment-form values in input order, laid out inside the blocks."""
    pl_ = S._plan
    x_spec = P(pl_.axis) if pl_.form == "segment" and not in_order else P()
    operands = [_place(x, NamedSharding(pl_.mesh, x_spec)), *S._index_leaves]
    if S._data is not None:  # new values (with_data) may come in any layout
        operands.append(_place(S._data, NamedSharding(pl_.mesh, P(pl_.axis))))
    if not pl_.aligned:
        operands += [S._send, S._recv]
    if in_order:
        operands.append(S._layout.input_order)
    return _sharded_function(pl_, reduce, return_arg, in_order)(*operands)


@functools.lru_cache(maxsize=256)
def _sharded_function(pl_: _Plan, reduce: str, return_arg: bool, in_order: bool = False):
    """The jitted ``shard_map`` of one plan and reduction (cached: eager calls compile
    once; inside an outer ``jit`` it is inlined)."""
    axis = pl_.axis
    shards, (m, _) = int(pl_.mesh.shape[pl_.axis]), pl_.shape
    specs = [P(axis) if pl_.form == "segment" and not in_order else P()]
    specs += [P(axis)] * pl_.index_tree.num_leaves
    specs += [P(axis)] * pl_.has_data + [P(axis), P(axis)] * (not pl_.aligned)
    specs += [P(axis)] * in_order
    body = functools.partial(
        _block_product,
        plan_=pl_,
        rows=rows_per_part(m, shards),
        reduce=reduce,
        return_arg=return_arg,
        in_order=in_order,
    )
    out_specs = (P(axis), P(axis)) if return_arg else P(axis)
    mapped = jax.shard_map(
        body, mesh=pl_.mesh, in_specs=tuple(specs), out_specs=out_specs, check_vma=False
    )
    trim = functools.partial(_trim, m=m, mesh=pl_.mesh)

    def run(*operands):
        out = mapped(*operands)
        return (trim(out[0]), trim(out[1])) if return_arg else trim(out)

    return jax.jit(run)


def _trim(out: jax.Array, *, m: int, mesh) -> jax.Array:
    """The ``m`` real rows of the ``shards * rows`` computed ones.

    Rows split evenly need nothing. Otherwise the result cannot keep a row sharding
    (JAX shards a dimension only in equal parts): Explicit axes replicate it first
    (an all-gather), Auto axes let XLA place the slice. Pick ``m`` divisible by the
    shard count (pad with empty rows) to keep the output sharded.
    """
    if out.shape[0] == m:
        return out
    if _explicit(mesh):
        out = jax.sharding.reshard(out, NamedSharding(mesh, P()))
    return out[:m]


def _explicit(mesh) -> bool:
    return any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))


def _block_product(
    x, *rest, plan_: _Plan, rows: int, reduce: str, return_arg: bool, in_order: bool
):
    queue = list(rest)
    leaves = [queue.pop(0)[0] for _ in range(plan_.index_tree.num_leaves)]
    data = queue.pop(0) if plan_.has_data else None
    send, recv = (queue.pop(0)[0], queue.pop(0)[0]) if not plan_.aligned else (None, None)
    order = queue.pop(0) if in_order else None  # this block's input positions, -1: pad
    if in_order:  # lay this block's edges out from the replicated input-order values
        x = x.at[order].get(mode="fill", fill_value=0, wrap_negative_indices=False)
    index = jax.tree_util.tree_unflatten(plan_.index_tree, leaves)
    block = CSRMatrix(data, index)
    out = block.product(x, reduce=reduce, return_arg=return_arg, impl=None, interpret=False)
    if not return_arg:
        return _relayout(out, send, recv, plan_, rows)
    out, arg = out
    k_b = plan_.block_cols
    if order is not None:  # block column j holds input position order[j]
        position = order[jnp.minimum(arg, k_b - 1)]
        arg = jnp.where(arg < k_b, position, plan_.shape[1]).astype(arg.dtype)
    elif plan_.form == "segment":  # block column j of device p is laid-out column p*K_b + j
        p = lax.axis_index(plan_.axis)
        arg = jnp.where(arg < k_b, arg + p * k_b, plan_.layout_size).astype(arg.dtype)
    return _relayout(out, send, recv, plan_, rows), _relayout(arg, send, recv, plan_, rows)


def _relayout(block_out, send, recv, plan_: _Plan, rows: int):
    """A block's rows -> this device's part of the even row split (ppermute halo)."""
    if plan_.aligned:
        return block_out[:rows]
    shards = int(plan_.mesh.shape[plan_.axis])
    out = jnp.zeros((rows, *block_out.shape[1:]), block_out.dtype)
    for i, shift in enumerate(plan_.shifts):
        buf = block_out[send[i]]
        if shift:
            perm = [(p, p + shift) for p in range(shards) if 0 <= p + shift < shards]
            buf = lax.ppermute(buf, plan_.axis, perm)
        out = out.at[recv[i]].set(buf, mode="drop")
    return out
