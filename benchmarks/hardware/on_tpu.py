"""TPU benchmark: jaxcsr against jax.ops and BCSR, side by side in one process.

``python -m benchmarks.hardware.on_tpu [--graphs tolokers,musae_github,PATH]
[--features 16,128] [--dtypes float32,bfloat16] [--out DIR] [--deadline S]``
(``benchmarks/hardware/tpu_session.sh`` runs it in one device call, after the compiled
kernel tests). ``--schedule-stats`` prints the kernel's schedule lengths (any machine).

For every graph, feature width ``N`` and dtype, each workload times jaxcsr and its
peers in turns (median of ``--repeats`` calls after two warm-ups, inputs as jit
arguments, matrices closed over), checks jaxcsr's output against the peer's, and
reports the ratio to the best peer. Workloads:

* ``segment``: per-edge values in input order summed by destination (``A @ v`` with
  ``A = from_indices(dst)``) against ``jax.ops.segment_sum`` on the same values and on
  values sorted by destination once (``pre-sorted``, the best a peer can do with a
  static graph); jaxcsr on pre-sorted values too.
* ``max``: the same with max, against ``jax.ops.segment_max``.
* ``traced``: ids as a jit argument (``jaxcsr.segment_sum``), unsorted and sorted
  (``indices_are_sorted=True``), against ``jax.ops.segment_sum`` on the same.
* ``segment grad``: ``grad`` w.r.t. the values of a loss linear in the segment sum;
  the forward is dead code there, so this times the backward alone (a row gather).
* ``spmm`` / ``spmm grad``: GCN's ``Â @ X`` against ``jax.experimental.sparse`` BCSR,
  and its gradient w.r.t. ``X`` (the product with the planned transpose).
* ``softmax``: ``segment_softmax`` against the jax.ops composition (max, exp, sum).
Whole training steps (``--models``, the default; float32; each one jitted forward,
loss, gradient and SGD update):

* ``gcn step`` (once per graph): a two-layer GCN with 128 hidden features on random
  ``(m, 128)`` node features, aggregating with ``Â @ h`` (jaxcsr, BCSR) or
  ``segment_sum(w * h[src], dst)`` (jax.ops).
* ``gat step (8x8)`` (once per graph): a two-layer GAT, 8 heads of 8 features then
  one head, on random ``(m, 64)`` features: ``edge_softmax`` and per-head products
  against the jax.ops composition (:func:`benchmarks.models.gat_step`).
* ``jraph step`` (once per ``tpu.json``): a message-passing step on a padded
  batch of 64 random graphs whose senders and receivers are jit arguments (a new
  batch every step, as jraph trains), ``jaxcsr.segment_sum`` in place of
  ``jax.ops.segment_sum`` with the same arguments.
* ``molecule step`` (once per ``tpu.json``): attention message passing on a jraph
  padded batch of 64 molecules of 10-40 atoms, 64 features, ids as jit arguments
  (:func:`benchmarks.models.molecule_step`).

``copy`` (``v + 1``, read and write) gives the bandwidth the chip reaches in the same
run; the segment rows report jaxcsr's GB/s (values read once, output written once) and
its share of that copy bandwidth. Writes ``tpu.json`` and ``tpu.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks.datasets import load_graph
from benchmarks.models import jraph_step, model_steps, molecule_step
from benchmarks.systems import jax_ops_softmax, jax_sparse_twins
from jaxcsr import CSRMatrix, matmul, segment_softmax, segment_sum


def schedule_stats() -> list[str]:
    """Markdown rows: TPU kernel steps on each embedded graph (host plan only)."""
    from benchmarks.datasets import EMBEDDED
    from jaxcsr import plan
    from jaxcsr.kernels import tpu

    rows = []
    for name in EMBEDDED:
        g = load_graph(name)
        indptr, _ = plan.segment_ids_to_csr(g.dst, g.num_nodes)
        schedule = tpu.plan_schedule(indptr)
        t = schedule.tiling
        blocks = -(-g.num_edges // t.block_k)
        gcn = tpu.plan_schedule(g.normalized_adjacency().indptr).num_steps
        rows.append(
            f"| {name} | {g.num_nodes:,} | {g.num_edges:,} | {t.block_k} / {t.window} | "
            f"{blocks:,} | {schedule.num_steps:,} | {gcn:,} | "
            f"{schedule.num_steps / blocks:.2f} |"
        )
    return rows


def median_ms(fn, args, repeats: int) -> tuple[float, object]:
    out = jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3, out


def rel_err(a, b) -> float:
    """Largest relative difference over the leaves of two outputs (finite entries)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = (np.asarray(jnp.asarray(t, jnp.float32), np.float64) for t in (x, y))
        finite = np.isfinite(y)
        scale = max(1.0, float(np.abs(y[finite]).max(initial=0.0)))
        worst = max(worst, float(np.abs(x[finite] - y[finite]).max(initial=0.0) / scale))
    return worst


