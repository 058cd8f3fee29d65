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
  against the jax.ops composition (:func:`gat_step`).
* ``jraph step`` (once per ``tpu.json``): a message-passing step on a padded
  batch of 64 random graphs whose senders and receivers are jit arguments (a new
  batch every step, as jraph trains), ``jaxcsr.segment_sum`` in place of
  ``jax.ops.segment_sum`` with the same arguments.
* ``molecule step`` (once per ``tpu.json``): attention message passing on a jraph
  padded batch of 64 molecules of 10-40 atoms, 64 features, ids as jit arguments
  (:func:`molecule_step`).

``copy`` (``v + 1``, read and write) gives the bandwidth the chip reaches in the same
run; the segment rows report jaxcsr's GB/s (values read once, output written once) and
its share of that copy bandwidth. Writes ``tpu.json`` and ``tpu.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import jaxcsr
from benchmarks.datasets import load_graph, padded_molecules
from benchmarks.systems import jax_sparse_twins
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
                "jax.ops composition": (jax.jit(lambda a: _ops_softmax(a, dst, m)), (v,)),
            },
            2 * e * f * size,
        )


def _gcn_step(aggregate, params, x, labels):
    """One SGD step of a two-layer GCN; ``aggregate(h)`` is ``Â @ h``."""

    def loss(p):
        h = jax.nn.relu(aggregate(x @ p["w1"]))
        logits = aggregate(h @ p["w2"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels, axis=1))

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)


def gcn_step(g, adj, rng: np.random.Generator, hidden: int = 128, classes: int = 2):
    """``(workload, systems, None)`` for the GCN training step on graph ``g``."""
    m = g.num_nodes
    coo = adj.tocoo()
    src, dst = jnp.asarray(coo.col, jnp.int32), jnp.asarray(coo.row, jnp.int32)
    w = jnp.asarray(coo.data, jnp.float32)[:, None]
    B = CSRMatrix.from_scipy(adj)
    bcsr, _ = jax_sparse_twins(adj, np.float32)
    params = {
        "w1": jnp.asarray(rng.normal(0, hidden**-0.5, (hidden, hidden)), jnp.float32),
        "w2": jnp.asarray(rng.normal(0, hidden**-0.5, (hidden, classes)), jnp.float32),
    }
    x = jnp.asarray(rng.uniform(-1, 1, (m, hidden)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, classes, (m, 1)), jnp.int32)
    aggregators = {
        "jaxcsr": lambda h: B @ h,
        "jax.ops": lambda h: jax.ops.segment_sum(w * h[src], dst, m),
        "bcsr": lambda h: bcsr @ h,
    }
    systems = {
        name: (jax.jit(lambda p, a=agg: _gcn_step(a, p, x, labels)), (params,))
        for name, agg in aggregators.items()
    }
    return "gcn step", systems, None


def _jraph_batch(rng: np.random.Generator, graphs: int, nodes: int, edges: int):
    """Senders and receivers of ``graphs`` random graphs concatenated (ids offset per
    graph, edges in random order within each), plus one padding graph's node."""
    offsets = np.repeat(np.arange(graphs) * nodes, edges)
    senders = rng.integers(0, nodes, graphs * edges) + offsets
    receivers = rng.integers(0, nodes, graphs * edges) + offsets
    return jnp.asarray(senders, jnp.int32), jnp.asarray(receivers, jnp.int32)


def jraph_step(rng: np.random.Generator, graphs=64, nodes=512, edges=4096, hidden=128):
    """``(workload, systems, None)``: a message-passing training step on a padded
    batch (jraph's ``GraphNetwork`` pattern: edge MLP on sender and receiver
    features, sum to receivers, node MLP), ids as jit arguments."""
    n = graphs * nodes + 1  # jraph pads with one extra node
    senders, receivers = _jraph_batch(rng, graphs, nodes, edges)
    params = {
        "edge": jnp.asarray(rng.normal(0, (2 * hidden) ** -0.5, (2 * hidden, hidden)), jnp.float32),
        "node": jnp.asarray(rng.normal(0, (2 * hidden) ** -0.5, (2 * hidden, hidden)), jnp.float32),
    }
    h = jnp.asarray(rng.uniform(-1, 1, (n, hidden)), jnp.float32)
    target = jnp.asarray(rng.uniform(-1, 1, (n, hidden)), jnp.float32)

    def step(segment, p, s, r):
        def loss(p):
            msg = jax.nn.relu(jnp.concatenate([h[s], h[r]], axis=1) @ p["edge"])
            agg = segment(msg, r, n)
            out = jnp.concatenate([h, agg], axis=1) @ p["node"]
            return jnp.mean((out - target) ** 2)

        value, grads = jax.value_and_grad(loss)(p)
        return value, jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

    systems = {
        name: (jax.jit(functools.partial(step, fn)), (params, senders, receivers))
        for name, fn in (("jaxcsr", segment_sum), ("jax.ops", jax.ops.segment_sum))
    }
    return "jraph step", systems, None


