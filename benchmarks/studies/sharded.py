"""Sharded products: balance, communication and time on forced CPU devices.

``python -m benchmarks.studies.sharded [--devices 4] [--out DIR]`` forces ``--devices`` CPU
devices (XLA_FLAGS, set before jax is imported) and prints

1. shard imbalance (max / mean nonzeros per shard) of the nnz-balanced row split for
   P = 2, 4, 8 on the embedded graphs and on law_cnr2000_sym (read from
   ``../shared/data/matrices`` by path when it is there);
2. bytes each device sends per product (``ShardedCSR.communication``) for the segment
   and SpMM forms at F = 64, float32;
3. the time of ``S @ x`` on the forced devices against ``A @ x`` on one device, both
   jitted (one CPU: the devices share its cores, so this shows that the sharded
   program runs and what it costs, not a speed-up).

Writes ``sharding.json`` and ``sharding.md`` to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

LAW = Path(__file__).resolve().parents[2] / "shared" / "data" / "matrices" / "law_cnr2000_sym.npz"
GRAPHS = ("cora", "planetoid_pubmed", "musae_github", "tolokers")


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.sharded",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--devices", type=int, default=4, help="forced CPU devices for timing")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType

    import jaxcsr
    from benchmarks import measure
    from benchmarks.datasets import load_graph
    from jaxcsr.sharding.row_blocks import balanced_row_blocks

    names = [*GRAPHS, *([str(LAW)] if LAW.exists() else [])]
    graphs = [load_graph(n) for n in names]
    report = {"devices": jax.device_count(), "imbalance": [], "communication": [], "time": []}
    lines = ["### Imbalance (max / mean nonzeros per shard), rows balanced by nonzeros", ""]
    lines += ["| graph | rows | nnz | P=2 | P=4 | P=8 |", "|---|---:|---:|---:|---:|---:|"]
    for g in graphs:
        lengths = np.bincount(g.dst, minlength=g.num_nodes)
        cum = np.concatenate([[0], np.cumsum(lengths)])
        cells = []
        for parts in (2, 4, 8):
            starts = balanced_row_blocks(lengths, parts)
            nnz = cum[starts[1:]] - cum[starts[:-1]]
            ratio = float(nnz.max() / nnz.mean())
            report["imbalance"].append({"graph": g.name, "parts": parts, "imbalance": ratio})
            cells.append(f"{ratio:.4f}")
        lines.append(
            f"| {g.name} | {g.num_nodes:,} | {int(cum[-1]):,} | " + " | ".join(cells) + " |"
        )
    print("\n".join(lines), flush=True)

    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("d",), axis_types=(AxisType.Auto,))
    F = args.features
    rng = np.random.default_rng(0)
    comm = [
        "",
        f"### Per product and device, P={devices}, F={F}, float32 (bytes sent; forward; "
        "the backward sends the same amounts back)",
        "",
        "| graph | form | gather x | relayout | output per device | time sharded (ms) "
        "| time 1 device (ms) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for g in graphs:
        seg = jaxcsr.CSRMatrix.from_indices(g.dst, g.num_nodes)
        adj = jaxcsr.CSRMatrix.from_scipy(g.normalized_adjacency())
        for form, A in (("segment", seg), ("spmm", adj)):
            S = jaxcsr.shard(A, mesh, "d")
            x = rng.uniform(-1, 1, (A.shape[1], F)).astype(np.float32)
            xs = S.layout_values(x) if form == "segment" else jnp.asarray(x)
            bytes_ = S.communication(F)
            if form == "segment":  # values already in the layout: the fast path
                sharded = jax.jit(lambda v, S=S: S.matmul_laid_out(v))
            else:
                sharded = jax.jit(lambda v, S=S: S @ v)
            single = jax.jit(lambda v, A=A: A @ v)
            t_s, _ = measure.time_thunk(lambda f=sharded, v=xs: f(v), args.repeats)
            x1 = jnp.asarray(x)
            t_1, _ = measure.time_thunk(lambda f=single, v=x1: f(v), args.repeats)
            out_bytes = -(-A.shape[0] // devices) * F * 4
            row = {
                "graph": g.name,
                "form": form,
                **bytes_,
                "output_per_device": out_bytes,
                "sharded_s": t_s.median_s,
                "single_s": t_1.median_s,
            }
            report["communication"].append(row)
            comm.append(
                f"| {g.name} | {form} | {bytes_['gather_x']:,} | {bytes_['relayout']:,} | "
                f"{out_bytes:,} | {t_s.median_s * 1e3:.2f} | {t_1.median_s * 1e3:.2f} |"
            )
    print("\n".join(comm), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sharding.json").write_text(json.dumps(report, indent=1))
        (args.out / "sharding.md").write_text("\n".join(lines + comm) + "\n")
    return report


if __name__ == "__main__":
    main()
