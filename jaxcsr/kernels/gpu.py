"""Pallas GPU kernel (Triton backend): load-balanced, row-tiled CSR x dense product.

Schedule (planned on the host, :func:`jaxcsr.plan.plan_work_items`): the nonzeros
are cut into *work items* of at most :data:`CHUNK` nonzeros, each inside one row;
a row longer than ``CHUNK`` spans several items, so a row with 100k nonzeros is
spread over thousands of programs instead of serialising one. Each program takes
:data:`ITEMS_PER_PROGRAM` consecutive items (several short rows per program) and
one block of ``block_n`` feature columns (a power of two; the tail is masked).

Per item the program walks its nonzeros, loads the gathered row ``x[col, cols]``
with a dynamic start (``pl.ds``), multiplies by the value (skipped for one-valued
matrices), accumulates in float32 and adds the partial row into the float32 output
with one atomic add (partials of a split row meet there). The output starts as
zeros (an aliased input), so empty rows are zeros; it is padded to whole column
blocks (sliced afterwards) so the atomic needs no mask. Float atomics make the
summation order, hence the last bits, vary between runs.

``reduce="max"``/``"min"`` swaps the semiring in the same kernel. Inside a work
item the products are reduced as int32 *order keys* (:func:`float_to_key`: the float
bits with the magnitude bits of negatives flipped, so integer order is float order;
NaN maps to the key that wins), then decoded and combined into the float32 output,
which starts at -inf/+inf, with a float ``atomic_max``/``atomic_min`` (Pallas
expands it into signed/unsigned integer atomics on the float bits). The NaN a
chunk carries has the sign bit that wins that expansion (+NaN for max, -NaN for
min), so NaN propagates. Integer atomics are order-independent: max/min results
are deterministic. The caller zeroes empty rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

CHUNK = 32
"""Most nonzeros one work item reduces (bounds the longest serial loop)."""
ITEMS_PER_PROGRAM = 4
"""Work items per program: packs short rows so no program idles on one of them."""

# feature width -> (block_n, num_warps); a block covers min(next_pow2(F), 128)
# columns. Chosen so that one warp covers 32 columns; not yet tuned on hardware.
TILE_TABLE: dict[int, tuple[int, int]] = {16: (16, 1), 32: (32, 1), 64: (64, 2), 128: (128, 4)}


_FLIP = 0x7FFFFFFF
_INT32_MAX = 2**31 - 1
_INT32_MIN = -(2**31)


def float_to_key(v: jax.Array, reduce: str) -> jax.Array:
    """float32 -> int32 key with the same order; NaN maps to the winning extreme."""
    bits = lax.bitcast_convert_type(v, jnp.int32)
    key = jnp.where(bits < 0, bits ^ _FLIP, bits)
    nan_key = _INT32_MAX if reduce == "max" else _INT32_MIN
    return jnp.where(jnp.isnan(v), jnp.int32(nan_key), key)


def key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of :func:`float_to_key`; the max NaN key decodes to +NaN, the min one to -NaN."""
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ _FLIP, key), jnp.float32)


def _identity_key(reduce: str) -> int:
    """Key of -inf (max) or +inf (min), computed on the host (a Python int)."""
    bits = int(np.array(-np.inf if reduce == "max" else np.inf, np.float32).view(np.int32))
    return bits ^ _FLIP if bits < 0 else bits


def tile_config(n_features: int) -> tuple[int, int]:
    """``(block_n, num_warps)`` for a feature width (see :data:`TILE_TABLE`)."""
    width = 16
    while width < min(n_features, 128):
        width *= 2
    return TILE_TABLE[width]


def _kernel(row_ref, start_ref, end_ref, idx_ref, *refs, has_data, block_n, n_features, reduce):
    if has_data:
        data_ref, x_ref, _, out_ref = refs
    else:
        x_ref, _, out_ref = refs
    program, block = pl.program_id(0), pl.program_id(1)
    col0 = block * block_n
    col_mask = col0 + jnp.arange(block_n) < n_features

    def item_body(t, carry):
        item = program * ITEMS_PER_PROGRAM + t
        row, start, end = row_ref[item], start_ref[item], end_ref[item]

        def nonzero_body(k, acc):
            col = idx_ref[k]
            vals = pltriton.load(x_ref.at[col, pl.ds(col0, block_n)], mask=col_mask, other=0)
            vals = vals.astype(jnp.float32)
            if has_data:
                vals = vals * data_ref[k].astype(jnp.float32)
            if reduce == "sum":
                return acc + vals
            combine = jnp.maximum if reduce == "max" else jnp.minimum
            return combine(acc, float_to_key(vals, reduce))

        if reduce == "sum":
            init = jnp.zeros((block_n,), jnp.float32)
        else:
            init = jnp.full((block_n,), _identity_key(reduce), jnp.int32)
        acc = lax.fori_loop(start, end, nonzero_body, init)
        if reduce != "sum":
            acc = key_to_float(acc)
        # Unmasked: the output is padded to whole column blocks and masked columns
        # (and empty items) add the identity. Pallas interpret mode has no masked atomics.
        atomic = {
            "sum": pltriton.atomic_add,
            "max": pltriton.atomic_max,
            "min": pltriton.atomic_min,
        }[reduce]
        atomic(out_ref, (row, pl.ds(col0, block_n)), acc)
        return carry

    lax.fori_loop(0, ITEMS_PER_PROGRAM, item_body, 0)


def spmm(
    x: jax.Array,
    data: jax.Array | None,
    items: tuple[jax.Array, jax.Array, jax.Array],
    indices: jax.Array,
    *,
    num_rows: int,
    reduce: str = "sum",
    interpret: bool = False,
) -> jax.Array:
    """``A @ x`` in float32 for ``x (n, F)``; ``items`` from ``plan_work_items``.

    Args:
      x: dense operand ``(n, F)``, float16/bfloat16/float32.
      data: ``(nnz,)`` values or ``None`` (one-valued: no multiply).
      items: ``(row, start, end)`` work-item arrays, padded to whole programs.
      indices: ``(nnz,)`` CSR column indices.
      num_rows: ``m``.
      reduce: ``"sum"``, ``"max"`` or ``"min"``.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      ``(m, F)`` float32; for max/min, empty rows hold -inf/+inf.
    """
    n_features = x.shape[1]
    block_n, num_warps = tile_config(n_features)
    row, start, end = items
    num_programs = row.shape[0] // ITEMS_PER_PROGRAM
    num_blocks = pl.cdiv(n_features, block_n)
    padded = num_blocks * block_n
    if reduce == "sum":
        init = jnp.zeros((num_rows, padded), jnp.float32)
    else:
        init = jnp.full((num_rows, padded), -jnp.inf if reduce == "max" else jnp.inf)
    operands = [row, start, end, indices, *([] if data is None else [data]), x, init]
    kernel = functools.partial(
        _kernel, has_data=data is not None, block_n=block_n, n_features=n_features, reduce=reduce
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, padded), init.dtype),
        grid=(num_programs, num_blocks),
        input_output_aliases={len(operands) - 1: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="jaxcsr_spmm",
    )(*operands)
    return out if padded == n_features else out[:, :n_features]
