"""Products against float64 scipy references: every structure, dtype and XLA strategy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from reference import (
    ALL,
    assert_close,
    dense_of,
    interpret_for,
    power_law_ids,
    random_csr,
    random_values,
    segment_reference,
)

import jaxcsr
from jaxcsr import CSRMatrix, kernels, ops
from jaxcsr.kernels import xla as xla_kernels

DTYPES = [np.float32, jnp.bfloat16, np.float16]
KINDS = ["uniform", "power_law", "empty_rows", "empty"]
SHAPES = [(1, 1), (7, 13), (37, 129), (130, 9), (0, 5), (5, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_scipy_matrix_times_dense(rng, shape, kind, dtype):
    m, n = shape
    mat = random_csr(rng, m, n, kind)
    A = CSRMatrix.from_scipy(mat, backends=ALL)
    x = random_values(rng, (n, 6)).astype(dtype)
    out = A @ jnp.asarray(x)
    assert out.dtype == jnp.result_type(A.dtype, dtype) and out.shape == (m, 6)
    expected = mat.astype(np.float32).astype(np.float64) @ x.astype(np.float64)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sorted_ids", [False, True])
@pytest.mark.parametrize("size,num_rows", [(1, 1), (200, 17), (1000, 130), (0, 4), (9, 0)])
def test_from_indices_equals_segment_sum(rng, size, num_rows, sorted_ids, dtype):
    if num_rows == 0 and size:
        size = 0
    idx = power_law_ids(rng, size, num_rows) if num_rows else np.zeros(0, int)
    if sorted_ids:
        idx = np.sort(idx)
    A = CSRMatrix.from_indices(idx, num_rows=num_rows, backends=ALL)
    if sorted_ids:
        assert A.structure.sorted_ids  # the streaming CSR-kernel path is exercised
    values = random_values(rng, (size, 3, 5)).astype(dtype)  # N-D features
    out = A @ jnp.asarray(values)
    assert out.dtype == np.dtype(dtype) and out.shape == (num_rows, 3, 5)
    assert_close(out, segment_reference(values, idx, num_rows), dtype)
    # jax.ops.segment_sum computes the same function
    if size:
        ref = jax.ops.segment_sum(jnp.asarray(values, jnp.float32), idx, num_rows)
        assert_close(out, ref, dtype)


def test_from_indices_with_weights(rng):
    idx = power_law_ids(rng, 300, 40)
    w = random_values(rng, (300,)).astype(np.float32)
    A = CSRMatrix.from_indices(idx, num_rows=40, data=w, backends=ALL)
    np.testing.assert_array_equal(np.asarray(A.data), w[np.asarray(A.input_order)])
    values = random_values(rng, (300, 4)).astype(np.float32)
    assert_close(A @ values, segment_reference(values * w[:, None], idx, 40), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_last_axis_scatter(rng, dtype):
    """``values @ A.T`` scatter-adds along the last axis (the seed's layout)."""
    idx = power_law_ids(rng, 257, 33)
    A = CSRMatrix.from_indices(idx, num_rows=33, backends=ALL)
    values = random_values(rng, (2, 3, 257)).astype(dtype)
    out = jnp.asarray(values) @ A.T
    expected = np.moveaxis(segment_reference(np.moveaxis(values, -1, 0), idx, 33), 0, -1)
    assert out.shape == (2, 3, 33)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("impl", ["xla", "cpu", "pallas_gpu", "pallas_tpu"])
def test_feature_major_products_on_every_backend(rng, impl):
    """``values @ A.T`` is a feature-major product (values ``(F, n)`` as stored, result
    ``(F, m)``); backends without feature-major products get it between transposes.
    Sum and mean of a general matrix with values and of a segment matrix: forward,
    the gradients of the operand and of the values, and vmap, against float64."""
    if impl == "cpu" and not kernels.BACKENDS["cpu"].available():
        pytest.skip("the CPU library is not built")
    general = CSRMatrix.from_scipy(random_csr(rng, 23, 17, "empty_rows"), backends=ALL)
    segment = CSRMatrix.from_indices(power_law_ids(rng, 90, 23), num_rows=23, backends=ALL)

    def run(B, v, reduce="sum", data=None):
        return ops.reduce_rows(
            v, B.data if data is None else data, B.index, reduce=reduce, return_arg=False,
            impl=impl, interpret=interpret_for(impl), feature_major=True,
        )  # fmt: skip

    def check(B):
        dense = dense_of(B)
        degree = np.maximum((dense != 0).sum(axis=1), 1)
        v = random_values(rng, (5, B.shape[1])).astype(np.float32)
        v64 = v.astype(np.float64)
        assert_close(run(B, v), v64 @ dense.T, np.float32)
        if B.dtype is None:
            assert_close(run(B, v, "mean"), v64 @ dense.T / degree, np.float32)
        ct = random_values(rng, (5, B.shape[0])).astype(np.float32)
        grad_v = jax.grad(lambda v: jnp.sum(run(B, v) * ct))(v)
        assert_close(grad_v, ct.astype(np.float64) @ dense, np.float32)
        if B.dtype is not None:
            grad_d = jax.grad(lambda d: jnp.sum(run(B, v, data=d) * ct))(B.data)
            rows = np.repeat(np.arange(B.shape[0]), np.diff(B.to_scipy().tocsr().indptr))
            want = np.sum(ct[:, rows] * v[:, B.to_scipy().tocsr().indices], axis=0)
            assert_close(grad_d, want, np.float32)  # the values in B's CSR order
        batch = random_values(rng, (3, 5, B.shape[1])).astype(np.float32)
        out = jax.vmap(lambda v: run(B, v))(batch)
        assert_close(out, np.einsum("bfn,mn->bfm", batch.astype(np.float64), dense), np.float32)

    check(general)
    check(segment)
    with pytest.raises(ValueError, match="feature_major products are sums"):
        ops.product(jnp.ones((2, 17)), None, segment.T.index, reduce="max", impl=None,
                    interpret=False, feature_major=True)  # fmt: skip


@pytest.mark.parametrize("impl", ["xla", "cpu", "pallas_gpu", "pallas_tpu"])
def test_values_in_the_transpose_order_on_every_backend(rng, impl):
    """``data_transposed``: a general view's product with its values in the CSR order of
    the view's transpose (what the backward pass binds). Both views, row-major and
    feature-major, against float64; its gradients (the operand's, and the values' in
    the order given) and a batch of values; refused for max and for one-per-column
    views."""
    if impl == "cpu" and not kernels.BACKENDS["cpu"].available():
        pytest.skip("the CPU library is not built")
    A = CSRMatrix.from_scipy(random_csr(rng, 23, 17, "empty_rows"), backends=ALL)

    def check(B):
        other = B.T  # its values are B's in the order B's transpose stores them
        dense = dense_of(B)

        def run(x, values, fm=False):
            return ops.product(
                x, values, B.index, reduce="sum", impl=impl, interpret=interpret_for(impl),
                feature_major=fm, data_transposed=True,
            )  # fmt: skip

        x = random_values(rng, (B.shape[1], 5)).astype(np.float32)
        x64 = x.astype(np.float64)
        assert_close(run(x, other.data), dense @ x64, np.float32)
        assert_close(run(x.T, other.data, fm=True), (dense @ x64).T, np.float32)
        ct = random_values(rng, (B.shape[0], 5)).astype(np.float32)
        grad_x = jax.grad(lambda x: jnp.sum(run(x, other.data) * ct))(x)
        assert_close(grad_x, dense.T @ ct.astype(np.float64), np.float32)
        grad_d = jax.grad(lambda d: jnp.sum(run(x, d) * ct))(other.data)
        t = other.to_scipy().tocsr()  # the values' order: B's transpose's CSR order
        cols_of_b = np.repeat(np.arange(t.shape[0]), np.diff(t.indptr))  # B's column
        want = np.sum(ct[t.indices] * x[cols_of_b], axis=1)
        assert_close(grad_d, want, np.float32)
        batch = jnp.stack([other.data, 2 * other.data])
        out = jax.vmap(lambda d: run(x, d))(batch)
        assert_close(out, np.stack([dense @ x64, 2 * dense @ x64]), np.float32)

    check(A)
    check(A.T)
    with pytest.raises(ValueError, match="data_transposed products are sums of general"):
        ops.product(jnp.ones((17, 2)), A.T.data, A.index, reduce="max", impl=None,
                    interpret=False, data_transposed=True)  # fmt: skip
    segment = CSRMatrix.from_indices(power_law_ids(rng, 90, 23), num_rows=23, backends=ALL)
    segment = segment.with_data(jnp.ones((90,)))
    with pytest.raises(ValueError, match="data_transposed products are sums of general"):
        ops.product(jnp.ones((90, 2)), segment.data, segment.index, reduce="sum", impl=None,
                    interpret=False, data_transposed=True)  # fmt: skip


def test_vector_operand_and_transpose(rng):
    mat = random_csr(rng, 45, 31, "power_law")
    A = CSRMatrix.from_scipy(mat, backends=ALL)
    x = random_values(rng, (31,)).astype(np.float32)
    y = random_values(rng, (45,)).astype(np.float32)
    assert_close(A @ x, mat @ x.astype(np.float64), np.float32)
    assert_close(A.T @ y, mat.T @ y.astype(np.float64), np.float32)
    assert_close(y @ A, y.astype(np.float64) @ mat, np.float32)
    assert_close(A.T.T @ x, mat @ x.astype(np.float64), np.float32)


def test_integer_values(rng):
    idx = power_law_ids(rng, 500, 20)
    A = CSRMatrix.from_indices(idx, num_rows=20, backends=ALL)
    values = rng.integers(-50, 50, size=(500, 3)).astype(np.int32)
    out = A @ jnp.asarray(values)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(out), segment_reference(values, idx, 20))


