"""GPU benchmark for the Pallas Triton kernel: ``python -m benchmarks.hardware.on_gpu``.

Runs from the source tree on a CUDA machine's own python (jax, numpy, scipy,
torch; nothing to install). In one process it

1. checks ``impl="pallas_gpu"`` against ``impl="xla"`` on fresh random inputs for
   every graph, workload and dtype (forward and backward), and that two runs of the
   kernel are bit-identical;
2. measures HBM copy bandwidth (``x * 2`` into a donated buffer);
3. times forward and backward (medians over ``--repeats`` with
   ``block_until_ready`` / ``torch.cuda.synchronize``) for jaxcsr (Pallas and XLA
   paths), ``jax.ops.segment_sum`` (unsorted and sorted), BCSR with the cuSPARSE
   lowering, torch (``sparse_csr`` mm = cuSPARSE, ``index_add_``) and
   torch_geometric's ``scatter`` where installed; and the ``reduce="max"`` kernel
   against ``jax.ops.segment_max``; on the embedded graphs, on
   ``law_cnr2000_sym`` when ``../shared/data/matrices`` is there (or any ``.npz``
   path in ``--graphs``), and on the 1- and 24-segment reductions of 400k values
   (``--segments``; a molecular-dynamics energy sum);
4. prints one table with achieved GB/s and % of copy bandwidth and writes
   ``gpu_results.json`` and ``gpu_results.md`` to ``--out``.

``--smoke`` runs the same code on CPU in Pallas interpret mode on a tiny input (the
test suite does this so the script cannot rot).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
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

try:
    import torch
except ImportError:
    torch = None
try:
    from torch_geometric.utils import scatter as pyg_scatter
except ImportError:
    pyg_scatter = None

LAW = Path(__file__).resolve().parents[2] / "shared" / "data" / "matrices" / "law_cnr2000_sym.npz"
DEFAULT_GRAPHS = ("tolokers", "musae_github", "planetoid_pubmed", str(LAW))
SEGMENT_VALUES = 400_000


def _graph_present(name: str) -> bool:
    """Embedded names always; paths only when the file is there (the shared matrix)."""
    return not name.endswith(".npz") or Path(name).exists()


@dataclasses.dataclass(frozen=True)
class Segments:
    """The few-segment reduction as a graph: ``SEGMENT_VALUES`` sorted ids in ``K``."""

    name: str
    dst: np.ndarray
    num_nodes: int

    @property
    def num_edges(self) -> int:
        return int(self.dst.size)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", default=",".join(DEFAULT_GRAPHS), help="names or .npz paths")
    p.add_argument("--segments", default="1,24", help="segment counts over 400k values")
    p.add_argument("--features", default="16,64,256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-latest"))
    p.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny input")
    args = p.parse_args(argv)
    args.graphs = [g for g in args.graphs.split(",") if g and _graph_present(g)]
    args.segments = [int(k) for k in args.segments.split(",") if k]
    args.features = [int(v) for v in args.features.split(",")]
    args.dtypes = args.dtypes.split(",")
    if args.smoke:
        args.graphs, args.features, args.dtypes, args.repeats = ["cora"], [8], ["float32"], 1
        args.segments = [3]
    return args


def _copy_bandwidth(megabytes: int) -> float:
    n = megabytes * 2**20 // 4
    f = jax.jit(lambda x: x * 2, donate_argnums=0)
    buf = [jnp.ones((n,), jnp.float32)]

    def run():
        buf[0] = f(buf[0])
        return buf[0]

    timing, _ = measure.time_thunk(run, 10)
    return 2 * n * 4 / timing.median_s / 1e9


def _torch_sync(thunk):
    def run():
        out = thunk()
        torch.cuda.synchronize()
        return out

    return run


def _vjp(f, p, c):
    g = jax.jit(lambda p, c: jax.vjp(f, p)[1](c)[0])
    return lambda: g(p, c)


def _fwd(f, p):
    g = jax.jit(f)
    return lambda: g(p)


def _cases(graph, n, dtype, rng, interpret, use_torch):
    """Yields (workload, pass, floor_bytes, {system: thunk}) for one cell group.

    The first system of every cell is ``jaxcsr_pallas`` (the reference of the error
    column), the second ``jaxcsr_xla`` (checked against it).
    """
    V, E = graph.num_nodes, graph.num_edges
    b = np.dtype(dtype).itemsize
    pallas = {"impl": "pallas_gpu", "interpret": interpret}
    backends = ("xla", "pallas_gpu")  # planned here even when built on a CPU (--smoke)
    A = CSRMatrix.from_indices(graph.dst, num_rows=V, backends=backends)
    dst = jnp.asarray(graph.dst, jnp.int32)
    order = np.argsort(graph.dst, kind="stable")
    dst_sorted = dst[order]
    msgs = jnp.asarray(rng.uniform(-1, 1, (E, n)), dtype)
    ct = jnp.asarray(rng.uniform(-1, 1, (V, n)), dtype)
    seg = {
        "jaxcsr_pallas": lambda m: matmul(A, m, **pallas),
        "jaxcsr_xla": lambda m: matmul(A, m, impl="xla"),
        "segment_sum": lambda m: jax.ops.segment_sum(m, dst, V),
    }
    seg_f = {k: _fwd(f, msgs) for k, f in seg.items()}
    seg_b = {k: _vjp(f, msgs, ct) for k, f in seg.items()}
    sorted_f = lambda m: jax.ops.segment_sum(m, dst_sorted, V, indices_are_sorted=True)  # noqa: E731
    seg_f["segment_sum_sorted"] = _fwd(sorted_f, msgs[order])
    seg_bytes = E * n * b + V * n * b + E * 4
    if use_torch:
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[np.dtype(dtype).name]
        dev = "cuda"
        tm = torch.tensor(np.asarray(msgs, np.float32), device=dev).to(tdt)
        tdst = torch.tensor(graph.dst, device=dev)
        seg_f["torch_index_add"] = _torch_sync(
            lambda: torch.zeros(V, n, dtype=tdt, device=dev).index_add_(0, tdst, tm)
        )
        if pyg_scatter is not None:
            seg_f["pyg_scatter"] = _torch_sync(
                lambda: pyg_scatter(tm, tdst, 0, dim_size=V, reduce="sum")
            )
    yield "segment", "fwd", seg_bytes, seg_f
    yield "segment", "bwd", seg_bytes, seg_b
    if not isinstance(graph, Segments):  # the few-segment case has no adjacency
        adj = graph.normalized_adjacency()
        B = CSRMatrix.from_scipy(adj, backends=backends)
        B = B.with_data(B.data.astype(dtype))
        x = jnp.asarray(rng.uniform(-1, 1, (V, n)), dtype)
        bcsr, _ = jax_sparse_twins(adj, dtype)
        spmm = {
            "jaxcsr_pallas": lambda x: matmul(B, x, **pallas),
            "jaxcsr_xla": lambda x: matmul(B, x, impl="xla"),
            "bcsr_cusparse": lambda x: bcsr @ x,
        }
        spmm_f = {k: _fwd(f, x) for k, f in spmm.items()}
        spmm_b = {k: _vjp(f, x, ct) for k, f in spmm.items()}
        if use_torch:
            tx = torch.tensor(np.asarray(x, np.float32), device=dev).to(tdt)
            tcsr = torch.sparse_csr_tensor(
                torch.tensor(adj.indptr.astype(np.int64), device=dev),
                torch.tensor(adj.indices.astype(np.int64), device=dev),
                torch.tensor(adj.data, device=dev).to(tdt),
                size=adj.shape,
            )
            spmm_f["torch_sparse_csr"] = _torch_sync(lambda: tcsr @ tx)
        spmm_bytes = 2 * V * n * b + adj.nnz * (4 + b) + (V + 1) * 4
        yield "spmm", "fwd", spmm_bytes, spmm_f
        yield "spmm", "bwd", spmm_bytes, spmm_b
    # the max semiring in the same kernel (jax.ops leaves -inf in empty segments,
    # jaxcsr 0: its error column is not comparable there; Pallas vs XLA is checked)
    seg_max = {
        "jaxcsr_pallas": lambda m: matmul(A, m, reduce="max", **pallas),
        "jaxcsr_xla": lambda m: matmul(A, m, reduce="max", impl="xla"),
        "segment_max": lambda m: jax.ops.segment_max(m, dst, V),
    }
    yield "segment_max", "fwd", seg_bytes, {k: _fwd(f, msgs) for k, f in seg_max.items()}
    yield "segment_max", "bwd", seg_bytes, {k: _vjp(f, msgs, ct) for k, f in seg_max.items()}


def _structures(args, rng):
    """The graphs, then the few-segment reductions."""
    for name in args.graphs:
        yield load_graph(name)
    for k in args.segments:
        size = 300 if args.smoke else SEGMENT_VALUES
        yield Segments(f"{k}_segments", np.sort(rng.integers(0, k, size)), k)


def main(argv=None) -> dict:
    args = _parse(argv)
    platform = jax.default_backend()
    if not args.smoke and platform != "gpu":
        raise SystemExit(f"no GPU: jax backend is {platform!r} (use --smoke on CPU)")
    interpret = args.smoke
    use_torch = torch is not None and not args.smoke and torch.cuda.is_available()
    device = str(jax.devices()[0].device_kind)
    copy_gbps = _copy_bandwidth(8 if args.smoke else 1024)
    print(f"{device}: jax {jax.__version__}, HBM copy {copy_gbps:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for graph in _structures(args, rng):
        for dtype in args.dtypes:
            for n in args.features:
                for workload, pass_, nbytes, systems in _cases(
                    graph, n, jnp.dtype(dtype), rng, interpret, use_torch
                ):
                    results = {}
                    ref = None
                    for system, thunk in systems.items():
                        try:
                            timing, out = measure.time_thunk(thunk, args.repeats)
                        except Exception as err:
                            if system == "jaxcsr_pallas":  # the kernel under test must run
                                raise
                            results[system] = {"error": f"{type(err).__name__}: {err}"[:200]}
                            continue
                        got = measure.to_numpy(out)
                        if ref is None:
                            ref = got  # jaxcsr_pallas runs first
                            again = measure.to_numpy(thunk())
                            if not np.array_equal(got, again, equal_nan=True):
                                raise SystemExit(
                                    f"pallas kernel is not deterministic: {graph.name} "
                                    f"{workload} {pass_} N={n} {dtype}"
                                )
                        err = measure.relative_error(got, ref)
                        results[system] = {
                            **vars(timing),
                            "rel_error_vs_pallas": err,
                            "gbps": nbytes / timing.median_s / 1e9,
                            "pct_copy_bw": 100 * nbytes / timing.median_s / 1e9 / copy_gbps,
                        }
                    xla_err = results.get("jaxcsr_xla", {}).get("rel_error_vs_pallas", 0.0)
                    if not xla_err <= measure.TOLERANCE[dtype]:
                        raise SystemExit(
                            f"pallas kernel disagrees with the XLA path: {graph.name} {workload} "
                            f"{pass_} N={n} {dtype}: relative error {xla_err:.2e}"
                        )
                    row = dict(
                        graph=graph.name,
                        workload=workload,
                        pass_=pass_,
                        n=n,
                        dtype=dtype,
                        floor_bytes=nbytes,
                        systems=results,
                    )
                    rows.append(row)
                    line = " ".join(
                        f"{k}={v['median_s'] * 1e3:.3f}ms({v['pct_copy_bw']:.0f}%)"
                        for k, v in results.items()
                        if "median_s" in v
                    )
                    print(f"{graph.name} {workload} {pass_} N={n} {dtype}: {line}", flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "jax": jax.__version__,
        "torch": None if torch is None else torch.__version__,
        "copy_gbps": copy_gbps,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_results.json").write_text(json.dumps(result, indent=1))
    systems = sorted({s for r in rows for s in r["systems"]})
    md = [
        f"# jaxcsr GPU benchmark ({result['date']}, {device}, jax {jax.__version__})",
        f"HBM copy bandwidth: {copy_gbps:.0f} GB/s. Cells: ms (% of copy bandwidth).",
        "",
        "| graph | workload | pass | N | dtype | " + " | ".join(systems) + " |",
        "|" + "---|" * (5 + len(systems)),
    ]
    for r in rows:
        cells = []
        for s in systems:
            v = r["systems"].get(s)
            cells.append(
                "-"
                if v is None
                else "error"
                if "error" in v
                else f"{v['median_s'] * 1e3:.3f} ({v['pct_copy_bw']:.0f}%)"
            )
        md.append(
            f"| {r['graph']} | {r['workload']} | {r['pass_']} | {r['n']} | {r['dtype']} | "
            + " | ".join(cells)
            + " |"
        )
    (args.out / "gpu_results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return result


if __name__ == "__main__":
    jax.config.update("jax_bcoo_cusparse_lowering", True)
    main()
