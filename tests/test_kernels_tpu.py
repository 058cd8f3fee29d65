"""The Pallas TPU (Mosaic) kernel: TPU-interpreter correctness on CPU, TPU lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from reference import (
    ALL,
    assert_close,
    assert_kernel_grads,
    power_law_ids,
    random_csr,
    random_values,
)

import jaxcsr
from jaxcsr import CSRMatrix, plan
from jaxcsr.kernels import tpu


def tpu_matmul(A, x):
    return jaxcsr.matmul(A, x, impl="pallas_tpu", interpret=True)


def _skewed_ids(rng, size, num_rows):
    """One row holds half the nonzeros; rows past 2 * BLOCK_M are all empty."""
    idx = rng.integers(0, min(num_rows, 2 * tpu.BLOCK_M), size)
    idx[: size // 2] = 3
    return rng.permutation(idx)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("n_features", [3, 130])
def test_segment_sum_skewed_rows_and_empty_tiles(rng, dtype, n_features):
    num_rows = 3 * tpu.BLOCK_M + 5  # last output tiles have no nonzeros, odd size
    idx = _skewed_ids(rng, 700, num_rows)
    A = CSRMatrix.from_indices(idx, num_rows=num_rows, backends=ALL)
    v = random_values(rng, (700, n_features)).astype(dtype)
    out = tpu_matmul(A, jnp.asarray(v))
    assert out.dtype == np.dtype(dtype)
    expected = np.zeros((num_rows, n_features))
    np.add.at(expected, idx, v.astype(np.float64))
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype,precision", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_mxu_precision_by_dtype(dtype, precision):
    """float32 tiles ask the MXU for HIGHEST precision (no bf16 truncation, which the
    CPU interpreter could not show); bfloat16 runs natively."""
    ints = (jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))
    schedule = tpu.TileSchedule(*ints, tpu.BLOCK_M, tpu.BLOCK_K)
    jaxpr = jax.make_jaxpr(lambda v: tpu.spmm(v, jnp.zeros(4, jnp.int32), schedule, num_rows=4))
    text = str(jaxpr(jnp.ones((4, 2), dtype)))
    assert ("precision=(Precision.HIGHEST" in text) == precision


def test_float32_values_to_float32_tolerance(rng):
    idx = power_law_ids(rng, 500, 40)
    v = (1.0 + rng.uniform(0, 1e-3, (500, 4))).astype(np.float32)  # bf16 would lose these
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
@pytest.mark.parametrize("interpret", [True, pltpu.InterpretParams()], ids=["pallas", "tpu"])
def test_kernel_under_both_interpreters(rng, dtype, interpret):
    """The kernel itself under the generic and the TPU interpreter (TPU semantics):
    skewed rows, empty output tiles, rows not a multiple of BLOCK_M, odd features."""
    num_rows = 2 * tpu.BLOCK_M + 9
    idx = np.sort(_skewed_ids(rng, 300, num_rows))
    indptr, _ = plan.segment_ids_to_csr(idx, num_rows)
    schedule = jax.tree.map(jnp.asarray, tpu.plan_tile_schedule(indptr))
    vals = random_values(rng, (300, 3)).astype(dtype)
    out = tpu.spmm(
        jnp.asarray(vals),
        jnp.asarray(idx, jnp.int32),
        schedule,
        num_rows=num_rows,
        interpret=interpret,
    )
    expected = np.zeros((num_rows, 3))
    np.add.at(expected, idx, vals.astype(np.float64))
    assert_close(out, expected, dtype)


def test_grads_through_the_kernel(rng):
    assert_kernel_grads(tpu_matmul, rng, 13, 9)


def test_schedule_covers_every_output_tile():
    indptr = np.array([0, 0, 0, 300, 300, 301, 301, 301, 301, 301, 600])
    s = tpu.plan_tile_schedule(indptr, block_m=4, block_k=128)
    # 3 output tiles + 5 nonzero tiles = 8 slots; the last is padding (first == PAD)
    np.testing.assert_array_equal(s.out_tile, [0, 0, 0, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(s.nnz_tile, [0, 1, 2, 2, 2, 3, 4, 4])
    np.testing.assert_array_equal(s.first, [1, 0, 0, 1, 1, 0, 0, tpu.PAD])
    assert s.num_steps == 7
    empty = tpu.plan_tile_schedule(np.zeros(10, np.int64), block_m=4, block_k=128)
    np.testing.assert_array_equal(empty.out_tile, [0, 1, 2, 2])  # zero tiles still written
    np.testing.assert_array_equal(empty.first, [1, 1, 1, tpu.PAD])


def test_schedule_length_depends_on_shape_and_nnz_only(rng):
    """Structures with the same (m, nnz) and different row-length distributions get
    schedules of one length (one compilation), each covering every nonzero once."""
    m, nnz = 300, 2000
    lengths = set()
    for ids in (
        rng.integers(0, m, nnz),  # uniform rows
        power_law_ids(rng, nnz, m),  # skewed rows
        np.zeros(nnz, int),  # one row holds everything
        np.arange(nnz) % 7,  # a few rows, many empty tiles
    ):
        indptr, _ = plan.segment_ids_to_csr(np.asarray(ids), m)
        s = tpu.plan_tile_schedule(indptr, block_m=8, block_k=128)
        lengths.add(s.out_tile.size)
        real = s.first != tpu.PAD
        assert np.all(real[: s.num_steps]) and not np.any(real[s.num_steps :])
        rows = np.repeat(np.arange(m), np.diff(indptr))
        seen = np.zeros(nnz, int)
        for t, k in zip(s.out_tile[real], s.nnz_tile[real], strict=True):
            block = np.arange(k * 128, min((k + 1) * 128, nnz))
            seen[block[(rows[block] >= t * 8) & (rows[block] < (t + 1) * 8)]] += 1
        np.testing.assert_array_equal(seen, 1)
    assert lengths == {tpu.schedule_capacity(m, nnz, 8, 128)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_for_tpu(dtype):
    A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0, 4, 4, 4]), num_rows=5, backends=ALL)
    B = CSRMatrix.from_dense(np.arange(1.0, 41.0).reshape(5, 8), backends=ALL)  # general
    for f in (
        jax.jit(lambda v: A @ v),  # impl=None picks the kernel on TPU
        # the backward of a general matrix is the kernel on the planned transpose
        jax.jit(jax.grad(lambda v: jnp.sum(B.with_data(B.data.astype(v.dtype)) @ v))),
    ):
        text = export.export(f, platforms=["tpu"])(jax.ShapeDtypeStruct((8, 20), dtype))
        assert "tpu_custom_call" in text.mlir_module()
    xla_only = jax.jit(lambda v: jaxcsr.matmul(A, v, impl="xla"))
    text = export.export(xla_only, platforms=["tpu"])(jax.ShapeDtypeStruct((8, 20), dtype))
    assert "tpu_custom_call" not in text.mlir_module()


def test_schedule_stats_for_docs():
    """The command behind docs/tpu.md's schedule table runs on any machine."""
    from benchmarks.hardware.on_tpu import schedule_stats

    rows = schedule_stats()
    assert len(rows) == 4
    for row in rows:
        ratio = float(row.split("|")[6])
        assert ratio >= 1.0  # never fewer steps than ceil(nnz / BLOCK_K)


@pytest.mark.parametrize("n_features,reduce", [(32, "max"), (64, "min")])
def test_tpu_kernel_keeps_nan_at_wide_features(rng, reduce, n_features):
    """XLA:CPU's vectorised max over a (128, F >= 32) tile dropped a NaN in interpret
    mode; the kernel now propagates NaN by an explicit count."""
    idx = power_law_ids(rng, 200, 9)
    x = random_values(rng, (200, n_features)).astype(np.float32)
    x[np.flatnonzero(idx == idx[0])[0], 5] = np.nan
    x[np.flatnonzero(idx == idx[-1])[-1], n_features - 1] = np.nan
    A = CSRMatrix.from_indices(idx, num_rows=9, backends=ALL)
    out = np.asarray(
        jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="pallas_tpu", interpret=True)
    )
    xla = np.asarray(jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce, impl="xla"))
    assert np.isnan(out[idx[0], 5]) and np.isnan(out[idx[-1], n_features - 1])
    np.testing.assert_array_equal(out, xla)  # NaN where XLA has NaN, equal elsewhere
