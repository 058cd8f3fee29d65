"""Means divided inside the CPU pull: ``python -m benchmarks.studies.mean_in_kernel``.

``matmul(A, messages, reduce="mean")`` with ``A = CSRMatrix.from_indices(dst, V)`` (a
real graph's destinations as stored, sorted, where the pull runs; or in a random order
(``--orders shuffled``), where the push, the pull through the sort or XLA's scatter
runs, as :func:`jaxcsr.kernels.cpu.choose` says), ``messages (E, N)``, forward,
systems timed in turns:

``in kernel``      the mean as jaxcsr runs it: where the native pull or push runs the
                   sum, the kernel divides each row's float32 sum as it stores it and
                   writes the output in its dtype once
``divided after``  the same kernel's sum in the accumulation dtype (float32), then the
                   division as a separate XLA pass: what the mean ran before
                   (``jaxcsr.ops.product(..., accumulate=True)`` times the reciprocal
                   degrees, rounded once); its output must equal ``in kernel``'s bit for
                   bit
``sum``            ``A @ messages``: the sum alone, in the messages' dtype
``jax.ops``        ``jax.ops.segment_sum`` times the host-computed reciprocal degrees

The first three are timed in turns with each other, then ``in kernel`` and ``jax.ops``
in turns of their own: jax.ops' large float32 temporaries, run between the others,
moved their times by up to 1.4x from run to run (fresh pages, evicted caches).

Writes ``mean_in_kernel.json`` and ``mean_in_kernel.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure, report
from benchmarks.datasets import load_graph
from jaxcsr import CSRMatrix

SYSTEMS = ("in kernel", "divided after", "sum", "jax.ops")


def _systems(A: CSRMatrix, ids, dtype) -> dict:
    """System -> jitted ``messages -> (V, N)``."""
    degree = np.maximum(np.diff(np.asarray(A.indptr)), 1).astype(np.float32)
    reciprocal = jnp.asarray(1 / degree)[:, None]
    num_rows = A.shape[0]

    def divided_after(x):
        total = jaxcsr.ops.product(
            x, None, A.index, reduce="sum", accumulate=True, impl=None, interpret=False
        )
        return (total * reciprocal).astype(dtype)

    def jax_ops(x):
        total = jax.ops.segment_sum(x.astype(jnp.float32), ids, num_rows)
        return (total * reciprocal).astype(dtype)

    return {
        "in kernel": jax.jit(lambda x: jaxcsr.matmul(A, x, reduce="mean")),
        "divided after": jax.jit(divided_after),
        "sum": jax.jit(lambda x: A @ x),
        "jax.ops": jax.jit(jax_ops),
    }


def rows_for(
    name: str, order: str, features: list[int], dtypes: list[str], repeats: int, rng
) -> list[dict]:
    g = load_graph(name)
    dst = np.asarray(g.dst)
    if order == "shuffled":
        dst = dst[np.random.default_rng(1).permutation(dst.shape[0])]
    A = CSRMatrix.from_indices(dst, num_rows=g.num_nodes)
    ids = jnp.asarray(dst, jnp.int32)
    rows = []
    for dtype in dtypes:
        systems = _systems(A, ids, jnp.dtype(dtype))
        for n in features:
            x = jnp.asarray(rng.uniform(-1, 1, (g.num_edges, n)), dtype)
            thunks = {k: functools.partial(f, x) for k, f in systems.items()}
            ours = {k: thunks[k] for k in SYSTEMS[:3]}
            timings, outs = measure.time_in_turns(ours, repeats)
            against = {k: thunks[k] for k in ("in kernel", "jax.ops")}
            peer, peer_outs = measure.time_in_turns(against, repeats)
            timings["jax.ops"], outs["jax.ops"] = peer["jax.ops"], peer_outs["jax.ops"]
            same = np.array_equal(
                np.asarray(outs["in kernel"], np.float32),
                np.asarray(outs["divided after"], np.float32),
            )
            assert same, f"{name} N={n} {dtype}: the two means differ"
            rows.append({
                "graph": name, "order": order, "edges": g.num_edges, "rows": g.num_nodes, "n": n,
                "dtype": dtype, "plan": A.plan_info(n).strategies.get("forward, cpu", ""),
                "ms": {k: t.median_s * 1e3 for k, t in timings.items()},
                "p10_ms": {k: t.p10_s * 1e3 for k, t in timings.items()},
                "vs_jax_ops": peer["jax.ops"].median_s / peer["in kernel"].median_s,
                "difference_vs_jax_ops": measure.largest_relative_error(
                    outs["in kernel"], outs["jax.ops"]
                ),
            })  # fmt: skip
            print(rows[-1], flush=True)
            del x
    return rows


def markdown(result: dict) -> str:
    lines = [
        "### Means divided in the kernel (ms, median of rounds in turns)",
        "",
        f"`{result['command']}` (commit {result['commit']}, {result['date']})",
        "",
        "`after / in`: `divided after`'s time over `in kernel`'s (the same bits, checked; "
        "`in kernel`, `divided after` and `sum` timed in turns); `vs jax.ops`: jax.ops' time "
        "over `in kernel`'s, the two timed in turns of their own (`jax.ops` ms from those).",
        "",
        "| graph | ids | N | dtype | kernel | " + " | ".join(SYSTEMS) + " | after / in "
        "| vs jax.ops |",
        "|---|---|---|---|---|" + "---|" * (len(SYSTEMS) + 2),
    ]
    for r in result["rows"]:
        ms = r["ms"]
        lines.append(
            f"| {r['graph']} ({r['edges']:,} ids) | {r['order']} | {r['n']} | {r['dtype']} "
            f"| {r['plan'].split(' (')[0]} | "
            + " | ".join(f"{ms[k]:.2f}" for k in SYSTEMS)
            + f" | {ms['divided after'] / ms['in kernel']:.2f}x"
            + f" | {r['vs_jax_ops']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.mean_in_kernel",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--graphs", default="tolokers,musae_github", help="comma-separated")
    p.add_argument("--features", default="16,64,256", help="N, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--orders", default="sorted,shuffled", help="ids as stored or shuffled")
    p.add_argument("--repeats", type=int, default=41, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    features = [int(f) for f in args.features.split(",")]
    rows = []
    for name in args.graphs.split(","):
        for order in args.orders.split(","):
            rows += rows_for(name, order, features, args.dtypes.split(","), args.repeats, rng)
    result = {**report.provenance("benchmarks.studies.mean_in_kernel", argv), "rows": rows}
    print(f"wrote {report.write_study(args.out, 'mean_in_kernel', result, markdown(result))}")
    return result


if __name__ == "__main__":
    main()
