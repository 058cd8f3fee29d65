"""Attention workloads against the JAX formulations users write:
``python -m benchmarks.studies.attention``.

Per graph (``dst`` ids, ``E`` edges, ``V`` nodes) and width ``N`` (heads x features):

``edge_softmax``  softmax of ``(E, N)`` scores over each node's incoming edges, forward
    (``fwd``) and forward + backward in one jitted ``jax.vjp`` (``fwd+bwd``):
    ``jaxcsr.segment_softmax(x, dst, V)`` (scores in the graph's edge order) and
    ``jaxcsr.edge_softmax(A, x)`` (``A = from_coo(dst, src)``, scores in its CSR order),
    against the ``jax.ops`` composition ``exp(x - segment_max(x)[dst]) /
    segment_sum(...)[dst]`` with unsorted ids in edge order and with sorted ids
    (``indices_are_sorted=True``) in CSR order, and the same composition in torch
    (``scatter_reduce_("amax")``, ``index_select``, ``index_add_``; forward only).
``sddmm``  ``(X[dst] * Y[src]).sum(-1)`` per edge for ``X, Y`` of shape ``(V, N)``:
    ``jaxcsr.sddmm(A, X, Y)`` against that gather formulation (edge order and CSR
    order), and ``jnp.einsum`` on the gathered rows.

``--shuffle`` puts each graph's edges in random order first (unsorted segment ids).
Every output (and gradient) is checked against float64 numpy. The systems of a cell
are timed in turns; ratios are best JAX peer time / jaxcsr time (> 1: jaxcsr faster).
Writes ``attention.json`` and ``attention.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure, report
from benchmarks.datasets import load_graph
from benchmarks.systems import jax_ops_softmax, softmax64

try:
    import torch
except ImportError:  # optional extra
    torch = None

TWITTER = Path(__file__).resolve().parents[2] / "shared" / "data" / "twitter_ego.npz"


def _fwd_bwd(f):
    def run(x, ct):
        out, vjp = jax.vjp(f, x)
        return out, vjp(ct)[0]

    return jax.jit(run)


def softmax_cells(graph, widths, repeats, rng) -> list[dict]:
    V, E = graph.num_nodes, graph.num_edges
    dst = graph.dst
    A = jaxcsr.CSRMatrix.from_coo(dst, graph.src, shape=(V, V))
    order = np.asarray(A.input_order)  # edge order -> CSR order of A (sorted by dst)
    assert np.all(np.diff(dst[order]) >= 0)
    dst_j, dst_sorted = jnp.asarray(dst, jnp.int32), jnp.asarray(dst[order], jnp.int32)
    rows = []
    for n in widths:
        x_host = rng.standard_normal((E, n), dtype=np.float32)
        ct_host = rng.standard_normal((E, n), dtype=np.float32)
        x, ct = jnp.asarray(x_host), jnp.asarray(ct_host)
        xs, cts = x[order], ct[order]
        want = softmax64(x_host, dst, V)
        inner = np.zeros((V, n))
        np.add.at(inner, dst, want * ct_host)
        want_grad = want * (ct_host - inner[dst])
        systems = {  # name: (function, inputs, maps the output to edge order)
            "jaxcsr.segment_softmax": (lambda x: jaxcsr.segment_softmax(x, dst, V), x, ct, None),
            "jaxcsr.edge_softmax": (lambda x: jaxcsr.edge_softmax(A, x), xs, cts, order),
            "jax.ops unsorted": (lambda x: jax_ops_softmax(x, dst_j, V), x, ct, None),
            "jax.ops sorted": (
                lambda x: jax_ops_softmax(x, dst_sorted, V, indices_are_sorted=True),
                xs,
                cts,
                order,
            ),
        }
        for pass_ in ("fwd", "fwd+bwd"):
            cell = {"graph": graph.name, "workload": "edge_softmax", "pass": pass_, "N": n}
            thunks = {}
            for name, (f, inp, c, _) in systems.items():
                fn = jax.jit(f) if pass_ == "fwd" else _fwd_bwd(f)
                args = (inp,) if pass_ == "fwd" else (inp, c)
                thunks[name] = lambda fn=fn, args=args: fn(*args)
            timings, outs = measure.time_in_turns(thunks, repeats)
            times = {k: t.median_s for k, t in timings.items()}
            for name, (_, _, _, back) in systems.items():
                outputs = [outs[name]] if pass_ == "fwd" else list(outs[name])
                for got, expected in zip(outputs, (want, want_grad), strict=False):
                    got = np.asarray(got)
                    if back is not None:  # CSR order -> edge order
                        unsorted = np.empty_like(got)
                        unsorted[back] = got
                        got = unsorted
                    err = measure.relative_error(got, expected)
                    if not err <= 1e-5:
                        raise AssertionError(f"{name} {pass_} N={n}: error {err:.2e} vs float64")
            if torch is not None and pass_ == "fwd":
                times["torch"] = _torch_softmax_time(x_host, dst, V, repeats, want)
            rows.append(_finish(cell, times))
            print(_line(rows[-1]), flush=True)
        del x, ct, xs, cts
    return rows


def _torch_softmax_time(x_host, dst, V, repeats, want) -> float:
    tx, tdst = torch.from_numpy(x_host), torch.from_numpy(dst.astype(np.int64))
    tdst_x = tdst[:, None].expand(*x_host.shape)

    def run():
        peak = torch.zeros(V, x_host.shape[1]).scatter_reduce_(
            0, tdst_x, tx, "amax", include_self=False
        )
        e = torch.exp(tx - peak.index_select(0, tdst))
        return e / torch.zeros(V, x_host.shape[1]).index_add_(0, tdst, e).index_select(0, tdst)

    timing, out = measure.time_thunk(run, repeats)
    assert measure.relative_error(out.numpy(), want) <= 1e-5
    return timing.median_s


def sddmm_cells(graph, widths, repeats, rng) -> list[dict]:
    V = graph.num_nodes
    A = jaxcsr.CSRMatrix.from_coo(graph.dst, graph.src, shape=(V, V))
    order = np.asarray(A.input_order)
    dst, src = jnp.asarray(graph.dst, jnp.int32), jnp.asarray(graph.src, jnp.int32)
    dst_c, src_c = dst[order], src[order]
    rows = []
    for n in widths:
        X = jnp.asarray(rng.standard_normal((V, n), dtype=np.float32))
        Y = jnp.asarray(rng.standard_normal((V, n), dtype=np.float32))
        want = np.sum(
            np.asarray(X, np.float64)[graph.dst[order]]
            * np.asarray(Y, np.float64)[graph.src[order]],
            axis=1,
        )
        systems = {
            "jaxcsr.sddmm": (jax.jit(lambda X, Y: jaxcsr.sddmm(A, X, Y)), True),
            "gather, edge order": (jax.jit(lambda X, Y: (X[dst] * Y[src]).sum(-1)), False),
            "gather, CSR order": (jax.jit(lambda X, Y: (X[dst_c] * Y[src_c]).sum(-1)), True),
            "gather + einsum": (
                jax.jit(lambda X, Y: jnp.einsum("ef,ef->e", X[dst_c], Y[src_c])),
                True,
            ),
        }
        thunks = {name: (lambda fn=fn, X=X, Y=Y: fn(X, Y)) for name, (fn, _) in systems.items()}
        timings, outs = measure.time_in_turns(thunks, repeats)
        times = {k: t.median_s for k, t in timings.items()}
        for name, (_, csr_order) in systems.items():
            got = np.asarray(outs[name])
            if not csr_order:
                got = got[order]
            err = measure.relative_error(got, want)
            if not err <= 1e-4:
                raise AssertionError(f"{name} N={n}: error {err:.2e} vs float64")
        cell = {"graph": graph.name, "workload": "sddmm", "pass": "fwd", "N": n}
        rows.append(_finish(cell, times))
        print(_line(rows[-1]), flush=True)
    return rows


def _finish(cell: dict, times: dict) -> dict:
    ours = {k: v for k, v in times.items() if k.startswith("jaxcsr")}
    jax_peers = {k: v for k, v in times.items() if not k.startswith("jaxcsr") and k != "torch"}
    best = min(jax_peers.values())
    cell["median_s"] = times
    cell["ratio_vs_best_jax"] = {k: best / v for k, v in ours.items()}
    return cell


def _line(cell: dict) -> str:
    t = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in cell["median_s"].items())
    r = ", ".join(f"{k} {v:.2f}x" for k, v in cell["ratio_vs_best_jax"].items())
    return f"{cell['graph']} {cell['workload']} {cell['pass']} N={cell['N']}: {t} ms | {r}"


def markdown(rows: list[dict], env: dict) -> str:
    out = [
        f"CPU: {env['cpu']} ({env['cpu_count']} cores), jax {env['jax']}, "
        f"torch {env['torch']}. Median ms; ratio = best JAX peer / jaxcsr (> 1: jaxcsr "
        "faster).",
        "",
    ]
    for workload in ("edge_softmax", "sddmm"):
        cells = [r for r in rows if r["workload"] == workload]
        if not cells:
            continue
        names = list(dict.fromkeys(k for r in cells for k in r["median_s"]))
        ours = [k for k in names if k.startswith("jaxcsr")]
        out.append(f"### {workload}")
        out.append("")
        out.append(
            "| graph | pass | N | "
            + " | ".join(names)
            + " | "
            + " | ".join(f"{k} ratio" for k in ours)
            + " |"
        )
        out.append("|---|---|---:|" + "---:|" * (len(names) + len(ours)))
        for r in cells:
            t = [f"{r['median_s'][k] * 1e3:.2f}" if k in r["median_s"] else "" for k in names]
            q = [f"{r['ratio_vs_best_jax'][k]:.2f}x" for k in ours]
            out.append(f"| {r['graph']} | {r['pass']} | {r['N']} | " + " | ".join(t + q) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.attention",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    default_graphs = "tolokers,musae_github" + (f",{TWITTER}" if TWITTER.exists() else "")
    p.add_argument("--graphs", default=default_graphs, help="names or .npz paths")
    p.add_argument("--softmax-widths", default="1,8,64")
    p.add_argument("--sddmm-widths", default="16,64")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="put each graph's edges in random order first (segment ids unsorted, as in "
        "edge lists built in any order)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    widths = lambda text: [int(w) for w in text.split(",") if w]  # noqa: E731
    rows = []
    for name in args.graphs.split(","):
        graph = load_graph(name)
        if args.shuffle:
            edges = rng.permutation(graph.num_edges)
            graph = dataclasses.replace(
                graph, name=f"{graph.name} shuffled", src=graph.src[edges], dst=graph.dst[edges]
            )
        rows += softmax_cells(graph, widths(args.softmax_widths), args.repeats, rng)
        rows += sddmm_cells(graph, widths(args.sddmm_widths), args.repeats, rng)
    from benchmarks.__main__ import environment

    env = environment()
    table = markdown(rows, env)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = report.command_line("benchmarks.studies.attention", argv)
        record = {"command": command}
        record.update(environment=env, rows=rows)
        (args.out / "attention.json").write_text(json.dumps(record, indent=1))
        (args.out / "attention.md").write_text(table)
    return rows


if __name__ == "__main__":
    main()
