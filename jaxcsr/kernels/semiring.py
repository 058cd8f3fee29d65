"""Per-entry products and empty rows: what the max/min semirings share across backends.

A max or min compares the products ``data[k] * x[indices[k]]`` themselves, so every
backend forms them the same way (16-bit products in float32, rounded once), and the
entry that attains a kernel's max is found again by comparing equal values
(:mod:`jaxcsr.kernels.xla`'s arg search). Rows that store no entry are 0 for every
reduction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcsr.dtypes import accumulation_dtype, product_dtype
from jaxcsr.structure import Structure

__all__ = ["column_values", "entry_values", "weighted", "zero_empty_rows"]


def weighted(values: jax.Array, weights: jax.Array | None, dtype) -> jax.Array:
    """``weights[:, None] * values`` in ``dtype`` (``values`` alone without weights).

    Products of 16-bit floats are formed in float32 and rounded once, as the Pallas
    kernels do, so comparing them with a kernel's max is exact.
    """
    if weights is None:
        return values.astype(dtype)
    acc = accumulation_dtype(dtype)
    return (weights.astype(acc)[:, None] * values.astype(acc)).astype(dtype)


def entry_values(x: jax.Array, data: jax.Array | None, structure: Structure) -> jax.Array:
    """``data[k] * x[indices[k]]`` for every stored entry ``k`` (CSR order), ``(nnz, F)``."""
    dtype = product_dtype(x.dtype, None if data is None else data.dtype)
    return weighted(x[structure.view_indices()], data, dtype)


def column_values(x: jax.Array, data: jax.Array | None, structure: Structure) -> jax.Array:
    """One-per-column view: ``data_j * x[j]`` in column (input) order, ``(n, F)``.

    No gather: column ``j``'s value multiplies X's row ``j`` (0 for empty columns).
    """
    dtype = product_dtype(x.dtype, None if data is None else data.dtype)
    weights = None if data is None else structure.column_values(data)
    return weighted(x, weights, dtype)


def zero_empty_rows(out: jax.Array, structure: Structure) -> jax.Array:
    """``out`` with the rows that store no entry set to 0 (max/min's empty rows).

    ``out`` holds the reduction's identity (``-inf``/``+inf``) in empty rows. A
    structure planned on the device has no stored degrees, and finding the non-empty
    rows costs a pass over the ids, so it is paid only when some output is infinite
    (an empty row, or a row of infinities); otherwise ``out`` is returned as is.
    """

    def zeroed():
        return jnp.where(structure.nonempty_rows()[:, None], out, jnp.zeros((), out.dtype))

    if not structure.layout.padded:
        return zeroed()
    if not jnp.issubdtype(out.dtype, jnp.floating):  # integer identities are finite
        return zeroed()
    return jax.lax.cond(jnp.any(jnp.isinf(out)), zeroed, lambda: out)
