"""Host-side plans, unit-tested without running a product; plus hypothesis properties."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import assert_close

from jaxcsr import CSRMatrix, plan


def test_segment_ids_to_csr_is_a_stable_sort():
    idx = np.array([2, 0, 2, 1, 0, 2])
    indptr, order = plan.segment_ids_to_csr(idx, 4)
    np.testing.assert_array_equal(indptr, [0, 2, 3, 6, 6])
    np.testing.assert_array_equal(order, [1, 4, 3, 0, 2, 5])
    assert indptr.dtype == np.int32 and order.dtype == np.int32


def test_transpose_plan_matches_scipy():
    rng = np.random.default_rng(5)
    mat = sp.random_array((23, 31), density=0.2, format="csr", rng=rng)
    mat.sort_indices()
    indptr = mat.indptr.astype(np.int32)
    indices = mat.indices.astype(np.int32)
    t = plan.plan_transpose(indptr, indices, mat.shape)
    ref = mat.T.tocsr()
    ref.sort_indices()
    np.testing.assert_array_equal(t.indptr, ref.indptr)
    np.testing.assert_array_equal(t.indices, ref.indices)
    np.testing.assert_array_equal(mat.data[t.perm], ref.data)
    np.testing.assert_array_equal(t.perm[t.inverse_perm], np.arange(mat.nnz))


def test_structure_classes():
    idx = np.array([1, 0, 1, 3])
    indptr, order = plan.segment_ids_to_csr(idx, 4)
    s = plan.plan_structure(indptr, order, (4, 4))
    np.testing.assert_array_equal(s.row_of_col, idx)
    assert s.col_of_row is None and not s.identity_columns
    t = plan.plan_transpose(indptr, order, (4, 4))
    st_ = plan.plan_structure(t.indptr, t.indices, (4, 4))
    np.testing.assert_array_equal(st_.col_of_row, idx)
    sorted_ids = np.sort(idx)
    indptr, order = plan.segment_ids_to_csr(sorted_ids, 4)
    assert plan.plan_structure(indptr, order, (4, 4)).identity_columns
    # an empty row marks its sentinel as n (out of range)
    s = plan.plan_structure(np.array([0, 1, 1]), np.array([2]), (2, 3))
    np.testing.assert_array_equal(s.col_of_row, [2, 3])


def test_index_dtype_widens_for_huge_sizes():
    assert plan.index_dtype_for(10, 2**31 - 2) == np.int32
    assert plan.index_dtype_for(2**31) == np.int64


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 20),
    n=st.integers(0, 20),
    data=st.data(),
)
def test_random_coo_structures_match_dense_reference(m, n, data):
    nnz = data.draw(st.integers(0, 60)) if m and n else 0
    row = np.array(
        data.draw(st.lists(st.integers(0, max(m - 1, 0)), min_size=nnz, max_size=nnz)), int
    )
    col = np.array(
        data.draw(st.lists(st.integers(0, max(n - 1, 0)), min_size=nnz, max_size=nnz)), int
    )
    seed = data.draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    vals = rng.uniform(-2, 2, nnz).astype(np.float32)
    A = CSRMatrix.from_coo(row, col, vals, shape=(m, n))
    dense = np.zeros((m, n))
    np.add.at(dense, (row, col), vals.astype(np.float64))
    x = rng.uniform(-2, 2, (n, 3)).astype(np.float32)
    y = rng.uniform(-2, 2, (m, 2)).astype(np.float32)
    assert_close(A @ jnp.asarray(x), dense @ x, np.float32)
    assert_close(A.T @ jnp.asarray(y), dense.T @ y, np.float32)
    assert_close(A.todense(), dense, np.float32)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 12), max_size=80), extra=st.integers(0, 3))
def test_random_segment_ids_match_segment_sum(ids, extra):
    idx = np.array(ids, int)
    m = (int(idx.max()) + 1 if idx.size else 0) + extra
    rng = np.random.default_rng(len(ids) * 31 + extra)
    values = rng.uniform(-2, 2, (idx.size, 2)).astype(np.float32)
    A = CSRMatrix.from_indices(idx, num_rows=m)
    expected = np.zeros((m, 2))
    np.add.at(expected, idx, values.astype(np.float64))
    assert_close(A @ jnp.asarray(values), expected, np.float32)
    assert_close(jnp.asarray(values.T) @ A.T, expected.T, np.float32)
