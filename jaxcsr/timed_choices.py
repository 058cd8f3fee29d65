"""Timed choices between CPU kernels that compute the same bits, stored per machine.

Static unsorted segment ids whose push takes one piece can run three kernels that add
each row's values in input order, so they give the same bits: the pull through the
planned sort, the push with its features split over the threads, and XLA's scatter
(float32 only: it adds in the values' dtype). The rule :func:`jaxcsr.kernels.cpu.choose`
applies picks one from the sizes; which one is fastest differs between machines
(``benchmarks/results/cpu-epyc/timed_choice/``). Here the candidates are timed once
per machine and *shape class*, and the result stored for every later process. This
module keeps the classes, the store and the margin; the CPU backend
(:mod:`jaxcsr.kernels.cpu`) runs its own kernels for the timing.

A shape class is a float32 or 16-bit sum with ``F`` features (1 to
:data:`MAX_FEATURES`) of ``m`` rows and ``n`` ids, both rounded to the nearest quarter
power of two (within 9%: which kernel wins changed within 20% of size in the cells
measured). The candidates run on uniform random ids of exactly that rounded size,
drawn from a fixed seed, so the stored choice is a function of the machine and the
class. The rule's kernel is kept unless another is faster by :data:`MARGIN` (medians
of alternating rounds). One pull exception: at one feature the pull sums in eight lanes
(other bits), so only the push and the scatter are timed there.

Timing one class takes 0.1-2 s (measured on 2 cores), once, when the first product of
that class is traced. The choices live in ``choices-<machine>.json`` beside the machine profile
(:func:`jaxcsr.machine.cache_file`), with the library they were timed with: a rebuilt
library, a choice older than :data:`jaxcsr.machine.MAX_AGE_DAYS` or one timed under
load (a 1-minute load average above half the cores) on a machine quiet now is timed
again.

Environment: ``JAXCSR_TIMED_CHOICES=0`` turns timed choices off (the rule decides);
``JAXCSR_CALIBRATE=0`` times nothing new but still reads stored choices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxcsr import machine

__all__ = [
    "MARGIN",
    "MAX_FEATURES",
    "TimedChoice",
    "candidates",
    "choice",
    "choices_file",
    "enabled",
    "pin",
    "pinned",
    "library_stamp",
    "shape_class",
    "stored",
]

MAX_FEATURES = 16
"""Sums this narrow are timed; wider ones keep the rule (the pull, whose rows of x
span whole lines: timed at 24-64 features it won 18 of 18 cells,
``benchmarks/results/cpu-epyc/timed_choice/timed_choice_wide.md``)."""

MARGIN = 0.15
"""Another candidate replaces the rule's kernel only when its median is this much
shorter (a noisy machine must not trade a choice for its spread)."""

_STEPS_PER_OCTAVE = 4  # shape classes: sizes within 9% (a cache's edge is that sharp)
_MIN_VALUES = 1 << 15  # ids x features below this: the call costs more than the choice
_MAX_X_BYTES = 256 << 20  # the timed operand at most this large (a few seconds)
TimeCandidates = Callable[[int, int, int, int, tuple[str, ...]], dict[str, float]]
"""``(rows, ids, n_features, itemsize, kernels) -> {kernel: median us}``."""

_PIN = threading.local()
_LOCK = threading.Lock()
_LOADED: dict[tuple[Path, str | None], dict] = {}
_FAILED: set[str] = set()  # classes whose timing failed in this process: the rule


@dataclasses.dataclass(frozen=True)
class TimedChoice:
    """A stored choice for one shape class.

    Attributes:
      kernel: ``"pull"``, ``"push"`` or ``"xla"``.
      times_us: each candidate's median time (microseconds) at the class's size.
      rule: the kernel the rule picks at that size.
      rows, ids: the class's size (quarter powers of two).
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
    """The kernel products traced on this thread run (:func:`pin`), else ``None``."""
    return getattr(_PIN, "kernel", None)


@contextlib.contextmanager
def pin(kernel: str) -> Iterator[None]:
    """Products traced inside the block, on this thread, run ``kernel`` where they
    would be timed (the timing's own products; tests)."""
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


def library_stamp(path: Path | None) -> str:
    """A stamp of the built library at ``path`` (its path, size and time): choices
    timed with another build are timed again."""
    if path is None:
        return "none"
    try:
        st = path.stat()
    except OSError:
        return "none"
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(stamp.encode()).hexdigest()[:16]


