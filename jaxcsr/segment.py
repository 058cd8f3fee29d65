"""Segment reductions with ``jax.ops.segment_*`` signatures, on a planned matrix.

Each function builds the one-valued matrix ``A = CSRMatrix.from_indices(segment_ids,
num_segments)`` and computes ``matmul(A, data, reduce=...)``. The ids may be

* **concrete** (a numpy array, or a JAX array outside ``jax.jit`` / closed over):
  planned on the host once and cached by the ids' value (:func:`segment_matrix`), so
  calling again with equal ids -- eagerly, or when a jitted function is retraced --
  plans nothing. Finding the matrix costs a hash of the ids on every *eager* call:
  in an eager loop, build the matrix once and call ``matmul(A, data)``.
* **traced** (a new graph at every step: jraph's ``receivers``, a padded batch):
  planned on the device inside the trace (:mod:`jaxcsr.device_plan`), with
  ``indices_are_sorted=True`` skipping the sort, and one compilation per padded
  size. ``num_segments`` must be a Python int.

By default every function behaves as its ``jax.ops`` namesake: out-of-range and
negative ids are dropped (:data:`MODES`), empty segments of max/min hold the dtype's
identity. Additions (``docs/migration.md``): ``mode="check"`` raises on out-of-range
concrete ids, ``empty=`` sets max/min's empty value, ``return_arg`` returns the
attaining positions, and ``axis`` picks the segmented axis of ``data``; ``axis=-1``
is the last-axis scatter ``data @ A.T``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcsr import device_plan, kernels, plan
from jaxcsr.dtypes import accumulation_dtype
from jaxcsr.matrix import CSRMatrix, SparseOperand, matmul
from jaxcsr.softmax import shifted_exp, softmax_over_rows
from jaxcsr.take_attaining import first_attaining, take_attaining
from jaxcsr.validation import (
    as_host_int_array,
    as_numeric,
    check_segment_ids,
    check_size,
    check_traced_ids,
    is_traced,
)

__all__ = ["MODES", "segment_matrix", "segment_sum", "segment_mean", "segment_max", "segment_min"]
__all__ += ["segment_prod"]
__all__ += ["segment_softmax", "segment_log_softmax", "segment_logsumexp"]

Size = int | None  # num_segments, bucket_size: None means "from the data"
Mode = str | None
Impl = str | None

MODES: tuple[Mode, ...] = (None, "promise_in_bounds", "drop", "fill", "clip", "check")
"""Accepted ``mode`` values, as in ``jax.ops`` plus ``"check"``. ``None`` (the
default), ``"drop"``, ``"fill"`` and ``"promise_in_bounds"`` leave out entries whose
id is negative or ``>= num_segments``, concrete or traced, as ``jax.ops`` does;
``"clip"`` clips ids into ``[0, num_segments)``; ``"check"`` raises ``ValueError``
naming the first out-of-range id (concrete ids only: traced ids cannot be checked
at trace time)."""

_xla_segment_prod = jax.ops.segment_prod
"""XLA's scatter-multiply, bound at import (a caller may swap ``jax.ops``' functions
for jaxcsr's, as the upstream conformance runs do)."""

CACHE_SIZE = 64
"""Most matrices :func:`segment_matrix` keeps (least recently used are evicted)."""

_cache: collections.OrderedDict[tuple, CSRMatrix] = collections.OrderedDict()
_cache_lock = threading.Lock()


def _host_ids(segment_ids: Any, num_segments: Size) -> tuple[np.ndarray, int]:
    """Concrete ids as a 1-D host array, and ``num_segments`` (``None``: ``max + 1``)."""
    ids = as_host_int_array(segment_ids, "segment_ids")
    if ids.ndim != 1:
        raise ValueError(f"segment_ids must be 1-D, got shape {ids.shape}")
    if num_segments is None:
        num_segments = int(ids.max()) + 1 if ids.size else 0
    return ids, check_size(num_segments, "num_segments")


def _traced_ids(segment_ids, num_segments, mode) -> tuple[jax.Array, int]:
    """Traced ids checked at trace time (clipped for ``mode="clip"``), and
    ``num_segments``, which must be given."""
    ids = check_traced_ids(segment_ids, "segment_ids")
    if mode == "check":
        raise ValueError(
            "mode='check' needs concrete segment_ids: traced ids are not known until "
            "the computation runs (the other modes drop or clip out-of-range ids)"
        )
    if num_segments is None:
        raise TypeError(
            "num_segments must be given (a Python int) when segment_ids are traced: "
            "it sets the output shape"
        )
    num_segments = check_size(num_segments, "num_segments")
    if mode == "clip" and num_segments > 0:
        ids = jnp.clip(ids, 0, num_segments - 1)
    return ids, num_segments


def _traced_matrix(segment_ids, num_segments, mode, backends, sorted_ids: bool) -> CSRMatrix:
    """The device-planned matrix of traced ids (no cache: planned in every trace)."""
    ids, num_segments = _traced_ids(segment_ids, num_segments, mode)
    return CSRMatrix.from_indices(
        ids, num_segments, backends=backends, indices_are_sorted=sorted_ids
    )


