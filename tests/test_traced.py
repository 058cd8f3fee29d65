"""Traced ids: structures and backend plans built on the device, inside jit/grad/vmap/scan.

The device planner must produce the host planner's arrays element for element; traced
products must equal the float64 reference with jax.ops' semantics (out-of-range ids
dropped); padded batches of one size must compile once whatever their structure.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import recorded_plans
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference import (
    ALL,
    SEGMENT_FUNCTIONS,
    assert_close,
    check_product_grads,
    interpret_for,
    logsumexp_reference,
    power_law_ids,
    random_values,
    segment_reference,
    softmax_reference,
)

import jaxcsr
from jaxcsr import CSRMatrix, device_plan, plan
from jaxcsr.kernels import gpu, tpu

LANE_FIELDS, TILE_FIELDS = recorded_plans.LANE_FIELDS, recorded_plans.TILE_FIELDS


def _assert_same_arrays(host, device, fields) -> None:
    for name in fields:
        a, b = np.asarray(getattr(host, name)), np.asarray(getattr(device, name))
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=name)


@jax.jit
def _device_kernel_plans(device):
    """The GPU and TPU plans of a device structure, planned in one program."""
    return gpu.plan(device), tpu.plan(device)


def _assert_same_kernel_plans(host, device) -> None:
    """GPU lanes and TPU tile schedules of both views, element for element."""
    device_gpu, dt = _device_kernel_plans(device)
    hg, dg = gpu.plan_lanes(np.asarray(host.indptr)), device_gpu.lanes
    _assert_same_arrays(hg, dg, LANE_FIELDS)
    ht = tpu.plan(host)
    _assert_same_arrays(ht.tiles, dt.tiles, TILE_FIELDS)
    np.testing.assert_array_equal(ht.rows, dt.rows)
    if host.t_indptr is not None:
        _assert_same_arrays(gpu.plan_lanes(host.t_indptr), device_gpu.t_lanes, LANE_FIELDS)
        _assert_same_arrays(ht.t_tiles, dt.t_tiles, TILE_FIELDS)
        np.testing.assert_array_equal(ht.t_rows, dt.t_rows)


@st.composite
def segment_ids(draw):
    """Ids with empty rows, a hub row holding most entries, duplicates, or none."""
    m = draw(st.integers(0, 40))
    if m == 0:
        return np.zeros(0, np.int32), 0
    size = draw(st.integers(0, 300))
    shape = draw(st.sampled_from(["uniform", "hub", "few_rows"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if shape == "hub":  # 90 % of the entries in one row: long rows, chunks and groups
        ids = np.where(rng.random(size) < 0.9, rng.integers(0, m), rng.integers(0, m, size))
        size = int(draw(st.sampled_from([size, 5000])))  # > 64 * 64 in the hub: group lanes
        ids = np.resize(ids, size) if ids.size else np.full(size, m - 1)
    elif shape == "few_rows":  # most rows empty
        ids = rng.choice(rng.choice(m, size=max(1, m // 4)), size=size)
    else:
        ids = rng.integers(0, m, size)
    return ids.astype(np.int32), m


HUB = (np.where(np.arange(5000) % 10 == 0, np.arange(5000) % 7, 3).astype(np.int32), 7)
"""90 % of 5000 entries in row 3: more than 64 * 64, so its chunks need group lanes."""


@settings(max_examples=4, deadline=None)
@given(segment_ids())
@example(HUB)
@example((np.zeros(0, np.int32), 0))  # the empty matrix
@example((np.zeros(0, np.int32), 5))  # no entries, five empty rows
@example((np.array([4, 4, 0, 4, 2], np.int32), 6))  # duplicates, empty rows
def test_device_plan_of_segment_ids_equals_the_host_plan(case):
    ids, m = case
    host = plan.structure_from_segment_ids(ids, m)
    device = jax.jit(device_plan.segment_structure, static_argnums=1)(jnp.asarray(ids), m)
    _assert_same_arrays(host, device, ("indptr", "row_of_col"))
    # host stores no indices for sorted ids (0, 1, ..., K - 1): the same order
    host_order = np.arange(ids.size) if host.indices is None else host.indices
    np.testing.assert_array_equal(host_order, device.indices)
    assert device.layout.padded and device.layout.shape == host.layout.shape
    _assert_same_kernel_plans(host, device)


@settings(max_examples=3, deadline=None)
@given(segment_ids(), st.integers(1, 30), st.integers(0, 2**31 - 1))
@example(HUB, 9, 0)
@example((np.zeros(0, np.int32), 3), 4, 0)
def test_device_plan_of_coordinates_equals_the_host_plan(case, n, seed):
    rows, m = case
    cols = np.random.default_rng(seed).integers(0, n, rows.size).astype(np.int32)
    indptr, indices, order = plan.coo_to_csr(rows, cols, (m, n))
    host = plan.general_structure(indptr, indices, (m, n))
    coo_structure = jax.jit(device_plan.coo_structure, static_argnums=2)
    device, device_order = coo_structure(jnp.asarray(rows), jnp.asarray(cols), (m, n))
    _assert_same_arrays(host, device, ("indptr", "indices", "t_indptr", "t_indices", "t_perm"))
    np.testing.assert_array_equal(order, device_order)
    _assert_same_kernel_plans(host, device)


def test_device_planners_run_under_jit(rng):
    ids = power_law_ids(rng, 2000, 50).astype(np.int32)
    host = plan.structure_from_segment_ids(ids, 50)
    structure = jax.jit(lambda i: device_plan.segment_structure(i, 50))(ids)
    np.testing.assert_array_equal(host.indices, structure.indices)
    lanes = jax.jit(gpu.plan)(structure).lanes
    _assert_same_arrays(gpu.plan_lanes(host.indptr), lanes, LANE_FIELDS)
    tiles = jax.jit(tpu.plan)(structure).tiles
    _assert_same_arrays(tpu.plan(host).tiles, tiles, TILE_FIELDS)


def _traced_kernel_plans(case: dict) -> dict:
    """GPU and TPU plans of a recorded case's ids or coordinates, planned under ``jit``
    from device structures (no column-reuse estimate: plain lanes)."""

    def planned(case):
        if "ids" in case:
            structure = device_plan.segment_structure(case["ids"], int(case["num_rows"]))
        else:
            shape = tuple(int(s) for s in case["shape"])
            structure, _ = device_plan.coo_structure(case["row"], case["col"], shape)
        return gpu.plan(structure), tpu.plan(structure)

    static = {k: v for k, v in case.items() if k in ("num_rows", "shape")}
    traced = {k: jnp.asarray(v) for k, v in case.items() if k not in static}
    g, t = jax.jit(lambda c: planned({**c, **static}))(traced)
    out = {f"gpu/plain_lanes/{f}": getattr(g.lanes, f) for f in LANE_FIELDS}
    out |= {f"tpu/tiles/{f}": getattr(t.tiles, f) for f in TILE_FIELDS}
    out["tpu/rows"] = t.rows
    if g.t_lanes is not None:
        out |= {f"gpu/plain_t_lanes/{f}": getattr(g.t_lanes, f) for f in LANE_FIELDS}
        out |= {f"tpu/t_tiles/{f}": getattr(t.t_tiles, f) for f in TILE_FIELDS}
        out["tpu/t_rows"] = t.t_rows
    return out


def test_traced_kernel_plans_equal_the_recorded_plans():
    """The kernel plans of traced ids and coordinates equal those recorded from host
    structures (``tests/recorded_plans.py``), element for element and dtype."""
    for name, recorded in recorded_plans.load().items():
        planned = _traced_kernel_plans(recorded_plans.inputs(recorded))
        for key, got in planned.items():
            got, want = np.asarray(got), recorded[key]
            assert got.dtype == want.dtype, (name, key, got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {key}")


REDUCES = ("sum", "mean", "max", "min")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_traced_ids_equal_static_ids_and_the_reference(rng, dtype):
    m, size = 37, 501  # not tile multiples; power-law rows with empty ones
    ids = power_law_ids(rng, size, m).astype(np.int32)
    x = jnp.asarray(random_values(rng, (size, 3)), dtype)
    for reduce in REDUCES:
        fn = SEGMENT_FUNCTIONS[reduce]
        traced = jax.jit(lambda x, ids, fn=fn: fn(x, ids, m))(x, ids)
        static = fn(x, ids, m)
        assert_close(traced, segment_reference(np.asarray(x, np.float32), ids, m, reduce), dtype)
        assert_close(traced, static, dtype)
    for reduce in ("max", "min"):
        fn = getattr(jaxcsr, f"segment_{reduce}")
        out, arg = jax.jit(lambda x, ids, fn=fn: fn(x, ids, m, return_arg=True))(x, ids)
        static_out, static_arg = fn(x, ids, m, return_arg=True)
        np.testing.assert_array_equal(arg, static_arg)
        np.testing.assert_array_equal(out, static_out)


def test_out_of_range_ids_are_dropped_as_jax_ops_drops_them(rng):
    m, size = 9, 200
    ids = rng.integers(-3, m + 3, size).astype(np.int32)
    kept = (ids >= 0) & (ids < m)
    assert 0 < kept.sum() < size
    x = jnp.asarray(random_values(rng, (size, 4)), jnp.float32)
    x64 = np.asarray(x, np.float64)
    for reduce in REDUCES:
        out = jax.jit(lambda x, i, r=reduce: SEGMENT_FUNCTIONS[r](x, i, m))(x, ids)
        assert_close(out, segment_reference(x64[kept], ids[kept], m, reduce), np.float32)
    out = jax.jit(lambda x, i: jaxcsr.segment_sum(x, i, m))(x, ids)
    assert_close(out, jax.ops.segment_sum(x, ids, m), np.float32)
    # no gradient reaches a dropped entry; the kept ones get their segment's cotangent
    ct = random_values(rng, (m, 4))
    grad = jax.jit(jax.grad(lambda x, i: jnp.sum(jaxcsr.segment_sum(x, i, m) * ct)))(x, ids)
    expected = np.where(kept[:, None], ct[np.clip(ids, 0, m - 1)], 0.0)
    assert_close(grad, expected, np.float32)
    # softmax: a dropped entry has probability 0 (log: -inf); the rest as without it
    logits = jnp.asarray(random_values(rng, size), jnp.float32)
    p = jax.jit(lambda s, i: jaxcsr.segment_softmax(s, i, m))(logits, ids)
    logp = jax.jit(lambda s, i: jaxcsr.segment_log_softmax(s, i, m))(logits, ids)
    expected = np.zeros(size)
    expected[kept] = jaxcsr.segment_softmax(logits[kept], ids[kept], m)
    assert_close(p, expected, np.float32)
    assert np.all(np.isneginf(np.asarray(logp)[~kept]))
    assert_close(np.asarray(logp)[kept], np.log(expected[kept]), np.float32)
    # mode="clip" clips instead
    clipped = jax.jit(lambda x, i: jaxcsr.segment_sum(x, i, m, mode="clip"))(x, ids)
    assert_close(clipped, segment_reference(x64, np.clip(ids, 0, m - 1), m), np.float32)


def _sorts(fn, *args) -> bool:
    """Whether the compiled program's entry computation runs a sort (an HLO ``sort``
    instruction outside the branches of a conditional)."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    entry = entry[: entry.index("\n}")]
    return " sort(" in entry or _sort_called_from(text, entry)


