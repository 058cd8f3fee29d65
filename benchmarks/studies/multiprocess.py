"""Sharded products in 2 processes x 2 CPU devices against 1 process x 4 devices, on
one machine: ``python -m benchmarks.studies.multiprocess``.

Both runs shard the embedded graphs over 4 devices and time, per graph, the segment
form with values already laid out (``S.matmul_laid_out``) and the SpMM form (the GCN
adjacency times ``x``), F features, forward. Across processes the collectives go
through gloo over localhost instead of in-process copies: on one 2-core machine that
is slower, and the point is what moves (``S.communication``, the same in both runs).
Writes ``multiprocess.json`` and ``multiprocess.md`` to ``--out``.

Only the standard library is imported at the top: every run is a fresh process that
forces its device count before importing jax.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

GRAPHS = ("cora", "planetoid_pubmed")
DEVICES = 4


def worker(process: int, processes: int, port: str, features: int, repeats: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES // processes}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, process)
    import numpy as np

    import jaxcsr
    from benchmarks import measure
    from benchmarks.datasets import load_graph

    mesh = jax.make_mesh((DEVICES,), ("d",))
    rng = np.random.default_rng(0)
    rows = []
    with jax.set_mesh(mesh):
        for name in GRAPHS:
            g = load_graph(name)
            seg = jaxcsr.shard(jaxcsr.CSRMatrix.from_indices(g.dst, g.num_nodes), mesh, "d")
            adj = jaxcsr.CSRMatrix.from_scipy(g.normalized_adjacency())
            spmm = jaxcsr.shard(adj, mesh, "d")
            v = seg.layout_values(rng.standard_normal((g.num_edges, features)).astype("f4"))
            x = rng.standard_normal((g.num_nodes, features)).astype("f4")  # replicated
            cases = {
                "segment (laid out)": (jax.jit(lambda S, v: S.matmul_laid_out(v)), seg, v),
                "spmm": (jax.jit(lambda S, x: S @ x), spmm, x),
            }
            for form, (fn, S, operand) in cases.items():
                timing, _ = measure.time_thunk(lambda f=fn, S=S, o=operand: f(S, o), repeats)
                cost = S.communication(features)
                rows.append({"graph": name, "form": form, "median_ms": timing.median_s * 1e3,
                             "bytes_per_device": cost})  # fmt: skip
    if process == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, features: int, repeats: int, timeout_s: int = 600) -> list[dict]:
    """Starts ``processes`` workers, returns process 0's rows; kills all on failure."""
    port = str(_free_port())
    command = [sys.executable, "-m", "benchmarks.studies.multiprocess", "--worker"]
    procs = [
        subprocess.Popen(
            [*command, str(i), str(processes), port, str(features), str(repeats)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(out[-3000:])
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def markdown(result: dict) -> str:
    f = result["features"]
    lines = [
        f"### {DEVICES} CPU devices: 1 process x {DEVICES} vs 2 processes x {DEVICES // 2} "
        f"(one 2-core machine), F = {f}, float32, forward",
        "",
        "| graph | form | 1 process ms | 2 processes ms | ratio | bytes per device "
        "(gather x / relayout) |",
        "|---|---|---|---|---|---|",
    ]
    for one, two in zip(result["one_process"], result["two_processes"], strict=True):
        cost = one["bytes_per_device"]
        lines.append(
            f"| {one['graph']} | {one['form']} | {one['median_ms']:.2f} | "
            f"{two['median_ms']:.2f} | {two['median_ms'] / one['median_ms']:.2f}x | "
            f"{cost['gather_x']:,} / {cost['relayout']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    from benchmarks import report  # not at the top: see the module docstring

    result = {
        "features": args.features,
        "one_process": run(1, args.features, args.repeats),
        "two_processes": run(2, args.features, args.repeats),
        "command": report.command_line("benchmarks.studies.multiprocess", argv),
    }

    report.write_study(args.out, "multiprocess", result, markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, n, port, features, repeats = sys.argv[2:7]
        worker(int(pid), int(n), port, int(features), int(repeats))
    else:
        main()