@dataclasses.dataclass(frozen=True)
class _SortedOrNot:
    """Traced ids given with ``indices_are_sorted=True``: ``jax.ops``' flag promises
    sorted ids, dropped ones at either end (``-1`` padding sorts first), and on CPU
    ``jax.ops`` is right even when they are not sorted. The plan that skips the sort
    needs more (dropped ids at the end), so both plans are built and :func:`_on_plan`
    runs the first where ``holds`` (one pass over the ids), else the sorted one. XLA
    removes whichever arrays the branch that runs does not read."""

    promised: CSRMatrix
    planned: CSRMatrix
    holds: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return self.promised.shape


def _sorted_or_not(segment_ids, num_segments, mode, backends) -> _SortedOrNot:
    """Both plans of traced ids given as sorted, and the device's test of the promise
    the plan without the sort needs (the ids checked and clipped once, for both)."""
    ids, m = _traced_ids(segment_ids, num_segments, _mode_argument(mode))
    planned = functools.partial(CSRMatrix.from_indices, ids, m, backends=backends)
    holds = device_plan.sorted_promise_holds(ids, m)
    return _SortedOrNot(planned(indices_are_sorted=True), planned(), holds)


def _dropped_as_minus_one(ids: Any, num_segments: int) -> Any:
    """``ids`` (host or traced) with every id outside ``[0, num_segments)`` as ``-1``,
    in the narrowest index dtype: an int64 id past int32 must not wrap into range when
    it is narrowed (on its way to the device without x64; in XLA's scatter under x64,
    as ``jax.ops.segment_prod`` wraps it)."""
    xp = np if isinstance(ids, np.ndarray) else jnp
    keep = (ids >= 0) & (ids < num_segments)
    return xp.where(keep, ids, -1).astype(plan.index_dtype_for(ids.size, num_segments))


def _on_plan(A: CSRMatrix | _SortedOrNot, body, *operands):
    """``body(A, *operands)``; for :class:`_SortedOrNot`, on the plan that is right for
    the ids, chosen on the device (``lax.cond``; under ``vmap`` of the ids, both)."""
    if not isinstance(A, _SortedOrNot):
        return body(A, *operands)
    return jax.lax.cond(
        A.holds,
        lambda *args: body(A.promised, *args),
        lambda *args: body(A.planned, *args),
        *operands,
    )


def segment_order(segment_ids: Any, num_segments: int | None = None) -> np.ndarray:
    """The edge permutation that sorts ``segment_ids`` (stable), for static graphs.

    Reorder every per-edge array once, at load time (``ids[perm]``, ``senders[perm]``,
    edge features ``[perm]``): products over sorted ids read their values in order
    (on CPU: one pass, no scatter) and ``segment_sum(..., indices_are_sorted=True)``
    holds. Host-side (numpy), concrete ids only.

    Args:
      segment_ids: 1-D integer ids (host array).
      num_segments: as in :func:`segment_sum` (``None``: ``max + 1``); ids must lie
        in ``[0, num_segments)``.

    Returns:
      ``perm``, an int64 permutation of ``range(len(segment_ids))`` with
      ``segment_ids[perm]`` non-decreasing and equal ids in input order.

    Example:
      >>> import numpy as np
      >>> ids = np.array([2, 0, 2, 1, 0])
      >>> perm = segment_order(ids)
      >>> perm.tolist(), ids[perm].tolist()
      ([1, 4, 3, 0, 2], [0, 0, 1, 2, 2])
    """
    if is_traced(segment_ids):
        raise TypeError("segment_ids must be concrete: segment_order runs on the host, once")
    ids, num_segments = _host_ids(segment_ids, num_segments)
    ids, num_segments = check_segment_ids(ids, num_segments, names=("segment_ids", "num_segments"))
    _, order = plan.segment_ids_to_csr(ids, num_segments)
    return order.astype(np.int64)


