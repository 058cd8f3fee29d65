"""What a matrix holds and when it compiles: the backend registry, per-backend plans,
``plan_info``, device bytes per nonzero, and one trace per (shape, nnz, class)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp
from reference import (
    ALL,
    assert_close,
    assert_sums_close,
    dense_of,
    entry_rows,
    power_law_ids,
    random_values,
    softmax_reference,
)

import jaxcsr
from jaxcsr import CSRMatrix, kernels


def _leaf_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))


# ----------------------------------------------------------------- registry
def test_registry_and_defaults():
    assert set(kernels.BACKENDS) == {"xla", "pallas_gpu", "pallas_tpu", "cpu"}
    assert kernels.BACKENDS["pallas_gpu"].platform == "cuda"
    assert kernels.BACKENDS["pallas_tpu"].platform == "tpu"
    assert kernels.BACKENDS["cpu"].platform == "cpu"
    assert kernels.default_backends("cpu") == ("xla", "cpu")
    assert kernels.default_backends("gpu") == ("xla", "pallas_gpu")
    assert kernels.default_backends("tpu") == ("xla", "pallas_tpu")
    assert kernels.resolve_backends(None) == tuple(sorted(kernels.default_backends()))
    assert kernels.resolve_backends("pallas_gpu") == ("pallas_gpu", "xla")  # xla always
    assert not kernels.BACKENDS["pallas_gpu"].coverage.supports(np.float32, np.int32)
    assert kernels.BACKENDS["xla"].coverage.supports(np.int8, np.float64)


def test_default_matrix_plans_only_the_default_backend(rng):
    A = CSRMatrix.from_indices(power_law_ids(rng, 200, 17), num_rows=17)
    assert A.backends == tuple(sorted(kernels.default_backends()))
    if jax.default_backend() == "cpu":
        assert A.backends == ("cpu", "xla")
        assert A.index.plans == {"cpu": None, "xla": None}  # no kernel arrays held on CPU


def test_segment_functions_plan_the_kernel_they_are_asked_for(rng):
    idx = power_law_ids(rng, 60, 9)
    x = jnp.asarray(random_values(rng, (60, 3)).astype(np.float32))
    # planned on demand: the kernel is chosen (and cannot run on CPU without interpret)
    with pytest.raises(NotImplementedError, match="impl='pallas_gpu' needs platform 'cuda'"):
        jaxcsr.segment_sum(x, idx, 9, impl="pallas_gpu")
    assert jaxcsr.segment_matrix(idx, 9, backends=["pallas_gpu"]).backends == ("pallas_gpu", "xla")


# ------------------------------------------------------------ what is held
def test_one_valued_from_indices_holds_at_most_12_bytes_per_id(rng):
    """Device bytes of a one-valued segment matrix planned for XLA (deterministic):
    the ids, their stable argsort and the row pointer; nothing for the transpose."""
    K, M = 200_000, 10_000
    idx = power_law_ids(rng, K, M)
    A = CSRMatrix.from_indices(idx, num_rows=M, backends=["xla"])
    held = _leaf_bytes(A)
    assert held / K <= 12
    assert held == 4 * K + 4 * K + 4 * (M + 1)  # row_of_col, indices, indptr
    info = A.plan_info()
    assert sum(info.arrays.values()) == held and info.bytes_per_nnz == held / K
    assert info.strategies["forward, xla on cpu"] == "scatter"
    assert info.strategies["transpose, xla on cpu"] == "gather"
    # forward and backward both work from those arrays alone
    x = jnp.asarray(random_values(rng, (K, 2)).astype(np.float32))
    ct = jnp.asarray(random_values(rng, (M, 2)).astype(np.float32))
    out, vjp = jax.vjp(lambda v: A @ v, x)
    expected, magnitude = np.zeros((M, 2)), np.zeros((M, 2))
    np.add.at(expected, idx, np.asarray(x, np.float64))
    np.add.at(magnitude, idx, np.abs(np.asarray(x, np.float64)))
    # the hub rows hold thousands of ids: XLA's scatter sums them in float32 one by one
    assert_sums_close(out, expected, magnitude, np.float32)
    assert_close(vjp(ct)[0], np.asarray(ct, np.float64)[idx], np.float32)
    # sorted ids store no argsort at all
    S = CSRMatrix.from_indices(np.sort(idx), num_rows=M, backends=["xla"])
    assert _leaf_bytes(S) == 4 * K + 4 * (M + 1)


def test_kernel_plans_are_held_only_when_asked_for(rng):
    idx = power_law_ids(rng, 1000, 50)
    xla = CSRMatrix.from_indices(idx, num_rows=50, backends=["xla"])
    gpu = CSRMatrix.from_indices(idx, num_rows=50, backends=["xla", "pallas_gpu"])
    info = gpu.plan_info(n_features=64)
    kernel_arrays = {k for k in info.arrays if k.startswith("pallas_gpu")}
    assert kernel_arrays == {
        f"pallas_gpu.lanes.{name}"
        for name in (
            "row",
            "start",
            "end",
            "num_short",
            "chunk_start",
            "chunk_end",
            "group_start",
            "group_end",
        )
    }
    assert _leaf_bytes(gpu) - _leaf_bytes(xla) == sum(info.arrays[k] for k in kernel_arrays)
    assert info.strategies["forward, pallas_gpu"].startswith("kernel: ")
    assert "lane utilisation" in info.strategies["forward, pallas_gpu"]
    assert "TileConfig(block_m=16" in info.strategies["forward, pallas_gpu"]
    assert info.strategies["transpose, pallas_gpu"].startswith("xla gather")
    assert "pallas_tpu" not in info.backends
    general = CSRMatrix.from_dense(np.arange(1.0, 13.0).reshape(3, 4), backends=ALL)
    names = set(general.plan_info().arrays)
    assert {"pallas_gpu.t_lanes.row", "pallas_tpu.t_tiles.span", "core.t_perm"} <= names
    assert "core.row_of_col" not in names


def test_plan_info_reports_general_extra_bytes(rng):
    mat = sp.random_array((300, 400), density=0.05, format="csr", rng=rng)
    A = CSRMatrix.from_scipy(mat, backends=["xla"])
    info = A.plan_info()
    assert info.kind == "general"
    core = {"core.indptr", "core.indices", "data"}
    extra = sum(v for k, v in info.arrays.items() if k not in core)
    # beyond data + indices + indptr: the transpose's row pointer, indices and permutation
    assert extra == 4 * (400 + 1) + 8 * A.nnz
    assert info.strategies["transpose, xla on gpu/tpu"] == "segment"
    assert "transposed view" in A.T.plan_info().kind
    assert "B/nnz" in str(info)


# ------------------------------------------------------------- compilation
def _segment_structures(rng, num_rows, size):
    """Same (num_rows, len(ids)), different row-length distributions."""
    uniform = rng.integers(0, num_rows, size)
    skewed = power_law_ids(rng, size, num_rows)
    one_hub = np.where(rng.random(size) < 0.7, rng.integers(0, num_rows), uniform)
    few_rows = rng.integers(0, 3, size)  # most rows empty
    return [uniform, skewed, one_hub, few_rows]


@pytest.mark.parametrize(
    "impl,interpret,sizes",
    [("xla", False, (300, 5000)), ("pallas_gpu", True, (40, 300)), ("pallas_tpu", True, (40, 300))],
)
def test_one_trace_for_segment_matrices_of_equal_shape(rng, impl, interpret, sizes):
    """Random segment ids with different degree distributions share one trace of a
    jitted forward + backward, on the XLA path and each kernel (interpret mode)."""
    num_rows, size = sizes
    traces = []

    @jax.jit
    def step(A, x, ct):
        traces.append(1)
        out, vjp = jax.vjp(lambda v: jaxcsr.matmul(A, v, impl=impl, interpret=interpret), x)
        return out, vjp(ct)[0]

    x = jnp.asarray(random_values(rng, (size, 3)).astype(np.float32))
    ct = jnp.asarray(random_values(rng, (num_rows, 3)).astype(np.float32))
    for ids in _segment_structures(rng, num_rows, size):
        A = CSRMatrix.from_indices(ids, num_rows=num_rows, backends=ALL)
        out, grad = step(A, x, ct)
        expected = np.zeros((num_rows, 3))
        np.add.at(expected, ids, np.asarray(x, np.float64))
        assert_close(out, expected, np.float32)
        assert_close(grad, np.asarray(ct, np.float64)[ids], np.float32)
    assert len(traces) == 1


@pytest.mark.parametrize(
    "impl,interpret,sizes",
    [
        ("xla", False, (1000, 5000)),
        ("pallas_gpu", True, (60, 300)),
        ("pallas_tpu", True, (60, 300)),
    ],
)
def test_one_trace_for_random_graphs_of_equal_shape_and_nnz(rng, impl, interpret, sizes):
    """General matrices (random COO graphs, one with a hub row) of one shape and nnz:
    one trace of forward + both gradients, results checked against dense float64."""
    n, nnz = sizes
    traces = []

    @jax.jit
    def step(A, x, ct):
        traces.append(1)

        def f(d, v):
            return jaxcsr.matmul(A.with_data(d), v, impl=impl, interpret=interpret)

        out, vjp = jax.vjp(f, A.data, x)
        return out, *vjp(ct)

    x = random_values(rng, (n, 2)).astype(np.float32)
    ct = random_values(rng, (n, 2)).astype(np.float32)
    for hub in (False, True, False):
        row, col = rng.integers(0, n, nnz), rng.integers(0, n, nnz)
        if hub:
            row[: nnz // 3] = 0
        vals = random_values(rng, (nnz,)).astype(np.float32)
        A = CSRMatrix.from_coo(row, col, vals, shape=(n, n), backends=ALL)
        out, d_data, d_x = step(A, jnp.asarray(x), jnp.asarray(ct))
        dense = dense_of(A)
        assert_close(out, dense @ x.astype(np.float64), np.float32)
        assert_close(d_x, dense.T @ ct.astype(np.float64), np.float32)
        rows = np.asarray(A.structure.row_ids())
        cols = np.asarray(A.indices)
        assert_close(d_data, np.sum(ct[rows] * x[cols], axis=1, dtype=np.float64), np.float32)
    assert len(traces) == 1


# ------------------------------------------------------ a backend added later
@pytest.fixture
def toy_backend():
    """A backend registered from user code: a segment reduction over row ids it plans
    on the host. It covers untransposed views only (transposes run on the fallback)
    and counts the products it is asked for."""
    from jaxcsr import plan as host_plan

    calls = []

    def toy_plan(structure):
        indptr, _ = host_plan.host_csr(structure)
        return {"rows": host_plan.row_ids(indptr)}

    def toy_product(x, data, view, toy, *, reduce, out_dtype, interpret, platform):
        calls.append(reduce)
        values = x[view.view_indices()].astype(jnp.float32)
        if data is not None:
            values = values * data.astype(jnp.float32)[:, None]
        m = view.shape[0]
        if reduce == "sum":
            return jax.ops.segment_sum(values, toy["rows"], m).astype(out_dtype)
        fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = fn(values, toy["rows"], m)
        return jnp.where(view.degrees()[:, None] > 0, out, 0).astype(out_dtype)

    def toy_describe(view, n_features):
        return {"toy": "segment reduction" if not view.transposed else "fallback"}

    backend = kernels.Backend(
        "toy",
        None,
        toy_plan,
        toy_product,
        toy_describe,
        kernels.Coverage((np.dtype(np.float32),), covers=lambda view: not view.transposed),
    )
    kernels.register(backend)
    yield calls
    del kernels.BACKENDS["toy"]


def test_a_backend_registered_later_works_end_to_end(rng, toy_backend):
    assert "toy" in jaxcsr.IMPLS and "toy" in tuple(jaxcsr.IMPLS)
    dense = random_values(rng, (9, 14)) * (rng.random((9, 14)) < 0.4)
    dense[3] = 0  # an empty row
    A = CSRMatrix.from_dense(dense.astype(np.float32), backends=["toy"])
    assert A.backends == ("toy", "xla")
    assert set(A.index.plans["toy"]) == {"rows"}
    assert A.plan_info().strategies["forward, toy"] == "segment reduction"
    x = jnp.asarray(random_values(rng, (14, 3)).astype(np.float32))
    want = dense_of(A) @ np.asarray(x, np.float64)
    assert_close(jaxcsr.matmul(A, x, impl="toy"), want, np.float32)
    degrees = np.maximum((dense_of(A) != 0).sum(1), 1)[:, None]
    assert_close(jaxcsr.matmul(A, x, reduce="mean", impl="toy"), want / degrees, np.float32)
    for reduce in ("max", "min"):
        got = jaxcsr.matmul(A, x, reduce=reduce, impl="toy", return_arg=True)
        want = jaxcsr.matmul(A, x, reduce=reduce, impl="xla", return_arg=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert toy_backend == ["sum", "sum", "max", "min"]  # the mean divides its sum

    # gradients: the transpose is not covered, so the fallback runs it
    def loss(x, data):
        return jnp.sum(jnp.sin(jaxcsr.matmul(A.with_data(data), x, impl="toy")))

    def reference(x, data):
        return jnp.sum(jnp.sin(jaxcsr.matmul(A.with_data(data), x, impl="xla")))

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, A.data)
    want = jax.grad(reference, argnums=(0, 1))(x, A.data)
    assert_close(got[0], want[0], np.float32)
    assert_close(got[1], want[1], np.float32)
    # the segment functions plan the backend they are asked for
    idx = power_law_ids(rng, 40, 6)
    v = jnp.asarray(random_values(rng, (40, 2)).astype(np.float32))
    before = len(toy_backend)
    want = np.zeros((6, 2))
    np.add.at(want, idx, np.asarray(v, np.float64))
    assert_close(jaxcsr.segment_sum(v, idx, 6, impl="toy"), want, np.float32)
    assert len(toy_backend) == before + 1
    with pytest.raises(TypeError, match="impl='toy' supports float32"):
        jaxcsr.matmul(A, x.astype(jnp.float16), impl="toy")


def test_a_backend_with_host_plans_only_is_left_out_of_traced_ids(rng, toy_backend):
    """A registered backend whose plan takes host structures only
    (``Capabilities.plans_traced`` False): matrices of traced ids that ask for it
    raise, naming it, before any device work; the row pattern of a softmax over its
    matrix leaves it out."""
    ids = power_law_ids(rng, 30, 5).astype(np.int32)

    def build(i):
        return CSRMatrix.from_indices(i, 5, backends=["toy"]).index.plans

    with pytest.raises(ValueError, match="'toy' cannot be planned on the device"):
        jax.jit(build)(jnp.asarray(ids))
    assert set(jax.jit(lambda i: CSRMatrix.from_indices(i, 5).index.plans)(ids)) == {
        *kernels.default_backends()
    }
    A = CSRMatrix.from_indices(ids, 5, backends=["toy"])
    scores = random_values(rng, (30,)).astype(np.float32)
    got = jax.jit(jaxcsr.edge_softmax)(A, jnp.asarray(scores))
    assert_close(got, softmax_reference(scores, entry_rows(A), 5), np.float32)
