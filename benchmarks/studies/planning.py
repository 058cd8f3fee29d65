"""Host planning time and device bytes of a matrix: ``python -m benchmarks.studies.planning``.

For K random segment ids (``M = K // 16`` segments, power-law row lengths) it times, in
one run, a numpy stable argsort of the ids (the floor: planning must sort them once)
and ``CSRMatrix.from_indices`` planned for each backend set, including the copy to the
device; and it reports the device bytes per nonzero of every matrix (sum of its
leaves' ``nbytes``), plus those of the GCN adjacency (``from_scipy``) of the embedded
graphs beyond ``data + indices + indptr``. Writes ``plan.json`` and ``plan.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import jax
import numpy as np

from benchmarks import measure, report
from benchmarks.datasets import EMBEDDED, load_graph
from jaxcsr import CSRMatrix

BACKEND_SETS = (("xla",), ("xla", "pallas_gpu"), ("xla", "pallas_tpu"))


def _ids(rng: np.random.Generator, size: int) -> tuple[np.ndarray, int]:
    num_rows = max(1, size // 16)
    weights = 1.0 / np.arange(1, num_rows + 1) ** 0.8
    cdf = np.cumsum(weights / weights.sum())
    ids = np.searchsorted(cdf, rng.random(size)).clip(max=num_rows - 1)
    return rng.permutation(num_rows)[ids].astype(np.int32), num_rows


def _best_of(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls (host planning: no compilation to set apart)."""
    return min(measure.timed(fn)[0] for _ in range(repeats))


def _bytes(A: CSRMatrix) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(A))


def planning_rows(sizes, repeats: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for size in sizes:
        ids, num_rows = _ids(rng, size)
        argsort = _best_of(lambda ids=ids: np.argsort(ids, kind="stable"), repeats)
        row = {"ids": size, "segments": num_rows, "argsort_s": argsort}
        for backends in BACKEND_SETS:
            key = "+".join(backends)
            t = _best_of(
                lambda b=backends, i=ids, m=num_rows: CSRMatrix.from_indices(i, m, backends=b),
                repeats,
            )
            A = CSRMatrix.from_indices(ids, num_rows, backends=backends)
            row[key] = {"seconds": t, "ratio": t / argsort, "bytes_per_nnz": _bytes(A) / size}
            del A
        rows.append(row)
        print(
            f"K={size:,}: argsort {argsort:.2f} s; "
            + "; ".join(
                f"{k} {v['seconds']:.2f} s ({v['ratio']:.2f}x, {v['bytes_per_nnz']:.2f} B/nnz)"
                for k, v in row.items()
                if isinstance(v, dict)
            ),
            flush=True,
        )
    return rows


def general_rows() -> list[dict]:
    rows = []
    for name in EMBEDDED:
        adj = load_graph(name).normalized_adjacency()
        row = {"graph": name, "rows": adj.shape[0], "nnz": adj.nnz}
        for backends in BACKEND_SETS:
            A = CSRMatrix.from_scipy(adj, backends=backends)
            arrays = A.plan_info().arrays
            core = arrays["core.indptr"] + arrays["core.indices"] + arrays["data"]
            row["+".join(backends)] = (sum(arrays.values()) - core) / adj.nnz
        rows.append(row)
    return rows


def markdown(planning: list[dict], general: list[dict]) -> str:
    keys = ["+".join(b) for b in BACKEND_SETS]
    lines = [
        "### Host planning, one-valued `from_indices` (K ids, K/16 power-law segments)",
        "",
        "| K | numpy stable argsort (s) | "
        + " | ".join(f"`{k}` s (x argsort, B/nnz)" for k in keys)
        + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for r in planning:
        cells = [
            f"{r[k]['seconds']:.2f} ({r[k]['ratio']:.2f}x, {r[k]['bytes_per_nnz']:.2f})"
            for k in keys
        ]
        lines.append(f"| {r['ids']:,} | {r['argsort_s']:.2f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "### General matrices (`from_scipy`, GCN adjacency): device bytes per nonzero "
        "beyond `data + indices + indptr`",
        "",
        "| graph | rows | nnz | " + " | ".join(f"`{k}`" for k in keys) + " |",
        "|---|---|---|" + "---|" * len(keys),
    ]
    for r in general:
        lines.append(
            f"| {r['graph']} | {r['rows']:,} | {r['nnz']:,} | "
            + " | ".join(f"{r[k]:.2f}" for k in keys)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10000000,30000000", help="numbers of ids")
    p.add_argument("--repeats", type=int, default=3, help="best of this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    planning = planning_rows(sizes, args.repeats, args.seed)
    general = general_rows()
    result = {
        "planning": planning,
        "general": general,
        "environment": {
            "jax": jax.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "command": report.command_line("benchmarks.studies.planning", argv),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps(result, indent=1))
    text = markdown(planning, general)
    (args.out / "plan.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
