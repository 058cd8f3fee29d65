"""Host planning of row blocks: how a matrix's rows split over the shards of a mesh axis.

Pure numpy, no devices: contiguous row blocks balanced by nonzeros
(:func:`balanced_row_blocks`) or the output's even row split, padded to capacities that
step geometrically (:func:`block_capacity`) so that structures of equal shape and nnz
share one compilation, and the relayout of block rows into the output's even split
(:func:`relayout_rows`). :mod:`jaxcsr.sharding` places the blocks and runs the product.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "BALANCES",
    "BlockPlan",
    "balanced_row_blocks",
    "block_capacity",
    "block_positions",
    "block_sizes",
    "plan_blocks",
    "relayout_plan",
    "relayout_rows",
    "rows_per_part",
]


BALANCES = ("nnz", "rows")


SLACK = 1.02
"""Largest block allowed, as a multiple of the mean nonzeros per shard (or the
optimum, if larger): the room used to keep block boundaries near the even row split."""


def balanced_row_blocks(lengths: np.ndarray, parts: int, slack: float = SLACK) -> np.ndarray:
    """Row starts ``(parts + 1,)`` of contiguous blocks balanced by nonzeros.

    The capacity is the optimal largest block (binary search, greedy fill; rows stay
    whole) or ``slack`` times the mean, whichever is larger. Within it each boundary
    goes as near the even row split as it can (less of the output to move), keeping
    the rest of the rows placeable in the remaining blocks.
    """
    lengths = np.asarray(lengths, np.int64)
    m = lengths.size
    cum = np.concatenate([[0], np.cumsum(lengths)])

    def fill(capacity):
        starts = [0]
        for _ in range(parts):
            lo = starts[-1]
            starts.append(int(np.searchsorted(cum, cum[lo] + capacity, side="right")) - 1)
            if starts[-1] == lo and lo < m:  # a row longer than the capacity
                return None
        return np.array(starts) if starts[-1] >= m else None

    lo, hi = int(lengths.max(initial=0)), int(cum[-1])
    while lo < hi:
        mid = (lo + hi) // 2
        if fill(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    capacity = max(lo, int(slack * cum[-1] / parts))
    even = _even_row_blocks(m, parts)
    chosen = [0]
    for p in range(1, parts):
        upper = int(np.searchsorted(cum, cum[chosen[-1]] + capacity, side="right")) - 1
        lower = int(np.searchsorted(cum, cum[-1] - (parts - p) * capacity, side="left"))
        chosen.append(min(max(int(even[p]), lower, chosen[-1]), max(upper, chosen[-1])))
    chosen.append(m)
    starts = np.array(chosen)
    if np.diff(cum[starts]).max(initial=0) > capacity:  # cannot happen; stay safe
        starts = np.minimum(fill(lo), m)
    return starts


def _even_row_blocks(m: int, parts: int) -> np.ndarray:
    rows = rows_per_part(m, parts)
    return np.minimum(np.arange(parts + 1) * rows, m)


def rows_per_part(m: int, parts: int) -> int:
    """Rows per device of the output's even split (JAX's layout of ``(m, ...)``)."""
    return max(1, -(-m // parts))


def block_capacity(size: int, base: float, steps_per_octave: int) -> int:
    """The smallest ``ceil(base * 2 ** (j / steps_per_octave))``, ``j >= 0``, that holds
    ``size``.

    ``base`` follows from the shape, nnz and shard count alone (the balanced block), so
    matrices of equal shape, nnz and shard count whose blocks fit the balanced size
    get equal capacities -- one compilation -- and others take one of a few steps
    (``steps_per_octave`` per doubling of the largest block)."""
    base = max(float(base), 1.0)
    size, capacity, j = int(size), int(np.ceil(base)), 0
    while capacity < size:
        j += 1
        capacity = int(np.ceil(base * 2 ** (j / steps_per_octave)))
    return capacity


NNZ_STEPS = 4
"""Capacity steps per doubling of the largest block's nonzeros (at most 19 % padding
past the balanced size ``SLACK * nnz / shards``)."""


ROW_STEPS = 2
"""Capacity steps per doubling of the largest block's rows (empty padding rows only
cost zeros in the block's output)."""


ROW_BASE = 1.25
"""The first row capacity, a multiple of the even split's ``ceil(m / shards)``: block
boundaries balanced by nonzeros stay near the even split when they can."""


def _overlaps(row_starts, m) -> dict[tuple[int, int], tuple[int, int]]:
    """``(p, q) -> (lo, hi)``: rows of device ``p``'s block in device ``q``'s part of
    the output's even row split (non-empty overlaps only)."""
    shards = len(row_starts) - 1
    rows = rows_per_part(m, shards)
    pairs = {}
    for p in range(shards):
        for q in range(shards):
            lo = max(row_starts[p], q * rows)
            hi = min(row_starts[p + 1], (q + 1) * rows, m)
            if hi > lo:
                pairs[(p, q)] = (lo, hi)
    return pairs


