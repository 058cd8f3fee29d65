"""The sampled dense-dense product (SDDMM): ``X @ Y.T`` at the stored entries of ``A``.

``jaxcsr.sddmm(A, X, Y)[k] = sum_f X[i_k, f] * Y[j_k, f]`` for the ``k``-th stored
entry ``(i_k, j_k)`` of ``A`` in its CSR order -- the attention scores of graph
attention, and what ``A.with_data(...)`` takes back. Its transposes are the two
products jaxcsr already plans: ``dX = A.with_data(g) @ Y`` and ``dY = A.with_data(g).T
@ X``. It is a primitive, ``sddmm_p``, defined with all its rules in :mod:`jaxcsr.ops`
beside the product (each is the other's transpose: the product's values' gradient is
this, and this transposes into two products), so forward mode, reverse mode (the
backward runs the platform's product path) and higher orders all work. ``vmap`` folds
the batch into the heads axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcsr.matrix import CSRMatrix
from jaxcsr.ops import sample, sddmm_p
from jaxcsr.validation import as_numeric

__all__ = ["sddmm", "sddmm_p"]


def sddmm(A: CSRMatrix, X: Any, Y: Any) -> jax.Array:
    """Per stored entry ``(i, j)`` of ``A`` (CSR order): ``sum_f X[i, f] * Y[j, f]``.

    Args:
      A: the sparsity pattern (its values are not used: multiply by ``A.data`` to
        weight).
      X: ``(m, F)``, or ``(m, H, F)`` for ``H`` heads.
      Y: ``(n, F)``, or ``(n, H, F)``.

    Returns:
      ``(nnz,)``, or ``(nnz, H)``, in the promoted dtype of ``X`` and ``Y`` (sums in
      float32 for 16-bit floats). Differentiable in ``X`` and ``Y`` in forward and
      reverse mode, to any order.

    Raises:
      TypeError: ``A`` not a CSRMatrix; non-floating ``X``/``Y``.
      ValueError: shapes that do not match ``A`` or each other.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> A = jaxcsr.CSRMatrix.from_dense(np.array([[1.0, 0.0], [1.0, 1.0]]))
      >>> jaxcsr.sddmm(A, jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.eye(2)).tolist()
      [1.0, 3.0, 4.0]
    """
    if not isinstance(A, CSRMatrix):
        raise TypeError(f"A must be a jaxcsr.CSRMatrix, got {type(A).__name__}")
    X, Y = as_numeric(X, "X", floating=True), as_numeric(Y, "Y", floating=True)
    for name, v in (("X", X), ("Y", Y)):
        if v.ndim not in (2, 3):
            raise ValueError(f"{name} must be (rows, F) or (rows, H, F), got shape {v.shape}")
    m, n = A.shape
    if X.shape[0] != m or Y.shape[0] != n:
        raise ValueError(
            f"X.shape[0] must be A.shape[0] = {m} and Y.shape[0] A.shape[1] = {n}, "
            f"got X {X.shape}, Y {Y.shape}"
        )
    if X.shape[1:] != Y.shape[1:]:
        raise ValueError(f"X and Y must agree past the first axis, got {X.shape}, {Y.shape}")
    out_dtype = jnp.result_type(X.dtype, Y.dtype)
    if X.ndim == 2:
        return _bind(X[:, None], Y[:, None], A, out_dtype)[:, 0]
    return _bind(X, Y, A, out_dtype)


def _bind(x, y, A: CSRMatrix, out_dtype) -> jax.Array:
    """``(nnz, H)`` scores of ``x`` ``(m, H, F)`` and ``y`` ``(n, H, F)`` at ``A``'s entries."""
    return sample(x, y, A.index, out_dtype=out_dtype)
