"""Softmax over the stored entries of each row: the attention weights of graph attention.

``edge_softmax(A, scores)`` normalises per-entry scores (for instance
``jaxcsr.sddmm(A, Q, K)``, or GAT's ``leaky_relu(el[dst] + er[src])``) over each row of
``A``; :func:`jaxcsr.segment_softmax` runs the same computation over segment ids.

What is fused, and why it is faster than the ``jax.ops`` composition
(``segment_max``, ``exp``, ``segment_sum``, divide) -- two segmented reductions, two
gathers and three ``(nnz, H)`` temporaries forward, more backward:

* **One segmented reduction forward, not two.** The row max only guards ``exp``
  against overflow and the sum against underflow; softmax does not depend on the
  shift. The forward computes ``e = exp(s)`` unshifted, the row sums ``t`` with the
  planned product, ``r = 1 / t`` per row and ``p = e * r[row]``. It keeps that result
  only when every step was a normal floating-point number for every non-empty row
  (:func:`fast_path_safe`): ``SAFE_TOTAL <= t <= 1 / tiny``, where ``tiny`` is the
  smallest normal number of the accumulation dtype (float32: ``t <= 2**126``, scores
  up to ``ln 2**126 ~ 87.34``; float64: ``t <= 2**1022``, ~708.4). The upper bound
  keeps ``r`` normal (a subnormal reciprocal is flushed to zero on CPU and GPU, which
  would zero the whole row), and ``e <= t`` cannot overflow below it; the lower bound
  keeps ``r <= 2**40``, so an entry whose ``exp`` underflows (score below ~-87 in
  float32) has a true probability below ``tiny * 2**40 ~ 1.3e-26``. Every probability
  above that equals the max-shifted formula's to float32 rounding. Otherwise (a row
  whose largest score is above ~87.34, or whose scores all lie below ~-27.7) a
  ``lax.cond`` recomputes with the exact row max. Under ``vmap`` the batch folds into
  the heads axis, so the cond stays a cond.
* **A backward that stores nothing it can recompute.** The derivative is a JVP,
  ``dp = p * (ds - rowsum(p * ds)[row])``, linear in ``ds`` and built only from the
  output ``p`` (the result the caller holds anyway); reverse mode transposes it into
  ``g -> p * (g - rowsum(p * g)[row])``: one segmented sum and one gather. Forward
  mode and higher orders work too.
* **The row sums run the planned product** of a one-valued matrix that maps each
  entry to its row (:func:`rows_pattern`), so the platform's strategy runs -- on CPU
  the scatter or jaxlib's CSR kernel chosen by feature width.

Scores and results are in float32 (float64 under x64) inside; 16-bit inputs are cast
back at the end. A row whose scores are all ``-inf`` gives NaN, as ``jax.nn.softmax``.

The forward and the tangent are primitives (:data:`softmax_p`,
:data:`softmax_tangent_p`) lowered per platform: where the backend that runs the
pattern's products has a fused softmax (:attr:`jaxcsr.kernels.Capabilities.softmax`: the
native CPU backend: one pass per row, always max-shifted, for patterns sorted by row
-- ``edge_softmax``'s, sorted segment ids --; pushes in input order for unsorted
segment ids, with the fast path's bounds above) it runs that; everywhere else the
composition above. The tangent's transpose is itself (per row it is ``diag(p) - p
p^T``, symmetric), and its own JVP is the composition's.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxcsr.dtypes import accumulation_dtype
from jaxcsr.matrix import CSRMatrix, matmul
from jaxcsr.ops import PLATFORMS, Index, backend_for
from jaxcsr.primitive import ShapedArray, def_jitted_impl, fold_batch, map_over_batch
from jaxcsr.validation import as_numeric

__all__ = [
    "SAFE_TOTAL",
    "edge_softmax",
    "fast_path_safe",
    "max_safe_total",
    "rows_pattern",
    "softmax_p",
    "softmax_tangent_p",
]

SAFE_TOTAL = 2.0**-40
"""Smallest row sum of unshifted ``exp(scores)`` the fast path accepts.

