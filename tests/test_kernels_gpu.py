"""The Pallas GPU (Triton) kernel: interpret-mode correctness on CPU, CUDA lowering."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from reference import (
    ALL,
    assert_close,
    assert_kernel_grads,
    dense_of,
    power_law_ids,
    random_csr,
    random_values,
)

import jaxcsr
from jaxcsr import CSRMatrix
from jaxcsr.kernels import gpu

TRITON_CALL = "__gpu$xla.gpu.triton"


def gpu_matmul(A, x):
    return jaxcsr.matmul(A, x, impl="pallas_gpu", interpret=True)


def _one_heavy_row_ids(rng, size, num_rows):
    """Most nonzeros in one row (longer than many CHUNKs), a few empty rows."""
    idx = rng.integers(0, num_rows, size)
    idx[: size * 3 // 4] = num_rows // 2
    idx[idx == num_rows - 1] = 0  # the last row stays empty
    return rng.permutation(idx)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("n_features", [1, 5, 33])
def test_segment_sum_with_one_heavy_row(rng, dtype, n_features):
    idx = _one_heavy_row_ids(rng, 300, 13)
    assert np.bincount(idx, minlength=13)[6] > 4 * gpu.CHUNK
    A = CSRMatrix.from_indices(idx, num_rows=13, backends=ALL)
    v = random_values(rng, (300, n_features)).astype(dtype)
    out = gpu_matmul(A, jnp.asarray(v))
    assert out.dtype == np.dtype(dtype)
    expected = np.zeros((13, n_features))
    np.add.at(expected, idx, v.astype(np.float64))
    assert_close(out, expected, dtype)
    assert np.all(np.asarray(out[12], np.float32) == 0)  # empty row


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_max_min_across_split_rows(rng, reduce):
    """A row split over many work items: partial maxima meet in the atomics."""
    idx = _one_heavy_row_ids(rng, 300, 13)
    A = CSRMatrix.from_indices(idx, num_rows=13, backends=ALL)
    v = random_values(rng, (300, 5)).astype(np.float32)
    v[idx == 6, 0] = -1e30  # the heavy row's column 0: all very negative but one
    v[np.flatnonzero(idx == 6)[200], 0] = 3.0
    out = jaxcsr.matmul(A, v, reduce=reduce, impl="pallas_gpu", interpret=True)
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


def test_pallas_gpu_without_gpu_or_interpret_is_explained():
    A = CSRMatrix.from_indices(np.array([0, 1, 1]), num_rows=2, backends=ALL)
    with pytest.raises(NotImplementedError, match=r"needs platform .cuda.*interpret=True"):
        jaxcsr.matmul(A, jnp.ones((3, 2)), impl="pallas_gpu")
    with pytest.raises(TypeError, match="pallas_gpu' supports float16/bfloat16/float32"):
        jaxcsr.matmul(A, jnp.ones((3, 2), jnp.int32), impl="pallas_gpu", interpret=True)


def test_work_items_bound_every_loop():
    indptr = np.array([0, 0, 100, 101, 101, 140], np.int32)
    items = gpu.plan_work_items(indptr, chunk=32, items_per_program=4)
    lengths = items.end.astype(int) - items.start
    assert lengths.max() <= 32 and items.row.size % 4 == 0
    assert items.row.size == gpu.work_item_capacity(5, 140, 32, 4)  # shape and nnz only
    covered = np.zeros(140, int)
    for r, s, e in zip(items.row, items.start, items.end, strict=True):
        assert e == s or indptr[r] <= s < e <= indptr[r + 1]
        covered[s:e] += 1
    np.testing.assert_array_equal(covered, 1)  # every nonzero exactly once
    assert set(items.row[lengths > 0]) == {1, 2, 4}  # empty rows get no item


def test_tile_table():
    assert gpu.tile_config(1) == (16, 1)
    assert gpu.tile_config(33) == (64, 2)
    assert gpu.tile_config(512) == (128, 4)


def _export_cuda(f, *args):
    """Exports for CUDA without a GPU; newer jax wants an abstract device for that."""
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    try:
        return export.export(f, platforms=["cuda"], disabled_checks=checks)(*args)
    except Exception as err:  # pragma: no cover - depends on the jax version
        if "device" not in str(err).lower():
            raise
        from jax.sharding import AbstractDevice, AbstractMesh  # type: ignore[attr-defined]

        mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("cuda", 1))
        with jax.sharding.use_abstract_mesh(mesh):
            return export.export(f, platforms=["cuda"], disabled_checks=checks)(*args)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton_for_cuda(dtype):
    A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0, 4, 4, 4]), num_rows=5, backends=ALL)
    B = CSRMatrix.from_dense(np.arange(1.0, 41.0).reshape(5, 8), backends=ALL)  # general
    fwd = jax.jit(lambda v: A @ v)  # impl=None picks the kernel on CUDA
    # the backward of a general matrix is the kernel on the planned transpose
    bwd = jax.jit(jax.grad(lambda v: jnp.sum(B.with_data(B.data.astype(v.dtype)) @ v)))
    for f in (fwd, bwd):
        text = _export_cuda(f, jax.ShapeDtypeStruct((8, 20), dtype)).mlir_module()
        assert TRITON_CALL in set(re.findall(r"custom_call @([\w$.]+)", text))
    xla_only = jax.jit(lambda v: jaxcsr.matmul(A, v, impl="xla"))
    text = _export_cuda(xla_only, jax.ShapeDtypeStruct((8, 20), dtype)).mlir_module()
    assert TRITON_CALL not in text


def test_gpu_benchmark_script_smoke(tmp_path):
    """benchmarks/gpu.py runs end to end (CPU, interpret mode) and checks the kernel."""
    from benchmarks.gpu import main

    result = main(["--smoke", "--out", str(tmp_path)])
    assert {(r["workload"], r["pass_"]) for r in result["rows"]} == {
        ("segment", "fwd"),
        ("segment", "bwd"),
        ("spmm", "fwd"),
        ("spmm", "bwd"),
        ("segment_max", "fwd"),
        ("segment_max", "bwd"),
    }
    for row in result["rows"]:
        assert "error" not in row["systems"]["jaxcsr_pallas"]  # the kernel itself ran
        assert row["systems"]["jaxcsr_pallas"]["rel_error_vs_pallas"] == 0.0  # the reference
        assert row["systems"]["jaxcsr_xla"]["rel_error_vs_pallas"] <= 1e-4
    assert (tmp_path / "gpu_results.md").exists()
