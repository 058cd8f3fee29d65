"""Segment reductions with ``jax.ops.segment_*`` signatures, on a cached planned matrix.

Each function takes a *static* host array of segment ids, builds (once) the
one-valued matrix ``A = CSRMatrix.from_indices(segment_ids, num_segments)`` and
computes ``matmul(A, data, reduce=...)``. The matrix is cached by the ids' value
(:func:`segment_matrix`), so calling a function again with equal ids -- eagerly,
or when a jitted function is retraced -- plans nothing. Finding it costs a hash of
the ids on every *eager* call (inside ``jax.jit`` only when tracing): in an eager
loop, build the matrix once (``A = segment_matrix(ids, n)`` or
``CSRMatrix.from_indices``) and call ``matmul(A, data)``.

Migrating from ``jax.ops`` is a one-line change, with three differences, all
documented in ``docs/migration.md``:

* ``segment_ids`` must be concrete (a numpy array, or a JAX array outside
  ``jax.jit`` / closed over as a constant): the plan is made on the host.
* Out-of-range ids raise ``ValueError`` unless ``mode="drop"``/``"fill"`` (drop them,
  as ``jax.ops`` does silently by default) or ``mode="clip"`` asks otherwise.
* Empty segments give 0 for ``segment_max``/``segment_min`` (torch_scatter's
  convention); ``jax.ops`` gives ``-inf``/``+inf`` (the identity).

``axis`` (which ``jax.ops`` lacks) picks the axis of ``data`` that is segmented;
``axis=-1`` is the last-axis scatter ``data @ A.T``.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcsr import kernels
from jaxcsr.matrix import CSRMatrix, matmul
from jaxcsr.softmax import shifted_exp, softmax_over_rows
from jaxcsr.validation import as_host_int_array, as_numeric, check_segment_ids, check_size

__all__ = ["MODES", "segment_matrix", "segment_sum", "segment_mean", "segment_max", "segment_min"]
__all__ += ["segment_softmax", "segment_log_softmax", "segment_logsumexp"]

Size = int | None  # num_segments, bucket_size: None means "from the data"
Mode = str | None
Impl = str | None

MODES: tuple[Mode, ...] = (None, "promise_in_bounds", "drop", "fill", "clip")
"""Accepted ``mode`` values. ``None``/``"promise_in_bounds"``: out-of-range ids raise
``ValueError``; ``"drop"``/``"fill"``: entries with out-of-range ids are left out;
``"clip"``: ids are clipped into ``[0, num_segments)``."""

CACHE_SIZE = 64
"""Most matrices :func:`segment_matrix` keeps (least recently used are evicted)."""

_cache: collections.OrderedDict[tuple, CSRMatrix] = collections.OrderedDict()
_cache_lock = threading.Lock()


_STATIC_SEGMENT_IDS = (
    "jaxcsr plans on the host, so it must be static: pass a numpy array (close over it "
    "inside jax.jit), or build a CSRMatrix.from_indices outside jit and pass the matrix "
    "in. Ids that change at every step are not static: use jax.ops.segment_sum for those."
)


def _host_ids(segment_ids: Any) -> np.ndarray:
    ids = as_host_int_array(segment_ids, "segment_ids", _STATIC_SEGMENT_IDS)
    if ids.ndim != 1:
        raise ValueError(f"segment_ids must be 1-D, got shape {ids.shape}")
    return ids


def segment_matrix(
    segment_ids: Any,
    num_segments: int | None = None,
    mode: str | None = None,
    *,
    backends: Any = None,
) -> CSRMatrix:
    """The one-valued ``(num_segments, len(segment_ids))`` matrix, cached by value.

    Args:
      segment_ids: concrete 1-D integer array.
      num_segments: number of segments; ``None`` means ``max(segment_ids) + 1``
        (0 for no ids), as in ``jax.ops``.
      mode: one of :data:`MODES`.
      backends: backends to plan for (see :class:`~jaxcsr.CSRMatrix`); part of the
        cache key.

    Returns:
      A :class:`~jaxcsr.CSRMatrix` ``A`` with ``A[segment_ids[j], j] = 1`` (entries
      with dropped ids left out).

    Raises:
      ValueError: traced or non-1-D ids, out-of-range ids (unless ``mode`` says
        otherwise), negative ``num_segments``, unknown ``mode``.
      TypeError: non-integer ids or ``num_segments``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ids = _host_ids(segment_ids)
    if num_segments is None:
        num_segments = int(ids.max()) + 1 if ids.size else 0
    num_segments = check_size(num_segments, "num_segments")  # before the cache: 2.0 != 2
    backends = kernels.resolve_backends(backends)
    names = ("segment_ids", "num_segments")
    digest = hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()
    key = (digest, ids.dtype.str, ids.size, num_segments, mode, backends)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    if mode in ("drop", "fill"):
        keep = (ids >= 0) & (ids < num_segments)
        kept, num_segments = check_segment_ids(ids[keep], num_segments, names=names)
        shape = (num_segments, ids.size)
        matrix = CSRMatrix.from_coo(kept, np.flatnonzero(keep), shape=shape, backends=backends)
    else:
        if mode == "clip" and num_segments > 0:
            ids = np.clip(ids, 0, num_segments - 1)
        ids, num_segments = check_segment_ids(ids, num_segments, names=names)
        matrix = CSRMatrix.from_indices(ids, num_rows=num_segments, backends=backends)
    with _cache_lock:
        _cache[key] = matrix
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return matrix


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
) -> tuple:
    """Validates (dtype first, before any planning), plans, and moves ``axis`` first.
    ``name`` is what errors call ``data``; ``floating`` asks for a floating dtype."""
    data = as_numeric(data, name, floating=floating)
    axis = _check_axis(data, axis)
    A = segment_matrix(segment_ids, num_segments, mode, backends=_backends_for(impl))
    if A.shape[1] != data.shape[axis]:
        raise ValueError(
            f"data.shape[{axis}] must equal len(segment_ids) = {A.shape[1]}, "
            f"got data.shape = {data.shape}"
        )
    return A, jnp.moveaxis(data, axis, 0), axis


