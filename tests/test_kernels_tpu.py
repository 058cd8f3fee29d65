"""The Pallas TPU (Mosaic) kernel: correctness (compiled on a TPU, interpreted elsewhere),
its schedule, and its lowering for TPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from reference import (
    ALL,
    TPU_INTERPRET,
    assert_close,
    assert_kernel_grads,
    assert_sums_close,
    power_law_ids,
    random_csr,
    random_values,
)

import jaxcsr
from jaxcsr import CSRMatrix, device_plan, plan
from jaxcsr.kernels import tpu

SMALL = tpu.Tiling(block_k=256, window=16, block_m=64)
"""Tiles small enough that a test's structure needs many blocks, several windows per
block and several output tiles."""


def tpu_matmul(A, x, **kw):
    return jaxcsr.matmul(A, x, impl="pallas_tpu", interpret=TPU_INTERPRET, **kw)


def _skewed_ids(rng, size, num_rows, busy_rows):
    """One row holds half the nonzeros; rows at or past ``busy_rows`` are all empty."""
    idx = rng.integers(0, min(num_rows, busy_rows), size)
    idx[: size // 2] = 3
    return rng.permutation(idx)


def _kernel_sum(values, indptr, num_rows, tiling, interpret=TPU_INTERPRET, **kw):
    schedule = jax.tree.map(jnp.asarray, tpu.plan_schedule(indptr, tiling))
    rows = tpu.padded_rows(tpu.row_of_entry(indptr, int(indptr[-1])), tiling.block_k)
    return tpu.spmm(
        jnp.asarray(values),
        jnp.asarray(rows),
        schedule,
        num_rows=num_rows,
        interpret=interpret,
        **kw,
    )


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("n_features", [3, 130])
def test_segment_sum_skewed_rows_and_empty_tiles(rng, dtype, n_features):
    num_rows = 2 * tpu.MAX_BLOCK_M + 5  # three output tiles, the last without nonzeros
    idx = _skewed_ids(rng, 700, num_rows, tpu.MAX_BLOCK_M + 40)
    A = CSRMatrix.from_indices(idx, num_rows=num_rows, backends=ALL)
    v = random_values(rng, (700, n_features)).astype(dtype)
    out = tpu_matmul(A, jnp.asarray(v))
    assert out.dtype == np.dtype(dtype)
    expected = np.zeros((num_rows, n_features))
    np.add.at(expected, idx, v.astype(np.float64))
    assert_close(out, expected, dtype)


def test_float32_values_keep_all_24_bits(rng):
    """float32 goes through the MXU as three bfloat16 parts: values that differ from 1
    below bfloat16's 8 bits still sum to float32 accuracy (one part would not)."""
    idx = power_law_ids(rng, 500, 40)
    v = (1.0 + rng.uniform(0, 1e-3, (500, 4))).astype(np.float32)
    out = tpu_matmul(CSRMatrix.from_indices(idx, num_rows=40, backends=ALL), jnp.asarray(v))
    expected = np.zeros((40, 4))
    np.add.at(expected, idx, v.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-6)


