"""What a step of the TPU kernel costs against the feature width, and what bounds it.

``python -m benchmarks.hardware.tpu_width_probe [--graphs tolokers] [--out DIR]``

For each width ``N`` (float32 values in CSR order of a real graph), times in one
process: a copy of the values (``v + 1``) and of the same bytes laid out lane-dense
(``(E * N / 128, 128)``); a Pallas kernel that only streams the value blocks the
windowed kernel reads (its ceiling for this access pattern); the windowed kernel
itself, and again with every step on the same block (its arithmetic alone); and the
feature-major kernel on ``values.T`` at several tilings. A *packed* kernel (``128 / N``
entries per lane row, one one-hot per packed group) was measured with this probe at
commit 3d4405f (``benchmarks/results/tpu-v5e/width_probe/layouts_packed.json``) and
removed. Times are per call, from ``--calls`` calls dispatched
back to back (the ~0.5 ms a blocking call costs is not counted). Sums are checked
against float64. Writes ``width_probe.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from benchmarks.datasets import load_graph
from benchmarks.hardware.tpu_probe import json_emitter
from jaxcsr.kernels import tpu

STREAM_BLOCK = 2048
"""Rows per block of the streaming-only kernel (the windowed kernel's ``block_k``)."""


def pipelined_ms(fn, args, calls: int) -> float:
    """Milliseconds per call of ``calls`` calls dispatched back to back (median of 3)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / calls)
    return float(np.median(runs)) * 1e3


def stream(values, block_rows: int, interpret=False):
    """Reads every ``(block_rows, C)`` block of ``values`` once, adds its first 8 rows."""
    e, c = values.shape
    nb = e // block_rows

    def kernel(v_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += v_ref[pl.ds(0, 8), :].astype(jnp.float32)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((8, c), jnp.float32),
        grid=(nb,),
        in_specs=[pl.BlockSpec((block_rows, c), lambda b: (b, 0))],
        out_specs=pl.BlockSpec((8, c), lambda b: (0, 0)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=tpu.VMEM_LIMIT_BYTES
        ),
        interpret=interpret,
    )(values)


def probe(graph, widths, calls, emit, interpret=False):
    g = load_graph(graph)
    m, e = g.num_nodes, g.num_edges
    dst = np.sort(g.dst)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=m))])
    onehot = sp.csr_array((np.ones(e), (dst, np.arange(e))), shape=(m, e))
    rows_host = tpu.row_of_entry(indptr, int(indptr[-1]))
    rng = np.random.default_rng(0)
    default = tpu.choose_tiling(m, e)
    emit({"graph": g.name, "rows": m, "nnz": e, "default_tiling": str(default)})

    def run(cell, name, fn, *args, check=None):
        try:
            ms = pipelined_ms(jax.jit(fn), args, calls)
            rec = {**cell, "case": name, "ms": round(ms, 4)}
            rec["values_GBps"] = round(cell["bytes"] / ms / 1e6, 1)
            if check is not None:
                out = np.asarray(jax.jit(fn)(*args), np.float64)
                rec["rel_err"] = float(np.abs(out - check).max() / np.abs(check).max())
        except Exception as err:  # one cell must not end the probe
            rec = {**cell, "case": name, "error": f"{type(err).__name__}: {err}"[:600]}
        emit(rec)

    def tiling_cells(cell, v, ref, name, kernel, sizes, bf16=False):
        """``kernel(values, rows, schedule)`` on ``v`` at ``sizes = (block_k, window)``:
        timed and checked against ``ref``, then with every step on one block (its
        arithmetic alone), then (with ``bf16``) on bfloat16 values."""
        bk, w = sizes
        t = tpu.Tiling(bk, min(w, default.block_m), default.block_m)
        plan = tpu.plan_schedule(indptr, t)
        sched = jax.tree.map(jnp.asarray, plan)
        rows = jnp.asarray(tpu.padded_rows(rows_host, t.block_k))
        same = tpu.Schedule(jnp.zeros_like(sched.block), sched.tile, sched.span, t)
        tag = f"k={t.block_k} w={t.window} steps={plan.num_steps}"
        run(cell, f"{name} {tag}", lambda a: kernel(a, rows, sched), v, check=ref)
        run(cell, f"{name} on one block (arithmetic) {tag}", lambda a: kernel(a, rows, same), v)
        if bf16:
            vb = v.astype(jnp.bfloat16)
            half = {**cell, "bytes": cell["bytes"] // 2}
            run(half, f"{name} bf16 {tag}", lambda a: kernel(a, rows, sched), vb)

    stream_blocks = functools.partial(stream, block_rows=STREAM_BLOCK, interpret=interpret)
    row_major = functools.partial(tpu.spmm, num_rows=m, interpret=interpret)
    fm = functools.partial(tpu.spmm_feature_major, num_rows=m, interpret=interpret)

    def feature_major(values, rows, schedule):
        return fm(values.T, rows, schedule)

    for n in widths:
        v64 = rng.uniform(-1, 1, (e, n))
        ref = onehot @ v64
        v = jnp.asarray(v64, jnp.float32)
        cell = {"graph": g.name, "N": n, "bytes": e * n * 4}
        hlo = jax.jit(lambda a: a + 1).lower(v).compile().as_text()
        layout = [ln.strip()[:160] for ln in hlo.splitlines() if "parameter(0)" in ln][:1]
        emit({**cell, "case": "layout of (E, N)", "hlo": layout})
        run(cell, "copy v+1", lambda a: a + 1, v)
        run(cell, "sum over ids jnp.sum(v, 0)", lambda a: jnp.sum(a, 0), v)
        # the windowed kernel, its stream ceiling and its arithmetic alone
        vp = jnp.pad(v, ((0, -(-e // STREAM_BLOCK) * STREAM_BLOCK - e), (0, 0)))
        run(cell, f"stream (E, N) blocks k={STREAM_BLOCK}", stream_blocks, vp)
        for w in (128, 64) if n in (16, 128) else (default.window,):
            tiling_cells(cell, v, ref, "kernel", row_major, (default.block_k, w))
        if n == tpu.LANES:
            continue
        # feature-major: values.T (free: XLA stores narrow arrays column-major)
        for sizes in ((default.block_k, default.window), (1024, 128), (4096, 128), (2048, 256)):
            tiling_cells(cell, v, ref, "feature-major", feature_major, sizes, bf16=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", default="tolokers")
    p.add_argument("--features", default="1,8,16,64,128")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/tmp-probe")
    p.add_argument("--interpret", action="store_true", help="smoke run on CPU")
    args = p.parse_args(argv)
    emit = json_emitter(Path(args.out) / "width_probe.json")
    emit({"jax": jax.__version__, "devices": str(jax.devices())})
    for graph in args.graphs.split(","):
        probe(
            graph,
            [int(w) for w in args.features.split(",")],
            args.calls,
            emit,
            args.interpret,
        )


if __name__ == "__main__":
    main()
