"""Regression tests for what a new user tripped on (each failed before its fix)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from reference import ALL, power_law_ids, random_values

import jaxcsr
from jaxcsr import CSRMatrix

INT8 = (jnp.int8, [100, 100, 7], [100, 7])  # the int8 sum 200 overflowed to -28
F16 = (jnp.float16, [40000.0, 40000.0, 1.5], [40000.0, 1.5])  # the f16 sum was inf


@pytest.mark.parametrize(
    "dtype,values,expected,impl,interpret",
    [(*INT8, "xla", False), (*F16, "xla", False), (*F16, "pallas_gpu", True)],
)
def test_mean_divides_before_rounding(dtype, values, expected, impl, interpret):
    A = CSRMatrix.from_indices(np.array([0, 0, 1]), num_rows=2, backends=ALL)
    x = jnp.asarray(values, dtype)
    out = jaxcsr.matmul(A, x, reduce="mean", impl=impl, interpret=interpret)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-2)
    seg = jaxcsr.segment_mean(x, np.array([0, 0, 1]), 2)
    np.testing.assert_array_equal(np.asarray(seg), np.asarray(out))


def test_from_scipy_coo_keeps_duplicates(rng):
    row = np.array([0, 0, 1, 0, 2])
    col = np.array([1, 1, 0, 1, 2])  # (0, 1) three times
    vals = random_values(rng, (5,)).astype(np.float32)
    coo = sp.coo_array((vals, (row, col)), shape=(3, 3))
    A = CSRMatrix.from_scipy(coo)
    B = CSRMatrix.from_coo(row, col, vals, shape=(3, 3))
    C = CSRMatrix.from_scipy(sp.csr_array((vals, (row, col)), shape=(3, 3)))  # summed by scipy
    assert A.nnz == B.nnz == 5 and C.nnz == 3
    x = jnp.asarray(random_values(rng, (3, 2)).astype(np.float32))
    for reduce in ("mean", "max", "sum"):
        np.testing.assert_allclose(
            np.asarray(jaxcsr.matmul(A, x, reduce=reduce)),
            np.asarray(jaxcsr.matmul(B, x, reduce=reduce)),
            rtol=1e-6,
        )
    np.testing.assert_allclose(np.asarray(A.todense()), coo.toarray(), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_to_scipy_of_16_bit_values_is_usable(rng, dtype):
    vals = random_values(rng, (4,))
    A = CSRMatrix.from_coo([0, 1, 1, 2], [2, 0, 1, 2], jnp.asarray(vals, dtype), shape=(3, 3))
    mat = A.to_scipy()
    assert mat.dtype == np.float32
    expected = np.zeros((3, 3))
    expected[[0, 1, 1, 2], [2, 0, 1, 2]] = np.asarray(jnp.asarray(vals, dtype), np.float64)
    np.testing.assert_array_equal(mat.toarray(), expected.astype(np.float32))
    assert (mat @ np.ones(3)).shape == (3,)


@pytest.mark.parametrize("n_features,reduce", [(32, "max"), (64, "min")])
def test_tpu_kernel_keeps_nan_at_wide_features(rng, reduce, n_features):
    """XLA:CPU's vectorised max over a (128, F >= 32) tile dropped a NaN in interpret
    mode; the kernel now propagates NaN by an explicit count."""
    idx = power_law_ids(rng, 200, 9)
    x = random_values(rng, (200, n_features)).astype(np.float32)
    x[np.flatnonzero(idx == idx[0])[0], 5] = np.nan
    x[np.flatnonzero(idx == idx[-1])[-1], n_features - 1] = np.nan
    A = CSRMatrix.from_indices(idx, num_rows=9, backends=ALL)
    out = np.asarray(
        jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="pallas_tpu", interpret=True)
    )
    xla = np.asarray(jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="xla"))
    assert np.isnan(out[idx[0], 5]) and np.isnan(out[idx[-1], n_features - 1])
    np.testing.assert_array_equal(out, xla)  # NaN where XLA has NaN, equal elsewhere


def test_sizes_reject_bools_and_floats():
    with pytest.raises(TypeError, match="num_rows must be an int, got the bool True"):
        CSRMatrix.from_indices(np.array([0, 0]), num_rows=True)
    ids = np.array([0, 1, 1])
    jaxcsr.segment_sum(jnp.ones(3), ids, 2)  # caches the matrix under num_segments=2
    with pytest.raises(TypeError, match=r"num_segments must be an int, got 2\.0"):
        jaxcsr.segment_sum(jnp.ones(3), ids, 2.0)
    with pytest.raises(TypeError, match="num_segments must be an int"):
        jaxcsr.segment_sum(jnp.ones(3), ids, False)


def test_empty_sequences_are_empty_ids():
    A = CSRMatrix.from_indices([], num_rows=3)
    assert A.shape == (3, 0)
    np.testing.assert_array_equal(np.asarray(A @ jnp.zeros((0, 2))), np.zeros((3, 2)))
    out = jaxcsr.segment_sum(jnp.zeros((0,)), [], 3)
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(jax.ops.segment_sum(jnp.zeros((0,)), jnp.zeros((0,), int), 3))
    )
    with pytest.raises(TypeError, match="integer dtype, got float64"):
        CSRMatrix.from_indices(np.array([0.0, 1.0]), num_rows=3)  # a float array still fails


X64_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, jaxcsr
    from jax.test_util import check_grads
    from jaxcsr import CSRMatrix
    assert jax.config.jax_enable_x64
    rng = np.random.default_rng(0)
    ALL = ("xla", "pallas_gpu", "pallas_tpu")
    idx = rng.integers(0, 7, 60)
    A = CSRMatrix.from_indices(idx, num_rows=7, backends=ALL)
    x32 = rng.uniform(-2, 2, (60, 3)).astype(np.float32)
    for reduce in ("max", "min"):
        # the x64 default dtype used to leak into the GPU kernel's output buffer
        out = jaxcsr.matmul(A, jnp.asarray(x32), reduce=reduce, impl="pallas_gpu", interpret=True)
        ref = jaxcsr.matmul(A, jnp.asarray(x32), reduce=reduce, impl="xla")
        assert out.dtype == np.float32, out.dtype
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
        seg = jaxcsr.segment_max if reduce == "max" else jaxcsr.segment_min
        np.testing.assert_array_equal(np.asarray(seg(jnp.asarray(x32), idx, 7)), np.asarray(ref))
    # float64 mean/max/min and their gradients against float64 numpy
    x = rng.uniform(-2, 2, (60, 3))
    for reduce in ("mean", "max", "min"):
        out = np.asarray(jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce))
        assert out.dtype == np.float64
        for r in range(7):
            rows = x[idx == r]
            want = {"mean": rows.mean(0), "max": rows.max(0), "min": rows.min(0)}[reduce]
            np.testing.assert_allclose(out[r], want if len(rows) else 0.0, rtol=1e-12)
        check_grads(lambda v: jaxcsr.matmul(A, v, reduce=reduce), (jnp.asarray(x),), 1, eps=1e-6)
    print("ok")
    """
)


def test_x64_kernels_and_float64_reductions():
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", X64_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
