"""Float64 references and random structures shared by the test modules."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def random_values(rng: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    """Random values away from 0 and 1 (never all zeros, never all ones)."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-9, 10, size=shape).astype(dtype)
    return rng.uniform(-2.0, 2.0, size=shape).astype(np.float64)


def power_law_ids(rng: np.random.Generator, size: int, num_rows: int) -> np.ndarray:
    """Segment ids with skewed (Zipf-like) row lengths and some empty rows."""
    weights = 1.0 / np.arange(1, num_rows + 1) ** 1.3
    weights[rng.choice(num_rows, size=max(1, num_rows // 5), replace=False)] = 0.0
    if weights.sum() == 0:
        weights[0] = 1.0
    perm = rng.permutation(num_rows)
    return perm[rng.choice(num_rows, size=size, p=weights / weights.sum())]


def random_csr(rng: np.random.Generator, m: int, n: int, kind: str) -> sp.csr_array:
    """Random structures: 'uniform', 'power_law' (skewed rows), 'empty_rows', 'empty'."""
    if kind == "empty" or m == 0 or n == 0:
        return sp.csr_array((m, n), dtype=np.float64)
    if kind == "uniform":
        nnz = max(1, int(0.1 * m * n))
        rows = rng.integers(0, m, nnz)
    elif kind == "power_law":
        nnz = max(1, int(0.15 * m * n))
        rows = power_law_ids(rng, nnz, m)
    elif kind == "empty_rows":
        nnz = max(1, int(0.1 * m * n))
        rows = rng.choice(rng.choice(m, size=max(1, m // 3), replace=False), size=nnz)
    else:
        raise ValueError(kind)
    cols = rng.integers(0, n, rows.size)
    data = rng.uniform(-2, 2, rows.size)
    mat = sp.coo_array((data, (rows, cols)), shape=(m, n)).tocsr()
    mat.sum_duplicates()
    return mat


TOLERANCES = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 2e-5,
    np.dtype(np.float16): 2e-2,
}


def tolerance(dtype) -> float:
    import jax.numpy as jnp

    dtype = np.dtype(dtype)
    if dtype == jnp.bfloat16:
        return 5e-2
    return TOLERANCES.get(dtype, 0.0)


def assert_close(actual, expected, dtype) -> None:
    """Compares against a float64 reference, relative to the reference's scale."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance(dtype) * scale)
