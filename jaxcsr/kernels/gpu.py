"""Pallas GPU kernel (Triton backend): load-balanced, row-tiled CSR x dense product.

Schedule (planned on the host by this module, :func:`plan_work_items`, into a
:class:`GpuPlan` the matrix carries when built with ``backends=`` including
``"pallas_gpu"``): the nonzeros
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

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxcsr.structure import Structure

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


# ------------------------------------------------------------------ host plan
@dataclasses.dataclass(frozen=True)
class WorkItems:
    """A load-balanced split of a CSR matrix's nonzeros into bounded work items.

    Item ``t`` reduces nonzeros ``start[t]:end[t]`` (at most ``chunk`` of them), all
    in row ``row[t]``. A row longer than ``chunk`` is split over several items
    (their partial sums are combined by atomic adds), so one huge row cannot
    serialise a kernel; empty rows get no item (the output starts at zero).

    The arrays have :func:`work_item_capacity` entries -- a function of ``(m, nnz)``
    only, so matrices of equal shape and nnz share one compilation; the slots after
    the real items are empty (``start == end``).
    """

    row: Any
    start: Any
    end: Any
    chunk: int
    items_per_program: int

    @property
    def num_programs(self) -> int:
        return self.row.shape[0] // self.items_per_program


jax.tree_util.register_dataclass(
    WorkItems, data_fields=["row", "start", "end"], meta_fields=["chunk", "items_per_program"]
)


def work_item_capacity(num_rows: int, nnz: int, chunk: int, items_per_program: int) -> int:
    """Upper bound on the items of any ``(num_rows, nnz)`` structure, whole programs.

    A row of length ``L`` takes ``ceil(L / chunk) <= L / chunk + 1`` items and at most
    ``min(num_rows, nnz)`` rows are non-empty, so ``ceil(nnz / chunk) + min(num_rows,
    nnz)`` items always suffice.
    """
    bound = -(-nnz // chunk) + min(num_rows, nnz)
    return max(1, -(-bound // items_per_program)) * items_per_program


def plan_work_items(indptr: np.ndarray, chunk: int = 0, items_per_program: int = 0) -> WorkItems:
    """Splits every row into items of at most ``chunk`` nonzeros (host, once).

    Defaults: :data:`CHUNK` and :data:`ITEMS_PER_PROGRAM`.
    """
    chunk = chunk or CHUNK
    items_per_program = items_per_program or ITEMS_PER_PROGRAM
    if chunk < 1 or items_per_program < 1:
        raise ValueError(
            f"chunk and items_per_program must be >= 1, got {chunk}, {items_per_program}"
        )
    indptr = np.asarray(indptr)
    lengths = np.diff(indptr).astype(np.int64)
    pieces = -(-lengths // chunk)  # ceil; 0 for empty rows
    row = np.repeat(np.arange(lengths.size, dtype=np.int64), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = indptr[:-1].astype(np.int64)[row] + (np.arange(row.size) - first) * chunk
    end = np.minimum(start + chunk, indptr[1:].astype(np.int64)[row])
    capacity = work_item_capacity(lengths.size, int(indptr[-1]), chunk, items_per_program)
    itype = indptr.dtype
    out = [np.zeros(capacity, itype) for _ in range(3)]
    for dst, src in zip(out, (row, start, end), strict=True):
        dst[: src.size] = src
    return WorkItems(*out, chunk, items_per_program)


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """What the Triton kernel reads beyond the portable core.

    Attributes:
      items: work items of the planned orientation ``C``.
      t_items: work items of ``C.T`` for ``"general"`` structures; ``None`` for the
        ``"columns"`` kind, whose transpose is a row gather (XLA's own gather does
        what a kernel would: one load per output row).
    """

    items: WorkItems
    t_items: WorkItems | None


jax.tree_util.register_dataclass(GpuPlan, data_fields=["items", "t_items"], meta_fields=[])


def plan(structure: Structure) -> GpuPlan:
    """The host plan for a host :class:`~jaxcsr.structure.Structure` (numpy leaves)."""
    indptr, t_indptr = structure.kernel_indptrs()
    t_items = None if t_indptr is None else plan_work_items(t_indptr)
    return GpuPlan(plan_work_items(indptr), t_items)


def product(
    x: jax.Array,
    data: jax.Array | None,
    structure: Structure,
    gpu_plan: GpuPlan,
    *,
    reduce: str,
    interpret: bool,
) -> jax.Array:
    """Kernel entry for the backend registry: the viewed matrix times ``x``, float32."""
    if structure.one_per_row:
        raise ValueError("a one-entry-per-row view is a row gather: the XLA path runs it")
    items = gpu_plan.t_items if structure.transposed else gpu_plan.items
    return spmm(
        x,
        data,
        items,
        structure.view_indices(),
        num_rows=structure.shape[0],
        reduce=reduce,
        interpret=interpret,
    )


# --------------------------------------------------------------------- kernel
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
    items: WorkItems,
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
      items: :class:`WorkItems` (from :func:`plan_work_items`).
      indices: ``(nnz,)`` CSR column indices.
      num_rows: ``m``.
      reduce: ``"sum"``, ``"max"`` or ``"min"``.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      ``(m, F)`` float32; for max/min, empty rows hold -inf/+inf.
    """
    n_features = x.shape[1]
    block_n, num_warps = tile_config(n_features)
    row, start, end = items.row, items.start, items.end
    num_programs = row.shape[0] // ITEMS_PER_PROGRAM
    num_blocks = pl.cdiv(n_features, block_n)
    padded = num_blocks * block_n
    if reduce == "sum":
        init = jnp.zeros((num_rows, padded), jnp.float32)
    else:
        fill = -jnp.inf if reduce == "max" else jnp.inf
        init = jnp.full((num_rows, padded), fill, jnp.float32)  # float32 under x64 too
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