def test_float64_with_x64(rng):
    mat = random_csr(rng, 30, 20, "uniform")
    x = random_values(rng, (20, 3))
    with jax.enable_x64(True):
        A = CSRMatrix.from_scipy(mat, backends=ALL)
        assert A.dtype == np.float64
        out = A @ jnp.asarray(x)
        assert out.dtype == np.float64
        assert_close(out, mat @ x, np.float64)


def _pattern_case(rng, kind):
    """A matrix of a structure class plus its float64 scipy twin."""
    if kind == "segment":
        idx = power_law_ids(rng, 400, 37)
        A = CSRMatrix.from_indices(idx, num_rows=37, backends=ALL)
        return A, sp.csr_array((np.ones(400), (idx, np.arange(400))), shape=(37, 400))
    if kind == "segment_sorted":
        idx = np.sort(power_law_ids(rng, 400, 37))
        A = CSRMatrix.from_indices(idx, num_rows=37, data=random_values(rng, (400,)), backends=ALL)
        return A, A.to_scipy().astype(np.float64)
    if kind == "gather":
        idx = power_law_ids(rng, 400, 37)
        A = CSRMatrix.from_indices(
            idx, num_rows=37, data=random_values(rng, (400,)), backends=ALL
        ).T
        return A, A.to_scipy().astype(np.float64)
    mat = random_csr(rng, 41, 77, "power_law")
    A = CSRMatrix.from_scipy(mat, backends=ALL)
    return A, mat


