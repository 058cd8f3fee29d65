"""Timed choices between CPU kernels that compute the same bits.

Static unsorted segment ids whose push takes one piece can run three kernels that add
each row's values in input order, so they give the same bits: the pull through the
planned sort, the push with its features split over the threads, and XLA's scatter
(float32 only: it adds in the values' dtype). The rule :func:`jaxcsr.kernels.cpu.choose`
applies picks one from the sizes; which one is fastest differs between machines
(``benchmarks/results/cpu-epyc/timed_choice/``). Here the candidates are timed once
per machine and *shape class*, and the result stored for every later process.

A shape class is a float32 or 16-bit sum with ``F`` features (1 to
:data:`MAX_FEATURES`) of ``m`` rows and ``n`` ids, both rounded to the nearest quarter
power of two (within 9%: which kernel wins changed within 20% of size in the cells
measured). The candidates run on uniform random ids of exactly that rounded size,
drawn from a fixed seed, so the stored choice is a function of the machine and the
class. The
rule's kernel is kept unless another is faster by :data:`MARGIN` (medians of
alternating rounds). One pull exception: at one feature the pull sums in eight lanes
(other bits), so only the push and the scatter are timed there.

Timing one class takes about a second, once, when the first product of that class is
traced. The choices live in ``choices-<machine>.json`` beside the machine profile
(:func:`jaxcsr.machine.cache_file`), with the library they were timed with: a rebuilt
library, a profile older than :data:`jaxcsr.machine.MAX_AGE_DAYS` or one timed under
load (a 1-minute load average above half the cores) on a machine quiet now is timed
again.

Environment: ``JAXCSR_TIMED_CHOICES=0`` turns timed choices off (the rule decides);
``JAXCSR_CALIBRATE=0`` times nothing new but still reads stored choices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from jaxcsr import machine

__all__ = [
    "MARGIN",
    "MAX_FEATURES",
    "TimedChoice",
    "candidates",
    "choice",
    "choices_file",
    "enabled",
    "pinned",
    "shape_class",
    "stored",
]

MAX_FEATURES = 16
"""Sums this narrow are timed; wider ones keep the rule (the pull, whose rows of x
span whole lines)."""

MARGIN = 0.15
"""Another candidate replaces the rule's kernel only when its median is this much
shorter (a noisy machine must not trade a choice for its spread)."""

_STEPS_PER_OCTAVE = 4  # shape classes: sizes within 9% (a cache's edge is that sharp)
_MIN_VALUES = 1 << 15  # ids x features below this: the call costs more than the choice
_MAX_X_BYTES = 256 << 20  # the timed operand at most this large (about a second)
_ROUNDS, _MAX_ROUNDS = 7, 41  # alternating rounds; each candidate's median over them
_ROUND_BUDGET_S = 0.3  # more rounds where they are this quick in all

_PIN = threading.local()
_LOCK = threading.Lock()
_LOADED: dict[Path, dict] = {}


@dataclasses.dataclass(frozen=True)
class TimedChoice:
    """A stored choice for one shape class.

    Attributes:
      kernel: ``"pull"``, ``"push"`` or ``"xla"``.
      times_us: each candidate's median time (microseconds) at the class's size.
      rule: the kernel the rule picks at that size.
      rows, ids: the class's size (powers of two).
      measured_at: when it was timed (UTC).
      load: the 1-minute load average then (``None``: not reported).
    """

    kernel: str
    times_us: dict[str, float]
    rule: str
    rows: int
    ids: int
    measured_at: datetime.datetime
    load: float | None

    def reason(self, path: Path) -> str:
        times = ", ".join(f"{k} {t:.0f} us" for k, t in sorted(self.times_us.items()))
        return (
            f"timed on this machine at {self.rows} rows, {self.ids} ids ({times}; rule: "
            f"{self.rule}; {path.name}, {self.measured_at:%Y-%m-%d})"
        )


def enabled() -> bool:
    """Whether products consult timed choices (``JAXCSR_TIMED_CHOICES``, default on)."""
    value = os.environ.get("JAXCSR_TIMED_CHOICES", "1").strip().lower()
    return value not in ("0", "off", "false", "no")


def pinned() -> str | None:
    """The kernel this thread is timing (products traced by :func:`choice`'s own
    measurement run it), else ``None``."""
    return getattr(_PIN, "kernel", None)


@contextlib.contextmanager
def _pin(kernel: str) -> Iterator[None]:
    _PIN.kernel = kernel
    try:
        yield
    finally:
        _PIN.kernel = None


def _step(k: int) -> int:
    """``k``'s step on the scale of quarter powers of two (``2^(step / 4)`` nearest)."""
    return max(0, round(_STEPS_PER_OCTAVE * math.log2(max(k, 1))))


