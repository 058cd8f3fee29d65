"""Where a GAT layer's aggregation time goes: ``python -m benchmarks.studies.gat_parts``.

The models section times whole GAT steps; this study times the parts of one layer's
aggregation that jaxcsr replaces, each jitted on its own, against the same part of
the jax.ops formulation the models section uses (``segment_max``, ``exp``,
``segment_sum``, and ``segment_sum`` of ``alpha * wh[src]``), systems in turns:

``softmax``  ``edge_softmax`` forward; ``softmax fwd+bwd`` its value and VJP.
``product``  the per-head product ``A.with_data(alpha[:, h]) @ wh[:, h]`` (``vmap``
    over heads), forward; ``grad alpha`` the attention values' gradient (the native
    SDDMM with one value per head) and ``grad wh`` the features' (the planned
    transpose's pull through the values' permutation).
``layer``  the softmax and product together, both gradients.

Edges in the CSR order of ``A = from_coo(dst, src)`` (sorted by destination), as the
models section's GAT. Each row checks jaxcsr against jax.ops (largest relative
difference). Writes ``gat_parts.json`` and ``gat_parts.md`` to ``--out``.
``JAXCSR_CPU_LIBRARY`` runs another build of the kernels (a before/after pair).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure, models, report
from benchmarks.datasets import load_graph

SYSTEMS = ("jaxcsr", "jax.ops")
PARTS = ("softmax", "softmax fwd+bwd", "product", "grad alpha", "grad wh", "layer")


def _parts(systems: dict) -> dict[str, dict]:
    """Part -> system -> ``f(scores, wh, ct_edges, ct_nodes)``, from each system's
    ``(softmax, product)`` (:func:`benchmarks.models.gat_attention`)."""

    def cell(softmax, product):
        return {
            "softmax": lambda s, wh, ce, cn: softmax(s),
            "softmax fwd+bwd": lambda s, wh, ce, cn: jax.vjp(softmax, s)[1](ce),
            "product": lambda s, wh, ce, cn: product(s, wh),
            "grad alpha": lambda s, wh, ce, cn: jax.vjp(lambda a: product(a, wh), s)[1](cn),
            "grad wh": lambda s, wh, ce, cn: jax.vjp(lambda v: product(s, v), wh)[1](cn),
            "layer": lambda s, wh, ce, cn: jax.vjp(lambda s, v: product(softmax(s), v), s, wh)[1](
                cn
            ),
        }

    by_system = {name: cell(*pair) for name, pair in systems.items()}
    return {part: {k: by_system[k][part] for k in SYSTEMS} for part in PARTS}


def rows_for(name: str, heads: int, features: int, repeats: int, rng) -> list[dict]:
    g = load_graph(name)
    dst, _, systems = models.gat_attention(g)
    m, e = g.num_nodes, dst.shape[0]
    args = (
        jnp.asarray(rng.standard_normal((e, heads)), jnp.float32),
        jnp.asarray(rng.standard_normal((m, heads, features)), jnp.float32),
        jnp.asarray(rng.standard_normal((e, heads)), jnp.float32),
        jnp.asarray(rng.standard_normal((m, heads, features)), jnp.float32),
    )
    rows = []
    for part, by_system in _parts(systems).items():
        thunks = {k: functools.partial(jax.jit(f), *args) for k, f in by_system.items()}
        timings, outs = measure.time_in_turns(thunks, repeats)
        rows.append({
            "graph": name, "edges": e, "heads": heads, "features": features, "part": part,
            "ms": {k: t.median_s * 1e3 for k, t in timings.items()},
            "difference": measure.largest_relative_error(outs["jaxcsr"], outs["jax.ops"]),
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [
        "### A GAT layer's aggregation, part by part (ms, median; jax.ops / jaxcsr)",
        "",
        f"`{result['command']}` (commit {result['commit']}, {result['date']})",
        "",
        "| graph | heads x features | part | jaxcsr ms | jax.ops ms | speedup | difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ms = r["ms"]
        lines.append(
            f"| {r['graph']} ({r['edges']:,} edges) | {r['heads']} x {r['features']} | {r['part']} "
            f"| {ms['jaxcsr']:.3f} | {ms['jax.ops']:.3f} | {ms['jax.ops'] / ms['jaxcsr']:.2f}x "
            f"| {r['difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.gat_parts",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--graphs", default="cora,planetoid_pubmed", help="comma-separated")
    p.add_argument("--layers", default="8x8,1x2", help="heads x features, comma-separated")
    p.add_argument("--repeats", type=int, default=41, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.graphs.split(","):
        for layer in args.layers.split(","):
            heads, features = (int(v) for v in layer.split("x"))
            rows += rows_for(name, heads, features, args.repeats, rng)
    result = {**report.provenance("benchmarks.studies.gat_parts", argv), "rows": rows}
    print(f"wrote {report.write_study(args.out, 'gat_parts', result, markdown(result))}")
    return result


if __name__ == "__main__":
    main()
