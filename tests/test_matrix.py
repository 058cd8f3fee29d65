"""CSRMatrix constructors, interop and pytree behaviour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from reference import assert_close, power_law_ids, random_csr, random_values

import jaxcsr
from jaxcsr import CSRMatrix


@pytest.mark.parametrize("kind", ["uniform", "power_law", "empty_rows", "empty"])
@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "csr_matrix"])
def test_scipy_round_trip(rng, kind, fmt):
    mat = random_csr(rng, 37, 129, kind)
    src = sp.csr_matrix(mat) if fmt == "csr_matrix" else mat.asformat(fmt)
    A = CSRMatrix.from_scipy(src)
    assert A.shape == (37, 129) and A.nnz == mat.nnz and A.dtype == np.float32
    back = A.to_scipy()
    assert isinstance(back, sp.csr_array)
    assert_close(back.toarray(), mat.toarray(), np.float32)
    assert_close(A.todense(), mat.toarray(), np.float32)
    assert_close(A.T.todense(), mat.toarray().T, np.float32)
    assert_close(A.T.to_scipy().toarray(), mat.toarray().T, np.float32)


def test_unsorted_scipy_indices_are_sorted(rng):
    mat = sp.csr_array(
        (np.array([1.5, -2.0, 3.0]), np.array([2, 0, 1]), np.array([0, 2, 3])), shape=(2, 3)
    )
    assert not mat.has_sorted_indices
    A = CSRMatrix.from_scipy(mat)
    np.testing.assert_array_equal(np.asarray(A.indices), [0, 2, 1])
    np.testing.assert_array_equal(np.asarray(A.data), [-2.0, 1.5, 3.0])
    assert mat.indices.tolist() == [2, 0, 1]  # the caller's matrix is untouched


def test_from_dense_and_from_coo(rng):
    dense = random_values(rng, (9, 14))
    dense[rng.random(dense.shape) < 0.6] = 0.0
    dense[3] = 0.0
    A = CSRMatrix.from_dense(dense)
    assert A.nnz == np.count_nonzero(dense)
    assert_close(A.todense(), dense, np.float32)
    row, col = np.nonzero(dense)
    order = rng.permutation(row.size)
    B = CSRMatrix.from_coo(row[order], col[order], dense[row, col][order], shape=(9, 14))
    np.testing.assert_array_equal(np.asarray(B.indptr), np.asarray(A.indptr))
    np.testing.assert_array_equal(np.asarray(B.indices), np.asarray(A.indices))
    # input_order[k] is the input position of the k-th stored nonzero
    np.testing.assert_array_equal(row[order][np.asarray(B.input_order)], row)
    np.testing.assert_array_equal(col[order][np.asarray(B.input_order)], col)
    np.testing.assert_allclose(np.asarray(B.data), dense[row, col].astype(np.float32))


def test_input_order_maps_per_edge_arrays(rng):
    idx = power_law_ids(rng, 200, 19)
    w = random_values(rng, (200,)).astype(np.float32)
    A = CSRMatrix.from_indices(idx, num_rows=19, data=w)
    order = np.asarray(A.input_order)
    np.testing.assert_array_equal(np.sort(order), np.arange(200))
    assert np.all(np.diff(idx[order]) >= 0)  # CSR order is rows ascending ...
    for r in range(19):  # ... and input order within a row (a stable sort)
        assert np.all(np.diff(order[idx[order] == r]) > 0)
    np.testing.assert_array_equal(np.asarray(A.data), w[order])
    one_valued = CSRMatrix.from_indices(idx, num_rows=19)
    assert one_valued.data is None and one_valued.dtype is None
    W = one_valued.with_data(w[order])
    assert_close(W.todense(), A.todense(), np.float32)


def test_one_valued_matrix_stores_no_values(rng):
    A = CSRMatrix.from_indices(power_law_ids(rng, 50, 7), num_rows=7)
    leaves = jax.tree_util.tree_leaves(A)
    assert all(jnp.issubdtype(leaf.dtype, jnp.integer) for leaf in leaves)
    assert A.T.data is None
    assert repr(A) == "CSRMatrix(shape=(7, 50), nnz=50, one-valued)"


def test_pytree_round_trip_and_aux_is_hashable(rng):
    A = CSRMatrix.from_scipy(random_csr(rng, 12, 10, "uniform"))
    leaves, treedef = jax.tree_util.tree_flatten(A)
    B = jax.tree_util.tree_unflatten(treedef, leaves)
    assert B.shape == A.shape and B.nnz == A.nnz
    np.testing.assert_array_equal(np.asarray(B.todense()), np.asarray(A.todense()))
    x = jnp.asarray(random_values(rng, (10, 2)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(B @ x), np.asarray(A @ x))
    np.testing.assert_array_equal(np.asarray(B.T @ (A @ x)), np.asarray(A.T @ (A @ x)))
    hash(treedef)
    C = A.with_data(jnp.asarray(random_values(rng, (A.nnz,)), jnp.float32))
    assert jax.tree_util.tree_structure(C) == treedef


def test_empty_matrices():
    for shape in [(0, 0), (0, 4), (4, 0), (3, 5)]:
        A = CSRMatrix.from_coo(np.zeros(0, int), np.zeros(0, int), shape=shape)
        x = jnp.asarray(np.random.default_rng(0).uniform(1, 2, (shape[1], 2)), jnp.float32)
        out = A @ x
        assert out.shape == (shape[0], 2)
        np.testing.assert_array_equal(np.asarray(out), 0.0)
        assert A.T.shape == shape[::-1]
        assert A.todense().shape == shape
    A = CSRMatrix.from_indices(np.zeros(0, int), num_rows=0)
    assert (A @ jnp.ones((0, 3))).shape == (0, 3)


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