def relayout_rows(row_starts, m) -> np.ndarray:
    """Rows each device computes for another device's part of the output."""
    moved = np.zeros(len(row_starts) - 1, np.int64)
    for (p, q), (lo, hi) in _overlaps(row_starts, m).items():
        if p != q:
            moved[p] += hi - lo
    return moved


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Where a matrix's rows and entries go, one contiguous row block per shard (host).

    Attributes:
      row_starts: ``(shards + 1,)`` first row of each block, then ``m``.
      block_nnz: ``(shards,)`` stored entries of each block.
      block_rows: row capacity of every block (without the trash row).
      block_cols: entry capacity of every block, ``K_b``.
      data_order: ``(shards, K_b)`` position in the matrix's CSR order of each block
        slot (``-1``: padding).
    """

    row_starts: np.ndarray
    block_nnz: np.ndarray
    block_rows: int
    block_cols: int
    data_order: np.ndarray


def plan_blocks(indptr: np.ndarray, shards: int, balance: str = "nnz") -> BlockPlan:
    """Splits the rows of a CSR row pointer into ``shards`` padded blocks (pure numpy).

    ``balance="nnz"``: :func:`balanced_row_blocks`; ``"rows"``: the output's even row
    split. Capacities follow :func:`block_capacity` (steps from the balanced sizes), so
    structures of equal shape and nnz whose blocks fit the same steps share one
    compilation.
    """
    indptr = np.asarray(indptr).astype(np.int64)
    starts, block_nnz, block_rows, k_b = block_sizes(indptr, shards, balance)
    data_order = np.stack([block_positions(indptr, starts, p, k_b) for p in range(shards)])
    return BlockPlan(starts, block_nnz, int(block_rows), int(k_b), data_order)


def block_positions(indptr: np.ndarray, starts: np.ndarray, p: int, k_b: int) -> np.ndarray:
    """``(K_b,)`` int64: the CSR position of each of block ``p``'s slots, -1: padding."""
    lo, hi = int(indptr[starts[p]]), int(indptr[starts[p + 1]])
    out = np.full(k_b, -1, np.int64)
    out[: hi - lo] = np.arange(lo, hi)
    return out


def block_sizes(
    indptr: np.ndarray, shards: int, balance: str = "nnz"
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """:func:`plan_blocks` without the per-slot map: ``(row_starts, block_nnz,
    block_rows, block_cols)``, ``O(m)`` memory (what a scale study needs)."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    indptr = np.asarray(indptr).astype(np.int64)
    m, nnz = indptr.size - 1, int(indptr[-1])
    rows = rows_per_part(m, shards)
    if balance == "nnz":
        starts = balanced_row_blocks(np.diff(indptr), shards)
        most = np.diff(starts).max(initial=0)
        block_rows = min(block_capacity(most, ROW_BASE * rows, ROW_STEPS), max(m, most))
    else:  # the even split: its row count follows the shape alone
        starts = _even_row_blocks(m, shards)
        block_rows = rows
    block_nnz = indptr[starts[1:]] - indptr[starts[:-1]]
    largest = int(block_nnz.max(initial=0))
    balanced_nnz = int(np.ceil(SLACK * nnz / shards))
    k_b = min(block_capacity(largest, balanced_nnz, NNZ_STEPS), max(nnz, largest))
    return starts, block_nnz, int(block_rows), int(k_b)


def relayout_plan(starts, m, block_rows, shards, balance):
    """Which block rows go to which device's part of the even split, per shift.

    Returns ``(send (P, D, W), recv (P, D, W), shifts, aligned)``: for shift ``d``,
    device ``p`` sends block rows ``send[p, i]`` (``block_rows``: the trash row, for
    padding) to device ``p + d``, which writes them at ``recv[p + d, i]`` (``rows``:
    dropped).
    """
    rows = rows_per_part(m, shards)
    pairs = _overlaps(starts, m)
    # Static choices that follow the structure take few values: the even split is
    # aligned (no relayout); otherwise the reach rounds up to a power of two and the
    # message width to a capacity step.
    aligned = balance == "rows"  # shard() gives the even split its exact row count
    reach = max((abs(q - p) for p, q in pairs), default=0)
    reach = 0 if aligned else 1 << max(reach - 1, 0).bit_length()
    shifts = tuple(range(-min(reach, shards - 1), min(reach, shards - 1) + 1))
    widest = max([hi - lo for lo, hi in pairs.values()], default=1)
    width = block_capacity(widest, ROW_BASE * rows, ROW_STEPS)
    send = np.full((shards, len(shifts), width), block_rows, np.int32)
    recv = np.full((shards, len(shifts), width), rows, np.int32)
    for (p, q), (lo, hi) in pairs.items():
        i = shifts.index(q - p)
        send[p, i, : hi - lo] = np.arange(lo, hi) - starts[p]
        recv[q, i, : hi - lo] = np.arange(lo, hi) - q * rows
    return send, recv, shifts, aligned
