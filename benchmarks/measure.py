"""The one timer of every benchmark, and memory-bandwidth measurement.

:func:`timed` is the stopwatch: one call, waited for (``block_until_ready``), in
seconds. Everything else builds on it: :func:`time_thunk` (first call apart, warm-up,
repeats, an optional budget), :func:`time_in_turns` and :func:`time_rounds` (several
systems timed in turns, optionally within a budget)
and the training loops of the examples (one :func:`timed` step per epoch). The GPU
script times the same way, with the device synchronised.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _sync(out: Any) -> Any:
    """Waits for a result: jax arrays (in any pytree) block; numpy/torch CPU results
    are ready."""
    return jax.block_until_ready(out)


def timed(thunk: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of one ``thunk()`` until its result is ready, and the result."""
    t0 = time.perf_counter()
    out = _sync(thunk())
    return time.perf_counter() - t0, out


@dataclasses.dataclass
class Timing:
    first_s: float  # first call: compilation (jax) + one run
    median_s: float
    p10_s: float
    p90_s: float
    runs: int
    min_s: float

    @classmethod
    def of(cls, first_s: float, samples: list[float]) -> Timing:
        t = np.asarray(samples)
        return cls(
            first_s,
            float(np.median(t)),
            float(np.percentile(t, 10)),
            float(np.percentile(t, 90)),
            len(t),
            float(t.min()),
        )


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
    first, out = timed(thunk)
    if budget_s is not None and first > budget_s:
        raise TimedOutError(f"first call took {first:.0f} s, past the {budget_s:.0f} s budget")
    spent = first
    for _ in range(warmup):
        if budget_s is not None and spent + first > budget_s:
            break
        spent += timed(thunk)[0]
    times: list[float] = []
    for _ in range(repeats):
        if times and budget_s is not None and spent > budget_s:
            break
        times.append(timed(thunk)[0])
        spent += times[-1]
    return Timing.of(first, times), out


def time_in_turns(
    thunks: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    min_time_s: float = 0.0,
    max_repeats: int | None = None,
) -> tuple[dict[str, Timing], dict[str, Any]]:
    """Times several thunks in turns (one run of each per round): a slow spell of the
    machine then spreads over every system instead of whichever ran during it.
    ``repeats``, ``min_time_s`` and ``max_repeats`` set the number of timed rounds as
    in :func:`time_rounds`. Returns each thunk's :class:`Timing` and its first output."""
    firsts, outs = {}, {}
    for name, thunk in thunks.items():
        firsts[name], outs[name] = timed(thunk)
    timings, _ = time_rounds(
        thunks, firsts, repeats, warmup, min_time_s=min_time_s, max_repeats=max_repeats
    )
    return timings, outs


def time_rounds(
    thunks: dict[str, Callable[[], Any]],
    firsts: dict[str, float],
    repeats: int,
    warmup: int = 1,
    budget_s: float | None = None,
    unbounded: tuple[str, ...] = (),
    min_time_s: float = 0.0,
    max_repeats: int | None = None,
) -> tuple[dict[str, Timing], dict[str, float]]:
    """After each thunk's first call (``firsts``: its seconds, made by the caller),
    ``warmup`` untimed rounds and at least ``repeats`` (>= 1) timed rounds, each calling
    every thunk once in turn; then more timed rounds while the timed rounds together
    have taken less than ``min_time_s``, up to ``max_repeats`` rounds in all (default
    ``repeats``: none more). A median of a few runs of a millisecond is the noise of
    the moment; rounds that take seconds need no more than ``repeats``. With
    ``budget_s``, a thunk (other than those in ``unbounded``) whose calls, its first
    included, pass the budget skips the warm-up rounds that would pass it and leaves
    the timed rounds once it has one run. Returns each thunk's :class:`Timing` and the
    seconds its calls took, the first included."""
    if max_repeats is None:
        max_repeats = repeats
    if repeats < 1 or max_repeats < repeats:
        raise ValueError(f"need 1 <= repeats <= max_repeats, got {repeats}, {max_repeats}")
    spent = dict(firsts)
    samples: dict[str, list[float]] = {name: [] for name in thunks}
    timed_s = 0.0
    for round_ in itertools.count():
        timed_round = round_ >= warmup
        done = round_ - warmup if timed_round else 0
        if done >= max_repeats or (done >= repeats and timed_s >= min_time_s):
            break
        for name, thunk in thunks.items():
            if budget_s is not None and name not in unbounded:
                ahead = 0.0 if timed_round else firsts[name]
                if spent[name] + ahead > budget_s and (not timed_round or samples[name]):
                    continue
            seconds = timed(thunk)[0]
            spent[name] += seconds
            if timed_round:
                samples[name].append(seconds)
                timed_s += seconds
    return {name: Timing.of(firsts[name], samples[name]) for name in thunks}, spent


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


