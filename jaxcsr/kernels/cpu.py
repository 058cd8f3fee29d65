"""The native CPU backend: jaxcsr's own C++ kernels through XLA FFI.

``csrc/*.cc`` are compiled by ``pip install`` into a plain shared library
(``_cpu_kernels*.so`` beside this module), loaded with ``ctypes`` and registered with
``jax.ffi.register_ffi_target`` for the ``cpu`` platform. The products split their
work over XLA's intra-op thread pool, read 16-bit operands as they are and accumulate
in float32; each takes ``reduce="sum"``, ``"max"`` or ``"min"`` (empty rows 0, NaN
propagates), and the pull and the push ``"mean"`` too (:func:`divides_means`). Every
row is reduced in one order fixed by the sizes, never by the thread count: results are
bit-identical for any number of threads.

``pull``
    ``y[r] = sum_j data[j] * x[cols[j]]`` over row ``r``'s entries in CSR order:
    general matrices (and their planned transposes), sorted segment ids (``cols``
    is the identity: ``x`` is read once, in order) and unsorted ids that reduce in one
    piece (``cols`` the planned sort: each row's ids in input order), but for narrow
    float32 sums, which XLA's scatter adds in the same order (:func:`choose`; or which
    of the three this machine runs fastest, timed once: :mod:`jaxcsr.timed_choices`).
``push``
    The one-per-column view of unsorted segment ids in 2 or 4 pieces of consecutive
    ids (the number fixed by the sizes: :func:`push_pieces`), each adding ``x[k]`` to
    row ``ids[k]`` of its own float32 partial, combined in piece order; ``x`` is
    streamed, and no id is skipped (a row owner skipping other rows' ids mispredicts a
    branch per id in random order). Ids planned on the device push in one piece too,
    its features split over the threads in blocks of 64-byte lines. :func:`choose`
    says which runs and why.
``arg search``
    The first entry attaining each max/min (``return_arg``, the max/min gradient;
    :func:`arg_positions`, :func:`arg_columns`): by rows over the threads for general
    views; for one-per-column views over the columns in input order, in pieces
    combined by their minimum (or one piece with its features split over threads).
``put_attaining``
    The max/min gradient of ``from_indices`` views (the transpose of
    :func:`jaxcsr.take_attaining.take_attaining`): ``ct[ids[k]]`` where column ``k`` attains its
    row's output, else 0, in one pass.
``gather``
    One entry per row (the backward of a segment sum, ``y[i] = data_i * x[ids[i]]``):
    rows copied in their dtype, split over threads.
``sddmm``
    ``out[k] = ct[row k] . x[col k]`` (:func:`sddmm`, the values' gradient): per row
    for general views, per entry in input order for one-per-column views; one value
    per head folds eight heads' sums at once where heads hold whole vectors.
``softmax``
    The softmax over rows (:func:`softmax`: ``edge_softmax``, ``segment_softmax``)
    and its tangent, fused: for entries sorted by row, each row's max, ``exp`` and
    sum, then the normalised output, one row at a time while it is in cache; for
    unsorted segment ids, a push in input order of ``exp`` into per-row sums (unshifted
    where the sums allow, as the XLA path's fast path; else after a push of the
    maxima) and one scaling pass; ``exp`` is the
    kernel's own (eight lanes at a time, sixteen with AVX-512 for head counts that
    are multiples of 16, the same bits either way; within 1 ulp of float64 on every
    float32 input in [-110, 90], checked exhaustively).

Products of fewer than 2^17 elements run on the calling thread alone (a gathered
value counts twice). Row gathers store outputs from the machine profile's
``stream_bytes`` on past the caches (:mod:`jaxcsr.machine`). The loops run their AVX2
build (the baseline's on CPUs without it), four of them (the pull's and the push's
loops over rows without their own vector code, the row gather, the put) their AVX-512
build where the CPU has it: the same bits on each. ``JAXCSR_CPU_ISA=baseline`` or
``avx2``, read once, caps the instruction set (the tests compare the builds).

Float64 and integers run on the XLA path (:mod:`jaxcsr.kernels.xla`). The backend plans
nothing beyond the portable core. Without the library (no compiler at
install time) :func:`available` is False: products fall back to XLA, with one
warning per process.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcsr import plan as host_plan
from jaxcsr import timed_choices
from jaxcsr.dtypes import KERNEL_DTYPES, product_dtype
from jaxcsr.kernels import xla
from jaxcsr.machine import profile
from jaxcsr.structure import Structure

__all__ = [
    "arg_columns",
    "arg_positions",
    "Strategy",
    "available",
    "choose",
    "describe",
    "library_path",
    "plan",
    "product",
    "push_pieces",
    "put_attaining",
    "reads_transposed_data",
    "sddmm",
    "softmax",
    "takes_heads",
    "divides_means",
    "threads",
    "unsorted_kernel",
    "traced_scatters",
    "push_loses_to_scatter",
    "push_runs_on_one_thread",
]

TRACED_SCATTER_MAX_WIDTH = {
    ("sum", False): (64, 16),
    ("max", False): (32, 8),
    ("min", False): (32, 8),
    ("max", True): (16, 8),
    ("min", True): (16, 8),
}
"""Per ``(reduce, gradient)`` (``gradient``: a max/min's gradient), the widths below
which traced reductions scatter on CPU, for values of 4 bytes or more and for 16-bit
floats (:func:`traced_scatters`)."""
TRACED_SCATTER_MAX_ELEMENTS = 2**24
TRACED_SCATTER_SMALL_VALUE = (2**23, 2**19)
"""A max/min value of fewer elements than this (4-byte, 16-bit values) and under 128
features scatters at any width: the plan's fixed cost is not repaid."""


def traced_scatters(
    reduce: str, num_ids: int, width: int, dtype: Any = np.float32, gradient: bool = False,
    num_segments: int | None = None,
) -> bool:  # fmt: skip
    """Whether a segment ``reduce`` (``"sum"``, ``"max"``, ``"min"``) of traced ids runs
    XLA's scatter on CPU (``impl=None``) instead of a device plan and the native kernel:
    below :data:`TRACED_SCATTER_MAX_WIDTH` features (a narrower bound for 16-bit floats,
    which the kernels read at half the bytes; XLA adds them in float32) when the values
    hold fewer than :data:`TRACED_SCATTER_MAX_ELEMENTS` elements; a max/min's value also
    below :data:`TRACED_SCATTER_SMALL_VALUE`.
    ``gradient``: whether a max/min's gradient scatters too (a narrower bound: other
    gradients are the planned product's, whose backward is a masked gather). The
    kernel's per-call cost (the sum's pieces with private partial outputs; the max's
    sort) is repaid per value, so narrow or few values cannot repay it (sums:
    ``benchmarks/results/cpu-xeon-avx512/traced_scatter/``, max and min:
    ``benchmarks/results/cpu-xeon-avx512/traced_extremes/``).
    With ``num_segments``, a sum of values other than 16-bit floats also scatters at
    any size where the native push would run on one thread
    (:func:`push_runs_on_one_thread`), as XLA's scatter does, which measured faster
    there (``benchmarks/results/cpu-epyc/traced_one_piece/``), and where the push
    lost to the scatter on both CPUs measured, one piece with few ids a row or two
    with large partials (:func:`push_loses_to_scatter`:
    ``benchmarks/results/cpu-epyc/traced_few_ids/``)."""
    dtype = np.dtype(dtype)
    sixteen_bit = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    if reduce == "sum" and num_segments is not None and not sixteen_bit and available():
        sizes = (num_segments, num_ids, width, dtype.itemsize)
        if push_runs_on_one_thread(*sizes) or push_loses_to_scatter(*sizes):
            return True
    gradient = gradient and reduce != "sum"
    limit = TRACED_SCATTER_MAX_WIDTH[reduce, gradient][sixteen_bit]
    elements = num_ids * width
    if reduce != "sum" and not gradient and width < 128:
        if elements < TRACED_SCATTER_SMALL_VALUE[sixteen_bit]:
            return True
    return width < limit and elements < TRACED_SCATTER_MAX_ELEMENTS


_TARGETS = {
    "jaxcsr_cpu_arg_search": "JaxcsrArgSearch",
    "jaxcsr_cpu_pull": "JaxcsrCsrPull",
    "jaxcsr_cpu_push": "JaxcsrRowPush",
    "jaxcsr_cpu_sddmm": "JaxcsrSddmm",
    "jaxcsr_cpu_gather": "JaxcsrGather",
    "jaxcsr_cpu_put_attaining": "JaxcsrPutAttaining",
    "jaxcsr_cpu_softmax": "JaxcsrSoftmax",
}
_MAX_THREADS = 0
# the gathers' stores: 0 as the kernel decides (past the caches for large outputs in
# resident pages), 1 always through the caches, 2 always past them where the layout
# allows; tests force each to compare their bits (_gather_stores)
_GATHER_STORES = 0
_REDUCE = {"sum": 0, "max": 1, "min": 2}
# what unsorted ids planned on the host run: None as choose() decides, or the kernel
# the tests and the pull_or_push study pin to compare the two
_UNSORTED_KERNEL: str | None = None


def library_path() -> Path | None:
    """The built library beside this module (``None``: not built). The environment
    variable ``JAXCSR_CPU_LIBRARY`` names another build instead (the sanitizer test's),
    read once, before the first product."""
    if os.environ.get("JAXCSR_CPU_LIBRARY"):
        return Path(os.environ["JAXCSR_CPU_LIBRARY"])
    found = sorted(Path(__file__).parent.glob("_cpu_kernels*.so"))
    return found[0] if found else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built library, loaded once (``None``: not built or not loadable)."""
    path = library_path()
    if path is None:
        return None
    try:
        return ctypes.cdll.LoadLibrary(str(path))
    except OSError:
        return None


@functools.cache
def available() -> bool:
    """Whether the library is built and its FFI targets are registered."""
    library = _library()
    if library is None:
        return False
    try:
        for target, symbol in _TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    except AttributeError:
        return False
    return True


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """At most ``n`` threads per product traced inside the block (``0``: XLA's whole
    intra-op pool, the default). The result does not depend on it: every row is
    summed in one order."""
    global _MAX_THREADS
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"threads: n must be a non-negative int, got {n!r}")
    saved, _MAX_THREADS = _MAX_THREADS, n
    try:
        yield
    finally:
        _MAX_THREADS = saved


@contextlib.contextmanager
def unsorted_kernel(kernel: str) -> Iterator[None]:
    """Unsorted ids planned on the host run ``kernel`` in products traced inside the
    block: ``"pull"`` or ``"push"``, whatever :func:`choose` would pick (tests and
    ``benchmarks.studies.pull_or_push`` compare the two). Where the push takes one
    piece both reduce each row in input order: the same bits, except for one feature
    (the pull then sums each row in eight interleaved lanes). In 2 or 4 pieces the
    push reduces in piece order and the pull in input order: the bits may differ."""
    global _UNSORTED_KERNEL
    if kernel not in ("pull", "push"):
        raise ValueError(f"kernel must be 'pull' or 'push', got {kernel!r}")
    saved, _UNSORTED_KERNEL = _UNSORTED_KERNEL, kernel
    try:
        yield
    finally:
        _UNSORTED_KERNEL = saved


@contextlib.contextmanager
def _gather_stores(how: str) -> Iterator[None]:
    """Gathers (row and feature-major) traced inside the block store ``"auto"`` (the
    default), always ``"cached"`` or always ``"streamed"`` (past the caches, where the
    values are copied as they are: no weights, one dtype; rows of 32 bytes or more, a
    multiple of 16). For tests: the results are the same bits."""
    global _GATHER_STORES
    saved, _GATHER_STORES = _GATHER_STORES, {"auto": 0, "cached": 1, "streamed": 2}[how]
    try:
        yield
    finally:
        _GATHER_STORES = saved


def plan(structure: Structure) -> None:
    """The kernels read the portable core only: nothing to plan."""
    del structure


@dataclasses.dataclass(frozen=True)
class Strategy:
    """What a native product runs and why (:func:`choose`).

    Attributes:
      kernel: ``"gather"``, ``"push"``, ``"pull"``, or ``"xla"`` (XLA's own op).
      reason: one sentence on why, with the sizes it read.
      pieces: the push's pieces for unsorted ids (the order rows are reduced in;
        0 where no push is in question).
    """

    kernel: str
    reason: str
    pieces: int = 0


@functools.cache
def _pieces_function():
    library = _library()
    assert library is not None, "push_pieces needs the built library"
    function = library.JaxcsrPushPieces
    function.restype = ctypes.c_int64
    function.argtypes = [ctypes.c_int64] * 4
    return function


def push_pieces(rows: int, entries: int, n_features: int, itemsize: int) -> int:
    """The pieces a row-major push of ``entries`` ids into ``rows`` rows takes (1, 2
    or 4), as the library computes it: fixed by the sizes, never by the machine, so
    every machine reduces each row in the same order."""
    return int(_pieces_function()(rows, entries, n_features, itemsize))


def push_runs_on_one_thread(rows: int, entries: int, n_features: int, itemsize: int) -> bool:
    """Whether a row-major push runs on one thread: one piece (:func:`push_pieces`)
    whose rows of ``x`` hold under two 64-byte lines (the one-piece push splits its
    features over the threads in blocks of whole lines)."""
    one_piece = push_pieces(rows, entries, n_features, itemsize) == 1
    return one_piece and n_features * itemsize < 128


TRACED_ONE_PIECE_IDS_A_ROW = 3
"""A traced float32 sum whose push takes one piece with fewer ids a row than this
scatters at any size (:func:`push_loses_to_scatter`)."""


def push_loses_to_scatter(rows: int, entries: int, n_features: int, itemsize: int) -> bool:
    """Whether a row-major push of ``entries`` traced ids into ``rows`` rows is one
    XLA's scatter outran on both CPUs measured: one piece with under
    :data:`TRACED_ONE_PIECE_IDS_A_ROW` ids a row (each output row, past the caches,
    updated about once, by feature blocks that each read every id), or two pieces whose
    float32 partials hold over 40 MiB (filled and combined out of the caches; the bound
    at which static ids pull instead)."""
    pieces = push_pieces(rows, entries, n_features, itemsize)
    if pieces == 1:
        return entries < TRACED_ONE_PIECE_IDS_A_ROW * rows
    return pieces == 2 and _large_partials(rows, n_features)


def choose(
    view: Structure, n_features: int | None = None, itemsize: int = 4,
    feature_major: bool = False, reduce: str = "sum",
) -> Strategy:  # fmt: skip
    """The native kernel for a product of ``view`` with ``n_features`` features of
    ``itemsize`` bytes, and why.

    Unsorted segment ids (a one-per-column view planned on the host) run the push in
    the pieces the sizes fix (:func:`push_pieces`), each row reduced in input order
    within each piece and the pieces in order, or the pull through the planned sort,
    each row in input order; which one follows from the sizes and dtype alone, so
    every machine computes the same bits. The measurements behind each rule (2 Intel
    Xeon cores): ``benchmarks/results/cpu-xeon-avx512/pull_or_push/``.

    - One piece: the pull. It reads ``x`` through the sort once and writes each output
      row once, where the one-piece push splits rows' features over the threads and
      updates output rows at random. One feature is the exception: the push, one
      sequential loop, where the pull gathers ``x`` at random.
    - Two pieces: the pull where the push's two float32 partials would stay out of the
      caches or cost what the pull does not (:func:`_pull_over_two_pieces`), else the
      push.
    - Four pieces: the push.
    - One piece of float32 sums into narrow rows: XLA's scatter, the loop
      ``jax.ops.segment_sum`` runs, at 2 to 8 features from
      :data:`NARROW_SCATTER_MIN_IDS` ids and at one feature from
      :data:`NARROW_SCATTER_MIN_ROWS` rows. It adds each value in input order too (the
      bits of the push, and of the pull from 2 features), and there its one loop beat
      the pull, which mispredicts a branch per row of a few ids, and matched or beat
      the push at 4 features and at one feature into outputs past the L2:
      ``benchmarks/results/cpu-epyc/narrow_scatter/``. ``reduce`` names the
      reduction: only sums take XLA's scatter.

    Where a one-piece sum's candidates give the same bits (the push, the pull from two
    features, XLA's scatter for float32), this machine's timings replace the rule:
    :mod:`jaxcsr.timed_choices` times them once per shape class and stores the
    result (``JAXCSR_TIMED_CHOICES=0``: the rule; measured in
    ``benchmarks/results/cpu-epyc/timed_choice/``). Pins (:func:`unsorted_kernel`)
    win over both.

    Ids planned on the device push: they have no sort to pull through.

    One entry per row (the segment sum's backward, ``ct[ids]``): the native gather,
    but for row-major rows under 32 bytes, which XLA's gather copies faster (the same
    bits: each value copied, times its value in float32): measured in
    ``benchmarks/results/cpu-xeon-avx512/random_graphs/``.
    """
    if view.one_per_row:
        row_bytes = None if n_features is None else n_features * itemsize
        if row_bytes is not None and row_bytes < _NARROW_GATHER_BYTES and not feature_major:
            return Strategy("xla", f"one entry per row, rows of {row_bytes} bytes: XLA's gather")
        return Strategy("gather", "one entry per row: rows copied (times their value)")
    if not view.one_per_column or view.sorted_ids:
        return Strategy("pull", "entries stored by row: each row reduced where it is")
    if view.layout.padded:
        return Strategy("push", "ids planned on the device: no sort to pull through")
    if feature_major:
        return Strategy("push", "feature-major: feature blocks pushed in input order")
    if n_features is None:
        return Strategy("push", "the push, or the pull where it takes one piece (by width)")
    m, n = view.shape
    pieces = push_pieces(m, n, n_features, itemsize)
    timing = timed_choices.pinned()  # a kernel being timed (_time_one_piece's products)
    if timing is not None and pieces == 1:
        return Strategy(timing, f"timing ({m} rows, {n} ids): {timing}", 1)
    if _UNSORTED_KERNEL == "pull":
        return Strategy("pull", f"pinned ({m} rows, {n} ids): the pull through the sort", 1)
    reason = _pull_over_two_pieces(m, n, n_features, itemsize) if pieces == 2 else None
    if reason is not None and _UNSORTED_KERNEL is None:
        return Strategy("pull", f"{reason} ({m} rows, {n} ids): the pull through the sort", 1)
    if pieces > 1:
        return Strategy(
            "push", f"{pieces} pieces of ids into private partials ({m} rows, {n} ids)", pieces
        )
    if _UNSORTED_KERNEL == "push":
        return Strategy("push", f"pinned ({m} rows, {n} ids): the push in one piece", 1)
    rule = _one_piece_rule(m, n, n_features, itemsize, reduce)
    if reduce == "sum":

        def rule_at(rows: int, ids: int) -> str | None:
            if push_pieces(rows, ids, n_features, itemsize) != 1:
                return None
            return _one_piece_rule(rows, ids, n_features, itemsize, reduce).kernel

        timed = timed_choices.choice(
            m, n, n_features, itemsize, rule_at, _time_one_piece, library_path()
        )
        if timed is not None:
            found, path = timed
            return Strategy(found.kernel, f"one piece ({m} rows, {n} ids): {found.reason(path)}", 1)
    return rule


_TIMED_ROUNDS, _TIMED_MAX_ROUNDS = 7, 41  # alternating rounds; medians over them
_TIMED_ROUND_BUDGET_S = 0.3  # more rounds where they are this quick in all


def _time_one_piece(
    rows: int, ids: int, n_features: int, itemsize: int, kernels: tuple[str, ...]
) -> dict[str, float]:
    """Each of ``kernels``' median time (us) for a one-piece sum of ``ids`` uniform
    random ids (a fixed seed) into ``rows`` rows of ``n_features`` features (float32,
    or bfloat16 for 2 bytes): the structure an argument, as a training step passes its
    matrix; two calls each, then alternating rounds (7, or up to 41 where they take
    under 0.3 s in all). :mod:`jaxcsr.timed_choices` calls it, once per shape class."""
    rng = np.random.default_rng(20261207)
    idx = rng.integers(0, rows, ids, dtype=np.int32)
    device = jax.devices("cpu")[0]  # the CPU's, whatever the default backend
    view = jax.device_put(host_plan.structure_from_segment_ids(idx, rows), device)
    dtype = jnp.float32 if itemsize == 4 else jnp.bfloat16
    x = jax.device_put(rng.standard_normal((ids, n_features), np.float32), device).astype(dtype)

    def run(v, x):
        return product(
            x, None, v, None, reduce="sum", out_dtype=dtype, interpret=False, platform="cpu"
        )

    compiled = {}
    for kernel in kernels:
        with timed_choices.pin(kernel):  # read when traced
            compiled[kernel] = functools.partial(jax.jit(run).lower(view, x).compile(), view)
        jax.block_until_ready(compiled[kernel](x))
    start = time.perf_counter()
    for kernel in kernels:
        jax.block_until_ready(compiled[kernel](x))
    once = time.perf_counter() - start  # a round
    rounds = max(_TIMED_ROUNDS, min(_TIMED_MAX_ROUNDS, int(_TIMED_ROUND_BUDGET_S / once)))
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(rounds):
        for kernel in kernels:
            start = time.perf_counter()
            jax.block_until_ready(compiled[kernel](x))
            times[kernel].append(time.perf_counter() - start)
    return {k: float(np.median(v) * 1e6) for k, v in times.items()}


def _one_piece_rule(m: int, n: int, n_features: int, itemsize: int, reduce: str) -> Strategy:
    """What static unsorted ids whose push takes one piece run by the rule
    (:func:`choose`)."""
    if _narrow_scatter(m, n, n_features, itemsize, reduce):
        return Strategy(
            "xla", f"one piece ({m} rows, {n} ids), {n_features} float32 feature(s): XLA's "
            "scatter, the same order", 1,
        )  # fmt: skip
    if n_features == 1:
        return Strategy("push", f"one piece ({m} rows, {n} ids), one feature: the push", 1)
    return Strategy(
        "pull", f"one piece ({m} rows, {n} ids): the pull through the sort, same order", 1
    )


_NARROW_GATHER_BYTES = 32  # row gathers of rows narrower than this: XLA's gather

NARROW_SCATTER_MIN_IDS = 1 << 16
"""Static unsorted ids in one piece, rows of 2 to 8 float32 features: from this many
ids XLA's scatter sums them (:func:`choose`); below, the kernels' lower call cost wins."""
NARROW_SCATTER_MIN_ROWS = 1 << 19
"""... and at one feature from this many rows (an output past the L2), where the push
wins below."""


def _narrow_scatter(m: int, n: int, n_features: int, itemsize: int, reduce: str) -> bool:
    """Whether a one-piece sum of ``n`` static unsorted ids into ``m`` rows runs XLA's
    scatter (:func:`choose`)."""
    if reduce != "sum" or itemsize != 4:  # float32 sums (the kernels' 4-byte dtype)
        return False
    if n_features == 1:
        return m >= NARROW_SCATTER_MIN_ROWS
    return 2 <= n_features <= 8 and n >= NARROW_SCATTER_MIN_IDS


# Where static unsorted ids in two pieces run the pull instead of the push: in the
# cells these bounds select the pull was faster in all but one, in most others the
# push (benchmarks/results/cpu-xeon-avx512/pull_or_push/pull_or_push.md).
_WIDE_ROW_BYTES = 512  # rows of x this long: the pull's gathers read whole lines
_LARGE_PARTIALS_BYTES = 40 << 20  # both float32 partials past this: out of the caches
_SIXTEEN_BIT_ROW_BYTES = 32  # 16-bit rows from this long with under 8 ids a row


def _large_partials(rows: int, n_features: int) -> bool:
    """Whether the push's two float32 partials of ``rows`` rows would hold more than
    :data:`_LARGE_PARTIALS_BYTES` (static ids pull there, traced ids scatter)."""
    return 2 * 4 * rows * n_features > _LARGE_PARTIALS_BYTES


def _pull_over_two_pieces(m: int, n: int, n_features: int, itemsize: int) -> str | None:
    """Why static unsorted ids whose push takes two pieces run the pull instead, or
    ``None`` to push: rows of ``x`` of 512 bytes or more; two float32 partials over
    40 MiB; or 16-bit values in rows of 32 bytes or more with under 8 ids a row (the
    two pieces the push takes for 16-bit values there exist to beat a one-piece push
    that converts every value on one thread; the pull splits rows over the threads)."""
    row_bytes = n_features * itemsize
    if row_bytes >= _WIDE_ROW_BYTES:
        return f"rows of x of {row_bytes} bytes, where the push takes 2 pieces"
    if _large_partials(m, n_features):
        return f"2 pieces would fill {2 * 4 * m * n_features / 2**20:.0f} MiB of partials"
    if itemsize == 2 and row_bytes >= _SIXTEEN_BIT_ROW_BYTES and n < 8 * m:
        return "16-bit rows of 32 bytes or more, under 8 ids a row"
    return None


def describe(view: Structure, n_features: int | None = None) -> dict[str, str]:
    chosen = choose(view, n_features)
    if chosen.kernel == "xla":
        return {"cpu": f"XLA ({chosen.reason})"}
    stores = ""
    if chosen.kernel == "gather":  # the only choice that reads the machine profile
        stores = f"; outputs from {profile().stream_bytes / 2**20:g} MiB stored past the caches"
    return {"cpu": f"native {chosen.kernel} ({chosen.reason}{stores})"}


def runs(view: Structure, x_dtype, data_dtype, out_dtype) -> bool:
    """Whether the kernels take this product (else the XLA path runs it). Not general
    matrices planned on the device (traced COO): their dropped entries sit past the
    row pointer's end, which the kernels' checks reject."""
    dtype = product_dtype(x_dtype, data_dtype)
    return (
        available()
        and not (view.layout.padded and view.layout.kind == "general")
        and dtype in KERNEL_DTYPES
        and np.dtype(out_dtype) in KERNEL_DTYPES
        and np.dtype(view.index_dtype) == np.int32
    )


def reads_transposed_data(view: Structure, platform, x_dtype, data_dtype, out_dtype) -> bool:
    """Backend entry (``Capabilities.transposed_data``): the native pull of a planned
    transpose reads values given in the planned orientation's order through ``t_perm``
    (each chunk of rows puts its own values in order first)."""
    return platform == "cpu" and view.transposed and runs(view, x_dtype, data_dtype, out_dtype)


def takes_heads(view: Structure, platform, x_dtype, data_dtype, out_dtype) -> bool:
    """Backend entry (``Capabilities.heads``): the native pull takes ``H`` values per
    entry (one per block of features, in one pass over each row) for the views it pulls
    in CSR order: general views (their planned transposes too) and sorted segment ids."""
    entries_by_row = not view.one_per_row and (not view.one_per_column or view.sorted_ids)
    return platform == "cpu" and entries_by_row and runs(view, x_dtype, data_dtype, out_dtype)


def divides_means(view: Structure, platform, x_dtype, data_dtype, out_dtype, n_features) -> bool:
    """Backend entry (``Capabilities.mean``): the products the native pull or push runs
    (:func:`choose`) take ``reduce="mean"``: the pull sums each block of rows in float32
    in cache, the push its float32 partials (or the output itself), and each row is
    multiplied by the reciprocal of its entry count as it is rounded into the output,
    which saves the float32 ``(m, F)`` sums and XLA's pass over them (the same bits as
    that pass). XLA's scatter and the row gather do not divide."""
    dtype = product_dtype(x_dtype, data_dtype)
    return (
        platform == "cpu"
        and runs(view, x_dtype, data_dtype, out_dtype)
        and choose(view, n_features, dtype.itemsize).kernel in ("pull", "push")
    )


