"""The GCN client on the real Cora graph: accuracy, one compilation, data gradients."""

from __future__ import annotations

import numpy as np
import pytest

from examples import gcn


def test_cora_split_and_adjacency(cora):
    assert cora.features.shape == (2708, 1433) and cora.num_classes == 7
    assert (len(cora.train), len(cora.val), len(cora.test)) == (140, 500, 1000)
    assert cora.adjacency.nnz == 10556 + 2708  # both directions + self loops
    np.testing.assert_allclose(cora.adjacency.toarray(), cora.adjacency.toarray().T, atol=1e-7)


@pytest.mark.slow
def test_gcn_reaches_published_accuracy(cora):
    runs = [gcn.train(cora, "jaxcsr", seed) for seed in range(2)]
    accs = [r["test_accuracy"] for r in runs]
    assert np.mean(accs) >= 0.78, accs
    assert all(r["traces"] == 1 for r in runs)  # the epoch step compiled once


def test_aggregators_agree(cora):
    rng = np.random.default_rng(3)
    h = rng.uniform(-1, 1, (2708, 4)).astype(np.float32)
    expected = cora.adjacency.astype(np.float64) @ h.astype(np.float64)
    for name in gcn.AGGREGATORS:  # jaxcsr_sharded: over this process's one device
        operand, apply = gcn.aggregator(name, cora.adjacency)
        np.testing.assert_allclose(np.asarray(apply(operand, h)), expected, atol=1e-5)


def test_edge_weight_gradient_matches_segment_sum(cora):
    g, ref = gcn.edge_weight_gradients(cora, seed=1)
    assert np.abs(ref).max() > 0
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
