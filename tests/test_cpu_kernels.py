"""The native CPU backend (jaxcsr/kernels/csrc through XLA FFI): every kernel on every
structure kind against float64, thread counts bit for bit, the fallback without the
library, guards against corrupted structures, and a sanitizer build.

CI sets ``JAXCSR_REQUIRE_CPU_KERNELS=1``: there a missing library fails these tests
instead of skipping them."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    assert_close,
    dense_of,
    entry_rows,
    power_law_ids,
    random_csr,
    random_values,
    reduce_reference,
    segment_reference,
    softmax_grad_reference,
    softmax_reference,
)

import jaxcsr
from jaxcsr import CSRMatrix, ops
from jaxcsr.dtypes import product_dtype
from jaxcsr.kernels import cpu, xla

PROGRAMS = Path(__file__).parent / "programs"  # scripts the tests run in a subprocess

REQUIRED = os.environ.get("JAXCSR_REQUIRE_CPU_KERNELS") == "1"
if not cpu.available():
    if REQUIRED:
        raise RuntimeError("JAXCSR_REQUIRE_CPU_KERNELS=1 but the CPU library is not built")
    pytest.skip("the CPU library is not built (no C++17 compiler?)", allow_module_level=True)

DTYPES = [np.float32, jnp.bfloat16, np.float16]
M, N, K = 37, 53, 400


def _hub_ids(rng, size, rows):
    """90 % of the ids in one row, the rest power-law, some rows empty."""
    ids = power_law_ids(rng, size, rows)
    ids[rng.random(size) < 0.9] = rows // 2
    return ids


def _matrix(rng, kind: str, m: int = M, n: int = N, k: int = K):
    """``(A, dense float64)`` for one structure kind (``m`` rows; ``k`` segment ids,
    ``n`` columns otherwise)."""
    if kind in ("segment", "segment_sorted", "segment_weighted", "hub", "hub_sorted"):
        ids = _hub_ids(rng, k, m) if kind.startswith("hub") else power_law_ids(rng, k, m)
        if kind.endswith("sorted"):
            ids = np.sort(ids)
        data = random_values(rng, k).astype(np.float32) if kind == "segment_weighted" else None
        dense = np.zeros((m, k))
        dense[ids, np.arange(k)] = 1.0 if data is None else data
        return CSRMatrix.from_indices(ids, m, data=data), dense
    if kind == "duplicates":  # repeated (row, col) pairs stay separate entries
        rows, cols = rng.integers(0, M, 300), rng.integers(0, 8, 300)
        data = random_values(rng, 300).astype(np.float32)
        dense = np.zeros((M, N))
        np.add.at(dense, (rows, cols), data.astype(np.float64))
        return CSRMatrix.from_coo(rows, cols, data, shape=(M, N)), dense
    mat = random_csr(rng, m, n, {"general": "power_law", "empty_rows": "empty_rows"}[kind])
    mat = mat.astype(np.float32)
    return CSRMatrix.from_scipy(mat), mat.toarray().astype(np.float64)


KINDS = ["segment", "segment_sorted", "segment_weighted", "hub", "hub_sorted", "general"]
KINDS += ["empty_rows", "duplicates"]


def _native_products(B, xs, reduces):
    """``[[B @ x with reduce r, for r in reduces] for x in xs]`` on the native kernels:
    jit it to check many widths in one program (a compile per program, not per width)."""
    return [[jaxcsr.matmul(B, x, reduce=r, impl="cpu") for r in reduces] for x in xs]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kernel_matches_float64(rng, kind):
    """Sum, max, min and mean (its sum carried in float32: 16-bit operands into float32
    outputs) of both views, three dtypes, one feature, the fixed-width loops (5, 12), the
    whole-vector widths (16, 64: 8 * V features; 72, 88, 136: pull blocks of 64 plus a
    tail of 8, 24 and 8) and others past 32, against float64 (max/min:
    reduce_reference, ties and NaN included)."""
    A, _ = _matrix(rng, kind)
    assert "native" in str(A.plan_info())
    reduces = ("sum", "max", "min", "mean")
    # every width in one program (a compile per view and dtype, not per width too)
    fn = jax.jit(lambda B, xs: _native_products(B, xs, reduces))
    for B in (A, A.T):
        for dtype in DTYPES:
            widths = (1, 5, 12, 16, 44, 64, 72, 88, 136)
            xs = [random_values(rng, (B.shape[1], f)).astype(dtype) for f in widths]
            if B.dtype is not None:  # the reference reads the values as rounded
                B = B.with_data(B.data.astype(dtype))
            for x, ys in zip(xs, fn(B, xs), strict=True):
                for reduce, y in zip(reduces, ys, strict=True):
                    assert y.dtype == np.dtype(dtype)
                    want, _ = reduce_reference(B, np.asarray(x, np.float64), reduce)
                    assert_close(y, want, dtype, err_msg=f"{reduce}, {x.shape[1]} features")
    # the FFI call is what runs, on both views (one entry per row: the gather; rows of
    # 32 bytes, where the gather is native)
    for B in (A, A.T):
        x = jnp.ones((B.shape[1], 8), jnp.float32)
        text = jax.jit(lambda B, x: jaxcsr.matmul(B, x, impl="cpu")).lower(B, x).as_text()
        assert f"jaxcsr_cpu_{cpu.choose(B.structure, 8).kernel}" in text


def _divided_sum(B, x, out_dtype):
    """The mean as the primitive composes it where a kernel does not divide: the sum in
    the accumulation dtype (the same kernel), then times the reciprocal degrees."""
    s = B.index.structure
    total = ops.product(
        x, B.data, B.index, reduce="sum", accumulate=True, impl="cpu", interpret=False
    )
    return ops._divide_by_degree(total, s, out_dtype)


def _check_means(B, widths, rng, pinned=None):
    """The mean of ``B`` equals :func:`_divided_sum` (its sum on the same kernel) bit
    for bit, in three dtypes; both jitted afresh, traced with the unsorted kernel
    ``pinned``. Returns how many means the kernel (pull or push) divided itself."""
    fused_count = 0
    for dtype in DTYPES:
        for f in widths:
            x = random_values(rng, (B.shape[1], f)).astype(dtype)
            if B.dtype is not None:
                B = B.with_data(B.data.astype(dtype))
            with cpu.unsorted_kernel(pinned) if pinned else contextlib.nullcontext():
                mean = jax.jit(lambda B, x: jaxcsr.matmul(B, x, reduce="mean", impl="cpu"))
                text = mean.lower(B, x).as_text()
                fused = cpu.divides_means(B.structure, "cpu", x.dtype, B.dtype, dtype, f)
                y = mean(B, x)
                divided = functools.partial(_divided_sum, out_dtype=np.dtype(dtype))
                want = jax.jit(lambda B, x, divided=divided: divided(B, x))(B, x)
            assert fused == ("mean = 1" in text), f
            fused_count += fused
            assert y.dtype == want.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(
                np.asarray(y, np.float32), np.asarray(want, np.float32), err_msg=f"{f}"
            )
    return fused_count


@pytest.mark.parametrize("kind", ["segment_sorted", "general", "empty_rows", "duplicates"])
def test_means_divided_in_the_pull_equal_the_divided_sum(rng, kind):
    """The pull's own mean (``mean=1``: sums of a block of rows in cache, times the
    rows' reciprocal entry counts, rounded once) gives the bits of the float32 sum
    followed by the primitive's division, for three dtypes and widths from one feature
    (eight lanes) through a fixed-width loop, whole vectors and blocks past 64; on
    both views of each matrix (a general matrix's transpose pulls its planned
    transpose; a segment matrix's is a gather, with no sum to divide). Unsorted ids:
    the push (in the pieces the sizes fix: its float32 partials, or the float32 output
    itself, scaled as stored) and the pull through the sort."""
    A, _ = _matrix(rng, kind)
    widths = (1, 5, 16, 72, 136)  # eight lanes, a fixed width, whole vectors, blocks + tail
    assert _check_means(A, widths, rng) == len(widths) * len(DTYPES)
    if kind == "segment_sorted":
        assert _check_means(A.T, (1, 16, 72), rng) == 0  # a gather
    else:
        assert _check_means(A.T, widths, rng) == len(widths) * len(DTYPES)
    if kind == "general":
        unsorted, _ = _matrix(rng, "segment")
        assert cpu.choose(unsorted.structure, 64).kernel == "push"
        sparse, _ = _matrix(rng, "segment", k=100)  # under 4 ids a row: one piece
        assert [cpu.choose(B.structure, 64).pieces for B in (unsorted, sparse)] == [2, 1]
        for B in (unsorted, sparse):
            assert _check_means(B, (1, 5, 136), rng, pinned="push") == 3 * len(DTYPES)
        assert _check_means(unsorted, (5, 64), rng, pinned="pull") == 2 * len(DTYPES)


def test_the_mean_transposes_and_differentiates_as_the_divided_sum(rng):
    """``jax.linear_transpose`` of a mean the kernel divides binds the primitive's mean
    transpose: ``A.T @ (ct * 1 / degree)``, equal to the divided sum's transpose; its
    JVP tangent is the divided sum of the tangent."""
    A, _ = _matrix(rng, "empty_rows")
    x = jnp.asarray(random_values(rng, (A.shape[1], 16)), jnp.float32)
    ct = jnp.asarray(random_values(rng, (A.shape[0], 16)), jnp.float32)
    mean = jax.jit(lambda x: jaxcsr.matmul(A, x, reduce="mean", impl="cpu"))
    assert "mean = 1" in mean.lower(x).as_text()
    (got,) = jax.linear_transpose(mean, x)(ct)
    (want,) = jax.linear_transpose(lambda x: _divided_sum(A, x, np.float32), x)(ct)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    degree = np.maximum(np.diff(np.asarray(A.indptr)), 1)[:, None]
    assert_close(got, dense_of(A).T @ (np.asarray(ct, np.float64) / degree), np.float32)
    dx = jnp.asarray(random_values(rng, x.shape), jnp.float32)
    _, tangent = jax.jvp(mean, (x,), (dx,))
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(_divided_sum(A, dx, np.float32)))


@pytest.mark.parametrize("dtype, f", [(np.float32, 3), (jnp.bfloat16, 16), (jnp.bfloat16, 64)])
def test_max_and_min_propagate_nan_and_zero_empty_rows(rng, dtype, f):
    """Also bfloat16 rows of whole vector pairs, read as 32-bit words: NaN in an even
    and in an odd feature."""
    ids = np.array([0, 0, 2, 2, 2])  # row 1 empty
    v = random_values(rng, (5, f)).astype(dtype)
    v[3, 1] = v[4, f - 1] = np.nan
    for sorted_ids in (True, False):
        order = np.arange(5) if sorted_ids else np.array([4, 2, 0, 3, 1])
        A = CSRMatrix.from_indices(ids[order], 3)
        for reduce in ("max", "min"):
            y = np.asarray(jaxcsr.matmul(A, v[order], reduce=reduce, impl="cpu"), np.float64)
            want = getattr(np, reduce)(np.asarray(v[2:], np.float64), axis=0)  # NaN propagates
            np.testing.assert_array_equal(y[2], want)
            np.testing.assert_array_equal(y[1], 0.0)
            assert np.isnan(y[2, 1]) and np.isnan(y[2, f - 1])


@pytest.mark.parametrize("kind", ["segment", "segment_sorted", "hub", "general", "duplicates"])
def test_native_sddmm_matches_float64(rng, kind):
    """``X @ Y.T`` at the stored entries (the values' gradient), both views, one and two
    heads, every dtype: the native kernel (the HLO calls it) against float64."""
    A, _ = _matrix(rng, kind)
    fn = jax.jit(jaxcsr.sddmm)
    for B in (A, A.T):
        mat = B.to_scipy().tocsr()  # B's CSR order
        rows = np.repeat(np.arange(B.shape[0]), np.diff(mat.indptr))
        for dtype in DTYPES:
            for heads in ((), (2,)):
                X = random_values(rng, (B.shape[0], *heads, 11)).astype(dtype)
                Y = random_values(rng, (B.shape[1], *heads, 11)).astype(dtype)
                x64, y64 = np.asarray(X, np.float64), np.asarray(Y, np.float64)
                want = np.sum(x64[rows] * y64[mat.indices], axis=-1)
                got = fn(B, X, Y)
                assert got.dtype == np.dtype(dtype) and got.shape == want.shape
                assert_close(got, want, dtype)
        assert "jaxcsr_cpu_sddmm" in fn.lower(B, X, Y).as_text()


def test_native_sddmm_of_one_per_column_matrices_with_empty_columns(rng):
    """from_coo with at most one entry per column plans the one-per-column kind; its
    empty columns have no entry (the case hypothesis found in test_plan)."""
    for rows, cols, shape in (([0], [0], (1, 2)), ([2, 0, 2], [4, 1, 0], (3, 6))):
        A = CSRMatrix.from_coo(np.array(rows), np.array(cols), shape=shape)
        dense = A.to_scipy().tocsr()
        for B, mat in ((A, dense), (A.T, dense.T.tocsr())):
            X = random_values(rng, (B.shape[0], 3)).astype(np.float32)
            Y = random_values(rng, (B.shape[1], 3)).astype(np.float32)
            rows_of = np.repeat(np.arange(B.shape[0]), np.diff(mat.indptr))
            want = np.sum(X[rows_of].astype(np.float64) * Y[mat.indices], axis=1)
            assert_close(jaxcsr.sddmm(B, X, Y), want, np.float32)


@pytest.mark.parametrize("sorted_ids", [False, True])
def test_traced_ids_drop_what_jax_ops_drops(rng, sorted_ids):
    """Ids planned on the device (a padded layout): out-of-range ids belong to no row."""
    ids = power_law_ids(rng, K, M)
    ids[rng.random(K) < 0.1] = M + 3  # dropped, as jax.ops drops them
    if sorted_ids:
        ids = np.sort(ids)
    else:
        ids[rng.random(K) < 0.05] = -2
    fn = jax.jit(
        lambda i, v: jaxcsr.segment_sum(
            v, i, num_segments=M, indices_are_sorted=sorted_ids, impl="cpu"
        )
    )
    keep = (ids >= 0) & (ids < M)
    for dtype, f in itertools.product((np.float32, jnp.bfloat16), (1, 9)):
        v = random_values(rng, (K, f)).astype(np.float32)
        want = np.zeros((M, f))
        np.add.at(want, ids[keep], np.asarray(v.astype(dtype), np.float64)[keep])
        assert_close(fn(jnp.asarray(ids), v.astype(dtype)), want, dtype)
        assert "jaxcsr_cpu_" in fn.lower(jnp.asarray(ids), v.astype(dtype)).as_text()


# Below this many elements a product runs on the calling thread alone (kSerialWork
# in csrc/common.h): the thread tests stay above it, so that several threads run.
SERIAL_WORK = 1 << 17


def test_planned_transpose_reads_the_values_through_the_permutation(rng):
    """The backward of ``G @ x`` and the forward of ``v @ G`` (G general, with values)
    pull the planned transpose with G's values as they are, read through ``t_perm`` in
    the kernel: no gather or scatter of the values in the compiled step. Against
    float64 (widths 1, 16, 33, 88), and one thread against all bit for bit."""
    G, _ = _matrix(rng, "general", m=300, n=1000, k=9000)
    bwd = jax.jit(lambda G, x, ct: jax.vjp(lambda x: G @ x, x)[1](ct)[0])
    fm = jax.jit(lambda G, v: v @ G)
    for dtype in (np.float32, jnp.bfloat16):
        H = G.with_data(G.data.astype(dtype))
        dense = dense_of(H)
        for f in (1, 16, 33, 88):
            x = random_values(rng, (1000, f)).astype(dtype)
            ct = random_values(rng, (300, f)).astype(dtype)
            v = random_values(rng, (f, 300)).astype(dtype)
            got = [bwd(H, x, ct), fm(H, v)]
            assert_close(got[0], dense.T @ np.asarray(ct, np.float64), dtype)
            assert_close(got[1], np.asarray(v, np.float64) @ dense, dtype)
            with cpu.threads(1):
                one = jax.jit(lambda G, x, ct: jax.vjp(lambda x: G @ x, x)[1](ct)[0])(H, x, ct)
                one_fm = jax.jit(lambda G, v: v @ G)(H, v)
            np.testing.assert_array_equal(np.asarray(one), np.asarray(got[0]))
            np.testing.assert_array_equal(np.asarray(one_fm), np.asarray(got[1]))
    x, ct, v = jnp.ones((1000, 4)), jnp.ones((300, 4)), jnp.ones((4, 300))
    for compiled in (bwd.lower(G, x, ct).compile(), fm.lower(G, v).compile()):
        text = compiled.as_text()
        assert "jaxcsr_cpu_pull" in text and "t_perm" in text, text[-3000:]
        assert " gather(" not in text and " scatter(" not in text, text[-3000:]


def test_pull_refuses_bad_value_positions():
    """The pull kernel's own guard: positions outside the values, or not one per entry,
    are an error, never a read out of bounds; so is a mean that is not a row-major sum
    with one value per entry."""
    call = jax.ffi.ffi_call("jaxcsr_cpu_pull", jax.ShapeDtypeStruct((3, 2), jnp.float32))
    indptr, cols = jnp.asarray([0, 1, 2, 3], jnp.int32), jnp.asarray([0, 1, 2], jnp.int32)
    x, data = jnp.ones((3, 2), jnp.float32), jnp.ones((3,), jnp.float32)
    attrs = {"max_threads": np.int64(0), "reduce": np.int64(0), "feature_major": np.int64(0)}
    attrs["mean"] = np.int64(0)
    one, two = {**attrs, "heads": np.int64(1)}, {**attrs, "heads": np.int64(2)}
    mean = {**one, "mean": np.int64(1)}
    ok = call(indptr, cols, data, jnp.asarray([2, 0, 1], jnp.int32), x, **one)
    np.testing.assert_array_equal(np.asarray(ok), np.ones((3, 2)))
    # two values per entry, read through the positions: row r gets entry perm[r]'s pair
    pairs = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    ok = call(indptr, cols, pairs, jnp.asarray([2, 0, 1], jnp.int32), x, **two)
    np.testing.assert_array_equal(np.asarray(ok), [[5.0, 6.0], [1.0, 2.0], [3.0, 4.0]])
    # a mean through the positions: one entry a row, so each row is its value times x
    ok = call(indptr, cols, data * 3, jnp.asarray([2, 0, 1], jnp.int32), x, **mean)
    np.testing.assert_array_equal(np.asarray(ok), np.full((3, 2), 3.0))
    bad = [
        (data, [0, 3, 1], one), (data, [0, -1, 1], one), (data, [0, 1], one),
        (jnp.zeros((0,)), [0, 1, 2], one), (pairs, [0, 3, 1], two),
        (data, [0, 1, 2], two),  # one value per entry, two heads
        (pairs, [0, 1, 2], {**attrs, "heads": np.int64(0)}),
        (jnp.ones((3, 3)), [0, 1, 2], {**attrs, "heads": np.int64(3)}),  # 2 features
        (pairs, [0, 1, 2], {**two, "feature_major": np.int64(1)}),
        # a mean is a row-major sum with one value per entry
        (data, [0, 1, 2], {**mean, "reduce": np.int64(1)}),
        (pairs, [0, 1, 2], {**two, "mean": np.int64(1)}),
        (data, [0, 1, 2], {**mean, "feature_major": np.int64(1)}),
    ]  # fmt: skip
    for values, perm, given in bad:
        with pytest.raises(Exception, match="jaxcsr cpu"):
            perm = jnp.asarray(perm, jnp.int32)
            jax.block_until_ready(call(indptr, cols, values, perm, x, **given))


def test_push_means_need_the_row_pointer():
    """The push's guard for a mean: it reads the rows' entry counts, so a mean without
    the row pointer, of a max, or feature-major is an error; with it, each row is its
    sum times the reciprocal count (row 1 empty: 0)."""
    call = jax.ffi.ffi_call("jaxcsr_cpu_push", jax.ShapeDtypeStruct((3, 2), jnp.float32))
    indptr, ids = jnp.asarray([0, 2, 2, 3], jnp.int32), jnp.asarray([2, 0, 0], jnp.int32)
    x, none = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]]), jnp.zeros((0,), jnp.float32)
    attrs = {"max_threads": np.int64(0), "reduce": np.int64(0), "feature_major": np.int64(0)}
    mean = {**attrs, "mean": np.int64(1)}
    ok = call(indptr, ids, none, x, **mean)
    np.testing.assert_array_equal(np.asarray(ok), [[4.0, 5.5], [0.0, 0.0], [1.0, 2.0]])
    bad = [
        (jnp.zeros((0,), jnp.int32), mean),
        (indptr, {**mean, "reduce": np.int64(1)}),
        (indptr, {**mean, "feature_major": np.int64(1)}),
    ]
    for pointer, given in bad:
        with pytest.raises(Exception, match="jaxcsr cpu"):
            jax.block_until_ready(call(pointer, ids, none, x, **given))


@pytest.mark.parametrize("kind", ["hub", "segment", "segment_sorted", "general"])
def test_one_thread_and_all_threads_agree_bit_for_bit(rng, kind):
    A, _ = _matrix(rng, kind, m=300, n=1000, k=9000)
    assert A.nnz * 16 >= SERIAL_WORK
    for dtype in (np.float32, jnp.bfloat16):
        for B, f in ((A, 33), (A, 16), (A.T, 64)) if kind == "general" else ((A, 33), (A, 16)):
            x = random_values(rng, (B.shape[1], f)).astype(dtype)
            every = jax.jit(lambda B, x: jaxcsr.matmul(B, x, impl="cpu"))
            with cpu.threads(1):
                one = jax.jit(lambda B, x: jaxcsr.matmul(B, x, impl="cpu"))
                lowered = one.lower(B, x).as_text()
                assert "max_threads = 1" in lowered, lowered[-2000:]
                y1 = np.asarray(one(B, x))
            assert "max_threads = 0" in every.lower(B, x).as_text()
            np.testing.assert_array_equal(y1, np.asarray(every(B, x)))
    with pytest.raises(ValueError, match="non-negative int"):
        with cpu.threads(-1):
            pass


def test_one_feature_push_threads_agree_bit_for_bit(rng):
    """Unsorted ids, one feature, enough entries for four pieces on the threads (the
    bare one-feature loop): with and without values, sum and max, 1 thread against all
    bit for bit and against float64."""
    m, k = 300, SERIAL_WORK + 9000
    ids = power_law_ids(rng, k, m)
    x = random_values(rng, (k, 1)).astype(np.float32)
    for data in (None, random_values(rng, k).astype(np.float32)):
        A = CSRMatrix.from_indices(ids, m, data=data)
        assert cpu.choose(A.structure, 1).pieces == 4
        for reduce in ("sum", "max"):
            every = jax.jit(lambda B, x, r=reduce: jaxcsr.matmul(B, x, reduce=r, impl="cpu"))
            with cpu.threads(1):
                one = jax.jit(lambda B, x, r=reduce: jaxcsr.matmul(B, x, reduce=r, impl="cpu"))
                assert "max_threads = 1" in one.lower(A, x).as_text()
                y1 = np.asarray(one(A, x))
            np.testing.assert_array_equal(y1, np.asarray(every(A, x)))
            want, _ = reduce_reference(A, np.asarray(x, np.float64), reduce)
            assert_close(y1, want, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_push_too_wide_for_8_mib_runs_two_pieces(rng, dtype):
    """20000 rows x 64 features: one float32 partial (5 MB) fits the 8 MiB budget only
    once, so two pieces run within 32 MiB (8.5 entries per row): sum and max against
    float64, one thread against all bit for bit."""
    m, k, f = 20000, 170000, 64
    ids = power_law_ids(rng, k, m)
    x = random_values(rng, (k, f)).astype(dtype)
    A = CSRMatrix.from_indices(ids, m)
    itemsize = np.dtype(dtype).itemsize
    assert cpu.push_pieces(m, k, f, itemsize) == 2  # the pieces fix each row's order
    assert cpu.choose(A.structure, f, itemsize).pieces == 2
    for reduce in ("sum", "max"):
        every = jax.jit(lambda B, x, r=reduce: jaxcsr.matmul(B, x, reduce=r, impl="cpu"))
        with cpu.threads(1):
            one = jax.jit(lambda B, x, r=reduce: jaxcsr.matmul(B, x, reduce=r, impl="cpu"))
            y1 = np.asarray(one(A, x))
        np.testing.assert_array_equal(y1, np.asarray(every(A, x)))
        want, _ = reduce_reference(A, np.asarray(x, np.float64), reduce)
        assert_close(y1, want, dtype)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_one_piece_push_splits_features_over_threads(rng, dtype):
    """Unsorted ids with under 2 per row reduce in one piece: the pull runs; the push,
    forced, splits the features over the threads in blocks of 64-byte lines (F = 48:
    blocks of 16 and 32 float32 features; F = 64 bfloat16: two of 32). Each: sum, max
    and min against float64, the same bits on one thread -- and the same bits as the
    other."""
    m, k = 3000, 5000
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, m)
    assert cpu.choose(A.structure, 48).kernel == "pull" and k < 2 * m  # one piece
    pulled = _push_threads_agree(rng, A, dtype, (48, 64))
    with cpu.unsorted_kernel("push"):
        assert cpu.choose(A.structure, 48).kernel == "push"
        pushed = _push_threads_agree(rng, A, dtype, (48, 64), inputs=pulled[1])
    for y, z in zip(pulled[0], pushed[0], strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(z))


def _push_threads_agree(rng, A, dtype, widths, inputs=None):
    """Sum, max and min of ``A @ x`` against float64, on all threads and one bit for bit.
    Returns the outputs and the inputs (``inputs``: the ones to use). Every width in one
    program (a compile per thread count, not per width too)."""
    reduces = ("sum", "max", "min")
    used = [
        random_values(rng, (A.shape[1], f)).astype(dtype) if inputs is None else inputs[i]
        for i, f in enumerate(widths)
    ]
    assert all(A.shape[1] * f >= SERIAL_WORK for f in widths)
    with cpu.threads(1):  # traced inside the block
        one = jax.jit(lambda B, xs: _native_products(B, xs, reduces))
        ones = one(A, used)
        assert "max_threads = 1" in one.lower(A, used).as_text()
    every = jax.jit(lambda B, xs: _native_products(B, xs, reduces))(A, used)
    outputs = []
    for x, ys, y1s in zip(used, every, ones, strict=True):
        for reduce, y, y1 in zip(reduces, ys, y1s, strict=True):
            want, _ = reduce_reference(A, np.asarray(x, np.float64), reduce)
            assert_close(y, want, dtype, err_msg=f"{reduce}, {x.shape[1]} features")
            np.testing.assert_array_equal(np.asarray(y1), np.asarray(y))
            outputs.append(y)
    return outputs, used


def test_narrow_one_piece_sums_scatter_with_the_kernels_bits(rng):
    """Static unsorted float32 ids in one piece, at least NARROW_SCATTER_MIN_IDS of
    them, summed into rows of 2 to 8 features: XLA's scatter runs (no native call in
    the program), with the bits of the push and the pull pinned (every row in input
    order; one feature into at least NARROW_SCATTER_MIN_ROWS rows: the push's), weighted
    or not, and the gradients of the planned product. Outside the rule (one feature
    into fewer rows, 12 features, 16-bit values, max, fewer ids) the kernels run."""
    m, k = 90000, cpu.NARROW_SCATTER_MIN_IDS + 4321
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, m)
    W = A.with_data(jnp.asarray(random_values(rng, (k,))))
    assert cpu.push_pieces(m, k, 4, 4) == 1 and np.bincount(ids, minlength=m).min() == 0
    assert [cpu.choose(A.structure, f).kernel for f in (1, 2, 4, 8, 12)] == (
        ["push", "xla", "xla", "xla", "pull"]
    )
    assert cpu.choose(A.structure, 4, 2).kernel == "pull"  # 16-bit
    assert cpu.choose(A.structure, 4, reduce="max").kernel == "pull"
    few = CSRMatrix.from_indices(ids[: cpu.NARROW_SCATTER_MIN_IDS - 1], m)
    assert cpu.choose(few.structure, 4).kernel == "pull"
    tall = CSRMatrix.from_indices(ids, cpu.NARROW_SCATTER_MIN_ROWS)
    assert [cpu.choose(tall.structure, f).kernel for f in (1, 4)] == ["xla", "xla"]
    assert "XLA's scatter" in A.plan_info(4).strategies["forward, cpu"]
    product = jax.jit(lambda B, x: B @ x)
    cells = [(A, 2), (W, 4), (A, 4), (W, 5), (A, 8), (tall, 1), (tall, 3)]
    for B, f in cells:
        x = jnp.asarray(random_values(rng, (k, f)))
        text = product.lower(B, x).compile().as_text()
        assert "jaxcsr_cpu" not in text and "scatter" in text
        y = np.asarray(product(B, x))
        # the pull sums one feature in eight lanes: other bits there
        for kernel in ("push",) if f == 1 else ("push", "pull"):
            with cpu.unsorted_kernel(kernel):
                pinned = jax.jit(lambda B, x: B @ x)
                assert "jaxcsr_cpu_" + kernel in pinned.lower(B, x).as_text()
                np.testing.assert_array_equal(y, np.asarray(pinned(B, x)))
        assert_close(y, reduce_reference(B, np.asarray(x, np.float64), "sum")[0], np.float32)
    x = jnp.asarray(random_values(rng, (k, 4)))
    ct = jnp.asarray(random_values(rng, (m, 4)))
    loss = lambda d, x: jnp.vdot(A.with_data(d) @ x, ct)  # noqa: E731
    d_data, d_x = jax.grad(loss, argnums=(0, 1))(W.data, x)
    ct64, x64 = np.asarray(ct, np.float64), np.asarray(x, np.float64)
    cols = np.asarray(A.structure.indices)  # the column of each CSR position
    by_column = np.empty(k)
    by_column[cols] = np.asarray(W.data)
    np.testing.assert_allclose(np.asarray(d_x), ct64[ids] * by_column[:, None], rtol=1e-6)
    want = (ct64[ids] * x64).sum(1)[cols]  # CSR order
    np.testing.assert_allclose(np.asarray(d_data), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_narrow_pull_and_one_feature_push_on_any_thread_count(rng, dtype):
    """Unsorted ids in one piece at 1 (the push), 3, 6, 11 and 21 features (the pull's
    fixed-width loops), enough work for every thread: sum, max and min against float64,
    and the same bits on one thread as on all."""
    m, k = 30000, 45000
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, m)
    assert [cpu.choose(A.structure, f).kernel for f in (1, 3, 6, 11, 21)] == ["push"] + ["pull"] * 4
    _push_threads_agree(rng, A, dtype, (3, 6, 11, 21))
    x = random_values(rng, (k, 1)).astype(dtype)
    with cpu.threads(1):
        one = jax.jit(lambda B, x: jaxcsr.matmul(B, x, impl="cpu"))(A, x)
    every = jax.jit(lambda B, x: jaxcsr.matmul(B, x, impl="cpu"))(A, x)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(every))
    assert_close(every, reduce_reference(A, np.asarray(x, np.float64), "sum")[0], dtype)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_sum_push_reads_no_row_pointer(rng, dtype):
    """A sum's push takes no row pointer (its empty rows keep the fill, 0), so traced
    ids compile to the push alone: no scatter of row counts, no cumulative sum; a max
    still reads it (empty rows). Traced ids in one piece with dropped ones (negative
    and past the rows), 1-31 features (1-40 bfloat16), sum and max against float64
    (float32 also against jax.ops), one thread against all bit for bit; static ids
    through the same push (pinned), weighted too."""
    m, k = 80_000, 140_000  # under 2 ids a row: one piece at every width
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    itemsize = np.dtype(dtype).itemsize
    widths = (1, 2, 5, 8, 16, 19, 31) if itemsize == 4 else (1, 8, 16, 40)
    assert all(cpu.push_pieces(m, k, f, itemsize) == 1 for f in widths)
    A = CSRMatrix.from_indices(ids, m)
    with cpu.unsorted_kernel("push"):
        assert all(cpu.choose(A.structure, f, itemsize).kernel == "push" for f in widths)
        _push_threads_agree(rng, A, dtype, widths[::3])
        W = CSRMatrix.from_indices(ids, m, data=random_values(rng, k).astype(dtype))
        _push_threads_agree(rng, W, dtype, widths[:2])
    dropped = ids.copy()
    dropped[rng.random(k) < 0.05] = m + 7
    dropped[rng.random(k) < 0.05] = -3
    keep = (dropped >= 0) & (dropped < m)
    empty = np.bincount(dropped[keep], minlength=m)[:, None] == 0
    traced_ids = jnp.asarray(dropped)
    for reduce in ("sum", "max"):
        op = getattr(jaxcsr, f"segment_{reduce}")
        fn = jax.jit(lambda i, v, op=op: op(v, i, num_segments=m, impl="cpu"))
        for f in widths[::2]:
            v = random_values(rng, (k, f)).astype(dtype)
            with cpu.threads(1):  # traced inside the block
                one = jax.jit(lambda i, v, op=op: op(v, i, num_segments=m, impl="cpu"))
                y1 = np.asarray(one(traced_ids, v))
            y = fn(traced_ids, v)
            np.testing.assert_array_equal(y1, np.asarray(y))
            compiled = fn.lower(traced_ids, v).compile().as_text()
            assert "jaxcsr_cpu_push" in compiled
            assert (" scatter(" in compiled) == (reduce == "max"), compiled  # the counts
            want = segment_reference(np.asarray(v)[keep], dropped[keep], m, reduce)
            if reduce == "max":
                want = np.where(empty, -np.inf, want)  # empty segments: -inf, as jax.ops
            assert_close(y, want, dtype)
            if itemsize == 4:  # jax.ops adds 16-bit values in 16 bits: far off on hub rows
                ops = getattr(jax.ops, f"segment_{reduce}")(v, traced_ids, m)
                assert_close(y, np.asarray(ops, np.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_narrow_push_in_pieces_matches_float64_on_any_thread_count(rng, dtype, weighted):
    """Unsorted ids in 4 pieces at 2 to 7, 9 to 15 and 17 to 31 features (the push's
    fixed-width loops), with and without values: sum, max and min against float64, one
    thread against all."""
    m, k = 3000, SERIAL_WORK // 2 + 7000
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    data = random_values(rng, k).astype(dtype) if weighted else None
    A = CSRMatrix.from_indices(ids, m, data=data)
    itemsize = np.dtype(dtype).itemsize
    widths = (2, 3, 4, 5, 6, 7, 9, 12, 15, 17, 26, 31)
    assert all(cpu.choose(A.structure, f, itemsize).pieces == 4 for f in widths)
    _push_threads_agree(rng, A, dtype, widths)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_sixteen_bit_push_with_few_ids_per_row_runs_two_pieces(rng, dtype):
    """16-bit values with 6 unsorted ids per row (too few for the float32 rule) push in
    two pieces in rows under 32 bytes (F = 8); from 32 bytes (F = 16, 64) the pull runs,
    in input order."""
    m, k = 3000, 18000
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, m)
    for f in (8, 16, 64):  # the pieces fix each row's order: pinned, with float32's one
        assert cpu.push_pieces(m, k, f, 2) == 2 and cpu.push_pieces(m, k, f, 4) == 1
        assert cpu.choose(A.structure, f, 4).pieces == 1
    assert cpu.choose(A.structure, 8, 2) == cpu.Strategy(
        "push", f"2 pieces of ids into private partials ({m} rows, {k} ids)", 2
    )
    for f in (16, 64):
        assert cpu.choose(A.structure, f, 2).kernel == "pull"
    _push_threads_agree(rng, A, dtype, (8, 16, 64))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_two_pieces_of_wide_rows_or_large_partials_run_the_pull(rng, dtype):
    """Where the push would take two pieces, rows of x of 512 bytes or more and float32
    partials over 40 MiB run the pull (input order, against float64 and jax.ops, one
    thread against all); 64 features over few rows keep the push."""
    m, k = 6000, 60000
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, m)
    itemsize = np.dtype(dtype).itemsize
    wide = 512 // itemsize
    assert cpu.push_pieces(m, k, wide, itemsize) == 2
    assert cpu.choose(A.structure, wide, itemsize).kernel == "pull"
    assert cpu.choose(A.structure, 64, 4).kernel == "push"  # partials of 3 MiB
    outputs, inputs = _push_threads_agree(rng, A, dtype, (wide,))
    want = jax.ops.segment_sum(jnp.asarray(inputs[0], jnp.float32), ids, m)
    assert_close(outputs[0], np.asarray(want, np.float64), dtype)
    # partials past 40 MiB (sizes only: nothing runs)
    big = CSRMatrix.from_indices(np.arange(900_000) % 90_000, 90_000)
    assert cpu.push_pieces(90_000, 900_000, 64, 4) == 2
    assert "44 MiB of partials" in cpu.choose(big.structure, 64, 4).reason
    assert cpu.choose(big.structure, 32, 4).kernel == "push"  # 22 MiB


@pytest.mark.parametrize("kind", KINDS)
def test_feature_major_products_match_float64(rng, kind):
    """``values @ B`` contracts the last axis of values ``(F, m)``: the kernels read and
    write that layout as stored (push, pull and the gather of the backward). Both views,
    three dtypes, widths 1, 3 and 33 (16 + 16 + 1), forward and the operand's gradient against
    float64; the compiled products hold no transpose."""
    A, _ = _matrix(rng, kind)

    def forward(B, v):
        return v @ B

    def backward(B, v, ct):
        return jax.vjp(functools.partial(forward, B), v)[1](ct)[0]

    fwd, bwd = jax.jit(forward), jax.jit(backward)

    @jax.jit
    def both(B, vs, cts):  # every width in one program: a compile per view and dtype
        return [(forward(B, v), backward(B, v, ct)) for v, ct in zip(vs, cts, strict=True)]

    for B in (A, A.T):
        for dtype in DTYPES:
            if B.dtype is not None:  # the reference reads the values as rounded
                B = B.with_data(B.data.astype(dtype))
            dense = dense_of(B)
            widths = (1, 3, 33)
            vs = [random_values(rng, (f, B.shape[0])).astype(dtype) for f in widths]
            cts = [random_values(rng, (f, B.shape[1])).astype(dtype) for f in widths]
            for f, v, ct, (out, grad) in zip(widths, vs, cts, both(B, vs, cts), strict=True):
                assert out.dtype == np.dtype(dtype) and out.shape == (f, B.shape[1])
                assert_close(out, np.asarray(v, np.float64) @ dense, dtype, err_msg=f"{f}")
                assert_close(grad, np.asarray(ct, np.float64) @ dense.T, dtype, err_msg=f"{f}")
        v, ct = jnp.ones((4, B.shape[0]), jnp.float32), jnp.ones((4, B.shape[1]), jnp.float32)
        for compiled in (fwd.lower(B, v).compile(), bwd.lower(B, v, ct).compile()):
            text = compiled.as_text()
            assert "jaxcsr_cpu_" in text and " transpose(" not in text, text[-3000:]


@pytest.mark.parametrize("kind", ["hub", "segment", "segment_sorted", "general"])
def test_feature_major_threads_agree_bit_for_bit(rng, kind):
    """Feature-major push, pull and gather: one thread and all give the same bits."""
    A, _ = _matrix(rng, kind, m=300, n=1000, k=9000)
    every = jax.jit(lambda B, v: v @ B)
    one = jax.jit(lambda B, v: v @ B)  # always called (so traced) inside the block
    for B in (A, A.T):
        for dtype in (np.float32, jnp.bfloat16):
            for f in (1, 20, 64):
                v = random_values(rng, (f, B.shape[0])).astype(dtype)
                assert B.nnz * 20 >= SERIAL_WORK
                with cpu.threads(1):
                    y1 = np.asarray(one(B, v))
                    assert "max_threads = 1" in one.lower(B, v).as_text()
                np.testing.assert_array_equal(y1, np.asarray(every(B, v)))


def test_feature_major_gather_splits_rows_and_zeroes_padded_ids(rng):
    """The backward of ``values @ A.T`` for a segment matrix is a gather ``ct[:, ids]``:
    with few features the rows of each split over the threads at any alignment (eight
    at a time, then a tail); bit for bit a copy, on one thread and all. Ids outside
    the rows (padding) give 0."""
    m, k = 1000, 1_000_003
    ids = rng.integers(0, m, k).astype(np.int32)
    A = CSRMatrix.from_indices(ids, m)
    for f in (1, 3):
        ct = random_values(rng, (f, m)).astype(np.float32)
        grad = jax.jit(lambda B, ct, f=f: jax.vjp(lambda v: v @ B.T, jnp.zeros((f, k)))[1](ct)[0])
        np.testing.assert_array_equal(np.asarray(grad(A, ct)), ct[:, ids])
        with cpu.threads(1):
            one = jax.jit(
                lambda B, ct, f=f: jax.vjp(lambda v: v @ B.T, jnp.zeros((f, k)))[1](ct)[0]
            )
            np.testing.assert_array_equal(np.asarray(one(A, ct)), ct[:, ids])
    f = 17
    ct = random_values(rng, (f, m)).astype(np.float32)
    padded = jax.jit(
        lambda ids, ct: jax.vjp(
            lambda v: v @ CSRMatrix.from_indices(ids, m).T, jnp.zeros((f, 40)))[1](ct)[0]
    )  # fmt: skip
    few = rng.integers(0, m, 40).astype(np.int32)  # traced ids: outside ones dropped
    few[rng.choice(40, 4, replace=False)] = [-3, -1, m, m + 2]
    want = np.where((few >= 0) & (few < m), ct[:, np.clip(few, 0, m - 1)], 0.0)
    np.testing.assert_array_equal(np.asarray(padded(jnp.asarray(few), ct)), want)


@pytest.mark.parametrize("how", ["cached", "streamed", "auto"])
def test_gather_stores_give_the_same_bits(rng, how):
    """The row gather ``y[ids]`` (the segment sum's backward) and the feature-major one
    ``ct[:, ids]`` (``values @ A.T``'s) copy through the caches or past them
    (non-temporal stores: large outputs into resident pages): forced either way, and
    as the kernel decides, each is a copy bit for bit -- rows of 32 to 272 bytes
    (streamed from 32 bytes on, in 16-byte units), feature rows of 2- and 4-byte values
    at every alignment, an odd count of rows over the threads, and traced ids outside
    the rows (zeros)."""
    m, k = 301, 20_011
    ids = rng.integers(0, m, k).astype(np.int32)
    A = CSRMatrix.from_indices(ids, m)
    padded = ids.copy()
    padded[rng.choice(k, 7, replace=False)] = [-3, -1, m, m + 2, m + 9, -7, m + 1]
    keep = (padded >= 0) & (padded < m)
    with cpu._gather_stores(how):
        static = jax.jit(lambda A, y: A.T @ y)
        traced = jax.jit(
            lambda i, y: jax.vjp(
                lambda v: jaxcsr.segment_sum(v, i, num_segments=m, impl="cpu"),
                jnp.zeros((k, y.shape[1]), y.dtype),
            )[1](y)[0]
        )
        widths = [(np.float16, 16), (np.float32, 8), (np.float32, 12), (np.float32, 16)]
        widths += [(np.float32, 68), (jnp.bfloat16, 16), (jnp.bfloat16, 40)]
        for dtype, f in widths:
            y = random_values(rng, (m, f)).astype(dtype)
            assert k * f >= SERIAL_WORK  # several threads, an odd number of rows each
            np.testing.assert_array_equal(np.asarray(static(A, y)), y[ids])
            want = np.where(keep[:, None], y[np.clip(padded, 0, m - 1)], 0).astype(dtype)
            np.testing.assert_array_equal(np.asarray(traced(padded, y)), want)
            code = {"auto": 0, "cached": 1, "streamed": 2}[how]
            assert f"stores = {code}" in traced.lower(padded, y).as_text()

        def fm_grad(A, ct):  # ct[:, ids]: feature rows of k values
            return jax.vjp(lambda v: v @ A.T, jnp.zeros((ct.shape[0], k), ct.dtype))[1](ct)[0]

        fm_static = jax.jit(fm_grad)
        fm_traced = jax.jit(lambda i, ct: fm_grad(CSRMatrix.from_indices(i, m), ct))
        for dtype, f in [(np.float32, 1), (np.float32, 7), (jnp.bfloat16, 9), (np.float16, 3)]:
            ct = random_values(rng, (f, m)).astype(dtype)
            np.testing.assert_array_equal(np.asarray(fm_static(A, ct)), ct[:, ids])
            want = np.where(keep[None], ct[:, np.clip(padded, 0, m - 1)], 0).astype(dtype)
            np.testing.assert_array_equal(np.asarray(fm_traced(padded, ct)), want)
    # past kStreamBytes (24 MiB): the output's pages decide; the same bits either way
    big = rng.integers(0, m, 400_009).astype(np.int32)
    y = random_values(rng, (m, 16)).astype(np.float32)
    with cpu._gather_stores(how):
        gather = jax.jit(lambda A, y: A.T @ y)
        for _ in range(3):  # a freed output's block may come back, its pages resident
            np.testing.assert_array_equal(
                np.asarray(gather(CSRMatrix.from_indices(big, m), y)), y[big]
            )


def test_gradients_through_the_native_products(rng):
    A, dense = _matrix(rng, "general")
    x = random_values(rng, (N, 5)).astype(np.float32)
    ct = random_values(rng, (M, 5))
    gx = jax.grad(lambda x: jnp.sum(jaxcsr.matmul(A, x, impl="cpu") * ct))(x)
    assert_close(gx, dense.T @ ct, np.float32)
    ids = power_law_ids(rng, K, M)
    S = CSRMatrix.from_indices(ids, M)
    v = random_values(rng, (K, 5)).astype(np.float32)
    gv = jax.grad(lambda v: jnp.sum(jaxcsr.matmul(S, v, impl="cpu") * ct))(v)
    assert_close(gv, ct[ids], np.float32)


def test_corrupted_structures_never_reach_the_kernel(rng):
    """Through from_arrays: refused in Python. Through the pytree (no checks there):
    the kernel's own guards raise instead of reading out of bounds."""
    indptr, indices = np.array([0, 2, 1, 3]), np.array([0, 1, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        CSRMatrix.from_arrays(indptr, indices, shape=(3, 4))
    with pytest.raises(ValueError, match="indices"):
        CSRMatrix.from_arrays(np.array([0, 1, 2, 3]), np.array([0, 9, 2]), shape=(3, 4))
    A = CSRMatrix.from_arrays(np.array([0, 1, 2, 3]), np.array([0, 1, 2]), shape=(3, 4))
    leaves, tree = jax.tree_util.tree_flatten(A)
    bad = [
        jnp.asarray([0, 1, 9_999_999, 3], x.dtype) if x.shape == (4,) and i == 0 else x
        for i, x in enumerate(leaves)
    ]
    corrupted = jax.tree_util.tree_unflatten(tree, bad)
    with pytest.raises(Exception, match="jaxcsr cpu"):
        jax.block_until_ready(jaxcsr.matmul(corrupted, jnp.ones((4, 3)), impl="cpu"))


# ------------------------------------------------------------------ arg search
def _ties_and_nans(rng, shape, dtype):
    """Values with many ties (a few distinct values) and some NaNs."""
    x = rng.integers(-3, 4, shape).astype(np.float32)
    x[rng.random(shape) < 0.05] = np.nan
    return jnp.asarray(x, dtype)


REDUCES = ("max", "min")


def _searches(view_of, xs):
    """The native and the fallback's searches of the max and the min of a view, for
    each operand in ``xs``: ``[(reduce, native, fallback)]``, operand by operand."""
    results = jax.tree.map(np.asarray, _jitted_searches(view_of, xs))
    return [
        (reduce, *found) for per_x in results for reduce, found in zip(REDUCES, per_x, strict=True)
    ]


@jax.jit
def _jitted_searches(view_of, xs):
    """:func:`_searches` in one program (a compile per view and dtype)."""
    view = view_of.structure
    results = []
    for x in xs:
        data = None if view_of.data is None else view_of.data.astype(x.dtype)
        per_x = []
        for reduce in REDUCES:
            out = jaxcsr.matmul(view_of, x, reduce=reduce, impl="xla")
            native, fallback = {}, {}
            for name, kernel, xla_fn in (
                ("positions", cpu.arg_positions, xla.extreme_positions),
                ("columns", cpu.arg_columns, xla.extreme_columns),
            ):
                if name == "positions" and view.one_per_column:
                    continue  # searched as columns (the fallback's too)
                native[name] = kernel(x, data, view, out)
                fallback[name] = xla_fn(x, data, view, out)
            per_x.append((native, fallback))
        results.append(per_x)
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_native_arg_search_matches_the_fallback(rng, kind):
    """Positions, columns and column masks of max and min, both views, three dtypes,
    values with ties and NaNs (first hit in CSR or input order), equal to the XLA
    path's; and return_arg through matmul runs the native search."""
    A, _ = _matrix(rng, kind)
    for B in (A, A.T):
        for dtype in DTYPES:
            if B.dtype is not None:
                B = B.with_data(jnp.asarray(_ties_and_nans(rng, B.data.shape, dtype)))
            # 19: eight lanes at a time and a tail of three
            xs = [_ties_and_nans(rng, (B.shape[1], f), dtype) for f in (1, 5, 19)]
            for reduce, native, fallback in _searches(B, xs):
                for name in native:
                    np.testing.assert_array_equal(
                        native[name], fallback[name], err_msg=f"{reduce} {name}"
                    )
        x = random_values(rng, (B.shape[1], 3)).astype(np.float32)
        fn = jax.jit(lambda B, x: jaxcsr.matmul(B, x, reduce="max", return_arg=True))
        if not B.structure.one_per_row:
            assert "jaxcsr_cpu_arg_search" in fn.lower(B, x).as_text()
        want = jaxcsr.matmul(B, x, reduce="max", return_arg=True, impl="xla")
        np.testing.assert_array_equal(fn(B, x)[1], want[1])


@pytest.mark.parametrize("kind", ["segment", "hub", "general"])
def test_native_arg_search_threads_agree(rng, kind):
    """Above the serial threshold (pieces of columns combined by their minimum; one
    piece split by features; rows over threads): one thread, all threads and the
    fallback find the same entries, and the max's gradient (the column mask) is the
    fallback's."""
    A, _ = _matrix(rng, kind, m=300, n=1000, k=9000)
    B, _ = _matrix(rng, "segment", m=3000, k=9000)  # ~3 ids per row: one piece
    for C, f in ((A, 16), (A, 33), (B, 64)):
        x = _ties_and_nans(rng, (C.shape[1], f), np.float32)
        assert C.nnz * f >= SERIAL_WORK
        out = jaxcsr.matmul(C, x, reduce="max", impl="xla")
        search = jax.jit(cpu.arg_columns)
        with cpu.threads(1):  # another function: jit caches by function, not by the cap
            one = jax.jit(lambda x, d, s, o: cpu.arg_columns(x, d, s, o))
            assert "max_threads = 1" in one.lower(x, None, C.structure, out).as_text()
            one = np.asarray(one(x, None, C.structure, out))
        every = np.asarray(search(x, None, C.structure, out))
        np.testing.assert_array_equal(one, every)
        want = xla.extreme_columns(x, None, C.structure, out)
        np.testing.assert_array_equal(every, np.asarray(want))
        x = random_values(rng, (C.shape[1], f)).astype(np.float32)
        grads = [
            jax.grad(lambda x, C=C, i=impl: jaxcsr.matmul(C, x, reduce="max", impl=i).sum())(x)
            for impl in ("cpu", "xla")
        ]
        np.testing.assert_array_equal(*grads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_min_gradients_put_ct_at_the_attaining_columns(rng, dtype):
    """A from_indices max/min gradient ends in the native put (``ct`` at the attaining
    columns, one pass: no zero array, no scatter) and equals the XLA path's bit for bit:
    ties and NaNs, weighted ids, a hub row, widths within and past a vector; one thread
    against all; under vmap; ids planned on the device with some outside the rows."""

    def grad_of(A, reduce, impl, w):
        def loss(x):
            y = jaxcsr.matmul(A, x, reduce=reduce, impl=impl)
            return (y.astype(jnp.float32) * w).sum()

        return jax.grad(loss)

    for kind in ("segment", "segment_weighted", "hub"):
        A, _ = _matrix(rng, kind, m=300, k=9000)
        for f, reduce in ((3, "max"), (19, "min"), (16, "max")):
            x = _ties_and_nans(rng, (A.shape[1], f), dtype)
            w = jnp.asarray(random_values(rng, (A.shape[0], f)), jnp.float32)
            grad = jax.jit(grad_of(A, reduce, "cpu", w))
            text = grad.lower(x).as_text()
            assert "jaxcsr_cpu_put_attaining" in text
            # (values in CSR order are put in column order by a scatter of nnz values)
            assert A.data is not None or "scatter" not in text
            got = np.asarray(grad(x))
            want = jax.jit(grad_of(A, reduce, "xla", w))(x)
            np.testing.assert_array_equal(got, np.asarray(want))
            with cpu.threads(1):  # traced inside the block
                one = jax.jit(grad_of(A, reduce, "cpu", w))
                assert "max_threads = 1" in one.lower(x).as_text()
                np.testing.assert_array_equal(np.asarray(one(x)), got)
        xs = jnp.stack([x, -x])
        batched = jax.jit(jax.vmap(grad_of(A, "max", "cpu", w)))(xs)
        for i in range(2):
            want = jax.jit(grad_of(A, "max", "xla", w))(xs[i])
            np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(want))
    ids = power_law_ids(rng, 5000, 300)
    ids[rng.random(5000) < 0.1] = 303  # outside the rows: dropped, no gradient
    x = _ties_and_nans(rng, (5000, 19), dtype)
    w = jnp.asarray(random_values(rng, (300, 19)), jnp.float32)

    def traced(i, x, impl):
        y = jaxcsr.segment_max(x, i, 300, impl=impl)
        return (y.astype(jnp.float32) * w).sum()

    got = jax.jit(jax.grad(traced, argnums=1), static_argnums=2)(jnp.asarray(ids), x, "cpu")
    want = jax.jit(jax.grad(traced, argnums=1), static_argnums=2)(jnp.asarray(ids), x, "xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(got, np.float32)[ids == 303].any()
    # the put itself, native and the fallback's: rows outside [0, m), columns of none
    rows = jnp.asarray(rng.integers(-2, 302, 5000), jnp.int32)
    columns = jnp.asarray(rng.integers(0, 5001, (300, 19)), jnp.int32)
    columns = columns.at[rows[rows < 300][:200], 3].set(jnp.arange(5000)[rows < 300][:200])
    ct = jnp.asarray(random_values(rng, (300, 19))).astype(dtype)
    native = np.asarray(jax.jit(cpu.put_attaining)(ct, columns, rows))
    np.testing.assert_array_equal(native, np.asarray(jax.jit(xla.put_attaining)(ct, columns, rows)))
    assert np.count_nonzero(native[:, 3]) >= 100  # ~146 rows set above (distinct of 200)


def test_native_arg_search_refuses_a_corrupted_row_pointer():
    """The search kernel's own guard: a row pointer past the entries is an error."""
    call = jax.ffi.ffi_call("jaxcsr_cpu_arg_search", jax.ShapeDtypeStruct((3, 2), jnp.int32))
    x, out = jnp.ones((4, 2), jnp.float32), jnp.ones((3, 2), jnp.float32)
    cols, empty = jnp.asarray([0, 1, 2], jnp.int32), jnp.zeros((0,), jnp.float32)
    for indptr in ([0, 1, 9, 3], [0, 2, 1, 3], [1, 1, 2, 3]):
        with pytest.raises(Exception, match="jaxcsr cpu"):
            indptr = jnp.asarray(indptr, jnp.int32)
            jax.block_until_ready(call(indptr, cols, empty, x, out, max_threads=np.int64(0)))


# ------------------------------------------------------------------ fused softmax
def _softmax_case(rng, kind: str, size: int = K):
    """``(softmax function of x, row id of every entry, m)``: unsorted and sorted
    segment ids (a hub with 90 % of the entries among them) for ``segment_softmax``,
    general patterns (their CSR order) for ``edge_softmax``."""
    if kind.startswith(("segment", "hub")):
        ids = _hub_ids(rng, size, M) if kind.startswith("hub") else power_law_ids(rng, size, M)
        if kind.endswith("sorted"):
            ids = np.sort(ids)
        return (lambda x: jaxcsr.segment_softmax(x, ids, M)), ids, M
    A, _ = _matrix(rng, kind) if size == K else _matrix(rng, kind, m=300, n=1000)
    return (lambda x: jaxcsr.edge_softmax(A, x)), entry_rows(A), A.shape[0]


SOFTMAX_KINDS = ["segment", "segment_sorted", "hub", "hub_sorted", "general", "empty_rows"]
SOFTMAX_KINDS += ["duplicates"]


@pytest.mark.parametrize("kind", SOFTMAX_KINDS)
def test_native_softmax_and_its_gradient_match_float64(rng, kind):
    """The fused kernel (forward and backward from the output) on every pattern kind:
    rows in order (sorted ids, CSR patterns) and unsorted ids (pushes in input order);
    three dtypes, one head (the eight-lane path), 5 and 40 heads, 80 (with AVX-512:
    sixteen lanes; sorted rows in blocks of 64 and 16 heads)."""
    softmax, rows, m = _softmax_case(rng, kind)
    for dtype in DTYPES:
        for heads in (1, 5, 40, 80):
            x = jnp.asarray(3 * rng.standard_normal((len(rows), heads)), dtype)
            g = jnp.asarray(rng.standard_normal((len(rows), heads)), dtype)
            forward = jax.jit(softmax)
            backward = jax.jit(lambda x, g: jax.vjp(softmax, x)[1](g)[0])
            calls = backward.lower(x, g).as_text().count("jaxcsr_cpu_softmax")
            assert calls == 2, kind
            want = softmax_reference(x, rows, m)
            assert_close(forward(x), want, dtype)
            assert_close(backward(x, g), softmax_grad_reference(want, g, rows, m), dtype)


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 8])
def test_native_softmax_of_few_heads_matches_float64(rng, heads):
    """1-8 heads. Sorted rows run in batches of whole rows that fill the kernel's
    buffer (8192 floats): 6000 entries cross several batches; a hub row longer than the
    buffer takes the row loop, short rows end mid-vector (1-4 heads hold several entries
    per vector), empty rows are skipped. Unsorted ids push eight values at a time
    across entries (below 8 heads). Forward and backward against float64."""
    ids = np.sort(power_law_ids(rng, 6000, 700))
    ids[:3000] = ids[0]  # a hub of 3000 entries: past the buffer from 3 heads on
    ids.sort()
    for these in (ids, rng.permutation(ids)):
        for dtype in DTYPES:
            x = jnp.asarray(3 * rng.standard_normal((ids.size, heads)), dtype)
            g = jnp.asarray(rng.standard_normal((ids.size, heads)), dtype)
            out, vjp = jax.vjp(lambda x, these=these: jaxcsr.segment_softmax(x, these, 700), x)
            want = softmax_reference(x, these, 700)
            assert_close(out, want, dtype)
            assert_close(vjp(g)[0], softmax_grad_reference(want, g, these, 700), dtype)


def test_native_softmax_keeps_long_rows_of_16_bit_outputs_exact(rng):
    """A row longer than the kernel's buffer of kept exps (8192 floats): 16-bit
    outputs compute the exps again, float32 ones keep them in the output."""
    ids = np.sort(np.concatenate([np.zeros(9000, int), rng.integers(1, 5, 300)]))
    for dtype in DTYPES:
        for heads in (1, 16):  # 16: the sixteen-lane path where the CPU has AVX-512
            x = jnp.asarray(3 * rng.standard_normal((len(ids), heads)), dtype)
            want = softmax_reference(x, ids, 5)
            assert_close(jaxcsr.segment_softmax(x, ids, 5), want, dtype)


def test_native_softmax_heads_do_not_depend_on_the_lane_width(rng):
    """Each head is reduced alone, in entry order, by the same operations in eight
    lanes or sixteen: 32 heads (sixteen lanes where the CPU has AVX-512) give the bits
    of the same heads among 40 (eight lanes everywhere)."""
    ids = np.sort(power_law_ids(rng, 3000, 40))
    x32 = jnp.asarray(3 * rng.standard_normal((ids.size, 32)), np.float32)
    x40 = jnp.concatenate([x32, x32[:, :8]], axis=1)
    for dtype in (np.float32, jnp.bfloat16):
        y32 = jaxcsr.segment_softmax(x32.astype(dtype), ids, 40)
        y40 = jaxcsr.segment_softmax(x40.astype(dtype), ids, 40)
        np.testing.assert_array_equal(np.asarray(y32), np.asarray(y40)[:, :32])


@pytest.mark.parametrize("kind", ["segment", "segment_sorted"])
def test_native_softmax_special_values_match_the_xla_path(rng, kind):
    """NaN, +inf, rows of -inf, peaks far above exp's range and far below: the same
    values (NaN where NaN) as the XLA composition, and float64 where finite."""
    ids = power_law_ids(rng, K, M)
    if kind.endswith("sorted"):
        ids = np.sort(ids)
    x = 3 * rng.standard_normal((K, 16))  # 16 heads: the sixteen-lane path too
    special = np.unique(ids)[:5]
    first = [np.flatnonzero(ids == r)[0] for r in special]
    for head in (0, 13):  # a low and a high lane
        x[first[0], head] = np.nan  # the row is NaN
        x[first[1], head] = np.inf  # NaN at the inf, 0 elsewhere
        x[ids == special[2], head] = -np.inf  # NaN (as jax.nn.softmax)
        x[ids == special[3], head] += 1e4  # far above exp's range: a fine softmax
        x[ids == special[4], head] -= 1e4  # far below: a fine softmax
    x = jnp.asarray(x, np.float32)
    native = jaxcsr.segment_softmax(x, ids, M)
    composed = jaxcsr.segment_softmax(x, ids, M, impl="xla")
    np.testing.assert_allclose(np.asarray(native), np.asarray(composed), rtol=1e-5, atol=1e-7)
    want = softmax_reference(x, ids, M)
    finite = np.isfinite(want)
    assert_close(np.asarray(native)[finite], want[finite], np.float32)
    assert np.array_equal(np.isnan(np.asarray(native)), np.isnan(want))


@pytest.mark.parametrize("heads", [1, 3, 16])
@pytest.mark.parametrize("sorted_ids", [False, True])
def test_native_softmax_of_traced_ids_drops_what_jax_ops_drops(rng, sorted_ids, heads):
    """Padded layouts: dropped entries are 0 forward (even where their exp overflows)
    and ``p * g`` backward; one head, an eight-lane tail, sixteen lanes."""
    ids = power_law_ids(rng, K, M)
    ids[rng.random(K) < 0.1] = M + 3
    if sorted_ids:
        ids = np.sort(ids)
    else:
        ids[rng.random(K) < 0.05] = -2
    x = rng.standard_normal((K, heads))
    x[ids == M + 3] += 200.0  # exp overflows there: still 0
    g = rng.standard_normal((K, heads))

    def softmax(i, x):
        return jaxcsr.segment_softmax(x, i, M, indices_are_sorted=sorted_ids)

    forward = jax.jit(softmax)
    backward = jax.jit(lambda i, x, g: jax.vjp(lambda x: softmax(i, x), x)[1](g)[0])
    for dtype in (np.float32, jnp.bfloat16):  # exps kept in the output, and recomputed
        xd, gd = jnp.asarray(x, dtype), jnp.asarray(g, dtype)
        assert "jaxcsr_cpu_softmax" in forward.lower(jnp.asarray(ids), xd).as_text()
        want = softmax_reference(xd, ids, M)
        assert_close(forward(jnp.asarray(ids), xd), want, dtype)
        g_want = softmax_grad_reference(want, gd, ids, M)
        assert_close(backward(jnp.asarray(ids), xd, gd), g_want, dtype)


@pytest.mark.parametrize(
    "kind",
    ["segment_sorted", "hub_sorted", "general", "segment", "hub", "segment_wide", "segment_big"],
)
def test_native_softmax_one_thread_and_all_threads_agree_bit_for_bit(rng, kind):
    """Large enough for several chunks of rows on several threads; unsorted ids in 4
    pieces of entries (``segment``, ``hub``), in one piece with its 32 heads split
    over the threads (``segment_wide``: few entries per row), and in 2 pieces whose
    partials pass the product's 8 MiB (``segment_big``: 16 heads, one line); both
    branches of the forward (unshifted, and shifted where one row's sum overflows)."""
    heads = {"segment_wide": 32, "segment_big": 16}.get(kind, 8)
    if kind in ("segment_wide", "segment_big"):
        m, n = (9000, 20_000) if kind == "segment_wide" else (140_000, 1_200_000)
        assert kind == "segment_wide" or m * heads * 4 > 8 << 20
        ids = rng.integers(0, m, n) if kind == "segment_big" else power_law_ids(rng, n, m)
        rows = ids

        def softmax(x):
            return jaxcsr.segment_softmax(x, ids, m)
    else:
        softmax, rows, _ = _softmax_case(rng, kind, size=20_000)
    assert len(rows) * 8 >= SERIAL_WORK
    x = jnp.asarray(rng.standard_normal((len(rows), heads)), np.float32)
    g = jnp.asarray(rng.standard_normal((len(rows), heads)), np.float32)
    overflowing = x.at[np.flatnonzero(rows == rows[0])].add(100.0)  # the shifted branch
    for scores in (x, overflowing):
        _one_thread_and_all_agree(softmax, scores, g)


def _one_thread_and_all_agree(softmax, x, g):
    """The softmax and its gradient on one thread and on all: the same bits."""

    def both(x, g):
        out, vjp = jax.vjp(softmax, x)
        return out, vjp(g)[0]

    every = jax.jit(both)
    with cpu.threads(1):  # another function: jit caches by function, not by the cap
        one = jax.jit(lambda x, g: both(x, g))
        assert "max_threads = 1" in one.lower(x, g).as_text()
        y1 = one(x, g)
    for a, b in zip(y1, every(x, g), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_native_softmax_refuses_a_corrupted_row_pointer():
    """The kernel's own guards: a row pointer past the entries or of another length
    than the rows (sorted rows), or ids of another length than the scores (unsorted),
    is an error, not a read; ids outside the rows belong to none."""
    call = jax.ffi.ffi_call("jaxcsr_cpu_softmax", jax.ShapeDtypeStruct((4, 2), jnp.float32))
    x, empty = jnp.ones((4, 2), jnp.float32), jnp.zeros((0,), jnp.float32)
    none = jnp.zeros((0,), jnp.int32)
    attrs = {"max_threads": np.int64(0), "rows": np.int64(2)}
    for indptr in ([0, 3, 9], [0, 3, 2], [1, 2, 4], [0, -1, 4], [0, 4], [0, 1, 2, 4]):
        with pytest.raises(Exception, match="jaxcsr cpu"):
            indptr = jnp.asarray(indptr, jnp.int32)
            jax.block_until_ready(call(indptr, none, x, empty, **attrs))
    for ids in ([0, 1, 1], [0, 1, 1, 0, 1]):
        with pytest.raises(Exception, match="jaxcsr cpu"):
            jax.block_until_ready(call(none, jnp.asarray(ids, jnp.int32), x, empty, **attrs))
    with pytest.raises(Exception, match="jaxcsr cpu"):  # both a row pointer and ids
        ids = jnp.asarray([0, 1, 1, 0], jnp.int32)
        jax.block_until_ready(call(jnp.asarray([0, 2, 4], jnp.int32), ids, x, empty, **attrs))
    ids = jnp.asarray([0, 7, -1, 1], jnp.int32)
    np.testing.assert_allclose(
        np.asarray(call(none, ids, x, empty, **attrs)), [[1, 1], [0, 0], [0, 0], [1, 1]]
    )


def test_without_the_library_products_fall_back_with_one_warning(tmp_path):
    """The package copied without its built library, as an install without a compiler
    leaves it."""
    package = Path(jaxcsr.__file__).parent
    shutil.copytree(package, tmp_path / "jaxcsr", ignore=shutil.ignore_patterns("*.so"))
    env = {k: v for k, v in os.environ.items() if k != "JAXCSR_CPU_LIBRARY"}
    env["PYTHONPATH"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, str(PROGRAMS / "without_library.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_instruction_sets_give_the_same_bits(tmp_path, rng):
    """The loops compiled for the baseline, AVX2 and (where the CPU has it) AVX-512 give
    the same bits: every product kind, 1-72 features (eight-lane code, whole vectors,
    loops past them), three dtypes, run with ``JAXCSR_CPU_ISA`` capping the instruction
    set, each run confirming the cap it ran under."""
    seed = str(int(rng.integers(0, 2**31)))
    runs = {}
    for cap in ("baseline", "avx2", ""):  # the three at once
        env = {**os.environ, "JAXCSR_CPU_ISA": cap}
        path = tmp_path / f"{cap or 'best'}.npz"
        runs[cap] = (
            path,
            subprocess.Popen(
                [sys.executable, str(PROGRAMS / "isa_outputs.py"), str(path), seed],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            ),
        )
    results = {}
    for cap, (path, run) in runs.items():
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]
        results[cap] = dict(np.load(path))
    cpu_level = _cpu_isa_level()
    for cap, level in (("baseline", 0), ("avx2", 1), ("", 2)):
        assert int(results[cap].pop("isa")) == min(level, cpu_level), cap
    assert len(results[""]) == 3 * (7 * (3 * 7 + 4) + 2 * 4 * 2)  # dtypes x widths x outputs
    for cap in ("baseline", "avx2"):
        assert results[cap].keys() == results[""].keys()
        for key, value in results[""].items():
            np.testing.assert_array_equal(results[cap][key], value, err_msg=f"{cap}: {key}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
    reason="Linux without transparent huge pages: the advice is refused",
)
def test_large_fresh_outputs_are_advised_huge_pages_with_the_same_bits(tmp_path, rng):
    """Outputs past glibc's mmap threshold (fresh pages) of the row gather, a sum and the
    softmax: their mappings carry the huge-page advice (``hg``) unless
    ``JAXCSR_HUGE_PAGES=0``, and the bytes are the same either way. GLIBC_TUNABLES is
    unset in both runs (with ``glibc.malloc.hugetlb=1`` glibc advises it itself)."""
    seed = str(int(rng.integers(0, 2**31)))
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXCSR_HUGE_PAGES")}
    results = {}
    for setting in ("default", "0"):
        path = tmp_path / f"{setting}.json"
        run_env = env if setting == "default" else {**env, "JAXCSR_HUGE_PAGES": setting}
        done = subprocess.run(
            [sys.executable, str(PROGRAMS / "huge_pages.py"), str(path), seed],
            capture_output=True, text=True, timeout=600, env=run_env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results[setting] = json.loads(path.read_text())
    assert results["default"].keys() == {"gather", "sum", "softmax"}
    for name, advised in results["default"].items():
        kept = results["0"][name]
        assert advised["digest"] == kept["digest"], name
        assert "hg" in advised["flags"], (name, advised["flags"])
        assert "hg" not in kept["flags"], (name, kept["flags"])


def _cpu_isa_level() -> int:
    """2: the CPU has the AVX-512 subsets the kernels use, 1: AVX2, 0: neither."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return 2
    return 1 if "avx2" in flags else 0


EXP_CHECK = r"""
#include "vector_math.h"
#include <cmath>
#include <cstdio>
#include <cstring>
using namespace jaxcsr;
// exp16 (the AVX-512 build's exp); main calls it only where the CPU has AVX-512.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) float wide(float x) {
  return exp16(splat_as<f32x16>(x))[15];
}
// Every 61st float32 in [-110, 90] (all binades), plus the specials: the largest
// error of exp8 in units in the last place of the float32 result (float64 exp is
// the reference; below the smallest normal, absolute error in subnormal steps);
// exp16 must give exp8's bits.
int main() {
  double worst = 0, worst_sub = 0;
  int bad_special = 0;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  for (float x = -110.0f; x < 90.0f;) {
    const float got = exp8(splat(x))[0];
    if (avx512) {
      const float same = wide(x);
      bad_special += std::memcmp(&got, &same, sizeof same) != 0;
    }
    const double want = std::exp(static_cast<double>(x));
    const float wantf = static_cast<float>(want);
    if (std::isinf(wantf)) {
      bad_special += !std::isinf(got);
    } else if (want < 1.1754943508222875e-38) {
      worst_sub = std::fmax(worst_sub, std::fabs(got - want) / 1.401298464324817e-45);
    } else {
      const double ulp = std::nextafter(wantf, 1e38f) - wantf;
      worst = std::fmax(worst, std::fabs(got - want) / ulp);
    }
    for (int i = 0; i < 61; ++i) x = std::nextafter(x, 100.0f);
  }
  bad_special += exp8(splat(-INFINITY))[0] != 0.0f;
  bad_special += !std::isinf(exp8(splat(INFINITY))[0]);
  bad_special += !std::isnan(exp8(splat(NAN))[0]);
  bad_special += exp8(splat(0.0f))[0] != 1.0f;
  if (avx512) bad_special += wide(-INFINITY) != 0.0f || !std::isinf(wide(INFINITY)) ||
                             !std::isnan(wide(NAN));
  std::printf("%.6f %.6f %d\n", worst, worst_sub, bad_special);
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the check")
def test_softmax_exp_is_within_one_ulp(tmp_path):
    """The softmax kernel's own exp (csrc/vector_math.h) against float64, compiled with
    setup.py's flags:
    within 1 ulp on a sample of every binade, the smallest subnormals within 2 steps,
    and exp(-inf) = 0, exp(inf) = inf, exp(NaN) = NaN, exp(0) = 1; where the CPU has
    AVX-512, the sixteen-lane exp gives the same bits on every sample."""
    source = Path(cpu.__file__).parent / "csrc"
    (tmp_path / "check.cc").write_text(EXP_CHECK)
    flags = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
    flags += ["-Wno-psabi"]
    build = subprocess.run(
        ["g++", *flags, "-Wall", f"-I{source}", str(tmp_path / "check.cc"), "-o",
         str(tmp_path / "check")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True, timeout=120)
    worst, worst_sub, bad_special = run.stdout.split()
    assert float(worst) <= 1.0 and float(worst_sub) <= 2.0 and int(bad_special) == 0, run.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the sanitizer build")
def test_sanitizer_build_finds_nothing(tmp_path, rng):
    """AddressSanitizer + UndefinedBehaviorSanitizer build of the kernels (the flags
    setup.py uses with JAXCSR_SANITIZE=1), run on random structures. The build
    instantiates each kernel for outputs of its operand's dtype only
    (``JAXCSR_SAME_OUTPUT_DTYPE``: the program's products; a third of the compile) and
    each loop for AVX2 only (``JAXCSR_ONE_ISA``: the baseline and AVX-512 builds of the
    same source loops are compared bit for bit in test_instruction_sets_give_the_same_bits):
    about 60 s of one core to compile (90 s with every instruction set, 205 s with every
    output dtype too). The program runs each width's products as one jitted function."""
    sources = sorted(str(p) for p in (Path(cpu.__file__).parent / "csrc").glob("*.cc"))
    library = tmp_path / "_cpu_kernels_sanitized.so"
    flags = ["-std=c++17", "-O0", "-g", "-fno-omit-frame-pointer", "-fPIC", "-shared"]
    flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    flags += ["-DJAXCSR_SAME_OUTPUT_DTYPE", "-DJAXCSR_ONE_ISA"]
    objects = [tmp_path / f"{Path(source).stem}.o" for source in sources]
    compiles = [  # one compiler per source at once, as setup.py builds them
        subprocess.Popen(
            ["g++", *flags, f"-I{jax.ffi.include_dir()}", "-c", source, "-o", str(obj)],
            stderr=subprocess.PIPE, text=True,
        )
        for source, obj in zip(sources, objects, strict=True)
    ]  # fmt: skip
    for compile_ in compiles:
        _, stderr = compile_.communicate(timeout=900)
        assert compile_.returncode == 0, stderr[-3000:]
    build = subprocess.run(
        ["g++", *flags, *map(str, objects), "-o", str(library)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    # the ASan runtime first; libstdc++ with it, so that C++ exceptions jaxlib throws
    # and catches find the real __cxa_throw behind ASan's interceptor
    asan = " ".join(
        subprocess.run(
            ["g++", f"-print-file-name={name}"], capture_output=True, text=True
        ).stdout.strip()
        for name in ("libasan.so", "libstdc++.so")
    )
    env = {
        **os.environ,
        "JAXCSR_CPU_LIBRARY": str(library),
        "JAX_PLATFORMS": "cpu",  # no plugin probing (its C++ exceptions upset the ASan runtime)
        "LD_PRELOAD": asan,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=23",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=24",
    }
    seed = str(int(rng.integers(0, 2**31)))
    result = subprocess.run(
        [sys.executable, str(PROGRAMS / "sanitized.py"), seed],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    report = result.stderr[-4000:]
    assert result.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in result.stderr, report
    assert "runtime error" not in result.stderr, report
    assert result.stdout.strip().endswith("ok")


def _fused_heads(A, w, x):
    return jax.vmap(lambda a, v: A.with_data(a) @ v, in_axes=(1, 1), out_axes=1)(w, x)


def _product_per_head(A, w, x):
    return jnp.stack([A.with_data(w[:, h]) @ x[:, h] for h in range(w.shape[1])], axis=1)


def _with_gradients(attend, A, cases):
    """``attend`` and its gradients for each ``(w, x, ct)`` of ``cases`` (one program:
    jit it)."""
    results = []
    for w, x, ct in cases:
        out, vjp = jax.vjp(functools.partial(attend, A), w, x)
        results.append((out, *vjp(ct)))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_per_head_run_one_native_pull_with_the_per_head_bits(rng, dtype):
    """``vmap`` over per-head values and features (attention) binds one native pull
    (one call in the program, not one per head) whose outputs are, bit for bit, those
    of a product per head, on one thread and on all: a general matrix, its transpose
    (values read through the planned permutation) and sorted segment ids; 8 features a
    head (one vector register each), 16 over 9 heads (the values' gradient folds eight
    heads at a time: a group of one left) and 5 (the loop); forward and both
    gradients. Every shape of a view in one program (a compile per view and way)."""
    G, _ = _matrix(rng, "general", m=300, n=1000, k=9000)
    ids = np.sort(power_law_ids(rng, 9000, 300))
    views = {"general": G, "transpose": G.T, "sorted ids": CSRMatrix.from_indices(ids, 300)}
    shapes = [(8, 8), (3, 8), (9, 16), (4, 5)]  # heads, features a head
    for name, A in views.items():
        cases = []
        for heads, width in shapes:
            w = jnp.asarray(random_values(rng, (A.nnz, heads)), dtype)
            x = jnp.asarray(random_values(rng, (A.shape[1], heads, width)), dtype)
            ct = jnp.asarray(random_values(rng, (A.shape[0], heads, width)), dtype)
            text = jax.jit(_fused_heads).lower(A, w, x).as_text()
            assert text.count("jaxcsr_cpu_pull") == 1, (name, heads, width)
            cases.append((w, x, ct))
        got = jax.jit(lambda A, c: _with_gradients(_fused_heads, A, c))(A, cases)
        with cpu.threads(1):  # a function traced inside the block: a new one
            one_thread = jax.jit(lambda A, c: _with_gradients(_fused_heads, A, c))(A, cases)
        per_head = jax.jit(lambda A, c: _with_gradients(_product_per_head, A, c))(A, cases)
        ways = zip(shapes, cases, got, per_head, one_thread, strict=True)
        for shape, (w, x, _), *results in ways:
            for a, b, c in zip(*results, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
                np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=name)
            dense = dense_of(A.with_data(np.asarray(w[:, 1], np.float64)))
            want = dense @ np.asarray(x[:, 1], np.float64)
            assert_close(results[0][0][:, 1], want, dtype, err_msg=f"{name} {shape}")


def test_row_gathers_of_narrow_rows_run_xlas_gather(rng):
    """The segment sum's backward (``ct[ids]``, times the values if any) runs XLA's
    gather for rows under 32 bytes and the native gather from 32 bytes on; both give
    float64's answer rounded once (unweighted: the values themselves)."""
    ids = power_law_ids(rng, 5000, 300)
    data = random_values(rng, 5000).astype(np.float32)
    for A in (CSRMatrix.from_indices(ids, 300), CSRMatrix.from_indices(ids, 300, data=data)):
        G = A.T
        for n, dtype, native in ((1, np.float32, False), (4, np.float32, False),
                                 (8, np.float32, True), (8, jnp.bfloat16, False),
                                 (16, jnp.bfloat16, True)):  # fmt: skip
            itemsize = product_dtype(dtype, A.dtype).itemsize  # float32 values: float32
            native = native or itemsize * n >= 32
            assert (cpu.choose(G.structure, n, itemsize).kernel == "gather") == native
            ct = jnp.asarray(random_values(rng, (300, n)), dtype)
            f = jax.jit(lambda G, c: G @ c)
            assert ("jaxcsr_cpu_gather" in f.lower(G, ct).as_text()) == native, (n, dtype)
            want = dense_of(G) @ np.asarray(ct, np.float64)
            assert_close(f(G, ct), want, dtype)
            if A.dtype is None:  # copies: the same bits as the values
                np.testing.assert_array_equal(np.asarray(f(G, ct)), np.asarray(ct)[ids])