def _size(step: int) -> int:
    return round(2 ** (step / _STEPS_PER_OCTAVE))


def shape_class(rows: int, ids: int, n_features: int, itemsize: int) -> str:
    """The key a sum of ``ids`` ids into ``rows`` rows of ``n_features`` features of
    ``itemsize`` bytes is stored under: its sizes rounded to the nearest quarter power
    of two (within 9%)."""
    return f"sum-f{n_features}-b{itemsize}-m{_step(rows)}-n{_step(ids)}"


def candidates(n_features: int, itemsize: int) -> tuple[str, ...]:
    """The kernels that give a one-piece sum's bits: the push, the pull from two
    features on, XLA's scatter for float32."""
    found = ["push"]
    if n_features >= 2:
        found.append("pull")
    if itemsize == 4:
        found.append("xla")
    return tuple(found)


def choices_file() -> Path:
    """Where this machine's timed choices are stored (beside its profile)."""
    profile_file = machine.cache_file()
    return profile_file.with_name(profile_file.name.replace("machine-", "choices-", 1))


def _library_stamp() -> str:
    """The built library the choices were timed with (its path, size and time)."""
    from jaxcsr.kernels import cpu

    path = cpu.library_path()
    if path is None:
        return "none"
    try:
        st = path.stat()
    except OSError:
        return "none"
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(stamp.encode()).hexdigest()[:16]


def _read(path: Path) -> dict:
    """The stored choices of this library build (empty where none validate)."""
    if path in _LOADED:
        return _LOADED[path]
    found: dict = {}
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict) and record.get("library") == _library_stamp():
            for key, entry in record.get("choices", {}).items():
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    found[key] = _parse(entry)
    except (OSError, ValueError):
        pass
    _LOADED[path] = found
    return found


def stored() -> dict[str, TimedChoice]:
    """The choices stored for this machine and library build, by shape class."""
    with _LOCK:
        return dict(_read(choices_file()))


def _parse(entry: dict) -> TimedChoice:
    times = {str(k): float(v) for k, v in entry["times_us"].items()}
    kernel = str(entry["kernel"])
    if kernel not in times or not all(math.isfinite(t) and t > 0 for t in times.values()):
        raise ValueError("a timed choice must name a timed kernel with positive times")
    at = datetime.datetime.fromisoformat(entry["measured_at"])
    if at.tzinfo is None:
        raise ValueError("measured_at without a time zone")
    load = entry["load"]
    return TimedChoice(
        kernel, times, str(entry["rule"]), int(entry["rows"]), int(entry["ids"]), at,
        None if load is None else float(load),
    )  # fmt: skip


