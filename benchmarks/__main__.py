"""Run the jaxcsr benchmark: ``python -m benchmarks [options]``.

Times jaxcsr against every available peer in one process on real graphs, checks
every peer's output against jaxcsr's first, measures the machine's memory
bandwidth, and writes a table (stdout), ``results.json``, ``results.md`` and
``speedup.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.catalog import PASSES, PEERS, WORKLOADS

# jax, numpy and the systems are imported in main(): `--help` answers at once.

DEFAULT_OUT = Path(__file__).parent / "results" / "latest"
QUICK_OUT = Path(__file__).parent / "results" / "quick"


def _csv(kind):
    def parse(text: str) -> tuple:
        return tuple(kind(v) for v in text.split(",") if v)

    parse.__name__ = f"comma-separated {kind.__name__}"  # named in argparse's errors
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--graphs",
        type=_csv(str),
        default="tolokers",
        help="embedded graph names (tolokers, musae_github, planetoid_pubmed, cora) "
        "or .npz paths, comma-separated",
    )
    p.add_argument(
        "--features",
        type=_csv(int),
        default="16,64,256",
        help="feature widths N, comma-separated",
    )
    p.add_argument(
        "--dtypes",
        type=_csv(str),
        default="float32,bfloat16",
        help="comma-separated subset of float32,bfloat16",
    )
    p.add_argument(
        "--workloads",
        type=_csv(str),
        default=",".join(WORKLOADS),
        help="comma-separated subset of the default",
    )
    p.add_argument(
        "--peers",
        type=_csv(str),
        default=",".join(PEERS),
        help="comma-separated subset of the default (peers not installed are skipped)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=argparse.SUPPRESS,
        help="timed runs per system, median (default 3; 5 with --quick)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds of timed rounds per cell: after --repeats rounds, more rounds until "
        "they have taken this long, at most --max-repeats (medians of a few runs of a "
        "millisecond are noise); 0: exactly --repeats (default 2; 0 with --quick)",
    )
    p.add_argument(
        "--max-repeats",
        type=int,
        default=25,
        help="most timed rounds per cell under --min-time",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=120.0,
        help="seconds a system may take in one cell (first call included); past it, its "
        "remaining runs are skipped and the cell reports it as timed out",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=argparse.SUPPRESS,
        help="output folder (default benchmarks/results/latest; quick/ with --quick)",
    )
    p.add_argument(
        "--no-models",
        action="store_true",
        help="skip the models section (whole training steps: GCN on cora and tolokers, GAT "
        "on cora and planetoid_pubmed, jraph and molecule batches; --quick: cora's and the "
        "molecules')",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument(
        "--no-malloc-hugepages",
        action="store_true",
        help="do not restart with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (see docs/benchmarks.md)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: cora, N=8, float32, 5 runs per system; checks that every system "
        "runs and agrees -- its ratios are not the benchmark's",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.graphs, args.features, args.dtypes = ("cora",), (8,), ("float32",)
        args.budget = min(args.budget, 30.0)
    if "out" not in vars(args):  # a smoke run never overwrites the last full run's folder
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    if "repeats" not in vars(args):
        args.repeats = 5 if args.quick else 3
    if "min_time" not in vars(args):
        args.min_time = 0.0 if args.quick else 2.0
    for name, allowed in (("peers", PEERS), ("workloads", WORKLOADS)):
        bad = set(getattr(args, name)) - set(allowed)
        if bad:
            p.error(f"unknown {name}: {sorted(bad)}; choose from {list(allowed)}")
    bad = set(args.dtypes) - {"float32", "bfloat16"}
    if bad:
        p.error(f"unknown dtypes: {sorted(bad)}; choose from float32, bfloat16")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.min_time < 0:
        p.error("--min-time must be >= 0")
    args.max_repeats = max(args.max_repeats, args.repeats)
    return args


def environment() -> dict[str, Any]:
    import jax
    import numpy as np
    import scipy

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import torch

        torch_version, torch_threads = torch.__version__, torch.get_num_threads()
    except ImportError:
        torch_version, torch_threads = "not installed", None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "torch": torch_version,
        "torch_threads": torch_threads,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s"


def run_case(
    case,
    repeats: int,
    budget_s: float,
    progress=None,
    min_time_s: float = 0.0,
    max_repeats: int | None = None,
) -> dict[str, Any]:
    """Times every system of a case in turns; peers are checked against jaxcsr's output.

    First each system's first call (compilation + one run), its output checked at once:
    a system whose first call takes longer than ``budget_s`` is reported as timed out
    (no timing), one that raises as an error. Then one warm-up round and ``repeats``
    timed rounds or more (``min_time_s``, ``max_repeats``: :func:`measure.time_rounds`),
    each calling every system once in turn, so that a slow spell of the
    machine (or the first runs after a cell's inputs were built) falls on every system
    rather than on whichever is timed first; a system whose calls pass the budget
    leaves the later rounds with the runs it finished. ``progress(name, median_s,
    spent_s)`` is called for each system at the end.
    """
    import numpy as np

    from benchmarks import measure

    results: dict[str, Any] = {}
    firsts: dict[str, float] = {}
    tol = measure.TOLERANCE[case.dtype]
    reference = None
    for name, thunk in case.systems.items():
        try:
            first, out = measure.timed(thunk)
        except Exception as err:  # a peer that cannot run this cell is reported, not fatal
            if name == "jaxcsr":
                raise
            results[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            continue
        if name != "jaxcsr" and first > budget_s:
            results[name] = {
                "error": f"timed out: first call took {first:.0f} s, past the "
                f"{budget_s:.0f} s budget"
            }
            if progress:
                progress(name, None, first)
            continue
        got = measure.to_numpy(out)
        del out
        if name == "jaxcsr":
            reference = got
            results[name] = {}
            if case.reference is not None:  # jaxcsr itself against float64 numpy/scipy
                err = measure.relative_error(reference, np.asarray(case.reference()))
                results[name] = {"rel_error_float64": err, "mismatch": not err <= tol}
        else:
            got = case.to_reference.get(name, lambda y: y)(got)
            err = measure.relative_error(got, reference)
            results[name] = {"rel_error": err, "mismatch": not err <= tol}
        firsts[name] = first
        del got
    thunks = {name: case.systems[name] for name in firsts}
    timings, spent = measure.time_rounds(
        thunks,
        firsts,
        repeats,
        budget_s=budget_s,
        unbounded=("jaxcsr",),
        min_time_s=min_time_s,
        max_repeats=max_repeats,
    )  # jaxcsr runs every round; each peer within its budget
    for name, timing in timings.items():
        results[name] = {**vars(timing), **results[name]}
        if progress:
            progress(name, timing.median_s, spent[name])
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    args = parse_args(argv)
    import numpy as np

    from benchmarks import measure, report, systems
    from benchmarks.datasets import load_graph

    env = environment()
    print(
        f"jaxcsr benchmark on {env['cpu']} ({env['cpu_count']} cores), jax {env['jax']}, "
        f"torch {env['torch']}",
        file=sys.stderr,
    )
    from jaxcsr import machine

    print(f"machine profile: {machine.profile().summary()}", file=sys.stderr)
    print("measuring memory bandwidth ...", file=sys.stderr)
    bw = measure.memory_bandwidth(64 if args.quick else 512)
    print(f"  read {bw['read_gbps']:.1f} GB/s, copy {bw['copy_gbps']:.1f} GB/s", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    per_graph = len(args.features) * len(args.dtypes)
    total = len(args.graphs) * per_graph * sum(PASSES[w] for w in args.workloads)
    start = time.perf_counter()
    if args.quick:
        print("smoke run (--quick): ratios on cora at N=8 are not the benchmark's", file=sys.stderr)

    def progress(name, median_s, spent_s):
        shown = "timed out" if median_s is None else f"{median_s * 1e3:.2f} ms"
        print(f"\n      {name:<21} {shown:>10}  ({spent_s:.1f} s)", end="", file=sys.stderr)

    for graph_name in args.graphs:
        graph = load_graph(graph_name)
        for dtype in args.dtypes:
            for n in args.features:
                cases = systems.build_cases(
                    graph, n, dtype, peers=args.peers, workloads=args.workloads, rng=rng
                )
                for case in cases:
                    elapsed = time.perf_counter() - start
                    eta = elapsed / len(rows) * (total - len(rows)) if rows else None
                    label = (
                        f"[{len(rows) + 1:>3}/{total}] {graph.name} {case.workload} "
                        f"{case.pass_} N={n} {dtype}  (elapsed {_clock(elapsed)}, "
                        f"ETA {'?' if eta is None else _clock(eta)})"
                    )
                    print(label, end="", flush=True, file=sys.stderr)
                    if case.strategy:
                        print(f"\n      jaxcsr runs: {case.strategy}", end="", file=sys.stderr)
                    res = run_case(
                        case,
                        args.repeats,
                        args.budget,
                        progress,
                        min_time_s=args.min_time,
                        max_repeats=args.max_repeats,
                    )
                    floor_s = case.floor_bytes / (bw["copy_gbps"] * 1e9)
                    rows.append(
                        {
                            "graph": graph.name,
                            "num_nodes": graph.num_nodes,
                            "num_edges": graph.num_edges,
                            "workload": case.workload,
                            "pass": case.pass_,
                            "n_features": n,
                            "dtype": dtype,
                            "floor_bytes": case.floor_bytes,
                            "floor_s": floor_s,
                            "strategy": case.strategy,
                            "systems": res,
                        }
                    )
                    best = min(
                        (
                            r["median_s"]
                            for k, r in res.items()
                            if k != "jaxcsr" and "median_s" in r
                        ),
                        default=None,
                    )
                    msg = f"\n      jaxcsr {res['jaxcsr']['median_s'] * 1e3:.2f} ms"
                    if best is not None:
                        msg += f", best peer {best * 1e3:.2f} ms"
                    print(msg, file=sys.stderr)
                    del case
                    gc.collect()
    print(f"all cells in {_clock(time.perf_counter() - start)}", file=sys.stderr)
    model_rows = []
    if not args.no_models:
        from benchmarks import models

        print("models: whole training steps", file=sys.stderr)
        graphs = {"cora": ("gcn", "gat")} if args.quick else models.MAIN_JOB
        batches = ("molecule",) if args.quick else models.BATCHES
        model_rows = models.run(
            graphs, batches, max(args.repeats, 5), args.seed,
            progress=lambda line: print(f"  {line}", file=sys.stderr),
        )  # fmt: skip
    cost = _run_cost(started)
    if cost["peak_rss_kib"] is not None:
        print(f"peak resident memory {cost['peak_rss_kib'] / 2**20:.1f} GiB", file=sys.stderr)
    shown = ["jaxcsr", *[p for p in PEERS if any(p in r["systems"] for r in rows)]]
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m benchmarks "
        + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "environment": env,
        "machine_profile": dataclasses.asdict(machine.profile()),
        "bandwidth": bw,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "run": cost,
        "rows": rows,
        "models": model_rows,
    }
    if args.quick:
        print("SMOKE RUN (--quick): checks every system, not a benchmark; see docs/benchmarks.md")
    print(report.table(rows, shown, markdown=False))
    print(report.LEGEND.replace("`", ""))
    print(report.summary_line(rows))
    if model_rows:
        print("\n".join(report.models_section(model_rows)))
    failed = report.errors(rows)
    if failed:
        print("Peers that could not run a cell:\n" + "\n".join(failed).replace("`", ""))
    paths = report.write_outputs(result, args.out, shown)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return result


def _run_cost(started: float) -> dict[str, Any]:
    """The run's wall time from ``main``'s start (install and imports excluded) and the
    process's peak resident memory (Linux ``ru_maxrss``; ``None`` elsewhere)."""
    peak_kib = None
    try:
        import resource

        if sys.platform == "linux":
            peak_kib = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except ImportError:
        pass
    return {"wall_s": round(time.perf_counter() - started, 1), "peak_rss_kib": peak_kib}


HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def _reexec_with_hugepage_malloc() -> None:
    """Restarts this process with glibc's transparent-huge-page malloc tunable.

    XLA:CPU writes every large result into freshly mmap-ed memory; with 4 KiB pages
    the page faults, not DRAM, bound such ops (measured: a 66 MB row gather takes
    23 ms without the tunable and 5.5 ms with it). numpy already asks for huge pages
    for large arrays. The tunable applies to every system in the process, so the
    comparison stays like for like; ``--no-malloc-hugepages`` measures without it.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if sys.platform != "linux" or "glibc.malloc.hugetlb" in tunables:
        return
    env = dict(os.environ, GLIBC_TUNABLES=":".join(t for t in (tunables, HUGEPAGE_TUNABLE) if t))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *sys.argv[1:]], env)


if __name__ == "__main__":
    if "--no-malloc-hugepages" not in sys.argv:
        _reexec_with_hugepage_malloc()
    main()
