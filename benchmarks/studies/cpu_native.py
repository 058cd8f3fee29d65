"""The native CPU backend against the peers, in one run:
``python -m benchmarks.studies.cpu_native``.

For each graph, width F and dtype, four products, every system timed in turns:

* ``segment``: ``segment_sum`` of per-edge values (``K x F``, edge order) by receiver:
  jaxcsr (native kernels, all threads and one thread), jaxcsr's XLA path,
  ``jax.ops.segment_sum``, torch ``index_add_``.
* ``segment_sorted``: the same values and ids reordered once by
  :func:`jaxcsr.segment_order`: jaxcsr vs ``segment_sum(..., indices_are_sorted=True)``
  and torch ``index_add_``.
* ``segment_shuffled``: the same edges in a random order (one permutation, seed 0):
  an edge list with no locality, where a row owner skipping other rows' ids would
  mispredict a branch per id.
* ``spmm`` / ``spmm_T``: the GCN-normalised adjacency (``A @ X`` and ``A.T @ G``, the
  backward): jaxcsr (native, one thread), jaxcsr's XLA path (jaxlib's CSR kernel),
  ``jax.experimental.sparse`` BCSR, scipy (float32) and torch ``sparse_csr`` mm.

Every cell reports the achieved GB/s of jaxcsr and its share of the copy bandwidth
measured in the same process (:func:`benchmarks.measure.memory_bandwidth`), counting
the floor's bytes: the dense operand read once, the output written once and the
index arrays (4 B per id; CSR: 4 B per entry and per row) read once; and jaxcsr on all
threads against one twice: in turns with the peers (whose calls let the pool's threads
fall asleep and evict the operands) and the two alone, next to how far a plain copy's
bandwidth scales over the same threads (:func:`benchmarks.measure.copy_bandwidth_by_threads`),
and what a jitted ``x + 1`` costs (:func:`benchmarks.measure.dispatch_floor`), the
floor under the smallest cells. torch runs
with ``OMP_WAIT_POLICY=PASSIVE`` (see :mod:`benchmarks`). Writes ``cpu_native.json``
and ``cpu_native.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import report
from benchmarks.datasets import load_graph
from benchmarks.measure import (
    copy_bandwidth_by_threads,
    dispatch_floor,
    memory_bandwidth,
    time_in_turns,
    to_numpy,
)
from jaxcsr import CSRMatrix
from jaxcsr.kernels import cpu

OURS = ("jaxcsr", "jaxcsr_1_thread", "jaxcsr_xla")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _systems(kind, graph, f, dtype, rng, torch):
    """``{name: thunk}`` for one cell, plus the bytes of the floor."""
    m = graph.num_nodes
    itemsize = np.dtype(dtype).itemsize
    matmul = jax.jit(lambda A, x: A @ x)
    xla = jax.jit(lambda A, x: jaxcsr.matmul(A, x, impl="xla"))
    one = jax.jit(lambda A, x: jaxcsr.matmul(A, x, impl="cpu"))  # traced under threads(1)
    if kind.startswith("segment"):
        ids = graph.dst.astype(np.int32)
        values = rng.standard_normal((ids.size, f)).astype(np.float32)
        if kind == "segment_sorted":
            perm = jaxcsr.segment_order(ids, m)
            ids, values = ids[perm], values[perm]
        elif kind == "segment_shuffled":
            perm = np.random.default_rng(0).permutation(ids.size)
            ids, values = ids[perm], values[perm]
        v = jnp.asarray(values, dtype)
        A = CSRMatrix.from_indices(ids, m)
        jids = jnp.asarray(ids)
        sorted_ = kind == "segment_sorted"
        ops = jax.jit(lambda v, i: jax.ops.segment_sum(v, i, m, indices_are_sorted=sorted_))
        with cpu.threads(1):
            jax.block_until_ready(one(A, v))  # compiled with one thread
        thunks = {
            "jaxcsr": lambda: matmul(A, v),
            "jaxcsr_1_thread": lambda: one(A, v),
            "jaxcsr_xla": lambda: xla(A, v),
            "jax.ops": lambda: ops(v, jids),
        }
        if torch is not None:
            tv = torch.from_numpy(values).to(_torch_dtype(torch, dtype))
            tids = torch.from_numpy(ids.astype(np.int64))

            def index_add():
                out = torch.zeros((m, f), dtype=tv.dtype)
                return out.index_add_(0, tids, tv)

            thunks["torch_index_add"] = index_add
        floor = ids.size * f * itemsize + m * f * itemsize + 4 * ids.size
        return thunks, floor
    mat = graph.normalized_adjacency().tocsr().astype(np.float32)
    if kind == "spmm_T":
        mat = mat.T.tocsr()
    x_np = rng.standard_normal((mat.shape[1], f)).astype(np.float32)
    x = jnp.asarray(x_np, dtype)
    A = CSRMatrix.from_scipy(mat)
    A = A.with_data(A.data.astype(dtype))
    from jax.experimental import sparse

    bcsr = sparse.BCSR.from_scipy_sparse(mat)
    bcsr = sparse.BCSR((bcsr.data.astype(dtype), bcsr.indices, bcsr.indptr), shape=bcsr.shape)
    bcsr_fn = jax.jit(lambda B, x: B @ x)
    with cpu.threads(1):
        jax.block_until_ready(one(A, x))
    thunks = {
        "jaxcsr": lambda: matmul(A, x),
        "jaxcsr_1_thread": lambda: one(A, x),
        "jaxcsr_xla": lambda: xla(A, x),
        "bcsr": lambda: bcsr_fn(bcsr, x),
    }
    if np.dtype(dtype) == np.float32:
        thunks["scipy"] = lambda: mat @ x_np
    if torch is not None:
        tdtype = _torch_dtype(torch, dtype)
        tmat = torch.sparse_csr_tensor(
            torch.from_numpy(mat.indptr.astype(np.int64)),
            torch.from_numpy(mat.indices.astype(np.int64)),
            torch.from_numpy(mat.data).to(tdtype),
            size=mat.shape,
        )
        tx = torch.from_numpy(x_np).to(tdtype)
        thunks["torch_sparse_csr"] = lambda: tmat @ tx
    m, n = mat.shape
    floor = (n + m) * f * itemsize + mat.nnz * (4 + itemsize) + 4 * (m + 1)
    return thunks, floor


def _torch_dtype(torch, dtype):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[np.dtype(dtype).name]


def run_cell(kind, graph, f, dtype, repeats, copy_gbps, rng, torch, min_time_s=0.0) -> dict:
    thunks, floor = _systems(kind, graph, f, dtype, rng, torch)
    # at least ``repeats`` rounds, more until they took ``min_time_s`` (at most 15x)
    rounds = dict(repeats=repeats, min_time_s=min_time_s, max_repeats=15 * repeats)
    try:
        timings, outs = time_in_turns(thunks, **rounds)
    except Exception as err:  # a peer without this dtype: time the others
        print(f"  {kind}: {err!r}; timing without failing systems", flush=True)
        for name in list(thunks):
            try:
                jax.block_until_ready(thunks[name]())
            except Exception:
                del thunks[name]
        timings, outs = time_in_turns(thunks, **rounds)
    # jaxcsr on all threads and on one, the two alone in turns: between the peers' calls
    # the pool's threads fall asleep and the operands leave the caches
    alone, _ = time_in_turns({k: thunks[k] for k in ("jaxcsr", "jaxcsr_1_thread")}, **rounds)
    ref = to_numpy(outs["jaxcsr_xla"]).astype(np.float64)
    scale = max(1.0, float(np.abs(ref).max()))
    row = {"kind": kind, "graph": graph.name, "features": f, "dtype": np.dtype(dtype).name}
    row["ms"] = {k: t.median_s * 1e3 for k, t in timings.items()}
    row["max_abs_diff_vs_xla_path"] = {
        k: float(np.abs(to_numpy(o).astype(np.float64) - ref).max() / scale)
        for k, o in outs.items()
    }
    peers = {k: v for k, v in row["ms"].items() if k not in OURS}
    best = min(peers, key=peers.get)
    ours = row["ms"]["jaxcsr"]
    row["best_peer"] = best
    row["vs_best_peer"] = peers[best] / ours
    row["vs_xla_path"] = row["ms"]["jaxcsr_xla"] / ours
    row["threads_speedup"] = row["ms"]["jaxcsr_1_thread"] / ours
    row["threads_speedup_alone"] = alone["jaxcsr_1_thread"].median_s / alone["jaxcsr"].median_s
    row["floor_bytes"] = int(floor)
    row["gbps"] = floor / (ours / 1e3) / 1e9
    row["pct_of_copy"] = 100 * row["gbps"] / copy_gbps
    return row


def markdown(result: dict) -> str:
    bw = result["bandwidth"]
    lines = [
        f"### Native CPU backend vs peers ({result['threads']} threads; copy bandwidth "
        f"{bw['copy_gbps']:.1f} GB/s, read {bw['read_gbps']:.1f} GB/s, measured in the run)",
        "",
        f"ms are medians of at least {result['repeats']} rounds, more until a timing's "
        f"rounds took {result['min_time_s']:g} s (at most {15 * result['repeats']}); "
        "`vs best peer` = best peer's time / jaxcsr's; `1 -> all threads` = jaxcsr on "
        "one thread / on all, timed in turns with the peers; `alone` = the "
        "same two timed in turns by themselves; GB/s counts the floor's bytes.",
        "",
        "| product | graph | F | dtype | jaxcsr ms | 1 thread ms | xla path ms | best peer "
        "| peer ms | vs best peer | 1 -> all threads | alone | GB/s | % of copy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ms = r["ms"]
        lines.append(
            f"| {r['kind']} | {r['graph']} | {r['features']} | {r['dtype']} | "
            f"{ms['jaxcsr']:.2f} | {ms['jaxcsr_1_thread']:.2f} | {ms['jaxcsr_xla']:.2f} | "
            f"{r['best_peer']} | {ms[r['best_peer']]:.2f} | {r['vs_best_peer']:.2f}x | "
            f"{r['threads_speedup']:.2f}x | {r['threads_speedup_alone']:.2f}x | "
            f"{r['gbps']:.1f} | {r['pct_of_copy']:.0f} |"
        )
    v = report.ratio_summary([r["vs_best_peer"] for r in result["rows"]])
    if v["cells"]:
        lines += [
            "",
            f"Geometric mean vs best peer: {v['geomean']:.2f}x over {v['cells']} cells; "
            f"{v['below_1']} cells below 1.0x, {v['at_least_1_3']} at or above 1.3x.",
        ]
    copy = result["copy_by_threads"]
    gbps = ", ".join(f"{t} thread(s) {g:.1f} GB/s" for t, g in copy.items())
    lines += ["", f"A copy split over threads (numpy, same process): {gbps}."]
    if "dispatch_ms" in result:
        lines.append(
            f"A jitted `x + 1` on 1000 floats takes {result['dispatch_ms']:.3f} ms: the "
            "floor of any call of a jitted function here, which jaxcsr, its XLA path, "
            "`jax.ops` and BCSR pay and scipy and torch do not."
        )
    wide = [r for r in result["rows"] if r["features"] >= 16]
    if wide:
        keys = ("threads_speedup", "threads_speedup_alone")
        counts = [sum(r[key] >= 1.6 for r in wide) for key in keys]
        geomeans = [float(np.exp(np.mean([np.log(r[key]) for r in wide]))) for key in keys]
        lines.append(
            f"1 -> all threads at F >= 16 ({len(wide)} cells): in turns with the peers "
            f"{counts[0]} at or above 1.6x (geometric mean {geomeans[0]:.2f}x); timed alone "
            f"{counts[1]} ({geomeans[1]:.2f}x)."
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", default="tolokers,musae_github,planetoid_pubmed")
    p.add_argument("--kinds", default="segment,segment_sorted,segment_shuffled,spmm,spmm_T")
    p.add_argument("--features", default="1,16,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds at least")
    p.add_argument(
        "--min-time",
        type=float,
        default=1.0,
        help="seconds of timed rounds per timing (in turns, and alone): more rounds "
        "until they took this long, at most 15x --repeats",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    if not cpu.available():
        raise SystemExit("the native CPU library is not built: pip install -e . with a compiler")
    torch = _torch()
    bandwidth = memory_bandwidth(512)
    copy_by_threads = copy_bandwidth_by_threads((1, os.cpu_count() or 1))
    dispatch_ms = dispatch_floor()
    print(f"a jitted x + 1 on 1000 floats: {dispatch_ms:.3f} ms")
    print(f"copy bandwidth {bandwidth['copy_gbps']:.1f} GB/s; by threads {copy_by_threads}")
    rng = np.random.default_rng(0)
    rows = []
    for name in args.graphs.split(","):
        graph = load_graph(name)
        for kind in args.kinds.split(","):
            for f in [int(v) for v in args.features.split(",")]:
                for dtype in args.dtypes.split(","):
                    dt = jnp.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
                    row = run_cell(kind, graph, f, dt, args.repeats, bandwidth["copy_gbps"],
                                   rng, torch, args.min_time)  # fmt: skip
                    rows.append(row)
                    print(
                        f"{kind} {name} F={f} {dtype}: jaxcsr {row['ms']['jaxcsr']:.2f} ms, "
                        f"{row['vs_best_peer']:.2f}x vs {row['best_peer']}, "
                        f"{row['threads_speedup']:.2f}x from threads, {row['gbps']:.1f} GB/s",
                        flush=True,
                    )
    result = {
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "bandwidth": bandwidth,
        "copy_by_threads": copy_by_threads,
        "dispatch_ms": dispatch_ms,
        "threads": os.cpu_count(),
        "repeats": args.repeats,
        "min_time_s": args.min_time,
        "rows": rows,
        "command": report.command_line("benchmarks.studies.cpu_native", argv),
    }
    print(f"wrote {report.write_study(args.out, 'cpu_native', result, markdown(result))}")
    return result


if __name__ == "__main__":
    main()
