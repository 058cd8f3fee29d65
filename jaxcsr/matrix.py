"""``CSRMatrix``: a sparse matrix with a static, host-planned structure, as a pytree;
:class:`SparseOperand`, what :func:`matmul` multiplies; and :func:`matmul`, the
product behind ``@``, which validates once and calls the operand's own product."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from jaxcsr import device_plan, kernels, ops, plan
from jaxcsr.kernels import IMPLS
from jaxcsr.ops import EXTREMES, REDUCTIONS, Index
from jaxcsr.structure import Structure
from jaxcsr.validation import (
    as_numeric,
    check_coo,
    check_csr_arrays,
    check_index_range,
    check_numeric_dtype,
    check_segment_ids,
    check_shape,
    check_size,
    check_traced_ids,
    is_traced,
    reject_traced,
)

__all__ = ["CSRMatrix", "PlanInfo", "SparseOperand", "matmul"]


def _check_values(data: Any, nnz: int, name: str) -> jax.Array:
    """Validates per-nonzero values (may be traced): numeric, shape ``(nnz,)``."""
    data = as_numeric(data, name)
    if data.shape != (nnz,):
        raise ValueError(f"{name} must have shape (nnz,) = ({nnz},), got {data.shape}")
    return data


def _host_values(data: Any, name: str) -> np.ndarray:
    reject_traced(
        data, name, "build the CSRMatrix outside jax.jit and set traced values with with_data()."
    )
    return np.asarray(data)


def _to_device(tree: Any) -> Any:
    # Concrete device arrays even when called under a trace (e.g. the first
    # jaxcsr.segment_sum inside jax.jit): the structure is host data, and a cached
    # matrix must not hold one trace's tracers.
    with jax.ensure_compile_time_eval():
        return jax.tree_util.tree_map(jnp.asarray, tree)


@dataclasses.dataclass(frozen=True)
class PlanInfo:
    """What a matrix holds and what will run (:meth:`CSRMatrix.plan_info`).

    Attributes:
      shape, nnz: of the matrix.
      kind: the core's kind (``"columns"`` or ``"general"``, see
        :mod:`jaxcsr.structure`) and whether this matrix is its transposed view.
      backends: the backends whose plans the matrix carries (``"xla"`` plans nothing).
      arrays: bytes of every device array, by name (``core.*``, ``<backend>.*``,
        ``data``, ``input_order``).
      bytes_per_nnz: all of ``arrays`` over ``nnz`` (``nan`` for an empty matrix).
      strategies: what runs, per backend and platform, for ``A @ X`` (``forward``) and
        for the backward pass ``A.T @ Y`` (``transpose``).
    """

    shape: tuple[int, int]
    nnz: int
    kind: str
    backends: tuple[str, ...]
    arrays: dict[str, int]
    bytes_per_nnz: float
    strategies: dict[str, str]

    def __str__(self) -> str:
        lines = [
            f"CSRMatrix {self.shape}, nnz={self.nnz}, kind={self.kind}, backends={self.backends}",
            f"  device bytes: {sum(self.arrays.values())} ({self.bytes_per_nnz:.2f} B/nnz)",
        ]
        lines += [f"    {k}: {v}" for k, v in self.arrays.items()]
        lines += [f"  {k}: {v}" for k, v in self.strategies.items()]
        return "\n".join(lines)


class SparseOperand(abc.ABC):
    """What :func:`matmul` multiplies: a sparse ``(m, n)`` matrix that runs its own
    product (:class:`CSRMatrix`, :class:`~jaxcsr.ShardedCSR`).

    :func:`matmul` checks every argument and reshapes ``X`` to 2-D once, then calls
    :meth:`product`.
    """

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]:
        """``(m, n)``: ``X.shape[0]`` must be ``n``."""

    @property
    @abc.abstractmethod
    def dtype(self) -> np.dtype | None:
        """dtype of the values; ``None`` for a one-valued matrix."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Refuses numpy's conversion (which would give a 0-d object array)."""
        raise TypeError(
            f"a {type(self).__name__} is not a dense array: use .todense() for a JAX "
            "array, or .to_scipy() for a scipy sparse copy on the host"
        )

    @abc.abstractmethod
    def product(
        self, x: jax.Array, *, reduce: str, return_arg: bool, impl: str | None, interpret: bool
    ) -> Any:
        """``A @ x`` for a validated 2-D ``x`` ``(n, F)``: ``(m, F)``, or ``(out, arg)``."""

    def operand_hint(self) -> str:
        """Appended to the error for an ``x`` of the wrong length (what else to call)."""
        return ""


