"""Shared fixtures: a seeded, fresh random generator per test; the Cora dataset."""

from __future__ import annotations

import os

import numpy as np
import pytest

# run as scripts in their own processes (they force CPU devices before importing jax)
collect_ignore = ["sharding_checks.py", "multiprocess_checks.py"]

# The CPU backend's rules decide, not timings of this machine (the kernels a test
# expects by its sizes); tests/test_timed_choices.py turns timed choices on where it
# tests them. Set JAXCSR_TIMED_CHOICES=1 to run the suite with them.
os.environ.setdefault("JAXCSR_TIMED_CHOICES", "0")


@pytest.fixture(scope="session")
def cora():
    """Cora as the example clients load it (features, normalized adjacency, splits)."""
    from examples.gcn import load_cora

    return load_cora()


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh generator per test; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("JAXCSR_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"[{request.node.name}] JAXCSR_TEST_SEED={seed}")
    return np.random.default_rng(seed)
