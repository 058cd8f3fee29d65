"""What a sharded matrix is, statically and where its blocks went: :class:`Spec` (the
hashable description the traced product reads), :class:`BlockLayout` (device leaves of
the block sizes and value orders) and :class:`HostBlockLayout` (their numpy copies)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["BlockLayout", "HostBlockLayout", "Spec"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static description of a sharded matrix (hashable: part of the pytree).

    Holds only what the traced product reads: capacities, not the structure's own
    block sizes (those are device leaves, :class:`BlockLayout`), so matrices whose blocks
    fall into the same capacities share one compilation."""

    mesh: Any
    axis: str
    shape: tuple[int, int]  # A's shape (m, n)
    layout_size: int  # rows of laid-out per-edge values: shards * block_cols (segment) or n
    form: str  # "segment" or "spmm"
    balance: str
    block_rows: int  # row capacity per block, without the trash row
    block_cols: int  # columns per block: the nonzero capacity K_b (segment) or n (spmm)
    shifts: tuple[int, ...]  # device offsets of the output relayout: -d..d (0: local)
    aligned: bool  # blocks are the even row split: no relayout
    index_tree: Any
    has_data: bool


class BlockLayout(NamedTuple):
    """Where the structure's rows and entries went (device leaves, not static: they
    differ between structures that share a compilation). Read on the host through
    :class:`ShardedCSR`'s properties."""

    row_starts: jax.Array  # (shards + 1,) first row of each block, replicated
    block_nnz: jax.Array  # (shards,) nonzeros of each block, replicated
    input_order: jax.Array  # (shards * K_b,) input position per laid-out column, -1: pad
    data_order: jax.Array  # (shards * K_b,) position in A.data per laid-out value, -1: pad


@dataclasses.dataclass(frozen=True)
class HostBlockLayout:
    """Numpy copies of the layout metadata (not leaves). ``orders`` maps each block
    this host knows (all of them for :func:`shard`; this process's own for
    :func:`shard_rows`) to its ``(input_order, data_order)`` slots."""

    row_starts: np.ndarray
    block_nnz: np.ndarray
    orders: dict[int, tuple[np.ndarray, np.ndarray]]

    def order(self, name: str) -> np.ndarray:
        shards = self.block_nnz.size
        missing = sorted(set(range(shards)) - set(self.orders))
        if missing:
            raise ValueError(
                f"S.{name} of blocks {missing} is not on this host (shard_rows loaded only "
                f"this process's blocks, {sorted(self.orders)})"
            )
        which = ("input_order", "data_order").index(name)
        return np.concatenate([self.orders[p][which] for p in range(shards)])

    def block_order(self, p: int, name: str) -> np.ndarray:
        return self.orders[p][("input_order", "data_order").index(name)]