def product(
    x, data, view: Structure, cpu_plan, *, reduce, out_dtype, interpret, platform,
    feature_major=False, data_transposed=False,
):  # fmt: skip
    """Backend entry: the viewed matrix times ``x`` with ``reduce``, natively. With
    ``feature_major``, ``x`` is ``(F, n)`` and the result ``(F, m)``: every kernel
    reads and writes that layout as it is. ``data_transposed`` comes only where
    :func:`reads_transposed_data` said yes, values ``(nnz, H)`` only where
    :func:`takes_heads` did, ``reduce="mean"`` only where :func:`divides_means` did."""
    del cpu_plan, interpret
    data_dtype = None if data is None else data.dtype
    if platform != "cpu" or not runs(view, x.dtype, data_dtype, out_dtype):
        out = xla.product(
            x.T if feature_major else x, data, view, None, reduce=reduce,
            out_dtype=out_dtype, interpret=False, platform=platform,
        )  # fmt: skip
        return out.T if feature_major else out
    dtype = product_dtype(x.dtype, data_dtype)
    x = x.astype(dtype)
    m = view.shape[0]
    result = jax.ShapeDtypeStruct((x.shape[0], m) if feature_major else (m, x.shape[1]), out_dtype)
    none = jnp.zeros((0,), dtype)
    attrs = {"max_threads": np.int64(_MAX_THREADS), "feature_major": np.int64(feature_major)}
    mean = reduce == "mean"
    if mean:
        assert divides_means(view, platform, x.dtype, data_dtype, out_dtype, x.shape[1])
        reduce = "sum"
    reduction = np.int64(_REDUCE[reduce])
    if data is not None and data.ndim == 2:  # heads: the pull in CSR order only
        assert not feature_major and takes_heads(view, platform, x.dtype, data.dtype, out_dtype)
    width = x.shape[0] if feature_major else x.shape[1]
    chosen = choose(view, width, dtype.itemsize, feature_major, reduce)
    if chosen.kernel == "xla":  # narrow rows: a row gather, a one-piece sum
        return xla.product(
            x, data, view, None, reduce=reduce, out_dtype=out_dtype, interpret=False,
            platform=platform,
        )  # fmt: skip
    if view.one_per_row:  # y[i] = data_i * x[col_i]: a row gather, no reduction
        values = none if data is None else view.row_values(data).astype(dtype)
        call = jax.ffi.ffi_call("jaxcsr_cpu_gather", result)
        cols = view.row_of_col.astype(jnp.int32)  # empty rows (past n, padded: < 0): 0
        stream = np.int64(profile().stream_bytes)
        return call(cols, values, x, stores=np.int64(_GATHER_STORES), stream_bytes=stream, **attrs)
    if chosen.kernel == "push":
        values = none if data is None else view.column_values(data).astype(dtype)
        call = jax.ffi.ffi_call("jaxcsr_cpu_push", result)
        # a sum reads no row pointer (its empty rows keep the fill, 0): none is passed,
        # so traced ids pay for none (XLA drops the unread counts and their scan); a
        # mean reads its rows' entry counts there
        indptr = view.indptr if reduce != "sum" or mean else jnp.zeros((0,), jnp.int32)
        ids, flag = view.row_of_col, np.int64(mean)
        return call(indptr, ids, values, x, reduce=reduction, mean=flag, **attrs)
    values = none if data is None else data.astype(dtype).reshape(-1)
    heads = 1 if data is None or data.ndim == 1 else data.shape[1]
    indptr = view.view_indptr()
    if view.one_per_column and view.sorted_ids:  # entry k is column k
        cols = jnp.zeros((0,), jnp.int32)
    else:
        cols = view.view_indices()
    # data_transposed: the view is a planned transpose, entry j's value is data[t_perm[j]]
    perm = view.t_perm.astype(jnp.int32) if data_transposed else jnp.zeros((0,), jnp.int32)
    call = jax.ffi.ffi_call("jaxcsr_cpu_pull", result)
    indices = (indptr.astype(jnp.int32), cols.astype(jnp.int32))
    heads, mean = np.int64(heads), np.int64(mean)
    return call(*indices, values, perm, x, reduce=reduction, heads=heads, mean=mean, **attrs)