@jax.tree_util.register_pytree_node_class
class CSRMatrix(SparseOperand):
    """A 2-D sparse matrix in CSR form whose structure is planned once on the host.

    The index structure is fixed at construction; only the values can change
    (:meth:`with_data`). The matrix is a pytree: pass it to ``jax.jit``-ed functions
    as an argument. Its arrays have lengths that depend only on the shape, the
    number of stored entries and the structure class (one entry per column, one per
    row, sorted ids, general), so matrices that agree on those share one compilation
    -- whatever their row-length distributions.

    A matrix carries the portable core (:mod:`jaxcsr.structure`) and the plans of
    the backends in :attr:`backends` only: by default the XLA path plus the kernel of
    ``jax.default_backend()`` (the Triton kernel on CUDA, the Mosaic kernel on TPU);
    pass ``backends=`` to any constructor to choose (for instance to build on a CPU
    host for a GPU, or to run a kernel in interpret mode on CPU).
    :meth:`plan_info` shows what is held and what runs.

    A matrix also keeps the host structure it was planned from
    (:attr:`host_structure`, numpy arrays; not a pytree leaf, so it never enters a
    trace), which :func:`jaxcsr.shard` splits into row blocks without reading the
    device back.

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
        index: Index,
        input_order: jax.Array | None = None,
        *,
        input_order_is_columns: bool = False,
        host_structure: Structure | None = None,
    ):
        self.data = data
        self.index = index
        self._input_order = input_order
        self._input_order_is_columns = input_order_is_columns
        self._host_structure = host_structure

    # ----------------------------------------------------------------- pytree
    def tree_flatten(self):
        return (self.data, self.index, self._input_order), (self._input_order_is_columns,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        data, index, input_order = children
        return cls(data, index, input_order, input_order_is_columns=aux[0])

    # ----------------------------------------------------------- constructors
    @classmethod
    def _planned(
        cls,
        structure: Structure,
        data: Any | None,
        backends: Any,
        input_order: Any | None = None,
        *,
        data_order: Any | None = None,
        input_order_is_columns: bool = False,
    ) -> CSRMatrix:
        """Plans the requested backends on ``structure`` and moves all to the device.

        A host structure (numpy leaves) gets the backends' plans on the host and is
        kept as :attr:`host_structure`; one planned on the device (traced ids: device
        leaves) gets the same plans computed in the trace and no host structure. ``data``
        comes in input order and is stored as ``data[data_order]`` (``data_order``
        defaults to ``input_order``, the stored map).
        """
        if data is not None:  # checked before any planning or device work
            data = _check_values(data, structure.nnz, "data")
        on_device = not structure.on_host
        if on_device:
            index, order = Index.planned(structure, backends), input_order
        else:
            index = _to_device(Index.planned(structure, backends))
            order = None if input_order is None else _to_device(input_order)
        if data is not None:
            data_order = input_order if data_order is None else data_order
            if data_order is not None:
                data = data[data_order]
        return cls(
            data,
            index,
            order,
            input_order_is_columns=input_order_is_columns,
            host_structure=None if on_device else structure,
        )

    @classmethod
    def _from_host_csr(
        cls,
        indptr: np.ndarray,
        indices: np.ndarray,
        data: Any | None,
        shape: tuple[int, int],
        backends: Any,
        input_order: np.ndarray | None = None,
    ) -> CSRMatrix:
        structure = plan.structure_from_csr(indptr, indices, shape)
        return cls._planned(structure, data, backends, input_order)

    @classmethod
    def from_indices(
        cls,
        idx: Any,
        num_rows: int,
        data: Any | None = None,
        *,
        backends: Any = None,
        indices_are_sorted: bool = False,
    ) -> CSRMatrix:
        """The matrix whose product is a segment sum: ``A[idx[j], j] = 1`` (or ``data[j]``).

        ``A @ values == jax.ops.segment_sum(values, idx, num_rows)`` for ``values`` of
        shape ``(len(idx), ...)``, and ``values @ A.T`` scatter-adds along the last
        axis of ``values``. The XLA path stores ``idx`` itself, its stable argsort and
        the row pointer -- ``8 + 4 (num_rows + 1) / len(idx)`` bytes per id with int32
        indices (4 when the ids are already sorted).

        Concrete ids are planned on the host once and checked: an id outside
        ``[0, num_rows)`` raises. Traced ids (inside ``jit``, ``grad``, ``scan``,
        ``vmap``: a new graph every step) are planned on the device at every call,
        with the same arrays (:mod:`jaxcsr.device_plan`); an id outside
        ``[0, num_rows)`` is dropped, as ``jax.ops.segment_sum`` drops it (its column
        is empty). Array lengths depend only on ``(num_rows, len(idx))``, so batches
        padded to one size compile once.

        Args:
          idx: integer array ``(K,)`` of segment ids, concrete or traced.
          num_rows: number of segments ``M`` (a Python int, also under ``jit``); the
            matrix has shape ``(M, K)``.
          data: optional ``(K,)`` weights, in the order of ``idx`` (input order).
            Stored in CSR order, ``A.data == data[A.input_order]``. May be traced.
          backends: backend names to plan for (see :attr:`backends`); ``None``: the
            XLA path and the kernel of ``jax.default_backend()``.
          indices_are_sorted: traced ids only: the caller promises they are
            non-decreasing with any dropped id at the end (``>= num_rows``), so the
            device plan skips its sort; a broken promise gives unspecified results,
            as in ``jax.ops``. Concrete ids are checked instead.

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
        if not isinstance(indices_are_sorted, bool):
            raise TypeError(f"indices_are_sorted must be a bool, got {indices_are_sorted!r}")
        if is_traced(idx):
            num_rows = check_index_range(check_size(num_rows, "num_rows"), "num_rows")
            idx = check_traced_ids(idx, "idx")
            structure = device_plan.segment_structure(idx, num_rows, sorted_ids=indices_are_sorted)
            return cls._planned(
                structure,
                data,
                backends,
                data_order=structure.indices,
                input_order_is_columns=True,
            )
        idx, num_rows = check_segment_ids(idx, num_rows)
        return cls._from_checked_ids(idx, num_rows, data, backends)

    @classmethod
    def _from_checked_ids(
        cls, idx: np.ndarray, num_rows: int, data: Any, backends: Any
    ) -> CSRMatrix:
        """:meth:`from_indices` of host ids its caller has checked (``check_segment_ids``:
        a 1-D int array inside ``[0, num_rows)``), without checking them again."""
        structure = plan.structure_from_segment_ids(idx, num_rows)
        order = None
        if data is not None and not structure.layout.sorted_ids:
            order = structure.indices
        # input_order is the column indices themselves: derived, not stored
        return cls._planned(
            structure, data, backends, data_order=order, input_order_is_columns=True
        )

    @classmethod
    def from_coo(
        cls, row: Any, col: Any, data: Any = None, *, shape: tuple[int, int], backends: Any = None
    ) -> CSRMatrix:
        """Builds a matrix from coordinates; duplicates are kept and add up.

        Concrete coordinates are planned on the host and checked (out of range
        raises); the matrix takes the cheapest kind that fits (at most one entry per
        column or per row, else general). Traced coordinates are planned on the
        device at every call (:mod:`jaxcsr.device_plan`): always the general kind,
        and an entry with a coordinate outside ``shape`` is dropped.

        Args:
          row, col: integer arrays ``(nnz,)`` of coordinates, concrete or traced.
          data: optional ``(nnz,)`` values in input order (may be traced);
            ``None`` for a one-valued matrix.
          shape: ``(m, n)``.
          backends: as in :meth:`from_indices`.

        Returns:
          A ``CSRMatrix``; ``A.data == data[A.input_order]``.
        """
        shape = check_shape(shape)
        if is_traced(row) or is_traced(col):
            row, col = (
                check_traced_ids(jnp.asarray(row), "row"),
                check_traced_ids(jnp.asarray(col), "col"),
            )
            if row.shape != col.shape:
                raise ValueError(
                    f"row and col must have the same length, got {row.size} and {col.size}"
                )
            structure, device_order = device_plan.coo_structure(row, col, shape)
            return cls._planned(structure, data, backends, device_order)
        row, col = check_coo(row, col, shape)
        return cls._from_checked_coo(row, col, shape, data, backends)

    @classmethod
    def _from_checked_coo(
        cls, row: np.ndarray, col: np.ndarray, shape: tuple[int, int], data: Any, backends: Any
    ) -> CSRMatrix:
        """:meth:`from_coo` of host coordinates its caller has checked (``check_coo``, or
        ids through ``check_segment_ids`` and their positions), without checking them
        again."""
        indptr, indices, order = plan.coo_to_csr(row, col, shape)
        return cls._from_host_csr(indptr, indices, data, shape, backends, order)

    @classmethod
    def from_arrays(
        cls,
        indptr: Any,
        indices: Any,
        data: Any | None = None,
        *,
        shape: tuple[int, int],
        backends: Any = None,
    ) -> CSRMatrix:
        """Builds a matrix from raw CSR arrays (validated like scipy's ``check_format``).

        Args:
          indptr: ``(m + 1,)`` non-decreasing, starting at 0, ending at ``nnz``.
          indices: ``(nnz,)`` column indices in ``[0, n)``; their order within a row
            is kept.
          data: optional ``(nnz,)`` values in the same order, or ``None``.
          shape: ``(m, n)``.
          backends: as in :meth:`from_indices`.
        """
        shape = check_shape(shape)
        indptr, indices = check_csr_arrays(indptr, indices, shape)
        return cls._from_host_csr(indptr, indices, data, shape, backends)

    @classmethod
    def from_scipy(cls, matrix: Any, *, backends: Any = None) -> CSRMatrix:
        """Builds a matrix from any ``scipy.sparse`` matrix or array.

        Column indices are sorted within rows; duplicates (in every format, COO
        included) and explicit zeros are kept. float64 values become float32 unless
        ``jax_enable_x64`` is on.

        Raises:
          TypeError: ``matrix`` is not a scipy sparse matrix/array.
        """
        if not sp.issparse(matrix):
            raise TypeError(
                f"matrix must be a scipy.sparse matrix or array, got {type(matrix).__name__}"
            )
        if matrix.ndim != 2:
            raise ValueError(f"matrix must be 2-D, got shape {matrix.shape}")
        shape = check_shape(matrix.shape)
        if matrix.format == "coo":  # scipy's CSR conversion would sum duplicates
            row, col = check_coo(matrix.row, matrix.col, shape)
            indptr, indices, order = plan.coo_to_csr(row, col, shape)
            values = np.asarray(matrix.data)[order]
        else:
            csr = sp.csr_array(matrix, copy=True)
            if not csr.has_sorted_indices:
                csr.sort_indices()
            indptr, indices = check_csr_arrays(csr.indptr, csr.indices, shape)
            values = csr.data
        data = np.asarray(values, dtype=jax.dtypes.canonicalize_dtype(values.dtype))
        return cls._from_host_csr(indptr, indices, data, shape, backends)

    @classmethod
    def from_dense(cls, dense: Any, *, backends: Any = None) -> CSRMatrix:
        """Builds a matrix holding the nonzero entries of a concrete 2-D array.

        Entries that compare unequal to 0 are stored (NaN included), in row-major
        order, in the array's own dtype (float16 and bfloat16 too; float64 becomes
        float32 unless ``jax_enable_x64`` is on).

        Raises:
          TypeError: ``dense`` is not numeric.
          ValueError: ``dense`` is traced or not 2-D.
        """
        dense = _host_values(dense, "dense")
        if dense.ndim != 2:
            raise ValueError(f"dense must be 2-D, got shape {dense.shape}")
        check_numeric_dtype(dense.dtype, "dense")  # before any work
        shape = check_shape(dense.shape)
        rows, cols = np.nonzero(dense != 0)
        indptr, indices, _ = plan.coo_to_csr(rows, cols, shape)  # already in CSR order
        data = dense[rows, cols]
        data = data.astype(jax.dtypes.canonicalize_dtype(data.dtype), copy=False)
        return cls._from_host_csr(indptr, indices, data, shape, backends)

    # ------------------------------------------------------------- properties
    @property
    def structure(self) -> Structure:
        """The portable core (:class:`~jaxcsr.structure.Structure`), viewed as this matrix."""
        return self.index.structure

    @property
    def backends(self) -> tuple[str, ...]:
        """Names of the backends planned for (``"xla"`` always; kernels when asked)."""
        return tuple(sorted(self.index.plans))

    @property
    def shape(self) -> tuple[int, int]:
        return self.structure.shape

    @property
    def nnz(self) -> int:
        """Number of stored entries."""
        return self.structure.nnz

    @property
    def dtype(self) -> np.dtype | None:
        """dtype of the values; ``None`` for a one-valued matrix."""
        return None if self.data is None else np.dtype(self.data.dtype)

    @property
    def indptr(self) -> jax.Array:
        """``(m + 1,)`` row pointer (derived on the device where it is not stored)."""
        return self.structure.view_indptr()

    @property
    def indices(self) -> jax.Array:
        """``(nnz,)`` column indices in CSR order (derived where not stored)."""
        return self.structure.view_indices()

    @property
    def host_structure(self) -> Structure | None:
        """The host :class:`~jaxcsr.structure.Structure` (numpy leaves) this matrix was
        planned from, viewed as this matrix. ``None`` for a matrix rebuilt from its
        leaves (a jitted function's output, ``tree_map``): rebuild it with a
        constructor to shard it."""
        return self._host_structure

    @property
    def columns_are_inputs(self) -> bool:
        """Built by :meth:`from_indices` and not transposed: column ``j`` holds input
        position ``j`` (``A @ values`` is a segment sum of per-input ``values``)."""
        return self._input_order_is_columns and self.structure.one_per_column

    @property
    def input_order(self) -> jax.Array | None:
        """Input position of each stored entry (:meth:`from_indices`, :meth:`from_coo`).

        ``None`` for matrices built from CSR/scipy/dense input, which are already in
        CSR order.
        """
        if self._input_order_is_columns:  # from_indices: input j is column j
            s = self.structure
            return s.row_ids() if s.transposed else s.view_indices()
        return self._input_order

    def plan_info(self, n_features: int | None = None) -> PlanInfo:
        """What this matrix holds on the device and what each backend runs.

        Args:
          n_features: optional feature width ``F`` of the dense operand: the XLA
            strategy for that width (default: a wide operand) and, where planned, the
            Triton kernel's float32 tile configuration for it.

        Example:
          >>> import numpy as np
          >>> A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0]), 3, backends=["xla"])
          >>> info = A.plan_info()
          >>> info.backends, sorted(info.arrays), info.strategies["forward, xla on cpu"]
          (('xla',), ['core.indices', 'core.indptr', 'core.row_of_col'], 'scatter')
        """
        s = self.structure
        arrays = {f"core.{k}": int(v.nbytes) for k, v in s.arrays().items()}
        for name, p in self.index.plans.items():
            flat, _ = jax.tree_util.tree_flatten_with_path(p)
            for path, leaf in flat:
                arrays[f"{name}{jax.tree_util.keystr(path)}"] = int(leaf.nbytes)
        if self.data is not None:
            arrays["data"] = int(self.data.nbytes)
        if self._input_order is not None:
            arrays["input_order"] = int(self._input_order.nbytes)
        total = sum(arrays.values())
        host = s if self._host_structure is None else self._host_structure
        strategies = {}
        for direction, view in (("forward", host), ("transpose", host.transpose())):
            for name in (kernels.FALLBACK, *sorted(set(self.index.plans) - {kernels.FALLBACK})):
                runs = kernels.BACKENDS[name].describe(view, n_features)
                strategies.update({f"{direction}, {label}": v for label, v in runs.items()})
        kind = s.layout.kind + (" (transposed view)" if s.transposed else "")
        return PlanInfo(
            self.shape,
            self.nnz,
            kind,
            self.backends,
            arrays,
            total / self.nnz if self.nnz else float("nan"),
            strategies,
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
            self.index,
            self._input_order,
            input_order_is_columns=self._input_order_is_columns,
            host_structure=self._host_structure,
        )

    @property
    def T(self) -> CSRMatrix:  # noqa: N802 - numpy spelling
        """The transpose: the same planned arrays, viewed transposed (no host work)."""
        s = self.structure
        data = None if self.data is None else s.transpose_values(self.data)
        order = None if self._input_order is None else s.transpose_values(self._input_order)
        host = None if self._host_structure is None else self._host_structure.transpose()
        return CSRMatrix(
            data,
            self.index.transpose(),
            order,
            input_order_is_columns=self._input_order_is_columns,
            host_structure=host,
        )

    # ---------------------------------------------------------------- interop
    def todense(self, dtype: Any = None) -> jax.Array:
        """Dense ``(m, n)`` array. One-valued matrices default to float32."""
        m, n = self.shape
        if dtype is None:
            dtype = jnp.float32 if self.data is None else self.data.dtype
        rows = self.structure.row_ids()
        values = jnp.ones(self.nnz, dtype) if self.data is None else self.data.astype(dtype)
        return jnp.zeros((m, n), dtype).at[rows, self.indices].add(values)

    def to_scipy(self) -> sp.csr_array:
        """A ``scipy.sparse.csr_array`` copy (host).

        One-valued matrices get float32 ones; float16/bfloat16 values become float32
        (scipy's sparse routines take neither).

        Raises:
          ValueError: inside ``jax.jit`` (a traced matrix has no values on the host).
        """
        reject_traced(
            self,
            "the matrix",
            "to_scipy() copies it to the host. Call it outside jax.jit, on a concrete "
            "matrix (return the matrix, or its data, from the jitted function), or use "
            "todense() inside.",
        )
        if self.data is None:
            data = np.ones(self.nnz, np.float32)
        else:
            data = _host_values(self.data, "data")
            if data.dtype in (np.float16, jnp.bfloat16):
                data = data.astype(np.float32)
        return sp.csr_array(
            (data, np.asarray(self.indices), np.asarray(self.indptr)), shape=self.shape
        )

    # ----------------------------------------------------------------- matmul
    def __matmul__(self, other: Any) -> jax.Array:
        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> jax.Array:
        """``X @ A`` for ``X`` of shape ``(..., m)``: contracts X's last axis.

        Runs as a feature-major product: ``X`` is read as it is stored, one feature per
        row, and the result written the same way (the CPU kernels take that layout
        directly; other backends get ``A.T @ X.T`` between transposes). A general
        matrix's values stay in its own order (``data_transposed``): the CPU kernels read
        them through the planned permutation, other backends permute them first."""
        x = as_numeric(other, "X")
        if x.ndim == 0:
            raise ValueError("X must have rank >= 1, got a scalar (shape ())")
        if x.shape[-1] != self.shape[0]:
            raise ValueError(
                f"X.shape[-1] must equal A.shape[0] = {self.shape[0]}, got X.shape = {x.shape}"
            )
        lead = x.shape[:-1]
        rows = x.reshape(int(np.prod(lead, dtype=np.int64)), self.shape[0])
        general = self.data is not None and self.structure.layout.kind == "general"
        data = self.data if general else self.T.data
        out = ops.reduce_rows(
            rows, data, self.index.transpose(), reduce="sum", return_arg=False, impl=None,
            interpret=False, feature_major=True, data_transposed=general,
        )  # fmt: skip
        return out.reshape((*lead, self.shape[1]))

    def product(
        self, x: jax.Array, *, reduce: str, return_arg: bool, impl: str | None, interpret: bool
    ) -> Any:
        """:meth:`SparseOperand.product`: checks ``impl`` against this matrix's plans
        and dtypes, then runs :func:`jaxcsr.ops.reduce_rows`."""
        if impl is not None and impl not in self.index.plans:
            raise ValueError(
                f"impl={impl!r} needs a matrix planned for it, but this one has "
                f"backends={self.backends}; build it with backends=(..., {impl!r}), e.g. "
                f"CSRMatrix.from_indices(idx, num_rows, backends=['xla', {impl!r}])"
            )
        coverage = None if impl is None else kernels.BACKENDS[impl].coverage
        if coverage is not None and not coverage.supports(x.dtype, self.dtype):
            names = "/".join(sorted(str(d) for d in coverage.dtypes or ()))
            raise TypeError(
                f"impl={impl!r} supports {names}, got X {x.dtype} and data {self.dtype}"
            )
        return ops.reduce_rows(
            x,
            self.data,
            self.index,
            reduce=reduce,
            return_arg=return_arg,
            impl=impl,
            interpret=interpret,
        )