def _write(path: Path, choices: dict[str, TimedChoice]) -> None:
    record = {
        "library": _library_stamp(),
        "choices": {
            key: {**dataclasses.asdict(c), "measured_at": c.measured_at.isoformat()}
            for key, c in choices.items()
        },
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(record, f, indent=1)
        os.replace(f.name, path)  # whole or not at all, for concurrent processes
    except OSError as err:
        import warnings

        warnings.warn(f"jaxcsr: timed choices not stored at {path}: {err}", stacklevel=3)


def _stale(found: TimedChoice, cores: int) -> bool:
    age = datetime.datetime.now(datetime.timezone.utc) - found.measured_at
    if not 0 <= age.total_seconds() <= machine.MAX_AGE_DAYS * 86400:
        return True
    busy = found.load is not None and found.load > cores / 2
    now = machine._load_average()
    return busy and not (now is not None and now > cores / 2)


def _time(rows: int, ids: int, n_features: int, itemsize: int, kernels) -> dict[str, float]:
    """Each kernel's median time (us) over alternating rounds (7, or up to 41 where
    they take under 0.3 s in all), after two calls each, on uniform random ids of
    the class's size from a fixed seed; run on a thread of its own (JAX's trace state
    is per thread: the product that asked is being traced)."""
    import jax
    import jax.numpy as jnp

    from jaxcsr.matrix import CSRMatrix

    times: dict[str, list[float]] = {k: [] for k in kernels}
    failed: list[BaseException] = []

    def measure() -> None:
        try:
            rng = np.random.default_rng(20261207)
            ids_np = rng.integers(0, rows, ids, dtype=np.int32)
            matrix = CSRMatrix.from_indices(ids_np, num_rows=rows)
            dtype = jnp.float32 if itemsize == 4 else jnp.bfloat16
            x = jnp.asarray(rng.standard_normal((ids, n_features), np.float32)).astype(dtype)
            compiled = {}
            for kernel in kernels:
                with _pin(kernel):
                    # the matrix an argument, as a training step passes it
                    product = jax.jit(lambda a, v: a @ v).lower(matrix, x).compile()
                    compiled[kernel] = functools.partial(product, matrix)
                jax.block_until_ready(compiled[kernel](x))
            start = time.perf_counter()
            for kernel in kernels:
                jax.block_until_ready(compiled[kernel](x))
            once = time.perf_counter() - start  # a round
            for _ in range(max(_ROUNDS, min(_MAX_ROUNDS, int(_ROUND_BUDGET_S / once)))):
                for kernel in kernels:
                    start = time.perf_counter()
                    jax.block_until_ready(compiled[kernel](x))
                    times[kernel].append(time.perf_counter() - start)
        except BaseException as err:  # reported to the caller's thread
            failed.append(err)

    worker = threading.Thread(target=measure, name="jaxcsr-timed-choice")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return {k: float(np.median(v) * 1e6) for k, v in times.items()}


def choice(
    rows: int, ids: int, n_features: int, itemsize: int, rule_at: Callable[[int, int], str | None]
) -> tuple[TimedChoice, Path] | None:
    """The stored (or, first, timed) choice for a one-piece sum of these sizes, with
    the file it is stored in; ``None`` where timed choices are off or do not apply
    (the rule decides): a width past :data:`MAX_FEATURES`, too few or too many values,
    a class at whose rounded size ``rule_at(rows, ids)`` gives no rule (the push would
    split into pieces there) or one outside the candidates, or calibration off with
    nothing stored."""
    if not enabled() or pinned() is not None or not 1 <= n_features <= MAX_FEATURES:
        return None
    kernels = candidates(n_features, itemsize)
    m, n = _size(_step(rows)), _size(_step(ids))
    if n * n_features < _MIN_VALUES or n * n_features * itemsize > _MAX_X_BYTES:
        return None
    rule = rule_at(m, n)
    if rule not in kernels:
        return None
    path = choices_file()
    key = shape_class(rows, ids, n_features, itemsize)
    with _LOCK:
        stored = _read(path)
        found = stored.get(key)
        cores = machine.profile().cores
        if found is not None and (not _stale(found, cores) or not machine._calibration_on()):
            return found, path
        if not machine._calibration_on():
            return None
        load = machine._load_average()
        times = _time(m, n, n_features, itemsize, kernels)
        best = min(times, key=times.__getitem__)
        kernel = best if times[best] < (1 - MARGIN) * times[rule] else rule
        found = TimedChoice(
            kernel, times, rule, m, n, datetime.datetime.now(datetime.timezone.utc), load
        )
        stored = {**_read(path), key: found}
        _write(path, stored)
        _LOADED[path] = stored
        return found, path


def _forget() -> None:
    """Drops the choices read into this process (tests: the next :func:`choice` reads
    the file again)."""
    with _LOCK:
        _LOADED.clear()
