"""Large outputs and glibc's allocator: ``python -m benchmarks.studies.allocator``.

On CPU, XLA and torch allocate every output anew. glibc serves an allocation above its
mmap threshold (at most 32 MiB by default) with fresh pages from the kernel, which
zeroes each one on first touch: a product whose output is an ``(E, N)`` array of
edges then writes its output twice. The study times, in one child process per
``GLIBC_TUNABLES`` setting (the tunables are read at process start), systems timed in
turns on a real graph's destinations ``ids`` (``E`` edges, ``V`` nodes):

``row gather``       jaxcsr's ``A.T @ y`` for ``A = CSRMatrix.from_indices(ids, V)``
                     (``y[ids]``, the segment sum's backward): an ``(E, N)`` output
``jnp.take``         ``y[ids]`` in XLA
``torch``            ``torch.index_select(y, 0, ids)`` (where torch installs)
``x * 2``            an ``(E, N)`` elementwise op, the same output size
``column gather``    jaxcsr's ``c @ A`` for ``c`` of shape ``(N, V)``: ``c[:, ids]``, the
                     backward of ``values @ A.T`` (an ``(N, E)`` output, feature-major)
``take columns``     ``c[:, ids]`` in XLA
``segment sum``      jaxcsr's ``A @ v``: a ``(V, N)`` output, the control

Settings (the environment of each child process):

``glibc default``      no ``GLIBC_TUNABLES``: what a user's process has. glibc advises
                       nothing; jaxcsr's kernels advise huge pages over their own large
                       fresh outputs (docs/cpu.md), XLA and torch do not
``no advice``          the same with ``JAXCSR_HUGE_PAGES=0``: jaxcsr's kernels advise
                       nothing either (the kernels before that advice)
``hugetlb``            ``glibc.malloc.hugetlb=1``, the benchmarks' setting: glibc
                       advises huge pages over every block it maps, for every system
``heap reuse``         plus ``glibc.malloc.mmap_threshold`` 1 GiB and
                       ``glibc.malloc.trim_threshold`` 4 GiB: large blocks come from
                       the heap and stay there, so a freed output's pages are reused

Writes ``allocator.json`` and ``allocator.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HUGETLB = "glibc.malloc.hugetlb=1"
HEAP_REUSE = HUGETLB + ":glibc.malloc.mmap_threshold=1073741824"
HEAP_REUSE += ":glibc.malloc.trim_threshold=4294967296"
# each setting's environment: None removes the variable
SETTINGS: dict[str, dict[str, str | None]] = {
    "glibc default": {"GLIBC_TUNABLES": None, "JAXCSR_HUGE_PAGES": None},
    "no advice": {"GLIBC_TUNABLES": None, "JAXCSR_HUGE_PAGES": "0"},
    "hugetlb": {"GLIBC_TUNABLES": HUGETLB, "JAXCSR_HUGE_PAGES": None},
    "heap reuse": {"GLIBC_TUNABLES": HEAP_REUSE, "JAXCSR_HUGE_PAGES": None},
}
SYSTEMS = ("row gather", "jnp.take", "torch", "x * 2", "column gather", "take columns")
SYSTEMS += ("segment sum",)


def child(graph_name: str, features: list[int], dtype: str, repeats: int) -> list[dict]:
    """One process: every system at every width, timed in turns; rows of medians."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcsr
    from benchmarks import measure
    from benchmarks.datasets import load_graph

    graph = load_graph(graph_name)
    V, ids = graph.num_nodes, graph.dst.astype(np.int32)
    A = jaxcsr.CSRMatrix.from_indices(ids, num_rows=V)
    jids = jnp.asarray(ids)
    rng = np.random.default_rng(0)
    try:
        import torch
    except ImportError:
        torch = None
    gather = jax.jit(lambda A, y: A.T @ y)
    take = jax.jit(lambda y, i: y[i])
    columns = jax.jit(lambda A, c: c @ A)
    take_columns = jax.jit(lambda c, i: c[:, i])
    double = jax.jit(lambda x: x * 2)
    segment = jax.jit(lambda A, v: A @ v)
    tids = None if torch is None else torch.from_numpy(ids.astype(np.int64))
    rows = []
    for n in features:
        y = jnp.asarray(rng.standard_normal((V, n)), dtype)
        v = jnp.asarray(rng.standard_normal((ids.size, n)), dtype)
        c = jnp.asarray(rng.standard_normal((n, V)), dtype)
        thunks = {
            "column gather": lambda c=c: columns(A, c),
            "take columns": lambda c=c: take_columns(c, jids),
            "row gather": lambda y=y: gather(A, y),
            "jnp.take": lambda y=y: take(y, jids),
            "x * 2": lambda v=v: double(v),
            "segment sum": lambda v=v: segment(A, v),
        }
        if torch is not None:
            ty = torch.from_numpy(np.asarray(y, np.float32)).to(getattr(torch, dtype))
            thunks["torch"] = lambda ty=ty: torch.index_select(ty, 0, tids)
        timings, outs = measure.time_in_turns(thunks, repeats)
        want = np.asarray(outs["jnp.take"], np.float32)
        for name in ("row gather", "torch"):
            if name in outs:  # the gathers agree exactly
                np.testing.assert_array_equal(measure.to_numpy(outs[name]), want)
        np.testing.assert_array_equal(
            measure.to_numpy(outs["column gather"]), measure.to_numpy(outs["take columns"])
        )
        out_bytes = ids.size * n * jnp.dtype(dtype).itemsize
        rows.append(
            {
                "features": n,
                "output_mb": out_bytes / 1e6,
                "ms": {k: t.median_s * 1e3 for k, t in timings.items()},
            }
        )
    return rows


