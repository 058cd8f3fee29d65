"""Crossovers of the XLA path's CPU strategies: ``python -m benchmarks.studies.strategies``.

Times every strategy that can run a structure (:data:`jaxcsr.kernels.xla.STRATEGIES`)
at each feature width, forward product only, float32, on real graphs -- the data
behind :func:`jaxcsr.kernels.xla.choose_strategy`'s thresholds. Segment ids come in
the graph's own order (``unsorted`` unless the file stores them sorted) and sorted;
``general`` is the adjacency ``A[dst, src]``. Writes ``strategies.json`` and
``strategies.md`` to ``--out``; the ``chosen`` column is what jaxcsr runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure
from benchmarks.datasets import load_graph
from jaxcsr import CSRMatrix
from jaxcsr.kernels import xla as xla_kernels


def _structures(graph):
    """(label, matrix, strategies that can run it) for one graph."""
    ids = graph.dst
    yield (
        "segment ids, sorted",
        CSRMatrix.from_indices(np.sort(ids), graph.num_nodes),
        (
            "scatter",
            "csr_kernel",
        ),
    )
    if np.any(np.diff(ids) < 0):
        yield (
            "segment ids, unsorted",
            CSRMatrix.from_indices(ids, graph.num_nodes),
            (
                "scatter",
                "csr_kernel",
            ),
        )
    yield "general (adjacency)", CSRMatrix.from_scipy(graph.adjacency()), ("csr_kernel", "segment")


def run(graphs, widths, repeats: int, max_elements: float) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for name in graphs:
        graph = load_graph(name)
        for label, A, strategies in _structures(graph):
            s = A.structure
            for f in widths:
                if A.shape[1] * f > max_elements:
                    continue
                x = jnp.asarray(rng.standard_normal((A.shape[1], f), dtype=np.float32))
                times = {}
                for strategy in strategies:
                    fn = jax.jit(
                        lambda x, A, strategy=strategy: xla_kernels.spmm(
                            x, A.data, A.structure, strategy=strategy
                        )
                    )
                    timing, _ = measure.time_thunk(lambda fn=fn, x=x, A=A: fn(x, A), repeats)
                    times[strategy] = timing.median_s
                chosen = xla_kernels.choose_strategy(s, on_cpu=True, width=f)
                rows.append(
                    {
                        "graph": graph.name,
                        "structure": label,
                        "nnz": A.nnz,
                        "width": f,
                        "median_s": times,
                        "chosen": chosen,
                        "chosen_is_fastest": chosen == min(times, key=times.get),
                    }
                )
                best = min(times, key=times.get)
                cells = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
                print(f"{graph.name} {label} F={f}: {cells} -> chosen {chosen} (fastest {best})")
                del x
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| graph | structure | F | scatter | csr_kernel | segment | chosen | fastest? |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        t = r["median_s"]
        cell = [f"{t[k] * 1e3:.2f}" if k in t else "" for k in ("scatter", "csr_kernel", "segment")]
        ok = "yes" if r["chosen_is_fastest"] else "no"
        lines.append(
            f"| {r['graph']} | {r['structure']} | {r['width']} | {' | '.join(cell)} "
            f"| {r['chosen']} | {ok} |"
        )
    return "\n".join(lines) + "\n\nTimes in ms (median), forward product, float32.\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.strategies", description=__doc__)
    p.add_argument("--graphs", default="tolokers,musae_github", help="comma-separated")
    p.add_argument("--widths", default="1,2,4,8,16,32,64,128,256", help="comma-separated")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-elements", type=float, default=4e8, help="skip larger operands")
    p.add_argument("--out", type=Path, default=None, help="folder for strategies.json/.md")
    args = p.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",") if w]
    rows = run(args.graphs.split(","), widths, args.repeats, args.max_elements)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "strategies.json").write_text(json.dumps(rows, indent=1))
        (args.out / "strategies.md").write_text(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
