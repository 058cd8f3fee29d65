"""jaxcsr.sddmm: values against float64 numpy, gradients, heads, every structure kind."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from reference import assert_close, check_product_grads, power_law_ids, random_csr

import jaxcsr
from jaxcsr import CSRMatrix


def _reference(A, X, Y):
    """Float64 ``sum_f X[i, ...f] * Y[j, ...f]`` per stored entry, CSR order."""
    mat = A.to_scipy().tocsr()
    rows = np.repeat(np.arange(mat.shape[0]), np.diff(mat.indptr))
    X, Y = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    return np.sum(X[rows] * Y[mat.indices], axis=-1)


def _matrices(rng):
    yield CSRMatrix.from_scipy(random_csr(rng, 23, 17, "power_law"))
    yield CSRMatrix.from_scipy(random_csr(rng, 23, 17, "empty_rows"))
    idx = power_law_ids(rng, 17, 23)  # one entry per column, a hub row
    yield CSRMatrix.from_indices(idx, 23)
    yield CSRMatrix.from_indices(np.sort(idx), 23)  # sorted ids
    yield CSRMatrix.from_indices(rng.integers(0, 17, 23), 17).T  # one entry per row


@pytest.mark.parametrize("heads", [None, 3])
def test_values_on_every_structure_kind(rng, heads):
    for A in _matrices(rng):
        m, n = A.shape
        tail = (5,) if heads is None else (heads, 5)
        X = rng.standard_normal((m, *tail)).astype(np.float32)
        Y = rng.standard_normal((n, *tail)).astype(np.float32)
        out = jax.jit(jaxcsr.sddmm)(A, X, Y)
        assert out.shape == ((A.nnz,) if heads is None else (A.nnz, heads))
        assert_close(out, _reference(A, X, Y), np.float32)
        # A.with_data(sddmm) is the sampled product
        sampled = A.with_data(out if heads is None else out[:, 0]).to_scipy().toarray()
        dense = (
            np.asarray(X if heads is None else X[:, 0], np.float64)
            @ np.asarray(Y if heads is None else Y[:, 0], np.float64).T
        )
        mask = A.to_scipy().toarray() != 0
        assert_close(sampled[mask], dense[mask], np.float32)


def test_gradients_are_the_two_products(rng):
    A = CSRMatrix.from_scipy(random_csr(rng, 19, 13, "power_law"))
    X = jnp.asarray(rng.standard_normal((19, 4)), jnp.float32)
    Y = jnp.asarray(rng.standard_normal((13, 4)), jnp.float32)
    g = rng.standard_normal(A.nnz).astype(np.float32)
    dX, dY = jax.grad(lambda X, Y: jnp.sum(jaxcsr.sddmm(A, X, Y) * g), argnums=(0, 1))(X, Y)
    G = A.with_data(g).to_scipy().toarray().astype(np.float64)
    assert_close(dX, G @ np.asarray(Y, np.float64), np.float32)
    assert_close(dY, G.T @ np.asarray(X, np.float64), np.float32)
    check_grads(
        lambda X, Y: jaxcsr.sddmm(A, X, Y),
        (X, Y),
        order=1,
        modes=("rev",),
        atol=1e-2,
        rtol=1e-2,
        eps=1e-2,
    )


def test_bfloat16_accumulates_in_float32(rng):
    A = CSRMatrix.from_indices(np.zeros(64, np.int64), 1)  # one row, 64 entries
    X = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
    Y = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
    out = jaxcsr.sddmm(A, X, Y)
    assert out.dtype == jnp.bfloat16
    assert_close(out, _reference(A, X, Y), jnp.bfloat16)


def test_empty_matrix():
    A = CSRMatrix.from_dense(np.zeros((3, 2)))
    assert jaxcsr.sddmm(A, np.ones((3, 4)), np.ones((2, 4))).shape == (0,)


@pytest.mark.parametrize("heads", [None, 2])
def test_forward_mode_jacfwd_and_vmap(rng, heads):
    """sddmm is bilinear: its JVP is sddmm(dX, Y) + sddmm(X, dY) (forward mode used to
    fail: it was a custom_vjp); jacfwd equals jacrev; vmap joins the heads axis."""
    for A in list(_matrices(rng))[::4]:  # a general matrix and one entry per row
        m, n = A.shape
        tail = (3,) if heads is None else (heads, 3)
        X, dX = (rng.standard_normal((m, *tail)).astype(np.float32) for _ in range(2))
        Y, dY = (rng.standard_normal((n, *tail)).astype(np.float32) for _ in range(2))
        out, tangent = jax.jvp(lambda X, Y, A=A: jaxcsr.sddmm(A, X, Y), (X, Y), (dX, dY))
        assert_close(out, _reference(A, X, Y), np.float32)
        assert_close(tangent, _reference(A, dX, Y) + _reference(A, X, dY), np.float32)
        if A.nnz < 40:  # jacobians are nnz x m x F: the small matrices
            f = jax.jit(lambda X, A=A, Y=Y: jaxcsr.sddmm(A, X, Y))
            assert_close(jax.jacfwd(f)(X), jax.jacrev(f)(X), np.float32)
        batch = rng.standard_normal((4, m, *tail)).astype(np.float32)
        out = jax.vmap(jaxcsr.sddmm, in_axes=(None, 0, None))(A, batch, Y)
        for b in range(4):
            assert_close(out[b], _reference(A, batch[b], Y), np.float32)
    # second order, both modes, on the last (one entry per row) matrix
    check_product_grads(jax.jit(lambda X, Y: jaxcsr.sddmm(A, X, Y)), (X, Y), order=2)
