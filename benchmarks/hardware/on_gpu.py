"""GPU benchmark for the Pallas Triton kernel: ``python -m benchmarks.hardware.on_gpu``.

Runs from the source tree on a CUDA machine's own python (jax, numpy, scipy,
torch; nothing to install). In one process it

1. checks ``impl="pallas_gpu"`` against ``impl="xla"`` on fresh random inputs for
   every graph, workload and dtype (forward and backward), and that two runs of the
   kernel are bit-identical;
2. measures HBM copy bandwidth (``x * 2`` into a donated buffer);
3. times forward and backward for jaxcsr (Pallas and XLA
   paths), ``jax.ops.segment_sum`` (unsorted and sorted), BCSR with the cuSPARSE
   lowering, torch (``sparse_csr`` mm = cuSPARSE, ``index_add_``) and
   torch_geometric's ``scatter`` where installed; and the ``reduce="max"`` kernel
   against ``jax.ops.segment_max``; on the embedded graphs, on
   ``law_cnr2000_sym`` when ``../shared/data/matrices`` is there (or any ``.npz``
   path in ``--graphs``), and on the 1- and 24-segment reductions of 400k values
   (``--segments``; a molecular-dynamics energy sum);
4. prints one table with achieved GB/s and % of copy bandwidth and writes
   ``gpu_results.json`` and ``gpu_results.md`` to ``--out`` (rewritten after every
   cell group, so a run stopped by a time limit keeps what it measured).

Timing: each sample is a batch of back-to-back calls (enough for about 2 ms) waited
for once (``block_until_ready`` and ``torch.cuda.synchronize``), divided by the batch
size: host dispatch overlaps the device work, as in a training loop, and a 20 us
kernel is not timed as its launch. The median of ``--repeats`` samples is reported.
Inputs are not rotated: a cell whose operands fit in the 60 MB L2 can run from it.

A failing cell (the kernel raising, disagreeing with the XLA path, or two runs not
bit-identical) is recorded and the run goes on; the exit status is then 1.
``--deadline`` (seconds) stops starting new cell groups, for a device lease.

``--smoke`` runs the same code on CPU in Pallas interpret mode on a tiny input (the
test suite does this so the script cannot rot).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
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
    p.add_argument(
        "--skip",
        default="",
        help="peers left out of every cell, comma-separated (e.g. segment_sum: "
        "jax.ops' bfloat16 scatter takes seconds per call on an H200)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-latest"))
    p.add_argument(
        "--deadline", type=float, default=None, help="seconds after which no new group starts"
    )
    p.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny input")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        help="rewrite the gpu_results.md beside this gpu_results.json (no GPU needed)",
    )
    args = p.parse_args(argv)
    args.graphs = [g for g in args.graphs.split(",") if g and _graph_present(g)]
    args.segments = [int(k) for k in args.segments.split(",") if k]
    args.features = [int(v) for v in args.features.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.skip = {k for k in args.skip.split(",") if k}
    if args.skip & {KERNEL, XLA_PATH}:
        p.error(f"--skip: {KERNEL} and {XLA_PATH} are what every cell checks")
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


def _wait(out):
    """Waits for jax results and for the CUDA stream (torch runs on it asynchronously)."""
    jax.block_until_ready(out)
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def _time_batched(thunk, repeats: int, target_s: float = 2e-3) -> tuple[measure.Timing, object]:
    """First call (compile) apart, one warm-up, then ``repeats`` samples of a batch of
    back-to-back calls waited for once; each sample is the batch's time per call."""
    t0 = time.perf_counter()
    out = _wait(thunk())
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    _wait(thunk())
    one = time.perf_counter() - t0
    batch = int(min(100, max(1, target_s // max(one, 1e-6))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batch):
            last = thunk()
        _wait(last)
        samples.append((time.perf_counter() - t0) / batch)
    return measure.Timing.of(first, samples), out


# The index arrays (a matrix, segment ids) are jit arguments, as in a training step that
# receives its graph: closed over, they would be compiled in as constants.


def _vjp(f, p, c, op):
    g = jax.jit(lambda p, c, op: jax.vjp(lambda p: f(p, op), p)[1](c)[0])
    return lambda: g(p, c, op)


def _fwd(f, p, op):
    g = jax.jit(f)
    return lambda: g(p, op)


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
        "jaxcsr_pallas": (lambda m, A: matmul(A, m, **pallas), A),
        "jaxcsr_xla": (lambda m, A: matmul(A, m, impl="xla"), A),
        "segment_sum": (lambda m, d: jax.ops.segment_sum(m, d, V), dst),
    }
    seg_f = {k: _fwd(f, msgs, op) for k, (f, op) in seg.items()}
    seg_b = {k: _vjp(f, msgs, ct, op) for k, (f, op) in seg.items()}
    sorted_f = lambda m, d: jax.ops.segment_sum(m, d, V, indices_are_sorted=True)  # noqa: E731
    seg_f["segment_sum_sorted"] = _fwd(sorted_f, msgs[order], dst_sorted)
    seg_bytes = E * n * b + V * n * b + E * 4
    if use_torch:
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[np.dtype(dtype).name]
        dev = "cuda"
        tm = torch.tensor(np.asarray(msgs, np.float32), device=dev).to(tdt)
        tdst = torch.tensor(graph.dst, device=dev)
        seg_f["torch_index_add"] = lambda: torch.zeros(V, n, dtype=tdt, device=dev).index_add_(
            0, tdst, tm
        )
        if pyg_scatter is not None:
            seg_f["pyg_scatter"] = lambda: pyg_scatter(tm, tdst, 0, dim_size=V, reduce="sum")
    yield "segment", "fwd", seg_bytes, seg_f
    yield "segment", "bwd", seg_bytes, seg_b
    if not isinstance(graph, Segments):  # the few-segment case has no adjacency
        adj = graph.normalized_adjacency()
        B = CSRMatrix.from_scipy(adj, backends=backends)
        B = B.with_data(B.data.astype(dtype))
        x = jnp.asarray(rng.uniform(-1, 1, (V, n)), dtype)
        bcsr, _ = jax_sparse_twins(adj, dtype)
        spmm = {
            "jaxcsr_pallas": (lambda x, B: matmul(B, x, **pallas), B),
            "jaxcsr_xla": (lambda x, B: matmul(B, x, impl="xla"), B),
            "bcsr_cusparse": (lambda x, bcsr: bcsr @ x, bcsr),
        }
        spmm_f = {k: _fwd(f, x, op) for k, (f, op) in spmm.items()}
        spmm_b = {k: _vjp(f, x, ct, op) for k, (f, op) in spmm.items()}
        if use_torch:
            tx = torch.tensor(np.asarray(x, np.float32), device=dev).to(tdt)
            tcsr = torch.sparse_csr_tensor(
                torch.tensor(adj.indptr.astype(np.int64), device=dev),
                torch.tensor(adj.indices.astype(np.int64), device=dev),
                torch.tensor(adj.data, device=dev).to(tdt),
                size=adj.shape,
            )
            spmm_f["torch_sparse_csr"] = lambda: tcsr @ tx
        spmm_bytes = 2 * V * n * b + adj.nnz * (4 + b) + (V + 1) * 4
        yield "spmm", "fwd", spmm_bytes, spmm_f
        yield "spmm", "bwd", spmm_bytes, spmm_b
    # the max semiring in the same kernel (jax.ops leaves -inf in empty segments,
    # jaxcsr 0: its error column is not comparable there; Pallas vs XLA is checked)
    seg_max = {
        "jaxcsr_pallas": (lambda m, A: matmul(A, m, reduce="max", **pallas), A),
        "jaxcsr_xla": (lambda m, A: matmul(A, m, reduce="max", impl="xla"), A),
        "segment_max": (lambda m, d: jax.ops.segment_max(m, d, V), dst),
    }
    yield "segment_max", "fwd", seg_bytes, {k: _fwd(f, msgs, op) for k, (f, op) in seg_max.items()}
    yield (
        "segment_max",
        "bwd",
        seg_bytes,
        {k: _vjp(f, msgs, ct, op) for k, (f, op) in seg_max.items()},
    )


def _run_cell(systems, repeats, deterministic_check):
    """Times every system of one cell; the kernel (first) is the reference. Returns
    ``(results, failure)``; failure is a message or None."""
    results, ref, failure = {}, None, None
    for system, thunk in systems.items():
        try:
            timing, out = _time_batched(thunk, repeats)
        except Exception as err:
            results[system] = {"error": f"{type(err).__name__}: {err}"[:300]}
            if system == "jaxcsr_pallas":  # the kernel under test must run
                return results, f"kernel raised {results[system]['error']}"
            continue
        got = measure.to_numpy(out)
        if ref is None:
            ref = got  # jaxcsr_pallas runs first
            if deterministic_check and not np.array_equal(
                got, measure.to_numpy(_wait(thunk())), equal_nan=True
            ):
                failure = "two runs of the kernel differ"
        results[system] = {
            **vars(timing),
            "rel_error_vs_pallas": measure.relative_error(got, ref),
        }
    return results, failure


KERNEL, XLA_PATH = "jaxcsr_pallas", "jaxcsr_xla"
PRESORTED = "segment_sum_sorted"  # its values come sorted: the sort is not charged


def _ratios(row) -> tuple[str, str]:
    """The kernel's speed-up over the best peer that takes the same unsorted inputs
    (``peer / kernel``, and which peer), and over jaxcsr's XLA path."""
    systems = row["systems"]
    kernel = systems.get(KERNEL, {}).get("median_s")
    if kernel is None:
        return "-", "-"
    peers = {
        k: v["median_s"]
        for k, v in systems.items()
        if k not in (KERNEL, XLA_PATH, PRESORTED) and "median_s" in v
    }
    best = min(peers, key=peers.get) if peers else None
    vs_peer = "-" if best is None else f"{peers[best] / kernel:.2f}x {best}"
    xla = systems.get(XLA_PATH, {}).get("median_s")
    return vs_peer, "-" if xla is None else f"{xla / kernel:.2f}x"


def render(result) -> list[str]:
    """The markdown table of one run: every system's ms (% of copy bandwidth), then the
    kernel's ratios."""
    rows = result["rows"]
    systems = list(dict.fromkeys(s for r in rows for s in r["systems"]))
    md = [
        f"# jaxcsr GPU benchmark ({result['date']}, {result['device']}, jax {result['jax']})",
        "",
        f"`{result.get('command', 'python -m benchmarks.hardware.on_gpu')}`",
        "",
        f"HBM copy bandwidth: {result['copy_gbps']:.0f} GB/s. Cells: ms (% of copy bandwidth "
        "at the cell's floor bytes); `error`: the system raised (see the JSON). "
        f"`vs best peer`: the best peer's time over the kernel's, among peers given the "
        f"same unsorted inputs (`{PRESORTED}` is given values sorted outside the timing); "
        "`vs XLA path`: jaxcsr's `impl=\"xla\"` time over the kernel's.",
        "",
        "| graph | workload | pass | N | dtype | status | vs best peer | vs XLA path | "
        + " | ".join(systems)
        + " |",
        "|" + "---|" * (8 + len(systems)),
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
        vs_peer, vs_xla = _ratios(r)
        md.append(
            f"| {r['graph']} | {r['workload']} | {r['pass_']} | {r['n']} | {r['dtype']} | "
            f"{r['status']} | {vs_peer} | {vs_xla} | " + " | ".join(cells) + " |"
        )
    if result.get("skipped_groups"):
        md += ["", "Past `--deadline`, not run: " + ", ".join(result["skipped_groups"]) + "."]
    return md


def _write(out: Path, result) -> list[str]:
    """Writes ``gpu_results.json`` and ``gpu_results.md``; returns the table's lines."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_results.json").write_text(json.dumps(result, indent=1))
    md = render(result)
    (out / "gpu_results.md").write_text("\n".join(md) + "\n")
    return md


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.render is not None:
        result = json.loads(args.render.read_text())
        md = render(result)
        (args.render.parent / "gpu_results.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
        return result
    start = time.perf_counter()
    platform = jax.default_backend()
    if not args.smoke and platform != "gpu":
        raise SystemExit(f"no GPU: jax backend is {platform!r} (use --smoke on CPU)")
    interpret = args.smoke
    use_torch = torch is not None and not args.smoke and torch.cuda.is_available()
    device = str(jax.devices()[0].device_kind)
    copy_gbps = _copy_bandwidth(8 if args.smoke else 1024)
    print(f"{device}: jax {jax.__version__}, HBM copy {copy_gbps:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "jax": jax.__version__,
        "torch": None if torch is None else torch.__version__,
        "copy_gbps": copy_gbps,
        "command": " ".join(["python -m benchmarks.hardware.on_gpu", *(argv or sys.argv[1:])]),
        "rows": [],
        "skipped_groups": [],
    }
    rows, failures = result["rows"], []
    groups = [(n, dtype, g) for n in args.features for dtype in args.dtypes for g in args.graphs]
    groups += [(n, dtype, k) for n in args.features for dtype in args.dtypes for k in args.segments]
    for n, dtype, structure in groups:
        if args.deadline is not None and time.perf_counter() - start > args.deadline:
            result["skipped_groups"].append(f"{structure} N={n} {dtype}")
            continue
        if isinstance(structure, int):
            size = 300 if args.smoke else SEGMENT_VALUES
            graph = Segments(
                f"{structure}_segments", np.sort(rng.integers(0, structure, size)), structure
            )
        else:
            graph = load_graph(structure)
        for workload, pass_, nbytes, systems in _cases(
            graph, n, jnp.dtype(dtype), rng, interpret, use_torch
        ):
            systems = {k: v for k, v in systems.items() if k not in args.skip}
            results, failure = _run_cell(systems, args.repeats, deterministic_check=True)
            for v in results.values():
                if "median_s" in v:
                    v["gbps"] = nbytes / v["median_s"] / 1e9
                    v["pct_copy_bw"] = 100 * v["gbps"] / copy_gbps
            xla_err = results.get("jaxcsr_xla", {}).get("rel_error_vs_pallas", 0.0)
            if failure is None and not xla_err <= measure.TOLERANCE[dtype]:
                failure = f"kernel disagrees with the XLA path: relative error {xla_err:.2e}"
            label = f"{graph.name} {workload} {pass_} N={n} {dtype}"
            if failure is not None:
                failures.append(f"{label}: {failure}")
            rows.append(
                dict(
                    graph=graph.name,
                    workload=workload,
                    pass_=pass_,
                    n=n,
                    dtype=dtype,
                    floor_bytes=nbytes,
                    status="ok" if failure is None else "FAILED",
                    failure=failure,
                    systems=results,
                )
            )
            line = " ".join(
                f"{k}={v['median_s'] * 1e3:.3f}ms({v['pct_copy_bw']:.0f}%)"
                for k, v in results.items()
                if "median_s" in v
            )
            print(f"{label}: {line}" + (f" FAILED: {failure}" if failure else ""), flush=True)
        result["failures"] = failures
        _write(args.out, result)
    md = _write(args.out, result)
    print("\n".join(md))
    if result["skipped_groups"]:
        print(f"past --deadline, not run: {', '.join(result['skipped_groups'])}")
    if failures:
        print("FAILED cells:\n  " + "\n  ".join(failures))
        if not args.smoke:
            raise SystemExit(1)
    return result


if __name__ == "__main__":
    jax.config.update("jax_bcoo_cusparse_lowering", True)
    main()
