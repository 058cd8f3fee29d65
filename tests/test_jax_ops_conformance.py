"""``jaxcsr.segment_*`` as a drop-in for ``jax.ops.segment_*``: the cases of JAX's own
segment tests (``tests/lax_numpy_indexing_test.py``: ``testSegmentSum``,
``testSegmentSumOutOfBounds``, ``testSegmentReduce``, ``testSegmentReduceBoolean``),
re-expressed: both functions on the same inputs, eagerly and under ``jit`` (traced ids),
on every path; the results must be identical (float sums: equal to float32 rounding).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcsr

REDUCERS = ("sum", "prod", "max", "min")
SHAPES = ((8,), (7, 4), (6, 4, 2))
DTYPES = (np.float32, np.float16, jnp.bfloat16, np.int32)


def _assert_same(ours, theirs, dtype) -> None:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if np.issubdtype(ours.dtype, np.inexact) or ours.dtype == jnp.bfloat16:
        a, b = ours.astype(np.float64), theirs.astype(np.float64)
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
        np.testing.assert_array_equal(a[~np.isfinite(a)], b[~np.isfinite(b)])
        # jaxcsr sums 16-bit floats in float32, jax.ops in the input dtype
        rtol = {np.dtype(np.float32): 1e-6}.get(np.dtype(dtype), 1e-2)
        np.testing.assert_allclose(a[np.isfinite(a)], b[np.isfinite(b)], rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(ours, theirs)


def _data(rng, shape, dtype):
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-5, 6, shape).astype(dtype)
    return rng.uniform(-3, 3, shape).astype(np.float32).astype(dtype)


CASES = (
    (None, None),
    (1, 2),
    (3, None),
)
"""``(num_segments, bucket_size)`` pairs (``bucket_size`` changes nothing in jaxcsr)."""


@pytest.mark.parametrize(
    "reducer,shape,dtype,case", list(itertools.product(REDUCERS, SHAPES, DTYPES, CASES))
)
def test_segment_reduce_matches_jax_ops(rng, reducer, shape, dtype, case):
    num_segments, bucket_size = case
    data = _data(rng, shape, dtype)
    ids = rng.integers(-2, 3, shape[:1]).astype(np.int32)  # negative and too-large ids
    ours_fn = getattr(jaxcsr, f"segment_{reducer}")
    theirs_fn = getattr(jax.ops, f"segment_{reducer}")
    kw = {"num_segments": num_segments, "bucket_size": bucket_size}
    theirs = theirs_fn(data, ids, **kw)
    _assert_same(ours_fn(data, ids, **kw), theirs, dtype)
    if num_segments is not None:  # traced ids (jax.ops needs num_segments then too)
        traced = jax.jit(lambda d, i: ours_fn(d, i, **kw))(data, ids)
        _assert_same(traced, jax.jit(lambda d, i: theirs_fn(d, i, **kw))(data, ids), dtype)


@pytest.mark.parametrize(
    "reducer,shape,case", list(itertools.product(("max", "min"), SHAPES, CASES))
)
def test_boolean_max_min_match_jax_ops(rng, reducer, shape, case):
    num_segments, bucket_size = case
    data = _data(rng, shape, np.bool_)
    ids = rng.integers(-2, 3, shape[:1]).astype(np.int32)
    kw = {"num_segments": num_segments, "bucket_size": bucket_size}
    theirs = getattr(jax.ops, f"segment_{reducer}")(data, ids, **kw)
    ours = getattr(jaxcsr, f"segment_{reducer}")(data, ids, **kw)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert np.asarray(ours).dtype == np.bool_


@pytest.mark.parametrize(
    "ids,num_segments",
    [
        ([0, 0, 0, 1, 2, 2, 3, 3], 4),
        ([0, 0, 0, 1, 2, 2, 3, 3], 5),  # more segments than ids reach
        ([0, 0, 0, 1, 2, 2, 3, 3], None),
        ([0, 4, 8, 1, 2, -6, -1, 3], 4),  # negative and too-large ids: dropped
        ([3, 3, 3, 4, 5, 5, -7, -6], None),  # num_segments from the largest id
    ],
)
def test_segment_sum_cases(ids, num_segments):
    data = jnp.array([5, 1, 7, 2, 3, 4, 1, 3])
    ids = np.array(ids)
    theirs = jax.ops.segment_sum(data, ids, num_segments)
    np.testing.assert_array_equal(jaxcsr.segment_sum(data, ids, num_segments), theirs)
    if num_segments is not None:
        traced = jax.jit(lambda d, i: jaxcsr.segment_sum(d, i, num_segments))(data, ids)
        np.testing.assert_array_equal(traced, theirs)


def test_all_ids_out_of_bounds_give_zero_value_and_gradient():
    data = np.array([0.5, -1.5], np.float32)

    def loss(fn, d, i):
        return fn(d, i, 2).sum()

    for ids in (np.array([2, 3]), jnp.array([2, 3])):
        val, grad = jax.value_and_grad(loss, argnums=1)(jaxcsr.segment_sum, data, ids)
        assert float(val) == 0.0 and np.array_equal(np.asarray(grad), [0.0, 0.0])


@pytest.mark.parametrize("reducer", ["sum", "max", "min", "prod"])
def test_scalar_and_length_one_data_broadcast_to_every_id(rng, reducer):
    ids = np.array([0, 2, 2, -1, 1])
    ours_fn = getattr(jaxcsr, f"segment_{reducer}")
    theirs_fn = getattr(jax.ops, f"segment_{reducer}")
    for data in (jnp.float32(1.5), jnp.asarray(rng.uniform(-1, 1, (1, 3)), jnp.float32)):
        _assert_same(ours_fn(data, ids, 3), theirs_fn(data, ids, 3), np.float32)


@pytest.mark.parametrize("reducer", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("num_segments", [3, 6])
def test_concrete_and_traced_ids_give_the_same_answer(rng, reducer, num_segments):
    """Every edge case at once: negative, too large, empty segments, duplicates."""
    ids = np.array([4, -1, 0, 0, 7, 2, 2, 2, -3, 5], np.int32)
    data = jnp.asarray(rng.uniform(-2, 2, (10, 3)), jnp.float32)
    fn = getattr(jaxcsr, f"segment_{reducer}")
    eager = fn(data, ids, num_segments)
    traced = jax.jit(lambda d, i: fn(d, i, num_segments))(data, ids)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(traced), rtol=1e-6)
    assert np.array_equal(np.isfinite(eager), np.isfinite(traced))


def test_integer_logits_and_unique_indices_as_jraph():
    ids = np.array([0, 0, 1, 1, 1])
    logits = jnp.array([1, 2, 0, 3, 3])
    out = jaxcsr.segment_softmax(logits, ids, 2, unique_indices=False)
    top = jax.ops.segment_max(logits, ids, 2)
    ex = jnp.exp(logits - top[ids])
    want = ex / jax.ops.segment_sum(ex, ids, 2)[ids]
    assert out.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2.5e-7)


def test_checked_mode_and_empty_value_keep_jaxcsr_choices_by_name(rng):
    ids = np.array([0, 3, 0])
    data = jnp.asarray(rng.uniform(-1, 1, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"segment_ids must be < num_segments = 3"):
        jaxcsr.segment_sum(data, ids, 3, mode="check")
    assert float(jaxcsr.segment_max(data, ids, 3, empty=0)[1]) == 0.0
    assert float(jaxcsr.segment_max(data, ids, 3)[1]) == -np.inf
    assert int(jaxcsr.segment_min(jnp.arange(3), ids, 3)[2]) == np.iinfo(np.int32).max
