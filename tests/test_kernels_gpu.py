"""The Pallas GPU (Triton) kernel: interpret-mode correctness on CPU, CUDA lowering."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_sass import TRITON_CALL, export_for_cuda
from reference import (
    ALL,
    GPU_INTERPRET,
    assert_close,
    assert_kernel_grads,
    dense_of,
    power_law_ids,
    random_csr,
    random_values,
    segment_reference,
)

import jaxcsr
from jaxcsr import CSRMatrix
from jaxcsr.kernels import gpu

PROGRAMS = Path(__file__).parent / "programs"  # scripts the tests run in a subprocess


def gpu_matmul(A, x):
    return jaxcsr.matmul(A, x, impl="pallas_gpu", interpret=GPU_INTERPRET)


def _one_heavy_row_ids(rng, size, num_rows):
    """Most nonzeros in one row (longer than many CHUNKs), a few empty rows."""
    idx = rng.integers(0, num_rows, size)
    idx[: size * 3 // 4] = num_rows // 2
    idx[idx == num_rows - 1] = 0  # the last row stays empty
    return rng.permutation(idx)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("n_features", [1, 5, 33])
def test_segment_sum_with_one_heavy_row(rng, dtype, n_features):
    idx = _one_heavy_row_ids(rng, 600, 13)
    assert np.bincount(idx, minlength=13)[6] > 4 * gpu.CHUNK
    A = CSRMatrix.from_indices(idx, num_rows=13, backends=ALL)
    v = random_values(rng, (600, n_features)).astype(dtype)
    out = gpu_matmul(A, jnp.asarray(v))
    assert out.dtype == np.dtype(dtype)
    expected = segment_reference(v, idx, 13)
    assert_close(out, expected, dtype)
    assert np.all(np.asarray(out[12], np.float32) == 0)  # empty row


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_max_min_across_split_rows(rng, reduce):
    """A row split over many chunks: partial maxima meet in the second pass."""
    idx = _one_heavy_row_ids(rng, 300, 13)
    A = CSRMatrix.from_indices(idx, num_rows=13, backends=ALL)
    v = random_values(rng, (300, 5)).astype(np.float32)
    v[idx == 6, 0] = -1e30  # the heavy row's column 0: all very negative but one
    v[np.flatnonzero(idx == 6)[200], 0] = 3.0
    out = jaxcsr.matmul(A, v, reduce=reduce, impl="pallas_gpu", interpret=GPU_INTERPRET)
    pick = np.max if reduce == "max" else np.min
    for r in range(13):
        members = v[idx == r]
        expected = pick(members, axis=0) if len(members) else np.zeros(5)
        np.testing.assert_array_equal(np.asarray(out[r]), expected.astype(np.float32))


@pytest.mark.parametrize("kind", ["power_law", "empty_rows", "empty"])
def test_general_matrix_with_values(rng, kind):
    mat = random_csr(rng, 21, 17, kind)
    A = CSRMatrix.from_scipy(mat, backends=ALL)
    x = random_values(rng, (17, 3, 2)).astype(np.float32)  # N-D features
    out = gpu_matmul(A, jnp.asarray(x))
    assert_close(out, np.einsum("mn,nab->mab", mat.toarray(), x.astype(np.float64)), np.float32)


def test_matches_xla_path_on_power_law_ids(rng):
    idx = power_law_ids(rng, 400, 29)
    w = random_values(rng, (400,)).astype(np.float32)
    A = CSRMatrix.from_indices(idx, num_rows=29, data=w, backends=ALL)
    v = jnp.asarray(random_values(rng, (400, 7)), jnp.float32)
    assert_close(gpu_matmul(A, v), np.asarray(jaxcsr.matmul(A, v, impl="xla")), np.float32)


def test_grads_through_the_kernel(rng):
    assert_kernel_grads(gpu_matmul, rng, 11, 9)


def test_vmap_and_jit(rng):
    A = CSRMatrix.from_indices(power_law_ids(rng, 60, 7), num_rows=7, backends=ALL)
    xs = random_values(rng, (2, 60, 3)).astype(np.float32)
    out = jax.jit(jax.vmap(lambda v: gpu_matmul(A, v)))(jnp.asarray(xs))
    assert_close(out, np.einsum("mn,bnf->bmf", dense_of(A), xs.astype(np.float64)), np.float32)


def _hub_ids(rng, size, num_rows, share):
    """A hub row holding ``share`` of the ids, the rest uniform; the last row empty."""
    idx = rng.integers(0, num_rows - 1, size)
    idx[: int(size * share)] = num_rows // 3
    return rng.permutation(idx)


REDUCES = ["sum", "mean", "max", "min"]


HUB_CASES = [(f, np.float32) for f in (1, 3, 16, 64, 130)] + [
    (f, dtype) for f in (3, 256) for dtype in (jnp.bfloat16, np.float16)
]  # 256: two blocks of features (16-bit: what the float32 cases run at 130)


@pytest.mark.parametrize("n_features,dtype", HUB_CASES)
def test_hub_row_with_90_percent_of_nonzeros(rng, n_features, dtype):
    """Both passes (short rows and a 2700-nonzero row over 43 chunks), every reduce."""
    idx = _hub_ids(rng, 3000, 40, 0.9)
    A = CSRMatrix.from_indices(idx, num_rows=40, backends=ALL)
    v = random_values(rng, (3000, n_features)).astype(dtype)
    # every reduce in float32; the 16-bit cases the sum (float32 accumulation) and max
    for reduce in REDUCES if dtype == np.float32 else ("sum", "max"):
        out = jaxcsr.matmul(
            A, jnp.asarray(v), impl="pallas_gpu", interpret=GPU_INTERPRET, reduce=reduce
        )
        assert out.dtype == np.dtype(dtype)
        assert_close(out, segment_reference(v, idx, 40, reduce), dtype)


@pytest.mark.parametrize("num_segments", [1, 24])
def test_few_segments_over_400k_values(rng, num_segments):
    """The molecular-dynamics energy reduction: 1-24 segments over 400k values."""
    idx = np.sort(rng.integers(0, num_segments, 400_000))
    A = CSRMatrix.from_indices(idx, num_rows=num_segments, backends=ALL)
    for n_features, dtype in ((1, np.float32), (3, np.float32), (16, jnp.bfloat16)):
        v = random_values(rng, (400_000, n_features)).astype(dtype)
        for reduce in ("sum", "max"):
            out = jaxcsr.matmul(A, v, impl="pallas_gpu", interpret=GPU_INTERPRET, reduce=reduce)
            expected = segment_reference(v, idx, num_segments, reduce)
            if reduce == "sum" and dtype == np.float32:  # 17k-400k terms per sum
                bound = 2e-6 * np.abs(v.astype(np.float64)).sum() / num_segments
                np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=bound)
            elif reduce == "sum":  # float32 sums rounded once to bfloat16
                assert_close(out, expected, dtype)
            else:
                np.testing.assert_array_equal(np.asarray(out, np.float64), expected)


def test_two_runs_are_bit_identical(rng):
    """No atomics: every sum has a fixed order (here in interpret mode; the SASS
    check in test_gpu_sass.py shows the compiled kernel has no atomics either)."""
    idx = _hub_ids(rng, 5000, 300, 0.3)
    A = CSRMatrix.from_indices(idx, num_rows=300, backends=ALL)
    v = jnp.asarray(random_values(rng, (5000, 20)), jnp.float32)
    f = jax.jit(lambda v: jaxcsr.matmul(A, v, impl="pallas_gpu", interpret=GPU_INTERPRET))
    first, second = np.asarray(f(v)), np.asarray(f(v))
    np.testing.assert_array_equal(first.view(np.int32), second.view(np.int32))
    assert_close(first, segment_reference(v, idx, 300), np.float32)


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_nan_propagates_through_both_passes(rng, reduce):
    idx = _hub_ids(rng, 1000, 9, 0.8)  # the hub row is long, the others short
    v = random_values(rng, (1000, 4)).astype(np.float32)
    hub, short = np.flatnonzero(idx == 3), np.flatnonzero(idx == 5)
    v[hub[700], 1] = np.nan  # deep in the long row's chunks
    v[short[0], 2] = np.nan
    A = CSRMatrix.from_indices(idx, num_rows=9, backends=ALL)
    out = np.asarray(jaxcsr.matmul(A, v, impl="pallas_gpu", interpret=GPU_INTERPRET, reduce=reduce))
    expected = segment_reference(v, idx, 9, reduce)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out[3, 1]) and np.isnan(out[5, 2])
    np.testing.assert_array_equal(np.nan_to_num(out), np.nan_to_num(expected.astype(np.float32)))


def test_grads_through_both_passes(rng):
    idx = _hub_ids(rng, 600, 12, 0.5)
    w = random_values(rng, (600,)).astype(np.float32)
    A = CSRMatrix.from_indices(idx, num_rows=12, data=w, backends=ALL)
    v = jnp.asarray(random_values(rng, (600, 3)), jnp.float32)
    ct = random_values(rng, (12, 3)).astype(np.float32)
    for reduce in REDUCES:

        def loss(w, v, impl, reduce=reduce):
            kw = {"interpret": GPU_INTERPRET} if impl == "pallas_gpu" else {}
            out = jaxcsr.matmul(A.with_data(w), v, impl=impl, reduce=reduce, **kw)
            return jnp.sum(out * ct)

        gw, gv = jax.grad(loss, argnums=(0, 1))(A.data, v, "pallas_gpu")
        rw, rv = jax.grad(loss, argnums=(0, 1))(A.data, v, "xla")
        assert_close(gw, rw, np.float32)
        assert_close(gv, rv, np.float32)


def test_lane_plan_covers_every_nonzero_once():
    # rows 1 and 4 are long; row 4 has more than CHUNK partials (so pass 1b groups them)
    big = gpu.CHUNK * gpu.CHUNK + 5 * gpu.CHUNK + 3
    indptr = np.cumsum([0, 0, 100, 1, 0, big, 10]).astype(np.int32)
    nnz = int(indptr[-1])
    lanes = gpu.plan_lanes(indptr)
    num_short = int(lanes.num_short[0])
    chunks, groups, max_long = gpu.lane_capacities(6, nnz)
    assert lanes.chunk_start.size == chunks and lanes.group_start.size == groups
    assert chunks % gpu.GROUP == 0 and groups % gpu.GROUP == 0  # shape and nnz only
    assert lanes.row.size == 6 and sorted(lanes.row) == list(range(6))  # every row once
    assert num_short == 4 and list(lanes.row[num_short:]) == [1, 4] and max_long >= 2
    lengths = lanes.chunk_end.astype(int) - lanes.chunk_start
    assert 0 <= lengths.min() and lengths.max() <= gpu.CHUNK
    covered = np.zeros(nnz, int)
    for s, e in zip(lanes.chunk_start, lanes.chunk_end, strict=True):
        covered[s:e] += 1
    for lane in range(num_short):
        s, e, r = lanes.start[lane], lanes.end[lane], lanes.row[lane]
        assert (s, e) == (indptr[r], indptr[r + 1])
        covered[s:e] += 1
    np.testing.assert_array_equal(covered, 1)  # every nonzero in exactly one lane
    # row 1 (2 chunks) reads its chunk partials directly, in order
    s, e = lanes.start[num_short], lanes.end[num_short]
    assert e - s == 2 and lanes.chunk_start[s] == indptr[1] and lanes.chunk_end[e - 1] == indptr[2]
    # row 4 (CHUNK + 6 chunks) reads 2 group partials, which cover its chunks in order
    s, e = lanes.start[num_short + 1], lanes.end[num_short + 1]
    assert (s, e) == (chunks, chunks + 2)
    first, last = lanes.group_start[0], lanes.group_end[1]
    assert lanes.group_end[0] - first == gpu.CHUNK and lanes.group_start[1] == lanes.group_end[0]
    assert lanes.chunk_start[first] == indptr[4] and lanes.chunk_end[last - 1] == indptr[5]
    assert np.all(lanes.group_end[2:] == lanes.group_start[2:])  # unused slots are empty


def test_lane_order_groups_rows_by_length_unless_csr_order_is_as_good():
    rng = np.random.default_rng(7)
    skewed = np.concatenate([[0], np.cumsum(np.where(rng.random(256) < 0.1, 60, 1))])
    lanes = gpu.plan_lanes(skewed)
    stats = gpu.lane_stats(skewed)
    lengths = np.diff(skewed)[lanes.row[: int(lanes.num_short[0])]]
    assert not stats.csr_order and np.all(np.diff(lengths) >= 0)  # sorted by length
    uniform = np.arange(0, 257 * 5, 5)
    assert gpu.lane_stats(uniform).csr_order and gpu.lane_stats(uniform).utilisation == 1.0
    np.testing.assert_array_equal(gpu.plan_lanes(uniform).row, np.arange(256))


def test_lane_order_keeps_csr_order_where_rows_share_columns():
    """Rows of varied length: sorted order fills lanes better, but where consecutive
    rows gather the same columns, CSR order fetches far fewer distinct ones."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(8, 40, 512)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    shared = np.concatenate([(i // 32) * 40 + np.arange(n) for i, n in enumerate(lengths)])
    spread = rng.integers(0, 20_000, indptr[-1])
    local = gpu.lane_stats(indptr, shared)
    assert local.csr_order and local.distinct_csr < 0.1 < local.distinct_sorted
    assert local.utilisation_sorted > local.utilisation_csr
    np.testing.assert_array_equal(gpu.plan_lanes(indptr, shared).row, np.arange(512))
    assert not gpu.lane_stats(indptr, spread).csr_order
    assert not gpu.lane_stats(indptr).csr_order  # no column information: no reuse


