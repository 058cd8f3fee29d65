"""The ``take_attaining`` primitive: a max/min's tangent taken at its attaining columns,
and its transpose ``put_attaining``.

Reading order: the primitives and their bindings, impls, abstract evals, then the rules
they share (JVP, transpose, batching) and the lowerings. :mod:`jaxcsr.ops`
binds the first in the JVP of ``csr_matmul``'s max and min over one-per-column views,
where a backend has its own arg search. The two are each other's transpose and both are
linear in their first operand, so every order of differentiation stays inside the pair
(a backend's ``put`` may be a foreign call, which JAX cannot differentiate itself).
Last, :func:`first_attaining`: the search for those columns in ``jnp`` (the XLA path's
and the traced CPU scatter's), one tie rule for all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxcsr.primitive import ShapedArray, def_jitted_impl, fold_batch, map_over_batch

__all__ = [
    "first_attaining",
    "put_attaining",
    "put_attaining_p",
    "take_attaining",
    "take_attaining_p",
]

take_attaining_p = Primitive("take_attaining")
"""``(m, F)``: ``x[columns[r, f], f]`` where ``columns[r, f] < n``, else 0, for the
columns attaining a max/min of a one-per-column view (:func:`take_attaining`). Linear
in ``x``. Its transpose puts each row's cotangent at its attaining column in one pass
over ``(n, F)``: column ``k`` of row ``rows[k]`` receives ``ct[rows[k], f]`` where
``columns[rows[k], f] == k`` -- no zeros written first, no scatter (the transpose of
``take_along_axis``: an ``(n, F)`` zero array, then a serial scatter of ``m * F``
values). That pass is the static param ``put``, the search's backend's
:attr:`ArgSearch.put_attaining <jaxcsr.kernels.ArgSearch>` (native on CPU)."""


def take_attaining(x: jax.Array, columns: jax.Array, rows: jax.Array, *, put) -> jax.Array:
    """:data:`take_attaining_p`: ``x (n, F)`` at ``columns (m, F)`` (``n``: none), for a
    view whose column ``k`` lies in row ``rows[k]`` alone (``m``: in none). ``put`` is
    its transpose (:attr:`ArgSearch.put_attaining <jaxcsr.kernels.ArgSearch>`)."""
    return take_attaining_p.bind(x, columns, rows, put=put)


def put_attaining(ct: jax.Array, columns: jax.Array, rows: jax.Array, *, put) -> jax.Array:
    """:data:`put_attaining_p`: ``ct (m, F)`` put at ``columns (m, F)`` of a view whose
    column ``k`` lies in row ``rows[k]`` (``(n,)``); ``put`` computes it."""
    return put_attaining_p.bind(ct, columns, rows, put=put)


put_attaining_p = Primitive("put_attaining")
"""``(n, F)``: ``ct[rows[k], f]`` where ``columns[rows[k], f] == k``, else 0 -- the
transpose of :data:`take_attaining_p`, computed by the static param ``put``. Linear in
``ct``; its transpose is ``take_attaining``."""


def _take_attaining(x, columns, rows, *, put):
    del rows, put
    n = x.shape[0]
    taken = jnp.take_along_axis(x, jnp.minimum(columns, n - 1), axis=0)
    return jnp.where(columns < n, taken, jnp.zeros((), x.dtype))


def _put_attaining(ct, columns, rows, *, put):
    return put(ct, columns, rows)


@take_attaining_p.def_abstract_eval
def _take_attaining_abstract_eval(x, columns, rows, *, put):
    del rows, put
    return ShapedArray((columns.shape[0], x.shape[1]), x.dtype)


@put_attaining_p.def_abstract_eval
def _put_attaining_abstract_eval(ct, columns, rows, *, put):
    del columns, put
    return ShapedArray((rows.shape[0], ct.shape[1]), ct.dtype)


def _linear_rules(primitive: Primitive, transposed) -> None:
    """The JVP, transpose and batching rules of ``primitive(v, columns, rows, put=)``,
    linear in ``v``, whose transpose binds ``transposed`` with the same indices."""

    def bind(v, columns, rows, *, put):
        return primitive.bind(v, columns, rows, put=put)

    def jvp(primals, tangents, *, put):
        v, columns, rows = primals
        out = bind(v, columns, rows, put=put)
        if type(tangents[0]) is ad.Zero:
            return out, ad.Zero.from_primal_value(out)
        return out, bind(tangents[0], columns, rows, put=put)

    def transpose(ct, v, columns, rows, *, put):
        if ad.is_undefined_primal(columns) or ad.is_undefined_primal(rows):
            raise ValueError(f"{primitive.name} is linear in its first operand only")
        if type(ct) is ad.Zero:
            return [ad.Zero(v.aval), None, None]
        return [transposed(ct, columns, rows, put=put).astype(v.aval.dtype), None, None]

    def batch(args, dims, *, put):
        """The batch joins the features: ``v (k, B, F) -> (k, B * F)``, the columns
        alike; rows that differ per element run one element at a time."""
        v, columns, rows = args
        v_bd, columns_bd, rows_bd = dims
        if rows_bd is not None:
            return map_over_batch(functools.partial(bind, put=put), args, dims), 0
        size = v.shape[v_bd] if v_bd is not None else columns.shape[columns_bd]
        out = bind(fold_batch(v, v_bd, size), fold_batch(columns, columns_bd, size), rows, put=put)
        return out.reshape(out.shape[0], size, -1), 1

    def_jitted_impl(primitive)
    ad.primitive_jvps[primitive] = jvp
    ad.primitive_transposes[primitive] = transpose
    batching.primitive_batchers[primitive] = batch


_linear_rules(take_attaining_p, put_attaining)
_linear_rules(put_attaining_p, take_attaining)
mlir.register_lowering(take_attaining_p, mlir.lower_fun(_take_attaining, multiple_results=False))
mlir.register_lowering(put_attaining_p, mlir.lower_fun(_put_attaining, multiple_results=False))


def first_attaining(
    values: jax.Array, target: jax.Array, rows: jax.Array, m: int, *, sorted_ids: bool, empty: int
) -> jax.Array:
    """``(m, F)`` int32: per row and feature, the first position ``k`` of ``values``
    (``(K, F)``) whose value equals ``target[k]`` (NaN matches NaN), ``empty`` where no
    position of the row does; positions whose row is outside ``[0, m)`` (negative ones
    included) belong to none. The arg of a max/min and where its gradient goes: ties
    go to the first position, on every backend."""
    hit = values == target
    if jnp.issubdtype(values.dtype, jnp.inexact):
        hit = hit | (jnp.isnan(values) & jnp.isnan(target))
    positions = jnp.where(hit, jnp.arange(values.shape[0], dtype=jnp.int32)[:, None], empty)
    return (
        jnp.full((m, values.shape[1]), empty, jnp.int32)
        .at[rows]
        .min(positions, mode="drop", indices_are_sorted=sorted_ids, wrap_negative_indices=False)
    )