def _environment(setting: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with ``setting`` applied."""
    env = dict(os.environ)
    for name, value in setting.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return env


def markdown(result: dict) -> str:
    names = list(result["settings"])
    lines = [
        f"### Large outputs and glibc's allocator ({result['graph']}, {result['dtype']}; "
        f"{result['edges']} edges)",
        "",
        "Medians in ms, systems timed in turns in one process per setting: "
        "`glibc default` = no `GLIBC_TUNABLES` (jaxcsr's kernels advise huge pages over "
        "their large fresh outputs), `no advice` = the same with `JAXCSR_HUGE_PAGES=0`, "
        f"`hugetlb` = `GLIBC_TUNABLES={HUGETLB}` (the benchmarks' setting), `heap reuse` = "
        f"`GLIBC_TUNABLES={HEAP_REUSE}`. Last column: `no advice` over `glibc default`.",
        "",
        "| N | output MB | system | " + " | ".join(names) + " | no advice / glibc default |",
        "|---|---|---|" + "---|" * len(names) + "---|",
    ]
    by_setting = result["settings"]
    for i, row in enumerate(by_setting[names[0]]):
        for system in SYSTEMS:
            if system not in row["ms"]:
                continue
            ms = [by_setting[name][i]["ms"][system] for name in names]
            ratio = by_setting["no advice"][i]["ms"][system] / row["ms"][system]
            cells = " | ".join(f"{t:.2f}" for t in ms)
            head = f"| {row['features']} | {row['output_mb']:.0f} | {system}"
            lines.append(f"{head} | {cells} | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.allocator",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--graph", default="tolokers", help="embedded graph name or .npz path")
    p.add_argument("--features", default="16,64", help="N, comma-separated")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    features = [int(f) for f in args.features.split(",")]
    if args.child:  # print the rows for the parent
        print(json.dumps(child(args.graph, features, args.dtype, args.repeats)))
        return {}
    from benchmarks import report
    from benchmarks.datasets import load_graph

    settings = {}
    for name, setting in SETTINGS.items():
        command = [sys.executable, "-m", "benchmarks.studies.allocator", "--child"]
        command += ["--graph", args.graph, "--features", args.features]
        command += ["--dtype", args.dtype, "--repeats", str(args.repeats)]
        env = _environment(setting)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        settings[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name}: {settings[name]}", flush=True)
    result = {
        "graph": args.graph,
        "edges": int(load_graph(args.graph).num_edges),
        "dtype": args.dtype,
        "settings": settings,
        "command": report.command_line("benchmarks.studies.allocator", argv),
    }
    print(f"wrote {report.write_study(args.out, 'allocator', result, markdown(result))}")
    return result


if __name__ == "__main__":
    main()
