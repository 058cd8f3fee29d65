"""Graph attention on a real graph: Velickovic et al.'s GAT on Cora, one jitted step.

``python -m examples.gat [--seeds 10] [--models jaxcsr,jax_ops]``

The paper's transductive Cora model: 8 heads x 8 hidden units with ELU, then one
head of 7 outputs; dropout 0.6 on both layers' inputs and on the normalised attention
coefficients; L2 weight decay 5e-4 on the weights (not biases); Adam, lr 0.005; early
stopping with patience 100 on validation loss and accuracy, testing the parameters of
the best validation loss. Self-loops are included (the GCN adjacency's pattern).

Two implementations of the same model and the same random stream:

``jaxcsr``   scores ``leaky_relu(el[dst] + er[src])`` gathered per stored entry (CSR
             order; GAT's additive attention is no SDDMM: a two-feature
             ``jaxcsr.sddmm`` of ``[el, 1]``, ``[1, er]``: 14.3 vs 10.6 ms per step, one run),
             ``jaxcsr.edge_softmax`` (fused) and the per-head products
             ``A.with_data(alpha[:, h]) @ Wh[:, h]``.
``jax_ops``  the same with gathers by ``dst``/``src`` and the ``jax.ops`` softmax
             composition (``segment_max``, ``exp``, ``segment_sum``, divide) and
             ``segment_sum(alpha * Wh[src], dst)``.

Prints mean and std of test accuracy over seeds, the step time (median, one jitted
``value_and_grad`` + Adam step) and the trace count (1: one compilation per run).
Paper: 83.0 +- 0.7 %.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

import jaxcsr
from benchmarks import measure, report
from examples.gcn import Cora, adam_update, load_cora
from jaxcsr import CSRMatrix

HEADS, HIDDEN, DROPOUT, WEIGHT_DECAY, LR = 8, 8, 0.6, 5e-4, 0.005
PATIENCE, MAX_EPOCHS, SLOPE = 100, 1000, 0.2


def _glorot(key, shape, fan_in, fan_out):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, shape, jnp.float32, -limit, limit)


def init_params(key: jax.Array, n_in: int, n_classes: int) -> dict[str, jax.Array]:
    k = jax.random.split(key, 6)
    return {
        "w1": _glorot(k[0], (n_in, HEADS, HIDDEN), n_in, HEADS * HIDDEN),
        "a1_dst": _glorot(k[1], (HEADS, HIDDEN), HIDDEN, 1),
        "a1_src": _glorot(k[2], (HEADS, HIDDEN), HIDDEN, 1),
        "b1": jnp.zeros(HEADS * HIDDEN),
        "w2": _glorot(k[3], (HEADS * HIDDEN, 1, n_classes), HEADS * HIDDEN, n_classes),
        "a2_dst": _glorot(k[4], (1, n_classes), n_classes, 1),
        "a2_src": _glorot(k[5], (1, n_classes), n_classes, 1),
        "b2": jnp.zeros(n_classes),
    }


# ---------------------------------------------------------- the two aggregations
def jaxcsr_attention(graph, wh, el, er, drop: Callable) -> jax.Array:
    """``(N, H, F)`` attention-weighted sums with jaxcsr's edge softmax and products."""
    A, dst, src = graph  # the matrix; each stored entry's row and column (CSR order)
    scores = jax.nn.leaky_relu(el[dst] + er[src], SLOPE)
    alpha = drop(jaxcsr.edge_softmax(A, scores))
    per_head = jax.vmap(lambda a, v: A.with_data(a) @ v, in_axes=(1, 1), out_axes=1)
    return per_head(alpha, wh)


def jax_ops_attention(graph, wh, el, er, drop: Callable) -> jax.Array:
    """The same with gathers and the ``jax.ops`` segment softmax composition."""
    dst, src = graph
    n = wh.shape[0]
    scores = jax.nn.leaky_relu(el[dst] + er[src], SLOPE)
    peak = jax.ops.segment_max(jax.lax.stop_gradient(scores), dst, n)
    e = jnp.exp(scores - peak[dst])
    alpha = drop(e / jax.ops.segment_sum(e, dst, n)[dst])
    return jax.ops.segment_sum(alpha[:, :, None] * wh[src], dst, n)


def jaxcsr_project(features: CSRMatrix, values, w) -> jax.Array:
    """``X @ W`` for the sparse bag-of-words features with (dropped-out) ``values``."""
    return features.with_data(values) @ w