def sddmm(ct, x, view: Structure, *, out_dtype):
    """Backend entry: ``ct (m, H, F)`` and ``x (n, H, F)`` at the view's stored entries,
    ``(nnz, H)`` in its CSR order (the values' gradient), every head in one native pass:
    per row for general views (``ct[r]`` read once per row), per entry in input order
    for one-per-column views (then put in CSR order), per row for one-per-row views.
    Other dtypes run the fallback's."""
    dtype = product_dtype(ct.dtype, x.dtype)  # the dtype runs() checks
    if not runs(view, ct.dtype, x.dtype, out_dtype):
        return xla.sddmm(ct, x, view, out_dtype=out_dtype)
    heads = ct.shape[1]
    ct = ct.astype(dtype).reshape(ct.shape[0], -1)
    x = x.astype(dtype).reshape(x.shape[0], -1)
    empty = jnp.zeros((0,), jnp.int32)
    attrs = {"max_threads": np.int64(_MAX_THREADS)}
    call = functools.partial(jax.ffi.ffi_call, "jaxcsr_cpu_sddmm", vmap_method="sequential")
    if view.one_per_column:  # per column k (input order): ct[ids[k]] . x[k]
        rows = view.row_of_col.astype(jnp.int32)  # empty columns, dropped ids: 0
        out = jax.ShapeDtypeStruct((rows.shape[0], heads), out_dtype)
        per_column = call(out)(empty, rows, empty, ct, x, **attrs)
        return per_column if view.sorted_ids else per_column[view.indices]
    if view.one_per_row:  # per row i: ct[i] . x[col_of_row[i]]
        cols = jnp.minimum(view.column_rows(), x.shape[0] - 1).astype(jnp.int32)
        out = jax.ShapeDtypeStruct((view.shape[0], heads), out_dtype)
        per_row = call(out)(empty, empty, cols, ct, x, **attrs)
        return view.compact_rows(per_row)
    out = jax.ShapeDtypeStruct((view.nnz, heads), out_dtype)
    indptr = view.view_indptr().astype(jnp.int32)
    cols = view.view_indices().astype(jnp.int32)
    return call(out)(indptr, empty, cols, ct, x, **attrs)


