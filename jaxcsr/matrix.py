"""``CSRMatrix``: a sparse matrix with a static, host-planned structure, as a pytree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from jaxcsr import plan
from jaxcsr.kernels import gpu as gpu_kernels
from jaxcsr.kernels import tpu as tpu_kernels
from jaxcsr.kernels import xla as xla_kernels
from jaxcsr.kernels.xla import Pattern
from jaxcsr.ops import MatmulInfo, matmul

__all__ = ["CSRMatrix"]


def _check_values(data: Any, nnz: int, name: str) -> jax.Array:
    """Validates per-nonzero values (may be traced): numeric, shape ``(nnz,)``."""
    data = jnp.asarray(data)
    if data.dtype == np.bool_ or not jnp.issubdtype(data.dtype, jnp.number):
        raise TypeError(f"{name} must have a numeric dtype, got {data.dtype}")
    if data.shape != (nnz,):
        raise ValueError(f"{name} must have shape (nnz,) = ({nnz},), got {data.shape}")
    return data


def _host_values(data: Any, name: str) -> np.ndarray:
    try:
        return np.asarray(data)
    except Exception as err:
        raise ValueError(
            f"{name} is a traced JAX value; build the CSRMatrix outside jax.jit and "
            "set traced values with with_data()."
        ) from err


@jax.tree_util.register_pytree_node_class
class CSRMatrix:
    """A 2-D sparse matrix in CSR form whose structure is planned once on the host.

    The index structure (``indptr``, ``indices`` and the planned transpose) is
    fixed at construction; only the values can change (:meth:`with_data`). The
    matrix is a pytree: pass it to ``jax.jit``-ed functions as an argument. Two
    matrices with the same shape and structure class share one compilation.

    A matrix built without values is *one-valued*: every stored entry is 1, no
    array of ones is stored and products skip the multiply. Its :attr:`dtype` is
    ``None``; a product returns the dense operand's dtype.

    Build it with a classmethod -- :meth:`from_indices`, :meth:`from_coo`,
    :meth:`from_scipy`, :meth:`from_dense`, :meth:`from_arrays` -- not with the
    constructor, whose arguments are the planned internals.

    Nonzero order: the matrix stores its nonzeros in CSR order (rows ascending;
    within a row, columns ascending for every constructor except
    :meth:`from_arrays`, which keeps the given order). :attr:`data` and
    :meth:`with_data` use this order. Constructors that take values in another
    order (:meth:`from_indices`, :meth:`from_coo`) record it in
    :attr:`input_order`: ``A.data == data_in_input_order[A.input_order]``.
    """

    __array_priority__ = 1000  # so numpy arrays defer `values @ A` to __rmatmul__

    def __init__(
        self,
        data: jax.Array | None,
        pattern: Pattern,
        *,
        shape: tuple[int, int],
        identity_columns: bool = False,
        t_identity_columns: bool = False,
        input_order: jax.Array | None = None,
    ):
        self.data = data
        self.pattern = pattern
        self.shape = shape
        self.identity_columns = identity_columns
        self.t_identity_columns = t_identity_columns
        self.input_order = input_order

    # ----------------------------------------------------------------- pytree
    def tree_flatten(self):
        children = (self.data, self.pattern, self.input_order)
        aux = (self.shape, self.identity_columns, self.t_identity_columns)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        data, pattern, input_order = children
        shape, identity, t_identity = aux
        return cls(
            data,
            pattern,
            shape=shape,
            identity_columns=identity,
            t_identity_columns=t_identity,
            input_order=input_order,
        )

    # ----------------------------------------------------------- constructors
    @classmethod
    def _from_host_csr(
        cls,
        indptr: np.ndarray,
        indices: np.ndarray,
        data: Any | None,
        shape: tuple[int, int],
        input_order: np.ndarray | None = None,
    ) -> CSRMatrix:
        """Plans a validated host CSR structure and moves it to the device."""
        t = plan.plan_transpose(indptr, indices, shape)
        items = plan.plan_work_items(indptr, gpu_kernels.CHUNK, gpu_kernels.ITEMS_PER_PROGRAM)
        t_items = plan.plan_work_items(t.indptr, gpu_kernels.CHUNK, gpu_kernels.ITEMS_PER_PROGRAM)
        tiles = plan.plan_tile_schedule(indptr, tpu_kernels.BLOCK_M, tpu_kernels.BLOCK_K)
        t_tiles = plan.plan_tile_schedule(t.indptr, tpu_kernels.BLOCK_M, tpu_kernels.BLOCK_K)
        s = plan.plan_structure(indptr, indices, shape)
        s_t = plan.plan_structure(t.indptr, t.indices, (shape[1], shape[0]))

        def put(a):
            # Concrete device arrays even when called under a trace (e.g. the first
            # jaxcsr.segment_sum inside jax.jit): the structure is host data, and a
            # cached matrix must not hold one trace's tracers.
            if a is None:
                return None
            with jax.ensure_compile_time_eval():
                return jnp.asarray(a)

        pattern = Pattern(
            put(indptr),
            put(indices),
            put(t.indptr),
            put(t.indices),
            put(t.perm),
            put(t.inverse_perm),
            (put(items.row), put(items.start), put(items.end)),
            (put(t_items.row), put(t_items.start), put(t_items.end)),
            (put(tiles.out_tile), put(tiles.nnz_tile), put(tiles.first)),
            (put(t_tiles.out_tile), put(t_tiles.nnz_tile), put(t_tiles.first)),
            put(s.row_of_col),
            put(s.col_of_row),
        )
        if data is not None:
            data = _check_values(data, indices.size, "data")
            if input_order is not None:
                data = data[input_order]
        return cls(
            data,
            pattern,
            shape=shape,
            identity_columns=s.identity_columns,
            t_identity_columns=s_t.identity_columns,
            input_order=put(input_order),
        )

    @classmethod
    def from_indices(cls, idx: Any, num_rows: int, data: Any | None = None) -> CSRMatrix:
        """The matrix whose product is a segment sum: ``A[idx[j], j] = 1`` (or ``data[j]``).

        ``A @ values == jax.ops.segment_sum(values, idx, num_rows)`` for ``values`` of
        shape ``(len(idx), ...)``, and ``values @ A.T`` scatter-adds along the last
        axis of ``values``.

        Args:
          idx: host integer array ``(K,)`` of segment ids in ``[0, num_rows)``. It
            must be concrete: building inside ``jax.jit`` raises a ``ValueError``
            (the structure is planned on the host; build outside and pass the matrix
            in as an argument).
          num_rows: number of segments ``M``; the matrix has shape ``(M, K)``.
          data: optional ``(K,)`` weights, in the order of ``idx`` (input order).
            Stored in CSR order, ``A.data == data[A.input_order]``. May be traced.

        Returns:
          A ``CSRMatrix`` of shape ``(num_rows, len(idx))``.

        Example:
          >>> import numpy as np, jax, jax.numpy as jnp
          >>> idx = np.array([0, 2, 2, 1, 0])
          >>> A = CSRMatrix.from_indices(idx, num_rows=3)
          >>> v = jnp.arange(10.0).reshape(5, 2)
          >>> bool(jnp.allclose(A @ v, jax.ops.segment_sum(v, idx, 3)))
          True
        """
        idx, num_rows = plan.check_segment_ids(idx, num_rows)
        indptr, order = plan.segment_ids_to_csr(idx, num_rows)
        return cls._from_host_csr(indptr, order, data, (num_rows, idx.size), order)

    @classmethod
    def from_coo(
        cls, row: Any, col: Any, data: Any | None = None, *, shape: tuple[int, int]
    ) -> CSRMatrix:
        """Builds a matrix from coordinates; duplicates are kept and add up.

        Args:
          row, col: host integer arrays ``(nnz,)`` of coordinates.
          data: optional ``(nnz,)`` values in input order (may be traced);
            ``None`` for a one-valued matrix.
          shape: ``(m, n)``.

        Returns:
          A ``CSRMatrix``; ``A.data == data[A.input_order]``.
        """
        shape = plan.check_shape(shape)
        indptr, indices, order = plan.coo_to_csr(row, col, shape)
        return cls._from_host_csr(indptr, indices, data, shape, order)

    @classmethod
    def from_arrays(
        cls, indptr: Any, indices: Any, data: Any | None = None, *, shape: tuple[int, int]
    ) -> CSRMatrix:
        """Builds a matrix from raw CSR arrays (validated like scipy's ``check_format``).

        Args:
          indptr: ``(m + 1,)`` non-decreasing, starting at 0, ending at ``nnz``.
          indices: ``(nnz,)`` column indices in ``[0, n)``; their order within a row
            is kept.
          data: optional ``(nnz,)`` values in the same order, or ``None``.
          shape: ``(m, n)``.
        """
        shape = plan.check_shape(shape)
        indptr, indices = plan.check_csr_arrays(indptr, indices, shape)
        return cls._from_host_csr(indptr, indices, data, shape)

    @classmethod
    def from_scipy(cls, matrix: Any) -> CSRMatrix:
        """Builds a matrix from any ``scipy.sparse`` matrix or array.

        Column indices are sorted within rows; duplicates and explicit zeros are kept.
        float64 values become float32 unless ``jax_enable_x64`` is on.

        Raises:
          TypeError: ``matrix`` is not a scipy sparse matrix/array.
        """
        if not sp.issparse(matrix):
            raise TypeError(
                f"matrix must be a scipy.sparse matrix or array, got {type(matrix).__name__}"
            )
        if matrix.ndim != 2:
            raise ValueError(f"matrix must be 2-D, got shape {matrix.shape}")
        csr = sp.csr_array(matrix, copy=True)
        if not csr.has_sorted_indices:
            csr.sort_indices()
        shape = plan.check_shape(csr.shape)
        indptr, indices = plan.check_csr_arrays(csr.indptr, csr.indices, shape)
        data = np.asarray(csr.data, dtype=jax.dtypes.canonicalize_dtype(csr.data.dtype))
        return cls._from_host_csr(indptr, indices, data, shape)

    @classmethod
    def from_dense(cls, dense: Any) -> CSRMatrix:
        """Builds a matrix holding the nonzero entries of a concrete 2-D array."""
        dense = _host_values(dense, "dense")
        if dense.ndim != 2:
            raise ValueError(f"dense must be 2-D, got shape {dense.shape}")
        return cls.from_scipy(sp.csr_array(dense))

    # ------------------------------------------------------------- properties
    @property
    def nnz(self) -> int:
        """Number of stored entries."""
        return int(self.pattern.indices.shape[0])

    @property
    def dtype(self) -> np.dtype | None:
        """dtype of the values; ``None`` for a one-valued matrix."""
        return None if self.data is None else np.dtype(self.data.dtype)

    @property
    def indptr(self) -> jax.Array:
        """``(m + 1,)`` row pointer."""
        return self.pattern.indptr

    @property
    def indices(self) -> jax.Array:
        """``(nnz,)`` column indices in CSR order."""
        return self.pattern.indices

    @property
    def matmul_info(self) -> MatmulInfo:
        """The static facts the product primitive needs."""
        return MatmulInfo(
            self.shape,
            self.data is not None,
            self.pattern.row_of_col is not None,
            self.pattern.col_of_row is not None,
            self.identity_columns,
            self.t_identity_columns,
        )

    def __repr__(self) -> str:
        dtype = "one-valued" if self.data is None else str(self.dtype)
        return f"CSRMatrix(shape={self.shape}, nnz={self.nnz}, {dtype})"

    # ----------------------------------------------------------------- values
    def with_data(self, data: Any) -> CSRMatrix:
        """Same structure, new values given in this matrix's CSR order (may be traced).

        Raises:
          TypeError: non-numeric ``data``.
          ValueError: ``data.shape != (nnz,)``.
        """
        data = _check_values(data, self.nnz, "data")
        return CSRMatrix(
            data,
            self.pattern,
            shape=self.shape,
            identity_columns=self.identity_columns,
            t_identity_columns=self.t_identity_columns,
            input_order=self.input_order,
        )

    @property
    def T(self) -> CSRMatrix:  # noqa: N802 - numpy spelling
        """The transpose, from the structure planned at construction (no host work)."""
        p = self.pattern
        data = None if self.data is None else self.data[p.t_perm]
        order = None if self.input_order is None else self.input_order[p.t_perm]
        return CSRMatrix(
            data,
            p.transpose(),
            shape=(self.shape[1], self.shape[0]),
            identity_columns=self.t_identity_columns,
            t_identity_columns=self.identity_columns,
            input_order=order,
        )

    # ---------------------------------------------------------------- interop
    def todense(self, dtype: Any = None) -> jax.Array:
        """Dense ``(m, n)`` array. One-valued matrices default to float32."""
        m, n = self.shape
        if dtype is None:
            dtype = jnp.float32 if self.data is None else self.data.dtype
        rows = xla_kernels.row_ids(self.pattern)
        values = jnp.ones(self.nnz, dtype) if self.data is None else self.data.astype(dtype)
        return jnp.zeros((m, n), dtype).at[rows, self.indices].add(values)

    def to_scipy(self) -> sp.csr_array:
        """A ``scipy.sparse.csr_array`` copy (host). One-valued matrices get float32 ones."""
        data = (
            np.ones(self.nnz, np.float32) if self.data is None else _host_values(self.data, "data")
        )
        return sp.csr_array(
            (data, np.asarray(self.indices), np.asarray(self.indptr)), shape=self.shape
        )

    # ----------------------------------------------------------------- matmul
    def __matmul__(self, other: Any) -> jax.Array:
        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> jax.Array:
        """``X @ A`` for ``X`` of shape ``(..., m)``: contracts X's last axis."""
        x = jnp.asarray(other)
        if x.ndim == 0:
            raise ValueError("X must have rank >= 1, got a scalar (shape ())")
        if x.shape[-1] != self.shape[0]:
            raise ValueError(
                f"X.shape[-1] must equal A.shape[0] = {self.shape[0]}, got X.shape = {x.shape}"
            )
        out = matmul(self.T, jnp.moveaxis(x, -1, 0))
        return jnp.moveaxis(out, 0, -1)
