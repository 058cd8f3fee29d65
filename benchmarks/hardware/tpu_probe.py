"""Where the time goes on a TPU: copy, XLA's gather and scatter, the kernel alone.

``python -m benchmarks.hardware.tpu_probe [--graphs tolokers,PATH] [--out DIR]``

For each graph, feature width and dtype, times in one process (median of ``--repeats``
calls after two warm-ups): a copy of the values (``v + 1``: the bandwidth floor), the
XLA gather that puts input-order values in CSR order, ``jax.ops.segment_sum`` on
input-order and on pre-sorted values, the windowed kernel alone on pre-sorted values
for several tilings (sum and max), two stripped kernels that show what a step's
one-hot and its MXU products cost (:func:`stripped`; their outputs are wrong by
design), ``A @ v`` (gather + kernel) and ``max`` against ``jax.ops.segment_max``.
Earlier variants, measured with this probe and removed: a row gather by one DMA per
row (3.5-4x slower than XLA's), float32 at ``Precision.HIGHEST`` (11-25 % slower than
three bfloat16 parts), a per-step finiteness check, and each value block fetched as
2-8 concurrent DMAs (no change; see ``benchmarks/results/tpu-v5e/README.md``).
Kernel results are checked against float64 (sums) and the XLA path (max, bit for
bit). Writes ``probe.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

import jaxcsr
from benchmarks.datasets import load_graph
from benchmarks.hardware.on_tpu import median_ms
from jaxcsr import CSRMatrix
from jaxcsr.kernels import tpu

TILINGS = ((2048, 64), (2048, 128), (4096, 128))
"""``(block_k, window)`` pairs timed for the kernel alone."""


@contextlib.contextmanager
def stripped(part: str):
    """The sum kernel without its one-hot (``part="onehot"``: a constant one) or
    without its MXU products (``part="mxu"``: the one-hot reduced along lanes
    instead), by swapping the kernel module's helper while a product is traced."""
    name = {"onehot": "_onehot", "mxu": "_select"}[part]
    saved = getattr(tpu, name)

    def constant_onehot(rows, base, start, lo, window):
        return jnp.ones((window, rows.shape[1]), jnp.bool_)

    def no_mxu(onehot, values, num_parts):
        hits = jnp.sum(onehot.astype(jnp.float32), axis=1, keepdims=True)
        return hits + values[: onehot.shape[0], :].astype(jnp.float32)

    setattr(tpu, name, constant_onehot if part == "onehot" else no_mxu)
    jax.clear_caches()
    try:
        yield
    finally:
        setattr(tpu, name, saved)
        jax.clear_caches()


