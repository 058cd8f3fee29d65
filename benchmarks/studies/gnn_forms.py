"""Message passing written three ways, one jitted training step each:
``python -m benchmarks.studies.gnn_forms``.

A mean aggregation of neighbour features ``h (V, F)`` over ``E`` random edges
``senders -> receivers``, inside ``jax.value_and_grad`` of a scalar loss:

``jax.ops``        ``segment_sum(h[senders], receivers, V) / degree``
``edge form``      ``jaxcsr.matmul(from_indices(receivers, V), h[senders], reduce="mean")``
``adjacency form`` ``jaxcsr.matmul(from_coo(receivers, senders, shape=(V, V)), h, reduce="mean")``

The adjacency form never materialises the ``(E, F)`` gathered messages: the gather of
``h[senders]`` and the reduction are one CSR product (jaxlib's CPU CSR kernel), and its
backward is the product with the planned transpose. The edge form still gathers
``h[senders]`` and scatters its cotangent back, so it costs about what ``jax.ops`` does.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure
from jaxcsr import CSRMatrix


def main(argv=None) -> dict[str, float]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.gnn_forms",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nodes", type=int, default=100_000, help="V")
    p.add_argument("--edges", type=int, default=1_000_000, help="E")
    p.add_argument("--features", type=int, default=64, help="F")
    p.add_argument("--repeats", type=int, default=10, help="timed steps (median)")
    args = p.parse_args(argv)
    V, E, F = args.nodes, args.edges, args.features
    rng = np.random.default_rng(0)
    senders = rng.integers(0, V, E).astype(np.int32)
    receivers = rng.integers(0, V, E).astype(np.int32)
    h = jnp.asarray(rng.standard_normal((V, F)).astype(np.float32))
    degree = jnp.asarray(np.maximum(np.bincount(receivers, minlength=V), 1), jnp.float32)
    s, r = jnp.asarray(senders), jnp.asarray(receivers)
    by_edge = CSRMatrix.from_indices(receivers, V)
    adjacency = CSRMatrix.from_coo(receivers, senders, shape=(V, V))

    def jax_ops(h):
        return jax.ops.segment_sum(h[s], r, V) / degree[:, None]

    def edge_form(h):
        return jaxcsr.matmul(by_edge, h[s], reduce="mean")

    def adjacency_form(h):
        return jaxcsr.matmul(adjacency, h, reduce="mean")

    forms = {"jax.ops": jax_ops, "edge form": edge_form, "adjacency form": adjacency_form}
    times, outputs = {}, {}
    for name, agg in forms.items():
        step = jax.jit(jax.value_and_grad(lambda h, agg=agg: jnp.sum(jnp.tanh(agg(h)) ** 2)))
        timing, outputs[name] = measure.time_thunk(lambda step=step: step(h), args.repeats)
        times[name] = timing.median_s
    reference = outputs["jax.ops"]
    print(f"V={V:,} E={E:,} F={F}, jitted value_and_grad step, median of {args.repeats}")
    for name, t in times.items():
        err = float(jnp.max(jnp.abs(outputs[name][1] - reference[1])))
        print(
            f"  {name:>15}: {1e3 * t:8.1f} ms  ({times['jax.ops'] / t:.2f}x jax.ops; "
            f"max |grad diff| {err:.1e})"
        )
    return times


if __name__ == "__main__":
    main()