def _reduce(data, segment_ids, num_segments, mode, axis, return_arg, impl, reduce: str):
    """The one body of every ``segment_<reduce>``: plan (cached), then ``matmul``.
    (``indices_are_sorted``, ``unique_indices`` and ``bucket_size`` are not needed: the
    host plan knows.)"""
    A, x, axis = _prepare(data, segment_ids, num_segments, mode, axis, impl)
    result = matmul(A, x, reduce=reduce, return_arg=return_arg, impl=impl)
    if return_arg:
        out, arg = result
        return jnp.moveaxis(out, 0, axis), jnp.moveaxis(arg, 0, axis)
    return jnp.moveaxis(result, 0, axis)


def _softmax_parts(logits, segment_ids, num_segments, axis, impl):
    """``(A, axis, shifted, exp(shifted), total, peak, input dtype)`` of a stable softmax.

    ``shifted`` is each logit minus its segment's (finite) max ``peak``; ``total`` the
    per-segment sum of ``exp(shifted)``; all in float32 or wider.
    """
    A, x, axis = _prepare(
        logits, segment_ids, num_segments, None, axis, impl, name="logits", floating=True
    )
    dtype = x.dtype
    x = x.astype(jnp.promote_types(dtype, jnp.float32))
    return (A, axis, *shifted_exp(x, A, impl), dtype)