def segment_matrix(
    segment_ids: Any,
    num_segments: int | None = None,
    mode: str | None = None,
    *,
    backends: Any = None,
    indices_are_sorted: bool = False,
) -> CSRMatrix:
    """The one-valued ``(num_segments, len(segment_ids))`` matrix, cached by value.

    Args:
      segment_ids: 1-D integer array. Concrete ids are planned on the host and the
        matrix is cached by their value; traced ids are planned on the device in
        the trace (not cached). Out-of-range ids are dropped (see :data:`MODES`).
      num_segments: number of segments; ``None`` means ``max(segment_ids) + 1``
        (0 for no ids), as in ``jax.ops`` (concrete ids only).
      mode: one of :data:`MODES`.
      backends: backends to plan for (see :class:`~jaxcsr.CSRMatrix`); part of the
        cache key.
      indices_are_sorted: traced ids only, a promise that skips the device sort
        (see :meth:`~jaxcsr.CSRMatrix.from_indices`); concrete ids are checked.

    Returns:
      A :class:`~jaxcsr.CSRMatrix` ``A`` with ``A[segment_ids[j], j] = 1`` (entries
      with dropped ids left out).

    Raises:
      ValueError: non-1-D ids, out-of-range ids with ``mode="check"`` (or traced ids
        with it), negative ``num_segments``, unknown ``mode``.
      TypeError: non-integer ids or ``num_segments``; a traced ``num_segments``, or
        none with traced ids.
    """
    mode = _mode_argument(mode)
    if is_traced(segment_ids):
        return _traced_matrix(segment_ids, num_segments, mode, backends, indices_are_sorted)
    ids, num_segments = _host_ids(segment_ids, num_segments)  # before the cache: 2.0 != 2
    backends = kernels.resolve_backends(backends)
    names = ("segment_ids", "num_segments")
    digest = hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()
    key = (digest, ids.dtype.str, ids.size, num_segments, mode, backends)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    if mode == "clip" and num_segments > 0:
        ids = np.clip(ids, 0, num_segments - 1)
    keep = (ids >= 0) & (ids < num_segments)
    if mode != "check" and not keep.all():  # jax.ops: out-of-range entries are left out
        kept, num_segments = check_segment_ids(ids[keep], num_segments, names=names)
        shape = (num_segments, ids.size)
        # checked once, here: the kept ids are in range, their positions are columns
        positions = np.flatnonzero(keep)
        matrix = CSRMatrix._from_checked_coo(kept, positions, shape, None, backends)
    else:
        ids, num_segments = check_segment_ids(ids, num_segments, names=names)
        # checked once, here: the matrix trusts them
        matrix = CSRMatrix._from_checked_ids(ids, num_segments, None, backends)
    with _cache_lock:
        _cache[key] = matrix
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return matrix


def _ids_argument(segment_ids: Any) -> Any:
    """Traced ids as given; anything else as a host integer array (a ragged list or a
    matrix raises a ``TypeError`` naming ``segment_ids``)."""
    if is_traced(segment_ids):
        return segment_ids
    return as_host_int_array(segment_ids, "segment_ids")


def _mode_argument(mode: Any) -> Mode:
    """``mode`` as one of :data:`MODES`; ``jax.lax.GatherScatterMode`` members, which
    ``jax.ops`` also accepts, name theirs."""
    if isinstance(mode, jax.lax.GatherScatterMode):
        named = {
            jax.lax.GatherScatterMode.CLIP: "clip",
            jax.lax.GatherScatterMode.FILL_OR_DROP: "drop",
            jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS: "promise_in_bounds",
        }
        if mode not in named:
            raise ValueError(f"mode {mode} has no segment reduction; use one of {MODES}")
        return named[mode]
    if mode not in MODES:
        raise ValueError(
            f"mode must be one of {MODES} or a jax.lax.GatherScatterMode, got {mode!r}"
        )
    return mode


def _check_axis(data: jax.Array, axis: int) -> int:
    if data.ndim == 0:
        raise ValueError("data must have rank >= 1, got a scalar (shape ())")
    if not isinstance(axis, int | np.integer) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not -data.ndim <= axis < data.ndim:
        raise ValueError(f"axis {axis} is out of bounds for data of rank {data.ndim}")
    return int(axis) % data.ndim


def _backends_for(impl: str | None) -> tuple[str, ...] | None:
    """Backends a segment function plans: the defaults, plus a kernel ``impl`` asks for."""
    if impl is None or impl not in kernels.BACKENDS:
        return None  # an unknown impl is rejected by matmul, naming impl
    return (*kernels.default_backends(), impl)


def _prepare(
    data: Any,
    segment_ids: Any,
    num_segments,
    mode,
    axis,
    impl=None,
    *,
    name: str = "data",
    floating: bool = False,
    sorted_ids: bool = False,
) -> tuple:
    """Validates (dtype first, before any planning), plans, and moves ``axis`` first.
    ``name`` is what errors call ``data``; ``floating`` asks for a floating dtype;
    ``sorted_ids`` is ``indices_are_sorted`` (traced ids: a :class:`_SortedOrNot`). Like
    ``jax.ops``, a 0-d ``data`` (or a length-1 leading axis) is broadcast to every id."""
    segment_ids = _ids_argument(segment_ids)
    data, axis = _checked_data(data, segment_ids, axis, name, floating)
    backends = _backends_for(impl)
    A: CSRMatrix | _SortedOrNot
    if sorted_ids and is_traced(segment_ids):
        A = _sorted_or_not(segment_ids, num_segments, mode, backends)
    else:
        A = segment_matrix(segment_ids, num_segments, mode, backends=backends)
    _check_length(data, axis, A.shape[1])
    return A, jnp.moveaxis(data, axis, 0), axis


def _checked_data(
    data: Any, segment_ids: Any, axis: Any, name: str = "data", floating: bool = False
) -> tuple[jax.Array, int]:
    """``data`` checked (dtype first), broadcast to one row per id where ``jax.ops``
    broadcasts it, and its checked ``axis``."""
    data = as_numeric(data, name, floating=floating)
    data = _broadcast_to_ids(data, segment_ids, axis)
    return data, _check_axis(data, axis)


def _check_length(data: jax.Array, axis: int, num_ids: int) -> None:
    if data.shape[axis] != num_ids:
        raise ValueError(
            f"data.shape[{axis}] must equal len(segment_ids) = {num_ids}, "
            f"got data.shape = {data.shape}"
        )