def softmax(x, g, view: Structure, *, out_dtype, fallback):
    """Backend entry: the softmax of ``x`` (``(n, H)``) over the rows of the
    one-per-column ``view``, or with ``g`` its tangent from the output ``x``, natively;
    ``fallback()`` for dtypes the kernels do not take.

    Entries sorted by row (``edge_softmax``'s pattern, sorted segment ids) run one
    row at a time while it is in cache, each shifted by its own max (no unshifted
    fast path, no ``lax.cond``). Unsorted segment ids run pushes that stream ``x`` in
    input order: the rows' sums of ``exp(x)``, kept when every non-empty row's sum is
    within the XLA path's fast-path bounds (:func:`jaxcsr.softmax.fast_path_safe`),
    else shifted by the rows' maxima (a push first), then the scaling, entry by entry.
    Every row is reduced in one order fixed by the sizes: bit-identical for any
    thread count."""
    dtype = x.dtype if g is None else product_dtype(x.dtype, g.dtype)
    if not (runs(view, dtype, None, out_dtype) and view.one_per_column):
        return fallback()
    x = x.astype(dtype)
    g = jnp.zeros((0,), dtype) if g is None else g.astype(dtype)
    # sorted: the row pointer; unsorted: the row of every entry as given (a padded
    # layout's dropped ids outside [0, m) belong to no row), no row pointer (one planned
    # on the device would cost a pass over the ids)
    none = jnp.zeros((0,), jnp.int32)
    if view.sorted_ids:
        indptr, ids = view.indptr, none
    else:
        indptr, ids = none, view.row_of_col.astype(jnp.int32)
    call = jax.ffi.ffi_call("jaxcsr_cpu_softmax", jax.ShapeDtypeStruct(x.shape, out_dtype))
    attrs = {"max_threads": np.int64(_MAX_THREADS), "rows": np.int64(view.shape[0])}
    return call(indptr, ids, x, g, **attrs)


