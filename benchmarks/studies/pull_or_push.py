"""Pull or push for unsorted ids: ``python -m benchmarks.studies.pull_or_push``.

Unsorted segment ids planned on the host run the pull (through the planned sort) or
the push (:func:`jaxcsr.kernels.cpu.choose`). Where the push takes one piece
(:func:`jaxcsr.kernels.cpu.push_pieces`) both reduce each row in input order (except
for one feature, where the pull sums in eight lanes); in 2 or 4 pieces the push
reduces in piece order. This study times both on the same cells, in turns
(``cpu.unsorted_kernel`` pins each), with XLA's scatter (``impl="xla"``, the loop
``jax.ops.segment_sum`` runs, which adds in input order too), and checks their bits
against each other and their error against float64: the embedded graphs with their ids shuffled and
synthetic uniform ids. ``--pieces`` keeps the cells of some piece counts only.
Writes ``pull_or_push.json`` and ``pull_or_push.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure, report
from benchmarks.datasets import shuffled_and_uniform_ids
from jaxcsr import CSRMatrix, machine, matmul
from jaxcsr.kernels import cpu


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.pull_or_push",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--graphs", default="tolokers,musae_github,planetoid_pubmed")
    p.add_argument(
        "--synthetic",
        default="90000/20000,300000/100000,400000/20000,1000000/400000",
        help="uniform random ids as IDS/ROWS, comma-separated",
    )
    p.add_argument("--features", default="16,64,256", help="N, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--pieces", default="1,2,4", help="the push's piece counts to time")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    if not cpu.available():
        raise SystemExit("the native CPU kernels are not built: nothing to compare")
    rng = np.random.default_rng(0)
    rows = []
    synthetic = [v for v in args.synthetic.split(",") if v]
    graphs = [g for g in args.graphs.split(",") if g]
    for label, ids, m in shuffled_and_uniform_ids(graphs, synthetic, rng):
        A = CSRMatrix.from_indices(ids, num_rows=m)
        for dtype in args.dtypes.split(","):
            itemsize = np.dtype(jnp.dtype(dtype)).itemsize
            for n in (int(f) for f in args.features.split(",")):
                pieces = cpu.push_pieces(m, len(ids), n, itemsize)
                if str(pieces) not in args.pieces.split(","):
                    continue
                x = jnp.asarray(rng.uniform(-1, 1, (len(ids), n)), dtype)
                fns = {}
                for kernel in ("pull", "push"):
                    with cpu.unsorted_kernel(kernel):  # read when traced
                        fns[kernel] = jax.jit(lambda A, x: A @ x)
                        jax.block_until_ready(fns[kernel](A, x))
                fns["xla"] = jax.jit(lambda A, x: matmul(A, x, impl="xla"))
                thunks = {k: functools.partial(f, A, x) for k, f in fns.items()}
                timings, outs = measure.time_in_turns(thunks, args.repeats)
                want = measure.segment_sum_f64(x, ids, m)
                bits = {k: np.asarray(o).view(np.uint8) for k, o in outs.items()}
                same = {k: bool(np.array_equal(bits[k], bits["push"])) for k in ("pull", "xla")}
                row = {
                    "structure": label,
                    "rows": m,
                    "ids": len(ids),
                    "n": n,
                    "dtype": dtype,
                    "pieces": pieces,
                    "output_mib": m * n * 4 / 2**20,
                    "ms": {k: t.median_s * 1e3 for k, t in timings.items()},
                    "same_bits": same,
                    "max_abs_error": {k: measure.max_abs_error(o, want) for k, o in outs.items()},
                }
                rows.append(row)
                print(
                    f"{label} N={n} {dtype} {pieces} piece(s): pull {row['ms']['pull']:.2f} "
                    f"ms, push {row['ms']['push']:.2f} ms, xla {row['ms']['xla']:.2f} ms, "
                    f"same bits as the push {same}",
                    flush=True,
                )
    result = {
        "command": report.command_line("benchmarks.studies.pull_or_push", argv),
        "machine": machine.profile().summary(),
        "rows": rows,
    }
    lines = [
        "# Unsorted ids: pull, push and XLA's scatter (ms, median, in turns)",
        "",
        f"`{result['command']}` on {result['machine']}. Pieces: the push's; xla: XLA's",
        'scatter (`impl="xla"`); xla / kernels: its time over the faster kernel\'s (below 1:',
        "the scatter faster); same bits: the pull's and the scatter's output against the",
        "push's; max error: the largest absolute difference from float64 (pull / push / xla).",
        "",
        "| structure | rows | ids | N | dtype | pieces | output MiB | pull | push | xla "
        "| push / pull | xla / kernels | same bits (pull, xla) | max error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms, err, same = r["ms"], r["max_abs_error"], r["same_bits"]
        lines.append(
            f"| {r['structure']} | {r['rows']} | {r['ids']} | {r['n']} | {r['dtype']} | "
            f"{r['pieces']} | {r['output_mib']:.1f} | {ms['pull']:.2f} | {ms['push']:.2f} | "
            f"{ms['xla']:.2f} | {ms['push'] / ms['pull']:.2f}x | "
            f"{ms['xla'] / min(ms['pull'], ms['push']):.2f}x | {same['pull']}, {same['xla']} | "
            f"{err['pull']:.1e} / {err['push']:.1e} / {err['xla']:.1e} |"
        )
    lines.append("")
    for pieces in sorted({r["pieces"] for r in rows}):
        these = [r for r in rows if r["pieces"] == pieces]
        ratios = [r["ms"]["push"] / r["ms"]["pull"] for r in these]
        summary = report.ratio_summary(ratios)
        scatter = [r["ms"]["xla"] / min(r["ms"]["pull"], r["ms"]["push"]) for r in these]
        lines.append(
            f"- {pieces} piece(s): push / pull geometric mean {summary['geomean']:.2f}x, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}x over {summary['cells']} cells; "
            f"xla / kernels {report.ratio_summary(scatter)['geomean']:.2f}x "
            f"({min(scatter):.2f}-{max(scatter):.2f}x); "
            f"{sum(r['same_bits']['pull'] for r in these)} (pull) and "
            f"{sum(r['same_bits']['xla'] for r in these)} (xla) of {len(these)} with the "
            "push's bits."
        )
    text = "\n".join(lines) + "\n"
    report.write_study(args.out, "pull_or_push", result, text)
    print(text)
    return result


if __name__ == "__main__":
    main()