Above it, an entry whose ``exp`` underflows (score < ~-87 in float32) has probability
below ``tiny * 2**40 ~ 1.3e-26``, so skipping the max shift loses nothing larger."""


def max_safe_total(dtype) -> float:
    """Largest row sum the fast path accepts in accumulation dtype ``dtype``:
    ``1 / tiny`` (``2**126`` for float32, ``2**1022`` for float64), the largest sum
    whose reciprocal is still a normal number."""
    return float(1 / jnp.finfo(dtype).tiny)


def fast_path_safe(total: jax.Array, nonempty: Any) -> jax.Array:
    """Whether the unshifted softmax is exact enough for every row: each non-empty
    row's sum lies in ``[SAFE_TOTAL, max_safe_total(total.dtype)]`` (NaN sums pass:
    NaN scores give NaN in either branch). A scalar bool.

    ``nonempty``: ``(m, 1)`` bool, or a function returning it, called only when some
    sum is out of range (an empty row's sum is 0): a structure planned on the device
    pays a pass over its ids for it."""
    suspect = (total < SAFE_TOTAL) | (total > max_safe_total(total.dtype))
    if not callable(nonempty):
        return ~jnp.any(nonempty & suspect)
    return jax.lax.cond(jnp.any(suspect), lambda: ~jnp.any(nonempty() & suspect), lambda: True)


def rows_pattern(A: CSRMatrix) -> CSRMatrix:
    """The one-valued ``(m, nnz)`` matrix ``R[row(k), k] = 1`` of ``A``'s stored entries.

    ``R @ v`` sums per-entry values ``v`` (``(nnz, F)``, CSR order) over each row of
    ``A``; ``R.T @ w`` broadcasts per-row values to the entries. Built on the device
    from ``A``'s structure (no host work, valid under ``jit``), with the plans of
    ``A``'s backends, so the platform's kernel runs its row sums.
    """
    index = Index.planned(A.structure.entry_rows(), A.backends, required=False)
    return CSRMatrix(None, index)


def edge_softmax(A: CSRMatrix, scores: Any) -> jax.Array:
    """Softmax of ``scores`` over the stored entries of each row of ``A``.

    ``out[k] = exp(s[k]) / sum_{k' in row(k)} exp(s[k'])``, computed stably (see the
    module docstring for what is fused). ``A``'s values are not used.

    Args:
      A: the sparsity pattern, e.g. ``CSRMatrix.from_coo(dst, src, shape=(V, V))``.
      scores: ``(nnz, ...)`` floating array in ``A``'s CSR order (the order of
        :func:`jaxcsr.sddmm` and ``A.with_data``; ``x[A.input_order]`` puts input-order
        values there). Trailing axes are heads: each is normalised separately.

    Returns:
      Array of ``scores``' shape and dtype. Differentiable in ``scores``.

    Raises:
      TypeError: ``A`` is not a CSRMatrix; ``scores`` is not floating.
      ValueError: ``scores.shape[0] != A.nnz``.

    Example:
      >>> import numpy as np, jax.numpy as jnp, jaxcsr
      >>> A = jaxcsr.CSRMatrix.from_coo(np.array([0, 0, 1]), np.array([0, 1, 1]), shape=(2, 2))
      >>> [round(float(v), 4) for v in jaxcsr.edge_softmax(A, jnp.array([0.0, 1.0, 5.0]))]
      [0.2689, 0.7311, 1.0]
    """
    if not isinstance(A, CSRMatrix):
        raise TypeError(f"A must be a jaxcsr.CSRMatrix, got {type(A).__name__}")
    scores = as_numeric(scores, "scores", floating=True)
    if scores.ndim == 0 or scores.shape[0] != A.nnz:
        raise ValueError(
            f"scores must have shape (nnz, ...) with nnz = A.nnz = {A.nnz}, got {scores.shape}"
        )
    return _edge_softmax(A, scores)


@jax.jit
def _edge_softmax(A: CSRMatrix, scores: jax.Array) -> jax.Array:
    # jitted so that eager calls compile once per shape, not at every call
    return softmax_over_rows(scores, rows_pattern(A))


def softmax_over_rows(
    scores: Any, pattern: CSRMatrix, impl: str | None = None, *, name: str = "scores"
) -> jax.Array:
    """Softmax of ``scores`` (``(n, ...)``) over the rows of a one-per-column ``pattern``.

    ``pattern`` is ``(m, n)`` with one entry in every column: entry ``j`` belongs to
    row ``row_of_col[j]`` (:func:`rows_pattern`, or a ``from_indices`` matrix for
    :func:`jaxcsr.segment_softmax`). ``impl`` is forwarded to the row-sum products;
    ``name`` is what errors call ``scores``.
    """
    scores = as_numeric(scores, name, floating=True)
    s = pattern.structure
    if not (s.one_per_column and s.nnz == s.shape[1]):
        raise ValueError("pattern must have exactly one stored entry per column")
    if scores.shape[0] != s.shape[1]:
        raise ValueError(f"{name} must have {s.shape[1]} rows, got shape {scores.shape}")
    n = scores.shape[0]
    flat = scores.reshape(n, int(np.prod(scores.shape[1:])))
    if flat.size == 0:
        return scores
    return _softmax_jit(flat, pattern, impl).reshape(scores.shape)


@functools.partial(jax.jit, static_argnums=2)
def _softmax_jit(scores: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    """:func:`_softmax` compiled once per shape when called eagerly (inlined in a trace)."""
    return _softmax(scores, pattern, impl)


def _row_sums(v: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    return matmul(pattern, v, impl=impl)


def _broadcast(per_row: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    """Per-row values ``(m, H)`` -> per entry ``(n, H)``: ``pattern.T @ per_row``, a row
    gather whose transpose is the planned row sum."""
    return matmul(pattern.T, per_row, impl=impl)


def _elementwise(fn, *arrays: jax.Array) -> jax.Array:
    """``fn(*arrays)`` for equal-shape arrays; a single ``(n, 1)`` column runs 1-D.

    XLA:CPU does not vectorise elementwise loops over a ``(n, 1)`` array (it does over
    ``(n,)``). XLA folds plain reshapes back into the loop, so the 1-D views sit behind
    optimization barriers (no copies: the reshapes are bitcasts).
    """
    if arrays[0].ndim != 2 or arrays[0].shape[1] != 1:
        return fn(*arrays)
    flat = [jax.lax.optimization_barrier(a.reshape(-1)) for a in arrays]
    return jax.lax.optimization_barrier(fn(*flat)).reshape(arrays[0].shape)


def shifted_exp(x: jax.Array, pattern: CSRMatrix, impl=None) -> tuple[jax.Array, ...]:
    """``(shifted, exp(shifted), row sums, peak)``: the max-shifted softmax's parts.

    ``peak`` is each row's max of ``x`` (0 where it is not finite: empty rows, rows
    of ``-inf``), ``shifted`` is ``x`` minus its row's peak, the row sums are of
    ``exp(shifted)``. The shift cancels in every result and its gradient, so no
    gradient flows through the max. Shared by the exact branch of the softmax and by
    ``segment_log_softmax`` / ``segment_logsumexp``.
    """
    peak = matmul(pattern, jax.lax.stop_gradient(x), reduce="max", impl=impl)
    peak = jnp.where(jnp.isfinite(peak), peak, 0)
    shifted = _elementwise(jnp.subtract, x, _broadcast(peak, pattern, impl))
    e = _elementwise(jnp.exp, shifted)
    return shifted, e, _row_sums(e, pattern, impl), peak


def _normalised(e: jax.Array, per_entry: jax.Array, fn, pattern: CSRMatrix) -> jax.Array:
    """``fn(e, per_entry)`` in one elementwise pass; for a padded pattern (traced ids)
    the dropped entries, which belong to no row, are 0 in the same pass."""
    s = pattern.structure
    if not s.layout.padded:
        return _elementwise(fn, e, per_entry)
    kept = jnp.broadcast_to((s.column_rows() < s.shape[0])[:, None], e.shape)
    return _elementwise(lambda e, v, kept: jnp.where(kept, fn(e, v), 0), e, per_entry, kept)


def _exact(x: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    """Softmax shifted by each row's max (the textbook stable formula)."""
    _, e, total, _ = shifted_exp(x, pattern, impl)
    return _normalised(e, _broadcast(total, pattern, impl), jnp.divide, pattern)


