"""Sharded products across processes; run by test_multiprocess.py, never imported.

``python tests/multiprocess_checks.py PROCESS_ID NUM_PROCESSES PORT [--mismatch]``:
each process forces 2 CPU devices, joins ``jax.distributed`` on localhost (gloo CPU
collectives) and checks the sharded products over all processes' devices against
the single-device result of its own unsharded matrix. ``--mismatch``: process 1 builds
a different graph, which ``shard`` must refuse with a clear error. Prints ``ok``.
"""

from __future__ import annotations

import os
import sys

PROCESS, PROCESSES, PORT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
MISMATCH = "--mismatch" in sys.argv
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{PORT}", PROCESSES, PROCESS, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import jaxcsr  # noqa: E402
from benchmarks.datasets import load_graph  # noqa: E402
from jaxcsr import CSRMatrix  # noqa: E402

assert jax.process_count() == PROCESSES and jax.device_count() == 2 * PROCESSES
mesh = jax.make_mesh((jax.device_count(),), ("d",))


def gathered(x) -> np.ndarray:
    """A global array, whole, on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def close(actual, expected, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(actual, np.asarray(expected), rtol=rtol, atol=atol)


rng = np.random.default_rng(0)  # the same graph and values in every process
graph = load_graph("cora")
M, K = graph.num_nodes, graph.num_edges
receivers = graph.dst.copy()
if MISMATCH and PROCESS == 1:
    receivers[:10] = (receivers[:10] + 1) % M
A = CSRMatrix.from_indices(receivers, M)
order = np.argsort(receivers, kind="stable")  # each row's edges, in input order
indptr = np.concatenate([[0], np.cumsum(np.bincount(receivers, minlength=M))])
loaded = []  # the rows this process read


def load_rows(lo, hi):
    loaded.append((lo, hi))
    return order[indptr[lo] : indptr[hi]]


with jax.set_mesh(mesh):
    try:
        S = jaxcsr.shard(A, mesh, "d")
    except ValueError as err:
        assert MISMATCH and "differ between processes" in str(err), err
        try:
            jaxcsr.shard_rows(np.diff(indptr), load_rows, mesh, "d", num_cols=K, form="segment")
        except ValueError as err:
            assert "differ between processes" in str(err) and not loaded, err
            print("mismatch refused")
            print("ok")
            sys.exit(0)
    assert not MISMATCH, "different graphs per process must be refused"
    assert S.shape == A.shape
    # segment form: per-edge values in input order, forward and gradient
    v = rng.standard_normal((K, 8)).astype(np.float32)
    ct = rng.standard_normal((M, 8)).astype(np.float32)
    # a sharded matrix spans other processes' devices: pass it to jit, never close over it
    y = jax.jit(lambda S, v: S @ v)(S, v)
    close(gathered(y), A @ v)
    g = jax.jit(jax.grad(lambda v, S: jnp.sum(jnp.sin(S @ v) * ct)))(v, S)
    close(gathered(g), jax.grad(lambda v: jnp.sum(jnp.sin(A @ v) * ct))(v))
    peak = jax.jit(lambda S, v: jaxcsr.matmul(S, v, reduce="max"))(S, v)
    np.testing.assert_array_equal(gathered(peak), np.asarray(jaxcsr.matmul(A, v, reduce="max")))
    # shard_rows: this process reads only the rows of its own devices' blocks
    SR = jaxcsr.shard_rows(np.diff(indptr), load_rows, mesh, "d", num_cols=K, form="segment")
    own = [(S.row_starts[p], S.row_starts[p + 1]) for p in (2 * PROCESS, 2 * PROCESS + 1)]
    assert sorted(loaded) == own, (loaded, own)
    share = sum(int(indptr[hi] - indptr[lo]) for lo, hi in loaded) / K
    print(f"process {PROCESS}: shard_rows read {share:.1%} of the edges")
    assert share < 0.75, share
    np.testing.assert_array_equal(gathered(jax.jit(lambda S, v: S @ v)(SR, v)), gathered(y))
    np.testing.assert_array_equal(
        gathered(jax.jit(jax.grad(lambda v, S: jnp.sum(jnp.sin(S @ v) * ct)))(v, SR)),
        gathered(g),
    )
    laid = SR.layout_values(v)  # each process fills its own blocks
    np.testing.assert_array_equal(
        gathered(jax.jit(lambda S, vl: S.matmul_laid_out(vl))(SR, laid)), gathered(y)
    )
    try:
        _ = SR.input_order
    except ValueError as err:
        assert "not on this host" in str(err), err
    else:
        raise AssertionError("another process's blocks are not on this host")
    # SpMM form: a GCN's normalised adjacency, a few training steps on Cora
    adj = CSRMatrix.from_scipy(graph.normalized_adjacency())
    SA = jaxcsr.shard(adj, mesh, "d")
    features = rng.standard_normal((M, 16)).astype(np.float32)
    labels = rng.integers(0, 7, M)
    w0 = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    w1 = (rng.standard_normal((16, 7)) / 4).astype(np.float32)

    def loss(params, adj):
        h = jax.nn.relu(adj @ (features @ params[0]))
        logits = adj @ (h @ params[1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    def train(adj, steps=5):
        params, losses = (w0, w1), []
        step = jax.jit(jax.value_and_grad(loss))  # adj is an argument
        for _ in range(steps):
            value, grads = step(params, adj)
            params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
            losses.append(float(value))
        return np.array(losses)

    sharded, single = train(SA), train(adj)
    close(sharded, single, rtol=1e-5, atol=0)
    csr = graph.normalized_adjacency().tocsr()
    SAR = jaxcsr.shard_rows(
        np.diff(csr.indptr),
        lambda lo, hi: (csr.indices[csr.indptr[lo] : csr.indptr[hi]],
                        csr.data[csr.indptr[lo] : csr.indptr[hi]]),
        mesh, "d", num_cols=M, dtype=np.float32,
    )  # fmt: skip
    close(train(SAR), single, rtol=1e-5, atol=0)
    print(f"process {PROCESS}: losses {np.round(sharded, 5).tolist()}")
print("ok")