def json_emitter(path: Path):
    """``emit(record)``: prints the record as a JSON line and rewrites ``path`` with
    every record so far (a probe cut short keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    records = []

    def emit(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)
        path.write_text(json.dumps(records, indent=1))

    return emit


def probe(graph: str, widths, dtypes, repeats: int, emit, interpret: bool = False) -> None:
    g = load_graph(graph)
    m, e = g.num_nodes, g.num_edges
    order = np.argsort(g.dst, kind="stable")
    dst_sorted = g.dst[order]
    A = CSRMatrix.from_indices(g.dst, num_rows=m, backends=("xla", "pallas_tpu"))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(g.dst, minlength=m))])
    onehot = sp.csr_array((np.ones(e), (g.dst, np.arange(e))), shape=(m, e))
    rng = np.random.default_rng(0)
    dst = jnp.asarray(g.dst, jnp.int32)
    dsts = jnp.asarray(dst_sorted, jnp.int32)
    perm = jnp.asarray(order, jnp.int32)
    base = {"graph": g.name, "rows": m, "nnz": e}
    emit({**base, "default_tiling": str(tpu.choose_tiling(m, e))})

    def cells(f: int, dtype, v64: np.ndarray) -> None:
        v = jnp.asarray(v64, dtype)
        vs = v[perm]
        ref = onehot @ np.asarray(v.astype(jnp.float32), np.float64)
        scale = np.abs(ref).max()
        cell = {**base, "features": f, "dtype": jnp.dtype(dtype).name}
        nbytes = e * f * jnp.dtype(dtype).itemsize

        def run(name, fn, *args, check=None, _cell=cell, _nbytes=nbytes):
            try:
                ms, _ = median_ms(jax.jit(fn), args, repeats)
                rec = {
                    **_cell,
                    "case": name,
                    "ms": round(ms, 4),
                    "values_GBps": round(_nbytes / ms / 1e6, 1),
                }
                if check is not None:
                    rec.update(check(np.asarray(jax.jit(fn)(*args), np.float64)))
            except Exception as err:  # record and go on: one cell must not end the probe
                rec = {**_cell, "case": name, "error": f"{type(err).__name__}: {err}"[:400]}
            emit(rec)

        def sum_err(out):
            return {"rel_err": float(np.abs(out - ref).max() / scale)}

        run("copy v+1", lambda a: a + 1, v)
        run("xla gather v[perm]", lambda a: a[perm], v)
        run(
            "segment_sum input order",
            lambda a: jax.ops.segment_sum(a, dst, m),
            v,
            check=sum_err,
        )
        run(
            "segment_sum pre-sorted",
            lambda a: jax.ops.segment_sum(a, dsts, m, indices_are_sorted=True),
            vs,
            check=sum_err,
        )
        for bk, w in TILINGS:
            t = tpu.Tiling(bk, min(w, tpu.MAX_BLOCK_M), min(tpu.MAX_BLOCK_M, -(-m // 8) * 8))
            sched = jax.tree.map(jnp.asarray, tpu.plan_schedule(indptr, t))
            rows = jnp.asarray(tpu.padded_rows(tpu.row_of_entry(indptr, int(indptr[-1])), bk))
            steps = int(tpu.plan_schedule(indptr, t).num_steps)
            for reduce in ("sum", "max"):
                run(
                    f"{reduce} kernel alone k={bk} w={w} steps={steps}",
                    lambda a, s=sched, r=rows, red=reduce: tpu.spmm(
                        a, r, s, num_rows=m, reduce=red, interpret=interpret
                    ),
                    vs,
                    check=sum_err if reduce == "sum" else None,
                )
        t = tpu.choose_tiling(m, e)
        sched = jax.tree.map(jnp.asarray, tpu.plan_schedule(indptr, t))
        rows = jnp.asarray(tpu.padded_rows(tpu.row_of_entry(indptr, int(indptr[-1])), t.block_k))
        for part in ("onehot", "mxu"):
            with stripped(part):
                run(
                    f"sum kernel without its {part} k={t.block_k} w={t.window}",
                    lambda a: tpu.spmm(a, rows, sched, num_rows=m, interpret=interpret),
                    vs,
                )
        run("A @ v (gather + kernel)", lambda a: A @ a, v, check=sum_err)
        run("A @ v impl=xla", lambda a: jaxcsr.matmul(A, a, impl="xla"), v)
        xla_max = np.asarray(jaxcsr.matmul(A, v, reduce="max", impl="xla"), np.float64)

        def max_same(out):
            return {"max_bits_equal": bool(np.array_equal(out, xla_max))}

        run(
            "max A (gather + kernel)",
            lambda a: jaxcsr.matmul(A, a, reduce="max"),
            v,
            check=max_same,
        )
        run("segment_max input order", lambda a: jax.ops.segment_max(a, dst, m), v)
        run(
            "segment_max pre-sorted",
            lambda a: jax.ops.segment_max(a, dsts, m, indices_are_sorted=True),
            vs,
        )

    for f in widths:
        v64 = rng.uniform(-1, 1, (e, f))
        for dtype in dtypes:
            cells(f, dtype, v64)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", default="tolokers")
    p.add_argument("--features", default="16,128")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results/tmp-probe")
    p.add_argument("--interpret", action="store_true", help="smoke run on CPU")
    args = p.parse_args(argv)
    emit = json_emitter(Path(args.out) / "probe.json")
    emit({"jax": jax.__version__, "devices": str(jax.devices())})
    widths = [int(w) for w in args.features.split(",")]
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
    for graph in args.graphs.split(","):
        probe(graph, widths, dtypes, args.repeats, emit, args.interpret)


if __name__ == "__main__":
    main()
