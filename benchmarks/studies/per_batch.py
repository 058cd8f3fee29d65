"""Per-batch graphs: traced ids, planned on the device, against ``jax.ops`` with the
same traced ids: ``python -m benchmarks.studies.per_batch``.

Three parts, one run, every system timed in turns (``measure.time_in_turns``):

* **Segment reductions** on the embedded graphs' edges in a shuffled order (a graph
  that arrives each step is not sorted): ``segment_sum``, ``segment_max`` and
  ``segment_softmax`` (jraph's composition: max, exp, sum, divide) over the
  receivers, ``N`` features (heads for the softmax), float32 and bfloat16, forward
  and forward + backward. Both sides are jitted functions of ``(values, ids)``, so
  the ids are traced in both.
* **A jraph-style training step**: a batch of 32 padded molecules (new graphs every
  step), two rounds of message passing and a per-graph sum pooling, the value and
  gradient of a squared error and an SGD update, with jaxcsr's or jax.ops'
  ``segment_sum``.
* **Device planning cost** per id: the jitted planner alone (structure; with the
  GPU lanes; with the TPU schedule), every array returned so that nothing is
  dead code. GPU figures are estimates from bytes moved, marked so.

Writes ``per_batch.json`` and ``per_batch.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure, report
from benchmarks.datasets import load_graph, padded_molecules
from jaxcsr import device_plan
from jaxcsr.kernels import gpu, tpu

GRAPHS = ("cora", "planetoid_pubmed", "musae_github")
WIDTHS = (1, 16, 64, 256)
DTYPES = ("float32", "bfloat16")
OPS = ("sum", "max", "softmax")
SYSTEMS = ("jaxcsr", "jax.ops")
CELL_BUDGET_S = 0.3
"""Fast cells repeat until each system has run about this long (at least ``--repeats``
times, at most 200): sub-millisecond timings need many samples."""


def _ops_softmax(logits, ids, num_segments):
    """jraph's segment softmax: max, shift, exp, sum, divide (all jax.ops)."""
    peak = jax.ops.segment_max(logits, ids, num_segments)
    e = jnp.exp(logits - peak[ids])
    return e / jax.ops.segment_sum(e, ids, num_segments)[ids]


def _forward(op: str, system: str, num_segments: int):
    if system == "jaxcsr":
        fn = {"sum": jaxcsr.segment_sum, "max": jaxcsr.segment_max}.get(op)
        fn = fn or jaxcsr.segment_softmax
    else:
        fn = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max}.get(op) or _ops_softmax
    return lambda x, ids: fn(x, ids, num_segments)


def _programs(op: str, system: str, num_segments: int):
    """``(forward, forward + backward)``, jitted, of ``(x, ids[, ct])``."""
    fwd = _forward(op, system, num_segments)

    def fwd_bwd(x, ids, ct):
        out, pullback = jax.vjp(lambda x: fwd(x, ids), x)
        return out, pullback(ct)[0]

    return jax.jit(fwd), jax.jit(fwd_bwd)


def segment_rows(
    graphs, widths, dtypes, repeats: int, seed: int, budget_s: float = CELL_BUDGET_S, ops=OPS
) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for name in graphs:
        graph = load_graph(name)
        m = graph.num_nodes
        order = rng.permutation(graph.num_edges)
        ids = jnp.asarray(graph.dst[order], jnp.int32)
        for dtype in dtypes:
            for width in widths:
                x = jnp.asarray(rng.standard_normal((graph.num_edges, width)), dtype)
                for op in ops:
                    out_rows = graph.num_edges if op == "softmax" else m
                    ct = jnp.asarray(rng.standard_normal((out_rows, width)), dtype)
                    programs = {system: _programs(op, system, m) for system in SYSTEMS}
                    for mode in ("fwd", "fwd+bwd"):
                        # the two systems in turns, one mode at a time (similar buffers)
                        args = (x, ids) if mode == "fwd" else (x, ids, ct)
                        index = 0 if mode == "fwd" else 1
                        thunks = {
                            f"{system} {mode}": functools.partial(programs[system][index], *args)
                            for system in SYSTEMS
                        }
                        reps = _repeats(thunks, repeats, budget_s)
                        timings, outs = measure.time_in_turns(thunks, reps)
                        row = _cell(name, op, dtype, width, mode, timings, outs, m)
                        rows.append(row)
                        print(_line(row), flush=True)
    return rows


def _repeats(thunks: dict, repeats: int, budget_s: float) -> int:
    if budget_s <= 0:
        return repeats
    slowest = max(thunks.values(), key=lambda t: measure.timed(t)[0])  # compiles all
    seconds = measure.timed(slowest)[0]
    return int(np.clip(budget_s / max(seconds, 1e-6), repeats, 200))