def jax_ops_project(features, values, w) -> jax.Array:
    rows, cols = features
    return jax.ops.segment_sum(values[:, None] * w[cols], rows, N_NODES)


N_NODES = 2708  # Cora (the jax.ops projection needs a static segment count)


def operands(model: str, data: Cora) -> dict[str, Any]:
    """The graph and the features as the model's step takes them.

    ``graph``: the planned matrix, or ``(dst, src)`` ids. ``features``: Cora's sparse bag
    of words (1.3 % nonzero) as a matrix or ``(rows, cols)``, with its stored ``values``:
    input dropout acts on those -- the same distribution as dropout on the dense array,
    whose zeros stay zero, for 1/75 of the random numbers (threefry on 2 CPU cores: 50 ms
    for the dense 2708 x 1433 mask, more than the rest of the step).
    """
    assert data.features.shape[0] == N_NODES
    pattern = data.adjacency  # symmetric, with self-loops; values unused
    x = sp.csr_array(data.features)
    values = jnp.asarray(x.data)
    if model == "jaxcsr":
        A = CSRMatrix.from_scipy(pattern)
        dst = np.repeat(np.arange(A.shape[0]), np.diff(pattern.indptr))
        return {
            "graph": (A, jnp.asarray(dst, jnp.int32), A.indices),
            "features": CSRMatrix.from_scipy(x),
            "values": values,
        }
    coo = pattern.tocoo()
    rows = np.repeat(np.arange(x.shape[0]), np.diff(x.indptr))
    return {
        "graph": (jnp.asarray(coo.row, jnp.int32), jnp.asarray(coo.col, jnp.int32)),
        "features": (jnp.asarray(rows, jnp.int32), jnp.asarray(x.indices, jnp.int32)),
        "values": values,
    }


# ------------------------------------------------------------------------ model
def forward(params, model: str, inputs: dict, key, train: bool) -> jax.Array:
    project, attention = MODELS[model]
    keys = iter(jax.random.split(key, 5))

    def drop(h):
        if not train:
            return h
        keep = jax.random.bernoulli(next(keys), 1 - DROPOUT, h.shape)
        return jnp.where(keep, h / (1 - DROPOUT), 0)

    def layer(wh, a_dst, a_src):
        el, er = jnp.sum(wh * a_dst, -1), jnp.sum(wh * a_src, -1)  # (N, H)
        return attention(inputs["graph"], wh, el, er, drop)

    w1 = params["w1"].reshape(params["w1"].shape[0], -1)
    wh = project(inputs["features"], drop(inputs["values"]), w1).reshape(-1, HEADS, HIDDEN)
    h = jax.nn.elu(layer(wh, params["a1_dst"], params["a1_src"]))
    h = h.reshape(h.shape[0], -1) + params["b1"]
    out = layer(
        jnp.einsum("nf,fhk->nhk", drop(h), params["w2"]), params["a2_dst"], params["a2_src"]
    )
    return out.mean(axis=1) + params["b2"]


def _nll(logits, labels, mask):
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.take_along_axis(logp, labels[:, None], 1)[:, 0] * mask) / jnp.sum(mask)


def loss_fn(params, model, inputs, labels, mask, key):
    logits = forward(params, model, inputs, key, train=True)
    l2 = sum(jnp.sum(v**2) for k, v in params.items() if not k.startswith("b"))
    return _nll(logits, labels, mask) + WEIGHT_DECAY * 0.5 * l2


def make_step(model: str, traces: list | None = None):
    """One training step (forward, backward, Adam) as one jitted function."""

    @jax.jit
    def step(params, state, inputs, labels, mask, key, epoch):
        if traces is not None:
            traces.append(1)
        loss, grads = jax.value_and_grad(loss_fn)(params, model, inputs, labels, mask, key)
        params, state = adam_update(params, grads, state, epoch, lr=LR)
        return params, state, loss

    return step


def make_eval(model: str):
    @jax.jit
    def evaluate(params, inputs, labels, val_mask, test_mask):
        logits = forward(params, model, inputs, jax.random.PRNGKey(0), train=False)
        correct = jnp.argmax(logits, 1) == labels
        acc = lambda m: jnp.sum(correct * m) / jnp.sum(m)  # noqa: E731
        return _nll(logits, labels, val_mask), acc(val_mask), acc(test_mask)

    return evaluate


MODELS = {
    "jaxcsr": (jaxcsr_project, jaxcsr_attention),
    "jax_ops": (jax_ops_project, jax_ops_attention),
}


