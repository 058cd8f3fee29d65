"""Host-side plans, unit-tested without running a product; plus hypothesis properties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import recorded_plans
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


def test_transpose_csr_matches_scipy():
    rng = np.random.default_rng(5)
    mat = sp.random_array((23, 31), density=0.2, format="csr", rng=rng)
    mat.sort_indices()
    indptr = mat.indptr.astype(np.int32)
    indices = mat.indices.astype(np.int32)
    t_indptr, t_indices, perm = plan.transpose_csr(indptr, indices, mat.shape)
    ref = mat.T.tocsr()
    ref.sort_indices()
    np.testing.assert_array_equal(t_indptr, ref.indptr)
    np.testing.assert_array_equal(t_indices, ref.indices)
    np.testing.assert_array_equal(mat.data[perm], ref.data)


def test_structure_kinds():
    idx = np.array([1, 0, 1, 3])
    s = plan.structure_from_segment_ids(idx, 4)
    assert s.layout.kind == "columns" and s.one_per_column and not s.sorted_ids
    np.testing.assert_array_equal(s.row_of_col, idx)  # the ids themselves
    np.testing.assert_array_equal(s.indices, [1, 0, 2, 3])  # their stable argsort
    assert s.t_perm is None and s.t_indices is None  # nothing planned for the transpose
    assert s.transpose().one_per_row
    sorted_ids = plan.structure_from_segment_ids(np.sort(idx), 4)
    assert sorted_ids.sorted_ids and sorted_ids.indices is None  # iota, not stored
    # at most one entry per row: the columns kind of the transpose, viewed transposed
    rows = plan.structure_from_csr(np.array([0, 1, 1, 2]), np.array([0, 0]), (3, 4))
    assert rows.one_per_row and rows.layout.shape == (4, 3)
    np.testing.assert_array_equal(rows.row_of_col, [0, 4, 0])  # empty row 1 -> sentinel 4
    general = plan.structure_from_csr(np.array([0, 2, 3]), np.array([0, 1, 1]), (2, 2))
    assert general.layout.kind == "general"
    np.testing.assert_array_equal(general.t_perm, [0, 1, 2])
    np.testing.assert_array_equal(general.t_indices, [0, 0, 1])


def test_sorted_ids_skip_the_sort():
    indptr, order = plan.segment_ids_to_csr(np.array([0, 0, 2, 3, 3]), 4)
    np.testing.assert_array_equal(order, np.arange(5))
    np.testing.assert_array_equal(indptr, [0, 2, 2, 3, 5])


def test_index_dtype_widens_for_huge_sizes():
    assert plan.index_dtype_for(10, 2**31 - 2) == np.int32
    assert plan.index_dtype_for(2**31) == np.int64


@settings(max_examples=15, deadline=None)  # each example compiles new shapes
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
    _check_views(A, dense, x, y)


def _check_views(A, dense, x, y):
    """Every array a view derives equals scipy's; values survive .T.T; the data
    gradient (SDDMM) matches ``y x^T`` at the stored entries, for both views."""
    for view, ref in ((A, dense), (A.T, dense.T)):
        got = view.to_scipy()
        np.testing.assert_array_equal(np.diff(np.asarray(view.indptr)), np.diff(got.indptr))
        assert_close(got.toarray(), ref, np.float32)
        np.testing.assert_array_equal(
            np.asarray(view.structure.degrees()), np.diff(np.asarray(view.indptr))
        )
        rows = np.asarray(view.structure.row_ids())
        np.testing.assert_array_equal(rows, np.repeat(np.arange(ref.shape[0]), np.diff(got.indptr)))
    np.testing.assert_array_equal(np.asarray(A.T.T.data), np.asarray(A.data))
    x = np.concatenate([x, x[:, :1]], axis=1)[:, : y.shape[1]]  # one feature width
    rows, cols = np.asarray(A.structure.row_ids()), np.asarray(A.indices)
    grad = jax.grad(lambda d: jnp.sum((A.with_data(d) @ jnp.asarray(x)) * y))(A.data)
    assert_close(grad, np.sum(y[rows] * x[cols], axis=1), np.float32)
    t_rows, t_cols = np.asarray(A.T.structure.row_ids()), np.asarray(A.T.indices)
    t_grad = jax.grad(lambda d: jnp.sum((A.T.with_data(d) @ jnp.asarray(y)) * x))(A.T.data)
    assert_close(t_grad, np.sum(x[t_rows] * y[t_cols], axis=1), np.float32)


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


def _assert_plans_equal(planned: dict, recorded: dict, keys) -> None:
    for key in keys:
        got, want = np.asarray(planned[key]), recorded[key]
        assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
        np.testing.assert_array_equal(got, want, err_msg=key)


def test_host_kernel_plans_equal_the_recorded_plans():
    """GPU lanes and TPU schedules of fixed structures, element for element, against
    the plans recorded before host and device planning became one planner."""
    for name, recorded in recorded_plans.load().items():
        structure = recorded_plans.structure_of(recorded_plans.inputs(recorded))
        planned = recorded_plans.kernel_plans(structure)
        assert set(planned) == {k for k in recorded if not k.startswith("input/")}, name
        _assert_plans_equal(planned, recorded, planned)