def _arg_operands(x, data, out):
    """``x``, ``data`` (empty: none) and ``out`` in the product dtype, the kernels'."""
    dtype = product_dtype(x.dtype, None if data is None else data.dtype)
    data = jnp.zeros((0,), dtype) if data is None else data.astype(dtype)
    return x.astype(dtype), data, out.astype(dtype)


def _native_search(x, data, view: Structure) -> bool:
    return runs(view, x.dtype, None if data is None else data.dtype, x.dtype)


def _search(indptr, index, data, x, out) -> jax.Array:
    """The search kernel: ``(m, F)`` int32 (a row pointer: CSR positions; none, and
    ``index`` the row of each column: first columns)."""
    call = jax.ffi.ffi_call(
        "jaxcsr_cpu_arg_search", jax.ShapeDtypeStruct(out.shape, jnp.int32),
        vmap_method="sequential",
    )  # fmt: skip
    return call(indptr, index, data, x, out, max_threads=np.int64(_MAX_THREADS))


def _first_columns(x, data, view: Structure, out) -> jax.Array:
    """One-per-column view: ``(m, F)`` the first column (input order) attaining each
    output, ``n`` where none does."""
    x, data, out = _arg_operands(x, data, out)
    if data.size:
        data = view.column_values(data)
    none = jnp.zeros((0,), jnp.int32)
    return _search(none, view.row_of_col.astype(jnp.int32), data, x, out)


