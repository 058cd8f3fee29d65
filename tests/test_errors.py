"""Bad input, in one place: every public entry point raises a ValueError or TypeError
that names the argument, before any device work."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from reference import ALL, power_law_ids, random_csr

import jaxcsr
from jaxcsr import CSRMatrix, kernels
from jaxcsr.kernels import xla as xla_kernels

GENERAL = np.array([[1.0, 2.0], [3.0, 0.0]])  # a column and a row with two entries


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


def test_traced_ids_are_checked_at_trace_time():
    """Traced ids are planned on the device; what can be checked without their values
    (dtype, rank, static sizes) raises at trace time, naming the argument."""
    ids = jnp.array([0, 1, 2])

    def traced(fn, *args):
        return jax.jit(fn)(*args)

    with pytest.raises(TypeError, match="idx must have an integer dtype, got float32"):
        traced(lambda i: CSRMatrix.from_indices(i, num_rows=4), ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"idx must be 1-D, got shape \(1, 3\)"):
        traced(lambda i: CSRMatrix.from_indices(i, num_rows=4), ids[None])
    with pytest.raises(TypeError, match=r"num_rows is a traced JAX value.*Python int"):
        traced(lambda i, n: CSRMatrix.from_indices(i, num_rows=n), ids, 4)
    with pytest.raises(TypeError, match="indices_are_sorted must be a bool"):
        traced(lambda i: CSRMatrix.from_indices(i, 4, indices_are_sorted=1), ids)
    with pytest.raises(ValueError, match="row and col must have the same length, got 3 and 2"):
        traced(lambda r: CSRMatrix.from_coo(r, r[:2], shape=(4, 4)), ids)
    with pytest.raises(TypeError, match="col must have an integer dtype"):
        traced(lambda r: CSRMatrix.from_coo(r, r * 1.0, shape=(4, 4)), ids)
    # constructors that plan on the host say which ones take traced ids
    match = r"indptr is a traced JAX value.*from_indices, CSRMatrix\.from_coo"
    with pytest.raises(ValueError, match=match):
        traced(lambda p: CSRMatrix.from_arrays(p, ids, shape=(3, 3)), jnp.array([0, 1, 2, 3]))


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


SHARD_ROWS_ERRORS = [  # (row_lengths, what load_rows returns, keywords, error, message)
    ([2, -1], [0], {}, ValueError, "row_lengths must be a 1-D array of non-negative"),
    ([[1, 2]], [0], {}, ValueError, "row_lengths must be a 1-D"),
    ([1.5, 2], [0], {}, TypeError, "row_lengths"),
    ([2, 1], [0, 1], {}, ValueError, r"load_rows\(0, 2\) must return 3 columns"),
    ([2, 1], [0, 1, 5], {}, ValueError, r"load_rows\(0, 2\)'s columns.*num_cols"),
    ([2, 1], [0, 1, -1], {}, ValueError, r"load_rows\(0, 2\)'s columns"),
    ([2, 1], [0.0, 1.0, 2.0], {}, TypeError, r"load_rows\(0, 2\)'s columns"),
    ([2, 1], [0, 1, 1], {"form": "segment"}, ValueError, "repeats a column"),
    ([2, 1], [0, 1, 2], {"dtype": np.float32}, TypeError, r"must return \(columns, values\)"),
    ([2, 1], ([0, 1, 2], [1.0]), {"dtype": np.float32}, ValueError, "must return 3 values"),
    ([2, 1], [0, 1, 2], {"dtype": "U3"}, TypeError, "dtype"),
    ([2, 1], [0, 1, 2], {"form": None}, ValueError, "form must be"),
    ([2, 1], [0, 1, 2], {"balance": "edges"}, ValueError, "balance must be"),
    ([2, 1], [0, 1, 2], {"num_cols": -1}, ValueError, "num_cols"),
]


@pytest.mark.parametrize("lengths,loaded,keywords,error,message", SHARD_ROWS_ERRORS)
def test_shard_rows_checks_what_it_is_given(lengths, loaded, keywords, error, message):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    keywords = {"num_cols": 4, **keywords}
    with pytest.raises(error, match=message):
        jaxcsr.shard_rows(lengths, lambda lo, hi: loaded, mesh, "d", **keywords)
    with pytest.raises(TypeError, match="load_rows must be callable"):
        jaxcsr.shard_rows([1], "rows.npy", mesh, "d", num_cols=1)


def test_sizes_reject_bools_and_floats():
    with pytest.raises(TypeError, match="num_rows must be an int, got the bool True"):
        CSRMatrix.from_indices(np.array([0, 0]), num_rows=True)
    ids = np.array([0, 1, 1])
    jaxcsr.segment_sum(jnp.ones(3), ids, 2)  # caches the matrix under num_segments=2
    with pytest.raises(TypeError, match=r"num_segments must be an int, got 2\.0"):
        jaxcsr.segment_sum(jnp.ones(3), ids, 2.0)
    with pytest.raises(TypeError, match="num_segments must be an int"):
        jaxcsr.segment_sum(jnp.ones(3), ids, False)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_impl_without_its_plan_raises_naming_backends(rng, impl):
    A = CSRMatrix.from_indices(power_law_ids(rng, 50, 7), num_rows=7, backends=["xla"])
    with pytest.raises(ValueError, match=rf"impl='{impl}' needs a matrix planned.*backends="):
        jaxcsr.matmul(A, jnp.ones((50, 2)), impl=impl, interpret=True)
    with pytest.raises(ValueError, match="backends="):
        jaxcsr.matmul(A.T, jnp.ones((7, 2)), impl=impl, interpret=True)


def test_bad_backends_argument():
    with pytest.raises(ValueError, match="backends: unknown backend 'cuda'"):
        CSRMatrix.from_indices(np.array([0, 1]), 2, backends=["cuda"])
    with pytest.raises(TypeError, match="backends must be a sequence"):
        CSRMatrix.from_indices(np.array([0, 1]), 2, backends=3)


def test_an_unregistered_backend_is_refused_by_name():
    assert "toy" not in jaxcsr.IMPLS
    with pytest.raises(ValueError, match="impl must be one of"):
        jaxcsr.matmul(CSRMatrix.from_indices(np.array([0, 1]), 2), jnp.ones(2), impl="toy")
    with pytest.raises(TypeError, match=r"must be a jaxcsr\.kernels\.Backend"):
        kernels.register("toy")


def test_pallas_gpu_without_gpu_or_interpret_is_explained():
    A = CSRMatrix.from_indices(np.array([0, 1, 1]), num_rows=2, backends=ALL)
    with pytest.raises(NotImplementedError, match=r"needs platform .cuda.*interpret=True"):
        jaxcsr.matmul(A, jnp.ones((3, 2)), impl="pallas_gpu")
    with pytest.raises(TypeError, match=r"pallas_gpu. supports bfloat16/float16/float32"):
        jaxcsr.matmul(A, jnp.ones((3, 2), jnp.int32), impl="pallas_gpu", interpret=True)


def test_strategy_preconditions(rng):
    A = CSRMatrix.from_dense(GENERAL)
    assert A.structure.layout.kind == "general"
    x = jnp.ones((A.shape[1], 2))
    with pytest.raises(ValueError, match="scatter"):
        xla_kernels.spmm(x, A.data, A.structure, strategy="scatter")
    with pytest.raises(ValueError, match="gather"):
        xla_kernels.spmm(x, A.data, A.structure, strategy="gather")
    with pytest.raises(ValueError, match="strategy must be one of"):
        xla_kernels.spmm(x, A.data, A.structure, strategy="nope")


def test_bad_reduce_arguments_are_named(rng):
    A = CSRMatrix.from_indices(np.array([0, 1, 1]), num_rows=2, backends=ALL)
    x = jnp.ones((3, 2))
    with pytest.raises(ValueError, match="reduce must be one of"):
        jaxcsr.matmul(A, x, reduce="prod")
    with pytest.raises(ValueError, match="return_arg=True needs reduce='max' or 'min'"):
        jaxcsr.matmul(A, x, reduce="sum", return_arg=True)
    with pytest.raises(TypeError, match="return_arg must be a bool"):
        jaxcsr.matmul(A, x, reduce="max", return_arg=1)
    with pytest.raises(TypeError, match="reduce='max' needs real dtypes"):
        jaxcsr.matmul(A, x.astype(jnp.complex64), reduce="max")


def test_mul_is_not_a_jaxcsr_reduce():
    A = jaxcsr.CSRMatrix.from_indices(np.array([0, 1, 0]), num_rows=2)
    with pytest.raises(ValueError, match="reduce must be one of"):
        jaxcsr.matmul(A, jnp.ones(3), reduce="mul")


def test_segment_functions_name_bad_arguments():
    v = jnp.ones((4, 2))
    with pytest.raises(TypeError, match="segment_ids must have an integer dtype"):
        jaxcsr.segment_sum(v, np.ones(4), 2)
    with pytest.raises(ValueError, match="segment_ids must be 1-D"):
        jaxcsr.segment_sum(v, np.zeros((2, 2), int), 2)
    with pytest.raises(ValueError, match=r"data.shape\[0\] must equal len\(segment_ids\) = 3"):
        jaxcsr.segment_sum(v, np.zeros(3, int), 2)
    with pytest.raises(ValueError, match="axis 2 is out of bounds"):
        jaxcsr.segment_sum(v, np.zeros(4, int), 2, axis=2)
    with pytest.raises(TypeError, match="num_segments must be an int"):
        jaxcsr.segment_sum(v, np.zeros(4, int), 2.5)
    zeros = jnp.zeros(4, jnp.int32)
    with pytest.raises(TypeError, match=r"num_segments must be given.*segment_ids are traced"):
        jax.jit(lambda ids: jaxcsr.segment_sum(v, ids))(zeros)
    with pytest.raises(TypeError, match="num_segments is a traced JAX value"):
        jax.jit(lambda ids, n: jaxcsr.segment_max(v, ids, n))(zeros, 2)
    with pytest.raises(TypeError, match="segment_ids must have an integer dtype"):
        jax.jit(lambda ids: jaxcsr.segment_softmax(v[:, 0], ids, 2))(zeros.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"data.shape\[0\] must equal len\(segment_ids\) = 3"):
        jax.jit(lambda ids: jaxcsr.segment_sum(v, ids, 2))(zeros[:3])
    with pytest.raises(ValueError, match="return_arg=True needs reduce='max' or 'min'"):
        jaxcsr.segment_mean(v, np.zeros(4, int), 2, return_arg=True)
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        jaxcsr.segment_softmax(jnp.ones(4, jnp.complex64), np.zeros(4, int), 1)
    with pytest.raises(TypeError, match="data must have a numeric dtype for segment_sum, got bool"):
        jaxcsr.segment_sum(np.ones(4, bool), np.zeros(4, int), 1)


def test_segment_prod_names_bad_arguments():
    v = jnp.ones((4, 2))
    with pytest.raises(TypeError, match="segment_ids must have an integer dtype"):
        jaxcsr.segment_prod(v, np.ones(4), 2)
    with pytest.raises(ValueError, match=r"data.shape\[0\] must equal len\(segment_ids\) = 3"):
        jaxcsr.segment_prod(v, np.zeros(3, int), 2)
    with pytest.raises(ValueError, match=r"segment_ids must be < num_segments = 2"):
        jaxcsr.segment_prod(v, np.array([0, 1, 2, 0]), 2, mode="check")
    with pytest.raises(ValueError, match="mode='check' needs concrete segment_ids"):
        jax.jit(lambda i: jaxcsr.segment_prod(v, i, 2, mode="check"))(jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="mode must be one of"):
        jaxcsr.segment_prod(v, np.zeros(4, int), 2, mode="wrap")


def test_edge_softmax_names_bad_arguments(rng):
    A = CSRMatrix.from_scipy(random_csr(rng, 5, 4, "uniform"))
    with pytest.raises(TypeError, match=r"A must be a jaxcsr\.CSRMatrix"):
        jaxcsr.edge_softmax(A.to_scipy(), np.ones(A.nnz))
    with pytest.raises(TypeError, match="scores must have a floating dtype"):
        jaxcsr.edge_softmax(A, np.ones(A.nnz, np.int32))
    with pytest.raises(ValueError, match=r"scores must have shape \(nnz, ...\)"):
        jaxcsr.edge_softmax(A, np.ones(A.nnz + 1, np.float32))
    with pytest.raises(ValueError, match=r"scores must have shape \(nnz, ...\)"):
        jaxcsr.edge_softmax(A, np.float32(1.0))


def test_sddmm_names_bad_input():
    B = CSRMatrix.from_dense(np.eye(3))
    with pytest.raises(ValueError, match=r"X.shape\[0\] must be A.shape\[0\] = 3"):
        jaxcsr.sddmm(B, np.ones((2, 4)), np.ones((3, 4)))
    with pytest.raises(ValueError, match="agree past the first axis"):
        jaxcsr.sddmm(B, np.ones((3, 4)), np.ones((3, 5)))
    with pytest.raises(TypeError, match="X must have a floating dtype"):
        jaxcsr.sddmm(B, np.ones((3, 4), np.int32), np.ones((3, 4)))
    with pytest.raises(TypeError, match=r"A must be a jaxcsr\.CSRMatrix"):
        jaxcsr.sddmm(np.eye(3), np.ones((3, 4)), np.ones((3, 4)))


def test_segment_order_checks_its_ids():
    with pytest.raises(ValueError, match="segment_ids must be < num_segments = 2"):
        jaxcsr.segment_order(np.array([0, 2]), 2)
    with pytest.raises(ValueError, match="segment_ids must be 1-D"):
        jaxcsr.segment_order(np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="segment_ids"):
        jaxcsr.segment_order(np.array([0.5]))
    with pytest.raises(TypeError, match="segment_order runs on the host"):
        jax.jit(jaxcsr.segment_order)(jnp.array([0, 1]))


def test_matrices_and_ragged_lists_are_named_where_arrays_belong():
    A = CSRMatrix.from_indices(np.array([0, 1, 1]), num_rows=2)
    with pytest.raises(TypeError, match=r"a CSRMatrix is not a dense array: use \.todense\(\)"):
        np.asarray(A)
    with pytest.raises(TypeError, match="data must be an array of numbers, got CSRMatrix"):
        jaxcsr.segment_sum(A, np.array([0, 1]), 2)
    with pytest.raises(TypeError, match="segment_ids must be an array of integers, got CSRMatrix"):
        jaxcsr.segment_sum(jnp.ones(2), A, 2)
    with pytest.raises(TypeError, match="segment_ids must be an array of integers, got list"):
        jaxcsr.segment_sum(jnp.ones(3), [[0, 1], [0]], 2)
    with pytest.raises(TypeError, match="segment_ids must be an array of integers, got list"):
        jaxcsr.segment_prod(jnp.ones(3), [[0, 1], [0]], 2)
    with pytest.raises(TypeError, match="data must be an array of numbers, got list"):
        jaxcsr.segment_max([[1.0, 2.0], [3.0]], np.array([0, 1]), 2)
    with pytest.raises(ValueError, match=r"to_scipy\(\) copies it to the host.*outside jax.jit"):
        jax.jit(lambda A: A.to_scipy())(A)