# Every structure class with every strategy that applies to it ("scatter" needs <= 1
# nonzero per column, "gather" <= 1 per row; test_strategy_preconditions covers misuse).
STRATEGY_CASES = [
    (kind, strategy)
    for kind in ("segment", "segment_sorted", "gather", "general")
    for strategy in xla_kernels.STRATEGIES
    if not (strategy == "scatter" and kind in ("gather", "general"))
    and not (strategy == "gather" and kind != "gather")
]


@pytest.mark.parametrize("kind,strategy", STRATEGY_CASES)
def test_every_strategy_computes_the_same_function(rng, kind, strategy):
    A, mat = _pattern_case(rng, kind)
    x = random_values(rng, (A.shape[1], 5)).astype(np.float32)
    out = jax.jit(lambda x, d, s: xla_kernels.spmm(x, d, s, strategy=strategy))(
        x, A.data, A.structure
    )
    assert_close(out, mat @ x.astype(np.float64), np.float32)


def test_strategy_choice(rng):
    choose = xla_kernels.choose_strategy
    segment, sorted_ids, gather, general = (
        _pattern_case(rng, kind)[0].structure
        for kind in ("segment", "segment_sorted", "gather", "general")
    )
    csr_kernel = "csr_kernel" if xla_kernels.HAS_CPU_CSR_KERNEL else None
    assert choose(segment, on_cpu=True) == "scatter"
    assert choose(sorted_ids, on_cpu=True) == (csr_kernel or "scatter")
    assert choose(sorted_ids, on_cpu=False) == "scatter"
    assert choose(gather, on_cpu=True) == "gather"
    assert choose(general, on_cpu=True) == (csr_kernel or "segment")
    assert choose(general, on_cpu=False) == "segment"
    # by operand width (measured crossovers): the kernel is slow for narrow operands
    if csr_kernel:
        assert choose(sorted_ids, on_cpu=True, width=1) == "scatter"
        assert choose(sorted_ids, on_cpu=True, width=7) == "scatter"
        assert choose(sorted_ids, on_cpu=True, width=8) == "csr_kernel"
        assert choose(segment, on_cpu=True, width=64) == "scatter"
        assert choose(segment, on_cpu=True, width=128) == "csr_kernel"
        assert choose(general, on_cpu=True, width=7) == "segment"
        assert choose(general, on_cpu=True, width=8) == "csr_kernel"
    assert choose(segment, on_cpu=False, width=512) == "scatter"
    # the transposed views swap scatter and gather
    assert choose(segment.transpose(), on_cpu=False) == "gather"
    assert choose(gather.transpose(), on_cpu=False) == "scatter"


