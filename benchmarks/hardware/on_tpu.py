"""TPU benchmark (for users with a TPU; not run by this project's CI or authors).

``python -m benchmarks.hardware.on_tpu [--graph tolokers] [--features 128,512]``

Times the segment form (``from_indices(dst) @ messages``) and the GCN SpMM form,
forward, with the Pallas TPU kernel (``impl=None`` on TPU), the XLA path,
``jax.ops.segment_sum`` (unsorted) and ``jax.experimental.sparse.BCSR``; checks the
kernel against the XLA path first and prints medians in ms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import measure
from benchmarks.datasets import load_graph
from benchmarks.systems import jax_sparse_twins
from jaxcsr import CSRMatrix, matmul


def schedule_stats() -> list[str]:
    """Markdown rows: TPU kernel steps on each embedded graph (host plan only)."""
    from benchmarks.datasets import EMBEDDED
    from jaxcsr import plan
    from jaxcsr.kernels import tpu

    rows = []
    for name in EMBEDDED:
        g = load_graph(name)
        indptr, _ = plan.segment_ids_to_csr(g.dst, g.num_nodes)
        schedule = tpu.plan_schedule(indptr)
        t = schedule.tiling
        blocks = -(-g.num_edges // t.block_k)
        gcn = tpu.plan_schedule(g.normalized_adjacency().indptr).num_steps
        rows.append(
            f"| {name} | {g.num_nodes:,} | {g.num_edges:,} | {t.block_k} / {t.window} | "
            f"{blocks:,} | {schedule.num_steps:,} | {gcn:,} | "
            f"{schedule.num_steps / blocks:.2f} |"
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--schedule-stats", action="store_true", help="print schedule lengths (any machine)"
    )
    p.add_argument("--graph", default="tolokers")
    p.add_argument("--features", default="128,512")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if args.schedule_stats:
        print("\n".join(schedule_stats()))
        return
    if jax.default_backend() != "tpu":
        raise SystemExit(f"no TPU: jax backend is {jax.default_backend()!r}")

    g = load_graph(args.graph)
    dtype = jnp.dtype(args.dtype)
    A = CSRMatrix.from_indices(g.dst, num_rows=g.num_nodes)
    adj = g.normalized_adjacency()
    B = CSRMatrix.from_scipy(adj)
    B = B.with_data(B.data.astype(dtype))
    bcsr, _ = jax_sparse_twins(adj, dtype)
    dst = jnp.asarray(g.dst, jnp.int32)
    rng = np.random.default_rng(0)
    for n in (int(v) for v in args.features.split(",")):
        msgs = jnp.asarray(rng.uniform(-1, 1, (g.num_edges, n)), dtype)
        x = jnp.asarray(rng.uniform(-1, 1, (g.num_nodes, n)), dtype)
        cases = {
            "segment": (
                msgs,
                {
                    "jaxcsr_pallas": lambda m: A @ m,
                    "jaxcsr_xla": lambda m: matmul(A, m, impl="xla"),
                    "segment_sum": lambda m: jax.ops.segment_sum(m, dst, g.num_nodes),
                },
            ),
            "spmm": (
                x,
                {
                    "jaxcsr_pallas": lambda x: B @ x,
                    "jaxcsr_xla": lambda x: matmul(B, x, impl="xla"),
                    "bcsr": lambda x: bcsr @ x,
                },
            ),
        }
        for workload, (arg, fns) in cases.items():
            ref, cells = None, []
            for name, fn in fns.items():
                f = jax.jit(fn)
                timing, out = measure.time_thunk(lambda f=f, a=arg: f(a), args.repeats)
                got = measure.to_numpy(out)
                ref = got if ref is None else ref
                err = measure.relative_error(got, ref)
                cells.append(f"{name} {timing.median_s * 1e3:.3f} ms (err {err:.1e})")
            print(f"{g.name} {workload} N={n} {dtype.name}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