def _read(path: Path, library: str | None) -> dict:
    """The choices stored at ``path`` for the library build stamped ``library`` (any
    build: ``None``), empty where none validate."""
    if (path, library) in _LOADED:
        return _LOADED[path, library]
    found: dict = {}
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict) and library in (None, record.get("library")):
            for key, entry in record.get("choices", {}).items():
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    found[key] = _parse(entry)
    except (OSError, ValueError):
        pass
    _LOADED[path, library] = found
    return found


def stored(library: Path | None = None) -> dict[str, TimedChoice]:
    """The choices stored for this machine, by shape class: those timed with the
    library build at ``library`` (``None``: with any build)."""
    with _LOCK:
        stamp = None if library is None else library_stamp(library)
        return dict(_read(choices_file(), stamp))


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


def _write(path: Path, library: str, choices: dict[str, TimedChoice]) -> None:
    record = {
        "library": library,
        "choices": {
            key: {**dataclasses.asdict(c), "measured_at": c.measured_at.isoformat()}
            for key, c in choices.items()
        },
    }
    machine.store_json(path, record, "timed choices")


def _stale(found: TimedChoice, cores: int) -> bool:
    age = datetime.datetime.now(datetime.timezone.utc) - found.measured_at
    if not 0 <= age.total_seconds() <= machine.MAX_AGE_DAYS * 86400:
        return True
    return machine._busy(found.load, cores) and not machine._busy(machine._load_average(), cores)


def _on_own_thread(time_candidates: TimeCandidates, *args) -> dict[str, float]:
    """``time_candidates(*args)`` on a thread of its own (JAX's trace state is per
    thread: the product that asked is being traced), its errors raised here."""
    times: list[dict[str, float]] = []
    failed: list[BaseException] = []

    def measure() -> None:
        try:
            times.append(time_candidates(*args))
        except BaseException as err:  # reported to the caller's thread
            failed.append(err)

    worker = threading.Thread(target=measure, name="jaxcsr-timed-choice")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return times[0]


def choice(
    rows: int,
    ids: int,
    n_features: int,
    itemsize: int,
    rule_at: Callable[[int, int], str | None],
    time_candidates: TimeCandidates,
    library: Path | None,
) -> tuple[TimedChoice, Path] | None:
    """The stored (or, first, timed) choice for a one-piece sum of these sizes, with
    the file it is stored in; ``None`` where timed choices are off or do not apply
    (the rule decides): a width past :data:`MAX_FEATURES`, too few or too many values,
    a class at whose rounded size ``rule_at(rows, ids)`` gives no rule (the push would
    split into pieces there) or one outside the candidates, or calibration off with
    nothing stored. ``time_candidates(rows, ids, n_features, itemsize, kernels)``
    returns each kernel's median time (us) at the class's size; ``library``: the
    kernels' build (choices of another build are timed again)."""
    if not enabled() or pinned() is not None or not 1 <= n_features <= MAX_FEATURES:
        return None
    kernels = candidates(n_features, itemsize)
    m, n = _size(_step(rows)), _size(_step(ids))
    if n * n_features < _MIN_VALUES or n * n_features * itemsize > _MAX_X_BYTES:
        return None
    rule = rule_at(m, n)
    if rule not in kernels:
        return None
    path, stamp = choices_file(), library_stamp(library)
    key = shape_class(rows, ids, n_features, itemsize)
    with _LOCK:
        stored = _read(path, stamp)
        found = stored.get(key)
        cores = machine.profile().cores
        if found is not None and (not _stale(found, cores) or not machine._calibration_on()):
            return found, path
        if not machine._calibration_on() or key in _FAILED:
            return None
        load = machine._load_average()
        try:
            times = _on_own_thread(time_candidates, m, n, n_features, itemsize, kernels)
        except Exception as err:  # a timing that fails must not fail the product
            if key not in _FAILED:
                import warnings

                warnings.warn(
                    f"jaxcsr: timing the CPU kernels for {key} failed ({err!r}); the "
                    "rule decides", stacklevel=3,
                )  # fmt: skip
            _FAILED.add(key)
            return None
        best = min(times, key=times.__getitem__)
        kernel = best if times[best] < (1 - MARGIN) * times[rule] else rule
        found = TimedChoice(
            kernel, times, rule, m, n, datetime.datetime.now(datetime.timezone.utc), load
        )
        stored = {**stored, key: found}
        _write(path, stamp, stored)
        _LOADED[path, stamp] = stored
        _LOADED.pop((path, None), None)  # the choices of any build: read again
        return found, path


def _forget() -> None:
    """Drops the choices read into this process (tests: the next :func:`choice` reads
    the file again)."""
    with _LOCK:
        _LOADED.clear()
        _FAILED.clear()