def test_tile_table():
    for (width, itemsize), cfg in gpu.TILE_TABLE.items():
        assert cfg.block_n == width and gpu.GROUP % cfg.block_m == 0
        per_thread = cfg.block_k * cfg.block_m * cfg.block_n / (32 * cfg.num_warps)
        assert per_thread <= 64, (width, itemsize)
    assert gpu.tile_config(1).block_n == 16
    assert gpu.tile_config(33, jnp.bfloat16) == gpu.TILE_TABLE[(64, 2)]
    assert gpu.tile_config(512).block_n == 256  # wider operands take several blocks


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton_for_cuda(dtype):
    A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0, 4, 4, 4]), num_rows=5, backends=ALL)
    B = CSRMatrix.from_dense(np.arange(1.0, 41.0).reshape(5, 8), backends=ALL)  # general
    fwd = jax.jit(lambda v: jaxcsr.matmul(A, v, reduce="max"))  # impl=None: the kernel
    # the backward of a general matrix is the kernel on the planned transpose
    bwd = jax.jit(jax.grad(lambda v: jnp.sum(B.with_data(B.data.astype(v.dtype)) @ v)))
    for f in (fwd, bwd):
        text = export_for_cuda(f, jax.ShapeDtypeStruct((8, 20), dtype)).mlir_module()
        assert TRITON_CALL in set(re.findall(r"custom_call @([\w$.]+)", text))
    # sums over unsorted ids: the kernel in 16-bit dtypes, the XLA path in float32
    # (gpu.default_for, the H200 rule); impl="pallas_gpu" still runs the kernel
    text = export_for_cuda(jax.jit(lambda v: A @ v), jax.ShapeDtypeStruct((8, 20), dtype))
    assert (TRITON_CALL in text.mlir_module()) == (np.dtype(dtype) != np.float32)
    forced = jax.jit(lambda v: jaxcsr.matmul(A, v, impl="pallas_gpu"))
    assert (
        TRITON_CALL in export_for_cuda(forced, jax.ShapeDtypeStruct((8, 20), dtype)).mlir_module()
    )
    xla_only = jax.jit(lambda v: jaxcsr.matmul(A, v, impl="xla"))
    text = export_for_cuda(xla_only, jax.ShapeDtypeStruct((8, 20), dtype)).mlir_module()
    assert TRITON_CALL not in text


