"""The sampled dense-dense product (SDDMM): ``X @ Y.T`` at the stored entries of ``A``.

``jaxcsr.sddmm(A, X, Y)[k] = sum_f X[i_k, f] * Y[j_k, f]`` for the ``k``-th stored
entry ``(i_k, j_k)`` of ``A`` in its CSR order -- the attention scores of graph
attention, and what ``A.with_data(...)`` takes back. Its transposes are the two
products jaxcsr already plans: ``dX = A.with_data(g) @ Y`` and ``dY = A.with_data(g).T
@ X``, so the backward runs the platform's product path (a custom VJP).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcsr.kernels import xla as xla_kernels
from jaxcsr.matrix import CSRMatrix

__all__ = ["sddmm"]


def sddmm(A: CSRMatrix, X: Any, Y: Any) -> jax.Array:
    """Per stored entry ``(i, j)`` of ``A`` (CSR order): ``sum_f X[i, f] * Y[j, f]``.

    Args:
      A: the sparsity pattern (its values are not used: multiply by ``A.data`` to
        weight).
      X: ``(m, F)``, or ``(m, H, F)`` for ``H`` heads.
      Y: ``(n, F)``, or ``(n, H, F)``.

    Returns:
      ``(nnz,)``, or ``(nnz, H)``, in the promoted dtype of ``X`` and ``Y`` (sums in
      float32 for 16-bit floats). Differentiable in ``X`` and ``Y``.

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
    X, Y = jnp.asarray(X), jnp.asarray(Y)
    for name, v in (("X", X), ("Y", Y)):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {v.dtype}")
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
    pattern = A.with_data(jnp.ones((A.nnz,), jnp.result_type(X.dtype, Y.dtype)))
    if X.ndim == 2:
        return _sddmm(pattern, X, Y)
    return jax.vmap(_sddmm, in_axes=(None, 1, 1), out_axes=1)(pattern, X, Y)


@jax.custom_vjp
def _sddmm(pattern: CSRMatrix, X: jax.Array, Y: jax.Array) -> jax.Array:
    out_dtype = jnp.result_type(X.dtype, Y.dtype)
    return xla_kernels.sddmm(X, Y, pattern.structure, out_dtype=out_dtype)


def _sddmm_fwd(pattern, X, Y):
    return _sddmm(pattern, X, Y), (pattern, X, Y)


def _sddmm_bwd(residuals, g):
    pattern, X, Y = residuals
    weighted = pattern.with_data(g.astype(pattern.data.dtype))
    dX = (weighted @ Y).astype(X.dtype)
    dY = (weighted.T @ X).astype(Y.dtype)
    return _zero_cotangent(pattern), dX, dY


def _zero_cotangent(tree):
    """Zero cotangents for a matrix's leaves (float0 for its integer arrays)."""

    def zero(leaf):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            return jnp.zeros_like(leaf)
        return np.zeros(leaf.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(zero, tree)


_sddmm.defvjp(_sddmm_fwd, _sddmm_bwd)
