"""Float64 references and random structures shared by the test modules."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.test_util import check_grads

import jaxcsr
from jaxcsr import CSRMatrix

ALL = ("xla", "pallas_gpu", "pallas_tpu")
"""Every backend: what tests that run the kernels in interpret mode plan for."""

GPU_INTERPRET = jax.default_backend() != "gpu"
"""``interpret`` for ``impl="pallas_gpu"`` in tests: compiled Triton on a CUDA machine
(``benchmarks/hardware/gpu_session.sh`` runs the kernel tests there), interpret mode
elsewhere."""


TPU_INTERPRET = jax.default_backend() != "tpu"
"""``interpret`` for ``impl="pallas_tpu"`` in tests: compiled Mosaic on a TPU machine
(``benchmarks/hardware/tpu_session.sh`` runs the kernel tests there), interpret mode
elsewhere."""


def interpret_for(impl: str) -> bool:
    """``interpret`` for a kernel backend in tests: compiled on its own platform,
    interpret mode elsewhere."""
    return {"pallas_gpu": GPU_INTERPRET, "pallas_tpu": TPU_INTERPRET}.get(impl, True)


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


SEGMENT_FUNCTIONS = {
    "sum": jaxcsr.segment_sum,
    "mean": jaxcsr.segment_mean,
    "max": functools.partial(jaxcsr.segment_max, empty=0),
    "min": functools.partial(jaxcsr.segment_min, empty=0),
}
"""``jaxcsr.segment_<reduce>`` with empty max/min segments 0, as :func:`segment_reference`
gives them."""


def segment_reference(values, ids: np.ndarray, m: int, reduce: str = "sum") -> np.ndarray:
    """Float64 ``reduce`` of ``values`` over segments ``ids`` along axis 0; empty ones 0."""
    values = np.asarray(values).astype(np.float64)
    ufunc = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[reduce]
    out = np.full((m, *values.shape[1:]), {"max": -np.inf, "min": np.inf}.get(reduce, 0.0))
    ufunc.at(out, ids, values)
    counts = np.bincount(ids, minlength=m).reshape(-1, *[1] * (values.ndim - 1))
    if reduce == "mean":
        out = out / np.maximum(counts, 1)
    return np.where(counts > 0, out, 0.0)


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


def assert_close(actual, expected, dtype, err_msg: str = "") -> None:
    """Compares against a float64 reference, relative to the reference's scale."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape, err_msg)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(
        actual, expected, rtol=0, atol=tolerance(dtype) * scale, err_msg=err_msg
    )