# --------------------------------------------------------------------- matmul
def matmul(
    A: SparseOperand,
    X: Any,
    *,
    reduce: str = "sum",
    return_arg: bool = False,
    impl: str | None = None,
    interpret: bool = False,
) -> Any:
    """Sparse x dense product ``A @ X``, or its max/min/mean semiring variant.

    ``out[i] = reduce_k data[k] * X[indices[k]]`` over the stored entries ``k`` of row
    ``i`` (duplicate entries count separately; a one-valued matrix has no multiply).

    Args:
      A: a :class:`~jaxcsr.CSRMatrix` of shape ``(m, n)``, or a
        :class:`~jaxcsr.ShardedCSR` (which takes neither ``impl`` nor ``interpret``).
      X: dense array of shape ``(n,)`` or ``(n, *features)``; float16, bfloat16,
        float32, float64 (with x64) or integer. Trailing dimensions are flattened
        into one feature axis internally.
      reduce: ``"sum"`` (the matrix product), ``"mean"`` (the sum divided by the
        row's number of stored entries; floor division for integers, as
        torch_scatter), ``"max"`` or ``"min"``. Empty rows give 0 for every reduce
        (torch_scatter's convention; ``jax.ops.segment_max`` gives ``-inf``). NaN
        propagates into every reduce.
      return_arg: with ``reduce="max"``/``"min"``, also return the column index
        attaining each output element (ties: the first stored entry of the row,
        i.e. the smallest column); empty rows get the sentinel ``n = A.shape[1]``.
      impl: ``None`` runs the platform's kernel when ``A`` carries its plan and the
        dtypes suit it (the Triton kernel on CUDA, the Mosaic kernel on TPU, for
        16/32-bit floats), else XLA; ``"xla"`` forces the XLA path;
        ``"pallas_gpu"``/``"pallas_tpu"`` force a kernel, which needs ``A`` built
        with it in ``backends=``. Every reduce runs on every impl. Rows holding at
        most one entry each (the transpose of a ``from_indices`` matrix) are a row
        gather, which XLA runs on every impl.
      interpret: run a Pallas impl in Pallas interpret mode on CPU.

    Returns:
      Array of shape ``(m,)`` or ``(m, *features)``, or ``(out, arg)`` with
      ``return_arg=True`` (``arg`` int32, same shape). The dtype is ``X.dtype`` for a
      one-valued matrix, else the promotion of ``A.dtype`` and ``X.dtype``. Sums of
      16-bit floats are accumulated in float32. Gradients: exact for ``mean``; for
      ``max``/``min`` they flow to the attaining entry only (the tie choice above).

    Raises:
      TypeError: ``X`` is not a numeric array (booleans included), complex ``X`` with
        ``reduce="max"``/``"min"``, or a kernel ``impl`` with a dtype it does not
        support.
      ValueError: ``X`` has rank 0 or ``X.shape[0] != A.shape[1]``; unknown ``impl``
        or ``reduce``; a kernel ``impl`` whose plan ``A`` does not carry (build it
        with ``backends=``); ``return_arg`` with a reduce other than max/min.
      NotImplementedError: (when traced) a Pallas impl on a platform it does not
        target, without ``interpret=True``.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> from jaxcsr import CSRMatrix, matmul
      >>> A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0]), num_rows=4)
      >>> matmul(A, jnp.arange(5.0))
      Array([4., 3., 3., 0.], dtype=float32)
      >>> matmul(A, jnp.arange(5.0), reduce="max", return_arg=True)
      (Array([4., 3., 2., 0.], dtype=float32), Array([4, 3, 2, 5], dtype=int32))
    """
    if not isinstance(A, SparseOperand):
        raise TypeError(f"A must be a jaxcsr.CSRMatrix or ShardedCSR, got {type(A).__name__}")
    _check_options(reduce, return_arg, impl, interpret)
    if isinstance(X, SparseOperand):
        raise TypeError("X must be a dense array; sparse @ sparse is not supported")
    X = as_numeric(X, "X")
    if X.ndim == 0:
        raise ValueError("X must have rank >= 1, got a scalar (shape ())")
    if reduce in EXTREMES and (
        jnp.issubdtype(X.dtype, jnp.complexfloating)
        or (A.dtype is not None and jnp.issubdtype(A.dtype, jnp.complexfloating))
    ):
        raise TypeError(f"reduce={reduce!r} needs real dtypes, got X {X.dtype}, A {A.dtype}")
    m, n = A.shape
    if X.shape[0] != n:
        raise ValueError(
            f"X.shape[0] must equal A.shape[1] = {n}{A.operand_hint()}, got X.shape = {X.shape}"
        )
    features = X.shape[1:]
    x2 = X.reshape(n, int(np.prod(features, dtype=np.int64)))
    result = A.product(x2, reduce=reduce, return_arg=return_arg, impl=impl, interpret=interpret)
    if not return_arg:
        return result.reshape((m, *features))
    out, arg = result
    return out.reshape((m, *features)), arg.reshape((m, *features))


def _check_options(reduce: str, return_arg: bool, impl: str | None, interpret: bool) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not isinstance(return_arg, bool):
        raise TypeError(f"return_arg must be a bool, got {return_arg!r}")
    if return_arg and reduce not in EXTREMES:
        raise ValueError(f"return_arg=True needs reduce='max' or 'min', got {reduce!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {tuple(IMPLS)}, got {impl!r}")
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {interpret!r}")