def _setup(data: Cora, model: str, seed: int):
    inputs = operands(model, data)
    labels = jnp.asarray(data.labels)
    key, init_key = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(init_key, data.features.shape[1], data.num_classes)
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}
    return inputs, labels, key, params, state


def train(
    data: Cora, model: str, seed: int, max_epochs: int = MAX_EPOCHS, patience: int = PATIENCE
) -> dict[str, Any]:
    """Trains one GAT with early stopping; returns test accuracy and step times."""
    inputs, labels, key, params, state = _setup(data, model, seed)
    masks = [jnp.zeros(len(data.labels)).at[i].set(1.0) for i in (data.train, data.val, data.test)]
    traces: list = []
    step, evaluate = make_step(model, traces), make_eval(model)
    best = {"loss": np.inf, "acc": 0.0, "test": 0.0, "epoch": 0}
    waited, times = 0, []
    for epoch in range(max_epochs):
        key, k = jax.random.split(key)
        seconds, (params, state, _) = measure.timed(
            lambda p=params, s=state, k=k, e=epoch: step(p, s, inputs, labels, masks[0], k, e)
        )
        times.append(seconds)
        val_loss, val_acc, test_acc = (
            float(v) for v in evaluate(params, inputs, labels, *masks[1:])
        )
        if val_loss <= best["loss"] or val_acc >= best["acc"]:
            if val_loss <= best["loss"]:  # test the parameters of the best validation loss
                best.update(test=test_acc, epoch=epoch)
            best["loss"], best["acc"] = min(val_loss, best["loss"]), max(val_acc, best["acc"])
            waited = 0
        else:
            waited += 1
            if waited == patience:
                break
    return {
        "model": model,
        "seed": seed,
        "test_accuracy": best["test"],
        "best_epoch": best["epoch"],
        "epochs": epoch + 1,
        "step_median_s": float(np.median(times[10:])) if len(times) > 10 else float("nan"),
        "compile_s": times[0],
        "traces": len(traces),
    }


def step_time(data: Cora, model: str, repeats: int = 50) -> float:
    """Median seconds of one training step (after compilation and warm-up)."""
    inputs, labels, key, params, state = _setup(data, model, 0)
    mask = jnp.zeros(len(data.labels)).at[data.train].set(1.0)
    step = make_step(model)
    times = []
    for epoch in range(repeats + 5):
        seconds, (params, state, _) = measure.timed(
            lambda p=params, s=state, e=epoch: step(p, s, inputs, labels, mask, key, e)
        )
        times.append(seconds)
    return float(np.median(times[5:]))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(
        prog="python -m examples.gat",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seeds", type=int, default=10, help="training runs per model")
    p.add_argument(
        "--models", default="jaxcsr,jax_ops", help="comma-separated subset of " + ",".join(MODELS)
    )
    p.add_argument("--max-epochs", type=int, default=MAX_EPOCHS)
    p.add_argument("--out", type=Path, default=None, help="folder for gat.json and gat.md")
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    bad = sorted(set(names) - set(MODELS))
    if bad or not names:
        p.error(f"unknown models: {bad}; choose from {list(MODELS)}")
    data = load_cora()
    runs = []
    for name in names:
        for seed in range(args.seeds):
            run = train(data, name, seed, args.max_epochs)
            runs.append(run)
            print(
                f"{name} seed {seed}: test accuracy {100 * run['test_accuracy']:.1f} % "
                f"(best epoch {run['best_epoch']}, stopped after {run['epochs']}), "
                f"step {1e3 * run['step_median_s']:.2f} ms",
                file=sys.stderr,
                flush=True,
            )
    lines = [
        "| model | step time (median, ms) | traces | test accuracy (mean ± std) |",
        "|---|---|---|---|",
    ]
    for name in names:
        rs = [r for r in runs if r["model"] == name]
        accs = np.array([r["test_accuracy"] for r in rs])
        steps = np.array([r["step_median_s"] for r in rs]) * 1e3
        lines.append(
            f"| {name} | {np.median(steps):.2f} | {max(r['traces'] for r in rs)} | "
            f"{100 * accs.mean():.1f} ± {100 * accs.std():.1f} (n={len(accs)}) |"
        )
    print("\n".join(lines))
    if args.out is not None:
        record = {**report.provenance("examples.gat", argv), "runs": runs}
        report.write_study(args.out, "gat", record, "\n".join(lines) + "\n")
    return runs


if __name__ == "__main__":
    main()
