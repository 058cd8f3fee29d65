"""Workloads and the systems that compute them: jaxcsr and every peer, side by side.

A :class:`Case` is one cell of the result table (graph x workload x pass x N x
dtype). It holds ready-to-call thunks, one per system, with inputs already on the
right device/library, plus the byte count of the bandwidth floor for the cell.

Workloads (``E`` edges, ``V`` nodes, ``N`` features):

``segment``   ``A @ messages``, ``A = CSRMatrix.from_indices(dst, V)``, messages
              ``(E, N)``: GNN aggregation / ``segment_sum``.
``spmm``      ``Â @ X`` with the GCN-normalised adjacency ``Â`` and ``X (V, N)``: includes
              the gather of ``X[src]``.
``last_axis`` ``values @ A.T`` with values ``(N, E)``: scatter-add along the last axis.
``segment_mean`` / ``segment_max``  ``matmul(A, messages, reduce="mean"/"max")``. The
              peer columns hold the same library's op for that reduce:
              ``segment_sum``/``segment_sum_sorted`` run ``jax.ops.segment_max``
              (mean: ``jax.ops.segment_sum`` divided by the host-counted degrees),
              ``torch_scatter_reduce`` runs ``scatter_reduce_("mean"/"amax",
              include_self=False)``; jax.ops' ``-inf`` in empty segments is mapped to
              jaxcsr's 0 before the check (untimed).
``segment_softmax``  ``jaxcsr.segment_softmax(logits, dst, V)`` with logits ``(E, N)``
              (GNN attention over incoming edges) vs the jax.ops idiom
              ``exp(x - segment_max(x)[dst]) / segment_sum(...)[dst]`` (sorted and
              unsorted ids) and the same composition in torch (``scatter_reduce_("amax")``,
              ``index_select``, ``index_add_``) in the ``torch_index_add`` column.

Passes: ``fwd``; ``bwd`` (cotangent for the dense operand); ``bwd_data`` (cotangent
for the matrix values, ``spmm`` only). Backward thunks run only the backward
computation (``jax.vjp`` under ``jit``; the primal is dead code), and for scipy and
torch the operation their autograd would run (``A.T @ ct``, ``index_select``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.experimental import sparse as jsparse

import jaxcsr
from benchmarks.datasets import Graph
from jaxcsr import CSRMatrix, kernels

try:
    import torch
except ImportError:  # optional extra
    torch = None

INDEX_BYTES = 4


@dataclasses.dataclass
class Case:
    graph: str
    workload: str
    pass_: str
    n_features: int
    dtype: str
    floor_bytes: int
    systems: dict[str, Callable[[], Any]]
    # maps a system's output to jaxcsr's layout before the correctness check
    # (not timed): e.g. pre-sorted inputs give outputs in sorted order.
    to_reference: dict[str, Callable[[np.ndarray], np.ndarray]] = dataclasses.field(
        default_factory=dict
    )
    # float64 numpy/scipy result of the cell (from the inputs as the systems see them,
    # i.e. rounded to the cell's dtype), against which jaxcsr's output is checked.
    reference: Callable[[], np.ndarray] | None = None
    # what jaxcsr runs for the cell's product on this platform, and why (plan_info)
    strategy: str = ""


def strategy(matrix: CSRMatrix, n_features: int) -> str:
    """What ``matrix @ x`` with ``n_features`` features runs on this platform, and why
    (from :meth:`jaxcsr.CSRMatrix.plan_info`)."""
    runs = matrix.plan_info(n_features).strategies
    kernel = kernels.platform_kernel(jax.default_backend())
    return runs.get(f"forward, {kernel}") or runs.get(
        f"forward, xla on {jax.default_backend()}", ""
    )


def _f64(x: Any) -> np.ndarray:
    """A float64 numpy copy of an array (bfloat16 included)."""
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# Every JAX system takes its index arrays (a matrix, segment ids) as a jit argument, as
# in a training step that receives its graph: closed over, they would be XLA constants,
# and XLA constant-folds gathers of constants at compile time (minutes for BCSR's
# backward on tolokers), which no user sees.


def _vjp(f: Callable) -> Callable:
    """A jitted ``(primal, ct, operand) -> cotangent`` running only ``f(primal, operand)``'s
    backward pass."""
    return jax.jit(lambda p, ct, op: jax.vjp(lambda p: f(p, op), p)[1](ct)[0])


def _data_vjp(f: Callable) -> Callable:
    """A jitted ``(values, x, ct, operand) -> cotangent of values`` of ``f(values, x, op)``."""
    return jax.jit(lambda d, x, ct, op: jax.vjp(lambda d: f(d, x, op), d)[1](ct)[0])


def _bind(fn: Callable, *args: Any) -> Callable[[], Any]:
    """A thunk ``fn(*args)``; a ``functools.partial``, so tests can lower ``fn`` with its
    arguments (and check what it holds as constants)."""
    return functools.partial(fn, *args)


class _Edges(NamedTuple):
    """Per-edge inputs ``(E, N)`` shared by the edge-form workloads."""

    host: np.ndarray  # float32 numpy copy (scipy, torch)
    values: jax.Array  # in input (edge) order
    sorted_values: jax.Array  # pre-sorted by destination, for the sorted peer
    order: np.ndarray  # the sort: sorted_values == values[order]
    unsort: np.ndarray  # its inverse, mapping sorted-order outputs back


def _passes(f: dict, operands: dict, x, ct) -> tuple[dict, dict]:
    """Forward and backward thunks of ``f[name](x, operands[name])`` (operands passed to
    ``jit`` as arguments)."""
    fwd = {k: _bind(jax.jit(fn), x, operands.get(k)) for k, fn in f.items()}
    bwd = {k: _bind(_vjp(fn), x, ct, operands.get(k)) for k, fn in f.items()}
    return fwd, bwd


def _edge_passes(
    f: dict, fsorted: Callable, operands: dict, edges: _Edges, ct, ct_sorted
) -> tuple[dict, dict]:
    """:func:`_passes` for edge-input systems; the sorted peer gets sorted inputs."""
    fwd, bwd = _passes(f, operands, edges.values, ct)
    sorted_fwd, sorted_bwd = _passes(
        {"segment_sum_sorted": fsorted}, operands, edges.sorted_values, ct_sorted
    )
    return {**fwd, **sorted_fwd}, {**bwd, **sorted_bwd}


def _torch_dtype(dtype: np.dtype):
    return {np.dtype(np.float32): torch.float32, np.dtype(jnp.bfloat16): torch.bfloat16}[
        np.dtype(dtype)
    ]


def _to_torch(x: Any, dtype: np.dtype):
    return torch.from_numpy(np.asarray(x, np.float32)).to(_torch_dtype(dtype))


def _torch_csr(mat: sp.csr_array, dtype: np.dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(
            torch.from_numpy(mat.indptr.astype(np.int64)),
            torch.from_numpy(mat.indices.astype(np.int64)),
            _to_torch(mat.data, dtype),
            size=mat.shape,
            check_invariants=True,
        )


def jax_sparse_twins(mat: sp.csr_array, dtype: np.dtype):
    """``jax.experimental.sparse`` BCSR and BCOO twins of ``mat`` with ``dtype`` values."""
    bcsr = jsparse.BCSR.from_scipy_sparse(mat)
    bcoo = jsparse.BCOO.from_scipy_sparse(mat)
    bcsr = jsparse.BCSR((bcsr.data.astype(dtype), bcsr.indices, bcsr.indptr), shape=mat.shape)
    bcoo = jsparse.BCOO((bcoo.data.astype(dtype), bcoo.indices), shape=mat.shape)
    return bcsr, bcoo


def build_cases(
    graph: Graph,
    n_features: int,
    dtype: Any,
    *,
    peers: tuple[str, ...],
    workloads: tuple[str, ...],
    rng: np.random.Generator,
) -> Iterator[Case]:
    """Yields the cases for one graph, feature width and dtype (inputs built lazily)."""
    dtype = np.dtype(dtype)
    b = dtype.itemsize
    V, E, N = graph.num_nodes, graph.num_edges, n_features
    use_torch = torch is not None
    want = set(peers)
    name = dtype.name

    def case(workload, pass_, floor, systems, to_reference=None, reference=None, matrix=None):
        systems = {k: v for k, v in systems.items() if k == "jaxcsr" or k in want}
        matrix = matrix or (A if pass_ == "fwd" else A.T)
        # plan_info describes products: not the feature-major ones (last_axis), the
        # fused softmax, or a max/min backward (arg search and put)
        described = workload in ("segment", "segment_mean", "spmm") or (
            workload in ("segment_max", "segment_min") and pass_ == "fwd"
        )
        runs = strategy(matrix, N) if described and pass_ in ("fwd", "bwd") else ""
        return Case(
            graph.name, workload, pass_, N, name, floor, systems, to_reference or {}, reference,
            runs,
        )  # fmt: skip

    dst = jnp.asarray(graph.dst, jnp.int32)
    order = np.argsort(graph.dst, kind="stable")
    dst_sorted = jnp.asarray(graph.dst[order], jnp.int32)
    seg_scipy = sp.csr_array((np.ones(E, np.float32), (graph.dst, np.arange(E))), shape=(V, E))
    seg_scipy_t = seg_scipy.T.tocsr()
    A = CSRMatrix.from_indices(graph.dst, num_rows=V)
    operands = {"jaxcsr": A, "segment_sum": dst, "segment_sum_sorted": dst_sorted}

    if workloads_need_messages(workloads):
        msgs_np = rng.uniform(-1, 1, (E, N)).astype(np.float32)
        ct_np = rng.uniform(-1, 1, (V, N)).astype(np.float32)
        msgs = jnp.asarray(msgs_np, dtype)
        edges = _Edges(msgs_np, msgs, msgs[order], order, np.argsort(order))
        ct = jnp.asarray(ct_np, dtype)

    if "segment" in workloads:
        bcsr, bcoo = jax_sparse_twins(seg_scipy, dtype)
        f = {
            "jaxcsr": lambda m, A: A @ m,
            "segment_sum": lambda m, ids: jax.ops.segment_sum(m, ids, V),
            "bcsr": lambda m, mat: mat @ m,
            "bcoo": lambda m, mat: mat @ m,
        }
        fsorted = lambda m, ids: jax.ops.segment_sum(m, ids, V, indices_are_sorted=True)  # noqa: E731
        fwd, bwd = _edge_passes(f, fsorted, {**operands, "bcsr": bcsr, "bcoo": bcoo}, edges, ct, ct)
        if dtype == np.float32:
            fwd["scipy"] = _bind(seg_scipy.__matmul__, msgs_np)
            bwd["scipy"] = _bind(seg_scipy_t.__matmul__, ct_np)
        if use_torch:
            tm, tct = _to_torch(msgs_np, dtype), _to_torch(ct_np, dtype)
            tdst = torch.from_numpy(graph.dst)
            tdst_x = tdst[:, None].expand(E, N)
            tcsr, tcsr_t = _torch_csr(seg_scipy, dtype), _torch_csr(seg_scipy_t, dtype)
            fwd["torch_index_add"] = lambda: torch.zeros(V, N, dtype=tm.dtype).index_add_(
                0, tdst, tm
            )
            fwd["torch_scatter_reduce"] = lambda: torch.zeros(V, N, dtype=tm.dtype).scatter_reduce_(
                0, tdst_x, tm, "sum"
            )
            fwd["torch_sparse_csr"] = lambda: tcsr @ tm
            bwd["torch_index_add"] = lambda: tct.index_select(0, tdst)
            bwd["torch_scatter_reduce"] = lambda: tct.gather(0, tdst_x)
            bwd["torch_sparse_csr"] = lambda: tcsr_t @ tct
        io = E * N * b + V * N * b + E * INDEX_BYTES
        seg64 = seg_scipy.astype(np.float64)
        yield case("segment", "fwd", io, fwd, reference=lambda: seg64 @ _f64(msgs))
        # segment_sum_sorted's backward is in sorted edge order
        unsort = {"segment_sum_sorted": lambda y: y[edges.unsort]}
        yield case("segment", "bwd", io, bwd, unsort, reference=lambda: seg64.T @ _f64(ct))

    if "segment_softmax" in workloads:
        ct_e = jnp.asarray(rng.uniform(-1, 1, (E, N)), dtype)
        yield from _softmax_cases(case, graph, operands, edges, ct_e, dtype, use_torch)

    for reduce in ("mean", "max"):
        if f"segment_{reduce}" in workloads:
            yield from _reduce_cases(case, reduce, graph, operands, edges, ct, dtype, use_torch)

    if "last_axis" in workloads:
        vals = msgs.T  # (N, E)
        vals_np = np.ascontiguousarray(msgs_np.T)
        ct_t = ct.T
        vals, ct_t = jnp.asarray(vals), jnp.asarray(ct_t)
        f = {
            "jaxcsr": lambda v, A_T: v @ A_T,
            "segment_sum": lambda v, ids: jnp.zeros((N, V), v.dtype).at[:, ids].add(v),
        }
        fwd, bwd = _passes(f, {"jaxcsr": A.T, "segment_sum": dst}, vals, ct_t)
        if dtype == np.float32:
            fwd["scipy"] = _bind(seg_scipy_t.__rmatmul__, vals_np)
            bwd["scipy"] = _bind(seg_scipy.__rmatmul__, np.ascontiguousarray(ct_np.T))
        if use_torch:
            tv, tct = _to_torch(vals_np, dtype), _to_torch(np.ascontiguousarray(ct_np.T), dtype)
            tdst = torch.from_numpy(graph.dst)
            fwd["torch_index_add"] = lambda: torch.zeros(N, V, dtype=tv.dtype).index_add_(
                1, tdst, tv
            )
            bwd["torch_index_add"] = lambda: tct.index_select(1, tdst)
        io = E * N * b + V * N * b + E * INDEX_BYTES
        seg64 = seg_scipy.astype(np.float64)
        yield case("last_axis", "fwd", io, fwd, reference=lambda: (seg64 @ _f64(vals).T).T)
        yield case("last_axis", "bwd", io, bwd, reference=lambda: (seg64.T @ _f64(ct_t).T).T)

    if "spmm" in workloads:
        adj = graph.normalized_adjacency()
        nnz = adj.nnz
        B = CSRMatrix.from_scipy(adj)
        B = B.with_data(B.data.astype(dtype))
        coo = adj.tocoo()
        row, col = jnp.asarray(coo.row, jnp.int32), jnp.asarray(coo.col, jnp.int32)
        # the GNN idiom gathers in edge (input) order; build it from a shuffled COO
        shuffle = rng.permutation(nnz)
        row_u, col_u = row[shuffle], col[shuffle]
        w = jnp.asarray(coo.data, dtype)
        w_u = w[shuffle]
        x_np = rng.uniform(-1, 1, (V, N)).astype(np.float32)
        ct_np = rng.uniform(-1, 1, (V, N)).astype(np.float32)
        x, ct = jnp.asarray(x_np, dtype), jnp.asarray(ct_np, dtype)
        bcsr, bcoo = jax_sparse_twins(adj, dtype)
        adj_t = adj.T.tocsr()
        f = {
            "jaxcsr": lambda x, B: B @ x,
            "segment_sum": lambda x, op: jax.ops.segment_sum(op[0][:, None] * x[op[1]], op[2], V),
            "segment_sum_sorted": lambda x, op: jax.ops.segment_sum(
                op[0][:, None] * x[op[1]], op[2], V, indices_are_sorted=True
            ),
            "bcsr": lambda x, mat: mat @ x,
            "bcoo": lambda x, mat: mat @ x,
        }
        spmm_operands = {
            "jaxcsr": B,
            "segment_sum": (w_u, col_u, row_u),
            "segment_sum_sorted": (w, col, row),
            "bcsr": bcsr,
            "bcoo": bcoo,
        }
        fwd, bwd = _passes(f, spmm_operands, x, ct)
        if dtype == np.float32:
            fwd["scipy"] = _bind(adj.__matmul__, x_np)
            bwd["scipy"] = _bind(adj_t.__matmul__, ct_np)
        if use_torch:
            tx, tct = _to_torch(x_np, dtype), _to_torch(ct_np, dtype)
            tcsr, tcsr_t = _torch_csr(adj, dtype), _torch_csr(adj_t, dtype)
            trow = torch.from_numpy(coo.row.astype(np.int64)[shuffle])
            tcol = torch.from_numpy(coo.col.astype(np.int64)[shuffle])
            tw = _to_torch(coo.data[shuffle], dtype)[:, None]
            fwd["torch_index_add"] = lambda: torch.zeros(V, N, dtype=tx.dtype).index_add_(
                0, trow, tw * tx.index_select(0, tcol)
            )
            fwd["torch_sparse_csr"] = lambda: tcsr @ tx
            bwd["torch_index_add"] = lambda: torch.zeros(V, N, dtype=tx.dtype).index_add_(
                0, tcol, tw * tct.index_select(0, trow)
            )
            bwd["torch_sparse_csr"] = lambda: tcsr_t @ tct
        io = 2 * V * N * b + nnz * (INDEX_BYTES + b) + (V + 1) * INDEX_BYTES
        adj64 = sp.csr_array((_f64(B.data), adj.indices, adj.indptr), shape=adj.shape)
        yield case("spmm", "fwd", io, fwd, reference=lambda: adj64 @ _f64(x), matrix=B)
        yield case("spmm", "bwd", io, bwd, reference=lambda: adj64.T @ _f64(ct), matrix=B.T)

        # cotangent for the matrix values (SDDMM); outputs in CSR order. X is an
        # argument, as in a training step: closed over, it would be an XLA constant and
        # a peer's gather X[col] would be constant-folded at compile time.
        data = B.data
        g = {
            "jaxcsr": lambda d, x, B: B.with_data(d) @ x,
            "segment_sum_sorted": lambda d, x, op: jax.ops.segment_sum(
                d[:, None] * x[op[1]], op[2], V, indices_are_sorted=True
            ),
        }
        bwd_data = {k: _bind(_data_vjp(fn), data, x, ct, spmm_operands[k]) for k, fn in g.items()}
        io = 2 * V * N * b + nnz * (2 * INDEX_BYTES + b)
        rows_csr = np.repeat(np.arange(V), np.diff(adj.indptr))

        def sddmm64():
            return np.sum(_f64(ct)[rows_csr] * _f64(x)[adj.indices], axis=1)

        yield case("spmm", "bwd_data", io, bwd_data, reference=sddmm64)


def workloads_need_messages(workloads) -> bool:
    return bool(
        {"segment", "last_axis", "segment_mean", "segment_max", "segment_softmax"} & set(workloads)
    )


def jax_ops_softmax(x, ids, num_segments, *, indices_are_sorted=False):
    """The stable segment softmax users write with ``jax.ops`` (jraph's
    ``segment_softmax``: shift by the segment max, ``exp``, sum, divide)."""
    kw = dict(indices_are_sorted=indices_are_sorted)
    peak = jax.ops.segment_max(jax.lax.stop_gradient(x), ids, num_segments, **kw)
    e = jnp.exp(x - peak[ids])
    return e / jax.ops.segment_sum(e, ids, num_segments, **kw)[ids]


def softmax64(x: Any, ids: np.ndarray, num_segments: int) -> np.ndarray:
    """The float64 segment softmax of ``x`` (``(n,)`` or ``(n, H)``) over ``ids``."""
    x = _f64(x)
    shape = (num_segments, *x.shape[1:])
    peak = np.full(shape, -np.inf)
    np.maximum.at(peak, ids, x)
    e = np.exp(x - peak[ids])
    total = np.zeros(shape)
    np.add.at(total, ids, e)
    return e / total[ids]


def _softmax_cases(case, graph, operands, edges: _Edges, ct_e, dtype, use_torch):
    """``segment_softmax`` cells: fwd and bwd, outputs per edge (input order).

    jaxcsr's ``segment_softmax`` takes host segment ids (its signature): its planned
    matrix is a constant of the jitted function, whose products keep their indices
    constant anyway (see ``jaxcsr.ops.behind_barrier``)."""
    V, E = graph.num_nodes, graph.num_edges
    N = edges.values.shape[1]
    ids = graph.dst
    f = {
        "jaxcsr": lambda x, _: jaxcsr.segment_softmax(x, ids, V),
        "segment_sum": lambda x, dst: jax_ops_softmax(x, dst, V),
    }
    fsorted = lambda x, dst: jax_ops_softmax(x, dst, V, indices_are_sorted=True)  # noqa: E731
    fwd, bwd = _edge_passes(f, fsorted, operands, edges, ct_e, ct_e[edges.order])
    if use_torch:
        tm = _to_torch(edges.host, dtype)
        tdst = torch.from_numpy(graph.dst)
        tdst_x = tdst[:, None].expand(E, N)

        def torch_softmax():
            peak = torch.zeros(V, N, dtype=tm.dtype).scatter_reduce_(
                0, tdst_x, tm, "amax", include_self=False
            )
            e = torch.exp(tm - peak.index_select(0, tdst))
            total = torch.zeros(V, N, dtype=tm.dtype).index_add_(0, tdst, e)
            return e / total.index_select(0, tdst)

        fwd["torch_index_add"] = torch_softmax
    b = np.dtype(dtype).itemsize
    io = 2 * E * N * b + E * INDEX_BYTES  # logits in, probabilities out
    fix = {"segment_sum_sorted": lambda y: y[edges.unsort]}

    def reference64():
        return softmax64(edges.values, ids, V)

    def softmax_grad64():
        p, g = reference64(), _f64(ct_e)
        inner = np.zeros((V, N))
        np.add.at(inner, ids, p * g)
        return p * (g - inner[ids])

    yield case("segment_softmax", "fwd", io, fwd, fix, reference=reference64)
    yield case("segment_softmax", "bwd", io + E * N * b, bwd, fix, reference=softmax_grad64)


def _reduce_cases(
    case, reduce, graph, operands, edges: _Edges, ct, dtype, use_torch
) -> Iterator[Case]:
    """``segment_mean`` / ``segment_max`` cells: fwd and bwd (dense operand)."""
    V, E = graph.num_nodes, graph.num_edges
    N = edges.values.shape[1]
    counts = np.bincount(graph.dst, minlength=V)
    empty = counts == 0
    inverse_degree = jnp.asarray(1.0 / np.maximum(counts, 1), jnp.float32)[:, None]

    def by_degree(total):
        return (total.astype(jnp.float32) * inverse_degree).astype(total.dtype)

    if reduce == "mean":
        f = {
            "jaxcsr": lambda m, A: jaxcsr.matmul(A, m, reduce="mean"),
            "segment_sum": lambda m, dst: by_degree(jax.ops.segment_sum(m, dst, V)),
        }
        fsorted = lambda m, dst: by_degree(  # noqa: E731
            jax.ops.segment_sum(m, dst, V, indices_are_sorted=True)
        )
        fix = {}
    else:
        f = {
            "jaxcsr": lambda m, A: jaxcsr.matmul(A, m, reduce="max"),
            "segment_sum": lambda m, dst: jax.ops.segment_max(m, dst, V),
        }
        fsorted = lambda m, dst: jax.ops.segment_max(m, dst, V, indices_are_sorted=True)  # noqa: E731
        zero_empty = lambda y: np.where(empty[:, None], 0, y)  # noqa: E731
        fix = {"segment_sum": zero_empty, "segment_sum_sorted": zero_empty}
    fwd, bwd = _edge_passes(f, fsorted, operands, edges, ct, ct)
    if use_torch:
        tm = _to_torch(edges.host, dtype)
        tdst_x = torch.from_numpy(graph.dst)[:, None].expand(E, N)
        op = "mean" if reduce == "mean" else "amax"
        fwd["torch_scatter_reduce"] = lambda: torch.zeros(V, N, dtype=tm.dtype).scatter_reduce_(
            0, tdst_x, tm, op, include_self=False
        )
    b = np.dtype(dtype).itemsize
    io = E * N * b + V * N * b + E * INDEX_BYTES
    ids = graph.dst
    scale = 1.0 / np.maximum(counts, 1)[:, None]

    def fwd64():
        m = _f64(edges.values)
        if reduce == "mean":
            total = np.zeros((V, N))
            np.add.at(total, ids, m)
            return total * scale
        peak = np.full((V, N), -np.inf)
        np.maximum.at(peak, ids, m)
        return np.where(empty[:, None], 0.0, peak)

    def bwd64():
        g = _f64(ct)
        if reduce == "mean":
            return (g * scale)[ids]
        m = _f64(edges.values)
        hit = np.where(m == fwd64()[ids], np.arange(E)[:, None], E)
        first = np.full((V, N), E)
        np.minimum.at(first, ids, hit)  # the first edge attaining each max gets the gradient
        return np.where(first[ids] == np.arange(E)[:, None], g[ids], 0.0)

    yield case(f"segment_{reduce}", "fwd", io, fwd, fix, reference=fwd64)
    unsorted = {"segment_sum_sorted": lambda y: y[edges.unsort]}
    yield case(f"segment_{reduce}", "bwd", io, bwd, unsorted, reference=bwd64)
