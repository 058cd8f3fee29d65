"""Whole training steps, jaxcsr against the same model written with jax.ops (or
jraph's composition): the models section of the main job (``python -m benchmarks``)
and of ``benchmarks/hardware/on_tpu.py``.

Each builder returns ``(name, systems, None)``, ``systems`` mapping a system to a
jitted step and its arguments; :func:`run` times the systems of each step in turns
and checks that they agree (the loss each step returns). With ``floor=True`` a
builder adds the system :data:`FLOOR`: the same step with every call jaxcsr replaces
swapped for a stand-in of the same shapes that reduces nothing (a slice, an
elementwise map). Its time is what the step costs without aggregation, so
``jax.ops ms / floor ms`` is the largest speedup a faster aggregation could give.

* ``gcn step``: a two-layer GCN (hidden 128) on a graph's normalised adjacency,
  aggregated by jaxcsr, by ``jax.ops.segment_sum`` of weighted gathered rows, and by
  ``jax.experimental.sparse`` BCSR.
* ``gat step (8x8)``: a two-layer GAT, jaxcsr's ``edge_softmax`` and per-head
  products against the jax.ops composition on the same edges.
* ``jraph step``: jraph's ``GraphNetwork`` pattern on a padded batch of 64 random
  graphs, ids as jit arguments.
* ``molecule step``: attention message passing on a padded batch of 64 molecules of
  10-40 atoms (64 features), ids as jit arguments.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure
from benchmarks.datasets import load_graph, padded_molecules
from benchmarks.systems import jax_ops_softmax, jax_sparse_twins
from jaxcsr import CSRMatrix, segment_softmax, segment_sum

FLOOR = "no aggregation"
"""The stand-in system of a step without its aggregation (not a peer: :func:`run`
reports it as the step's floor)."""


def _no_reduction(values, ids, num_segments):
    """Stand-in for a segment reduction: the first ``num_segments`` rows of ``values``
    (zero-padded), the shape of the sum without reducing anything; ``ids`` unused."""
    del ids
    rows = min(num_segments, values.shape[0])
    pad = [(0, num_segments - rows)] + [(0, 0)] * (values.ndim - 1)
    return jnp.pad(values[:rows], pad)


def _gcn_step(aggregate, params, x, labels):
    """One SGD step of a two-layer GCN; ``aggregate(h)`` is ``Â @ h``."""

    def loss(p):
        h = jax.nn.relu(aggregate(x @ p["w1"]))
        logits = aggregate(h @ p["w2"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels, axis=1))

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)


def gcn_step(g, adj, rng: np.random.Generator, hidden: int = 128, classes: int = 2,
             floor: bool = False):  # fmt: skip
    """``(workload, systems, None)`` for the GCN training step on graph ``g``; with
    ``floor``, also :data:`FLOOR` (``Â @ h`` replaced by ``h``)."""
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
    if floor:
        aggregators[FLOOR] = lambda h: h
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


def jraph_step(rng: np.random.Generator, graphs=64, nodes=512, edges=4096, hidden=128,
               floor: bool = False):  # fmt: skip
    """``(workload, systems, None)``: a message-passing training step on a padded
    batch (jraph's ``GraphNetwork`` pattern: edge MLP on sender and receiver
    features, sum to receivers, node MLP), ids as jit arguments; with ``floor``, also
    :data:`FLOOR`."""
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

    segments = {"jaxcsr": segment_sum, "jax.ops": jax.ops.segment_sum}
    if floor:
        segments[FLOOR] = _no_reduction
    systems = {
        name: (jax.jit(functools.partial(step, fn)), (params, senders, receivers))
        for name, fn in segments.items()
    }
    return "jraph step", systems, None


def gat_attention(g) -> tuple[Any, Any, dict[str, tuple[Any, Any]]]:
    """A GAT's aggregation on graph ``g``: ``(dst, src, systems)`` with ``dst``/``src``
    the edges in the CSR order of ``A = from_coo(dst, src)`` (sorted by destination),
    and ``systems`` mapping ``"jaxcsr"`` and ``"jax.ops"`` to ``(softmax, product)``:
    ``softmax(scores (E, H))`` over each node's incoming edges and ``product(alpha
    (E, H), wh (m, H, F))`` the per-head weighted sums --
    jaxcsr's ``edge_softmax`` and per-head products, and the jax.ops composition
    (``segment_max``, ``exp``, ``segment_sum``, ``segment_sum`` of the weighted
    messages). The models section's GAT step and ``benchmarks.studies.gat_parts``."""
    m = g.num_nodes
    A = CSRMatrix.from_coo(g.dst, g.src, shape=(m, m))
    order = np.asarray(A.input_order)
    dst, src = jnp.asarray(g.dst[order], jnp.int32), jnp.asarray(g.src[order], jnp.int32)

    def product_jaxcsr(alpha, wh):
        return jax.vmap(lambda a, v: A.with_data(a) @ v, in_axes=(1, 1), out_axes=1)(alpha, wh)

    def product_ops(alpha, wh):
        return jax.ops.segment_sum(alpha[:, :, None] * wh[src], dst, m)

    systems = {
        "jaxcsr": (functools.partial(jaxcsr.edge_softmax, A), product_jaxcsr),
        "jax.ops": (lambda s: jax_ops_softmax(s, dst, m), product_ops),
    }
    return dst, src, systems