def assert_sums_close(actual, expected, abs_sums, dtype) -> None:
    """Compares sums against a float64 reference, each within the dtype's tolerance of
    the absolute sum of its terms (``abs_sums``, same shape): a sum accumulated in
    float32 errs in proportion to its terms, not to its result, which long rows of
    terms that cancel make small."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape == np.shape(abs_sums)
    bound = tolerance(dtype) * np.maximum(1.0, np.asarray(abs_sums, np.float64))
    worst = np.argmax(np.abs(actual - expected) - bound)
    assert np.all(np.abs(actual - expected) <= bound), (
        np.unravel_index(worst, actual.shape),
        actual.flat[worst],
        expected.flat[worst],
        bound.flat[worst],
    )


def dense_of(A) -> np.ndarray:
    """A CSRMatrix as a float64 numpy array (through scipy, not through jaxcsr's todense)."""
    return A.to_scipy().toarray().astype(np.float64)


def check_product_grads(f, args, order: int = 1) -> None:
    """``check_grads`` in fwd and rev modes at the tolerances float32 products need."""
    check_grads(f, args, order=order, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2, eps=1e-2)


def assert_kernel_grads(matmul, rng: np.random.Generator, m: int, n: int) -> None:
    """Gradients through ``matmul(A, x)`` on a power-law matrix: the X cotangent against
    the float64 ``A.T @ ct``, and numerical checks w.r.t. both the values and X."""
    A = CSRMatrix.from_scipy(random_csr(rng, m, n, "power_law"), backends=ALL)
    x = jnp.asarray(random_values(rng, (n, 3)), jnp.float32)
    ct = random_values(rng, (m, 3)).astype(np.float32)
    g = jax.grad(lambda x: jnp.sum(matmul(A, x) * ct))(x)
    assert_close(g, dense_of(A).T @ ct.astype(np.float64), np.float32)
    check_product_grads(lambda w, x: matmul(A.with_data(w), x), (A.data, x))


def reduce_reference(A, x: np.ndarray, reduce: str) -> tuple[np.ndarray, np.ndarray]:
    """Float64 ``reduce_k data[k] * x[col_k]`` per row, from A's CSR arrays in order.

    Empty rows are 0 (arg: ``n``); ties go to the first entry in CSR order; NaN
    propagates (its arg is the first NaN). ``x`` is ``(n, F)``.
    Returns ``(out (m, F), arg (m, F))`` where ``arg`` is the attaining column.
    """
    m, n = A.shape
    indptr, indices = np.asarray(A.indptr), np.asarray(A.indices)
    x = np.asarray(x, np.float64)
    vals = x[indices]  # (nnz, F) in CSR order
    if A.data is not None:
        vals = vals * np.asarray(A.data, np.float64)[:, None]
    counts = np.diff(indptr)
    rows = np.repeat(np.arange(m), counts)
    out = np.zeros((m, x.shape[1]))
    arg = np.full((m, x.shape[1]), n)
    if reduce in ("sum", "mean"):
        with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as intended
            np.add.at(out, rows, vals)
            if reduce == "mean":
                out /= np.maximum(counts, 1)[:, None]
        return out, arg
    # max/min: the first NaN of a row if it has one, else the first entry attaining
    # the extreme (CSR order)
    nnz = vals.shape[0]
    position = np.broadcast_to(np.arange(nnz)[:, None], vals.shape)
    nan = np.isnan(vals)
    fill, extreme = (-np.inf, np.maximum) if reduce == "max" else (np.inf, np.minimum)
    peak = np.full(out.shape, fill)
    extreme.at(peak, rows, np.where(nan, fill, vals))
    first = np.full(out.shape, nnz)
    np.minimum.at(first, rows, np.where(~nan & (vals == peak[rows]), position, nnz))
    first_nan = np.full(out.shape, nnz)
    np.minimum.at(first_nan, rows, np.where(nan, position, nnz))
    chosen = np.where(first_nan < nnz, first_nan, first)
    hit = chosen < nnz  # rows with entries
    features = np.broadcast_to(np.arange(x.shape[1]), out.shape)
    out[hit] = vals[chosen[hit], features[hit]]
    arg[hit] = indices[chosen[hit]]
    return out, arg


def entry_rows(A) -> np.ndarray:
    """The row of every stored entry of ``A`` (a CSRMatrix), in its CSR order."""
    mat = A.to_scipy().tocsr()
    return np.repeat(np.arange(mat.shape[0]), np.diff(mat.indptr))


def softmax_reference(scores, rows: np.ndarray, m: int) -> np.ndarray:
    """Float64 max-shifted softmax of ``scores`` (``(k, ...)``) within each row id;
    entries whose id is outside ``[0, m)`` belong to no row and get 0 (dropped)."""
    s = np.asarray(jnp.asarray(scores, jnp.float32), np.float64)
    keep = (rows >= 0) & (rows < m)
    r = np.where(keep, rows, 0)
    peak = np.full((m, *s.shape[1:]), -np.inf)
    np.maximum.at(peak, r[keep], s[keep])
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(s - peak[r])
    total = np.zeros_like(peak)
    np.add.at(total, r[keep], e[keep])
    with np.errstate(invalid="ignore", divide="ignore"):
        out = e / total[r]
    out[~keep] = 0.0
    return out


def logsumexp_reference(scores, rows: np.ndarray, m: int) -> np.ndarray:
    """Float64 ``log(sum(exp(scores)))`` per row id (``(m, ...)``); entries whose id is
    outside ``[0, m)`` are dropped; empty rows are 0."""
    s = np.asarray(jnp.asarray(scores, jnp.float32), np.float64)
    keep = (rows >= 0) & (rows < m)
    total = np.zeros((m, *s.shape[1:]))
    np.add.at(total, rows[keep], np.exp(s[keep]))
    counts = np.bincount(rows[keep], minlength=m).reshape((m,) + (1,) * (s.ndim - 1))
    return np.where(counts > 0, np.log(np.where(counts > 0, total, 1)), 0.0)


def softmax_grad_reference(p: np.ndarray, g, rows: np.ndarray, m: int) -> np.ndarray:
    """Float64 ``p * (g - rowsum(p * g)[row])``; dropped entries (ids outside
    ``[0, m)``) get 0."""
    g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
    keep = (rows >= 0) & (rows < m)
    r = np.where(keep, rows, 0)
    inner = np.zeros((m, *p.shape[1:]))
    np.add.at(inner, r[keep], (p * g)[keep])
    out = p * (g - inner[r])
    out[~keep] = 0.0
    return out