def _cell(graph, op, dtype, width, mode, timings, outs, m) -> dict:
    ours, theirs = timings[f"jaxcsr {mode}"], timings[f"jax.ops {mode}"]
    a = jax.tree_util.tree_leaves(outs[f"jaxcsr {mode}"])
    b = jax.tree_util.tree_leaves(outs[f"jax.ops {mode}"])
    if op == "max":  # empty segments: -inf on both sides (compared as 0)
        a, b = (
            [jnp.where(jnp.isneginf(v), 0, v) if v.shape[0] == m else v for v in t] for t in (a, b)
        )
    error = measure.largest_relative_error(a, b)
    return {
        "graph": graph,
        "op": op,
        "dtype": dtype,
        "width": width,
        "mode": mode,
        "jaxcsr_ms": ours.median_s * 1e3,
        "jax_ops_ms": theirs.median_s * 1e3,
        "speedup": theirs.median_s / ours.median_s,
        "max_relative_difference": error,
    }


def _line(r: dict) -> str:
    return (
        f"{r['graph']:>16} {r['op']:>7} {r['dtype']:>8} N={r['width']:<3} {r['mode']:>7}: "
        f"jaxcsr {r['jaxcsr_ms']:8.2f} ms, jax.ops {r['jax_ops_ms']:8.2f} ms, "
        f"{r['speedup']:.2f}x (diff {r['max_relative_difference']:.1e})"
    )


# ------------------------------------------------------------- training step
NODES, EDGES, GRAPHS_PER_BATCH = 640, 2048, 33  # 32 molecules + jraph's padding graph


def _molecule_batch(rng, features: int) -> dict:
    """32 random molecule-sized graphs in one padded batch, as jraph pads one: the
    padding edges point at a padding node, the padding nodes form one more graph."""
    senders, receivers, graph_of_node = padded_molecules(
        rng, GRAPHS_PER_BATCH - 1, (6, 19), (1, 5), NODES, EDGES
    )
    return {
        "nodes": rng.standard_normal((NODES, features)).astype(np.float32),
        "senders": senders,
        "receivers": receivers,
        "graph_of_node": graph_of_node,
        "targets": rng.standard_normal((GRAPHS_PER_BATCH, 1)).astype(np.float32),
    }


def _train_step(segment_sum, learning_rate=1e-3):
    def loss(params, batch):
        h = batch["nodes"]
        for w_msg, w_self in params[:-1]:
            messages = jax.nn.relu(h[batch["senders"]] @ w_msg)
            h = jax.nn.relu(h @ w_self + segment_sum(messages, batch["receivers"], NODES))
        pooled = segment_sum(h, batch["graph_of_node"], GRAPHS_PER_BATCH)
        prediction = pooled @ params[-1]
        return jnp.mean((prediction[:-1] - batch["targets"][:-1]) ** 2)  # real graphs only

    @jax.jit
    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), value

    return step