def test_duplicates_in_coo_add_up(rng):
    row = np.array([0, 2, 0, 2, 2, 1, 0])
    col = np.array([1, 0, 1, 3, 0, 2, 1])
    data = random_values(rng, (7,)).astype(np.float32)
    A = CSRMatrix.from_coo(row, col, data, shape=(4, 5), backends=ALL)
    x = random_values(rng, (5, 3)).astype(np.float32)
    dense = np.zeros((4, 5))
    np.add.at(dense, (row, col), data.astype(np.float64))
    assert_close(A @ x, dense @ x.astype(np.float64), np.float32)
    assert_close(A.todense(), dense, np.float32)
    assert_close(A.to_scipy().toarray(), dense, np.float32)


def test_matmul_function_matches_operator(rng):
    A, mat = _pattern_case(rng, "general")
    x = random_values(rng, (A.shape[1], 2)).astype(np.float32)
    for impl in (None, "xla"):
        assert_close(jaxcsr.matmul(A, x, impl=impl), mat @ x.astype(np.float64), np.float32)


@pytest.mark.parametrize("n_features", [1, 2])
def test_sorted_ids_scatter_in_strided_order(rng, n_features):
    """Sorted ids, one feature: the scatter takes the updates 16 apart (padded to a
    multiple of 16; dropped ids and a hub row included) and still sums every one."""
    m, n = 23, 16 * 40 + 7
    ids = np.sort(power_law_ids(rng, n, m))
    x = random_values(rng, (n, n_features)).astype(np.float32)
    A = CSRMatrix.from_indices(ids, m, backends=["xla"])
    assert A.structure.sorted_ids
    assert_close(jax.jit(lambda A, x: A @ x)(A, x), segment_reference(x, ids, m), np.float32)
    ids_dropped = np.where(rng.random(n) < 0.2, m + 3, ids)  # out of range: left out
    keep = ids_dropped < m
    got = jaxcsr.segment_sum(x, ids_dropped, m, mode="drop")
    assert_close(got, segment_reference(x[keep], ids_dropped[keep], m), np.float32)
