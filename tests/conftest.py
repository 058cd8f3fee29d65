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


# The longest tests (20-110 s each on the 2-core CI machine) go first: under `pytest -n 2`
# they then start while the short ones fill the other worker, instead of one of them
# running alone at the end.
LONGEST_FIRST = (
    "test_sanitizer_build_finds_nothing",
    "test_sharded_products_on_forced_devices",
    "test_every_kernel_meets_the_machine_code_requirements",
    "test_instruction_sets_give_the_same_bits",
    "test_allocator_study",
    "test_quick_benchmark_writes_checked_results",
    "test_gat_reaches_the_paper_on_cora",
    "test_two_processes",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(getattr(item, "originalname", item.name), len(rank)))
