"""How far ``segment_softmax`` is from exact: ``python -m benchmarks.studies.softmax_accuracy``.

Float32 softmax over random segment ids, measured in ulps against the float64 result
rounded to float32, for jaxcsr (the platform's default path and ``impl="xla"``), for
jraph's composition (``segment_max``, subtract, ``exp``, ``segment_sum``, divide; the
same as ``jraph.segment_softmax``) and for jaxcsr against that composition. Logits are
``normal(0, scale)``; probabilities below float32's smallest normal number are left
out (their ulps are subnormal spacing). Writes ``softmax_accuracy.json`` and ``.md``
to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import report
from benchmarks.systems import jax_ops_softmax, softmax64


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in float32 steps between non-negative float32 arrays."""
    a32 = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    return np.abs(a32 - np.asarray(b, np.float32).view(np.int32))


def measure(scale: float, n: int, m: int, rng: np.random.Generator) -> dict:
    x = (rng.normal(size=n) * scale).astype(np.float32)
    ids = rng.integers(0, m, n)
    truth = softmax64(x, ids, m).astype(np.float32)
    keep = truth >= np.finfo(np.float32).tiny
    results = {
        "jaxcsr": jaxcsr.segment_softmax(x, ids, m),
        'jaxcsr impl="xla"': jaxcsr.segment_softmax(x, ids, m, impl="xla"),
        "jraph composition": jax_ops_softmax(jnp.asarray(x), jnp.asarray(ids), m),
    }
    row = {"scale": scale, "entries": n, "segments": m, "compared": int(keep.sum())}
    for name, out in results.items():
        d = ulps(np.asarray(out), truth)[keep]
        row[name] = {"max_ulp": int(d.max()), "mean_ulp": round(float(d.mean()), 3)}
    d = ulps(np.asarray(results["jaxcsr"]), np.asarray(results["jraph composition"]))[keep]
    row["jaxcsr vs jraph"] = {"max_ulp": int(d.max()), "equal": round(float((d == 0).mean()), 3)}
    return row


def table(rows: list[dict]) -> str:
    names = ("jaxcsr", 'jaxcsr impl="xla"', "jraph composition")
    head = " | ".join(f"{n} max / mean ulp" for n in names)
    lines = [
        f"| logit scale | {head} | jaxcsr vs jraph: max ulp, share equal |",
        "|---" * (len(names) + 2) + "|",
    ]
    for r in rows:
        cells = " | ".join(f"{r[n]['max_ulp']} / {r[n]['mean_ulp']:.2f}" for n in names)
        v = r["jaxcsr vs jraph"]
        lines.append(f"| {r['scale']:g} | {cells} | {v['max_ulp']}, {100 * v['equal']:.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.softmax_accuracy",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--scales", default="1,3,10,30", help="logit standard deviations")
    p.add_argument("--entries", type=int, default=200_000)
    p.add_argument("--segments", type=int, default=5_000)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = [measure(float(s), args.entries, args.segments, rng) for s in args.scales.split(",")]
    record = {"jax": jax.__version__, "backend": jax.default_backend(), "rows": rows}
    text = table(rows)
    report.write_study(args.out, "softmax_accuracy", record, text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
