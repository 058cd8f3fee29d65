"""The rule or this machine's timings: ``python -m benchmarks.studies.timed_choice``.

Static unsorted float32 ids whose push takes one piece run the pull, the push or XLA's
scatter: the same bits (each row in input order). The CPU backend's rule picks one
from the sizes; :mod:`jaxcsr.timed_choices` times the candidates once per machine
and shape class instead. This study runs each cell both ways -- traced with
``JAXCSR_TIMED_CHOICES=0`` (the rule) and with timed choices on, into an empty
choices file of its own (a temporary ``JAXCSR_CACHE_DIR``, the machine profile copied
into it), so every class is timed fresh -- and times the two programs and
``jax.ops.segment_sum`` on the same static ids in turns. It reports what each chose,
the medians, the first trace's extra time (the timing itself, once per class) and
whether the two outputs have the same bits. Writes ``timed_choice.json`` and
``timed_choice.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import measure, report
from benchmarks.datasets import shuffled_and_uniform_ids
from jaxcsr import CSRMatrix, machine
from jaxcsr.kernels import cpu


@contextlib.contextmanager
def _environment(name: str, value: str):
    """``os.environ[name] = value`` inside the block, as it was after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.timed_choice",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--graphs", default="planetoid_pubmed,musae_github")
    p.add_argument(
        "--synthetic",
        default="40000/25000,100000/60000,400000/200000,1000000/1000000,2000000/1000000",
        help="uniform random ids as IDS/ROWS, comma-separated",
    )
    p.add_argument("--features", default="1,2,4,8,12,16", help="N, comma-separated")
    p.add_argument("--repeats", type=int, default=11, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    if not cpu.available():
        raise SystemExit("the native CPU kernels are not built: nothing to compare")
    profile_file = machine.cache_file()
    machine.profile()  # measured (and stored) before the cache directory moves
    scratch = Path(tempfile.mkdtemp(prefix="jaxcsr-timed-choice-"))
    if profile_file.exists():
        shutil.copy(profile_file, scratch / profile_file.name)
    rng = np.random.default_rng(0)
    rows = []
    try:
        with _environment("JAXCSR_CACHE_DIR", str(scratch)):
            synthetic = [v for v in args.synthetic.split(",") if v]
            graphs = [g for g in args.graphs.split(",") if g]
            for label, ids, m in shuffled_and_uniform_ids(graphs, synthetic, rng):
                ids = np.asarray(ids, np.int32)
                A = CSRMatrix.from_indices(ids, num_rows=m)
                for n in (int(f) for f in args.features.split(",")):
                    if cpu.push_pieces(m, len(ids), n, 4) != 1:
                        continue
                    rows.append(_cell(label, A, ids, m, n, rng, args.repeats))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {**report.provenance("benchmarks.studies.timed_choice", argv)}
    result.update(machine=machine.profile().summary(), rows=rows)
    text = _markdown(result)
    report.write_study(args.out, "timed_choice", result, text)
    print(text)
    return result


def _cell(label, A, ids, m, n, rng, repeats) -> dict:
    x = jnp.asarray(rng.uniform(-1, 1, (len(ids), n)), jnp.float32)
    with _environment("JAXCSR_TIMED_CHOICES", "0"):
        rule_kernel = cpu.choose(A.structure, n).kernel
        rule = jax.jit(lambda A, x: A @ x).lower(A, x).compile()
    with _environment("JAXCSR_TIMED_CHOICES", "1"):
        start = time.perf_counter()
        strategy = cpu.choose(A.structure, n)  # the timing, once per class
        timing_s = time.perf_counter() - start
        timed = jax.jit(lambda A, x: A @ x).lower(A, x).compile()
    theirs = jax.jit(lambda x: jax.ops.segment_sum(x, ids, m))
    thunks = {
        "rule": functools.partial(rule, A, x),
        "timed": functools.partial(timed, A, x),
        "jax.ops": functools.partial(theirs, x),
    }
    timings, outs = measure.time_in_turns(thunks, repeats)
    same = bool(np.array_equal(np.asarray(outs["rule"]), np.asarray(outs["timed"])))
    error = measure.max_abs_error(outs["timed"], measure.segment_sum_f64(x, ids, m))
    row = {
        "structure": label,
        "rows": m,
        "ids": len(ids),
        "n": n,
        "rule": rule_kernel,
        "timed": strategy.kernel,
        "timed_reason": strategy.reason,
        "timing_s": timing_s,
        "ms": {k: t.median_s * 1e3 for k, t in timings.items()},
        "same_bits": same,
        "max_abs_error": error,
    }
    ms = row["ms"]
    print(
        f"{label} N={n}: rule {rule_kernel} {ms['rule']:.3f} ms, timed {strategy.kernel} "
        f"{ms['timed']:.3f} ms, jax.ops {ms['jax.ops']:.3f} ms; timing {timing_s:.2f} s; "
        f"same bits {same}",
        flush=True,
    )
    return row


def _markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "# The rule or this machine's timings: one-piece static float32 sums",
        "",
        f"`{result['command']}` on {result['machine']}, jax {result['jax']}, commit "
        f"{result['commit']}. Medians in ms, the three programs timed in turns; rule / "
        "timed: the rule's time over the timed choice's (above 1: the timed choice "
        "faster); x jax.ops: jax.ops' time over each (above 1: faster than jax.ops); "
        "timing: the first trace's time in the timed choice, once per shape class (0.00 "
        "where another cell of the class had timed it); same bits: the two outputs.",
        "",
        "| structure | rows | ids | N | rule | timed | jax.ops | rule ms | timed ms | "
        "rule / timed | rule x jax.ops | timed x jax.ops | timing s | same bits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['structure']} | {r['rows']} | {r['ids']} | {r['n']} | {r['rule']} | "
            f"{r['timed']} | {ms['jax.ops']:.3f} | {ms['rule']:.3f} | {ms['timed']:.3f} | "
            f"{ms['rule'] / ms['timed']:.2f}x | {ms['jax.ops'] / ms['rule']:.2f}x | "
            f"{ms['jax.ops'] / ms['timed']:.2f}x | {r['timing_s']:.2f} | {r['same_bits']} |"
        )
    lines.append("")
    if rows:
        changed = [r for r in rows if r["rule"] != r["timed"]]
        for name, these in (("every cell", rows), ("cells the timing changed", changed)):
            if not these:
                continue
            gain = report.ratio_summary([r["ms"]["rule"] / r["ms"]["timed"] for r in these])
            rule = report.ratio_summary([r["ms"]["jax.ops"] / r["ms"]["rule"] for r in these])
            timed = report.ratio_summary([r["ms"]["jax.ops"] / r["ms"]["timed"] for r in these])
            lines.append(
                f"- {name} ({len(these)}): rule / timed geometric mean "
                f"{gain['geomean']:.2f}x; against jax.ops the rule {rule['geomean']:.2f}x, "
                f"the timed choice {timed['geomean']:.2f}x"
            )
        lines.append(
            f"- same bits in {sum(r['same_bits'] for r in rows)} of {len(rows)} cells; "
            f"timing took {sum(r['timing_s'] for r in rows):.1f} s in all"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
