"""jraph as a client: jaxcsr's segment functions as a GraphNetwork's aggregations.

jraph passes traced, padded ids every step (``receivers``, the node-to-graph map),
with ``num_segments`` read from a shape. A GraphNetwork with attention built on
``jaxcsr.segment_sum`` / ``jaxcsr.segment_softmax`` must give jraph's own results
and gradients (``jax.ops`` underneath) on padded batches of different molecules, with
one trace for all batches of one padded size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jraph
import numpy as np
from reference import assert_close

import jaxcsr

NODES, EDGES, GRAPHS = 96, 320, 9  # the padded sizes: one compilation for all batches
FEATURES = 8


def _molecule(rng) -> jraph.GraphsTuple:
    """A random molecule-sized graph: a chain (bonds) plus a few rings' closures."""
    n = int(rng.integers(3, 13))
    bonds = [(i, i + 1) for i in range(n - 1)]
    bonds += [tuple(rng.choice(n, 2, replace=False)) for _ in range(int(rng.integers(0, 4)))]
    senders = np.array([a for a, b in bonds] + [b for a, b in bonds], np.int32)
    receivers = np.array([b for a, b in bonds] + [a for a, b in bonds], np.int32)
    return jraph.GraphsTuple(
        nodes=rng.standard_normal((n, FEATURES)).astype(np.float32),
        edges=rng.standard_normal((senders.size, FEATURES)).astype(np.float32),
        senders=senders,
        receivers=receivers,
        globals=np.zeros((1, FEATURES), np.float32),
        n_node=np.array([n], np.int32),
        n_edge=np.array([senders.size], np.int32),
    )


def _padded_batch(rng) -> jraph.GraphsTuple:
    graphs = [_molecule(rng) for _ in range(int(rng.integers(2, GRAPHS)))]
    return jraph.pad_with_graphs(jraph.batch(graphs), NODES, EDGES, GRAPHS)


def _network(segment_sum, segment_softmax, params):
    """A GraphNetwork with GAT-style attention; its aggregations are the arguments."""
    w_edge, w_node, w_global, w_attention = params

    def update_edge(edges, sent, received, globals_):
        return jnp.tanh(jnp.concatenate([edges, sent, received], axis=1) @ w_edge)

    def update_node(nodes, sent, received, globals_):
        return jnp.tanh(jnp.concatenate([nodes, sent, received], axis=1) @ w_node)

    def update_global(nodes, edges, globals_):
        return jnp.concatenate([nodes, edges], axis=1) @ w_global

    def attention_logits(edges, sent, received, globals_):
        return jax.nn.leaky_relu(jnp.concatenate([sent, received], axis=1) @ w_attention)[:, 0]

    return jraph.GraphNetwork(
        update_edge_fn=update_edge,
        update_node_fn=update_node,
        update_global_fn=update_global,
        aggregate_edges_for_nodes_fn=segment_sum,
        aggregate_nodes_for_globals_fn=segment_sum,
        aggregate_edges_for_globals_fn=segment_sum,
        attention_logit_fn=attention_logits,
        attention_normalize_fn=segment_softmax,
        attention_reduce_fn=lambda edges, weights: edges * weights[:, None],
    )


def _loss(params, graph, segment_sum, segment_softmax):
    out = _network(segment_sum, segment_softmax, params)(graph)
    mask = jraph.get_graph_padding_mask(graph)[:, None]
    return jnp.sum(jnp.where(mask, out.globals, 0) ** 2) + jnp.sum(out.nodes**2)


def test_graph_network_with_jaxcsr_aggregations_matches_jraph(rng):
    f = FEATURES
    params = tuple(
        jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
        for shape in [(3 * f, f), (3 * f, f), (2 * f, f), (2 * f, 1)]
    )
    traces = []

    @jax.jit
    def ours(params, graph):
        traces.append(1)
        return jax.value_and_grad(_loss)(params, graph, jaxcsr.segment_sum, jaxcsr.segment_softmax)

    theirs = jax.jit(
        lambda p, g: jax.value_and_grad(_loss)(p, g, jraph.segment_sum, jraph.segment_softmax)
    )
    for _ in range(20):
        graph = _padded_batch(rng)
        loss, grads = ours(params, graph)
        expected_loss, expected_grads = theirs(params, graph)
        assert_close(loss, expected_loss, np.float32)
        for g, e in zip(grads, expected_grads, strict=True):
            assert_close(g, e, np.float32)
    assert len(traces) == 1
