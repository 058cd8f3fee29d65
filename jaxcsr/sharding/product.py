"""The sharded product: one jitted ``shard_map`` per :class:`~jaxcsr.sharding.spec.Spec`
and reduction, each device running its block's default backend, then the relayout of
block rows into the output's even row split (a ``ppermute`` halo)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcsr.matrix import CSRMatrix
from jaxcsr.sharding.row_blocks import rows_per_part
from jaxcsr.sharding.spec import Spec

__all__ = ["sharded_product"]


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` in ``sharding`` (``reshard`` on explicit mesh axes, a constraint else)."""
    if _explicit(sharding.mesh):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def sharded_product(
    spec: Spec,
    x: jax.Array,
    index_leaves: tuple,
    data: jax.Array | None,
    relayout_maps: tuple[jax.Array, jax.Array] | None,
    input_order: jax.Array | None,
    *,
    reduce: str,
    return_arg: bool,
):
    """``A @ x`` over the blocks: ``index_leaves`` (the blocks' stacked index arrays),
    ``data`` (laid-out values, or ``None``), ``relayout_maps`` (``(send, recv)``,
    ``None`` when aligned) and ``input_order`` (segment-form values in input order,
    laid out inside the blocks by it; ``None``: ``x`` is laid out already, or SpMM)."""
    in_order = input_order is not None
    x_spec = P(spec.axis) if spec.form == "segment" and not in_order else P()
    operands = [_place(x, NamedSharding(spec.mesh, x_spec)), *index_leaves]
    if data is not None:  # new values (with_data) may come in any layout
        operands.append(_place(data, NamedSharding(spec.mesh, P(spec.axis))))
    if relayout_maps is not None:
        operands += list(relayout_maps)
    if in_order:
        operands.append(input_order)
    return _sharded_function(spec, reduce, return_arg, in_order)(*operands)


@functools.lru_cache(maxsize=256)
def _sharded_function(spec: Spec, reduce: str, return_arg: bool, in_order: bool = False):
    """The jitted ``shard_map`` of one plan and reduction (cached: eager calls compile
    once; inside an outer ``jit`` it is inlined)."""
    axis = spec.axis
    shards, (m, _) = int(spec.mesh.shape[spec.axis]), spec.shape
    specs = [P(axis) if spec.form == "segment" and not in_order else P()]
    specs += [P(axis)] * spec.index_tree.num_leaves
    specs += [P(axis)] * spec.has_data + [P(axis), P(axis)] * (not spec.aligned)
    specs += [P(axis)] * in_order
    body = functools.partial(
        _block_product,
        spec=spec,
        rows=rows_per_part(m, shards),
        reduce=reduce,
        return_arg=return_arg,
        in_order=in_order,
    )
    out_specs = (P(axis), P(axis)) if return_arg else P(axis)
    mapped = jax.shard_map(
        body, mesh=spec.mesh, in_specs=tuple(specs), out_specs=out_specs, check_vma=False
    )
    trim = functools.partial(_trim, m=m, mesh=spec.mesh)

    def run(*operands):
        out = mapped(*operands)
        return (trim(out[0]), trim(out[1])) if return_arg else trim(out)

    return jax.jit(run)


def _trim(out: jax.Array, *, m: int, mesh) -> jax.Array:
    """The ``m`` real rows of the ``shards * rows`` computed ones.

    Rows split evenly need nothing. Otherwise the result cannot keep a row sharding
    (JAX shards a dimension only in equal parts): Explicit axes replicate it first
    (an all-gather), Auto axes let XLA place the slice. Pick ``m`` divisible by the
    shard count (pad with empty rows) to keep the output sharded.
    """
    if out.shape[0] == m:
        return out
    if _explicit(mesh):
        out = jax.sharding.reshard(out, NamedSharding(mesh, P()))
    return out[:m]


def _explicit(mesh) -> bool:
    return any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))


def _block_product(x, *rest, spec: Spec, rows: int, reduce: str, return_arg: bool, in_order: bool):
    queue = list(rest)
    leaves = [queue.pop(0)[0] for _ in range(spec.index_tree.num_leaves)]
    data = queue.pop(0) if spec.has_data else None
    send, recv = (queue.pop(0)[0], queue.pop(0)[0]) if not spec.aligned else (None, None)
    order = queue.pop(0) if in_order else None  # this block's input positions, -1: pad
    if in_order:  # lay this block's edges out from the replicated input-order values
        x = x.at[order].get(mode="fill", fill_value=0, wrap_negative_indices=False)
    index = jax.tree_util.tree_unflatten(spec.index_tree, leaves)
    block = CSRMatrix(data, index)
    out = block.product(x, reduce=reduce, return_arg=return_arg, impl=None, interpret=False)
    if not return_arg:
        return _relayout(out, send, recv, spec, rows)
    out, arg = out
    k_b = spec.block_cols
    if order is not None:  # block column j holds input position order[j]
        position = order[jnp.minimum(arg, k_b - 1)]
        arg = jnp.where(arg < k_b, position, spec.shape[1]).astype(arg.dtype)
    elif spec.form == "segment":  # block column j of device p is laid-out column p*K_b + j
        p = lax.axis_index(spec.axis)
        arg = jnp.where(arg < k_b, arg + p * k_b, spec.layout_size).astype(arg.dtype)
    return _relayout(out, send, recv, spec, rows), _relayout(arg, send, recv, spec, rows)


def _relayout(block_out, send, recv, spec: Spec, rows: int):
    """A block's rows -> this device's part of the even row split (ppermute halo)."""
    if spec.aligned:
        return block_out[:rows]
    shards = int(spec.mesh.shape[spec.axis])
    out = jnp.zeros((rows, *block_out.shape[1:]), block_out.dtype)
    for i, shift in enumerate(spec.shifts):
        buf = block_out[send[i]]
        if shift:
            perm = [(p, p + shift) for p in range(shards) if 0 <= p + shift < shards]
            buf = lax.ppermute(buf, spec.axis, perm)
        out = out.at[recv[i]].set(buf, mode="drop")
    return out
