"""Timing and memory-bandwidth measurement (CPU; the same rules as the GPU script)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _sync(out: Any) -> Any:
    """Waits for a result: jax arrays block; numpy/torch CPU results are ready."""
    return jax.block_until_ready(out) if isinstance(out, jax.Array) else out


@dataclasses.dataclass
class Timing:
    first_s: float  # first call: compilation (jax) + one run
    median_s: float
    p10_s: float
    p90_s: float
    runs: int


class TimedOutError(Exception):
    """A system's first call ran past its time budget (:func:`time_thunk`)."""


def time_thunk(
    thunk: Callable[[], Any], repeats: int, warmup: int = 1, budget_s: float | None = None
) -> tuple[Timing, Any]:
    """Times ``thunk()``: first call (compile) apart, warm-up excluded, ``repeats`` runs.

    With ``budget_s``: a first call slower than the budget raises :class:`TimedOutError`;
    otherwise runs stop once the budget is spent (``Timing.runs`` says how many ran,
    at least one).
    """
    t0 = time.perf_counter()
    out = _sync(thunk())
    first = time.perf_counter() - t0
    if budget_s is not None and first > budget_s:
        raise TimedOutError(f"first call took {first:.0f} s, past the {budget_s:.0f} s budget")
    spent = first
    for _ in range(warmup):
        if budget_s is not None and spent + first > budget_s:
            break
        t0 = time.perf_counter()
        _sync(thunk())
        spent += time.perf_counter() - t0
    times: list[float] = []
    for _ in range(repeats):
        if times and budget_s is not None and spent > budget_s:
            break
        t0 = time.perf_counter()
        _sync(thunk())
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    t = np.asarray(times)
    timing = Timing(
        first, float(np.median(t)), float(np.percentile(t, 10)), float(np.percentile(t, 90)), len(t)
    )
    return timing, out


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict[str, float]:
    """Measures this machine's memory bandwidth in GB/s through XLA.

    read: ``sum(x)`` over a ``megabytes`` float32 array (bytes read / time).
    copy: ``x * 2`` written back into ``x``'s donated buffer (bytes read + written / time):
      the rate of a kernel that reads its input once and writes its output once.
    fresh_copy: ``x * 2`` into a newly allocated array; on CPU this pays the page
      faults of fresh memory, which every op with a large fresh output pays too.
    """
    n = megabytes * 2**20 // 4
    x = jnp.asarray(np.random.default_rng(0).uniform(1, 2, n).astype(np.float32))
    size = n * 4
    read_fn = jax.jit(jnp.sum)
    read, _ = time_thunk(lambda: read_fn(x), repeats)
    fresh_fn = jax.jit(lambda x: x * 2)
    fresh, _ = time_thunk(lambda: fresh_fn(x), repeats)
    inplace_fn = jax.jit(lambda x: x * 2, donate_argnums=0)
    buf = [x]

    def inplace():
        buf[0] = inplace_fn(buf[0])
        return buf[0]

    copy, _ = time_thunk(inplace, repeats)
    return {
        "read_gbps": size / read.median_s / 1e9,
        "copy_gbps": 2 * size / copy.median_s / 1e9,
        "fresh_copy_gbps": 2 * size / fresh.median_s / 1e9,
        "array_mb": float(megabytes),
    }


def to_numpy(out: Any) -> np.ndarray:
    """Any system's output as a float32 numpy array (for the correctness check)."""
    if hasattr(out, "detach"):  # torch
        out = out.detach().float().numpy()
    elif hasattr(out, "todense") and not isinstance(out, np.ndarray):
        out = out.todense()
    return np.asarray(out, dtype=np.float32)


TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Max abs difference relative to the reference's scale (``inf`` on shape mismatch)."""
    if actual.shape != expected.shape:
        return float("inf")
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    err = float(np.abs(actual - expected).max(initial=0.0)) / scale
    return err if np.isfinite(err) else float("inf")
