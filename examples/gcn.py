"""A real client: Kipf & Welling's two-layer GCN on Cora, trained in one jitted step.

``python -m examples.gcn [--seeds 10] [--aggregators jaxcsr,segment_sum,bcsr]``

Loads Cora from ``benchmarks/data/cora.npz`` (Planetoid split: 140 train / 500 val /
1000 test), builds ``D^-1/2 (A + I) D^-1/2`` with scipy, and trains hidden 16, dropout
0.5, weight decay 5e-4 on the first layer, Adam (lr 0.01), 200 epochs. The input
dropout acts on the stored entries of the sparse features (as Kipf & Welling's code
does), so a step spends its time on the model, not on drawing a dense 2708 x 1433 mask;
the features' product is the same ``BCOO`` product in every system. The epoch step
is one ``jax.jit`` function taking the aggregation operand as an argument; it compiles
once. The same loop runs with the aggregation done by jaxcsr, ``jax.ops.segment_sum``
and ``jax.experimental.sparse.BCSR``; step times (median after warm-up) and test
accuracy are printed side by side. ``--learn-edge-weights`` also trains the adjacency
values through ``CSRMatrix.with_data``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.experimental import sparse as jsparse

import jaxcsr
from benchmarks import measure, report
from benchmarks.datasets import DATA_DIR, load_graph
from jaxcsr import CSRMatrix

HIDDEN, DROPOUT, WEIGHT_DECAY, LR, EPOCHS = 16, 0.5, 5e-4, 0.01, 200


@dataclasses.dataclass(frozen=True)
class Cora:
    features: np.ndarray  # (N, F) row-normalised bag of words
    adjacency: sp.csr_array  # D^-1/2 (A + I) D^-1/2
    labels: np.ndarray
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1

    def sparse_features(self) -> jsparse.BCOO:
        """The features as a ``BCOO`` matrix (2.6k x 1.4k, 49k stored entries)."""
        return jsparse.BCOO.fromdense(jnp.asarray(self.features))


def load_cora(path: Path = DATA_DIR / "cora.npz") -> Cora:
    with np.load(path, allow_pickle=False) as f:
        x = sp.csr_array((f["x_data"], f["x_indices"], f["x_indptr"]), shape=tuple(f["x_shape"]))
        labels, train, val, test = (
            f[k] for k in ("labels", "train_index", "val_index", "test_index")
        )
    rowsum = np.asarray(x.sum(axis=1)).ravel()
    features = (sp.diags_array(1.0 / np.maximum(rowsum, 1e-12)) @ x).toarray().astype(np.float32)
    adjacency = load_graph(str(path)).normalized_adjacency()
    return Cora(features, adjacency, labels.astype(np.int32), train, val, test)


AGGREGATORS = ("jaxcsr", "segment_sum", "bcsr", "jaxcsr_sharded")


def aggregator(name: str, adj: sp.csr_array) -> tuple[Any, Callable[[Any, jax.Array], jax.Array]]:
    """``(operand, apply)`` with ``apply(operand, h) == adj @ h`` for one system."""
    if name == "jaxcsr":
        return CSRMatrix.from_scipy(adj), lambda A, h: A @ h
    if name == "jaxcsr_sharded":  # rows over every device (Auto axes: jit places the rest)
        from jax.sharding import AxisType

        mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(AxisType.Auto,))
        return jaxcsr.shard(CSRMatrix.from_scipy(adj), mesh, "d"), lambda S, h: S @ h
    if name == "segment_sum":
        coo = adj.tocoo()
        arrays = (jnp.asarray(coo.row), jnp.asarray(coo.col), jnp.asarray(coo.data))

        def apply(a, h):
            row, col, w = a
            return jax.ops.segment_sum(w[:, None] * h[col], row, adj.shape[0])

        return arrays, apply
    if name == "bcsr":
        return jsparse.BCSR.from_scipy_sparse(adj), lambda A, h: A @ h
    raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {name!r}")


def init_params(key: jax.Array, n_in: int, n_out: int) -> dict[str, jax.Array]:
    def glorot(k, shape):
        limit = np.sqrt(6.0 / (shape[0] + shape[1]))
        return jax.random.uniform(k, shape, jnp.float32, -limit, limit)

    k1, k2 = jax.random.split(key)
    return {
        "w1": glorot(k1, (n_in, HIDDEN)),
        "b1": jnp.zeros(HIDDEN),
        "w2": glorot(k2, (HIDDEN, n_out)),
        "b2": jnp.zeros(n_out),
    }


def forward(params, apply, operand, x: jsparse.BCOO, key, train: bool):
    def dropout(h, k):
        if not train:
            return h
        keep = jax.random.bernoulli(k, 1 - DROPOUT, h.shape)
        return jnp.where(keep, h / (1 - DROPOUT), 0)

    k1, k2 = jax.random.split(key)
    x = jsparse.BCOO((dropout(x.data, k1), x.indices), shape=x.shape)  # stored entries only
    h = jax.nn.relu(apply(operand, x @ params["w1"]) + params["b1"])
    return apply(operand, dropout(h, k2) @ params["w2"]) + params["b2"]


def loss_fn(params, apply, operand, x, labels, mask, key):
    logits = forward(params, apply, operand, x, key, train=True)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.sum(jnp.take_along_axis(logp, labels[:, None], 1)[:, 0] * mask) / jnp.sum(mask)
    return nll + WEIGHT_DECAY * 0.5 * jnp.sum(params["w1"] ** 2)


def adam_update(params, grads, state, step, lr=LR):
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    t = step + 1
    scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
    params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, {"m": m, "v": v}


def make_step(apply, traces: list | None = None):
    """The whole epoch as one jitted function of (params, state, operand, data, key)."""

    @jax.jit
    def step(params, state, operand, x, labels, mask, key, epoch):
        if traces is not None:
            traces.append(1)
        loss, grads = jax.value_and_grad(loss_fn)(params, apply, operand, x, labels, mask, key)
        params, state = adam_update(params, grads, state, epoch)
        return params, state, loss

    return step


def train(data: Cora, name: str, seed: int, epochs: int = EPOCHS) -> dict[str, Any]:
    """Trains one GCN; returns test accuracy, step times and the trace count."""
    operand, apply = aggregator(name, data.adjacency)
    x = data.sparse_features()
    labels = jnp.asarray(data.labels)
    mask = jnp.zeros(len(data.labels)).at[data.train].set(1.0)
    key = jax.random.PRNGKey(seed)
    key, init_key = jax.random.split(key)
    params = init_params(init_key, x.shape[1], data.num_classes)
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}
    traces: list = []
    step = make_step(apply, traces)
    times = []
    for epoch in range(epochs):
        key, k = jax.random.split(key)
        seconds, (params, state, loss) = measure.timed(
            lambda p=params, s=state, k=k, e=epoch: step(p, s, operand, x, labels, mask, k, e)
        )
        times.append(seconds)
    logits = forward(params, apply, operand, x, key, train=False)
    pred = np.asarray(jnp.argmax(logits, axis=1))
    acc = float(np.mean(pred[data.test] == data.labels[data.test]))
    return {
        "aggregator": name,
        "seed": seed,
        "test_accuracy": acc,
        "final_loss": float(loss),
        "step_median_s": float(np.median(times[10:])),
        "compile_s": times[0],
        "traces": len(traces),
    }


def edge_weight_gradients(data: Cora, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gradient of the training loss w.r.t. the adjacency values, by jaxcsr and by a
    ``segment_sum`` reference (both in the matrix's CSR order)."""
    A = CSRMatrix.from_scipy(data.adjacency)
    coo = data.adjacency.tocoo()  # same (row, col) order as CSR order for a csr_array
    row, col = jnp.asarray(coo.row), jnp.asarray(coo.col)
    x = data.sparse_features()
    labels = jnp.asarray(data.labels)
    mask = jnp.zeros(len(data.labels)).at[data.train].set(1.0)
    params = init_params(jax.random.PRNGKey(seed), x.shape[1], data.num_classes)
    key = jax.random.PRNGKey(seed + 1)

    def via_jaxcsr(w):
        return loss_fn(params, lambda a, h: A.with_data(w) @ h, None, x, labels, mask, key)

    def via_segment_sum(w):
        def apply(a, h):
            return jax.ops.segment_sum(w[:, None] * h[col], row, A.shape[0])

        return loss_fn(params, apply, None, x, labels, mask, key)

    return np.asarray(jax.grad(via_jaxcsr)(A.data)), np.asarray(jax.grad(via_segment_sum)(A.data))


