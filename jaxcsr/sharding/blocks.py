"""The padded row blocks of one matrix on the host (:class:`RowBlocks`, read lazily) and
their placement on the devices of a mesh axis: one block per device, stacked along a
leading shard axis, only this process's blocks computed."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxcsr import plan
from jaxcsr.ops import Index
from jaxcsr.sharding.row_blocks import block_positions
from jaxcsr.structure import Structure

__all__ = ["RowBlocks", "from_blocks", "local_blocks", "place_index"]


class RowBlocks:
    """The padded row blocks of one matrix, each built when first asked for.

    ``columns(lo, hi)`` gives the column indices (and values, or ``None``) of rows
    ``lo:hi`` in row order; it is called only for the blocks a caller reads, so a
    process that places only its own devices' blocks reads only its rows."""

    def __init__(self, indptr: np.ndarray, sizes, columns: Callable, *, n: int, segment: bool):
        self.indptr = indptr  # (m + 1,) int64, the whole matrix's
        self.row_starts, self.block_nnz, self.block_rows, self.block_cols = sizes
        self.shards = len(self.row_starts) - 1
        self.n, self.segment = n, segment
        self._columns = columns
        self._loaded: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    def entries(self, p: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Columns and values of block ``p``'s stored entries (unpadded)."""
        if p not in self._loaded:
            lo, hi = int(self.row_starts[p]), int(self.row_starts[p + 1])
            self._loaded[p] = self._columns(lo, hi)
        return self._loaded[p]

    def _padded(self, values: np.ndarray, fill, dtype) -> np.ndarray:
        out = np.full(self.block_cols, fill, dtype)
        out[: len(values)] = values
        return out

    def data_order(self, p: int) -> np.ndarray:
        """``(K_b,)`` position in the whole matrix's CSR order per slot, -1: padding."""
        return block_positions(self.indptr, self.row_starts, p, self.block_cols).astype(np.int32)

    def input_order(self, p: int) -> np.ndarray:
        """``(K_b,)`` segment form: the input position (column) per slot, -1: padding."""
        columns = self.entries(p)[0] if self.segment else np.zeros(0, np.int32)
        return self._padded(columns, -1, np.int32)

    def values(self, p: int, dtype) -> np.ndarray:
        values = self.entries(p)[1]
        assert values is not None, "a block of a matrix with values"
        return self._padded(values, 0, dtype)

    def structure(self, p: int) -> Structure:
        """Host structure of block ``p``: its rows, empty rows up to the row capacity,
        then the trash row that holds the padding entries (one layout for every
        block)."""
        starts, k_b = self.row_starts, self.block_cols
        lo = int(self.indptr[starts[p]])
        own = self.indptr[starts[p] : starts[p + 1] + 1] - lo
        empty = np.full(self.block_rows - (starts[p + 1] - starts[p]), own[-1])
        local_indptr = np.concatenate([own, empty, [k_b]]).astype(np.int32)
        if self.segment:  # the block's columns are its own entries, in order
            ids = plan.row_ids(local_indptr)
            return plan.structure_from_segment_ids(ids, self.block_rows + 1)
        cols = self._padded(self.entries(p)[0], 0, np.int32)
        return plan.general_structure(local_indptr, cols, (self.block_rows + 1, self.n))


def from_blocks(block: Callable[[int], np.ndarray], shards: int, sharding) -> jax.Array:
    """A ``(shards * len(b), ...)`` array sharded as ``sharding`` whose rows are the
    blocks ``block(p)``; only this process's devices' blocks are computed."""
    p0 = local_blocks(sharding)[0]
    first = block(p0)  # its shape is every block's; computed once

    def rows(index) -> np.ndarray:
        size = first.shape[0]
        if size == 0:  # empty blocks (no entries): nothing to compute
            return first
        lo, hi, _ = index[0].indices(shards * size)
        return np.concatenate(
            [first if p == p0 else block(p) for p in range(lo // size, hi // size)]
        )

    return jax.make_array_from_callback((shards * first.shape[0], *first.shape[1:]), sharding, rows)


def place_index(blocks: RowBlocks, backends, sharding) -> tuple[list[jax.Array], Any]:
    """Plans every block of this process's devices for ``backends`` (each block once)
    and places its arrays on its device, stacked along a leading shard axis. Returns
    the leaves and the treedef (every block has one static layout)."""
    planned: dict[int, list[np.ndarray]] = {}
    trees = set()

    def leaves_of(p: int) -> list[np.ndarray]:
        if p not in planned:
            leaves, tree = jax.tree_util.tree_flatten(Index.planned(blocks.structure(p), backends))
            planned[p] = [np.asarray(x)[None] for x in leaves]
            trees.add(tree)
        return planned[p]

    count = len(leaves_of(local_blocks(sharding)[0]))

    def leaf(k: int, p: int) -> np.ndarray:
        return leaves_of(p)[k]

    leaves = [
        from_blocks(functools.partial(leaf, k), blocks.shards, sharding) for k in range(count)
    ]
    assert len(trees) == 1, "row blocks must share one static layout"
    return leaves, trees.pop()


def local_blocks(sharding: NamedSharding) -> list[int]:
    """The blocks (rows of a ``(shards, ...)`` array) this process's devices hold."""
    return sorted({int(p) for d in sharding.addressable_devices for p in _block_ids(sharding, d)})


def _block_ids(sharding: NamedSharding, device) -> range:
    """The blocks (rows of a ``(shards, ...)`` array) that ``device`` holds."""
    shards = int(sharding.mesh.shape[sharding.spec[0]])
    index = sharding.addressable_devices_indices_map((shards,))[device]
    assert index is not None
    return range(shards)[index[0]]
