"""Sharded products on forced CPU devices; run by test_sharding.py in its own process.

``python tests/sharding_checks.py DEVICES [--gcn]``: XLA_FLAGS must force the device
count before jax is imported, so this file sets it and is never imported by pytest.
Prints ``ok`` when every check holds.
"""

from __future__ import annotations

import os
import re
import sys
import time

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from reference import assert_close, random_csr, segment_reference  # noqa: E402

import jaxcsr  # noqa: E402
from jaxcsr import CSRMatrix  # noqa: E402

COLLECTIVES = r"\b(all-gather|all-to-all|all-reduce|collective-permute|reduce-scatter)\b"
assert jax.device_count() == DEVICES
rng = np.random.default_rng(int(os.environ.get("JAXCSR_TEST_SEED", "0")))
explicit = jax.make_mesh((DEVICES,), ("d",))  # jax's default: Explicit axes
auto = jax.make_mesh((DEVICES,), ("d",), axis_types=(AxisType.Auto,))


def collectives(fn, *args) -> set[str]:
    return set(re.findall(COLLECTIVES, jax.jit(fn).lower(*args).compile().as_text()))


def hub_ids(size, num_rows, share=0.3):
    """Power-law ids plus a hub row holding ``share`` of them; the last row empty."""
    ids = np.minimum((rng.pareto(1.2, size) * 3).astype(np.int64), num_rows - 2)
    ids[rng.random(size) < share] = num_rows // 3
    return rng.permutation(ids)


def check_segment_form(mesh):
    K, M = 4000, 16 * DEVICES
    idx = hub_ids(K, M)
    w = rng.uniform(-2, 2, K).astype(np.float32)
    v = rng.standard_normal((K, 3)).astype(np.float32)
    ct = rng.standard_normal((M, 3)).astype(np.float32)
    for data in (w,) if QUICK else (None, w):
        _segment_case(mesh, idx, M, data, v, ct)
    _segment_communication(mesh, idx, M, v)


def _segment_case(mesh, idx, M, data, v, ct):
    K = idx.size
    A = CSRMatrix.from_indices(idx, M, data=data)
    S = jaxcsr.shard(A, mesh, "d")
    assert S.form == "segment" and S.shape == A.shape == (M, K)
    assert S.layout_size == len(S.input_order) >= K
    assert np.array_equal(np.sort(S.input_order[S.input_order >= 0]), np.arange(K))
    vl = S.layout_values(v)
    weighted = v * (1.0 if data is None else data[:, None])
    for reduce in ("sum", "max") if QUICK else ("sum", "mean", "max", "min"):
        y = jax.jit(lambda vl, reduce=reduce: S.matmul_laid_out(vl, reduce=reduce))(vl)
        # values in input order: laid out inside the product, the same result
        y_in = jax.jit(lambda v, reduce=reduce: jaxcsr.matmul(S, v, reduce=reduce))(v)
        np.testing.assert_array_equal(np.asarray(y_in), np.asarray(y))
        assert y.shape == (M, 3)
        assert_close(y, segment_reference(weighted, idx, M, reduce), np.float32)
        single = np.asarray(jaxcsr.matmul(A, v, reduce=reduce))
        if reduce in ("max", "min"):  # exact whatever the grouping
            np.testing.assert_array_equal(np.asarray(y), single)
        else:
            np.testing.assert_allclose(np.asarray(y), single, rtol=1e-5, atol=1e-5)
    y, arg = S.matmul_laid_out(vl, reduce="max", return_arg=True)
    _, ref_arg = jaxcsr.matmul(A, v, reduce="max", return_arg=True)
    arg = np.asarray(arg)
    size = S.layout_size
    in_order = np.where(arg < size, S.input_order[np.minimum(arg, size - 1)], K)
    np.testing.assert_array_equal(in_order, np.asarray(ref_arg))
    _, arg_in = jaxcsr.matmul(S, v, reduce="max", return_arg=True)  # input positions
    np.testing.assert_array_equal(np.asarray(arg_in), np.asarray(ref_arg))
    # gradients w.r.t. the per-edge values (both forms) and the matrix values
    gv = jax.grad(lambda vl: jnp.sum(jnp.sin(S.matmul_laid_out(vl)) * ct))(vl)
    ref_gv = jax.grad(lambda v: jnp.sum(jnp.sin(A @ v) * ct))(v)
    real = S.input_order >= 0
    assert_close(np.asarray(gv)[real], np.asarray(ref_gv)[S.input_order[real]], np.float32)
    assert np.all(np.asarray(gv)[~real] == 0)
    gv_in = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(S @ v) * ct)))(v)
    assert_close(gv_in, ref_gv, np.float32)
    for wrong, form in ((vl, "S.matmul_laid_out"), (v[:-1], "S.matmul_laid_out")):
        try:
            S @ wrong
        except ValueError as err:
            assert f"A.shape[1] = {K}" in str(err) and form in str(err), err
        else:
            raise AssertionError("a wrong length must raise")
    try:
        S.matmul_laid_out(v[:-1])
    except ValueError as err:
        assert f"A.shape[1] = {size}" in str(err) and "S @ v" in str(err), err
    else:
        raise AssertionError("a wrong laid-out length must raise")
    Sw = S.with_data(
        S.layout_data(np.asarray(A.data)) if data is not None else jnp.ones(len(S.data_order))
    )
    gw = jax.grad(lambda d: jnp.sum(jnp.sin(Sw.with_data(d).matmul_laid_out(vl)) * ct))(Sw.data)
    Aw = A if data is not None else A.with_data(jnp.ones(A.nnz))
    ref_gw = jax.grad(lambda d: jnp.sum(jnp.sin(Aw.with_data(d) @ v) * ct))(Aw.data)
    keep = S.data_order >= 0
    assert_close(np.asarray(gw)[keep], np.asarray(ref_gw)[S.data_order[keep]], np.float32)