def _broadcast_to_ids(data: jax.Array, segment_ids: Any, axis: Any) -> jax.Array:
    """``data`` broadcast to one row per id where ``jax.ops`` broadcasts it: 0-d, or a
    leading axis of length 1 (``axis=0`` only)."""
    if np.ndim(segment_ids) != 1 or axis != 0:
        return data
    num_ids = np.shape(segment_ids)[0]
    if data.ndim == 0 or data.shape[0] == 1 != num_ids:
        return jnp.broadcast_to(data, (num_ids, *data.shape[1:]))
    return data


def _dtype_of(value: Any) -> np.dtype:
    """``value``'s dtype without converting a (possibly traced) array; ``object`` for
    what numpy cannot convert (the argument checks then name it)."""
    if hasattr(value, "dtype") and not isinstance(value, SparseOperand):
        return np.dtype(value.dtype)
    try:
        return np.asarray(value).dtype
    except (TypeError, ValueError):
        return np.dtype(object)


def _nonempty(A: CSRMatrix, ndim: int) -> jax.Array:
    """Rows of ``A`` with an entry, shaped to broadcast against ``ndim``-d results."""
    return (A.structure.degrees() > 0).reshape((-1,) + (1,) * (ndim - 1))


def _identity(dtype, reduce: str) -> Any:
    """``jax.ops``' value for an empty segment of max (the dtype's lowest) or min."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return reduce == "min"
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.max if reduce == "min" else info.min
    return np.inf if reduce == "min" else -np.inf


def _scatter_sum(x: jax.Array, ids: jax.Array, num_segments: int, sorted_ids: bool):
    """XLA's scatter-add of ``x`` (ids first) as ``jax.ops.segment_sum`` runs it:
    out-of-range ids dropped (negative ones too; clipped first for ``mode="clip"``;
    int64 ids narrowed by :func:`_scatter_on_cpu`), and the sum carried in
    :func:`~jaxcsr.dtypes.accumulation_dtype` (float32 for 16-bit floats), as every
    jaxcsr path does."""
    wide = x.astype(accumulation_dtype(x.dtype))
    out = jnp.zeros((num_segments, *x.shape[1:]), wide.dtype)
    out = out.at[ids].add(
        wide, mode="drop", indices_are_sorted=sorted_ids, wrap_negative_indices=False
    )
    return out.astype(x.dtype)


def _scatter_extreme(
    x: jax.Array, ids: jax.Array, num_segments: int, sorted_ids: bool, reduce: str
) -> jax.Array:
    """XLA's scatter-max/min of ``x (n, F)``, as ``jax.ops.segment_max``/``min`` run it:
    out-of-range ids dropped, empty segments at the dtype's identity."""
    out = jnp.full((num_segments, *x.shape[1:]), _identity(x.dtype, reduce), x.dtype)
    at = out.at[ids]
    scatter = at.max if reduce == "max" else at.min
    return scatter(x, mode="drop", indices_are_sorted=sorted_ids, wrap_negative_indices=False)


def _first_attaining(x, ids, out, sorted_ids: bool) -> jax.Array:
    """``(m, F)`` int32: the first position (in input order) of each segment whose
    value is ``out`` (NaN matches NaN), ``n`` where the segment is empty: jaxcsr's
    ``return_arg``, and where the gradient of max/min goes."""
    n, m = x.shape[0], out.shape[0]
    target = out[jnp.clip(ids, 0, max(m - 1, 0))]
    return first_attaining(x, target, ids, m, sorted_ids=sorted_ids, empty=n)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _scattered_extreme(x, ids, num_segments: int, sorted_ids: bool, reduce: str):
    """:func:`_scatter_extreme` of floating ``x (n, F)`` whose tangent is taken at
    :func:`_first_attaining` (one position per output element, as every jaxcsr path);
    its transpose puts the cotangent back in one masked gather, no scatter."""
    return _scatter_extreme(x, ids, num_segments, sorted_ids, reduce)


@_scattered_extreme.defjvp
def _scattered_extreme_jvp(num_segments, sorted_ids, reduce, primals, tangents):
    x, ids = primals
    out = _scatter_extreme(x, ids, num_segments, sorted_ids, reduce)
    first = _first_attaining(x, ids, out, sorted_ids)
    rows = jnp.where((ids >= 0) & (ids < num_segments), ids, num_segments)
    put = kernels.fallback().capabilities.arg_search.put_attaining
    return out, take_attaining(tangents[0], first, rows, put=put)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5))
def _scattered_value(x, ids, num_segments: int, sorted_ids: bool, reduce: str, planned):
    """XLA's scatter (:func:`_scatter_sum`, :func:`_scatter_extreme`) whose tangent is
    the planned product's (``planned(x, ids)``, the same function), so that its
    backward is the plan's gather. A max/min: the scatter where only the value is
    needed, the plan and its masked gather where a gradient is. A sum, linear: the
    scatter's value and the plan's tangent, whose transpose is the native row gather
    (its row pointer unread, so never built)."""
    if reduce == "sum":
        return _scatter_sum(x, ids, num_segments, sorted_ids)
    return _scatter_extreme(x, ids, num_segments, sorted_ids, reduce)


