"""The machine products run on: what the CPU backend's choices read.

Cache sizes and the core count come from the OS (Linux ``/sys``; ``os.sysconf``
elsewhere). Memory bandwidths (read, copy, write into fresh pages) and the floor of one
jitted call are measured once per machine, in about half a second, and stored in a JSON file
(:func:`cache_file`) with when it was measured and the machine's load then; later
processes read the file. A stored profile is measured again when it fails validation
(a damaged or hand-edited file: every field is checked against plausible bounds), when
it is older than :data:`MAX_AGE_DAYS`, or when it was measured while the machine was
busy (a 1-minute load average above half its cores: bandwidths shared with other work)
and the machine is quiet now. ``python -m jaxcsr.calibrate`` measures again and prints
the profile; ``--show`` prints the one in use and the file it came from, storing
nothing.

Environment:

* ``JAXCSR_CACHE_DIR`` -- where the file lives (default ``$XDG_CACHE_HOME/jaxcsr``,
  else ``~/.cache/jaxcsr``); one file per machine, named by a hash of what the OS
  reports (CPU model, cores, caches).
* ``JAXCSR_CALIBRATE=0`` -- never measure on first use: without a stored file the
  profile is :data:`DEFAULT`, the conservative values the backend's constants were
  first fitted with, whatever the machine.

Choices read the profile when a product is traced. None of them changes a result's
bits: what they choose between reduces every row in the same order
(``docs/cpu.md``, "How the CPU backend chooses").
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = [
    "DEFAULT",
    "MAX_AGE_DAYS",
    "MachineProfile",
    "StoredProfile",
    "cache_file",
    "calibrate",
    "profile",
    "store_json",
    "stored",
    "use",
]

_MiB = 1 << 20

MAX_AGE_DAYS = 30
"""A stored profile older than this is measured again (the machine may have changed
under the same name: a resized VM, a new kernel, other tenants)."""

_INT_BOUNDS = {"cores": (1, 1 << 16), "l2_bytes": (0, 1 << 32), "l3_bytes": (0, 1 << 40)}
"""Plausible ranges of the counted fields (beyond them a file is damaged, not a machine)."""

_FLOAT_BOUNDS = {
    "read_gbs": 1e4,
    "copy_gbs": 1e4,
    "write_gbs": 1e4,
    "call_floor_us": 1e7,
}
"""Upper bounds of the measured fields; each is NaN (not measured) or in ``(0, bound]``."""


@dataclasses.dataclass(frozen=True)
class MachineProfile:
    """What the choices know of a machine.

    Attributes:
      cpu: the CPU's model name as the OS reports it.
      cores: CPUs this process may run on.
      l2_bytes: level-2 cache per core.
      l3_bytes: last-level cache, all of it (0: none reported).
      read_gbs: one thread's read bandwidth over arrays of twice the L3 (at most
        128 MiB; GB/s; NaN: not measured).
      copy_gbs: one thread's copy bandwidth (bytes read + written per second).
      write_gbs: one thread's write bandwidth into fresh pages (page faults included).
      call_floor_us: the median time of a jitted call that does almost nothing (µs).
      source: ``"measured"``, ``"file"`` (read from :func:`cache_file`), ``"defaults"``
        or ``"given"`` (built by hand, as tests do).
    """

    cpu: str
    cores: int
    l2_bytes: int
    l3_bytes: int
    read_gbs: float = float("nan")
    copy_gbs: float = float("nan")
    write_gbs: float = float("nan")
    call_floor_us: float = float("nan")
    source: str = "given"

    def __post_init__(self):
        if not isinstance(self.cpu, str):
            raise ValueError(f"MachineProfile: cpu must be a string, got {self.cpu!r}")
        for name, (low, high) in _INT_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"MachineProfile: {name} must be a non-negative int, got {value!r}"
                )
            if not low <= value <= high:
                raise ValueError(f"MachineProfile: {name} must lie in [{low}, {high}], got {value}")
        for name, high in _FLOAT_BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"MachineProfile: {name} must be a number, got {value!r}")
            if not (np.isnan(value) or 0 < value <= high):
                raise ValueError(
                    f"MachineProfile: {name} must be NaN (not measured) or in (0, {high:g}], "
                    f"got {value!r}"
                )

    @property
    def stream_bytes(self) -> int:
        """Outputs of a row gather from this size on are stored past the caches (into
        pages already resident): three quarters of the last-level cache, where an
        output larger than it cannot stay in cache anyway (24 MiB without an L3)."""
        return (3 * self.l3_bytes) // 4 if self.l3_bytes else 24 * _MiB

    def summary(self) -> str:
        """One line: the machine and what was measured."""
        measured = (
            f"read {self.read_gbs:.1f} GB/s, copy {self.copy_gbs:.1f} GB/s, fresh-page "
            f"write {self.write_gbs:.1f} GB/s (one thread), call floor "
            f"{self.call_floor_us:.1f} us"
            if np.isfinite(self.read_gbs)
            else "bandwidths not measured"
        )
        return (
            f"{self.cpu}: {self.cores} cores, L2 {self.l2_bytes / _MiB:g} MiB per core, "
            f"L3 {self.l3_bytes / _MiB:g} MiB; {measured} ({self.source})"
        )


DEFAULT = MachineProfile(
    "unknown", cores=2, l2_bytes=1 * _MiB, l3_bytes=32 * _MiB, source="defaults"
)
"""The profile without a measurement (``JAXCSR_CALIBRATE=0`` and no stored file): a
2-core part with 1 MiB of L2 per core and 32 MiB of L3, the machine the backend's
constants were first fitted on; its choices are the backend's original ones."""