def _segment_communication(mesh, idx, M, v):
    """Laid out as S.input_sharding says, the segment form needs no communication."""
    for balance, allowed in (("rows", set()), ("nnz", {"collective-permute"})):
        S = jaxcsr.shard(CSRMatrix.from_indices(idx, M), mesh, "d", balance=balance)
        vl = S.layout_values(v)
        assert vl.sharding == S.input_sharding
        forward = collectives(lambda vl, S=S: S.matmul_laid_out(vl), vl)
        backward = collectives(
            jax.grad(lambda vl, S=S: jnp.sum(jnp.sin(S.matmul_laid_out(vl)))), vl
        )
        assert forward <= allowed and backward <= allowed, (balance, forward, backward)
        cost = S.communication(3)
        assert (cost["relayout"] > 0) == bool(forward)
        assert cost["gather_x"] == 0
        # values in input order, split evenly: laying them out moves what cost says
        v_in = jax.device_put(v, S.input_sharding)
        moved = collectives(lambda v, S=S: S @ v, v_in)
        assert cost["layout"] > 0 and moved - allowed, (cost, moved)


def check_spmm_form(mesh):
    m, n = 24 * DEVICES, 40
    hub = sp.csr_array(
        (rng.uniform(-1, 1, 300), (np.full(300, 5), rng.integers(0, n, 300))), shape=(m, n)
    )
    for mat in (random_csr(rng, m, n, "power_law") + hub, random_csr(rng, m, n, "empty_rows")):
        S, x = _spmm_case(mesh, mat)
    # x is gathered (forward) and its cotangent reduce-scattered (backward)
    found = collectives(lambda x: S @ x, x)
    assert "all-gather" in found, found
    back = collectives(jax.grad(lambda x: jnp.sum(S @ x)), x)
    assert back & {"reduce-scatter", "all-reduce"}, back