def gat_step(g, rng: np.random.Generator, heads: int = 8, hidden: int = 8, n_in: int = 64):
    """``(workload, systems, None)``: one training step of a two-layer GAT (``heads``
    x ``hidden`` attention, then one head over 2 classes) on random ``(m, n_in)``
    features: jaxcsr's ``edge_softmax`` and per-head products against the jax.ops
    composition (``segment_max``, ``exp``, ``segment_sum``, ``segment_sum`` of the
    weighted messages) on the same edges."""
    m = g.num_nodes
    A = CSRMatrix.from_coo(g.dst, g.src, shape=(m, m))
    order = np.asarray(A.input_order)
    dst, src = jnp.asarray(g.dst[order], jnp.int32), jnp.asarray(g.src[order], jnp.int32)

    def init(shape):
        return jnp.asarray(rng.normal(0, shape[0] ** -0.5, shape), jnp.float32)

    params = {
        "w1": init((n_in, heads * hidden)),
        "a1": init((2, heads, hidden)),
        "w2": init((heads * hidden, 2)),
        "a2": init((2, 1, 2)),
    }
    x = jnp.asarray(rng.uniform(-1, 1, (m, n_in)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 2, (m, 1)), jnp.int32)

    def attend_jaxcsr(wh, scores):
        alpha = jaxcsr.edge_softmax(A, scores)  # (E, H) in A's CSR order
        return jax.vmap(lambda a, v: A.with_data(a) @ v, in_axes=(1, 1), out_axes=1)(alpha, wh)

    def attend_ops(wh, scores):
        peak = jax.ops.segment_max(jax.lax.stop_gradient(scores), dst, m)
        e = jnp.exp(scores - peak[dst])
        alpha = e / jax.ops.segment_sum(e, dst, m)[dst]
        return jax.ops.segment_sum(alpha[:, :, None] * wh[src], dst, m)

    def layer(attend, h, w, a, n_heads):
        wh = (h @ w).reshape(m, n_heads, -1)
        el, er = jnp.sum(wh * a[0], -1), jnp.sum(wh * a[1], -1)
        scores = jax.nn.leaky_relu(el[dst] + er[src], 0.2)
        return attend(wh, scores)

    def step(attend, p):
        def loss(p):
            h = jax.nn.elu(layer(attend, x, p["w1"], p["a1"], heads).reshape(m, -1))
            logits = layer(attend, h, p["w2"], p["a2"], 1)[:, 0, :]
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels, axis=1))

        value, grads = jax.value_and_grad(loss)(p)
        return value, jax.tree.map(lambda w, gr: w - 0.1 * gr, p, grads)

    systems = {
        name: (jax.jit(functools.partial(step, fn)), (params,))
        for name, fn in (("jaxcsr", attend_jaxcsr), ("jax.ops", attend_ops))
    }
    return f"gat step ({heads}x{hidden})", systems, None


MOLECULES, MOLECULE_NODES, MOLECULE_EDGES = 64, 64 * 40 + 64, 64 * 2 * 48
"""The padded molecule batch (:func:`benchmarks.datasets.padded_molecules`): 64 graphs
of 10-40 atoms with 1-8 extra bonds, and room for the padding."""


def molecule_step(rng: np.random.Generator, features: int = 64):
    """``(workload, systems, None)``: a training step of a two-layer attention
    message-passing network on a padded batch of molecules whose ids are jit arguments
    (a jraph batch): per-edge scores, ``segment_softmax`` over receivers, weighted
    ``segment_sum``, then a sum-pool per graph; jaxcsr's functions against jax.ops'
    (the softmax as its composition) with the same arguments."""
    batch = padded_molecules(rng, MOLECULES, (10, 41), (1, 9), MOLECULE_NODES, MOLECULE_EDGES)
    senders, receivers, graph_of_node = (jnp.asarray(a) for a in batch)
    n = MOLECULE_NODES

    def init(shape):
        return jnp.asarray(rng.normal(0, shape[0] ** -0.5, shape), jnp.float32)

    params = [
        {"q": init((features, features)), "k": init((features, features)),
         "msg": init((features, features)), "self": init((features, features))}
        for _ in range(2)
    ]  # fmt: skip
    head = init((features, 1))
    h0 = jnp.asarray(rng.standard_normal((n, features)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((MOLECULES + 1, 1)), jnp.float32)

    def step(segment, softmax, p, s, r, pool):
        def loss(p):
            h = h0
            for layer in p[0]:
                q, k = (h @ layer["q"])[r], (h @ layer["k"])[s]
                alpha = softmax(jnp.sum(q * k, -1, keepdims=True) / 8.0, r, n)
                messages = alpha * jax.nn.relu(h[s] @ layer["msg"])
                h = jax.nn.relu(h @ layer["self"] + segment(messages, r, n))
            pred = segment(h, pool, MOLECULES + 1) @ p[1]
            return jnp.mean((pred[:-1] - target[:-1]) ** 2)

        value, grads = jax.value_and_grad(loss)(p)
        return value, jax.tree.map(lambda w, gr: w - 1e-3 * gr, p, grads)

    args = ((params, head), senders, receivers, graph_of_node)
    systems = {
        "jaxcsr": (jax.jit(functools.partial(step, segment_sum, segment_softmax)), args),
        "jax.ops": (jax.jit(functools.partial(step, jax.ops.segment_sum, _ops_softmax)), args),
    }
    return f"molecule step ({MOLECULES} graphs, N={features})", systems, None


def model_steps(g, rng: np.random.Generator):
    """The whole-step workloads of one graph: GCN (hidden 128) and GAT (8 x 8)."""
    yield gcn_step(g, g.normalized_adjacency(), rng)
    yield gat_step(g, rng)


def _zero_empty(out):
    return jnp.where(jnp.isfinite(out), out, jnp.zeros((), out.dtype))


def _ops_softmax(x, ids, m):
    top = jax.ops.segment_max(x, ids, m)
    ex = jnp.exp(x - top[ids])
    return ex / jax.ops.segment_sum(ex, ids, m)[ids]


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
