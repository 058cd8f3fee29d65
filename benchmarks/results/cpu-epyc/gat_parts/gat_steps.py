"""The models section's GAT steps (``benchmarks.models.gat_step``: Cora and PubMed, 8
heads x 8 features then one head of 2) with the step without aggregation, systems
timed in turns, in this process: run it once per build of the kernels
(``JAXCSR_CPU_LIBRARY``) to compare two builds on whole steps. Prints one JSON line:
the library and, per graph, each system's median ms. Run from the repository root
with ``PYTHONPATH=.``; arguments: graph names (default cora planetoid_pubmed)."""

import functools
import json
import os
import sys

import jax
import numpy as np

from benchmarks import measure, models
from benchmarks.datasets import load_graph

steps = {}
for name in sys.argv[1:] or ["cora", "planetoid_pubmed"]:
    _, systems, _ = models.gat_step(load_graph(name), np.random.default_rng(0), floor=True)
    thunks = {k: functools.partial(f, *args) for k, (f, args) in systems.items()}
    for thunk in thunks.values():
        jax.block_until_ready(thunk())
    timings, _ = measure.time_in_turns(thunks, 41 if name == "cora" else 15)
    steps[name] = {k: round(t.median_s * 1e3, 3) for k, t in timings.items()}
print(json.dumps({"library": os.environ.get("JAXCSR_CPU_LIBRARY", "built"), "steps": steps}))
