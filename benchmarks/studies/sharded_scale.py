"""Per-device bytes of a sharded segment sum at scale, from the block plan alone:
``python -m benchmarks.studies.sharded_scale``.

A synthetic power-law graph (default: 1e9 edges into 5e7 nodes, Pareto in-degrees with
one hub) is never allocated: only its row pointer is, and
:func:`jaxcsr.sharding.row_blocks.block_sizes` (the sizes of
:func:`~jaxcsr.sharding.row_blocks.plan_blocks`) cuts it for P devices. Per device,
for one product with F float32 features:

* structure: the block's XLA-path arrays (``from_indices`` form: ``indices`` and
  ``row_of_col``, 4 B per entry slot each, and ``indptr``, 4 B per row slot);
* values: the block's per-edge values, ``K_b * F * 4``;
* output: the device's part of the result, ``ceil(m / P) * F * 4``;
* relayout: rows of its block that belong to another device's part of the output
  (sent once forward, once backward);
* layout: ``S @ v`` with ``v`` in input order, sharded: the all-gather of ``v``
  (``(P - 1) / P`` of it per device); 0 for values already laid out.

And per process (one device each), the host memory of building it:

* ``shard``: the whole matrix's host structure (``from_indices``: the ids and their
  sort order, 8 B per entry each, and ``indptr``, 8 B per row) plus the layout maps of
  every block (``input_order``/``data_order``, 4 B per entry slot each);
* ``shard_rows``: the row lengths and row pointer (8 B per row each), its block's
  loaded columns (8 B per entry slot), layout maps (8 B per slot) and planned block
  structure.

Writes ``sharded_scale.json`` and ``sharded_scale.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks import report
from jaxcsr.sharding.row_blocks import block_sizes, relayout_rows, rows_per_part


def power_law_indptr(edges: int, nodes: int, seed: int) -> np.ndarray:
    """Row pointer of ``nodes`` rows whose lengths follow a Pareto law (exponent 1.5),
    scaled to ``edges`` in all, plus one hub row holding 0.5 % of them."""
    rng = np.random.default_rng(seed)
    weights = rng.pareto(1.5, nodes) + 1.0
    hub = int(0.005 * edges)
    lengths = np.floor(weights / weights.sum() * (edges - hub)).astype(np.int64)
    lengths[0] += edges - lengths.sum()  # the hub and the rounding remainder
    indptr = np.zeros(nodes + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    return indptr


def rows(indptr: np.ndarray, devices, features: int) -> list[dict]:
    m, nnz = indptr.size - 1, int(indptr[-1])
    out = []
    for p in devices:
        starts, block_nnz, r_b, k_b = block_sizes(indptr, p)
        moved = relayout_rows(starts, m)
        row = {
            "devices": p,
            "block_entries": k_b,
            "block_rows": r_b,
            "imbalance": float(block_nnz.max() / max(block_nnz.mean(), 1)),
            "largest_row": int(np.diff(indptr).max()),
            "structure_bytes": 8 * k_b + 4 * (r_b + 2),
            "values_bytes": k_b * features * 4,
            "output_bytes": rows_per_part(m, p) * features * 4,
            "relayout_bytes": int(moved.max(initial=0)) * features * 4,
            "layout_bytes": (p - 1) * -(-nnz // p) * features * 4,
            "host_shard_bytes": 16 * nnz + 8 * (m + 1) + 8 * p * k_b,
            "host_shard_rows_bytes": 16 * (m + 1) + 16 * k_b + 8 * k_b + 4 * (r_b + 2),
        }
        out.append(row)
        print(
            f"P={p}: {k_b:,} entry slots, structure {row['structure_bytes'] / 2**20:.1f} MiB, "
            f"values {row['values_bytes'] / 2**30:.2f} GiB, relayout "
            f"{row['relayout_bytes'] / 2**20:.2f} MiB",
            flush=True,
        )
    return out


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f}"


def markdown(result: dict) -> str:
    g = result["graph"]
    largest = result["rows"][0]["largest_row"] if result["rows"] else 0
    lines = [
        f"### Per-device bytes, segment form, {g['edges']:.0e} edges into {g['nodes']:.0e} "
        f"nodes (power law + a hub of 0.5 %), F = {result['features']} float32",
        "",
        f"Largest row: {largest:,} entries. Rows stay whole, so no block holds fewer "
        "entry slots than that: past `edges / largest row` devices the blocks stop "
        "shrinking (the imbalance column).",
        "",
        "| P | entry slots per block | imbalance | structure GiB | values GiB | output GiB "
        "| relayout GiB | layout (input order) GiB | host GiB per process: shard "
        "| host GiB per process: shard_rows |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['devices']} | {r['block_entries']:,} | {r['imbalance']:.3f} | "
            f"{_gib(r['structure_bytes'])} | {_gib(r['values_bytes'])} | "
            f"{_gib(r['output_bytes'])} | {_gib(r['relayout_bytes'])} | "
            f"{_gib(r['layout_bytes'])} | {_gib(r['host_shard_bytes'])} | "
            f"{_gib(r['host_shard_rows_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--edges", type=float, default=1e9)
    p.add_argument("--nodes", type=float, default=5e7)
    p.add_argument("--devices", default="8,32,128,512,1024")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    indptr = power_law_indptr(int(args.edges), int(args.nodes), args.seed)
    devices = [int(d) for d in args.devices.split(",")]
    result = {
        "graph": {"edges": int(args.edges), "nodes": int(args.nodes), "seed": args.seed},
        "features": args.features,
        "rows": rows(indptr, devices, args.features),
        "command": report.command_line("benchmarks.studies.sharded_scale", argv),
    }
    print(f"wrote {report.write_study(args.out, 'sharded_scale', result, markdown(result))}")
    return result


if __name__ == "__main__":
    main()
