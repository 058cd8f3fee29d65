"""Uniform random graphs, static and traced ids: ``python -m benchmarks.studies.random_graphs``.

The embedded graphs are real and skewed; a random graph is the other end: every
segment about equally long, the ids in no order, the output rows touched at random.
This study times ``segment_sum`` of ``(ids, N)`` values into ``rows`` segments on
uniform random ids, against ``jax.ops.segment_sum`` on the same ids, in turns, jitted,
forward and forward + backward (the output and the values' gradient, the cotangent an
argument): with the ids static (closed over: jaxcsr plans them
once on the host; jax.ops gets them as a constant) and traced (a jit argument on both
sides: jaxcsr plans on the device per call, or runs XLA's scatter where its rule says
so). Each row records the largest relative difference of jaxcsr's output from
jax.ops'. Writes ``random_graphs.json`` and ``random_graphs.md`` to ``--out``.
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
from jaxcsr import machine

SYSTEMS = ("jaxcsr", "jax.ops")


def _function(system: str, ids: np.ndarray, m: int, traced: bool, backward: bool):
    """The cell's program of ``system`` (:func:`benchmarks.measure.segment_program`)."""
    segment = jaxcsr.segment_sum if system == "jaxcsr" else jax.ops.segment_sum
    return measure.segment_program(lambda v, i: segment(v, i, m), ids, traced, backward)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.random_graphs",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rows", default="10000,100000,1000000", help="segments, comma-separated")
    p.add_argument("--ids", default="1000000,2000000", help="ids (edges), comma-separated")
    p.add_argument("--features", default="1,4,16,64", help="N, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for k in (int(v) for v in args.ids.split(",")):
        for m in (int(v) for v in args.rows.split(",")):
            ids = rng.integers(0, m, k).astype(np.int32)
            for n in (int(f) for f in args.features.split(",")):
                x = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
                ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
                for traced in (False, True):
                    for backward in (False, True):
                        operands = (x, jnp.asarray(ids)) if traced else (x,)
                        if backward:
                            operands = (*operands, ct)
                        thunks = {
                            s: functools.partial(_function(s, ids, m, traced, backward), *operands)
                            for s in SYSTEMS
                        }
                        timings, outs = measure.time_in_turns(thunks, args.repeats)
                        ms = {s: t.median_s * 1e3 for s, t in timings.items()}
                        difference = measure.largest_relative_error(outs["jaxcsr"], outs["jax.ops"])
                        row = {
                            "rows": m, "ids": k, "n": n,
                            "ids_kind": "traced" if traced else "static",
                            "mode": "fwd+bwd" if backward else "fwd",
                            "ms": ms, "speedup": ms["jax.ops"] / ms["jaxcsr"],
                            "max_relative_difference": difference,
                        }  # fmt: skip
                        rows.append(row)
                        print(_line(row), flush=True)
    result = {
        **report.provenance("benchmarks.studies.random_graphs", argv),
        "machine": machine.profile().summary(),
        "rows": rows,
    }
    text = markdown(result)
    report.write_study(args.out, "random_graphs", result, text)
    print(text)
    return result


def _line(r: dict) -> str:
    return (
        f"{r['ids']} ids / {r['rows']} rows N={r['n']} {r['ids_kind']} {r['mode']}: "
        f"jaxcsr {r['ms']['jaxcsr']:.2f} ms, jax.ops {r['ms']['jax.ops']:.2f} ms, "
        f"{r['speedup']:.2f}x (diff {r['max_relative_difference']:.1e})"
    )


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "# Uniform random graphs: segment_sum against jax.ops, static and traced ids",
        "",
        f"`{result['command']}` on {result['machine']}, jax {result['jax']}, "
        f"commit {result['commit']}. float32; medians in ms; the ratio is jax.ops' time "
        "over jaxcsr's (above 1: jaxcsr faster).",
        "",
        "| ids | rows | N | ids | mode | jax.ops | jaxcsr | ratio | max rel. diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ids']} | {r['rows']} | {r['n']} | {r['ids_kind']} | {r['mode']} | "
            f"{r['ms']['jax.ops']:.2f} | {r['ms']['jaxcsr']:.2f} | {r['speedup']:.2f}x | "
            f"{r['max_relative_difference']:.1e} |"
        )
    lines.append("")
    for kind in ("static", "traced"):
        for mode in ("fwd", "fwd+bwd"):
            ratios = [r["speedup"] for r in rows if r["ids_kind"] == kind and r["mode"] == mode]
            if ratios:
                summary = report.ratio_summary(ratios)
                below = sum(v < 1.0 for v in ratios)
                lines.append(
                    f"- {kind} ids, {mode}: geometric mean {summary['geomean']:.2f}x, "
                    f"range {min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} cells, "
                    f"{below} below 1.0x."
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