@pytest.mark.parametrize("kind", ["power_law", "empty_rows", "empty"])
def test_general_matrix_with_values(rng, kind):
    mat = random_csr(rng, 150, 37, kind)
    A = CSRMatrix.from_scipy(mat, backends=ALL)
    x = random_values(rng, (37, 2, 3)).astype(np.float32)
    out = tpu_matmul(A, jnp.asarray(x))
    assert_close(out, np.einsum("mn,nab->mab", mat.toarray(), x.astype(np.float64)), np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "interpret",
    [TPU_INTERPRET, pltpu.InterpretParams() if TPU_INTERPRET else False],
    ids=["pallas", "tpu"],
)
def test_small_tiles_many_windows_under_both_interpreters(rng, dtype, interpret):
    """The kernel itself with tiles far smaller than a structure's rows: blocks that
    need several windows (the later ones clamped to the tile's end), several output
    tiles, empty tiles, rows not a multiple of anything, odd features; sums and
    max/min (bit for bit against numpy) under the generic and the TPU interpreter."""
    num_rows = 5 * SMALL.block_m + 9
    idx = np.sort(_skewed_ids(rng, 900, num_rows, 3 * SMALL.block_m))
    indptr, _ = plan.segment_ids_to_csr(idx, num_rows)
    assert tpu.plan_schedule(indptr, SMALL).num_steps > -(-900 // SMALL.block_k) + 5
    vals = random_values(rng, (900, 3)).astype(dtype)
    out = _kernel_sum(vals, indptr, num_rows, SMALL, interpret)
    expected = np.zeros((num_rows, 3))
    np.add.at(expected, idx, vals.astype(np.float64))
    assert_close(out, expected, dtype)
    wide = vals.astype(np.float32)
    for reduce, ufunc, identity in (("max", np.maximum, -np.inf), ("min", np.minimum, np.inf)):
        got = _kernel_sum(vals, indptr, num_rows, SMALL, interpret, reduce=reduce, chunk=128)
        want = np.full((num_rows, 3), identity, np.float32)
        ufunc.at(want, idx, wide)
        np.testing.assert_array_equal(np.asarray(got), want)


WIDE_TILE = tpu.Tiling(block_k=256, window=16, block_m=392)
"""A tile wider than 128 lanes, so feature-major windows start off a lane boundary."""


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "n_features,interpret",
    [(n, TPU_INTERPRET) for n in (1, 3, 8, 64, 100)]
    + [(n, pltpu.InterpretParams() if TPU_INTERPRET else False) for n in (1, 64)],
    ids=["pallas-1", "pallas-3", "pallas-8", "pallas-64", "pallas-100", "tpu-1", "tpu-64"],
)
def test_feature_major_kernel_matches_float64(rng, dtype, n_features, interpret):
    """The feature-major kernel (values ``(N, nnz)``, output window placed by a lane
    rotation; sums against float64, max/min with the segmented scan along lanes bit
    for bit against numpy) with tiles far smaller than the structure: several windows
    per block, windows starting at every multiple of 8 inside 392-row tiles, an empty last tile,
    one row holding half the entries, widths 1 to 100 (not multiples of 8)."""
    num_rows = 3 * WIDE_TILE.block_m + 11
    idx = np.sort(_skewed_ids(rng, 1500, num_rows, 2 * WIDE_TILE.block_m + 30))
    indptr, _ = plan.segment_ids_to_csr(idx, num_rows)
    schedule = tpu.plan_schedule(indptr, WIDE_TILE)
    starts = np.asarray(schedule.span)[(np.asarray(schedule.tile) & tpu.SKIP) == 0] & 0xFFFF
    assert len(set(starts % 128)) > 4  # windows at many lane offsets
    vals = random_values(rng, (1500, n_features)).astype(dtype)
    rows = tpu.padded_rows(tpu.row_of_entry(indptr, int(indptr[-1])), WIDE_TILE.block_k)

    def kernel(reduce):
        return tpu.spmm_feature_major(
            jnp.asarray(vals).T,
            jnp.asarray(rows),
            jax.tree.map(jnp.asarray, schedule),
            num_rows=num_rows,
            reduce=reduce,
            interpret=interpret,
        )

    out = kernel("sum")
    assert out.shape == (num_rows, n_features) and out.dtype == jnp.float32
    expected = np.zeros((num_rows, n_features))
    np.add.at(expected, idx, vals.astype(np.float64))
    assert_close(out, expected, np.float32)  # float32 accumulation of exact values
    wide = vals.astype(np.float32)
    for reduce, ufunc, identity in (("max", np.maximum, -np.inf), ("min", np.minimum, np.inf)):
        want = np.full((num_rows, n_features), identity, np.float32)
        ufunc.at(want, idx, wide)
        np.testing.assert_array_equal(np.asarray(kernel(reduce)), want)  # bits, empty rows


@pytest.mark.parametrize("n_features", [1, 5, 64])
def test_narrow_sums_run_feature_major_and_take_inf_and_nan(rng, n_features):
    """``A @ v`` with fewer than 128 features runs the feature-major kernel; an inf or
    NaN sends it to the IEEE (row-major) kernel, which gives numpy's answer (max with
    inf and NaN at narrow widths: ``test_tpu_kernel_keeps_nan_at_wide_features``)."""
    idx = power_law_ids(rng, 600, 70)
    A = CSRMatrix.from_indices(idx, num_rows=70, backends=ALL)
    v = random_values(rng, (600, n_features)).astype(np.float32)
    for bad in (None, np.inf, np.nan, -np.inf):
        x = v.copy()
        if bad is not None:
            x[int(rng.integers(0, 600)), int(rng.integers(0, n_features))] = bad
        expected, abs_sums = np.zeros((70, n_features)), np.zeros((70, n_features))
        np.add.at(expected, idx, x.astype(np.float64))
        np.add.at(abs_sums, idx, np.abs(x.astype(np.float64)))
        got = np.asarray(tpu_matmul(A, jnp.asarray(x)))
        finite = np.isfinite(expected)
        np.testing.assert_array_equal(got[~finite], expected[~finite])  # inf, -inf, NaN
        assert_sums_close(got[finite], expected[finite], abs_sums[finite], np.float32)