def _spmm_case(mesh, mat):
    (m, n) = mat.shape
    A = CSRMatrix.from_scipy(mat)
    S = jaxcsr.shard(A, mesh, "d")
    assert S.form == "spmm" and S.shape == A.shape
    x = jax.device_put(rng.standard_normal((n, 4)).astype(np.float32), NamedSharding(mesh, P("d")))
    dense = mat.toarray()
    assert_close(S @ x, dense @ np.asarray(x, np.float64), np.float32)
    for reduce in ("mean", "max", "min"):
        np.testing.assert_allclose(
            np.asarray(jaxcsr.matmul(S, x, reduce=reduce)),
            np.asarray(jaxcsr.matmul(A, np.asarray(x), reduce=reduce)),
            rtol=1e-6,
            atol=1e-6,
        )
    _, arg = jaxcsr.matmul(S, x, reduce="min", return_arg=True)
    _, ref_arg = jaxcsr.matmul(A, np.asarray(x), reduce="min", return_arg=True)
    np.testing.assert_array_equal(np.asarray(arg), np.asarray(ref_arg))
    ct = rng.standard_normal((m, 4)).astype(np.float32)
    gx = jax.jit(jax.grad(lambda x: jnp.sum((S @ x) * ct)))(x)
    assert_close(gx, dense.T @ ct.astype(np.float64), np.float32)
    gw = jax.grad(lambda d: jnp.sum(jnp.cos(S.with_data(d) @ x)))(S.data)
    ref = jax.grad(lambda d: jnp.sum(jnp.cos(A.with_data(d) @ np.asarray(x))))(A.data)
    keep = S.data_order >= 0
    assert_close(np.asarray(gw)[keep], np.asarray(ref)[S.data_order[keep]], np.float32)
    return S, x


class RowLoader:
    """``load_rows`` over a host CSR that records which rows were asked for."""

    def __init__(self, indptr, indices, data=None):
        self.indptr, self.indices, self.data, self.calls = indptr, indices, data, []

    def __call__(self, lo, hi):
        self.calls.append((lo, hi))
        span = slice(self.indptr[lo], self.indptr[hi])
        cols = self.indices[span]
        return cols if self.data is None else (cols, self.data[span])


def check_shard_rows(mesh):
    """shard_rows, built from row lengths and per-block rows, equals shard of the whole
    matrix: each block read once, the same layout, products and gradients."""
    K, M = 3000, 16 * DEVICES + 3
    idx = hub_ids(K, M)
    w = rng.uniform(-2, 2, K).astype(np.float32)
    order = np.argsort(idx, kind="stable")  # the edges of each row, in input order
    indptr = np.concatenate([[0], np.cumsum(np.bincount(idx, minlength=M))])
    v = rng.standard_normal((K, 3)).astype(np.float32)
    ct = rng.standard_normal((M, 3)).astype(np.float32)
    for data in (None, w):
        load = RowLoader(indptr, order, None if data is None else data[order])
        dtype = None if data is None else np.float32
        S = jaxcsr.shard_rows(
            np.diff(indptr), load, mesh, "d", num_cols=K, dtype=dtype, form="segment"
        )
        ref = jaxcsr.shard(CSRMatrix.from_indices(idx, M, data=data), mesh, "d")
        starts = ref.row_starts
        assert sorted(load.calls) == [(starts[p], starts[p + 1]) for p in range(DEVICES)]
        assert S.shape == ref.shape and S.layout_size == ref.layout_size
        np.testing.assert_array_equal(S.input_order, ref.input_order)
        np.testing.assert_array_equal(S.data_order, ref.data_order)
        np.testing.assert_array_equal(np.asarray(S.layout_values(v)), ref.layout_values(v))
        for reduce in ("sum", "max"):
            got = jax.jit(lambda S, v, r=reduce: jaxcsr.matmul(S, v, reduce=r))(S, v)
            np.testing.assert_array_equal(np.asarray(got), jaxcsr.matmul(ref, v, reduce=reduce))
        weighted = v * (1.0 if data is None else data[:, None])
        assert_close(S @ v, segment_reference(weighted, idx, M, "sum"), np.float32)
        grad = jax.jit(jax.grad(lambda v, S: jnp.sum(jnp.sin(S @ v) * ct)))
        np.testing.assert_array_equal(np.asarray(grad(v, S)), grad(v, ref))
    # SpMM form, values loaded with the rows, in 16 bits
    m, n = 20 * DEVICES + 1, 37
    mat = random_csr(rng, m, n, "power_law").astype(np.float32)
    load = RowLoader(mat.indptr, mat.indices, mat.data)
    S = jaxcsr.shard_rows(np.diff(mat.indptr), load, mesh, "d", num_cols=n, dtype=jnp.bfloat16)
    assert S.form == "spmm" and S.dtype == jnp.bfloat16 and len(load.calls) == DEVICES
    A = CSRMatrix.from_scipy(mat).with_data(jnp.asarray(mat.data, jnp.bfloat16))
    x = rng.standard_normal((n, 4)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(S @ x), np.asarray(jaxcsr.shard(A, mesh, "d") @ x))
    gx = jax.grad(lambda x: jnp.sum(jnp.cos(S @ x)))(x)
    ref_gx = jax.grad(lambda x: jnp.sum(jnp.cos(A @ x)))(x)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(ref_gx), rtol=2e-2, atol=2e-2)


