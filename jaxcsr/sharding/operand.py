"""The sharded matrix as a user holds it: :class:`ShardedCSR` (a pytree and a
:class:`~jaxcsr.matrix.SparseOperand`), its host metadata and value layout, and
:class:`LaidOutView`, the same matrix over values already laid out."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcsr.matrix import SparseOperand, matmul
from jaxcsr.sharding.blocks import from_blocks
from jaxcsr.sharding.product import sharded_product
from jaxcsr.sharding.row_blocks import relayout_rows
from jaxcsr.sharding.spec import BlockLayout, Spec
from jaxcsr.validation import is_traced

__all__ = ["LaidOutView", "ShardedCSR"]


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
        self, index_leaves, data, send, recv, layout: BlockLayout, spec: Spec, host_layout=None
    ):
        self._host_layout = host_layout  # numpy copies of layout (not leaves): see _meta
        self._index_leaves = tuple(index_leaves)
        self._data = data
        self._send, self._recv = send, recv  # the relayout's row maps (None: aligned)
        self._spec = spec
        self._layout = layout

    # ------------------------------------------------------------------ pytree
    def tree_flatten(self):
        children = (self._index_leaves, self._data, self._send, self._recv, self._layout)
        return children, self._spec

    @classmethod
    def tree_unflatten(cls, spec, children):
        return cls(*children, spec)

    # -------------------------------------------------------------- properties
    @property
    def shape(self) -> tuple[int, int]:
        """``A.shape``: ``S @ x`` takes what ``A @ x`` takes (per-edge values in input
        order, for the segment form)."""
        return self._spec.shape

    @property
    def layout_size(self) -> int:
        """Rows of per-edge values laid out shard by shard (segment form: ``shards *
        block capacity``, padding slots included; SpMM form: ``shape[1]``), what
        :meth:`layout_values` returns and :meth:`matmul_laid_out` takes."""
        return self._spec.layout_size

    @property
    def dtype(self) -> np.dtype | None:
        """dtype of the values; ``None`` for a one-valued matrix."""
        return None if self._data is None else np.dtype(self._data.dtype)

    @property
    def mesh(self):
        return self._spec.mesh

    @property
    def axis(self) -> str:
        return self._spec.axis

    @property
    def num_shards(self) -> int:
        return self._layout.block_nnz.shape[0]

    @property
    def form(self) -> str:
        """``"segment"`` (``from_indices``) or ``"spmm"``."""
        return self._spec.form

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
            f"along {self.axis!r}, balance={self._spec.balance!r}, nnz per shard "
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

        return from_blocks(block, self.num_shards, self.input_sharding)

    def with_data(self, data: Any) -> ShardedCSR:
        """Same structure, new laid-out values ``(len(S.data_order),)`` (may be traced)."""
        data = jnp.asarray(data)
        size = self._layout.data_order.shape[0]
        if data.shape != (size,):
            raise ValueError(f"data must have shape ({size},) (laid out), got {data.shape}")
        spec = dataclasses.replace(self._spec, has_data=True)
        return ShardedCSR(
            self._index_leaves,
            data,
            self._send,
            self._recv,
            self._layout,
            spec,
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
        return matmul(LaidOutView(self), values, reduce=reduce, return_arg=return_arg)

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
        order = self._layout.input_order if self.form == "segment" else None
        return self._product(x, reduce, return_arg, order)

    def _product(self, x, reduce: str, return_arg: bool, input_order) -> Any:
        maps = None if self._spec.aligned else (self._send, self._recv)
        return sharded_product(
            self._spec, x, self._index_leaves, self._data, maps, input_order,
            reduce=reduce, return_arg=return_arg,
        )  # fmt: skip

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


class LaidOutView(SparseOperand):
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
        return self._S._product(x, reduce, return_arg, None)

    def operand_hint(self) -> str:
        n = self._S.shape[1]
        return f" (values laid out); per-edge values in input order ({n} rows) go to S @ v"