def _loss_grad(fn):
    return jax.jit(jax.grad(lambda v, c: jnp.sum(fn(v).astype(jnp.float32) * c)))


def workloads(g, f: int, dtype, rng: np.random.Generator):
    """Yields ``(workload, {system: (fn, args)}, bytes moved by the ideal kernel)``;
    the first system is jaxcsr's, the others are peers."""
    m, e = g.num_nodes, g.num_edges
    order = np.argsort(g.dst, kind="stable")
    A = CSRMatrix.from_indices(g.dst, num_rows=m)
    As = CSRMatrix.from_indices(g.dst[order], num_rows=m)
    dst, dsts = jnp.asarray(g.dst, jnp.int32), jnp.asarray(g.dst[order], jnp.int32)
    v = jnp.asarray(rng.uniform(-1, 1, (e, f)), dtype)
    vs = v[jnp.asarray(order)]
    ct = jnp.asarray(rng.uniform(-1, 1, (m, f)), jnp.float32)
    size = jnp.dtype(dtype).itemsize
    ideal = e * f * size + m * f * size
    yield "copy", {"v + 1": (jax.jit(lambda a: a + 1), (v,))}, 2 * e * f * size
    yield (
        "segment",
        {
            "jaxcsr": (jax.jit(lambda a: A @ a), (v,)),
            "segment_sum": (jax.jit(lambda a: jax.ops.segment_sum(a, dst, m)), (v,)),
            "segment_sum pre-sorted": (
                jax.jit(lambda a: jax.ops.segment_sum(a, dsts, m, indices_are_sorted=True)),
                (vs,),
            ),
        },
        ideal,
    )
    yield (
        "segment pre-sorted",
        {
            "jaxcsr": (jax.jit(lambda a: As @ a), (vs,)),
            "segment_sum pre-sorted": (
                jax.jit(lambda a: jax.ops.segment_sum(a, dsts, m, indices_are_sorted=True)),
                (vs,),
            ),
        },
        ideal,
    )
    yield (
        "max",
        {
            "jaxcsr": (jax.jit(lambda a: matmul(A, a, reduce="max")), (v,)),
            "segment_max": (jax.jit(lambda a: _zero_empty(jax.ops.segment_max(a, dst, m))), (v,)),
            "segment_max pre-sorted": (
                jax.jit(
                    lambda a: _zero_empty(jax.ops.segment_max(a, dsts, m, indices_are_sorted=True))
                ),
                (vs,),
            ),
        },
        ideal,
    )
    yield (
        "traced",
        {
            "jaxcsr": (jax.jit(lambda a, d: segment_sum(a, d, m)), (v, dst)),
            "segment_sum": (jax.jit(lambda a, d: jax.ops.segment_sum(a, d, m)), (v, dst)),
        },
        ideal,
    )
    yield (
        "traced sorted",
        {
            "jaxcsr": (
                jax.jit(lambda a, d: segment_sum(a, d, m, indices_are_sorted=True)),
                (vs, dsts),
            ),
            "segment_sum": (
                jax.jit(lambda a, d: jax.ops.segment_sum(a, d, m, indices_are_sorted=True)),
                (vs, dsts),
            ),
        },
        ideal,
    )
    yield (
        "segment grad",
        {
            "jaxcsr": (_loss_grad(lambda a: A @ a), (v, ct)),
            "segment_sum": (_loss_grad(lambda a: jax.ops.segment_sum(a, dst, m)), (v, ct)),
        },
        2 * ideal,
    )
    adj = g.normalized_adjacency()
    B = CSRMatrix.from_scipy(adj)
    B = B.with_data(B.data.astype(dtype))
    bcsr, _ = jax_sparse_twins(adj, dtype)
    x = jnp.asarray(rng.uniform(-1, 1, (m, f)), dtype)
    yield (
        "spmm",
        {"jaxcsr": (jax.jit(lambda a: B @ a), (x,)), "bcsr": (jax.jit(lambda a: bcsr @ a), (x,))},
        None,
    )
    yield (
        "spmm grad",
        {
            "jaxcsr": (_loss_grad(lambda a: B @ a), (x, ct)),
            "bcsr": (_loss_grad(lambda a: bcsr @ a), (x, ct)),
        },
        None,
    )
    if f <= 16:  # attention heads
        yield (
            "softmax",
            {
                "jaxcsr": (jax.jit(lambda a: segment_softmax(a, dst, m)), (v,)),
                "jax.ops composition": (jax.jit(lambda a: jax_ops_softmax(a, dst, m)), (v,)),
            },
            2 * e * f * size,
        )


