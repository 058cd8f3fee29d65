"""What one busy core costs: ``python -m benchmarks.studies.busy_core``.

A training loop shares its cores with data loaders. This study times the same cells
twice, in turns with their peers: on a quiet machine, then with a second process
spinning on core 0 (``os.sched_setaffinity``; the timed process may run anywhere).
Systems: jaxcsr as it chooses, the same on one thread (``cpu.threads(1)``: what one
core's share is worth), jaxcsr's XLA path (``impl="xla"``) and
``jax.ops.segment_sum``, all jitted, forward and forward + backward, on static ids
(planned once on the host) and traced ids (planned per call); forward + backward
returns the output and the values' gradient for a cotangent passed in. Structures: a real
graph's destinations shuffled, and uniform random ids. Writes ``busy_core.json`` and
``busy_core.md`` to ``--out``; each row records the largest relative difference of a
system's output from jax.ops'.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure, report
from benchmarks.datasets import shuffled_and_uniform_ids
from jaxcsr import machine
from jaxcsr.kernels import cpu

SYSTEMS = ("jaxcsr", "jaxcsr 1 thread", "jaxcsr xla", "jax.ops")
SPIN = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def busy_core(busy: bool):
    """A process spinning on core 0 while the block runs (nothing when not ``busy``)."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _functions(ids: np.ndarray, m: int, traced: bool, backward: bool) -> dict:
    """System -> the cell's program (:func:`benchmarks.measure.segment_program`)."""
    ops = {
        "jaxcsr": lambda v, i: jaxcsr.segment_sum(v, i, m),
        "jaxcsr xla": lambda v, i: jaxcsr.segment_sum(v, i, m, impl="xla"),
        "jax.ops": lambda v, i: jax.ops.segment_sum(v, i, m),
    }
    ops = {"jaxcsr": ops["jaxcsr"], "jaxcsr 1 thread": ops["jaxcsr"], **ops}
    fns = {}
    for name, op in ops.items():
        fn = measure.segment_program(op, ids, traced, backward)
        if name == "jaxcsr 1 thread":  # the cap is read when the product is traced
            fn = functools.partial(_traced_on_one_thread, fn)
        fns[name] = fn
    return fns


def _traced_on_one_thread(fn, *args):
    with cpu.threads(1):
        return fn(*args)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.busy_core",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--graphs", default="musae_github")
    p.add_argument("--synthetic", default="1000000/100000", help="uniform ids as IDS/ROWS")
    p.add_argument("--features", default="16,64", help="N, comma-separated")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs at least two cores: one to keep busy, one to run on")
    rng = np.random.default_rng(0)
    synthetic = [v for v in args.synthetic.split(",") if v]
    graphs = [g for g in args.graphs.split(",") if g]
    cells = []
    for label, ids, m in shuffled_and_uniform_ids(graphs, synthetic, rng):
        ids = ids.astype(np.int32)
        for n in (int(f) for f in args.features.split(",")):
            x = jnp.asarray(rng.standard_normal((len(ids), n)), jnp.float32)
            ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
            for traced in (False, True):
                for backward in (False, True):
                    fns = _functions(ids, m, traced, backward)
                    operands = (x, jnp.asarray(ids)) if traced else (x,)
                    if backward:
                        operands = (*operands, ct)
                    for f in fns.values():
                        jax.block_until_ready(f(*operands))  # compiled before timing
                    cells.append((label, m, len(ids), n, traced, backward, fns, operands))
    rows = []
    for busy in (False, True):
        with busy_core(busy):
            for label, m, k, n, traced, backward, fns, operands in cells:
                thunks = {s: functools.partial(f, *operands) for s, f in fns.items()}
                timings, outs = measure.time_in_turns(thunks, args.repeats)
                ms = {s: t.median_s * 1e3 for s, t in timings.items()}
                difference = max(
                    measure.largest_relative_error(out, outs["jax.ops"]) for out in outs.values()
                )
                row = {
                    "structure": label, "rows": m, "ids": k, "n": n,
                    "ids_kind": "traced" if traced else "static",
                    "mode": "fwd+bwd" if backward else "fwd",
                    "busy": busy, "ms": ms, "max_relative_difference": difference,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{'busy' if busy else 'quiet'} {label} N={n} {row['ids_kind']} "
                    f"{row['mode']}: " + ", ".join(f"{s} {v:.2f} ms" for s, v in ms.items()),
                    flush=True,
                )
    result = {
        **report.provenance("benchmarks.studies.busy_core", argv),
        "machine": machine.profile().summary(),
        "rows": rows,
    }
    text = markdown(result)
    report.write_study(args.out, "busy_core", result, text)
    print(text)
    return result


def markdown(result: dict) -> str:
    lines = [
        "# One busy core: segment_sum against jax.ops, quiet and with core 0 spinning",
        "",
        f"`{result['command']}` on {result['machine']}, jax {result['jax']}, "
        f"commit {result['commit']}. Medians in ms; ratios are jax.ops time / system "
        "time (above 1: faster than jax.ops).",
        "",
        "| structure | N | ids | mode | jax.ops quiet | jaxcsr quiet | 1 thread quiet "
        "| xla quiet | jax.ops busy | jaxcsr busy | 1 thread busy | xla busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key: dict[tuple, dict[bool, dict]] = {}
    for r in result["rows"]:
        key = (r["structure"], r["n"], r["ids_kind"], r["mode"])
        by_key.setdefault(key, {})[r["busy"]] = r["ms"]
    busy_ratios = []
    for (label, n, kind, mode), runs in by_key.items():
        cells = []
        for busy in (False, True):
            ms = runs.get(busy)
            if ms is None:
                cells += ["", "", "", ""]
                continue
            base = ms["jax.ops"]
            cells.append(f"{base:.2f} ms")
            cells += [f"{base / ms[s]:.2f}x" for s in ("jaxcsr", "jaxcsr 1 thread", "jaxcsr xla")]
            if busy:
                busy_ratios.append(base / ms["jaxcsr"])
        lines.append(f"| {label} | {n} | {kind} | {mode} | " + " | ".join(cells) + " |")
    if busy_ratios:
        summary = report.ratio_summary(busy_ratios)
        lines += [
            "",
            f"Busy: jaxcsr / jax.ops geometric mean {summary['geomean']:.2f}x, "
            f"min {min(busy_ratios):.2f}x over {summary['cells']} cells.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