@_scattered_value.defjvp
def _scattered_value_jvp(num_segments, sorted_ids, reduce, planned, primals, tangents):
    x, ids = primals
    if reduce == "sum":
        return _scatter_sum(x, ids, num_segments, sorted_ids), planned(tangents[0], ids)
    return jax.jvp(lambda x: planned(x, ids), (x,), (tangents[0],))


def _scatter_on_cpu(x, ids, num_segments, sorted_ids, reduce, return_arg, fill, planned):
    """:func:`_reduce`'s XLA scatter for ``x (n, F)``: a sum, or a max/min with its
    arg and ``fill`` (``None``: the identity) in empty segments; a max/min's gradient
    scatters too where :func:`kernels.traced_scatters_on_cpu` says so, else it is the
    ``planned`` product's."""
    if ids.dtype.itemsize > 4:  # XLA's CPU scatter would wrap int64 ids into range
        ids = _dropped_as_minus_one(ids, num_segments)
    if reduce == "sum":
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return _scatter_sum(x, ids, num_segments, sorted_ids)
        # its backward: the plan's row gather (native where that is faster)
        return _scattered_value(x, ids, num_segments, sorted_ids, reduce, planned)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        out = _scatter_extreme(x, ids, num_segments, sorted_ids, reduce)
    elif kernels.traced_scatters_on_cpu(reduce, *x.shape, x.dtype, gradient=True):
        out = _scattered_extreme(x, ids, num_segments, sorted_ids, reduce)
    else:
        out = _scattered_value(x, ids, num_segments, sorted_ids, reduce, planned)
    if not return_arg and fill is None:
        return out
    first = _first_attaining(jax.lax.stop_gradient(x), ids, jax.lax.stop_gradient(out), sorted_ids)
    if fill is not None:
        out = jnp.where(first < x.shape[0], out, fill.astype(out.dtype))
    return (out, first) if return_arg else out


def _traced_on_cpu(data, segment_ids, num_segments, sorted_ids, mode, axis, reduce, return_arg,
                   empty):  # fmt: skip
    """A traced segment sum, max or min whose CPU lowering scatters
    (:func:`kernels.traced_scatters_on_cpu`; every other platform plans as usual),
    or ``None`` where the rule keeps the plan."""
    data, axis = _checked_data(data, segment_ids, axis)
    if data.dtype == np.bool_:
        return None  # the planned path reduces booleans (or names the error)
    x = jnp.moveaxis(data, axis, 0)
    rest = x.shape[1:]
    width = int(np.prod(rest))
    ids, m = _traced_ids(segment_ids, num_segments, _mode_argument(mode))
    if not kernels.traced_scatters_on_cpu(reduce, x.shape[0], width, x.dtype, num_segments=m):
        return None
    _check_length(x, 0, ids.shape[0])
    if m == 0 or x.shape[0] == 0:
        return None  # the planned path's constant result
    fill = None
    if reduce != "sum" and empty is not None:
        fill = _empty_value(x.dtype, reduce, empty)
    x = x.reshape(x.shape[0], width)

    def planned(x, ids, return_arg=return_arg, empty=empty):
        return _reduce(x, ids, m, sorted_ids, None, 0, return_arg, None, reduce, empty,
                       plan_only=True)  # fmt: skip

    def scattered(x, ids):
        value = functools.partial(planned, return_arg=False, empty=None)
        return _scatter_on_cpu(x, ids, m, sorted_ids, reduce, return_arg, fill, value)

    result = jax.lax.platform_dependent(x, ids, cpu=scattered, default=planned)
    out, arg = result if return_arg else (result, None)
    out = jnp.moveaxis(out.reshape(m, *rest), 0, axis)
    if not return_arg:
        return out
    return out, jnp.moveaxis(arg.reshape(m, *rest), 0, axis)


def _reduce(data, segment_ids, num_segments, sorted_ids, mode, axis, return_arg, impl, reduce,
            empty=0, plan_only=False):  # fmt: skip
    """The one body of every ``segment_<reduce>``: plan, then ``matmul``; empty segments
    of max/min hold ``empty`` (``None``: the dtype's identity, as ``jax.ops``).
    Boolean data (max/min only) is reduced as integers (max: any; min: all) and
    given back as bool. (``unique_indices`` and ``bucket_size`` are not needed: the plan knows.)"""
    scatters = reduce in ("sum", "max", "min") and not (reduce == "sum" and return_arg)
    if scatters and impl is None and not plan_only and is_traced(segment_ids):
        result = _traced_on_cpu(data, segment_ids, num_segments, sorted_ids, mode, axis, reduce,
                                return_arg, empty)  # fmt: skip
        if result is not None:
            return result
    boolean = _dtype_of(data) == np.bool_
    if boolean:
        if reduce not in ("max", "min"):  # jax.ops rejects bool sums too
            raise TypeError(f"data must have a numeric dtype for segment_{reduce}, got bool")
        data = jnp.asarray(data, jnp.int32)
    A, x, axis = _prepare(data, segment_ids, num_segments, mode, axis, impl, sorted_ids=sorted_ids)
    fill = None
    if reduce in ("max", "min"):
        fill = _empty_value(jnp.bool_ if boolean else x.dtype, reduce, empty)

    def body(A: CSRMatrix, x: jax.Array):
        result = matmul(A, x, reduce=reduce, return_arg=return_arg, impl=impl)
        out, arg = result if return_arg else (result, None)
        if fill is not None:
            out = jnp.where(_nonempty(A, out.ndim), out, fill.astype(out.dtype))
        return (out, arg) if return_arg else out

    result = _on_plan(A, body, x)
    out, arg = result if return_arg else (result, None)
    if boolean:
        out = out > 0
    out = jnp.moveaxis(out, 0, axis)
    return (out, jnp.moveaxis(arg, 0, axis)) if return_arg else out


