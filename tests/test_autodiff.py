"""jit / grad / jvp / vmap / scan / linear_transpose through the csr_matmul primitive."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    assert_close,
    check_product_grads,
    dense_of,
    power_law_ids,
    random_csr,
    random_values,
)

from jaxcsr import CSRMatrix, matmul, ops


def _matrices(rng):
    idx = power_law_ids(rng, 150, 23)
    yield "segment", CSRMatrix.from_indices(idx, num_rows=23)
    yield "segment_sorted", CSRMatrix.from_indices(np.sort(idx), num_rows=23)
    yield "segment_weighted", CSRMatrix.from_indices(idx, 23, data=random_values(rng, (150,)))
    yield "gather", CSRMatrix.from_indices(idx, 23, data=random_values(rng, (150,))).T
    yield "general", CSRMatrix.from_scipy(random_csr(rng, 29, 150, "power_law"))


KINDS = ["segment", "segment_sorted", "segment_weighted", "gather", "general"]


def _matrix(rng, kind):
    return dict(_matrices(rng))[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_grad_wrt_dense_operand(rng, kind):
    A = _matrix(rng, kind)
    x = random_values(rng, (A.shape[1], 4)).astype(np.float32)
    ct = random_values(rng, (A.shape[0], 4)).astype(np.float32)
    g = jax.grad(lambda x: jnp.sum((A @ x) * ct))(jnp.asarray(x))
    assert_close(g, dense_of(A).T @ ct.astype(np.float64), np.float32)
    # second-order finite differences of float32 outputs err by ~ulp(|A x|) / eps^2:
    # check them at a small x, where that stays far below the tolerance
    check_product_grads(lambda x: A @ x, (jnp.asarray(x) / 8,), order=2)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_wrt_matrix_data(rng, kind):
    A = _matrix(rng, kind)
    w = random_values(rng, (A.nnz,)).astype(np.float32)
    x = random_values(rng, (A.shape[1], 3)).astype(np.float32)
    ct = random_values(rng, (A.shape[0], 3)).astype(np.float32)
    g = jax.grad(lambda w: jnp.sum((A.with_data(w) @ x) * ct))(jnp.asarray(w))
    rows = np.repeat(np.arange(A.shape[0]), np.diff(np.asarray(A.indptr)))
    cols = np.asarray(A.indices)
    expected = np.sum(ct[rows].astype(np.float64) * x[cols].astype(np.float64), axis=1)
    assert_close(g, expected, np.float32)
    check_product_grads(lambda w: A.with_data(w) @ x, (jnp.asarray(w),), order=2)


def test_grad_through_both_operands_and_jvp(rng):
    A = _matrix(rng, "general")
    w = jnp.asarray(random_values(rng, (A.nnz,)), jnp.float32)
    x = jnp.asarray(random_values(rng, (A.shape[1], 2)), jnp.float32)
    check_product_grads(lambda w, x: A.with_data(w) @ x, (w, x), order=1)
    dw = jnp.asarray(random_values(rng, (A.nnz,)), jnp.float32)
    dx = jnp.asarray(random_values(rng, x.shape), jnp.float32)
    _, tangent = jax.jvp(lambda w, x: A.with_data(w) @ x, (w, x), (dw, dx))
    expected = A.with_data(dw) @ x + A.with_data(w) @ dx
    assert_close(tangent, np.asarray(expected, np.float64), np.float32)


def test_grad_with_16_bit_inputs(rng):
    A = _matrix(rng, "segment")
    x = jnp.asarray(random_values(rng, (A.shape[1], 4)), jnp.bfloat16)
    g = jax.grad(lambda x: jnp.sum(A @ x).astype(jnp.float32))(x)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.ones(x.shape))


def test_linear_transpose(rng):
    A = _matrix(rng, "general")
    x = jnp.asarray(random_values(rng, (A.shape[1], 3)), jnp.float32)
    ct = random_values(rng, (A.shape[0], 3)).astype(np.float32)
    (xt,) = jax.linear_transpose(lambda x: A @ x, x)(jnp.asarray(ct))
    assert_close(xt, dense_of(A).T @ ct.astype(np.float64), np.float32)


@pytest.mark.parametrize("kind", ["segment", "general"])
def test_vmap_over_dense_operand(rng, kind):
    A = _matrix(rng, kind)
    xs = random_values(rng, (3, A.shape[1], 2)).astype(np.float32)
    out = jax.vmap(lambda v: A @ v)(jnp.asarray(xs))
    assert_close(out, np.einsum("mn,bnf->bmf", dense_of(A), xs.astype(np.float64)), np.float32)
    out = jax.vmap(lambda v: A @ v, in_axes=2, out_axes=0)(jnp.asarray(xs.transpose(1, 2, 0)))
    assert_close(out, np.einsum("mn,nfb->bmf", dense_of(A), xs.transpose(1, 2, 0)), np.float32)


@pytest.mark.parametrize("sets", [3, ops.UNROLLED_VALUE_SETS + 1])  # products, or a loop
def test_vmap_over_matrix_values_and_grad_of_vmap(rng, sets):
    A = _matrix(rng, "general")
    ws = random_values(rng, (sets, A.nnz)).astype(np.float32)
    x = random_values(rng, (A.shape[1], 2)).astype(np.float32)
    out = jax.vmap(lambda w: A.with_data(w) @ x)(jnp.asarray(ws))
    for b in range(sets):
        assert_close(out[b], A.with_data(ws[b]).to_scipy() @ x.astype(np.float64), np.float32)
    xs_per_set = random_values(rng, (sets, *x.shape)).astype(np.float32)
    both = jax.vmap(lambda w, v: A.with_data(w) @ v)(jnp.asarray(ws), jnp.asarray(xs_per_set))
    for b in range(sets):
        want = A.with_data(ws[b]).to_scipy() @ xs_per_set[b].astype(np.float64)
        assert_close(both[b], want, np.float32)
    xs = random_values(rng, (2, *x.shape)).astype(np.float32)
    g = jax.grad(lambda xs: jnp.sum(jax.vmap(lambda v: A @ v)(xs) ** 2))(jnp.asarray(xs))
    dense = dense_of(A)
    for b in range(2):  # d/dx sum((A x)^2) = 2 A^T A x
        expected = 2 * dense.T @ (dense @ xs[b].astype(np.float64))
        assert_close(g[b], expected, np.float32)


def _per_head(rng, A, heads, width):
    """Values ``(nnz, H)``, features ``(n, H, width)``, cotangent ``(m, H, width)``."""
    w = random_values(rng, (A.nnz, heads)).astype(np.float32)
    x = random_values(rng, (A.shape[1], heads, width)).astype(np.float32)
    ct = random_values(rng, (A.shape[0], heads, width)).astype(np.float32)
    return w, x, ct


@pytest.mark.parametrize("impl", [None, "xla"])
@pytest.mark.parametrize("kind", [*KINDS, "general_t"])
@pytest.mark.parametrize("heads, width", [(1, 3), (3, 8), (4, 5), (2, 1)])
def test_vmap_over_values_and_features_per_head(rng, kind, heads, width, impl):
    """``vmap`` over per-head values and features (attention), bound as one product
    with ``H`` values per entry: output, both gradients and under ``jit``, against
    float64 one head at a time, for every kind of view (the native pull takes the
    general ones and sorted ids; the rest run a product per head)."""
    A = _matrix(rng, "general").T if kind == "general_t" else _matrix(rng, kind)
    w, x, ct = _per_head(rng, A, heads, width)

    def attend(w, x):
        return jax.vmap(
            lambda a, v: matmul(A.with_data(a), v, impl=impl), in_axes=(1, 1), out_axes=1
        )(w, x)

    out = jax.jit(attend)(jnp.asarray(w), jnp.asarray(x))
    gw, gx = jax.grad(lambda w, x: jnp.sum(attend(w, x) * ct), argnums=(0, 1))(
        jnp.asarray(w), jnp.asarray(x)
    )
    for h in range(heads):
        dense = dense_of(A.with_data(w[:, h]))
        assert_close(out[:, h], dense @ x[:, h].astype(np.float64), np.float32)
        assert_close(gx[:, h], dense.T @ ct[:, h].astype(np.float64), np.float32)
    # d/dw_h[k] = ct_h[row_k] . x_h[col_k], entries in the view's CSR order
    rows = np.repeat(np.arange(A.shape[0]), np.diff(np.asarray(A.indptr)))
    cols = np.asarray(A.indices)
    want = np.einsum("khf,khf->kh", ct[rows].astype(np.float64), x[cols].astype(np.float64))
    assert_close(gw, want, np.float32)


def test_values_per_head_of_empty_matrices_and_feature_major_products(rng):
    """Per-head values of a matrix with no entries give zeros and zero gradients; the
    feature-major product (``values @ A.T``) batched the same way keeps a product per
    value set, against float64."""
    E = CSRMatrix.from_scipy(random_csr(rng, 6, 4, "empty"))
    w, x = jnp.zeros((0, 3)), jnp.asarray(random_values(rng, (4, 3, 2)), jnp.float32)
    f = jax.vmap(lambda a, v: E.with_data(a) @ v, in_axes=(1, 1), out_axes=1)
    assert f(w, x).shape == (6, 3, 2) and not np.any(np.asarray(f(w, x)))
    assert not np.any(np.asarray(jax.grad(lambda x: jnp.sum(f(w, x)))(x)))
    A = _matrix(rng, "general")
    w = random_values(rng, (A.nnz, 3)).astype(np.float32)
    v = random_values(rng, (3, 5, A.shape[1])).astype(np.float32)  # (H, F, n)
    out = jax.vmap(lambda a, v: v @ A.with_data(a).T, in_axes=(1, 0))(jnp.asarray(w), v)
    for h in range(3):
        want = v[h].astype(np.float64) @ dense_of(A.with_data(w[:, h])).T
        assert_close(out[h], want, np.float32)


def test_scan_and_jit(rng):
    A = _matrix(rng, "segment")
    B = CSRMatrix.from_scipy(random_csr(rng, A.shape[1], A.shape[0], "uniform"))
    x0 = random_values(rng, (A.shape[1], 2)).astype(np.float32)

    @jax.jit
    def run(A, B, x):
        def step(x, _):
            x = B @ (A @ x) * 0.1
            return x, jnp.sum(x)

        return jax.lax.scan(step, x, None, length=3)

    x, _ = run(A, B, jnp.asarray(x0))
    ref = x0.astype(np.float64)
    for _ in range(3):
        ref = (dense_of(B) @ (dense_of(A) @ ref)) * 0.1
    assert_close(x, ref, np.float32)
    g = jax.grad(lambda x: run(A, B, x)[0].sum())(jnp.asarray(x0))
    step = dense_of(B) @ dense_of(A) * 0.1  # x -> step @ x, three times: linear
    expected = np.linalg.matrix_power(step, 3).T @ np.ones(x0.shape)
    assert_close(g, expected, np.float32)


def test_jit_compiles_once_for_equal_structures(rng):
    traces = []

    @jax.jit
    def loss(params, A, x):
        traces.append(1)
        return jnp.sum((A @ (x @ params)) ** 2)

    idx = power_law_ids(rng, 80, 11)
    A1 = CSRMatrix.from_indices(idx, num_rows=11)
    # another degree distribution (uniform, not power law), same shape and class
    A2 = CSRMatrix.from_indices(rng.integers(0, 11, 80), num_rows=11)
    params = jnp.asarray(random_values(rng, (4, 3)), jnp.float32)
    x = jnp.asarray(random_values(rng, (80, 4)), jnp.float32)
    loss(params, A1, x)
    loss(params, A2, x)
    assert len(traces) == 1  # A2 reused A1's trace and executable
    expected = np.sum(
        (dense_of(A2) @ (np.asarray(x, np.float64) @ np.asarray(params, np.float64))) ** 2
    )
    np.testing.assert_allclose(float(loss(params, A2, x)), expected, rtol=1e-4)
    assert len(traces) == 1


@pytest.mark.parametrize("impl", [None, "xla"])
def test_mean_backward_gathers_in_the_operand_dtype(rng, impl):
    """The mean's backward is a row gather of ct / degree: ct is rounded to the values'
    dtype first (each gradient value is one of its values, so the bits are those of
    gathering in float32 and rounding); the native gather forms no (E, F) float32
    array (the XLA path's float32 round trip is XLA's to fold)."""
    import jaxcsr

    ids = power_law_ids(rng, 150, 23)
    v = jnp.asarray(random_values(rng, (150, 16)), jnp.bfloat16)  # rows of 32 bytes: native
    ct = jnp.asarray(random_values(rng, (23, 16)), jnp.bfloat16)

    def backward(v, ct):
        return jax.vjp(lambda v: jaxcsr.segment_mean(v, ids, 23, impl=impl), v)[1](ct)[0]

    grad = jax.jit(backward)(v, ct)
    degree = np.maximum(np.bincount(ids, minlength=23), 1)[:, None]
    per_row = (np.asarray(ct, np.float32) / degree.astype(np.float32)).astype(jnp.bfloat16)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(grad), per_row[ids])
    if impl is None and jax.default_backend() == "cpu":
        hlo = jax.jit(backward).lower(v, ct).as_text()
        assert "jaxcsr_cpu_gather" in hlo and "150x16xf32" not in hlo, hlo[-3000:]


@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("kind", KINDS)
def test_second_order_through_max_and_min(rng, kind, reduce):
    """Hessians (forward over reverse, reverse over reverse) of max/min products on
    every path, the native kernels' arg search and gradient put included, against the
    same function on dense float32 jax.ops-style reductions."""
    import jaxcsr

    A = _matrix(rng, kind)
    dense = dense_of(A)
    x0 = jnp.asarray(random_values(rng, (A.shape[1],)), jnp.float32)
    scale = jnp.asarray(random_values(rng, (1, 3)), jnp.float32)
    mask = jnp.asarray(dense != 0)
    weights = jnp.asarray(np.where(dense != 0, dense, 0), jnp.float32)
    pick = jnp.max if reduce == "max" else jnp.min
    fill = -jnp.inf if reduce == "max" else jnp.inf

    def features(x):
        return x[:, None] * scale + jnp.sin(x)[:, None]

    def ours(x, impl):
        return jnp.sum(jaxcsr.matmul(A, features(x), reduce=reduce, impl=impl) ** 3)

    def reference(x):
        terms = weights[:, :, None] * features(x)[None]
        out = pick(jnp.where(mask[:, :, None], terms, fill), axis=1)
        return jnp.sum(jnp.where(mask.any(1)[:, None], out, 0.0) ** 3)

    expected = jax.jit(jax.hessian(reference))(x0)
    for impl in (None, "xla"):
        for order in (jax.hessian, lambda f: jax.jacrev(jax.grad(f))):
            got = jax.jit(order(functools.partial(ours, impl=impl)))(x0)
            scale_ = float(jnp.abs(expected).max()) + 1.0
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-4 * scale_)
