"""Pull or push for unsorted ids in one piece: ``python -m benchmarks.studies.one_piece``.

Where a push of unsorted segment ids would take one piece
(:func:`jaxcsr.kernels.cpu.push_pieces`), each row is reduced over its ids in input
order, which is also the order of a pull through the planned sort (except for one
feature, where the pull sums in eight lanes): jaxcsr chooses the pull, and the push
for one feature. This study times both on the same cells, in turns, and checks their
bits: the embedded graphs with their ids shuffled and synthetic uniform ids, at the
widths where one piece runs (cells of 2 or 4 pieces are skipped: only the push reduces
in their order). Writes ``one_piece.json`` and ``one_piece.md`` to ``--out``.
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
from jaxcsr import CSRMatrix, machine
from jaxcsr.kernels import cpu


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.one_piece",
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
                if cpu.push_pieces(m, len(ids), n, itemsize) != 1:
                    continue
                x = jnp.asarray(rng.uniform(-1, 1, (len(ids), n)), dtype)
                fns = {}
                for kernel in ("pull", "push"):
                    with cpu.one_piece(kernel):  # read when traced
                        fns[kernel] = jax.jit(lambda A, x: A @ x)
                        jax.block_until_ready(fns[kernel](A, x))
                thunks = {k: functools.partial(f, A, x) for k, f in fns.items()}
                timings, outs = measure.time_in_turns(thunks, args.repeats)
                same = bool(
                    np.array_equal(
                        np.asarray(outs["pull"]).view(np.uint8),
                        np.asarray(outs["push"]).view(np.uint8),
                    )
                )
                row = {
                    "structure": label,
                    "rows": m,
                    "ids": len(ids),
                    "n": n,
                    "dtype": dtype,
                    "output_mib": m * n * 4 / 2**20,
                    "ms": {k: t.median_s * 1e3 for k, t in timings.items()},
                    "same_bits": same,
                }
                rows.append(row)
                print(
                    f"{label} N={n} {dtype}: pull {row['ms']['pull']:.2f} ms, push "
                    f"{row['ms']['push']:.2f} ms, same bits {same}",
                    flush=True,
                )
    result = {
        "command": report.command_line("benchmarks.studies.one_piece", argv),
        "machine": machine.profile().summary(),
        "rows": rows,
    }
    lines = [
        "# Unsorted ids in one piece: pull against push (ms, median, in turns)",
        "",
        f"`{result['command']}` on {result['machine']}.",
        "",
        "| structure | rows | ids | N | dtype | output MiB | pull | push | push / pull "
        "| same bits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['structure']} | {r['rows']} | {r['ids']} | {r['n']} | {r['dtype']} | "
            f"{r['output_mib']:.1f} | {ms['pull']:.2f} | {ms['push']:.2f} | "
            f"{ms['push'] / ms['pull']:.2f}x | {r['same_bits']} |"
        )
    ratios = [r["ms"]["push"] / r["ms"]["pull"] for r in rows]
    if ratios:
        summary = report.ratio_summary(ratios)
        lines += [
            "",
            f"push / pull: geometric mean {summary['geomean']:.2f}x, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}x over {summary['cells']} cells; "
            f"{sum(r['same_bits'] for r in rows)} of {len(rows)} with the same bits.",
        ]
    text = "\n".join(lines) + "\n"
    report.write_study(args.out, "one_piece", result, text)
    print(text)
    return result


if __name__ == "__main__":
    main()