@pytest.mark.parametrize("n_features", [5, 130])
def test_a_callers_highest_matmul_precision_does_not_reach_the_kernel(rng, n_features):
    """The kernel's MXU products are one-pass bfloat16 products (exact); their precision
    is explicit, so ``jax.default_matmul_precision("highest")`` around a caller's code
    leaves them as they are (compiled on a TPU, it failed to build: Mosaic rejects
    bfloat16 operands at HIGHEST). The same bits with it and without, feature-major (5
    features) and row-major, with an inf (the IEEE kernel's counts too)."""
    idx = power_law_ids(rng, 600, 70)
    A = CSRMatrix.from_indices(idx, num_rows=70, backends=ALL)
    v = random_values(rng, (600, n_features)).astype(np.float32)
    v[int(rng.integers(0, 600)), 0] = np.inf
    want = np.asarray(jax.jit(lambda v: tpu_matmul(A, v))(v))
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda v: tpu_matmul(A, v))(v))
    np.testing.assert_array_equal(got, want)
    expected = np.zeros((70, n_features))
    np.add.at(expected, idx, v.astype(np.float64))
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(got[~finite], expected[~finite])


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_fast_kernel_output_is_finite_only_when_right(rng, reduce):
    """What product's rerun rests on: without ``ieee`` the kernel equals the IEEE one
    on finite values; with an inf or NaN anywhere (any block, any window), its output
    is either right or not finite (always not finite for sums: the value's own row);
    the IEEE kernel gives numpy's answer."""
    num_rows = 3 * SMALL.block_m + 5
    idx = np.sort(_skewed_ids(rng, 700, num_rows, 2 * SMALL.block_m))
    indptr, _ = plan.segment_ids_to_csr(idx, num_rows)
    vals = random_values(rng, (700, 5)).astype(np.float32)
    kw = {"reduce": reduce, "chunk": 128}
    fast = _kernel_sum(vals, indptr, num_rows, SMALL, **kw)
    np.testing.assert_array_equal(
        np.asarray(fast), np.asarray(_kernel_sum(vals, indptr, num_rows, SMALL, ieee=True, **kw))
    )
    ufunc, identity = {"sum": (np.add, 0.0), "max": (np.maximum, -np.inf)}[reduce]
    for bad in (np.inf, -np.inf, np.nan, np.inf):
        spoilt = vals.copy()
        k = int(rng.integers(0, 700))
        spoilt[k, int(rng.integers(0, 5))] = bad
        want = np.full((num_rows, 5), identity)
        ufunc.at(want, idx, spoilt.astype(np.float64))
        got = np.asarray(_kernel_sum(spoilt, indptr, num_rows, SMALL, ieee=True, **kw))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5)
        fast = np.asarray(_kernel_sum(spoilt, indptr, num_rows, SMALL, **kw))
        if reduce == "sum" or bad != -np.inf:
            assert not np.isfinite(fast[idx[k]]).all(), (bad, k)
        else:  # a -inf below its row's max changes nothing; product zeroes empty rows
            nonempty = np.diff(indptr) > 0
            fast, got = fast[nonempty], got[nonempty]
            assert not np.isfinite(fast).all() or np.array_equal(fast, got), k


def test_grads_through_the_kernel(rng):
    assert_kernel_grads(tpu_matmul, rng, 13, 9)


def _coverage(schedule: tpu.Schedule, indptr: np.ndarray) -> np.ndarray:
    """How many steps count each nonzero (decoded from the packed step arrays)."""
    t = schedule.tiling
    nnz = int(indptr[-1])
    rows = tpu.row_of_entry(indptr, nnz)
    seen = np.zeros(nnz, int)
    for b, word, span in zip(schedule.block, schedule.tile, schedule.span, strict=True):
        if word & tpu.SKIP:
            continue
        tile, start, lo = word >> 2, span & 0xFFFF, span >> 16
        block = np.arange(b * t.block_k, min((b + 1) * t.block_k, nnz))
        local = rows[block] - tile * t.block_m
        seen[block[(local >= lo) & (local >= start) & (local < start + t.window)]] += 1
    return seen