def _empty_value(dtype, reduce: str, empty: Any) -> Any:
    """The value of an empty max/min segment as a 0-d array of ``dtype``: ``empty``, or
    ``None`` for ``jax.ops``' identity. A concrete ``empty`` that ``dtype`` cannot hold
    exactly (1000 for int8, NaN or 0.5 for integers) raises instead of wrapping; a
    traced one is cast."""
    dtype = np.dtype(dtype)
    if empty is None:
        return np.asarray(_identity(dtype, reduce), dtype)
    if is_traced(empty):
        return jnp.asarray(empty).astype(dtype)
    value = np.asarray(empty)
    if (
        value.ndim != 0
        or value.dtype == object
        or not (value.dtype == np.bool_ or np.issubdtype(value.dtype, np.number))
    ):
        raise TypeError(f"empty must be a number, got {empty!r}")
    if dtype == np.bool_ or np.issubdtype(dtype, np.integer):
        exact = np.isfinite(value) and float(value) == int(value)
        info = (0, 1) if dtype == np.bool_ else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        if not exact or not info[0] <= int(value) <= info[1]:
            raise ValueError(
                f"empty = {empty!r} is not a value of the data's dtype {dtype} "
                f"(an integer in [{info[0]}, {info[1]}])"
            )
        return np.asarray(int(value), dtype)
    return np.asarray(value, dtype)


def _prepare_logits(logits, segment_ids, num_segments, sorted_ids, axis, impl) -> tuple:
    """:func:`_prepare` for the softmax family: no ``mode`` (out-of-range ids dropped:
    probability 0); integer and bool logits promoted to JAX's default float, as
    ``jnp.exp`` promotes them. Returns ``(A, x, axis)``."""
    dtype = _dtype_of(logits)
    if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer):
        logits = jnp.asarray(logits, jnp.result_type(float))
    A, x, axis = _prepare(
        logits,
        segment_ids,
        num_segments,
        None,
        axis,
        impl,
        name="logits",
        floating=True,
        sorted_ids=sorted_ids,
    )
    if isinstance(A, CSRMatrix) and not (
        A.structure.one_per_column and A.structure.nnz == A.shape[1]
    ):
        # concrete ids with some out of range: the host plan left those entries out;
        # the device plan keeps one slot per id (dropped ones in padding), which the
        # fused softmax needs
        ids = _dropped_as_minus_one(np.asarray(segment_ids), A.shape[0])
        A = _planned_on_device(jnp.asarray(ids), num_rows=A.shape[0], backends=A.backends)
    return A, x, axis


_planned_on_device = jax.jit(CSRMatrix.from_indices, static_argnames=("num_rows", "backends"))
"""``from_indices`` of concrete ids through the device planner (out-of-range ids in
padding: one slot per id)."""


def _wide(x: jax.Array) -> jax.Array:
    """Logits in float32 or wider, as the softmax family computes."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# ------------------------------------------------------------ public functions
# The reductions keep jax.ops' signature (plus axis, return_arg, impl), written
# compactly; their shared argument docs are appended at the end. Each is followed by
# its softmax-family counterpart.
_ARGS = """
    Args:
      data: array whose ``axis`` has length ``len(segment_ids)``.
      segment_ids: 1-D integer array of segment ids, concrete (planned on the host,
        cached by value) or traced (planned on the device; see the module docstring
        and :func:`segment_matrix`).
      num_segments: number of segments (a Python int; required for traced ids);
        ``None`` means ``max(segment_ids) + 1``.
      indices_are_sorted: traced ids: the promise that skips the device sort;
        concrete ids: ignored (the host plan checks).
      unique_indices, bucket_size: accepted for signature compatibility with
        ``jax.ops`` and ignored: the plan knows.
      mode: one of :data:`MODES`; the default drops out-of-range and negative
        ids (concrete or traced), as ``jax.ops``; ``"check"`` raises on them.
      axis: the segmented axis of ``data`` (``jax.ops`` always uses 0).
      return_arg: max/min only (``ValueError`` otherwise): also return the position
        along ``axis`` of each extreme (ties: the first position; empty segments:
        ``len(segment_ids)``). Gradients flow to those positions only.
      empty: max/min only: the value of empty segments (default: the dtype's
        identity, as ``jax.ops``).
      impl: forwarded to :func:`jaxcsr.matmul`.
