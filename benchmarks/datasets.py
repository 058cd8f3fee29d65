"""Graph loaders (numpy/scipy only, no downloads) for the embedded and shared graphs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import scipy.sparse as sp

DATA_DIR = Path(__file__).parent / "data"
EMBEDDED = ("tolokers", "musae_github", "planetoid_pubmed", "cora")


@dataclasses.dataclass(frozen=True)
class Graph:
    """A directed graph as edge arrays: message ``e`` flows ``src[e] -> dst[e]``."""

    name: str
    src: np.ndarray
    dst: np.ndarray
    num_nodes: int

    @property
    def num_edges(self) -> int:
        return int(self.dst.size)

    def adjacency(self) -> sp.csr_array:
        """``A[dst, src] = 1``: row ``i`` aggregates the messages sent to ``i``."""
        ones = np.ones(self.num_edges, np.float32)
        shape = (self.num_nodes, self.num_nodes)
        return sp.csr_array((ones, (self.dst, self.src)), shape=shape)

    def normalized_adjacency(self) -> sp.csr_array:
        """GCN's ``D^-1/2 (A + I) D^-1/2`` (float32, CSR, sorted indices)."""
        a = self.adjacency() + sp.eye_array(self.num_nodes, dtype=np.float32, format="csr")
        deg = np.asarray(a.sum(axis=1)).ravel()
        scale = sp.diags_array(1.0 / np.sqrt(deg)).astype(np.float32)
        out = sp.csr_array(scale @ a @ scale, dtype=np.float32)
        out.sort_indices()
        return out


def load_graph(name_or_path: str) -> Graph:
    """Loads an embedded graph by name, or any ``.npz`` by path.

    Two formats are understood: ``edges`` (2, E) + ``num_nodes`` (the shared
    ``data/`` graphs, and Cora), or a scipy ``save_npz`` CSR adjacency (the shared
    ``data/matrices`` files), read as edges ``col -> row``.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = DATA_DIR / f"{name_or_path}.npz"
    if not path.exists():
        raise FileNotFoundError(f"no graph {name_or_path!r}: {path} does not exist")
    with np.load(path, allow_pickle=False) as f:
        keys = set(f.files)
        if "edges" in keys:
            src, dst = (np.asarray(a, np.int64) for a in f["edges"])
            if "num_nodes" in keys:
                n = int(f["num_nodes"])
            elif "labels" in keys:
                n = int(f["labels"].shape[0])
            else:
                n = int(max(src.max(), dst.max()) + 1)
            return Graph(path.stem, src, dst, n)
    mat = sp.load_npz(path).tocoo()
    if mat.shape[0] != mat.shape[1]:
        raise ValueError(f"{path} is not a square adjacency matrix: shape {mat.shape}")
    return Graph(path.stem, mat.col.astype(np.int64), mat.row.astype(np.int64), mat.shape[0])


def shuffled_and_uniform_ids(graphs, synthetic, rng: np.random.Generator):
    """``(label, ids, rows)`` for the studies that take ids in no order: each of
    ``graphs``' destinations shuffled, then for each ``"IDS/ROWS"`` of ``synthetic``
    uniform random ids."""
    for name in graphs:
        graph = load_graph(name)
        yield f"{graph.name} shuffled", rng.permutation(graph.dst), graph.num_nodes
    for pair in synthetic:
        k, m = (int(v) for v in pair.split("/"))
        yield f"uniform {k} ids", rng.integers(0, m, k), m


def padded_molecules(
    rng: np.random.Generator,
    graphs: int,
    atoms: tuple[int, int],
    extra_bonds: tuple[int, int],
    nodes: int,
    edges: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One padded batch of ``graphs`` random molecule-like graphs, as jraph pads one.

    Each graph is a chain of ``rng.integers(*atoms)`` atoms plus
    ``rng.integers(*extra_bonds)`` random bonds, every bond in both directions. The
    padding edges point at the last node; the padding nodes form graph ``graphs``.

    Returns:
      ``senders``, ``receivers`` (``(edges,)`` int32) and each node's graph
      (``(nodes,)`` int32).
    """
    senders, receivers, graph_of_node, offset = [], [], [], 0
    for g in range(graphs):
        n = int(rng.integers(*atoms))
        bonds = [(i, i + 1) for i in range(n - 1)]
        bonds += [
            tuple(rng.choice(n, 2, replace=False)) for _ in range(int(rng.integers(*extra_bonds)))
        ]
        for a, b in bonds:
            senders += [offset + a, offset + b]
            receivers += [offset + b, offset + a]
        graph_of_node += [g] * n
        offset += n
    assert offset < nodes and len(senders) <= edges, (offset, len(senders))
    pad_edges = edges - len(senders)
    senders += [nodes - 1] * pad_edges
    receivers += [nodes - 1] * pad_edges
    graph_of_node += [graphs] * (nodes - offset)
    return tuple(np.asarray(a, np.int32) for a in (senders, receivers, graph_of_node))