def test_schedule_counts_every_nonzero_once_and_its_length_depends_on_shape_only(rng):
    """Structures with the same (m, nnz) and different row-length distributions get
    schedules of one length (one compilation), each counting every nonzero once."""
    m, nnz = 300, 2000
    lengths = set()
    for ids in (
        rng.integers(0, m, nnz),  # uniform rows
        power_law_ids(rng, nnz, m),  # skewed rows
        np.zeros(nnz, int),  # one row holds everything
        np.arange(nnz) % 7,  # a few rows, many empty tiles
        rng.integers(0, m, nnz) // 16 * 16,  # every 16th row: sparse spans
    ):
        indptr, _ = plan.segment_ids_to_csr(np.asarray(ids), m)
        s = tpu.plan_schedule(indptr, SMALL)
        lengths.add(s.block.size)
        np.testing.assert_array_equal(_coverage(s, indptr), 1)
        skip = (s.tile & tpu.SKIP) != 0
        first = (s.tile & tpu.FIRST) != 0
        tiles = s.tile >> 2
        # every tile gets its FIRST step before any other, in order
        np.testing.assert_array_equal(tiles[first], np.arange(-(-m // SMALL.block_m)))
        assert np.all(np.diff(tiles) >= 0)
        assert not np.any(skip[: s.num_steps] & ~first[: s.num_steps])
    assert lengths == {tpu.schedule_capacity(m, nnz, SMALL)}


def test_traced_schedule_equals_the_host_schedule(rng):
    for ids, m in ((power_law_ids(rng, 3000, 700), 700), (np.zeros(0, int), 5)):
        indptr, _ = plan.segment_ids_to_csr(np.asarray(ids), m)
        nnz = int(indptr[-1])
        for tiling in (SMALL, None):
            host = tpu.plan_schedule(indptr, tiling)
            device = jax.jit(lambda p, t=tiling, n=nnz: tpu.plan_schedule(p, t, nnz=n))(
                jnp.asarray(indptr, jnp.int32)
            )
            assert host.tiling == device.tiling
            for name in ("block", "tile", "span"):
                np.testing.assert_array_equal(getattr(host, name), getattr(device, name))


def test_tiling_depends_on_rows_and_nnz_only():
    assert tpu.choose_tiling(11_758, 1_038_000) == tpu.Tiling(2048, 128, 1024)
    sparse = tpu.choose_tiling(2_708, 10_556)  # Cora: 4 nonzeros a row
    assert sparse.window >= 128 and sparse.block_k <= 2048
    tiny = tpu.choose_tiling(5, 3)
    assert tiny.block_m == 8 and tiny.window == 8
    with pytest.raises(ValueError, match="multiples"):
        tpu.Tiling(100, 8, 8)


@pytest.mark.parametrize("n_features", [1, 3, 8, 64, 100, 130])
def test_each_width_lowers_to_its_kernel_for_tpu(n_features):
    """Products of fewer than 128 features lower to the feature-major kernel (sum and
    max), wider ones to the row-major one; forward and backward, float32 and
    bfloat16."""
    idx = np.array([0, 2, 2, 1, 0, 4, 4, 4, 3, 3, 1])
    A = CSRMatrix.from_indices(idx, num_rows=5, backends=ALL)
    narrow = n_features < 128
    for dtype in (jnp.float32, jnp.bfloat16):
        v = jax.ShapeDtypeStruct((idx.size, n_features), dtype)
        y = jax.ShapeDtypeStruct((5, n_features), dtype)
        for f, args, feature_major in (
            (lambda v: A @ v, (v,), narrow),
            (lambda v: jaxcsr.matmul(A, v, reduce="max"), (v,), narrow),
            # the backward of a segment sum is a row gather (XLA), of A.T @ y a sum
            (lambda y: A.T @ y, (y,), False),
        ):
            text = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
            assert ("jaxcsr_window_spmm_feature_major" in text) == feature_major, (f, dtype)
            if not feature_major and "tpu_custom_call" in text:
                assert "jaxcsr_window_spmm" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_for_tpu(dtype):
    A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0, 4, 4, 4]), num_rows=5, backends=ALL)
    B = CSRMatrix.from_dense(np.arange(1.0, 41.0).reshape(5, 8), backends=ALL)  # general
    for f in (
        jax.jit(lambda v: A @ v),  # impl=None picks the kernel on TPU
        jax.jit(lambda v: jaxcsr.matmul(A, v, reduce="max")),
        # the backward of a general matrix is the kernel on the planned transpose
        jax.jit(jax.grad(lambda v: jnp.sum(B.with_data(B.data.astype(v.dtype)) @ v))),
    ):
        text = export.export(f, platforms=["tpu"])(jax.ShapeDtypeStruct((8, 20), dtype))
        assert "tpu_custom_call" in text.mlir_module()
    xla_only = jax.jit(lambda v: jaxcsr.matmul(A, v, impl="xla"))
    text = export.export(xla_only, platforms=["tpu"])(jax.ShapeDtypeStruct((8, 20), dtype))
    assert "tpu_custom_call" not in text.mlir_module()


