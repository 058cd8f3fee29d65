"""Argument checks shared by every public entry point: ids, sizes, shapes, dtypes, traces.

Every check runs before any planning or device work and raises a ``TypeError`` or
``ValueError`` that names the argument as the caller spelled it. Traced values are
recognised by type (``jax.core.Tracer``), never by an exception's text.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "INT32_SIZE_LIMIT",
    "as_host_int_array",
    "as_numeric",
    "check_coo",
    "check_csr_arrays",
    "check_index_range",
    "check_numeric_dtype",
    "check_range",
    "check_segment_ids",
    "check_shape",
    "check_size",
    "check_traced_ids",
    "is_traced",
    "reject_traced",
]

INT32_SIZE_LIMIT = 2**31 - 1
"""Sizes (rows, columns, stored entries) from here on need int64 indices."""

STATIC_IDS_ADVICE = (
    "this constructor plans on the host and needs concrete arrays. Build the matrix "
    "outside jax.jit and pass it in as an argument (it is a pytree), or use a "
    "constructor that plans traced ids on the device: CSRMatrix.from_indices, "
    "CSRMatrix.from_coo and every jaxcsr.segment_* function accept traced ids."
)
"""What to do instead of passing traced ids (the advice of :func:`as_host_int_array`)."""


# ------------------------------------------------------------------ traced values
def is_traced(value: Any) -> bool:
    """Whether ``value`` (or any leaf of it, for a pytree) is a JAX tracer."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(value))


def reject_traced(value: Any, name: str, advice: str) -> None:
    """Raises ``ValueError("<name> is a traced JAX value; <advice>")`` for a traced value."""
    if is_traced(value):
        raise ValueError(f"{name} is a traced JAX value; {advice}")


# -------------------------------------------------------------------------- sizes
def check_size(value: Any, name: str) -> int:
    """Validates a size argument: a non-negative int (bools rejected), named in errors."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be an int, got the bool {value!r}")
    if is_traced(value):
        raise TypeError(
            f"{name} is a traced JAX value; it sets an array shape, so it must be a "
            "Python int known at trace time (pass it as a static argument, or read it "
            "from a shape)"
        )
    try:
        size = operator.index(value)
    except TypeError as err:
        raise TypeError(f"{name} must be an int, got {value!r}") from err
    if size < 0:
        raise ValueError(f"{name} must be >= 0, got {size}")
    return size


def check_index_range(size: int, name: str) -> int:
    """Rejects a size that needs int64 indices while JAX runs without 64-bit types
    (JAX would truncate the indices to int32), before anything is allocated."""
    if size >= INT32_SIZE_LIMIT and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"{name} = {size} needs 64-bit indices (sizes must be < 2**31 - 1 = "
            f"{INT32_SIZE_LIMIT} with int32 indices); enable jax_enable_x64 for int64 "
            "indices, or split the matrix"
        )
    return size


def check_shape(shape: Any) -> tuple[int, int]:
    """Validates a 2-D matrix shape."""
    try:
        m, n = shape
    except (TypeError, ValueError) as err:
        raise ValueError(f"shape must be a pair (rows, cols), got {shape!r}") from err
    m, n = check_size(m, "shape[0]"), check_size(n, "shape[1]")
    return check_index_range(m, "shape[0]"), check_index_range(n, "shape[1]")


# ------------------------------------------------------------------------- dtypes
def check_numeric_dtype(dtype, name: str, *, floating: bool = False) -> None:
    """Raises a ``TypeError`` naming ``name`` for a dtype that is not a number (strings,
    objects, booleans), or not floating with ``floating=True``."""
    dtype = np.dtype(dtype)
    kind = "floating" if floating else "numeric"
    if dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.floating if floating else jnp.number):
        raise TypeError(f"{name} must have a {kind} dtype, got {dtype}")


def as_numeric(value: Any, name: str, *, floating: bool = False) -> jax.Array:
    """``value`` as a JAX array (may be traced), after :func:`check_numeric_dtype` (which
    reads the dtype without converting a JAX or numpy array first). Anything else that
    numpy cannot make a numeric array of (a ragged list, a sparse matrix) raises a
    ``TypeError`` naming ``name``."""
    if not isinstance(value, jax.Array | np.ndarray | np.generic):  # tracers are jax.Arrays
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"{name} must be an array of numbers, got {type(value).__name__} ({err})"
            ) from err
    check_numeric_dtype(value.dtype, name, floating=floating)
    return jnp.asarray(value)


# ---------------------------------------------------------------------- index ids
def as_host_int_array(value: Any, name: str, advice: str = STATIC_IDS_ADVICE) -> np.ndarray:
    """Converts ``value`` to a host numpy integer array or raises a named error.

    A traced value raises ``ValueError`` with ``advice``. An empty list or tuple is an
    empty int32 array (as ``jax.ops`` accepts).
    """
    reject_traced(value, name, advice)
    try:
        arr = np.asarray(value)
    except Exception as err:  # ragged lists and other non-arrays
        raise TypeError(
            f"{name} must be an array of integers, got {type(value).__name__} ({err})"
        ) from err
    if arr.size == 0 and arr.dtype == np.float64 and not isinstance(value, np.ndarray):
        arr = arr.astype(np.int32)
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of integers, got dtype object")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    return arr


def check_traced_ids(value: Any, name: str) -> jax.Array:
    """Validates traced index ids at trace time (their values are not known): an
    integer dtype (``TypeError``) and rank 1 (``ValueError``). Returns the array."""
    dtype = np.dtype(value.dtype)
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {dtype}")
    if value.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {value.shape}")
    check_index_range(value.shape[0], f"len({name})")
    return value


def check_range(arr: np.ndarray, bound: int, name: str, bound_name: str) -> None:
    """Every entry of the host array ``arr`` in ``[0, bound)``; names the first that is not."""
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
    check_range(arr, num_rows, idx_name, size_name)
    return arr, num_rows


def check_coo(row: Any, col: Any, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Validates COO coordinates of a validated ``shape``; returns host arrays."""
    m, n = shape
    row = as_host_int_array(row, "row")
    col = as_host_int_array(col, "col")
    if row.ndim != 1 or col.ndim != 1:
        raise ValueError(f"row and col must be 1-D, got shapes {row.shape} and {col.shape}")
    if row.shape != col.shape:
        raise ValueError(f"row and col must have the same length, got {row.size} and {col.size}")
    check_index_range(row.size, "len(row)")
    check_range(row, m, "row", "shape[0]")
    check_range(col, n, "col", "shape[1]")
    return row, col


def check_csr_arrays(
    indptr: Any, indices: Any, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Validates raw CSR index arrays (as scipy's ``check_format`` does).

    Returns them as host arrays of their input dtype.

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
    check_range(indices, n, "indices", "shape[1]")
    return indptr, indices
