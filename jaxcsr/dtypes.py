"""dtype rules shared by every backend: what a product returns and what it sums in.

* A product's dtype is ``X.dtype`` for a one-valued matrix, else the promotion of the
  matrix's and ``X``'s dtypes (:func:`product_dtype`).
* Sums are carried in :func:`accumulation_dtype`: float32 for 16-bit floats, int32
  for 8/16-bit integers, the dtype itself otherwise; the result is cast back once.
* The Pallas kernels take :data:`KERNEL_DTYPES` (16/32-bit floats).
* Argument dtypes are checked in :mod:`jaxcsr.validation`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["KERNEL_DTYPES", "accumulation_dtype", "product_dtype"]

KERNEL_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(jnp.bfloat16),
)
"""dtypes the Pallas kernels are written for (values and dense operand)."""


def product_dtype(x_dtype, data_dtype) -> np.dtype:
    """dtype of ``data * x`` (of ``x`` for a one-valued matrix, ``data_dtype=None``)."""
    if data_dtype is None:
        return np.dtype(x_dtype)
    return np.dtype(jnp.result_type(data_dtype, x_dtype))


def accumulation_dtype(dtype) -> np.dtype:
    """The dtype sums are carried in: float32 for 16-bit floats, int32 for small ints."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    if jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4:
        return np.dtype(np.int32)
    return dtype