_CURRENT: MachineProfile | None = None
_OVERRIDE: list[MachineProfile] = []


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG") or 0) * scale


def _caches() -> tuple[int, int]:
    """``(L2 per core, L3)`` in bytes from ``/sys`` (0 where not reported)."""
    sizes = {2: 0, 3: 0}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")) if base.is_dir() else ():
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            if level in sizes and kind in ("Unified", "Data"):
                sizes[level] = _size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    if not sizes[2] and hasattr(os, "sysconf"):
        for level, name in ((2, "SC_LEVEL2_CACHE_SIZE"), (3, "SC_LEVEL3_CACHE_SIZE")):
            with contextlib.suppress(ValueError, OSError):
                sizes[level] = max(int(os.sysconf(name)), 0)
    return sizes[2], sizes[3]


def _reported() -> MachineProfile:
    """What the OS reports, nothing measured."""
    l2, l3 = _caches()
    return MachineProfile(_cpu_name(), _cores(), l2 or DEFAULT.l2_bytes, l3, source="reported")


def cache_file(machine: MachineProfile | None = None) -> Path:
    """The file the profile of ``machine`` (default: this one, as the OS reports it) is
    stored in: named by its CPU model, cores and caches."""
    root = os.environ.get("JAXCSR_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg) / "jaxcsr") if xdg else str(Path.home() / ".cache" / "jaxcsr")
    r = _reported() if machine is None else machine
    key = f"{r.cpu}|{r.cores}|{r.l2_bytes}|{r.l3_bytes}|{platform.machine()}"
    return Path(root) / f"machine-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _call_floor_us() -> float:
    """The median of 200 calls of a jitted ``v + 1`` on 8 floats, timed on a thread of
    its own: JAX's trace state is per thread, so the calls run eagerly even when the
    product that first needs the profile is being traced or lowered."""
    import threading

    import jax

    def measure() -> None:
        tiny = jax.jit(lambda v: v + 1)
        v = jax.device_put(np.zeros((8,), np.float32))
        jax.block_until_ready(tiny(v))
        for _ in range(200):
            start = time.perf_counter()
            jax.block_until_ready(tiny(v))
            times.append(time.perf_counter() - start)

    times: list[float] = []
    worker = threading.Thread(target=measure, name="jaxcsr-calibrate")
    worker.start()
    worker.join()
    return float(np.median(times) * 1e6) if times else float("nan")  # NaN: it failed


def _measure(reported: MachineProfile) -> MachineProfile:
    """Bandwidths over arrays of twice the L3, within 32-128 MiB, best of three; the
    call floor over 200 calls. About half a second."""
    size = int(min(max(2 * reported.l3_bytes, 32 * _MiB), 128 * _MiB)) // 8
    src = np.empty(size)
    write = _best(lambda: np.empty(size).fill(1.0))  # a new array each time: fresh pages
    src.fill(1.0)
    dst = np.empty_like(src)
    dst.fill(0.0)
    read = _best(lambda: src.sum())
    copy = _best(lambda: np.copyto(dst, src))
    gbs = size * 8 / 1e9
    return dataclasses.replace(
        reported,
        read_gbs=round(gbs / read, 2),
        copy_gbs=round(2 * gbs / copy, 2),
        write_gbs=round(gbs / write, 2),
        call_floor_us=round(_call_floor_us(), 2),
        source="measured",
    )


def _load_average() -> float | None:
    """The 1-minute load average (``None`` where the OS reports none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _busy(load: float | None, cores: int) -> bool:
    """Whether a load average means other work shares the cores (above half of them)."""
    return load is not None and load > cores / 2


@dataclasses.dataclass(frozen=True)
class StoredProfile:
    """A profile read from :func:`cache_file`, with when and under what load it was
    measured.

    Attributes:
      profile: the profile (``source="file"``).
      path: the file.
      measured_at: when it was measured (UTC).
      load: the 1-minute load average when it was measured (``None``: not reported).
    """

    profile: MachineProfile
    path: Path
    measured_at: datetime.datetime
    load: float | None

    @property
    def age_days(self) -> float:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (now - self.measured_at).total_seconds() / 86400

    @property
    def measured_busy(self) -> bool:
        return _busy(self.load, self.profile.cores)

    def stale(self) -> str | None:
        """Why it should be measured again (``None``: it holds): too old, from the
        future, or measured busy on a machine that is quiet now."""
        if not 0 <= self.age_days <= MAX_AGE_DAYS:
            return f"measured {self.measured_at:%Y-%m-%d}, more than {MAX_AGE_DAYS} days ago"
        if self.measured_busy and not _busy(_load_average(), self.profile.cores):
            return f"measured under load {self.load:.2f} on {self.profile.cores} cores"
        return None

    def describe(self) -> str:
        load = "not reported" if self.load is None else f"{self.load:.2f}"
        busy = " (busy: measured again when the machine is quiet)" if self.measured_busy else ""
        return (
            f"read from {self.path}, measured {self.measured_at:%Y-%m-%d %H:%M} UTC "
            f"under a 1-minute load of {load}{busy}"
        )


def calibrate(store: bool = True) -> MachineProfile:
    """Measures this machine (about a second) and, with ``store``, writes the profile
    to :func:`cache_file` (replacing any there), with the time and the load average,
    and makes it the current one."""
    global _CURRENT
    load = _load_average()
    measured = _measure(_reported())
    if store:
        path = cache_file(measured)  # measured from what the OS reported: the same name
        fields = dataclasses.asdict(measured)
        fields.pop("source")
        now = datetime.datetime.now(datetime.timezone.utc)
        record = {"profile": fields, "measured_at": now.isoformat(), "load": load}
        store_json(path, record, "machine profile")
        _CURRENT = measured
    return measured


def store_json(path: Path, record: dict, what: str) -> None:
    """Writes ``record`` to ``path`` as JSON, whole or not at all (a temporary file
    replaces it, for concurrent processes); warns, naming ``what``, where it cannot."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(record, f, indent=1)
        os.replace(f.name, path)
    except OSError as err:
        import warnings

        warnings.warn(f"jaxcsr: {what} not stored at {path}: {err}", stacklevel=3)


def stored(path: Path | None = None) -> StoredProfile | None:
    """The profile stored at ``path`` (default: :func:`cache_file`), or ``None`` where
    there is none, or none that validates (damaged, hand-edited, from another version:
    measured again, never trusted)."""
    path = cache_file() if path is None else path
    try:
        record = json.loads(path.read_text())
        profile = MachineProfile(**record["profile"], source="file")
        measured_at = datetime.datetime.fromisoformat(record["measured_at"])
        if measured_at.tzinfo is None:
            raise ValueError("measured_at without a time zone")
        load = record["load"]
        if load is not None and (isinstance(load, bool) or not isinstance(load, int | float)):
            raise ValueError(f"load must be a number or null, got {load!r}")
        if load is not None and not 0 <= load < 1e6:
            raise ValueError(f"load out of range: {load!r}")
        return StoredProfile(profile, path, measured_at, None if load is None else float(load))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _calibration_on() -> bool:
    return os.environ.get("JAXCSR_CALIBRATE", "1").strip().lower() not in (
        "0",
        "off",
        "false",
        "no",
    )


def profile() -> MachineProfile:
    """The profile choices read: one given with :func:`use`, else this process's (the
    stored file where it validates and is not stale, else a measurement stored for the
    next process, else :data:`DEFAULT` with calibration off), found once per process."""
    global _CURRENT
    if _OVERRIDE:
        return _OVERRIDE[-1]
    if _CURRENT is None:
        found = stored()
        if found is not None and (found.stale() is None or not _calibration_on()):
            _CURRENT = found.profile
        elif _calibration_on():
            _CURRENT = calibrate(store=True)
        else:
            _CURRENT = DEFAULT
    return _CURRENT


@contextlib.contextmanager
def use(machine: MachineProfile) -> Iterator[MachineProfile]:
    """Products traced inside the block choose for ``machine`` (tests, what-if studies).
    Jitted functions keep what they chose when traced."""
    if not isinstance(machine, MachineProfile):
        raise TypeError(f"use: machine must be a MachineProfile, got {type(machine).__name__}")
    _OVERRIDE.append(machine)
    try:
        yield machine
    finally:
        _OVERRIDE.pop()


def _forget() -> None:
    """Drops this process's profile (tests: the next :func:`profile` looks again)."""
    global _CURRENT
    _CURRENT = None