"""


def segment_sum(data: Any, segment_ids: Any, num_segments: Size = None,
                indices_are_sorted: bool = False, unique_indices: bool = False,
                bucket_size: Size = None, mode: Mode = None, *, axis: int = 0,
                return_arg: bool = False, impl: Impl = None) -> Any:  # fmt: skip
    """Sum of ``data`` over segments along ``axis``; empty segments are 0.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> jaxcsr.segment_sum(jnp.arange(5.0), np.array([0, 2, 2, 1, 0]), 4)
      Array([4., 3., 3., 0.], dtype=float32)
    """
    return _reduce(
        data, segment_ids, num_segments, indices_are_sorted, mode, axis, return_arg, impl, "sum"
    )


def segment_softmax(logits: Any, segment_ids: Any, num_segments: Size = None,
                    indices_are_sorted: bool = False, unique_indices: bool = False, *,
                    axis: int = 0, impl: Impl = None) -> jax.Array:  # fmt: skip
    """Softmax of ``logits`` within each segment (GNN attention over incoming edges).

    ``out[j] = exp(x[j] - m) / sum_{i in seg(j)} exp(x[i] - m)`` with ``m`` the
    segment's max (numerically stable). 16-bit inputs are computed in float32 and
    cast back; integer logits give JAX's default float (as jraph's). A segment whose
    logits are all ``-inf`` gives NaN, as ``jax.nn.softmax`` does. Entries with
    out-of-range or negative ids get probability 0. ``unique_indices`` is accepted
    for jraph's signature and ignored. Fused as
    :func:`jaxcsr.edge_softmax` is (one segmented sum forward in the common case, a
    backward that keeps only the output): the segments are the rows of the planned
    ``from_indices`` matrix.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> out = jaxcsr.segment_softmax(jnp.array([0.0, 1.0, 5.0]), np.array([0, 0, 1]), 2)
      >>> [round(float(v), 4) for v in out]
      [0.2689, 0.7311, 1.0]
    """
    A, x, axis = _prepare_logits(logits, segment_ids, num_segments, indices_are_sorted, axis, impl)
    out = _on_plan(A, lambda A, x: softmax_over_rows(x, A, impl, name="logits"), x)
    return jnp.moveaxis(out, 0, axis)


def segment_mean(data: Any, segment_ids: Any, num_segments: Size = None,
                 indices_are_sorted: bool = False, unique_indices: bool = False,
                 bucket_size: Size = None, mode: Mode = None, *, axis: int = 0,
                 return_arg: bool = False, impl: Impl = None) -> Any:  # fmt: skip
    """Mean of ``data`` over segments: the sum, carried in float32 for 16-bit floats,
    divided by the segment's size and rounded once. Empty segments are 0; integers
    floor-divide (as torch_scatter).

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> ids = np.array([0, 2, 2, 1, 0])
      >>> jaxcsr.segment_mean(jnp.arange(5.0), ids, 4)
      Array([2. , 3. , 1.5, 0. ], dtype=float32)
    """
    return _reduce(
        data, segment_ids, num_segments, indices_are_sorted, mode, axis, return_arg, impl, "mean"
    )


def segment_log_softmax(logits: Any, segment_ids: Any, num_segments: Size = None,
                        indices_are_sorted: bool = False, unique_indices: bool = False, *,
                        axis: int = 0, impl: Impl = None) -> jax.Array:  # fmt: skip
    """Log of :func:`segment_softmax`, computed as ``x - m - log(sum exp(x - m))``.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> out = jaxcsr.segment_log_softmax(jnp.array([0.0, 0.0]), np.array([0, 0]), 1)
      >>> [round(float(v), 4) for v in out]
      [-0.6931, -0.6931]
    """
    A, x, axis = _prepare_logits(logits, segment_ids, num_segments, indices_are_sorted, axis, impl)

    def body(A: CSRMatrix, x: jax.Array) -> jax.Array:
        shifted, _, total, _ = shifted_exp(_wide(x), A, impl)
        out = shifted - matmul(A.T, jnp.log(total), impl=impl)
        s = A.structure
        if s.layout.padded:  # dropped entries (ids out of range): probability 0
            dropped = (s.column_rows() >= s.shape[0]).reshape((-1,) + (1,) * (out.ndim - 1))
            out = jnp.where(dropped, -jnp.inf, out)
        return out.astype(x.dtype)

    return jnp.moveaxis(_on_plan(A, body, x), 0, axis)


def segment_max(data: Any, segment_ids: Any, num_segments: Size = None,
                indices_are_sorted: bool = False, unique_indices: bool = False,
                bucket_size: Size = None, mode: Mode = None, *, axis: int = 0,
                return_arg: bool = False, empty: Any = None,
                impl: Impl = None) -> Any:  # fmt: skip
    """Maximum of ``data`` over segments; NaN propagates. Empty segments hold
    ``empty``: by default the dtype's lowest value (``-inf``, the integer minimum,
    ``False``), as ``jax.ops``; ``empty=0`` gives torch_scatter's 0.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> x = jnp.array([1.0, 3.0, 2.0, 4.0, 5.0, 6.0])
      >>> jaxcsr.segment_max(x, np.array([0, 1, 0, 1, 1, 3]), 4, return_arg=True)
      (Array([  2.,   5., -inf,   6.], dtype=float32), Array([2, 4, 6, 5], dtype=int32))
    """
    return _reduce(
        data, segment_ids, num_segments, indices_are_sorted, mode, axis, return_arg, impl, "max",
        empty,
    )  # fmt: skip


def segment_logsumexp(logits: Any, segment_ids: Any, num_segments: Size = None,
                      indices_are_sorted: bool = False, unique_indices: bool = False, *,
                      axis: int = 0, impl: Impl = None) -> jax.Array:  # fmt: skip
    """``log(sum(exp(x)))`` per segment, stable; empty segments are 0 (torch_scatter).

    A segment whose logits are all ``-inf`` gives ``-inf``.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> out = jaxcsr.segment_logsumexp(jnp.array([0.0, 0.0, 3.0]), np.array([0, 0, 2]), 3)
      >>> [round(float(v), 4) for v in out]
      [0.6931, 0.0, 3.0]
    """
    A, x, axis = _prepare_logits(logits, segment_ids, num_segments, indices_are_sorted, axis, impl)

    def body(A: CSRMatrix, x: jax.Array) -> jax.Array:
        _, _, total, peak = shifted_exp(_wide(x), A, impl)
        nonempty = _nonempty(A, total.ndim)
        # log(0) only where the segment is empty; keep its gradient finite there.
        out = jnp.where(nonempty, jnp.log(jnp.where(nonempty, total, 1)) + peak, 0)
        return out.astype(x.dtype)

    return jnp.moveaxis(_on_plan(A, body, x), 0, axis)


def segment_min(data: Any, segment_ids: Any, num_segments: Size = None,
                indices_are_sorted: bool = False, unique_indices: bool = False,
                bucket_size: Size = None, mode: Mode = None, *, axis: int = 0,
                return_arg: bool = False, empty: Any = None,
                impl: Impl = None) -> Any:  # fmt: skip
    """Minimum of ``data`` over segments; NaN propagates. Empty segments hold
    ``empty``: by default the dtype's highest value (``+inf``, the integer maximum,
    ``True``), as ``jax.ops``; ``empty=0`` gives torch_scatter's 0.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> ids = np.array([0, 1, 0, 1, 1, 3])
      >>> jaxcsr.segment_min(jnp.array([1.0, 3, 2, 4, 5, 6]), ids, 4, empty=0)
      Array([1., 3., 0., 6.], dtype=float32)
    """
    return _reduce(
        data, segment_ids, num_segments, indices_are_sorted, mode, axis, return_arg, impl, "min",
        empty,
    )  # fmt: skip


def segment_prod(data: Any, segment_ids: Any, num_segments: Size = None,
                 indices_are_sorted: bool = False, unique_indices: bool = False,
                 bucket_size: Size = None, mode: Mode = None, *,
                 axis: int = 0) -> jax.Array:  # fmt: skip
    """Product of ``data`` over segments; empty segments are 1.

    jaxcsr plans no product kernel: after the same argument checks and id handling
    as the other reductions (``mode``, ``axis``), this runs ``jax.ops.segment_prod``
    (XLA's scatter-multiply) on the ids that are kept. It is here so that the
    ``segment_*`` family can replace ``jax.ops``' whole.

    Args:
      data, segment_ids, num_segments, mode, axis: as in :func:`segment_sum`.
      indices_are_sorted, unique_indices, bucket_size: passed to ``jax.ops``.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> jaxcsr.segment_prod(jnp.array([2.0, 3.0, 4.0]), np.array([0, 0, 2]), 3)
      Array([6., 1., 4.], dtype=float32)
    """
    data = as_numeric(data, "data")
    segment_ids = _ids_argument(segment_ids)
    data = _broadcast_to_ids(data, segment_ids, axis)
    axis = _check_axis(data, axis)
    mode = _mode_argument(mode)
    ids: Any
    if is_traced(segment_ids):
        ids, num_segments = _traced_ids(segment_ids, num_segments, mode)
    else:
        ids, num_segments = _host_ids(segment_ids, num_segments)
        if mode == "check":
            check_segment_ids(ids, num_segments, names=("segment_ids", "num_segments"))
        elif mode == "clip" and num_segments > 0:
            ids = np.clip(ids, 0, num_segments - 1)
    ids = _dropped_as_minus_one(ids, num_segments)
    _check_length(data, axis, ids.shape[0])
    out = _xla_segment_prod(
        jnp.moveaxis(data, axis, 0),
        jnp.asarray(ids),
        num_segments,
        indices_are_sorted=indices_are_sorted,
        unique_indices=unique_indices,
        bucket_size=bucket_size,
    )
    return jnp.moveaxis(out, 0, axis)


for _reduction in (segment_sum, segment_mean, segment_max, segment_min):
    _summary, _example = (_reduction.__doc__ or "").split("\n\n    Example:", 1)
    _reduction.__doc__ = f"{_summary}\n{_ARGS}\n    Example:{_example}"