def training_rows(features: int, steps: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    batches = [_molecule_batch(rng, features) for _ in range(20)]
    params = [
        tuple(rng.standard_normal((features, features)).astype(np.float32) / np.sqrt(features)
              for _ in range(2))
        for _ in range(2)
    ]  # fmt: skip
    params.append(rng.standard_normal((features, 1)).astype(np.float32) / np.sqrt(features))
    systems = {
        "jaxcsr": _train_step(jaxcsr.segment_sum),
        "jax.ops": _train_step(jax.ops.segment_sum),
    }
    state = {name: params for name in systems}
    calls = dict.fromkeys(systems, 0)

    def run(name):  # each system steps through the same sequence of batches
        batch = batches[calls[name] % len(batches)]
        calls[name] += 1
        state[name], value = systems[name](state[name], batch)
        return value

    thunks = {name: functools.partial(run, name) for name in systems}
    timings, _ = measure.time_in_turns(thunks, repeats=steps)
    losses = {name: float(systems[name](params, batches[0])[1]) for name in systems}
    row = {
        "features": features,
        "nodes": NODES,
        "edges": EDGES,
        "graphs": GRAPHS_PER_BATCH - 1,
        "jaxcsr_ms": timings["jaxcsr"].median_s * 1e3,
        "jax_ops_ms": timings["jax.ops"].median_s * 1e3,
        "speedup": timings["jax.ops"].median_s / timings["jaxcsr"].median_s,
        "loss_difference": abs(losses["jaxcsr"] - losses["jax.ops"]),
    }
    print(
        f"training step F={features}: jaxcsr {row['jaxcsr_ms']:.2f} ms, jax.ops "
        f"{row['jax_ops_ms']:.2f} ms, {row['speedup']:.2f}x",
        flush=True,
    )
    return [row]


# ------------------------------------------------------------ planning cost
def _planner(which: str, num_rows: int):
    def plan(ids):
        structure = device_plan.segment_structure(ids, num_rows)
        if which == "structure":
            return structure
        if which == "+ gpu lanes":
            return structure, gpu.plan(structure)
        return structure, tpu.plan(structure)

    return jax.jit(plan)


# GPU estimate: bytes a device sort and the counts move, at a sustained bandwidth.
GPU_SORT_BYTES_PER_ID = 4 * 2 * 8  # ~4 radix passes reading and writing key + value
GPU_COUNT_BYTES_PER_ID = 4 + 4 + 4  # ids read, counts scattered, pointer written
GPU_BANDWIDTH_GBPS = 3000.0  # H200: ~4.8 TB/s nominal, ~3 TB/s sustained for sorts


def planning_rows(graphs, repeats: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    estimate_ns = (GPU_SORT_BYTES_PER_ID + GPU_COUNT_BYTES_PER_ID) / GPU_BANDWIDTH_GBPS
    for name in graphs:
        graph = load_graph(name)
        ids = jnp.asarray(graph.dst[rng.permutation(graph.num_edges)], jnp.int32)
        thunks = {
            which: functools.partial(_planner(which, graph.num_nodes), ids)
            for which in ("structure", "+ gpu lanes", "+ tpu schedule")
        }
        timings, _ = measure.time_in_turns(thunks, repeats)
        row = {"graph": name, "ids": graph.num_edges, "segments": graph.num_nodes}
        row.update({k: t.median_s * 1e9 / graph.num_edges for k, t in timings.items()})
        row["gpu_estimate_ns"] = estimate_ns
        rows.append(row)
        print(
            f"planning {name}: "
            + ", ".join(f"{k} {row[k]:.1f} ns/id" for k in timings)
            + f"; GPU estimate {estimate_ns:.3f} ns/id",
            flush=True,
        )
    return rows


def markdown(result: dict) -> str:
    widths = sorted({r["width"] for r in result["segments"]})
    lines = [
        "### Segment reductions with traced ids (jaxcsr / jax.ops time: speedup)",
        "",
        "Ids: the graph's receivers in a shuffled edge order, traced in both systems.",
        "",
        "| graph | op | dtype | mode | " + " | ".join(f"N={w}" for w in widths) + " |",
        "|---|---|---|---|" + "---|" * len(widths),
    ]
    cells: dict[tuple, dict[int, dict]] = {}
    for r in result["segments"]:
        cells.setdefault((r["graph"], r["op"], r["dtype"], r["mode"]), {})[r["width"]] = r
    for key, by_width in cells.items():
        row = [
            f"{by_width[w]['speedup']:.2f}x ({by_width[w]['jaxcsr_ms']:.2f} ms)"
            if w in by_width
            else ""
            for w in widths
        ]
        lines.append("| " + " | ".join(key) + " | " + " | ".join(row) + " |")
    speedups = [r["speedup"] for r in result["segments"]]
    if speedups:
        lines += [
            "",
            f"Cells: {len(speedups)}; geometric mean {np.exp(np.mean(np.log(speedups))):.2f}x; "
            f"min {min(speedups):.2f}x; cells below 1.0x: {sum(s < 1 for s in speedups)}.",
        ]
    lines += [
        "",
        "### jraph-style training step (32 padded molecules, new graphs every step)",
        "",
        "| features | nodes | edges | jaxcsr ms | jax.ops ms | speedup | loss difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["training"]:
        lines.append(
            f"| {r['features']} | {r['nodes']} | {r['edges']} | {r['jaxcsr_ms']:.2f} | "
            f"{r['jax_ops_ms']:.2f} | {r['speedup']:.2f}x | {r['loss_difference']:.1e} |"
        )
    lines += [
        "",
        "### Device planning cost (ns per id, CPU measured; GPU an estimate)",
        "",
        "| graph | ids | structure | + GPU lanes | + TPU schedule | GPU (estimate) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["planning"]:
        lines.append(
            f"| {r['graph']} | {r['ids']:,} | {r['structure']:.1f} | {r['+ gpu lanes']:.1f} | "
            f"{r['+ tpu schedule']:.1f} | ~{r['gpu_estimate_ns']:.3f} (estimate) |"
        )
    lines += [
        "",
        "GPU estimate: not measured; "
        f"{GPU_SORT_BYTES_PER_ID + GPU_COUNT_BYTES_PER_ID} B moved per id (a 4-pass radix "
        f"sort of key + value, the counts and the row pointer) at {GPU_BANDWIDTH_GBPS:.0f} GB/s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graphs", default=",".join(GRAPHS))
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--ops", default=",".join(OPS), help=f"a subset of {','.join(OPS)}")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per cell, at least")
    p.add_argument(
        "--cell-budget", type=float, default=CELL_BUDGET_S, help="seconds per system and cell"
    )
    p.add_argument("--steps", type=int, default=40, help="timed training steps")
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/latest"))
    args = p.parse_args(argv)
    graphs = args.graphs.split(",")
    ops = tuple(args.ops.split(","))
    if not set(ops) <= set(OPS):
        p.error(f"--ops: choose from {','.join(OPS)}, got {args.ops!r}")
    result = {
        "segments": segment_rows(
            graphs,
            [int(w) for w in args.widths.split(",")],
            args.dtypes.split(","),
            args.repeats,
            args.seed,
            args.cell_budget,
            ops,
        ),
        "training": training_rows(args.features, args.steps, args.seed),
        "planning": planning_rows(graphs, args.repeats, args.seed),
        "environment": {
            "jax": jax.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": jax.local_device_count(),
            "command": report.command_line("benchmarks.studies.per_batch", argv),
        },
    }
    print(f"wrote {report.write_study(args.out, 'per_batch', result, markdown(result))}")
    return result


if __name__ == "__main__":
    main()