def _sort_called_from(text: str, body: str) -> bool:
    """Whether a computation ``body`` calls (other than as a conditional branch) runs a
    sort: fusions and calls are followed, branch computations are not."""
    import re

    for name in re.findall(r"(?:calls|to_apply)=%?([\w.-]+)", body):
        start = text.find(f"%{name} ")
        if start < 0:
            continue
        called = text[start : text.index("\n}", start)]
        if " sort(" in called or _sort_called_from(text, called):
            return True
    return False


SORTED_CASES = {
    "negatives first": lambda rng, m, size: np.sort(rng.integers(-3, m, size)),
    "both ends": lambda rng, m, size: np.sort(rng.integers(-2, m + 2, size)),
    "unsorted": lambda rng, m, size: rng.integers(-2, m + 2, size),
    "sorted, dropped last": lambda rng, m, size: np.sort(rng.integers(0, m + 2, size)),
}
"""Traced ids given with ``indices_are_sorted=True``: what jax.ops' flag allows (dropped
ids at either end: ``-1`` padding sorts first), a broken promise, and the case the
sort-free plan serves."""


@pytest.mark.parametrize("case", list(SORTED_CASES))
@pytest.mark.parametrize("reduce", list(SEGMENT_FUNCTIONS))
def test_sorted_flag_with_dropped_ids_at_either_end(rng, case, reduce):
    """jax.ops' promise (sorted, dropped ids anywhere) gives the reference; a broken one
    too (jax.ops is right on CPU): the plan without the sort runs only where it holds."""
    m, size = 13, 200
    ids = SORTED_CASES[case](rng, m, size).astype(np.int32)
    x = jnp.asarray(random_values(rng, (size, 3)), jnp.float32)
    keep = (ids >= 0) & (ids < m)
    fn = SEGMENT_FUNCTIONS[reduce]

    def loss(x, ids):
        out = fn(x, ids, m, indices_are_sorted=True)
        return jnp.sum(out * jnp.cos(out)), out

    (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(x, ids)
    expected = segment_reference(np.asarray(x)[keep], ids[keep], m, reduce)
    assert_close(out, expected, np.float32)
    # the gradient through the device's choice of plan: the same as with no promise
    unsorted = jax.jit(jax.grad(lambda x, ids: jnp.sum(jnp.cos(fn(x, ids, m)) * fn(x, ids, m))))
    assert_close(grad, unsorted(x, ids), np.float32)


@pytest.mark.parametrize("case", list(SORTED_CASES))
def test_sorted_flag_in_the_softmax_family(rng, case):
    m, size = 9, 120
    ids = SORTED_CASES[case](rng, m, size).astype(np.int32)
    x = jnp.asarray(random_values(rng, (size, 2)), jnp.float32)
    p = softmax_reference(x, ids, m)

    def family(x, ids):
        kw = {"indices_are_sorted": True}
        return (
            jaxcsr.segment_softmax(x, ids, m, **kw),
            jaxcsr.segment_log_softmax(x, ids, m, **kw),
            jaxcsr.segment_logsumexp(x, ids, m, **kw),
        )

    soft, log_soft, lse = jax.jit(family)(x, ids)
    keep = (ids >= 0) & (ids < m)
    assert_close(soft, p, np.float32)
    assert np.all(np.isneginf(np.asarray(log_soft)[~keep]))
    assert_close(np.asarray(log_soft)[keep], np.log(p[keep]), np.float32)
    expected = logsumexp_reference(x, ids, m)
    if jax.default_backend() == "tpu":
        # XLA's float32 log on a TPU errs by up to 2.2e-5 relative on every path, while
        # the sums it is taken of are within 1.8e-6
        # (benchmarks/results/tpu-v5e/sorted_promise/probes.txt)
        np.testing.assert_allclose(np.asarray(lse), expected, rtol=5e-5, atol=1e-6)
    else:
        assert_close(lse, expected, np.float32)


def test_sorted_flag_reaches_the_plan(rng):
    """Sorted traced ids run the plan without the sort: on CPU the pull in the
    program (unsorted traced ids push), and the sort only in the fallback branch."""
    from jaxcsr.kernels import cpu

    m, size = 30, 500
    ids = np.sort(rng.integers(0, m, size)).astype(np.int32)
    x = jnp.asarray(random_values(rng, (size, 64)), jnp.float32)  # narrower: a scatter

    def run(sorted_ids):
        return jax.jit(lambda x, ids: jaxcsr.segment_sum(x, ids, m, indices_are_sorted=sorted_ids))

    assert_close(run(True)(x, ids), segment_reference(np.asarray(x), ids, m), np.float32)
    assert not _sorts(run(True), x, ids)
    if cpu.available():
        assert "jaxcsr_cpu_pull" in run(True).lower(x, ids).as_text()
        assert "jaxcsr_cpu_pull" not in run(False).lower(x, ids).as_text()


def test_wide_ids_are_dropped_not_wrapped_under_x64(rng):
    """int64 ids past int32 are out of range: dropped before the plan narrows them to
    int32 indices (the wrapped id 2**32 + 1 would land in segment 1)."""
    with jax.enable_x64(True):
        ids = jnp.array([0, 2**32 + 1, 1, 2**31, -(2**32) + 1], jnp.int64)
        x = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0])
        for name in ("sum", "max", "logsumexp", "prod"):
            fn = getattr(jaxcsr, f"segment_{name}")
            for sorted_ids in (False, True):
                run = jax.jit(functools.partial(fn, num_segments=2, indices_are_sorted=sorted_ids))
                out = run(x, ids)
                np.testing.assert_allclose(np.asarray(out), [1.0, 3.0], err_msg=name)
        A = jax.jit(lambda r, c: CSRMatrix.from_coo(r, c, shape=(2, 5)) @ x)
        np.testing.assert_allclose(np.asarray(A(ids, jnp.arange(5))), [1.0, 3.0])