# ------------------------------------------------------------ public functions
# The reductions keep jax.ops' signature (plus axis, return_arg, impl), written
# compactly; their shared argument docs are appended at the end. Each is followed by
# its softmax-family counterpart.
_ARGS = """
    Args:
      data: array whose ``axis`` has length ``len(segment_ids)``.
      segment_ids: concrete 1-D integer array of segment ids (see
        :func:`segment_matrix`; the planned matrix is cached by value).
      num_segments: number of segments; ``None`` means ``max(segment_ids) + 1``.
      indices_are_sorted, unique_indices, bucket_size: accepted for signature
        compatibility with ``jax.ops`` and ignored: the host plan knows.
      mode: one of :data:`MODES`; the default raises on out-of-range ids.
      axis: the segmented axis of ``data`` (``jax.ops`` always uses 0).
      return_arg: max/min only (``ValueError`` otherwise): also return the position
        along ``axis`` of each extreme (ties: the first position; empty segments:
        ``len(segment_ids)``). Gradients flow to those positions only.
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
    return _reduce(data, segment_ids, num_segments, mode, axis, return_arg, impl, "sum")


def segment_softmax(
    logits: Any, segment_ids: Any, num_segments: Size = None, *, axis: int = 0, impl: Impl = None
) -> jax.Array:
    """Softmax of ``logits`` within each segment (GNN attention over incoming edges).

    ``out[j] = exp(x[j] - m) / sum_{i in seg(j)} exp(x[i] - m)`` with ``m`` the
    segment's max (numerically stable). 16-bit inputs are computed in float32 and
    cast back. A segment whose logits are all ``-inf`` gives NaN, as
    ``jax.nn.softmax`` does. Out-of-range ids raise ``ValueError``. Fused as
    :func:`jaxcsr.edge_softmax` is (one segmented sum forward in the common case, a
    backward that keeps only the output): the segments are the rows of the planned
    ``from_indices`` matrix.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> out = jaxcsr.segment_softmax(jnp.array([0.0, 1.0, 5.0]), np.array([0, 0, 1]), 2)
      >>> [round(float(v), 4) for v in out]
      [0.2689, 0.7311, 1.0]
    """
    A, x, axis = _prepare(
        logits, segment_ids, num_segments, None, axis, impl, name="logits", floating=True
    )
    return jnp.moveaxis(softmax_over_rows(x, A, impl, name="logits"), 0, axis)


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
    return _reduce(data, segment_ids, num_segments, mode, axis, return_arg, impl, "mean")


def segment_log_softmax(
    logits: Any, segment_ids: Any, num_segments: Size = None, *, axis: int = 0, impl: Impl = None
) -> jax.Array:
    """Log of :func:`segment_softmax`, computed as ``x - m - log(sum exp(x - m))``.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> out = jaxcsr.segment_log_softmax(jnp.array([0.0, 0.0]), np.array([0, 0]), 1)
      >>> [round(float(v), 4) for v in out]
      [-0.6931, -0.6931]
    """
    A, axis, shifted, _, total, _, dtype = _softmax_parts(
        logits, segment_ids, num_segments, axis, impl
    )
    out = shifted - matmul(A.T, jnp.log(total), impl=impl)
    return jnp.moveaxis(out.astype(dtype), 0, axis)


def segment_max(data: Any, segment_ids: Any, num_segments: Size = None,
                indices_are_sorted: bool = False, unique_indices: bool = False,
                bucket_size: Size = None, mode: Mode = None, *, axis: int = 0,
                return_arg: bool = False, impl: Impl = None) -> Any:  # fmt: skip
    """Maximum of ``data`` over segments. Empty segments are 0 (``jax.ops`` gives
    ``-inf``); NaN propagates.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> x = jnp.array([1.0, 3.0, 2.0, 4.0, 5.0, 6.0])
      >>> jaxcsr.segment_max(x, np.array([0, 1, 0, 1, 1, 3]), 4, return_arg=True)
      (Array([2., 5., 0., 6.], dtype=float32), Array([2, 4, 6, 5], dtype=int32))
    """
    return _reduce(data, segment_ids, num_segments, mode, axis, return_arg, impl, "max")


def segment_logsumexp(
    logits: Any, segment_ids: Any, num_segments: Size = None, *, axis: int = 0, impl: Impl = None
) -> jax.Array:
    """``log(sum(exp(x)))`` per segment, stable; empty segments are 0 (torch_scatter).

    A segment whose logits are all ``-inf`` gives ``-inf``.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> out = jaxcsr.segment_logsumexp(jnp.array([0.0, 0.0, 3.0]), np.array([0, 0, 2]), 3)
      >>> [round(float(v), 4) for v in out]
      [0.6931, 0.0, 3.0]
    """
    A, axis, _, _, total, peak, dtype = _softmax_parts(
        logits, segment_ids, num_segments, axis, impl
    )
    degrees = A.structure.degrees()
    nonempty = (degrees > 0).reshape((-1,) + (1,) * (total.ndim - 1))
    # log(0) only where the segment is empty; keep its gradient finite there.
    out = jnp.where(nonempty, jnp.log(jnp.where(nonempty, total, 1)) + peak, 0)
    return jnp.moveaxis(out.astype(dtype), 0, axis)


def segment_min(data: Any, segment_ids: Any, num_segments: Size = None,
                indices_are_sorted: bool = False, unique_indices: bool = False,
                bucket_size: Size = None, mode: Mode = None, *, axis: int = 0,
                return_arg: bool = False, impl: Impl = None) -> Any:  # fmt: skip
    """Minimum of ``data`` over segments (empty ones: 0, where ``jax.ops`` gives ``+inf``).

    NaN propagates.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> jaxcsr.segment_min(jnp.array([1.0, 3, 2, 4, 5, 6]), np.array([0, 1, 0, 1, 1, 3]), 4)
      Array([1., 3., 0., 6.], dtype=float32)
    """
    return _reduce(data, segment_ids, num_segments, mode, axis, return_arg, impl, "min")


for _reduction in (segment_sum, segment_mean, segment_max, segment_min):
    _summary, _example = _reduction.__doc__.split("\n\n    Example:", 1)
    _reduction.__doc__ = f"{_summary}\n{_ARGS}\n    Example:{_example}"