def _zero_empty(out):
    return jnp.where(jnp.isfinite(out), out, jnp.zeros((), out.dtype))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule-stats", action="store_true", help="print schedule lengths")
    p.add_argument("--graphs", default="tolokers,musae_github")
    p.add_argument("--features", default="16,128")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/tpu-latest")
    p.add_argument("--deadline", type=float, default=None, help="seconds; stop starting groups")
    p.add_argument("--any-platform", action="store_true", help="smoke run off a TPU")
    p.add_argument("--append", action="store_true", help="add to --out's tpu.json")
    p.add_argument(
        "--workloads",
        default=None,
        help="comma list: run only these per-width workloads (copy always runs)",
    )
    p.add_argument(
        "--models",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="whole training steps: GCN and GAT per graph, jraph and molecule batches once",
    )
    args = p.parse_args(argv)
    if args.schedule_stats:
        print("\n".join(schedule_stats()))
        return
    if jax.default_backend() != "tpu" and not args.any_platform:
        raise SystemExit(f"no TPU: jax backend is {jax.default_backend()!r}")
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if args.append and (out / "tpu.json").exists():
        rows = json.loads((out / "tpu.json").read_text())
    rng = np.random.default_rng(0)
    for graph in args.graphs.split(","):
        g = load_graph(graph)
        for f in (int(w) for w in args.features.split(",")):
            for dtype in (jnp.dtype(d) for d in args.dtypes.split(",")):
                if args.deadline and time.perf_counter() - start > args.deadline:
                    print(f"deadline: skipping {g.name} N={f} {dtype.name}", flush=True)
                    continue
                copy_gbps = None
                groups = workloads(g, f, dtype, rng)
                if args.workloads:
                    keep = {"copy", *args.workloads.split(",")}
                    groups = (group for group in groups if group[0] in keep)
                if args.models and not any(
                    r["graph"] == g.name and r["workload"].startswith("gcn") for r in rows
                ):
                    groups = itertools.chain(groups, model_steps(g, rng))
                if args.models and not any(r["workload"] == "jraph step" for r in rows):
                    groups = itertools.chain(groups, [jraph_step(rng), molecule_step(rng)])
                for workload, systems, nbytes in groups:
                    cell = {
                        "graph": g.name,
                        "rows": g.num_nodes,
                        "nnz": g.num_edges,
                        "features": f,
                        "dtype": dtype.name,
                        "workload": workload,
                    }
                    if workload.endswith("step") or " step " in workload:  # its own sizes
                        cell.update(features="model", dtype="float32")
                    times, outs = {}, {}
                    for name, (fn, fargs) in systems.items():
                        try:
                            times[name], outs[name] = median_ms(fn, fargs, args.repeats)
                        except Exception as err:  # one system must not end the run
                            cell[f"error {name}"] = f"{type(err).__name__}: {err}"[:300]
                    cell["ms"] = {k: round(t, 4) for k, t in times.items()}
                    if workload == "copy" and times:
                        copy_gbps = nbytes / times["v + 1"] / 1e6
                        cell["copy_GBps"] = round(copy_gbps, 1)
                    elif "jaxcsr" in times:
                        peers = {k: t for k, t in times.items() if k != "jaxcsr"}
                        if peers:
                            best = min(peers, key=peers.get)
                            cell["best_peer"] = best
                            cell["speedup"] = round(peers[best] / times["jaxcsr"], 3)
                            cell["rel_err_vs_best_peer"] = rel_err(outs["jaxcsr"], outs[best])
                        if nbytes and copy_gbps:
                            gbps = nbytes / times["jaxcsr"] / 1e6
                            cell["jaxcsr_GBps"] = round(gbps, 1)
                            cell["pct_of_copy"] = round(100 * gbps / copy_gbps, 1)
                    rows.append(cell)
                    print(json.dumps(cell), flush=True)
                    (out / "tpu.json").write_text(json.dumps(rows, indent=1))
    (out / "tpu.md").write_text(table(rows))
    print(table(rows))


def table(rows: list[dict]) -> str:
    lines = [
        "| graph | N | dtype | workload | jaxcsr ms | best peer | peer ms | speedup | "
        "GB/s | % of copy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "speedup" not in r:
            if "copy_GBps" in r:
                lines.append(
                    f"| {r['graph']} | {r['features']} | {r['dtype']} | copy | "
                    f"{r['ms']['v + 1']:.3f} | | | | {r['copy_GBps']} | 100 |"
                )
            continue
        peer = r["best_peer"]
        lines.append(
            f"| {r['graph']} | {r['features']} | {r['dtype']} | {r['workload']} | "
            f"{r['ms']['jaxcsr']:.3f} | {peer} | {r['ms'][peer]:.3f} | {r['speedup']:.2f}x | "
            f"{r.get('jaxcsr_GBps', '')} | {r.get('pct_of_copy', '')} |"
        )
    ratios = [r["speedup"] for r in rows if "speedup" in r]
    if ratios:
        geo = float(np.exp(np.mean(np.log(ratios))))
        lines.append("")
        lines.append(
            f"Geometric mean {geo:.2f}x the best peer over {len(ratios)} cells; "
            f"{sum(x < 1.0 for x in ratios)} below 1.0x."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