def test_sorted_promise_skips_the_sort_and_narrow_scatters_never_sort(rng):
    m, size = 40, 3000
    ids = np.sort(rng.integers(0, m, size)).astype(np.int32)
    ids[-25:] = m + 2  # padding edges after the last segment, as a padded batch has
    x = jnp.asarray(random_values(rng, (size, 16)), jnp.float32)
    expected = segment_reference(np.asarray(x)[: size - 25], ids[: size - 25], m)

    def sorted_sum(x, ids):
        return jaxcsr.segment_sum(x, ids, m, indices_are_sorted=True)

    assert_close(jax.jit(sorted_sum)(x, ids), expected, np.float32)
    assert not _sorts(jax.jit(sorted_sum), x, ids)
    narrow = jax.jit(lambda x, ids: jaxcsr.segment_sum(x, ids, m))
    x1 = x[:, :2]
    assert not _sorts(narrow, x1, ids)
    assert_close(narrow(x1, ids), segment_reference(np.asarray(x1)[:-25], ids[:-25], m), np.float32)


def test_gradients_match_finite_differences(rng):
    m, size = 7, 60
    ids = rng.integers(-1, m, size).astype(np.int32)
    x = jnp.asarray(random_values(rng, (size, 2)), jnp.float32)
    w = jnp.asarray(random_values(rng, size), jnp.float32)

    @jax.jit
    def weighted_sum(x, w, ids):
        return CSRMatrix.from_indices(ids, m, w) @ x

    check_product_grads(lambda x, w: weighted_sum(x, w, ids), (x, w))
    # max is piecewise linear: values 0.1 apart keep the finite differences off its kinks
    spread = jnp.asarray(rng.permutation(2 * size).reshape(size, 2) * 0.1, jnp.float32)
    segment_max = jax.jit(jaxcsr.segment_max, static_argnums=2)
    check_product_grads(lambda x: segment_max(x, ids, m), (spread,))
    rows, cols = rng.integers(0, m, size), rng.integers(0, 5, size)
    y = jnp.asarray(random_values(rng, (5, 3)), jnp.float32)

    @jax.jit
    def coo_product(w, y, rows, cols):
        return CSRMatrix.from_coo(rows, cols, w, shape=(m, 5)) @ y

    check_product_grads(lambda w, y: coo_product(w, y, rows, cols), (w, y))
    softmax = jax.jit(jaxcsr.segment_softmax, static_argnums=2)
    check_product_grads(lambda s: softmax(s, ids, m), (w,))