def gat_step(g, rng: np.random.Generator, heads: int = 8, hidden: int = 8, n_in: int = 64,
             floor: bool = False):  # fmt: skip
    """``(workload, systems, None)``: one training step of a two-layer GAT (``heads``
    x ``hidden`` attention, then one head over 2 classes) on random ``(m, n_in)``
    features, each system aggregating with its pair of :func:`gat_attention` on the
    same edges. With ``floor``, also :data:`FLOOR`: the softmax and products replaced
    by ``wh`` scaled by the mean edge score (so the per-edge score gathers still run)."""
    m = g.num_nodes
    dst, src, aggregations = gat_attention(g)

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

    def attend_with(system):
        softmax, product = aggregations[system]
        return lambda wh, scores: product(softmax(scores), wh)  # scores in A's CSR order

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

    attends = {name: attend_with(name) for name in aggregations}
    if floor:
        attends[FLOOR] = lambda wh, scores: wh * jnp.mean(scores, 0)[:, None]
    systems = {
        name: (jax.jit(functools.partial(step, fn)), (params,)) for name, fn in attends.items()
    }
    return f"gat step ({heads}x{hidden})", systems, None


MOLECULES, MOLECULE_NODES, MOLECULE_EDGES = 64, 64 * 40 + 64, 64 * 2 * 48
"""The padded molecule batch (:func:`benchmarks.datasets.padded_molecules`): 64 graphs
of 10-40 atoms with 1-8 extra bonds, and room for the padding."""


def molecule_step(rng: np.random.Generator, features: int = 64, floor: bool = False):
    """``(workload, systems, None)``: a training step of a two-layer attention
    message-passing network on a padded batch of molecules whose ids are jit arguments
    (a jraph batch): per-edge scores, ``segment_softmax`` over receivers, weighted
    ``segment_sum``, then a sum-pool per graph; jaxcsr's functions against jax.ops'
    (the softmax as its composition) with the same arguments. With ``floor``, also
    :data:`FLOOR` (sums as :func:`_no_reduction`, the softmax as a sigmoid)."""
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
        "jax.ops": (jax.jit(functools.partial(step, jax.ops.segment_sum, jax_ops_softmax)), args),
    }
    if floor:
        stand_in = functools.partial(step, _no_reduction, lambda x, r, n: jax.nn.sigmoid(x))
        systems[FLOOR] = (jax.jit(stand_in), args)
    return f"molecule step ({MOLECULES} graphs, N={features})", systems, None


def model_steps(g, rng: np.random.Generator):
    """The whole-step workloads of one graph: GCN (hidden 128) and GAT (8 x 8)."""
    yield gcn_step(g, g.normalized_adjacency(), rng)
    yield gat_step(g, rng)


MAIN_JOB = {"cora": ("gcn", "gat"), "tolokers": ("gcn",), "planetoid_pubmed": ("gat",)}
"""The main job's models per graph; the padded batches (:data:`BATCHES`) run once."""
BATCHES = ("jraph", "molecule")


def steps(graphs: dict[str, tuple[str, ...]], batches: tuple[str, ...], rng):
    """The steps to run: per graph name, its models (``"gcn"``, ``"gat"``), then the
    padded ``batches`` (``"jraph"``, ``"molecule"``), each with its :data:`FLOOR`.
    Yields ``(graph name, step)``."""
    for name, models in graphs.items():
        g = load_graph(name)
        if "gcn" in models:
            yield g.name, gcn_step(g, g.normalized_adjacency(), rng, floor=True)
        if "gat" in models:
            yield g.name, gat_step(g, rng, floor=True)
    if "jraph" in batches:
        yield "padded batch", jraph_step(rng, floor=True)
    if "molecule" in batches:
        yield "padded batch", molecule_step(rng, floor=True)


def run(
    graphs: dict[str, tuple[str, ...]],
    batches: tuple[str, ...],
    repeats: int,
    seed: int = 0,
    progress=print,
) -> list[dict[str, Any]]:
    """Times every step's systems in turns (medians of ``repeats`` rounds, each system
    stepping from the same parameters): one row per step, with each system's ms, the
    speedup of jaxcsr over each peer, the largest relative loss difference, the
    step's :data:`FLOOR` (``floor_ms``) and ``ceiling``, the speedup over the jax.ops
    model that an aggregation taking no time would give."""
    rows = []
    rng = np.random.default_rng(seed)
    for graph, (name, systems, _) in steps(graphs, batches, rng):
        thunks = {k: functools.partial(fn, *args) for k, (fn, args) in systems.items()}
        timings, outs = measure.time_in_turns(thunks, repeats)
        ms = {k: t.median_s * 1e3 for k, t in timings.items()}
        floor_ms = ms.pop(FLOOR)
        loss = {k: float(out[0]) for k, out in outs.items() if k != FLOOR}
        row = {
            "graph": graph,
            "model": name,
            "ms": ms,
            "speedup": {k: ms[k] / ms["jaxcsr"] for k in ms if k != "jaxcsr"},
            "loss_difference": max(
                abs(v - loss["jaxcsr"]) / max(1.0, abs(loss["jaxcsr"])) for v in loss.values()
            ),
            "floor_ms": floor_ms,
            "ceiling": ms["jax.ops"] / floor_ms,
        }
        rows.append(row)
        shown = ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
        progress(
            f"{graph} {name}: {shown}, {FLOOR} {floor_ms:.2f} ms; "
            f"loss difference {row['loss_difference']:.1e}"
        )
    return rows