def test_gpu_benchmark_script_smoke(tmp_path):
    """benchmarks/hardware/on_gpu.py runs end to end (CPU, interpret mode) and checks the kernel."""
    from benchmarks.hardware.on_gpu import main

    result = main(["--smoke", "--out", str(tmp_path)])
    assert {(r["workload"], r["pass_"]) for r in result["rows"]} == {
        ("segment", "fwd"),
        ("segment", "bwd"),
        ("spmm", "fwd"),
        ("spmm", "bwd"),
        ("segment_max", "fwd"),
        ("segment_max", "bwd"),
    }
    assert result["failures"] == [] and result["skipped_groups"] == []
    for row in result["rows"]:
        assert row["status"] == "ok"
        assert "error" not in row["systems"]["jaxcsr_pallas"]  # the kernel itself ran
        assert row["systems"]["jaxcsr_pallas"]["rel_error_vs_pallas"] == 0.0  # the reference
        assert row["systems"]["jaxcsr_xla"]["rel_error_vs_pallas"] <= 1e-4
    table = (tmp_path / "gpu_results.md").read_text()
    (tmp_path / "gpu_results.md").unlink()
    main(["--render", str(tmp_path / "gpu_results.json")])  # the table again, from the JSON
    assert (tmp_path / "gpu_results.md").read_text() == table
    assert "| cora | segment | fwd | 8 | float32 | ok |" in table


def test_without_pallas_triton_cuda_falls_back_to_xla_with_one_warning():
    """A jax without the Pallas Triton backend (deprecated in JAX 0.11): impl=None on
    CUDA lowers to the XLA path with one warning; impl='pallas_gpu' raises."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(PROGRAMS / "missing_triton.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_tile_configs_are_validated():
    """Every table entry is a valid configuration; bad ones are refused by name."""
    for config in gpu.TILE_TABLE.values():
        assert gpu.TileConfig(*dataclasses.astuple(config)) == config
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        gpu.TileConfig(16, 12, 64, 4)
    with pytest.raises(ValueError, match="block_n must be at least 16"):
        gpu.TileConfig(16, 8, 8, 4)
    with pytest.raises(ValueError, match="128 gathered elements per thread"):
        gpu.TileConfig(64, 16, 16, 4)