def check_empty_shards(mesh):
    """More devices than non-empty rows; an all-empty matrix."""
    idx = np.array([1, 1, 0, 1, 2])
    A = CSRMatrix.from_indices(idx, 3)
    S = jaxcsr.shard(A, mesh, "d")
    assert min(S.block_nnz) == 0
    v = rng.standard_normal((5, 2)).astype(np.float32)
    laid = S.matmul_laid_out(S.layout_values(v))
    np.testing.assert_allclose(np.asarray(laid), np.asarray(A @ v), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(S @ v), np.asarray(A @ v), rtol=1e-6)
    Z = jaxcsr.shard(CSRMatrix.from_scipy(sp.csr_array((7, 4))), mesh, "d")
    assert np.all(np.asarray(Z @ np.ones((4, 2), np.float32)) == 0)


def check_auto_axes(mesh):
    """Auto mesh axes: the same products, an uneven row count (replicated result)."""
    idx = hub_ids(1000, 4 * DEVICES + 1)
    A = CSRMatrix.from_indices(idx, 4 * DEVICES + 1)
    S = jaxcsr.shard(A, mesh, "d")
    v = rng.standard_normal((1000, 2)).astype(np.float32)
    y = jax.jit(lambda vl: S.matmul_laid_out(vl))(S.layout_values(v))
    assert_close(y, segment_reference(v, idx, 4 * DEVICES + 1), np.float32)
    assert_close(jax.jit(lambda v: S @ v)(v), y, np.float32)
    mat = random_csr(rng, 8 * DEVICES, 30, "power_law")
    SA = jaxcsr.shard(CSRMatrix.from_scipy(mat), mesh, "d")
    x = rng.standard_normal((30, 3)).astype(np.float32)
    gx = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(SA @ x))))(x)
    ref = np.cos(mat.toarray() @ x.astype(np.float64))
    assert_close(gx, mat.toarray().T @ ref, np.float32)


def check_gcn():
    """The GCN client on all devices reaches the single-device accuracy."""
    from examples import gcn

    data = gcn.load_cora()
    for seed in (0,):  # 40 epochs keeps the test short; same seed, same dropout masks
        one = gcn.train(data, "jaxcsr", seed, epochs=40)
        many = gcn.train(data, "jaxcsr_sharded", seed, epochs=40)
        # the same training run: the losses agree to float32 rounding after 40 steps
        np.testing.assert_allclose(many["final_loss"], one["final_loss"], rtol=1e-4)
        print(
            f"gcn accuracy: 1 device {one['test_accuracy']:.3f}, {DEVICES} devices "
            f"{many['test_accuracy']:.3f}; step {one['step_median_s'] * 1e3:.1f} ms vs "
            f"{many['step_median_s'] * 1e3:.1f} ms",
            file=sys.stderr,
        )
        # the first step's inputs are uncommitted and its outputs come back placed on
        # the mesh, so the step traces once more (single device: once)
        assert many["traces"] <= 2, many
        assert abs(many["test_accuracy"] - one["test_accuracy"]) <= 0.01, (one, many)
        assert many["test_accuracy"] >= 0.70


