"""The last-axis product ``values @ A.T``: ``python -m benchmarks.studies.last_axis``.

``values (N, E)`` scatter-added along their last axis into ``(N, V)`` by
``A = CSRMatrix.from_indices(dst, V)`` (a real graph's destinations, in edge order),
forward and backward (``jax.vjp`` under ``jit``), every system timed in turns:

``feature_major``   ``values @ A.T``: the feature-major product (the native CPU kernels
                    read values as stored, no transpose), on XLA's whole pool
``one_thread``      the same, traced under ``jaxcsr.kernels.cpu.threads(1)``
``transposed``      ``matmul(A, values.T).T``: the row-major product between two
                    ``(E, N)`` transposes (what ``values @ A.T`` ran before)
``jax.ops``         ``jnp.zeros((N, V)).at[:, dst].add(values)``

Writes ``last_axis.json`` and ``last_axis.md`` to ``--out``.
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
from jaxcsr.kernels import cpu

SYSTEMS = ("feature_major", "one_thread", "transposed", "jax.ops")


def _forms(num_nodes: int) -> dict:
    """System -> ``(values, operand) -> (N, V)``; each a new function, so that each is
    traced (and given its thread cap) on its own."""
    return {
        "feature_major": lambda v, A: v @ A.T,
        "one_thread": lambda v, A: v @ A.T,
        "transposed": lambda v, A: jaxcsr.matmul(A, v.T).T,
        "jax.ops": lambda v, ids: jnp.zeros((v.shape[0], num_nodes), v.dtype).at[:, ids].add(v),
    }


def _jitted(fn, pass_: str):
    if pass_ == "fwd":
        return jax.jit(fn)
    return jax.jit(lambda v, ct, op: jax.vjp(lambda v: fn(v, op), v)[1](ct)[0])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.last_axis",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--graph", default="tolokers", help="embedded graph name or .npz path")
    p.add_argument("--features", default="16,64,256", help="N, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    graph = load_graph(args.graph)
    V, E = graph.num_nodes, graph.num_edges
    A = CSRMatrix.from_indices(graph.dst, num_rows=V)
    ids = jnp.asarray(graph.dst, jnp.int32)
    operands = {"feature_major": A, "one_thread": A, "transposed": A, "jax.ops": ids}
    rng = np.random.default_rng(0)
    rows = []
    for dtype in args.dtypes.split(","):
        for n in (int(f) for f in args.features.split(",")):
            values = jnp.asarray(rng.uniform(-1, 1, (n, E)), dtype)
            ct = jnp.asarray(rng.uniform(-1, 1, (n, V)), dtype)
            for pass_ in ("fwd", "bwd"):
                fns = {k: _jitted(f, pass_) for k, f in _forms(V).items()}
                args_of = {
                    k: (values, operands[k]) if pass_ == "fwd" else (values, ct, operands[k])
                    for k in fns
                }
                with cpu.threads(1):  # traced (and compiled) under the cap
                    jax.block_until_ready(fns["one_thread"](*args_of["one_thread"]))
                thunks = {k: functools.partial(fns[k], *args_of[k]) for k in SYSTEMS}
                timings, outs = measure.time_in_turns(thunks, args.repeats)
                want = np.asarray(outs["jax.ops"], np.float32)
                scale = max(1.0, float(np.abs(want).max()))
                errors = {
                    k: float(np.abs(np.asarray(outs[k], np.float32) - want).max() / scale)
                    for k in SYSTEMS
                }
                row = {
                    "pass": pass_,
                    "n": n,
                    "dtype": dtype,
                    "ms": {k: timings[k].median_s * 1e3 for k in SYSTEMS},
                    "rel_error_vs_jax_ops": errors,
                }
                rows.append(row)
                print(
                    f"{pass_} N={n} {dtype}: "
                    + " ".join(f"{k}={v:.2f}ms" for k, v in row["ms"].items()),
                    flush=True,
                )
    result = {"graph": graph.name, "nodes": V, "edges": E, "rows": rows}
    lines = [
        f"# `values @ A.T` on {graph.name} ({E} ids, {V} rows), ms (median, in turns)",
        "",
        "`python -m benchmarks.studies.last_axis` -- `x`: jax.ops' time over the "
        "feature-major product's; threads: one thread's time over all threads'.",
        "",
        "| pass | N | dtype | " + " | ".join(SYSTEMS) + " | vs jax.ops | threads |",
        "|---|---|---|" + "---|" * (len(SYSTEMS) + 2),
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['pass']} | {r['n']} | {r['dtype']} | "
            + " | ".join(f"{ms[k]:.2f}" for k in SYSTEMS)
            + f" | {ms['jax.ops'] / ms['feature_major']:.2f}x"
            + f" | {ms['one_thread'] / ms['feature_major']:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    report.write_study(args.out, "last_axis", result, text)
    print(text)
    return result


if __name__ == "__main__":
    main()
