"""The functional API: ``jaxcsr.segment_*`` against jax.ops and float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    SEGMENT_FUNCTIONS,
    assert_close,
    check_product_grads,
    logsumexp_reference,
    power_law_ids,
    random_values,
    segment_reference,
    softmax_reference,
)

import jaxcsr
from jaxcsr import segment

FUNCTIONS = SEGMENT_FUNCTIONS  # empty max/min segments 0, as segment_reference


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("reduce", list(FUNCTIONS))
def test_matches_reference_and_jax_ops(rng, reduce, dtype):
    ids = power_law_ids(rng, 300, 41)
    values = random_values(rng, (300, 4)).astype(dtype)
    out = FUNCTIONS[reduce](jnp.asarray(values), ids, 41)
    assert out.dtype == np.dtype(dtype) and out.shape == (41, 4)
    assert_close(out, segment_reference(values, ids, 41, reduce), dtype)
    if reduce != "mean":  # the defaults: jax.ops' identity in empty segments
        ours = getattr(jaxcsr, f"segment_{reduce}")(jnp.asarray(values), ids, 41)
        ref = getattr(jax.ops, f"segment_{reduce}")(jnp.asarray(values, jnp.float32), ids, 41)
        finite = np.isfinite(np.asarray(ref))
        assert np.array_equal(np.isfinite(np.asarray(ours, np.float32)), finite)
        assert np.array_equal(np.asarray(ours, np.float32)[~finite], np.asarray(ref)[~finite])
        assert_close(np.asarray(ours, np.float32)[finite], np.asarray(ref)[finite], dtype)


@pytest.mark.parametrize("reduce", list(FUNCTIONS))
def test_axis_covers_the_last_axis_scatter(rng, reduce):
    ids = power_law_ids(rng, 37, 9)
    values = random_values(rng, (2, 5, 37)).astype(np.float32)
    out = FUNCTIONS[reduce](values, ids, 9, axis=-1)
    assert out.shape == (2, 5, 9)
    expected = np.moveaxis(segment_reference(np.moveaxis(values, -1, 0), ids, 9, reduce), 0, -1)
    assert_close(out, expected, np.float32)
    middle = FUNCTIONS[reduce](np.moveaxis(values, -1, 1), ids, 9, axis=1)
    assert_close(middle, np.moveaxis(expected, -1, 1), np.float32)
    if reduce == "sum":  # the same function as values @ A.T
        A = jaxcsr.CSRMatrix.from_indices(ids, num_rows=9)
        assert_close(out, jnp.asarray(values) @ A.T, np.float32)


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_arg_is_the_position_along_axis(rng, reduce):
    ids = power_law_ids(rng, 50, 7)
    values = random_values(rng, (3, 50)).astype(np.float32)
    out, arg = FUNCTIONS[reduce](values, ids, 7, axis=1, return_arg=True)
    assert arg.shape == (3, 7) and arg.dtype == np.int32
    for b in range(3):
        for s in range(7):
            members = np.flatnonzero(ids == s)
            if members.size == 0:
                assert arg[b, s] == 50 and out[b, s] == 0
            else:
                pick = np.argmax if reduce == "max" else np.argmin
                assert arg[b, s] == members[pick(values[b, members])]


def test_num_segments_defaults_to_max_plus_one(rng):
    ids = np.array([3, 0, 3, 1])
    out = jaxcsr.segment_sum(jnp.arange(4.0), ids)
    np.testing.assert_array_equal(np.asarray(out), [1.0, 3.0, 0.0, 2.0])
    assert jaxcsr.segment_sum(jnp.zeros((0, 2)), np.zeros(0, int)).shape == (0, 2)


def test_same_keywords_as_jax_ops(rng):
    ids = np.sort(power_law_ids(rng, 20, 5))
    v = random_values(rng, (20,)).astype(np.float32)
    kwargs = dict(num_segments=5, indices_are_sorted=True, unique_indices=False, bucket_size=4)
    ours = jaxcsr.segment_sum(data=v, segment_ids=ids, **kwargs)
    theirs = jax.ops.segment_sum(data=v, segment_ids=ids, **kwargs)
    assert_close(ours, theirs, np.float32)


def test_out_of_range_ids_are_dropped_as_jax_ops_unless_mode_checks(rng):
    ids = np.array([0, 5, 1, -1, 2])
    v = random_values(rng, (5, 2)).astype(np.float32)
    for mode in (None, "drop", "fill", "promise_in_bounds"):
        dropped = jaxcsr.segment_sum(v, ids, 3, mode=mode)
        assert_close(dropped, jax.ops.segment_sum(v, ids, 3), np.float32)
        top, arg = jaxcsr.segment_max(v, ids, 3, mode=mode, return_arg=True)
        np.testing.assert_array_equal(np.asarray(top), np.asarray(jax.ops.segment_max(v, ids, 3)))
        assert np.all(np.asarray(arg) != 1) and np.all(np.asarray(arg) != 3)  # dropped
    clipped = jaxcsr.segment_sum(v, ids, 3, mode="clip")
    assert_close(clipped, jax.ops.segment_sum(v, ids, 3, mode="clip"), np.float32)
    with pytest.raises(ValueError, match=r"segment_ids must be < num_segments = 3; segment_ids"):
        jaxcsr.segment_sum(v, np.abs(ids), 3, mode="check")
    with pytest.raises(ValueError, match=r"segment_ids must be >= 0; segment_ids\[3\] = -1"):
        jaxcsr.segment_max(v, ids, 6, mode="check")
    with pytest.raises(ValueError, match="mode='check' needs concrete segment_ids"):
        jax.jit(lambda i: jaxcsr.segment_sum(v, i, 3, mode="check"))(ids)
    with pytest.raises(ValueError, match="mode must be one of"):
        jaxcsr.segment_sum(v, ids, 3, mode="wrap")


def test_matrix_is_cached_by_value_and_jit_traces_once(rng):
    ids = power_law_ids(rng, 64, 8)
    first = jaxcsr.segment_matrix(ids, 8)
    assert jaxcsr.segment_matrix(ids.copy(), 8) is first  # equal value, new array
    from_jax = jaxcsr.segment_matrix(jnp.asarray(ids), 8)  # a concrete JAX array works
    np.testing.assert_array_equal(np.asarray(from_jax.indices), np.asarray(first.indices))
    assert jaxcsr.segment_matrix(ids, 9) is not first
    other = ids.copy()
    other[0] = (other[0] + 1) % 8
    assert jaxcsr.segment_matrix(other, 8) is not first
    traces = []

    @jax.jit
    def step(v):
        traces.append(1)
        return jaxcsr.segment_mean(v, ids, 8)

    v = jnp.asarray(random_values(rng, (64, 3)), jnp.float32)
    for _ in range(3):
        assert_close(step(v), segment_reference(np.asarray(v), ids, 8, "mean"), np.float32)
    assert len(traces) == 1
    for i in range(segment.CACHE_SIZE + 2):  # the cache is bounded
        jaxcsr.segment_matrix(np.array([i]), i + 1)
    assert len(segment._cache) == segment.CACHE_SIZE


def test_first_call_inside_jit_caches_no_tracer(rng):
    """The matrix planned during a trace is reused by later traces (no leaked tracer)."""
    ids = power_law_ids(rng, 33, 5) + 1000  # ids no other test uses: not cached yet
    v = jnp.asarray(random_values(rng, (33, 2)), jnp.float32)
    first = jax.jit(lambda v: jaxcsr.segment_max(v, ids, 1005, empty=0))(v)
    A = jaxcsr.segment_matrix(ids, 1005)
    assert all(not isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(A))
    second = jax.jit(jax.grad(lambda v: jnp.sum(jaxcsr.segment_max(v, ids, 1005))))(v)
    assert_close(first, segment_reference(np.asarray(v), ids, 1005, "max"), np.float32)
    assert float(jnp.sum(second)) == float(np.sum(np.bincount(ids, minlength=1005) > 0) * 2)


def test_gradients_and_vmap(rng):
    ids = power_law_ids(rng, 30, 6)
    # values 0.5 apart: check_grads' 1e-2 perturbations cannot flip a max/min winner
    v = jnp.asarray((rng.permutation(90).reshape(30, 3) * 0.5), jnp.float32)
    for reduce, fn in FUNCTIONS.items():
        check_product_grads(lambda v, fn=fn: fn(v, ids, 6), (v,))
        batched = jax.vmap(lambda v, fn=fn: fn(v, ids, 6))(jnp.stack([v, 2 * v]))
        assert_close(batched[1], segment_reference(2 * np.asarray(v), ids, 6, reduce), np.float32)


# ------------------------------------------------------------ softmax family
def np_softmax_family(x: np.ndarray, ids: np.ndarray, m: int):
    """Float64 per-segment softmax, log-softmax, logsumexp (empty segments: 0)."""
    x = np.asarray(x, np.float64)
    soft, log_soft = np.zeros_like(x), np.zeros_like(x)
    lse = np.zeros((m, *x.shape[1:]))
    with np.errstate(invalid="ignore", divide="ignore"):
        for s in range(m):
            sel = ids == s
            if not sel.any():
                continue
            seg = x[sel]
            peak = seg.max(axis=0)
            peak = np.where(np.isfinite(peak), peak, 0)
            total = np.exp(seg - peak).sum(axis=0)
            soft[sel] = np.exp(seg - peak) / total
            log_soft[sel] = seg - peak - np.log(total)
            lse[s] = np.log(total) + peak
    return soft, log_soft, lse


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_softmax_family_matches_reference(rng, dtype):
    ids = power_law_ids(rng, 200, 30)
    x = (random_values(rng, (200, 3)) * 20).astype(dtype)
    x[:5] += 1000.0  # stability: a naive exp overflows
    soft, log_soft, lse = np_softmax_family(x, ids, 30)
    out = jaxcsr.segment_softmax(jnp.asarray(x), ids, 30)
    assert out.dtype == np.dtype(dtype)
    assert_close(out, soft, dtype)
    assert_close(jaxcsr.segment_log_softmax(jnp.asarray(x), ids, 30), log_soft, dtype)
    assert_close(jaxcsr.segment_logsumexp(jnp.asarray(x), ids, 30), lse, dtype)
    sums = np.zeros((30, 3))
    np.add.at(sums, ids, np.asarray(out, np.float64))
    nonempty = np.bincount(ids, minlength=30) > 0
    assert_close(sums[nonempty], np.ones((nonempty.sum(), 3)), dtype)


def test_softmax_with_infinities_and_empty_segments():
    ids = np.array([0, 0, 2, 2, 3, 3])
    x = np.array([1.0, -np.inf, -np.inf, -np.inf, 2.0, 5.0], np.float32)
    soft = np.asarray(jaxcsr.segment_softmax(x, ids, 5))
    assert soft[0] == 1.0 and soft[1] == 0.0  # -inf gets probability 0
    assert np.isnan(soft[2:4]).all()  # all -inf: NaN, as jax.nn.softmax
    np.testing.assert_allclose(soft[4:], np.asarray(jax.nn.softmax(x[4:])), rtol=1e-6)
    lse = np.asarray(jaxcsr.segment_logsumexp(x, ids, 5))
    np.testing.assert_array_equal(lse[[1, 4]], [0.0, 0.0])  # empty segments
    assert lse[2] == -np.inf and lse[0] == 1.0
    np.testing.assert_allclose(lse[3], float(jax.nn.logsumexp(x[4:])), rtol=1e-6)


def test_softmax_family_gradients(rng):
    ids = power_law_ids(rng, 40, 7)
    x = jnp.asarray(random_values(rng, (40, 2)), jnp.float32)
    for fn in (jaxcsr.segment_softmax, jaxcsr.segment_log_softmax, jaxcsr.segment_logsumexp):
        check_product_grads(lambda x, fn=fn: fn(x, ids, 7), (x,))
    # the gradient of logsumexp is the softmax
    g = jax.grad(lambda x: jnp.sum(jaxcsr.segment_logsumexp(x, ids, 7)))(x)
    assert_close(g, jaxcsr.segment_softmax(x, ids, 7), np.float32)


def test_segment_order_sorts_stably_and_keeps_every_product(rng):
    ids = power_law_ids(rng, 700, 41)
    perm = jaxcsr.segment_order(ids, 41)
    assert perm.dtype == np.int64 and np.array_equal(np.sort(perm), np.arange(700))
    assert np.all(np.diff(ids[perm]) >= 0)
    for row in np.unique(ids):  # equal ids stay in input order
        assert np.all(np.diff(perm[ids[perm] == row]) > 0)
    v = random_values(rng, (700, 6)).astype(np.float32)
    sorted_sum = jaxcsr.segment_sum(v[perm], ids[perm], 41, indices_are_sorted=True)
    assert_close(sorted_sum, segment_reference(v, ids, 41), np.float32)
    assert np.array_equal(jaxcsr.segment_order(np.sort(ids)), np.arange(700))
    assert jaxcsr.segment_order(np.zeros(0, np.int32)).shape == (0,)


def test_segment_prod_matches_float64_with_dropped_and_clipped_ids(rng):
    ids = np.array([0, 3, 3, -1, 1, 7, 1, 3])
    v = rng.uniform(0.5, 1.5, (8, 2)).astype(np.float32)
    for mode in (None, "clip"):
        kept = np.clip(ids, 0, 4) if mode == "clip" else ids
        keep = (kept >= 0) & (kept < 5)
        want = np.ones((5, 2))
        np.multiply.at(want, kept[keep], v[keep].astype(np.float64))
        assert_close(jaxcsr.segment_prod(v, ids, 5, mode=mode), want, np.float32)
        traced = jax.jit(lambda v, i, mode=mode: jaxcsr.segment_prod(v, i, 5, mode=mode))(v, ids)
        assert_close(traced, want, np.float32)
    moved = jaxcsr.segment_prod(v.T, ids, 5, axis=1)
    assert_close(moved, np.asarray(jaxcsr.segment_prod(v, ids, 5)).T, np.float32)


def _count_calls(monkeypatch, *targets) -> list[str]:
    """Wraps each ``(module, name)`` so that a call appends ``name`` to the returned list."""
    calls: list[str] = []
    for module, name in targets:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_concrete_ids_are_checked_once_per_call(rng, monkeypatch):
    """segment_* validate the ids at their door and hand them to the matrix checked:
    one range check of fresh ids per call (the matrix does not check them again)."""
    import jaxcsr.matrix
    import jaxcsr.segment

    calls = _count_calls(
        monkeypatch,
        (jaxcsr.segment, "check_segment_ids"),
        (jaxcsr.matrix, "check_segment_ids"),
    )
    ids = rng.integers(0, 37, 911)  # fresh ids: not in the matrix cache
    x = random_values(rng, (911, 3)).astype(np.float32)
    out = jaxcsr.segment_max(x, ids, 37)
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(out), segment_reference(x, ids, 37, "max"), rtol=1e-6)


def test_dropped_ids_are_checked_once_per_call(rng, monkeypatch):
    """With out-of-range ids dropped (jax.ops' default), the kept ids are range-checked
    once at the door and the matrix is built from them without ``check_coo``."""
    import jaxcsr.matrix
    import jaxcsr.segment

    calls = _count_calls(
        monkeypatch, (jaxcsr.segment, "check_segment_ids"), (jaxcsr.matrix, "check_coo")
    )
    ids = rng.integers(-3, 40, 907)  # fresh, some negative and some >= 37: dropped
    x = random_values(rng, (907, 3)).astype(np.float32)
    out = jaxcsr.segment_sum(x, ids, 37)
    assert calls == ["check_segment_ids"]
    keep = (ids >= 0) & (ids < 37)
    want = segment_reference(x[keep], ids[keep], 37, "sum")
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.int8, np.int32])
def test_integer_max_min_fill_empty_segments_with_the_dtype_limits(rng, dtype):
    """jax.ops' identity of every integer dtype, unsigned ones included (their maximum
    does not fit a signed int of the same width)."""
    info = np.iinfo(dtype)
    ids = np.array([0, 2, 0, 2, 4])
    values = rng.integers(max(info.min, -50), 100, 5).astype(dtype)
    for reduce in ("max", "min"):
        ours = getattr(jaxcsr, f"segment_{reduce}")(values, ids, 5)
        ref = getattr(jax.ops, f"segment_{reduce}")(values, ids, 5)
        assert ours.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
        assert np.asarray(ours)[1] == (info.max if reduce == "min" else info.min)


def test_empty_must_be_a_value_of_the_dtype(rng):
    values = jnp.asarray(rng.integers(-9, 10, 4), jnp.int8)
    ids = np.array([0, 0, 2, 2])
    out = jaxcsr.segment_max(values, ids, 3, empty=-7)
    assert int(out[1]) == -7
    for bad in (1000, -129, float("nan"), 0.5, float("inf")):
        with pytest.raises(ValueError, match=r"empty = .* is not a value of the data's dtype int8"):
            jaxcsr.segment_max(values, ids, 3, empty=bad)
    with pytest.raises(TypeError, match="empty must be a number"):
        jaxcsr.segment_min(values, ids, 3, empty="low")
    floats = jnp.asarray(random_values(rng, (4,)), jnp.float32)
    assert np.isnan(float(jaxcsr.segment_min(floats, ids, 3, empty=float("nan"))[1]))


@pytest.mark.parametrize("fn", ["max", "min", "softmax", "log_softmax", "logsumexp", "sum"])
def test_no_segments_with_traced_ids(rng, fn):
    """num_segments=0: every id dropped; empty results (and zero gradients), as jax.ops."""
    x = jnp.asarray(random_values(rng, (6, 2)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 4, 6), jnp.int32)
    f = getattr(jaxcsr, f"segment_{fn}")
    for impl in (None, "xla"):

        def finite_sum(x, ids, impl=impl):
            out = f(x, ids, 0, impl=impl)
            return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0)), out

        (_, out), g = jax.jit(jax.value_and_grad(finite_sum, has_aux=True))(x, ids)
        if fn in ("softmax", "log_softmax"):
            assert out.shape == (6, 2)
            assert np.all(np.asarray(out) == (0.0 if fn == "softmax" else -np.inf))
        else:
            assert out.shape == (0, 2)
        np.testing.assert_array_equal(np.asarray(g), 0.0)
    if fn in ("max", "min"):
        top, arg = jax.jit(lambda x, ids: f(x, ids, 0, return_arg=True))(x, ids)
        assert top.shape == arg.shape == (0, 2)


def test_gather_scatter_modes_are_accepted(rng):
    """jax.lax.GatherScatterMode members, as jax.ops accepts them."""
    ids = np.array([0, 5, 1, -1, 2])
    v = random_values(rng, (5, 2)).astype(np.float32)
    modes = jax.lax.GatherScatterMode
    for fn in (jaxcsr.segment_sum, jaxcsr.segment_prod, jaxcsr.segment_max):
        ref_fn = getattr(jax.ops, fn.__name__)
        for mode in (modes.CLIP, modes.FILL_OR_DROP, modes.PROMISE_IN_BOUNDS):
            if mode == modes.PROMISE_IN_BOUNDS:
                ids_in = np.array([0, 2, 1, 1, 2])
                expected = ref_fn(v, ids_in, 3)
                out = fn(v, ids_in, 3, mode=mode)
            else:
                expected, out = ref_fn(v, ids, 3, mode=mode), fn(v, ids, 3, mode=mode)
            assert_close(out, expected, np.float32)
    with pytest.raises(ValueError, match="ONE_HOT has no segment reduction"):
        jaxcsr.segment_sum(v, ids, 3, mode=modes.ONE_HOT)


def test_int64_ids_past_int32_are_dropped_everywhere(rng):
    """One rule for concrete int64 ids (no x64): an id >= 2**31 is out of range and
    dropped by every function, never wrapped into a valid segment."""
    ids = np.array([0, 2**32 + 1, 1, 2**31, 2**31 - 1, -(2**32) + 1], np.int64)
    x = jnp.asarray(random_values(rng, (6,)), jnp.float32)
    keep = np.array([True, False, True, False, False, False])
    k_ids, k_x = ids[keep], np.asarray(x)[keep]
    for name in ("sum", "mean", "max", "min"):
        out = getattr(jaxcsr, f"segment_{name}")(
            x, ids, 2, **({"empty": 0} if name in ("max", "min") else {})
        )
        assert_close(out, segment_reference(k_x, k_ids, 2, name), np.float32)
    prod = np.ones(2)
    np.multiply.at(prod, k_ids, k_x.astype(np.float64))
    assert_close(jaxcsr.segment_prod(x, ids, 2), prod, np.float32)
    lse = jaxcsr.segment_logsumexp(x, ids, 2)
    assert_close(lse, np.log(np.exp(k_x.astype(np.float64))), np.float32)
    soft = jaxcsr.segment_softmax(x, ids, 2)
    assert_close(soft, np.where(keep, 1.0, 0.0), np.float32)


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp"])
def test_softmax_family_drops_concrete_out_of_range_ids(rng, fn):
    """Concrete ids, negative and >= num_segments among them: probability 0 (log:
    -inf) for the dropped entries, the float64 reference for the rest."""
    m = 6
    ids = rng.integers(-2, m + 2, 80)
    ids[:3] = (-1, m, 0)
    x = jnp.asarray(random_values(rng, (80, 3)), jnp.float32)
    keep = (ids >= 0) & (ids < m)
    p = softmax_reference(x, ids, m)
    out = np.asarray(getattr(jaxcsr, f"segment_{fn}")(x, ids, m))
    if fn == "softmax":
        assert_close(out, p, np.float32)
    elif fn == "log_softmax":
        assert np.all(np.isneginf(out[~keep]))
        assert_close(out[keep], np.log(p[keep]), np.float32)
    else:
        assert_close(out, logsumexp_reference(x, ids, m), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("impl", [None, "xla"])
def test_signed_zeros_tie(rng, impl, dtype):
    """docs/migration.md: -0.0 == 0.0 is a tie. The CPU kernels keep the first zero in
    input order, as for any tie (value and return_arg agree); the XLA path orders -0.0
    below +0.0, as jax.ops. Values equal jax.ops' either way (F = 1 and 37: the
    kernels' eight-lane loops and their tails)."""
    from jaxcsr.kernels import cpu

    native = impl is None and cpu.available() and jax.default_backend() == "cpu"
    for f in (1, 37):
        ids = rng.integers(0, 5, 60)
        signs = rng.random((60, f)) < 0.5
        x = jnp.asarray(np.where(signs, -0.0, 0.0), dtype)
        for name in ("max", "min"):
            ours, arg = getattr(jaxcsr, f"segment_{name}")(x, ids, 6, impl=impl, return_arg=True)
            ref = getattr(jax.ops, f"segment_{name}")(x, ids, 6)
            np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(ref, np.float32))
            got = np.signbit(np.asarray(ours, np.float32))[:5]
            if native:  # the first zero of each segment, where return_arg points
                want = np.take_along_axis(signs, np.asarray(arg)[:5], axis=0)
            else:
                want = np.signbit(np.asarray(ref, np.float32))[:5]
            np.testing.assert_array_equal(got, want)


def test_documented_differences_from_jax_ops():
    """docs/migration.md's "What still differs": integer means wrap where their int32
    sum does."""
    big = jnp.full((3,), 2**30, jnp.int32)
    wrapped = jax.ops.segment_sum(big, np.zeros(3, int), 1) // 3
    np.testing.assert_array_equal(jaxcsr.segment_mean(big, np.zeros(3, int), 1), wrapped)
    small = jnp.asarray([100, 101, 7], jnp.int8)  # int8 sums in int32: no wrap
    assert jaxcsr.segment_mean(small, np.array([0, 0, 1]), 2).tolist() == [100, 7]
