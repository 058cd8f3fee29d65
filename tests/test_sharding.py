"""Sharded products: the multi-device checks run in their own process with forced CPU
devices (tests/sharding_checks.py); the host-side plan is tested here."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.datasets import load_graph
from jaxcsr.sharding.row_blocks import balanced_row_blocks, plan_blocks

CHECKS = Path(__file__).with_name("sharding_checks.py")


@pytest.mark.parametrize("devices,extra", [(4, ["--gcn"]), (8, ["--quick"])])
def test_sharded_products_on_forced_devices(devices, extra):
    env = {**os.environ, "JAXCSR_TEST_SEED": os.environ.get("JAXCSR_TEST_SEED", "0")}
    result = subprocess.run(
        [sys.executable, str(CHECKS), str(devices), *extra],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")


def _brute_force_max(lengths, parts):
    """Smallest largest-block sum over all contiguous splits (tiny inputs)."""
    m = len(lengths)
    best = None
    for cuts in itertools.combinations_with_replacement(range(m + 1), parts - 1):
        starts = [0, *cuts, m]
        largest = max(sum(lengths[a:b]) for a, b in itertools.pairwise(starts))
        best = largest if best is None else min(best, largest)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_blocks_are_optimal_and_cover_every_row(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 20, rng.integers(1, 9)) * (rng.random(1) < 0.9)
    parts = int(rng.integers(1, 5))
    best = _brute_force_max(list(lengths), parts)
    for slack in (1.0, 1.02, 1.5):
        starts = balanced_row_blocks(lengths, parts, slack)
        assert starts[0] == 0 and starts[-1] == len(lengths) and np.all(np.diff(starts) >= 0)
        sums = [lengths[a:b].sum() for a, b in itertools.pairwise(starts)]
        assert max(sums) <= max(best, int(slack * lengths.sum() / parts))
        if slack == 1.0:
            assert max(sums) == best  # the optimum


@pytest.mark.parametrize("name", ["cora", "musae_github", "planetoid_pubmed", "tolokers"])
def test_imbalance_on_the_embedded_graphs(name):
    """Segment form (rows = in-edges) and adjacency rows, P = 2, 4, 8: max/mean nnz."""
    graph = load_graph(name)
    lengths = np.bincount(graph.dst, minlength=graph.num_nodes)
    for parts in (2, 4, 8):
        starts = balanced_row_blocks(lengths, parts)
        cum = np.concatenate([[0], np.cumsum(lengths)])
        nnz = cum[starts[1:]] - cum[starts[:-1]]
        assert nnz.sum() == lengths.sum()
        assert nnz.max() / nnz.mean() <= 1.05, (name, parts, nnz)


@pytest.mark.parametrize("balance", ["nnz", "rows"])
def test_block_plan_places_every_entry_once(balance):
    """The pure-numpy block plan: contiguous row blocks, every entry in exactly one
    slot of its own block, capacities that hold the largest block."""
    rng = np.random.default_rng(int(os.environ.get("JAXCSR_TEST_SEED", "0")))
    lengths = rng.zipf(1.6, 301).clip(max=400)
    lengths[[3, 40, 41]] = 0  # empty rows
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    shards = 4
    blocks = plan_blocks(indptr, shards, balance)
    starts = blocks.row_starts
    assert starts[0] == 0 and starts[-1] == lengths.size and np.all(np.diff(starts) >= 0)
    assert blocks.block_rows >= np.diff(starts).max()
    assert blocks.block_cols >= blocks.block_nnz.max()
    np.testing.assert_array_equal(blocks.block_nnz, indptr[starts[1:]] - indptr[starts[:-1]])
    placed = blocks.data_order[blocks.data_order >= 0]
    np.testing.assert_array_equal(np.sort(placed), np.arange(indptr[-1]))  # each entry once
    for p in range(shards):  # block p holds exactly the entries of its rows, in order
        own = blocks.data_order[p][blocks.data_order[p] >= 0]
        np.testing.assert_array_equal(own, np.arange(indptr[starts[p]], indptr[starts[p + 1]]))
    if balance == "nnz":
        mean = indptr[-1] / shards  # contiguous blocks: the optimum is below mean + longest row
        assert blocks.block_nnz.max() <= max(1.02 * mean, mean + lengths.max()) + 1
    else:
        np.testing.assert_array_equal(starts, np.minimum(np.arange(shards + 1) * 76, 301))