def test_traced_ids_default_to_the_kernel_only_when_sorted_and_long():
    """On TPU, ``impl=None`` runs XLA's scatter for unsorted traced ids (a sort and a
    gather per call cost more there) and for sorted ones with fewer than
    DEVICE_PLAN_MIN_IDS_PER_ROW ids per segment (the device plan costs per row); the
    kernel for longer sorted segments; ``impl=`` forces it."""
    per_row = tpu.DEVICE_PLAN_MIN_IDS_PER_ROW
    v_long = jax.ShapeDtypeStruct((9 * per_row, 16), jnp.float32)
    v_short = jax.ShapeDtypeStruct((9 * per_row - 1, 16), jnp.float32)

    def lowered(v, impl=None, **kw):
        ids = jax.ShapeDtypeStruct(v.shape[:1], jnp.int32)

        def f(v, i):
            A = CSRMatrix.from_indices(i, 9, backends=ALL, **kw)
            return jaxcsr.matmul(A, v, impl=impl)

        return export.export(jax.jit(f), platforms=["tpu"])(v, ids).mlir_module()

    assert "tpu_custom_call" not in lowered(v_long)
    assert "tpu_custom_call" in lowered(v_long, indices_are_sorted=True)
    assert "tpu_custom_call" not in lowered(v_short, indices_are_sorted=True)
    assert "tpu_custom_call" in lowered(v_short, impl="pallas_tpu", indices_are_sorted=True)
    assert "tpu_custom_call" in lowered(v_long, impl="pallas_tpu")
    structure = device_plan.segment_structure(jnp.zeros(64, jnp.int32), 9)
    assert not tpu.default_for(structure) and tpu.covers(structure)


def test_schedule_stats_for_docs():
    """The command behind docs/tpu.md's schedule table runs on any machine."""
    from benchmarks.hardware.on_tpu import schedule_stats

    rows = schedule_stats()
    assert len(rows) == 4
    for row in rows:
        assert float(row.split("|")[-2]) >= 1.0  # never fewer steps than blocks


@pytest.mark.parametrize("n_features,reduce", [(32, "max"), (64, "min"), (8, "max"), (130, "min")])
def test_tpu_kernel_keeps_nan_at_wide_features(rng, reduce, n_features):
    """A NaN propagates to its row only, also through the MXU's selection (where
    ``0 * NaN`` would spread it over the window)."""
    idx = power_law_ids(rng, 200, 9)
    x = random_values(rng, (200, n_features)).astype(np.float32)
    x[np.flatnonzero(idx == idx[0])[0], 5] = np.nan
    x[np.flatnonzero(idx == idx[-1])[-1], n_features - 1] = np.nan
    x[np.flatnonzero(idx == idx[1])[0], 7] = -np.inf
    A = CSRMatrix.from_indices(idx, num_rows=9, backends=ALL)
    out = np.asarray(tpu_matmul(A, jnp.asarray(x), reduce=reduce))
    xla = np.asarray(jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="xla"))
    assert np.isnan(out[idx[0], 5]) and np.isnan(out[idx[-1], n_features - 1])
    np.testing.assert_array_equal(out, xla)  # NaN where XLA has NaN, equal elsewhere


def test_tpu_benchmark_runs_off_a_tpu(tmp_path):
    """benchmarks/hardware/on_tpu.py (run on a TPU by tpu_session.sh) still runs: every
    workload on Cora, each jaxcsr output within tolerance of its best peer."""
    import json

    from benchmarks.hardware import on_tpu

    on_tpu.main(
        [
            "--graphs",
            "cora",
            "--features",
            "16,128",
            "--dtypes",
            "float32",
            "--repeats",
            "1",
            "--any-platform",
            "--out",
            str(tmp_path),
        ]
    )
    rows = json.loads((tmp_path / "tpu.json").read_text())
    assert not [r for r in rows if any(k.startswith("error") for k in r)]
    compared = [r for r in rows if "speedup" in r]
    assert {r["workload"] for r in compared} >= {
        "segment",
        "max",
        "traced",
        "spmm",
        "softmax",
        "gcn step",
        "gat step (8x8)",
        "jraph step",
        "molecule step (64 graphs, N=64)",
    }
    # a whole training step compounds float32 summation orders (and, on a TPU, default
    # matmul precision) through layers, softmax and gradient: its loss and new
    # parameters agree to 1e-4; single products to 1e-5
    for r in compared:
        assert r["rel_err_vs_best_peer"] < (1e-4 if r["features"] == "model" else 1e-5), r
    assert "Geometric mean" in (tmp_path / "tpu.md").read_text()