def copy_bandwidth_by_threads(
    threads: tuple[int, ...] = (1, 2), megabytes: int = 512, repeats: int = 7
) -> dict[int, float]:
    """GB/s (bytes read + written / time) of a copy between two ``megabytes`` arrays,
    split in equal slices over ``threads`` Python threads (numpy's copy releases the
    GIL): how far memory bandwidth itself scales from one thread to several here,
    the ceiling of any memory-bound kernel's thread speedup. Best of ``repeats``."""

    n = megabytes * 2**20 // 4
    src = np.random.default_rng(0).uniform(1, 2, n).astype(np.float32)
    dst = np.empty_like(src)
    dst.fill(0.0)  # pages touched before timing
    out = {}
    for t in threads:
        bounds = [n * i // t for i in range(t + 1)]
        best = float("inf")
        for _ in range(repeats):
            workers = [
                threading.Thread(target=np.copyto, args=(dst[lo:hi], src[lo:hi]))
                for lo, hi in itertools.pairwise(bounds)
            ]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - start)
        out[t] = 2 * 4 * n / best / 1e9
    return out


def dispatch_floor(size: int = 1000, repeats: int = 201) -> float:
    """Median ms of a jitted ``x + 1`` on ``size`` float32s: what any call of a jitted
    function costs here before its own work (dispatch, the output's allocation), paid
    by every JAX system and by neither scipy nor torch."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((size,), jnp.float32)
    inc = jax.jit(lambda x: x + 1)
    timing, _ = time_thunk(lambda: inc(x), repeats)
    return timing.median_s * 1e3


def to_numpy(out: Any) -> np.ndarray:
    """Any system's output as a float32 numpy array (for the correctness check)."""
    if hasattr(out, "detach"):  # torch
        out = out.detach().float().cpu().numpy()
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


def segment_sum_f64(x: Any, ids: np.ndarray, m: int) -> np.ndarray:
    """The float64 segment sum of ``x`` (rows ``(len(ids), N)``) into ``m`` rows: the
    reference the studies hold the kernels to."""
    want = np.zeros((m, x.shape[1]))
    np.add.at(want, ids, np.asarray(x, np.float64))
    return want


def max_abs_error(out: Any, want: np.ndarray) -> float:
    """The largest absolute difference of ``out`` from ``want``."""
    return float(np.abs(np.asarray(out, np.float64) - want).max(initial=0.0))


def largest_relative_error(actual: Any, expected: Any) -> float:
    """:func:`relative_error` of each pair of leaves of two outputs of the same
    structure (an output, or an output and its gradient), the largest."""
    pairs = zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True)
    return max(relative_error(to_numpy(a), to_numpy(b)) for a, b in pairs)


def segment_program(op: Callable, ids: np.ndarray, traced: bool, backward: bool):
    """A new jitted program (jit's cache must not hand one cell's program to another)
    of ``op(values, ids)``, a study's segment reduction: a function of the values, and
    of the ids where ``traced`` (else they are closed over, a constant); with
    ``backward`` also of the output's cotangent, returning the output and the values'
    gradient. The cotangent is an argument: closed over, with static ids, XLA would
    fold a scatter's whole gradient (a gather of two constants) into a constant at
    compile time, and the study would time a copy."""

    def run(v, i, *ct):
        if not backward:
            return op(v, i)
        out, pullback = jax.vjp(lambda v: op(v, i), v)
        return out, pullback(ct[0])[0]

    if traced:
        return jax.jit(run)
    constant = np.asarray(ids)
    return jax.jit(lambda v, *ct: run(v, constant, *ct))