def train_edge_weights(data: Cora, seed: int, epochs: int = EPOCHS) -> dict[str, Any]:
    """Trains the GCN and the adjacency values (initialised to the normalised ones)."""
    A = CSRMatrix.from_scipy(data.adjacency)
    x, labels = data.sparse_features(), jnp.asarray(data.labels)
    mask = jnp.zeros(len(data.labels)).at[data.train].set(1.0)
    key, init_key = jax.random.split(jax.random.PRNGKey(seed))
    params = {**init_params(init_key, x.shape[1], data.num_classes), "edge_w": A.data}
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}

    def apply_weighted(operand, h):
        A_, w = operand
        return A_.with_data(w) @ h

    @jax.jit
    def step(params, state, A, key, epoch):
        def loss(p):
            model = {k: v for k, v in p.items() if k != "edge_w"}
            return loss_fn(model, apply_weighted, (A, p["edge_w"]), x, labels, mask, key)

        value, grads = jax.value_and_grad(loss)(params)
        params, state = adam_update(params, grads, state, epoch)
        return params, state, value

    losses = []
    for epoch in range(epochs):
        key, k = jax.random.split(key)
        params, state, value = step(params, state, A, k, epoch)
        losses.append(float(value))
    model = {k: v for k, v in params.items() if k != "edge_w"}
    logits = forward(model, apply_weighted, (A, params["edge_w"]), x, key, train=False)
    pred = np.asarray(jnp.argmax(logits, axis=1))
    change = float(jnp.max(jnp.abs(params["edge_w"] - A.data)))
    return {
        "test_accuracy": float(np.mean(pred[data.test] == data.labels[data.test])),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "max_edge_weight_change": change,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(
        prog="python -m examples.gcn",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seeds", type=int, default=10, help="training runs per aggregator")
    p.add_argument(
        "--aggregators",
        default="jaxcsr,segment_sum,bcsr",
        help="comma-separated subset of " + ",".join(AGGREGATORS),
    )
    p.add_argument("--epochs", type=int, default=EPOCHS, help="training epochs per run")
    p.add_argument(
        "--learn-edge-weights",
        action="store_true",
        help="also check the edge-weight gradient and train the adjacency values",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for gcn.json and gcn.md")
    args = p.parse_args(argv)
    names = [a for a in args.aggregators.split(",") if a]
    bad = sorted(set(names) - set(AGGREGATORS))
    if bad or not names:
        p.error(f"unknown aggregators: {bad}; choose from {list(AGGREGATORS)}")
    if args.seeds < 1 or args.epochs < 11:
        p.error("--seeds must be >= 1 and --epochs >= 11 (the first 10 steps are warm-up)")
    data = load_cora()
    runs = []
    for name in names:
        for seed in range(args.seeds):
            run = train(data, name, seed, args.epochs)
            runs.append(run)
            print(
                f"{name} seed {seed}: test accuracy {100 * run['test_accuracy']:.1f} %, "
                f"step {1e3 * run['step_median_s']:.2f} ms",
                file=sys.stderr,
                flush=True,
            )
    lines = [
        "| aggregation | step time (median, ms) | compile (s) | traces | test accuracy |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        rs = [r for r in runs if r["aggregator"] == name]
        accs = np.array([r["test_accuracy"] for r in rs])
        steps = np.array([r["step_median_s"] for r in rs]) * 1e3
        lines.append(
            f"| {name} | {np.median(steps):.2f} | {np.median([r['compile_s'] for r in rs]):.2f} | "
            f"{max(r['traces'] for r in rs)} | {100 * accs.mean():.1f} ± {100 * accs.std():.1f} "
            f"(n={len(accs)}) |"
        )
    record: dict[str, Any] = {**report.provenance("examples.gcn", argv), "runs": runs}
    if args.learn_edge_weights:
        g_jaxcsr, g_ref = edge_weight_gradients(data)
        err = float(np.abs(g_jaxcsr - g_ref).max() / np.abs(g_ref).max())
        learned = train_edge_weights(data, seed=0, epochs=args.epochs)
        record["edge_weight_gradient_max_rel_diff"] = err
        record["learned_edge_weights"] = learned
        lines.append("")
        lines.append(f"edge-weight gradient vs segment_sum reference: max relative diff {err:.2e}")
        lines.append(f"learned edge weights: {learned}")
    print("\n".join(lines))
    if args.out is not None:
        report.write_study(args.out, "gcn", record, "\n".join(lines) + "\n")
    return runs


if __name__ == "__main__":
    main()