def _batch_of_ids(rng, batch, size, m) -> np.ndarray:
    """Id arrays of one length with different degree distributions."""
    shapes = [
        lambda: rng.integers(0, m, size),
        lambda: power_law_ids(rng, size, m),
        lambda: np.where(rng.random(size) < 0.8, 0, rng.integers(0, m, size)),
        lambda: np.sort(rng.integers(0, m // 2, size)),
    ]
    return np.stack([shapes[i % len(shapes)]() for i in range(batch)]).astype(np.int32)


def test_vmap_over_a_batch_of_id_arrays(rng):
    m, size, batch = 11, 90, 4
    ids = _batch_of_ids(rng, batch, size, m)
    x = jnp.asarray(random_values(rng, (batch, size, 3)), jnp.float32)
    out = jax.jit(jax.vmap(lambda x, i: jaxcsr.segment_sum(x, i, m)))(x, ids)
    for b in range(batch):
        assert_close(out[b], segment_reference(np.asarray(x[b]), ids[b], m), np.float32)
    ct = random_values(rng, (batch, m, 3))

    def loss(x):
        return jnp.sum(jax.vmap(lambda x, i: jaxcsr.segment_max(x, i, m))(x, ids) * ct)

    reference = jax.grad(
        lambda x: jnp.sum(jax.vmap(lambda x, i: jax.ops.segment_max(x, i, m))(x, ids) * ct)
    )
    assert_close(jax.jit(jax.grad(loss))(x), reference(x), np.float32)
    logits = x[..., 0]
    p = jax.jit(jax.vmap(lambda s, i: jaxcsr.segment_softmax(s, i, m)))(logits, ids)
    for b in range(batch):
        assert_close(p[b], jaxcsr.segment_softmax(logits[b], ids[b], m), np.float32)
    # the same ids for every element of a batch of values: one structure, no map
    shared = jax.jit(jax.vmap(lambda x: jaxcsr.segment_sum(x, ids[0], m)))(x)
    assert_close(shared[1], segment_reference(np.asarray(x[1]), ids[0], m), np.float32)


def test_scan_over_batches(rng):
    m, size = 13, 70
    ids = _batch_of_ids(rng, 6, size, m)
    x = jnp.asarray(random_values(rng, (6, size, 2)), jnp.float32)

    def step(total, batch):
        x, ids = batch
        return total + jaxcsr.segment_mean(x, ids, m), None

    total, _ = jax.jit(lambda x, ids: jax.lax.scan(step, jnp.zeros((m, 2)), (x, ids)))(x, ids)
    expected = sum(segment_reference(np.asarray(x[b]), ids[b], m, "mean") for b in range(6))
    assert_close(total, expected, np.float32)


def test_one_trace_for_20_batches_of_one_padded_size(rng):
    m, size = 31, 400
    traces = []

    @jax.jit
    def step(x, receivers, senders):
        traces.append(1)
        msg = x[senders]
        total = jaxcsr.segment_sum(msg, receivers, m)
        return total, jaxcsr.segment_softmax(msg[:, 0], receivers, m)

    receivers = _batch_of_ids(rng, 20, size, m)
    for b in range(20):
        senders = rng.integers(0, m, size).astype(np.int32)
        x = jnp.asarray(random_values(rng, (m, 5)), jnp.float32)
        total, p = step(x, receivers[b], senders)
        msg = np.asarray(x, np.float64)[senders]
        assert_close(total, segment_reference(msg, receivers[b], m), np.float32)
        assert_close(p, jaxcsr.segment_softmax(x[senders][:, 0], receivers[b], m), np.float32)
    assert len(traces) == 1


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_run_their_device_plans(rng, impl):
    m, size = 19, 150
    ids = rng.integers(-1, m + 1, size).astype(np.int32)
    kept = (ids >= 0) & (ids < m)
    x = jnp.asarray(random_values(rng, (size, 3)), jnp.float32)

    @jax.jit
    def run(x, ids):
        A = CSRMatrix.from_indices(ids, m, backends=["xla", impl])
        return [
            jaxcsr.matmul(A, x, reduce=r, impl=impl, interpret=interpret_for(impl))
            for r in ("sum", "max")
        ]

    total, peak = run(x, ids)
    x64 = np.asarray(x, np.float64)[kept]
    assert_close(total, segment_reference(x64, ids[kept], m), np.float32)
    assert_close(peak, segment_reference(x64, ids[kept], m, "max"), np.float32)
    rows, cols = rng.integers(0, m, size), rng.integers(0, 8, size)
    w = random_values(rng, size).astype(np.float32)
    y = jnp.asarray(random_values(rng, (m, 2)), jnp.float32)

    @jax.jit
    def transposed(w, y, rows, cols):
        A = CSRMatrix.from_coo(rows, cols, w, shape=(m, 8), backends=["xla", impl])
        return jaxcsr.matmul(A.T, y, impl=impl, interpret=interpret_for(impl))

    dense = np.zeros((m, 8))
    np.add.at(dense, (rows, cols), w)
    assert_close(transposed(w, y, rows, cols), dense.T @ np.asarray(y, np.float64), np.float32)


def test_edge_softmax_on_traced_coordinates_gets_device_plans(rng):
    m, size = 12, 80
    rows = rng.integers(0, m + 1, size).astype(np.int32)  # some dropped (row m)
    cols = rng.integers(0, m, size).astype(np.int32)
    scores = jnp.asarray(random_values(rng, size), jnp.float32)

    @jax.jit
    def attention(scores, rows, cols):
        A = CSRMatrix.from_coo(rows, cols, shape=(m, m), backends=ALL)
        assert set(jaxcsr.softmax.rows_pattern(A).backends) == set(ALL)
        return jaxcsr.edge_softmax(A, scores[A.input_order]), A.input_order

    p, order = attention(scores, rows, cols)
    kept = rows < m
    host = CSRMatrix.from_coo(rows[kept], cols[kept], shape=(m, m))
    expected = jaxcsr.edge_softmax(host, scores[kept][host.input_order])
    assert_close(p[: kept.sum()], expected, np.float32)
    np.testing.assert_array_equal(np.asarray(p)[kept.sum() :], 0.0)
    assert set(np.asarray(order)[kept.sum() :]) == set(np.flatnonzero(~kept))


def test_vmap_over_a_stack_of_host_matrices_runs_each(rng):
    """Matrices of one layout stacked into one pytree: vmap runs one product each."""
    mats = [
        CSRMatrix.from_coo(rng.integers(0, 6, 20), rng.integers(0, 5, 20), shape=(6, 5))
        for _ in range(3)
    ]
    stack = jax.tree.map(lambda *leaves: jnp.stack(leaves), *mats)
    x = jnp.asarray(random_values(rng, (5, 2)), jnp.float32)
    y = jnp.asarray(random_values(rng, (6, 2)), jnp.float32)
    products = jax.vmap(lambda A: A @ x)(stack)
    sampled = jax.vmap(lambda A: jaxcsr.sddmm(A, y, x))(stack)
    for b, A in enumerate(mats):
        dense = A.to_scipy().toarray()
        assert_close(products[b], dense @ np.asarray(x, np.float64), np.float32)
        expected = (np.asarray(y, np.float64) @ np.asarray(x, np.float64).T)[
            np.asarray(A.structure.row_ids()), np.asarray(A.indices)
        ]
        assert_close(sampled[b], expected, np.float32)


def test_device_planned_products_lower_to_the_kernels():
    """With traced ids, the exported program holds the planner and the platform's
    kernel: Triton for CUDA, Mosaic for TPU (forward, and the general kind's backward
    on the planned transpose)."""
    from gpu_sass import TRITON_CALL, export_for_cuda
    from jax import export

    def segment_form(v, ids, impl=None):
        return jaxcsr.matmul(CSRMatrix.from_indices(ids, 5, backends=ALL), v, impl=impl)

    # impl=None runs XLA's scatter for unsorted traced ids on TPU (kernels.tpu.default_for)
    # and for their float32 sums on CUDA (kernels.gpu.default_for): the kernels forced
    tpu_segment_form = functools.partial(segment_form, impl="pallas_tpu")
    gpu_segment_form = functools.partial(segment_form, impl="pallas_gpu")

    def coo_backward(v, rows, cols):
        A = CSRMatrix.from_coo(
            rows, cols, jnp.ones(rows.shape, v.dtype), shape=(5, 8), backends=ALL
        )
        return jax.grad(lambda v: jnp.sum(A.T @ v))(v)

    v = jax.ShapeDtypeStruct((8, 20), jnp.float32)
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    v5 = jax.ShapeDtypeStruct((5, 20), jnp.float32)
    cases = (
        (gpu_segment_form, tpu_segment_form, (v, ids)),
        (coo_backward, coo_backward, (v5, ids, ids)),
    )
    for fn, tpu_fn, args in cases:
        text = export_for_cuda(fn, *args).mlir_module()
        assert TRITON_CALL in text and "stablehlo.sort" in text  # planned in the program
        text = export.export(jax.jit(tpu_fn), platforms=["tpu"])(*args).mlir_module()
        assert "tpu_custom_call" in text


def test_sorted_row_pointer_equals_the_scatter_row_pointer(rng):
    """The TPU branch of segment_structure (a search in the sorted keys) gives the
    scatter-add's row pointer; CPU tests run only the scatter branch."""
    for m in (1, 7, 300):
        keys = np.sort(rng.integers(0, m + 1, 500))  # m = dropped, sorted to the end
        keys = jnp.asarray(keys, jnp.int32)
        np.testing.assert_array_equal(
            device_plan.sorted_row_pointer(keys, m, jnp.int32),
            device_plan.row_pointer(keys, m, jnp.int32),
        )
    empty = jnp.zeros(0, jnp.int32)
    np.testing.assert_array_equal(device_plan.sorted_row_pointer(empty, 4, jnp.int32), 0)


@pytest.mark.parametrize("impl", [None, "xla"])
def test_traced_coordinates_out_of_range_are_dropped_on_every_path(rng, impl):
    """A traced COO entry outside the shape is left out by the default (native CPU)
    path as by the XLA path: products, max, and gradients for x and the values."""
    m, n, nnz = 9, 11, 60
    rows = rng.integers(0, m, nnz).astype(np.int32)
    cols = rng.integers(0, n, nnz).astype(np.int32)
    rows[[3, 17]] = [m, m + 4]  # past the last row
    cols[[8, 40]] = [n, n + 2]  # past the last column
    vals = jnp.asarray(random_values(rng, (nnz,)), jnp.float32)
    x = jnp.asarray(random_values(rng, (n, 4)), jnp.float32)
    keep = (rows < m) & (cols < n)
    dense = np.zeros((m, n))
    np.add.at(dense, (rows[keep], cols[keep]), np.asarray(vals, np.float64)[keep])

    def product(r, c, w, x, reduce="sum"):
        A = CSRMatrix.from_coo(r, c, w, shape=(m, n))
        return jaxcsr.matmul(A, x, reduce=reduce, impl=impl)

    out = jax.jit(product)(rows, cols, vals, x)
    assert_close(out, dense @ np.asarray(x, np.float64), np.float32)
    loss = jax.grad(lambda w, x, r, c: jnp.sum(product(r, c, w, x)), (0, 1))
    grad_w, grad_x = jax.jit(loss)(vals, x, rows, cols)
    assert_close(grad_x, dense.T @ np.ones((m, 4)), np.float32)
    expected_w = np.where(keep, np.asarray(x, np.float64)[np.minimum(cols, n - 1)].sum(1), 0.0)
    assert_close(grad_w, expected_w, np.float32)
    top = jax.jit(functools.partial(product, reduce="max"))(rows, cols, vals, x)
    ref = jax.jit(functools.partial(jaxcsr.matmul, reduce="max", impl="xla"))(
        CSRMatrix.from_coo(rows[keep], cols[keep], vals[keep], shape=(m, n)), x
    )
    np.testing.assert_array_equal(np.asarray(top), np.asarray(ref))


@pytest.mark.parametrize("sorted_ids", [False, True])
@pytest.mark.parametrize("width", [1, 5, 63, 64])
def test_narrow_traced_sums_scatter_on_cpu(rng, width, sorted_ids):
    """On CPU a traced segment sum of fewer than 64 features runs XLA's scatter (no
    device plan, no native kernel; ``cpu.traced_scatters``), 64 and more the
    native kernel; both give the float64 sums and gradients, dropping out-of-range
    ids."""
    from jaxcsr.kernels import cpu

    m, size = 40, 700
    ids = rng.integers(-2, m + 3, size).astype(np.int32)
    ids = np.sort(ids) if sorted_ids else ids
    x = jnp.asarray(random_values(rng, (size, width)), jnp.float32)
    ct = jnp.asarray(random_values(rng, (m, width)), jnp.float32)

    def loss(x, ids):
        return jnp.sum(jaxcsr.segment_sum(x, ids, m, indices_are_sorted=sorted_ids) * ct)

    f = jax.jit(lambda x, ids: jaxcsr.segment_sum(x, ids, m, indices_are_sorted=sorted_ids))
    keep = ((ids >= 0) & (ids < m))[:, None]
    expected = np.zeros((m, width))
    np.add.at(expected, ids[keep[:, 0]], np.asarray(x, np.float64)[keep[:, 0]])
    assert_close(f(x, ids), expected, np.float32)
    want = np.where(keep, np.asarray(ct, np.float64)[np.clip(ids, 0, m - 1)], 0.0)
    assert_close(jax.jit(jax.grad(loss))(x, ids), want, np.float32)
    compiled = f.lower(x, ids).compile().as_text()
    scatters = width < 64
    assert cpu.traced_scatters("sum", size, width) == scatters
    if scatters:
        assert not _sorts(f, x, ids)
    if cpu.available():
        assert ("jaxcsr_cpu" in compiled) == (not scatters)


def test_traced_scatter_rule_and_its_sums():
    """The rule's size bound, and the scatter's float32 accumulation of 16-bit floats
    (a bfloat16 scatter would stall near 256 on a long segment of values near 1)."""
    from jaxcsr.kernels import cpu

    assert cpu.traced_scatters("sum", 2**18, 32)
    assert not cpu.traced_scatters("sum", 2**19, 63)  # 2**24 elements and more: the plan
    assert not cpu.traced_scatters("sum", 10, 64)
    assert cpu.traced_scatters("sum", 10, 15, jnp.bfloat16)
    assert not cpu.traced_scatters("sum", 10, 16, jnp.bfloat16)  # the kernel reads half
    assert cpu.traced_scatters("sum", 10, 16, np.int32)
    assert cpu.traced_scatters("max", 2**17, 63)  # a small value: any width below 128
    assert not cpu.traced_scatters("max", 2**17, 128)
    assert not cpu.traced_scatters("min", 2**17, 64, gradient=True)
    assert cpu.traced_scatters("max", 2**17, 15, gradient=True)  # no small-value bound
    assert not cpu.traced_scatters("max", 2**17, 16, gradient=True)
    assert cpu.traced_scatters("min", 2**17, 7, jnp.bfloat16, gradient=True)
    assert not cpu.traced_scatters("min", 2**15, 8, jnp.bfloat16, gradient=True)
    assert cpu.traced_scatters("sum", 2**18, 32, gradient=True)  # a sum has one bound
    assert not cpu.traced_scatters("max", 2**18, 32)
    assert cpu.traced_scatters("max", 2**18, 31)
    assert cpu.traced_scatters("min", 2**16, 7, jnp.bfloat16)
    assert not cpu.traced_scatters("min", 2**16, 8, jnp.bfloat16)
    assert cpu.traced_scatters("min", 2**15, 8, jnp.bfloat16)
    rng = np.random.default_rng(7)
    x = rng.uniform(0.5, 1.5, (3000, 2))
    ids = rng.integers(0, 2, 3000).astype(np.int32)
    for dtype in (jnp.bfloat16, jnp.float16):  # two features: the scatter
        xd = jnp.asarray(x, dtype)
        out = jax.jit(lambda x, ids: jaxcsr.segment_sum(x, ids, 3))(xd, ids)
        assert out.dtype == dtype
        want = segment_reference(np.asarray(xd.astype(jnp.float32), np.float64), ids, 3)
        np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2)


def test_traced_sums_that_would_push_on_one_thread_scatter(rng):
    """A float32 sum of traced ids past the size bound still scatters where the native
    push would run on one thread (one piece, rows under two 64-byte lines): few ids per
    segment. Many ids per segment (pieces), wide rows (feature blocks over the threads)
    and 16-bit values keep the kernel. Compiled for the full sizes; the values checked
    on small ones."""
    from jaxcsr.kernels import cpu

    if not cpu.available():
        pytest.skip("the rule needs the built library (push_pieces)")
    big = 2_000_000
    assert cpu.push_runs_on_one_thread(1_000_000, big, 16, 4)
    assert not cpu.push_runs_on_one_thread(10_000, big, 16, 4)  # four pieces
    assert not cpu.push_runs_on_one_thread(1_000_000, big, 32, 4)  # two feature blocks
    cases = {  # (segments, width, dtype): scatters
        (1_000_000, 16, jnp.float32): True,
        (1_000_000, 31, jnp.float32): True,
        (10_000, 16, jnp.float32): False,
        (300_000, 64, jnp.float32): False,  # one piece of 6.7 ids a row: feature blocks
        (1_000_000, 16, jnp.bfloat16): False,
    }
    for (m, width, dtype), scatters in cases.items():
        assert not cpu.traced_scatters("sum", big, width, dtype)  # past the size bound
        assert cpu.traced_scatters("sum", big, width, dtype, num_segments=m) == scatters
        f = jax.jit(lambda x, ids, m=m: jaxcsr.segment_sum(x, ids, m))
        compiled = (
            f.lower(
                jax.ShapeDtypeStruct((big, width), dtype), jax.ShapeDtypeStruct((big,), jnp.int32)
            )
            .compile()
            .as_text()
        )
        assert ("jaxcsr_cpu_push" in compiled) == (not scatters), (m, width, dtype)
        assert (" scatter(" in compiled) == scatters  # the push builds no row counts
    m, size = 5000, 7000
    ids = rng.integers(-2, m + 3, size).astype(np.int32)
    x = jnp.asarray(random_values(rng, (size, 16)), jnp.float32)
    keep = (ids >= 0) & (ids < m)
    want = segment_reference(np.asarray(x)[keep], ids[keep], m)
    assert cpu.push_runs_on_one_thread(m, size, 16, 4)
    assert_close(jax.jit(lambda x, i: jaxcsr.segment_sum(x, i, m))(x, ids), want, np.float32)


def test_traced_sums_the_push_loses_scatter(rng):
    """A float32 sum of traced ids past the size bound also scatters where the push
    would take one piece with under 3 ids a row, or two pieces of partials over 40 MiB
    (``cpu.push_loses_to_scatter``), at any width; more ids a row in one piece, smaller
    partials in two, and 16-bit values keep the push. Compiled for the full sizes; the
    values and the gradient (the planned row gather) checked against float64 on small
    ones, dropped ids included."""
    from jaxcsr.kernels import cpu

    if not cpu.available():
        pytest.skip("the rule needs the built library (push_pieces)")
    big = 2_000_000
    cases = {  # (segments, width, dtype): (pieces, scatters)
        (1_000_000, 64, jnp.float32): (1, True),  # 2 ids a row
        (700_000, 64, jnp.float32): (1, True),  # 2.9
        (300_000, 64, jnp.float32): (1, False),  # 6.7
        (150_000, 64, jnp.float32): (2, True),  # partials of 73 MiB
        (200_000, 32, jnp.float32): (2, True),  # 49 MiB
        (60_000, 64, jnp.float32): (2, False),  # 29 MiB
        (150_000, 64, jnp.bfloat16): (2, False),
    }
    for (m, width, dtype), (pieces, scatters) in cases.items():
        itemsize = np.dtype(dtype).itemsize
        assert cpu.push_pieces(m, big, width, itemsize) == pieces
        assert not cpu.push_runs_on_one_thread(m, big, width, itemsize)
        assert cpu.traced_scatters("sum", big, width, dtype, num_segments=m) == scatters
        f = jax.jit(lambda x, ids, m=m: jaxcsr.segment_sum(x, ids, m))
        shapes = jax.ShapeDtypeStruct((big, width), dtype), jax.ShapeDtypeStruct((big,), jnp.int32)
        compiled = f.lower(*shapes).compile().as_text()
        assert ("jaxcsr_cpu_push" in compiled) == (not scatters), (m, width, dtype)
    m, size = 3000, 8000  # one piece of 2.7 ids a row at 64 features
    assert cpu.push_loses_to_scatter(m, size, 64, 4)
    assert not cpu.push_runs_on_one_thread(m, size, 64, 4)
    ids = rng.integers(-2, m + 3, size).astype(np.int32)
    x = jnp.asarray(random_values(rng, (size, 64)), jnp.float32)
    ct = random_values(rng, (m, 64))
    keep = (ids >= 0) & (ids < m)
    want = segment_reference(np.asarray(x)[keep], ids[keep], m)
    out, pullback = jax.vjp(lambda x: jaxcsr.segment_sum(x, jnp.asarray(ids), m), x)
    assert_close(out, want, np.float32)
    grad = np.where(keep[:, None], np.asarray(ct, np.float64)[np.clip(ids, 0, m - 1)], 0.0)
    assert_close(pullback(jnp.asarray(ct, jnp.float32))[0], grad, np.float32)


def _extreme_reference(x: np.ndarray, ids: np.ndarray, m: int, reduce: str):
    """float64 max/min per segment (``nan`` for empty ones), the first position
    attaining each (``len(x)`` for empty ones), and the gradient of ``sum(out * ct)``."""
    pick = np.maximum if reduce == "max" else np.minimum
    out = np.full((m, x.shape[1]), np.nan)
    first = np.full((m, x.shape[1]), len(x), np.int64)
    for k in range(len(x)):
        r = ids[k]
        if not 0 <= r < m:
            continue
        for f in range(x.shape[1]):
            if np.isnan(out[r, f]) or pick(out[r, f], x[k, f]) != out[r, f]:
                out[r, f], first[r, f] = x[k, f], k
    return out, first


@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("width, dtype", [(1, np.float32), (15, np.float32),
                                          (16, np.float32), (31, np.float32),
                                          (32, np.float32), (3, jnp.bfloat16),
                                          (8, jnp.bfloat16)])  # fmt: skip
def test_narrow_traced_extremes_scatter_on_cpu(rng, monkeypatch, reduce, width, dtype):
    """On CPU a traced segment max/min below 32 features (8 for 16-bit floats) runs
    XLA's scatter (``cpu.traced_scatters``), its gradient too below 16 (else the
    planned product's), wider ones the plan; all give the float64 values, the first
    attaining position (``return_arg``; ties kept: values on a coarse grid), ``empty=``,
    and a gradient at that position only, dropping out-of-range ids; a skewed segment
    (a hub) and empty ones included. (The bound under which small values scatter at
    any width is set to 0, so that these small values reach every regime; the rule's
    own test checks it.)"""
    from jaxcsr.kernels import cpu

    monkeypatch.setattr(cpu, "TRACED_SCATTER_SMALL_VALUE", (0, 0))
    m, size = 37, 900
    ids = np.where(rng.random(size) < 0.3, 4, rng.integers(-2, m + 3, size)).astype(np.int32)
    ids[ids == 11] = 12  # an empty segment inside
    x64 = np.round(random_values(rng, (size, width)) * 4) / 4  # ties
    x = jnp.asarray(x64, dtype)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ct = jnp.asarray(random_values(rng, (m, width)), jnp.float32)
    fn = getattr(jaxcsr, f"segment_{reduce}")
    out, arg = jax.jit(lambda x, ids: fn(x, ids, m, return_arg=True))(x, ids)
    want, first = _extreme_reference(x64, ids, m, reduce)
    empty = np.isnan(want)
    assert empty[11].all() and not empty[4].any()
    identity = -np.inf if reduce == "max" else np.inf
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.where(empty, identity, want))
    np.testing.assert_array_equal(np.asarray(arg), first)
    zero = jax.jit(lambda x, ids: fn(x, ids, m, empty=0))(x, ids)
    np.testing.assert_array_equal(np.asarray(zero, np.float64), np.where(empty, 0.0, want))

    def loss(x, ids):
        return jnp.sum(fn(x, ids, m, empty=0).astype(jnp.float32) * ct)

    grad = jax.jit(jax.grad(loss))(x, ids)
    expected = np.zeros((size, width))
    rows, cols = np.nonzero(~empty)
    expected[first[rows, cols], cols] = np.asarray(ct, np.float64)[rows, cols]
    assert_close(grad, expected, dtype)
    sixteen = dtype == jnp.bfloat16
    scatters, grad_scatters = width < (8 if sixteen else 32), width < (8 if sixteen else 16)
    assert cpu.traced_scatters(reduce, size, width, dtype) == scatters
    assert cpu.traced_scatters(reduce, size, width, dtype, gradient=True) == grad_scatters
    f = jax.jit(lambda x, ids: fn(x, ids, m))
    if scatters:
        assert not _sorts(f, x, ids)
    if cpu.available():
        assert ("jaxcsr_cpu" in f.lower(x, ids).compile().as_text()) == (not scatters)
        backward = jax.jit(jax.grad(loss)).lower(x, ids).compile().as_text()
        assert ("jaxcsr_cpu" in backward) == (not grad_scatters)