def arg_positions(x, data, view: Structure, out) -> jax.Array:
    """Backend entry (:class:`~jaxcsr.kernels.ArgSearch`): ``(m, F)`` CSR positions of
    the entries attaining ``out`` (first in CSR order; ``nnz`` for empty rows), natively
    for general views, by rows over the threads; the fallback's otherwise."""
    if view.one_per_column or view.one_per_row or not _native_search(x, data, view):
        return xla.extreme_positions(x, data, view, out)
    x, data, out = _arg_operands(x, data, out)
    indptr = view.view_indptr().astype(jnp.int32)
    return _search(indptr, view.view_indices().astype(jnp.int32), data, x, out)


def arg_columns(x, data, view: Structure, out) -> jax.Array:
    """Backend entry: ``(m, F)`` columns attaining ``out`` (``n`` for empty rows):
    one-per-column views search their columns in input order, natively (pieces of
    consecutive columns over the threads, combined by their minimum); general views
    map :func:`arg_positions` to columns."""
    if view.one_per_row or not _native_search(x, data, view):
        return xla.extreme_columns(x, data, view, out)
    if view.one_per_column:
        return _first_columns(x, data, view, out)
    position = arg_positions(x, data, view, out)
    columns = jnp.append(view.view_indices().astype(jnp.int32), jnp.int32(view.shape[1]))
    return columns[position]


def put_attaining(ct, columns, rows) -> jax.Array:
    """Backend entry (:class:`~jaxcsr.kernels.ArgSearch`): the max/min gradient's
    ``(n, F)`` put of ``ct`` at the attaining columns of a one-per-column view, in one
    pass over the threads (values copied as bits: 2- and 4-byte dtypes); the
    fallback's for other dtypes."""
    if not available() or jnp.dtype(ct.dtype).itemsize not in (2, 4):
        return xla.put_attaining(ct, columns, rows)
    out = jax.ShapeDtypeStruct((rows.shape[0], ct.shape[1]), ct.dtype)
    call = jax.ffi.ffi_call("jaxcsr_cpu_put_attaining", out, vmap_method="sequential")
    return call(
        rows.astype(jnp.int32), columns.astype(jnp.int32), ct, max_threads=np.int64(_MAX_THREADS)
    )
