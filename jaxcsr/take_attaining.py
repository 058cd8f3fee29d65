"""The ``take_attaining`` primitive: a max/min's tangent taken at its attaining columns.

Reading order: primitive -> binding -> impl -> abstract eval -> JVP -> transpose ->
batching -> lowering. :mod:`jaxcsr.ops` binds it in the JVP of ``csr_matmul``'s max and
min over one-per-column views, where a backend has its own arg search.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxcsr.primitive import ShapedArray, def_jitted_impl, map_over_batch

__all__ = ["take_attaining", "take_attaining_p"]

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


def _take_attaining(x, columns, rows, *, put):
    del rows, put
    n = x.shape[0]
    taken = jnp.take_along_axis(x, jnp.minimum(columns, n - 1), axis=0)
    return jnp.where(columns < n, taken, jnp.zeros((), x.dtype))


@take_attaining_p.def_abstract_eval
def _take_attaining_abstract_eval(x, columns, rows, *, put):
    del rows, put
    return ShapedArray((columns.shape[0], x.shape[1]), x.dtype)


def _take_attaining_jvp(primals, tangents, *, put):
    x, columns, rows = primals
    out = take_attaining_p.bind(x, columns, rows, put=put)
    if type(tangents[0]) is ad.Zero:
        return out, ad.Zero.from_primal_value(out)
    return out, take_attaining_p.bind(tangents[0], columns, rows, put=put)


def _take_attaining_transpose(ct, x, columns, rows, *, put):
    if ad.is_undefined_primal(columns) or ad.is_undefined_primal(rows):
        raise ValueError("take_attaining is linear in x only")
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval), None, None]
    return [put(ct, columns, rows).astype(x.aval.dtype), None, None]


def _take_attaining_batch(args, dims, *, put):
    """The batch joins the features: ``x (n, B, F) -> (n, B * F)``, the columns alike;
    rows that differ per element run one element at a time."""
    x, columns, rows = args
    x_bd, columns_bd, rows_bd = dims
    if rows_bd is not None:
        return map_over_batch(functools.partial(take_attaining, put=put), args, dims), 0
    size = x.shape[x_bd] if x_bd is not None else columns.shape[columns_bd]

    def fold(v, bd):  # (k, F) batched at bd -> (k, size * F)
        v = jnp.broadcast_to(v[:, None], (v.shape[0], size, v.shape[1])) if bd is None else (
            jnp.moveaxis(v, bd, 1))  # fmt: skip
        return v.reshape(v.shape[0], -1)

    out = take_attaining(fold(x, x_bd), fold(columns, columns_bd), rows, put=put)
    return out.reshape(out.shape[0], size, -1), 1


def_jitted_impl(take_attaining_p)
ad.primitive_jvps[take_attaining_p] = _take_attaining_jvp
ad.primitive_transposes[take_attaining_p] = _take_attaining_transpose
batching.primitive_batchers[take_attaining_p] = _take_attaining_batch
mlir.register_lowering(take_attaining_p, mlir.lower_fun(_take_attaining, multiple_results=False))
