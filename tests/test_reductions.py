"""``matmul(A, X, reduce=...)``: sum/mean/max/min (+ arg) on every path vs float64 refs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_sass import TRITON_CALL, export_for_cuda
from jax import export
from reference import (
    ALL,
    GPU_INTERPRET,
    assert_close,
    check_product_grads,
    dense_of,
    interpret_for,
    power_law_ids,
    random_csr,
    random_values,
    reduce_reference,
    tolerance,
)

import jaxcsr
from jaxcsr import CSRMatrix

PROGRAMS = Path(__file__).parent / "programs"  # scripts the tests run in a subprocess

REDUCES = ["sum", "mean", "max", "min"]
EXTREMES = ["max", "min"]
# (impl, interpret): the XLA path and both Pallas kernels in interpret mode.
PATHS = [("xla", False), ("pallas_gpu", GPU_INTERPRET), ("pallas_tpu", True)]


def structure(rng, kind: str) -> CSRMatrix:
    """Every structure class the XLA path distinguishes, with empty rows."""
    if kind == "segment":  # <= 1 nonzero per column: scatter strategy
        return CSRMatrix.from_indices(power_law_ids(rng, 150, 23), num_rows=23, backends=ALL)
    if kind == "sorted_segment":  # identity columns: CSR-kernel strategy for sums
        return CSRMatrix.from_indices(
            np.sort(power_law_ids(rng, 150, 23)), num_rows=23, backends=ALL
        )
    if kind == "gather":  # <= 1 nonzero per row
        return CSRMatrix.from_indices(power_law_ids(rng, 40, 23), num_rows=23, backends=ALL).T
    if kind == "weighted":  # general matrix with values
        return CSRMatrix.from_scipy(random_csr(rng, 19, 31, "power_law"), backends=ALL)
    if kind == "weighted_segment":  # values on the scatter structure
        idx = power_law_ids(rng, 90, 11)
        return CSRMatrix.from_indices(
            idx, num_rows=11, data=random_values(rng, (90,)), backends=ALL
        )
    if kind == "empty":
        return CSRMatrix.from_scipy(random_csr(rng, 6, 9, "empty"), backends=ALL)
    raise ValueError(kind)


KINDS = ["segment", "sorted_segment", "gather", "weighted", "weighted_segment", "empty"]


def check_arg(A, x, out, arg, reduce, dtype) -> None:
    """``arg`` names an entry of its row whose product equals ``out`` (sentinel if empty)."""
    m, n = A.shape
    arg = np.asarray(arg)
    assert arg.dtype == np.int32 and arg.shape == np.shape(out)
    dense = dense_of(A) if A.data is not None else None
    degree = np.diff(np.asarray(A.indptr))
    x = np.asarray(x, np.float64).reshape(n, -1)
    out = np.asarray(out, np.float64).reshape(m, -1)
    arg = arg.reshape(m, -1)
    assert np.all(arg[degree == 0] == n)
    rows, cols = np.nonzero(np.broadcast_to(degree[:, None] > 0, arg.shape))
    for i, f in zip(rows, cols, strict=True):
        j = arg[i, f]
        lo, hi = np.asarray(A.indptr)[i : i + 2]
        assert j in np.asarray(A.indices)[lo:hi], (i, f, j)
        value = x[j, f] * (1.0 if dense is None else dense[i, j])
        assert abs(value - out[i, f]) <= 2 * tolerance(dtype) * max(1, abs(out[i, f]))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduce", REDUCES)
def test_xla_path_matches_reference(rng, reduce, kind, dtype):
    A = structure(rng, kind)
    x = random_values(rng, (A.shape[1], 3, 2)).astype(dtype)
    out = jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="xla")
    assert out.shape == (A.shape[0], 3, 2)
    assert out.dtype == np.dtype(dtype) if A.data is None else out.dtype == np.float32
    expected, expected_arg = reduce_reference(A, x.reshape(A.shape[1], 6), reduce)
    assert_close(out.reshape(A.shape[0], 6), expected, dtype)
    if reduce in EXTREMES:
        out2, arg = jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, return_arg=True)
        np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
        if A.data is None and dtype == np.float32:  # exact values: exact arg
            np.testing.assert_array_equal(np.asarray(arg).reshape(-1, 6), expected_arg)
        check_arg(A, x, out, arg, reduce, dtype)


@pytest.mark.parametrize(
    "reduce,dtype",
    [
        ("mean", np.float32),
        ("mean", jnp.bfloat16),
        ("max", np.float32),
        ("max", jnp.bfloat16),
        ("min", np.float32),
    ],  # min shares max's code path; bfloat16 max covers the rounding
)
@pytest.mark.parametrize("kind", ["segment", "weighted"])
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_match_reference(rng, impl, reduce, kind, dtype):
    A = structure(rng, kind)
    x = random_values(rng, (A.shape[1], 5)).astype(dtype)
    out = jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl=impl, interpret=interpret_for(impl))
    expected, _ = reduce_reference(A, x, reduce)
    assert_close(out, expected, dtype)
    if reduce in EXTREMES:  # max/min are exact: every path gives the same bits
        xla = jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="xla")
        np.testing.assert_array_equal(np.asarray(out), np.asarray(xla))
        _, arg = jaxcsr.matmul(
            A,
            jnp.asarray(x),
            reduce=reduce,
            impl=impl,
            interpret=interpret_for(impl),
            return_arg=True,
        )
        check_arg(A, x, out, arg, reduce, dtype)


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("sorted_segment", np.float32),
        ("gather", np.float32),  # a row gather: XLA under every impl
        ("weighted_segment", np.float16),  # float16 through the MXU path as float32
        ("empty", np.float32),  # nnz = 0
    ],
)
@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_on_every_structure_class(rng, impl, reduce, kind, dtype):
    A = structure(rng, kind)
    x = random_values(rng, (A.shape[1], 3)).astype(dtype)
    out = jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl=impl, interpret=interpret_for(impl))
    expected, _ = reduce_reference(A, x, reduce)
    assert out.dtype == (np.dtype(dtype) if A.data is None else np.float32)
    assert_close(out, expected, dtype)
    if reduce == "max":
        xla = jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="xla")
        np.testing.assert_array_equal(np.asarray(out), np.asarray(xla))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_with_zero_features_and_vmapped_values(rng, impl):
    A = structure(rng, "weighted")
    empty = jaxcsr.matmul(A, jnp.zeros((A.shape[1], 0)), impl=impl, interpret=interpret_for(impl))
    assert empty.shape == (A.shape[0], 0)
    x = random_values(rng, (A.shape[1], 2)).astype(np.float32)
    datas = random_values(rng, (2, A.nnz)).astype(np.float32)

    def product(d):
        return jaxcsr.matmul(
            A.with_data(d), jnp.asarray(x), impl=impl, interpret=interpret_for(impl)
        )

    out = jax.vmap(product)(jnp.asarray(datas))
    rows = np.repeat(np.arange(A.shape[0]), np.diff(np.asarray(A.indptr)))
    for b in range(2):
        dense = np.zeros(A.shape)
        np.add.at(dense, (rows, np.asarray(A.indices)), datas[b].astype(np.float64))
        assert_close(out[b], dense @ x.astype(np.float64), np.float32)


@pytest.mark.parametrize("impl,interpret", PATHS)
@pytest.mark.parametrize("reduce", EXTREMES)
def test_ties_go_to_the_smallest_column(rng, reduce, impl, interpret):
    idx = power_law_ids(rng, 200, 9)
    A = CSRMatrix.from_indices(idx, num_rows=9, backends=ALL)
    x = rng.integers(-2, 3, size=(200, 4)).astype(np.float32)  # many ties
    out, arg = jaxcsr.matmul(
        A, jnp.asarray(x), reduce=reduce, return_arg=True, impl=impl, interpret=interpret
    )
    expected, expected_arg = reduce_reference(A, x, reduce)
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(arg), expected_arg)
    # the documented rule, stated directly: first position of the segment attaining it
    for i in range(9):
        members = np.flatnonzero(idx == i)
        for f in range(4):
            if members.size:
                target = x[members, f].max() if reduce == "max" else x[members, f].min()
                assert arg[i, f] == members[np.flatnonzero(x[members, f] == target)[0]]


@pytest.mark.parametrize("impl,interpret", PATHS)
@pytest.mark.parametrize("reduce", REDUCES)
def test_infinities_and_nan(reduce, impl, interpret):
    #            row 0         row 1          row 2         row 3 (empty) row 4
    idx = np.array([0, 0, 0, 1, 1, 2, 2, 2, 4, 4])
    x = np.array([1.5, np.nan, -3.0, np.inf, -np.inf, -np.inf, -np.inf, -np.inf, 2.0, np.inf])
    x = np.stack([x, -x], axis=1).astype(np.float32)
    A = CSRMatrix.from_indices(idx, num_rows=5, backends=ALL)
    out = jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl=impl, interpret=interpret)
    expected, expected_arg = reduce_reference(A, x, reduce)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(np.asarray(out), expected.astype(np.float32))
    assert np.isnan(out[0]).all()  # NaN propagates into every reduce
    assert np.all(out[3] == 0)  # empty row
    if reduce in EXTREMES:
        # a row of -inf is not empty: its max is -inf, not 0
        assert out[2, 0] == -np.inf and out[2, 1] == np.inf
        _, arg = jaxcsr.matmul(
            A, jnp.asarray(x), reduce=reduce, return_arg=True, impl=impl, interpret=interpret
        )
        np.testing.assert_array_equal(np.asarray(arg), expected_arg)
        assert arg[0, 0] == 1 and arg[3, 0] == 10


@pytest.mark.parametrize("reduce", EXTREMES)
def test_integer_max_min_and_floor_mean(rng, reduce):
    idx = power_law_ids(rng, 60, 7)
    A = CSRMatrix.from_indices(idx, num_rows=7, backends=ALL)
    x = rng.integers(-50, 50, size=(60, 3)).astype(np.int32)
    out, arg = jaxcsr.matmul(A, x, reduce=reduce, return_arg=True)
    expected, expected_arg = reduce_reference(A, x, reduce)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(arg), expected_arg)
    mean = jaxcsr.matmul(A, x, reduce="mean")
    total = np.zeros((7, 3), np.int64)
    np.add.at(total, idx, x)
    count = np.maximum(np.bincount(idx, minlength=7), 1)[:, None]
    np.testing.assert_array_equal(np.asarray(mean), np.floor_divide(total, count))


def _separated_products(rng, idx: np.ndarray, weights: np.ndarray, n_features: int):
    """``x`` whose products ``weights[j] * x[j]`` differ by >= 0.5 within each segment.

    Only entries of the same segment compete for its max, so a 1e-3 perturbation of
    the weights and of ``x`` (``check_grads``) cannot flip a winner.
    """
    products = np.empty((idx.size, n_features))
    for segment in np.unique(idx):
        members = np.flatnonzero(idx == segment)
        for f in range(n_features):
            products[members, f] = rng.permutation(members.size) * 0.5 - 1.0
    return (products / weights[:, None]).astype(np.float32)


@pytest.mark.parametrize("impl,interpret", PATHS)
@pytest.mark.parametrize("reduce", EXTREMES)
def test_gradients_reach_the_arg_positions_only(rng, reduce, impl, interpret):
    idx = power_law_ids(rng, 80, 10)
    weights = rng.uniform(0.5, 2.0, 80)
    A = CSRMatrix.from_indices(idx, num_rows=10, data=weights, backends=ALL)
    x = jnp.asarray(_separated_products(rng, idx, weights, 3))
    ct = random_values(rng, (10, 3)).astype(np.float32)

    def loss(data, x):
        out = jaxcsr.matmul(A.with_data(data), x, reduce=reduce, impl=impl, interpret=interpret)
        return jnp.sum(out * ct)

    g_data, g_x = jax.grad(loss, argnums=(0, 1))(A.data, x)
    _, arg = jaxcsr.matmul(A, x, reduce=reduce, return_arg=True)
    arg, order = np.asarray(arg), np.asarray(A.input_order)
    data_in = np.empty(80)
    data_in[order] = np.asarray(A.data)  # weights in input order (column j)
    expected_x = np.zeros((80, 3))
    expected_data_in = np.zeros(80)
    for i in range(10):
        for f in range(3):
            j = arg[i, f]
            if j < 80:
                expected_x[j, f] += ct[i, f] * data_in[j]
                expected_data_in[j] += ct[i, f] * float(x[j, f])
    assert_close(g_x, expected_x, np.float32)
    assert_close(g_data, expected_data_in[order], np.float32)  # CSR order
    if impl == "xla":
        f = lambda d, x: jaxcsr.matmul(A.with_data(d), x, reduce=reduce)  # noqa: E731
        jax.test_util.check_grads(f, (A.data, x), order=1, modes=("fwd", "rev"), eps=1e-3)


@pytest.mark.parametrize("kind", ["general", "general_transposed", "gather", "sorted_segment"])
@pytest.mark.parametrize("reduce", EXTREMES)
def test_max_min_gradients_on_every_structure(rng, reduce, kind):
    """Forward- and reverse-mode max/min gradients (w.r.t. X and the values) against
    finite differences on matrices not built by an unsorted from_indices."""
    if kind.startswith("general"):
        A = CSRMatrix.from_scipy(random_csr(rng, 12, 20, "power_law"))
        A = A.T if kind == "general_transposed" else A
        assert A.structure.layout.kind == "general"
    elif kind == "gather":
        A = CSRMatrix.from_indices(power_law_ids(rng, 20, 12), num_rows=12).T
    else:
        A = CSRMatrix.from_indices(np.sort(power_law_ids(rng, 40, 12)), num_rows=12)
    n = A.shape[1]
    # distinct columns 0.05 apart in [-1, 1] and values within 1 % of 1: every product
    # in a row differs from the others by > 0.02, so a 1e-3 perturbation flips no
    # winner, and float32 finite differences of O(1) values stay accurate (with
    # columns up to 10 apart, the one-valued check missed rtol 2e-3 on seed 1784492529)
    x = np.stack([rng.permutation(n) * 0.05 - n * 0.025 for _ in range(3)], axis=1)
    data = rng.uniform(0.99, 1.01, A.nnz)

    def f(d, v):
        return jaxcsr.matmul(A.with_data(d), v, reduce=reduce)

    args = (jnp.asarray(data, jnp.float32), jnp.asarray(x, jnp.float32))
    jax.test_util.check_grads(f, args, order=1, modes=("fwd", "rev"), eps=1e-3)
    one_valued = (lambda v: jaxcsr.matmul(A, v, reduce=reduce)) if A.data is None else None
    if one_valued is not None:
        jax.test_util.check_grads(one_valued, args[1:], order=1, modes=("fwd", "rev"), eps=1e-3)


def test_mean_gradient_is_exact(rng):
    A = CSRMatrix.from_scipy(random_csr(rng, 13, 17, "empty_rows"), backends=ALL)
    x = jnp.asarray(random_values(rng, (17, 2)), jnp.float32)
    ct = random_values(rng, (13, 2))
    degree = np.maximum(np.diff(np.asarray(A.indptr)), 1)[:, None]
    g = jax.grad(lambda x: jnp.sum(jaxcsr.matmul(A, x, reduce="mean") * ct))(x)
    assert_close(g, dense_of(A).T @ (ct / degree), np.float32)
    check_product_grads(lambda w, x: jaxcsr.matmul(A.with_data(w), x, reduce="mean"), (A.data, x))


@pytest.mark.parametrize("reduce", REDUCES)
def test_jit_vmap_and_scan(rng, reduce):
    idx = power_law_ids(rng, 50, 8)
    A = CSRMatrix.from_indices(idx, num_rows=8, backends=ALL)
    xs = jnp.asarray(random_values(rng, (4, 50, 3)), jnp.float32)
    per_item = jnp.stack([jaxcsr.matmul(A, x, reduce=reduce) for x in xs])
    f = jax.jit(lambda A, x: jaxcsr.matmul(A, x, reduce=reduce))
    assert_close(jax.vmap(f, in_axes=(None, 0))(A, xs), per_item, np.float32)
    # batched matrix values (vmap over with_data)
    ws = jnp.asarray(rng.uniform(0.5, 2, (3, 50)), jnp.float32)
    batched = jax.vmap(lambda w: jaxcsr.matmul(A.with_data(w), xs[0], reduce=reduce))(ws)
    for b in range(3):
        ref, _ = reduce_reference(A.with_data(ws[b]), np.asarray(xs[0]), reduce)
        assert_close(batched[b], ref, np.float32)
    _, scanned = jax.lax.scan(lambda c, x: (c, jaxcsr.matmul(A, x, reduce=reduce)), 0, xs)
    assert_close(scanned, per_item, np.float32)


@pytest.mark.parametrize("reduce", EXTREMES)
def test_max_min_kernels_lower_for_hardware(rng, reduce):
    A = CSRMatrix.from_indices(power_law_ids(rng, 300, 40), num_rows=40, backends=ALL)
    spec = jax.ShapeDtypeStruct((300, 128), jnp.float32)
    gpu = lambda x: jaxcsr.matmul(A, x, reduce=reduce, impl="pallas_gpu")  # noqa: E731
    assert TRITON_CALL in export_for_cuda(gpu, spec).mlir_module()
    tpu = jax.jit(lambda x: jaxcsr.matmul(A, x, reduce=reduce, impl="pallas_tpu"))
    assert "tpu_custom_call" in export.export(tpu, platforms=["tpu"])(spec).mlir_module()


def _tied(rng, kind: str) -> CSRMatrix:
    """A matrix of ``kind`` whose row products tie often: small integer values."""
    if kind == "duplicates":  # repeated coordinates: equal products, separate entries
        rows, cols = rng.integers(0, 7, 60), rng.integers(0, 5, 60)
        A = CSRMatrix.from_coo(rows, cols, rng.choice([1.0, 2.0], 60), shape=(9, 5), backends=ALL)
    else:
        A = structure(rng, kind)
    if A.data is not None:
        A = A.with_data(jnp.asarray(rng.choice([1.0, 2.0], A.nnz), jnp.float32))
    return A


@pytest.mark.parametrize(
    "reduce,impl,interpret",
    [("max", "xla", False), ("min", "xla", False), ("max", *PATHS[1]), ("min", *PATHS[2])],
)
def test_tied_extremes_send_the_gradient_to_the_first_entry_only(rng, reduce, impl, interpret):
    """The documented tie rule for gradients: among entries of a row attaining the
    max/min, only the first in CSR order (the smallest column) gets the cotangent,
    for X and for the values, in reverse and forward mode."""
    kinds = ["segment", "weighted"]  # interpret mode is slow: the two kernel layouts
    if impl == "xla":
        kinds += ["sorted_segment", "weighted_segment", "duplicates", "gather", "empty"]
    # jit the XLA path (one compile per kind); interpret-mode kernels run faster eagerly
    staged = jax.jit if impl == "xla" else (lambda fn: fn)
    for kind in kinds:
        A = _tied(rng, kind)
        m, n = A.shape
        x = rng.integers(-2, 3, size=(n, 3)).astype(np.float32)  # many ties
        # integer cotangents: the data gradient, sum_f ct * x, is exact in float32, so it
        # matches the float64 reference to rtol 1e-6 even where its terms cancel
        ct = rng.choice([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0], size=(m, 3)).astype(np.float32)
        indptr, indices = np.asarray(A.indptr), np.asarray(A.indices)
        data = np.ones(A.nnz) if A.data is None else np.asarray(A.data, np.float64)
        want_x, want_data = np.zeros((n, 3)), np.zeros(A.nnz)
        ties = 0
        for i in range(m):
            lo, hi = indptr[i], indptr[i + 1]
            for f in range(3):
                if lo == hi:
                    continue
                products = data[lo:hi] * x[indices[lo:hi], f]
                target = products.max() if reduce == "max" else products.min()
                hits = np.flatnonzero(products == target)
                ties += hits.size > 1
                k = lo + hits[0]
                want_x[indices[k], f] += ct[i, f] * data[k]
                want_data[k] += ct[i, f] * x[indices[k], f]

        def loss(d, v, A=A, ct=ct):
            B = A if d is None else A.with_data(d)
            out = jaxcsr.matmul(B, v, reduce=reduce, impl=impl, interpret=interpret)
            return jnp.sum(out * ct)

        if kind not in ("gather", "empty"):
            assert ties > 0, kind  # the test must contain ties to pin the rule
        if A.data is None:
            g_x = staged(jax.grad(loss, argnums=1))(A.data, jnp.asarray(x))
        else:
            g_data, g_x = staged(jax.grad(loss, argnums=(0, 1)))(A.data, jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(g_x), want_x, rtol=1e-6, atol=1e-6, err_msg=kind)
        if A.data is not None:
            np.testing.assert_allclose(np.asarray(g_data), want_data, rtol=1e-6, err_msg=kind)
        if impl != "xla":
            continue  # the tangent rule is one XLA computation whatever impl gave `out`
        # forward mode: the tangent of out[i, f] is the tangent at the first hit only
        dx = random_values(rng, (n, 3)).astype(np.float32)

        def product(v, A=A):
            return jaxcsr.matmul(A, v, reduce=reduce, impl=impl, interpret=interpret)

        jvp = staged(lambda v, dv, product=product: jax.jvp(product, (v,), (dv,)))
        _, tangent = jvp(jnp.asarray(x), jnp.asarray(dx))
        want_t = np.zeros((m, 3))
        for i in range(m):
            lo, hi = indptr[i], indptr[i + 1]
            for f in range(3 if hi > lo else 0):
                products = data[lo:hi] * x[indices[lo:hi], f]
                target = products.max() if reduce == "max" else products.min()
                k = lo + np.flatnonzero(products == target)[0]
                want_t[i, f] = data[k] * dx[indices[k], f]
        np.testing.assert_allclose(np.asarray(tangent), want_t, rtol=1e-6, atol=1e-6, err_msg=kind)


INT8 = (jnp.int8, [100, 100, 7], [100, 7])  # the int8 sum 200 overflowed to -28


F16 = (jnp.float16, [40000.0, 40000.0, 1.5], [40000.0, 1.5])  # the f16 sum was inf


@pytest.mark.parametrize(
    "dtype,values,expected,impl,interpret",
    [(*INT8, "xla", False), (*F16, "xla", False), (*F16, "pallas_gpu", GPU_INTERPRET)],
)
def test_mean_divides_before_rounding(dtype, values, expected, impl, interpret):
    A = CSRMatrix.from_indices(np.array([0, 0, 1]), num_rows=2, backends=ALL)
    x = jnp.asarray(values, dtype)
    out = jaxcsr.matmul(A, x, reduce="mean", impl=impl, interpret=interpret)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-2)
    seg = jaxcsr.segment_mean(x, np.array([0, 0, 1]), 2)
    np.testing.assert_array_equal(np.asarray(seg), np.asarray(out))


def test_x64_kernels_and_float64_reductions():
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(PROGRAMS / "x64_reductions.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
