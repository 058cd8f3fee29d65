"""What every jaxcsr primitive shares: eager calls that run the lowering, and the
batching of an index that differs per batch element.

The primitives themselves, each with its rules in one module: ``csr_matmul`` and
``sddmm`` (:mod:`jaxcsr.ops`; ``sddmm``'s transpose, built from planned products, in
:mod:`jaxcsr.sddmm`), ``take_attaining`` (:mod:`jaxcsr.take_attaining`) and the
softmax pair (:mod:`jaxcsr.softmax`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

try:  # the public spelling; jax.core's aliases are being retired
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future jax
    from jax._src.core import ShapedArray

__all__ = ["ShapedArray", "def_jitted_impl", "fold_batch", "map_over_batch"]


def map_over_batch(fn, args: Sequence[Any], dims: Sequence[int | None]) -> jax.Array:
    """``fn(*args)`` once per batch element (``lax.map``), for ``args`` batched at
    ``dims`` (``None``: shared by every element). The batching rule of an index that
    differs per element (``vmap`` over id arrays planned on the device): each element
    has its own structure, so the products run one after another."""
    batched = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims, strict=True) if d is not None]

    def one(slices):
        taken = iter(slices)
        return fn(*[a if d is None else next(taken) for a, d in zip(args, dims, strict=True)])

    return jax.lax.map(one, batched)


def fold_batch(v: jax.Array, bd: int | None, size: int) -> jax.Array:
    """``(k, F)`` batched at ``bd`` (``None``: shared by every element, broadcast) ->
    ``(k, size * F)``: the batching rule of an operation that treats its columns
    independently runs the whole batch as one call with more columns."""
    if bd is None:
        v = jnp.broadcast_to(v[:, None], (v.shape[0], size, v.shape[1]))
    else:
        v = jnp.moveaxis(v, bd, 1)
    return v.reshape(v.shape[0], -1)


@functools.cache
def _jitted_bind(primitive: Primitive, **params):
    return jax.jit(functools.partial(primitive.bind, **params))


def def_jitted_impl(primitive: Primitive) -> None:
    """Eager calls of ``primitive`` run its lowering, jitted once per set of params."""
    primitive.def_impl(lambda *operands, **params: _jitted_bind(primitive, **params)(*operands))
