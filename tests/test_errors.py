"""Bad input raises a named ValueError/TypeError before any device work."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from reference import ALL

import jaxcsr
from jaxcsr import CSRMatrix


@pytest.mark.parametrize(
    "idx,num_rows,error,match",
    [
        ([0, 3, 1], 3, ValueError, r"idx must be < num_rows = 3; idx\[1\] = 3"),
        ([0, -1, 1], 3, ValueError, r"idx must be >= 0; idx\[1\] = -1"),
        ([0.0, 1.0], 3, TypeError, "idx must have an integer dtype, got float64"),
        ([True, False], 3, TypeError, "idx must have an integer dtype, got bool"),
        ([[0, 1]], 3, ValueError, r"idx must be 1-D, got shape \(1, 2\)"),
        ([0, 1], -2, ValueError, "num_rows must be >= 0, got -2"),
        ([0, 1], 2.5, TypeError, "num_rows must be an int, got 2.5"),
    ],
)
def test_from_indices_bad_input(idx, num_rows, error, match):
    with pytest.raises(error, match=match):
        CSRMatrix.from_indices(np.asarray(idx), num_rows=num_rows)


def test_from_indices_inside_jit_says_to_build_outside():
    @jax.jit
    def f(idx):
        return CSRMatrix.from_indices(idx, num_rows=4)

    match = r"idx is a traced JAX value.*outside jax\.jit.*jax\.ops\.segment_sum"
    with pytest.raises(ValueError, match=match):
        f(jnp.array([0, 1, 2]))


def test_matmul_bad_operand():
    A = CSRMatrix.from_indices(np.array([0, 2, 1]), num_rows=3)
    with pytest.raises(
        ValueError, match=r"X.shape\[0\] must equal A.shape\[1\] = 3, got X.shape = \(4, 2\)"
    ):
        A @ jnp.ones((4, 2))
    with pytest.raises(ValueError, match=r"X must have rank >= 1"):
        jaxcsr.matmul(A, jnp.float32(1.0))
    with pytest.raises(TypeError, match="X must have a numeric dtype, got bool"):
        A @ jnp.ones(3, bool)
    with pytest.raises(ValueError, match=r"X.shape\[-1\] must equal A.shape\[0\] = 3"):
        jnp.ones((2, 4)) @ A
    with pytest.raises(ValueError, match="impl must be one of"):
        jaxcsr.matmul(A, jnp.ones(3), impl="cuda")
    with pytest.raises(TypeError, match="interpret must be a bool"):
        jaxcsr.matmul(A, jnp.ones(3), interpret="yes")
    with pytest.raises(TypeError, match=r"A must be a jaxcsr\.CSRMatrix"):
        jaxcsr.matmul(np.ones((3, 3)), jnp.ones(3))
    with pytest.raises(TypeError, match="sparse @ sparse"):
        A @ A.T


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_pallas_impl_off_its_platform_is_explained(impl):
    A = CSRMatrix.from_indices(np.array([0, 2, 1]), num_rows=3, backends=ALL)
    with pytest.raises(NotImplementedError, match=f"impl='{impl}' needs platform.*interpret=True"):
        jaxcsr.matmul(A, jnp.ones(3), impl=impl)


def test_data_length_mismatch():
    A = CSRMatrix.from_indices(np.array([0, 2, 1]), num_rows=3, backends=ALL)
    with pytest.raises(ValueError, match=r"data must have shape \(nnz,\) = \(3,\), got \(4,\)"):
        A.with_data(jnp.ones(4))
    with pytest.raises(TypeError, match="data must have a numeric dtype, got bool"):
        A.with_data(jnp.ones(3, bool))
    with pytest.raises(ValueError, match=r"data must have shape \(nnz,\) = \(2,\), got \(3,\)"):
        CSRMatrix.from_coo([0, 1], [1, 0], np.ones(3), shape=(2, 2))
    with pytest.raises(ValueError, match=r"data must have shape \(nnz,\) = \(3,\), got \(2,\)"):
        CSRMatrix.from_indices(np.array([0, 2, 1]), num_rows=3, data=np.ones(2))


def test_coo_bad_coordinates():
    with pytest.raises(ValueError, match=r"col must be < shape\[1\] = 2; col\[1\] = 5"):
        CSRMatrix.from_coo([0, 1], [1, 5], shape=(2, 2))
    with pytest.raises(ValueError, match=r"row must be >= 0; row\[0\] = -1"):
        CSRMatrix.from_coo([-1, 1], [1, 0], shape=(2, 2))
    with pytest.raises(ValueError, match="row and col must have the same length, got 2 and 3"):
        CSRMatrix.from_coo([0, 1], [1, 0, 0], shape=(2, 2))
    with pytest.raises(ValueError, match=r"shape must be a pair"):
        CSRMatrix.from_coo([0], [0], shape=(2,))


@pytest.mark.parametrize(
    "indptr,indices,match",
    [
        (
            [0, 2, 1, 3],
            [0, 1, 2],
            r"indptr must be non-decreasing; indptr\[1\] = 2 > indptr\[2\] = 1",
        ),
        ([0, 1, 2, 2], [0, 1, 2], r"indptr\[-1\] must equal nnz = len\(indices\) = 3, got 2"),
        ([1, 1, 2, 3], [0, 1, 2], r"indptr\[0\] must be 0, got 1"),
        ([0, 1, 3], [0, 1, 2], r"indptr must be 1-D of length shape\[0\] \+ 1 = 4"),
        ([0, 1, 2, 3], [0, 1, 4], r"indices must be < shape\[1\] = 4; indices\[2\] = 4"),
    ],
)
def test_bad_csr_arrays(indptr, indices, match):
    with pytest.raises(ValueError, match=match):
        CSRMatrix.from_arrays(np.array(indptr), np.array(indices), shape=(3, 4))


def test_bad_csr_from_scipy():
    bad = sp.csr_array((np.ones(3), np.array([0, 1, 2]), np.array([0, 2, 1, 3])), shape=(3, 4))
    with pytest.raises(ValueError, match="indptr must be non-decreasing"):
        CSRMatrix.from_scipy(bad)


def test_from_scipy_rejects_non_sparse():
    with pytest.raises(
        TypeError, match=r"matrix must be a scipy\.sparse matrix or array, got ndarray"
    ):
        CSRMatrix.from_scipy(np.eye(3))
    with pytest.raises(ValueError, match=r"dense must be 2-D, got shape \(3,\)"):
        CSRMatrix.from_dense(np.ones(3))


STRINGS = np.array(["a", "b", "c"])


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda A: A @ STRINGS, TypeError, "X must have a numeric dtype, got <U1"),
        (lambda A: STRINGS[None] @ A.T, TypeError, "X must have a numeric dtype, got <U1"),
        (lambda A: A.with_data(STRINGS), TypeError, "data must have a numeric dtype, got <U1"),
        (
            lambda A: CSRMatrix.from_indices([0, 1, 1], 2, data=STRINGS),
            TypeError,
            "data must have a numeric dtype, got <U1",
        ),
        (
            lambda A: jaxcsr.segment_sum(STRINGS, np.array([0, 1, 1]), 2),
            TypeError,
            "data must have a numeric dtype, got <U1",
        ),
        (
            lambda A: jaxcsr.segment_softmax(STRINGS, np.array([0, 1, 1]), 2),
            TypeError,
            "logits must have a floating dtype, got <U1",
        ),
        (
            lambda A: jaxcsr.edge_softmax(A, STRINGS),
            TypeError,
            "scores must have a floating dtype, got <U1",
        ),
        (
            lambda A: jaxcsr.sddmm(A, STRINGS[:2, None], np.ones((3, 1))),
            TypeError,
            "X must have a floating dtype, got <U1",
        ),
        (
            lambda A: CSRMatrix.from_dense(STRINGS[None]),
            TypeError,
            "dense must have a numeric dtype, got <U1",
        ),
        (
            lambda A: CSRMatrix.from_coo([0], [0], shape=(2**31, 2)),
            ValueError,
            r"shape\[0\] = 2147483648 needs 64-bit indices",
        ),
        (
            lambda A: CSRMatrix.from_indices([0], 2**31 - 1),
            ValueError,
            "num_rows = 2147483647 needs 64-bit indices",
        ),
    ],
    ids=[
        "matmul_X",
        "rmatmul_X",
        "with_data",
        "from_indices_data",
        "segment_sum_data",
        "segment_softmax_logits",
        "edge_softmax_scores",
        "sddmm_X",
        "from_dense",
        "from_coo_huge_rows",
        "from_indices_huge_rows",
    ],
)
def test_bad_dtypes_and_sizes_are_named_before_any_work(call, error, match):
    """Strings fail with the argument's name (not deep in JAX); sizes past int32
    indices fail before anything is allocated (from_coo used to try 16-32 GiB)."""
    A = CSRMatrix.from_indices(np.array([0, 1, 1]), 2)
    with pytest.raises(error, match=match):
        call(A)


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16])
def test_from_dense_keeps_16_bit_values(rng, dtype):
    dense = rng.standard_normal((5, 7)) * (rng.random((5, 7)) < 0.4)
    dense = np.asarray(dense, dtype)
    A = CSRMatrix.from_dense(dense)
    assert A.dtype == dtype and A.nnz == np.count_nonzero(dense != 0)
    np.testing.assert_array_equal(np.asarray(A.todense(), np.float64), dense.astype(np.float64))
    x = rng.standard_normal((7, 3)).astype(np.float32)
    want = dense.astype(np.float64) @ x
    np.testing.assert_allclose(np.asarray(A @ x, np.float64), want, rtol=1e-2, atol=1e-2)


def test_shard_of_traced_values_says_what_to_do():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    A = CSRMatrix.from_coo(np.array([0, 1, 1]), np.array([1, 0, 1]), shape=(2, 2))

    @jax.jit
    def f(values):
        return jaxcsr.shard(A.with_data(values), mesh, "d")

    with pytest.raises(ValueError, match=r"A holds traced values.*outside jax\.jit"):
        f(jnp.ones(3))