def _forward_unbatched(scores: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    """The XLA composition of the forward: unshifted when :func:`fast_path_safe`, else
    :func:`_exact`."""
    acc = accumulation_dtype(scores.dtype)
    x = scores.astype(acc)
    e = _elementwise(jnp.exp, x)
    total = _row_sums(e, pattern, impl)
    s = pattern.structure

    def nonempty():
        return s.nonempty_rows()[:, None]

    out = jax.lax.cond(
        fast_path_safe(total, nonempty if s.layout.padded else nonempty()),
        lambda: _normalised(e, _broadcast(1 / total, pattern, impl), jnp.multiply, pattern),
        lambda: _exact(x, pattern, impl),
    )
    return out.astype(scores.dtype)


def _tangent_composed(p: jax.Array, ds: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    """The XLA composition of the tangent, ``p * ds - p * rowsum(p * ds)[row]``."""
    acc = accumulation_dtype(p.dtype)
    out_dtype = p.dtype
    p, ds = p.astype(acc), ds.astype(acc)
    pd = _elementwise(jnp.multiply, p, ds)
    inner = _broadcast(_row_sums(pd, pattern, impl), pattern, impl)
    return _elementwise(lambda pd, p, inner: pd - p * inner, pd, p, inner).astype(out_dtype)


# ------------------------------------------------------------------ primitives
# The forward and its tangent are primitives, lowered per platform: the platform's
# kernel when it has a fused softmax (the native CPU backend), else the compositions
# above. The tangent is linear in ``ds`` and self-adjoint (per row, diag(p) - p p^T),
# so its transpose is itself.
softmax_p = Primitive("row_softmax")
softmax_tangent_p = Primitive("row_softmax_tangent")
def_jitted_impl(softmax_p)
def_jitted_impl(softmax_tangent_p)


def _pattern(leaves, index_tree) -> CSRMatrix:
    return CSRMatrix(None, jax.tree_util.tree_unflatten(index_tree, leaves))


def _bind(primitive: Primitive, arrays, pattern: CSRMatrix, impl) -> jax.Array:
    leaves, index_tree = jax.tree_util.tree_flatten(pattern.index)
    return primitive.bind(*arrays, *leaves, index_tree=index_tree, impl=impl)


@softmax_p.def_abstract_eval
def _softmax_abstract_eval(scores, *leaves, index_tree, impl):
    return ShapedArray(scores.shape, scores.dtype)


@softmax_tangent_p.def_abstract_eval
def _tangent_abstract_eval(p, ds, *leaves, index_tree, impl):
    return ShapedArray(p.shape, p.dtype)


def _lowered(arrays, leaves, *, index_tree, impl, platform: str, composed) -> jax.Array:
    """What runs on ``platform``: the fused kernel of the backend that runs the pattern's
    products there, if it has one, else ``composed`` (the XLA composition)."""
    pattern = _pattern(leaves, index_tree)
    dtype = arrays[0].dtype
    backend = backend_for(impl, platform, pattern.index, dtype, None, None)
    fused = backend.capabilities.softmax
    if fused is None or backend.platform != platform:
        return composed(*arrays, pattern, impl)
    tangent = arrays[1] if len(arrays) == 2 else None
    return fused(
        arrays[0], tangent, pattern.structure, out_dtype=dtype,
        fallback=lambda: composed(*arrays, pattern, impl),
    )  # fmt: skip


for _platform in PLATFORMS:
    for _primitive, _arity, _composed in (
        (softmax_p, 1, _forward_unbatched),
        (softmax_tangent_p, 2, _tangent_composed),
    ):
        mlir.register_lowering(
            _primitive,
            mlir.lower_fun(
                functools.partial(
                    lambda *operands, arity, **params: _lowered(
                        operands[:arity], operands[arity:], **params
                    ),
                    arity=_arity,
                    platform=_platform,
                    composed=_composed,
                ),
                multiple_results=False,
            ),
            platform=_platform,
        )


def _batch(primitive: Primitive, n_arrays: int):
    """Batching: every head is normalised on its own, so a batch of scores joins the
    heads axis (one call, and the composition's ``lax.cond`` stays a cond); a pattern
    per element maps over the batch."""

    def rule(args, dims, *, index_tree, impl):
        if any(d is not None for d in dims[n_arrays:]):

            def bind(*operands):
                return primitive.bind(*operands, index_tree=index_tree, impl=impl)

            return map_over_batch(bind, args, dims), 0
        arrays, leaves = args[:n_arrays], args[n_arrays:]
        size = next(a.shape[d] for a, d in zip(arrays, dims, strict=False) if d is not None)
        folded = [fold_batch(a, d, size) for a, d in zip(arrays, dims, strict=False)]
        out = primitive.bind(*folded, *leaves, index_tree=index_tree, impl=impl)
        return out.reshape(out.shape[0], size, -1), 1

    return rule


batching.primitive_batchers[softmax_p] = _batch(softmax_p, 1)
batching.primitive_batchers[softmax_tangent_p] = _batch(softmax_tangent_p, 2)


def _tangent_transpose(ct, p, ds, *leaves, index_tree, impl):
    if ad.is_undefined_primal(p) or not ad.is_undefined_primal(ds):
        raise ValueError("the softmax tangent is linear in its second operand only")
    if type(ct) is ad.Zero:
        return [None, None, *[None] * len(leaves)]
    pattern = _pattern(leaves, index_tree)
    ds_ct = _bind(softmax_tangent_p, (p, ct), pattern, impl).astype(ds.aval.dtype)
    return [None, ds_ct, *[None] * len(leaves)]


ad.primitive_transposes[softmax_tangent_p] = _tangent_transpose


def _tangent_jvp(primals, tangents, *, index_tree, impl):
    """Higher orders: the composition's JVP (the tangent is quadratic in ``p``)."""
    p, ds, *leaves = primals
    dp, dds = (ad.instantiate_zeros(t) for t in tangents[:2])
    pattern = _pattern(leaves, index_tree)
    out = _bind(softmax_tangent_p, (p, ds), pattern, impl)
    _, tangent = jax.jvp(lambda p, ds: _tangent_composed(p, ds, pattern, impl), (p, ds), (dp, dds))
    return out, tangent


ad.primitive_jvps[softmax_tangent_p] = _tangent_jvp


def _forward(scores: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    return _bind(softmax_p, (scores,), pattern, impl)


def _tangent(p: jax.Array, ds: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    """``p * (ds - rowsum(p * ds)[row])``: linear in ``ds``; its transpose (the
    backward) has the same form, so reverse mode keeps only ``p``."""
    return _bind(softmax_tangent_p, (p, ds.astype(p.dtype)), pattern, impl)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _softmax(scores: jax.Array, pattern: CSRMatrix, impl) -> jax.Array:
    return _forward(scores, pattern, impl)


@_softmax.defjvp
def _softmax_jvp(impl, primals, tangents):
    scores, pattern = primals
    ds, _ = tangents
    out = _softmax(scores, pattern, impl)  # itself differentiable: higher orders work
    return out, _tangent(out, ds, pattern, impl)