def _structures(M, K, balanced):
    """20 (balanced) or 10 (skewed) segment-id arrays of length K over M rows, with
    different degree distributions.

    balanced: uniform, and power laws of exponent 0-0.6 over permuted rows -- blocks
    that fit the balanced capacities. Otherwise: power-law tails packed at the first
    rows plus a hub of 0-60 % of the ids, or a hub of 15 % among spread rows."""
    for i in range(20 if balanced else 10):
        if not balanced:
            if i % 4 == 3:  # a hub row with 15 % of the ids among spread rows
                ids = rng.integers(0, M, K)
                ids[rng.random(K) < 0.15] = int(rng.integers(M))
                yield ids
            else:
                yield hub_ids(K, M, 0.6 * i / 9)
            continue
        weights = 1.0 / np.arange(1, M + 1) ** (0.6 * i / 19)
        yield rng.permutation(M)[rng.choice(M, K, p=weights / weights.sum())]


def check_compiles_per_structure(mesh):
    """One jitted step over structures of equal shape and nnz with different degree
    distributions, both forms, values and gradients checked: 20 balanced ones compile
    once; 10 skewed ones once per static plan (capacity steps), fewer than structures."""
    K, M, N = 6000, 200 * DEVICES, 40  # rows much smaller than a block, as in real graphs
    for balanced in (True, False):
        traces = {"segment": 0, "spmm": 0}

        def step(S, v, form, traces=traces):
            traces[form] += 1
            y = S.matmul_laid_out(v) if form == "segment" else S @ v
            return 0.5 * jnp.sum(y * y)

        steps = {
            form: jax.jit(jax.value_and_grad(lambda S, v, f=form: step(S, v, f), argnums=1))
            for form in traces
        }
        plans, largest = {"segment": set(), "spmm": set()}, set()
        for idx in _structures(M, K, balanced):
            S = jaxcsr.shard(CSRMatrix.from_indices(idx, M), mesh, "d")
            v = rng.standard_normal((K, 2)).astype(np.float32)
            loss, g = steps["segment"](S, S.layout_values(v))
            want = segment_reference(v, idx, M)
            np.testing.assert_allclose(loss, 0.5 * np.sum(want**2), rtol=1e-4)
            real = S.input_order >= 0
            g_in = np.zeros((K, 2))
            g_in[S.input_order[real]] = np.asarray(g)[real]
            assert_close(g_in, want[idx], np.float32)
            B = CSRMatrix.from_coo(idx, rng.integers(0, N, K), shape=(M, N))
            SB = jaxcsr.shard(B, mesh, "d")
            x = rng.standard_normal((N, 2)).astype(np.float32)
            loss, g = steps["spmm"](SB, x)
            dense = B.to_scipy().toarray().astype(np.float64)
            np.testing.assert_allclose(loss, 0.5 * np.sum((dense @ x) ** 2), rtol=1e-4)
            want = dense.T @ (dense @ x)  # sums of up to ~1e4 terms: float32 rounding
            np.testing.assert_allclose(g, want, rtol=0, atol=1e-4 * np.abs(want).max())
            plans["segment"].add(S._spec)
            plans["spmm"].add(SB._spec)
            largest.add((max(S.block_nnz), max(np.diff(S.row_starts))))
        print(
            f"{'balanced' if balanced else 'skewed'} structures: traces {traces} for "
            f"{20 if balanced else 10} structures with {len(largest)} distinct largest blocks",
            file=sys.stderr,
        )
        assert len(largest) >= (10 if balanced else 8)  # the structures' blocks differ
        for form, count in traces.items():
            assert count == len(plans[form]), (form, count, len(plans[form]))
            assert count == 1 if balanced else count < len(largest), (balanced, traces)


def timed(name, fn, *args):
    t0 = time.perf_counter()
    fn(*args)
    print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


QUICK = "--quick" in sys.argv  # the 8-device run: fewer reductions, same structures
with jax.set_mesh(explicit):  # what jax asks for eager work on Explicit axes
    timed("segment form", check_segment_form, explicit)
    timed("spmm form", check_spmm_form, explicit)
    timed("empty shards", check_empty_shards, explicit)
    timed("shard_rows", check_shard_rows, explicit)
    if not QUICK:
        timed("compiles per structure", check_compiles_per_structure, explicit)
with jax.set_mesh(auto):
    timed("auto axes", check_auto_axes, auto)
if "--gcn" in sys.argv:
    timed("gcn", check_gcn)
print("ok")
