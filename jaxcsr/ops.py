"""The ``csr_matmul`` primitive: ``A @ X`` with every transformation rule in one place.

Reading order (as in ``jax.experimental.sparse``): primitive -> binding -> impl ->
abstract eval -> JVP -> transpose -> batching -> lowerings. The public function is
:func:`jaxcsr.matmul` (in :mod:`jaxcsr.matrix`); this module knows nothing of
``CSRMatrix``: it takes an :class:`Index`, the matrix's planned structure.

Operands of the primitive: ``x`` (2-D, ``(n, F)``), then ``data`` when the matrix
has values, then the leaves of the :class:`Index` (the portable
:class:`~jaxcsr.structure.Structure` and the per-backend plans). Static params:
``index_tree`` (the Index's treedef: layout, view and which plans are present),
``has_data``, ``reduce`` (``"sum"``, ``"max"`` or ``"min"``: the semiring; ``"mean"``
is a sum divided outside the primitive), ``accumulate`` (return the sum in the
accumulation dtype -- float32 for 16-bit floats -- instead of rounding it to the
product dtype; what the mean divides), ``impl`` and ``interpret``.

The sum is bilinear in ``(X, data)``: its JVP binds the primitive on the tangents and
its transpose is the product with the transposed view (and an SDDMM for ``data``).
Max and min are piecewise linear: their JVP takes the tangents at the entry that
attains each output, so the gradient reaches the arg positions only. For at most one
nonzero per column (``from_indices``) it is the masked sum ``A @ (mask * dX)``
(:func:`jaxcsr.kernels.xla.extreme_column_mask`), transposed by the sum's own rule;
otherwise a gather at :func:`jaxcsr.kernels.xla.extreme_positions`, which JAX
transposes into a scatter-add.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

try:  # the public spelling; jax.core's aliases are being retired
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future jax
    from jax._src.core import ShapedArray
from jax.interpreters import ad, batching, mlir

from jaxcsr import kernels
from jaxcsr.dtypes import accumulation_dtype, product_dtype
from jaxcsr.kernels import xla as xla_kernels
from jaxcsr.structure import Structure

__all__ = [
    "IMPLS",
    "REDUCTIONS",
    "STATIC_STRUCTURE_MESSAGE",
    "Index",
    "ShapedArray",
    "def_jitted_impl",
    "csr_matmul_p",
    "opaque",
    "product",
]

IMPLS: tuple[str | None, ...] = (None, *kernels.BACKENDS)
"""``impl=`` values: ``None`` (the platform's planned kernel, else XLA) or a backend."""
REDUCTIONS: tuple[str, ...] = ("sum", "mean", "max", "min")
STATIC_STRUCTURE_MESSAGE = (
    "vmap over a stack of CSRMatrix structures (batched index arrays) is not supported: "
    "the structure is static (planned on the host). What works: lax.scan or a "
    "Python loop over the stack; vmap over the values (A.with_data) or the dense operand "
    "of one matrix; for many small graphs, one block-diagonal matrix (offset the ids)."
)
"""The error every transformation rule raises when ``vmap`` batches a matrix's structure."""


@dataclasses.dataclass(frozen=True)
class Index:
    """What the product reads besides the values: the core and the backends' plans.

    Attributes:
      structure: the portable :class:`~jaxcsr.structure.Structure` (a view).
      plans: backend name -> that backend's plan pytree (``None`` for XLA).
    """

    structure: Structure
    plans: dict[str, Any]

    def transpose(self) -> Index:
        """The transposed view; plans cover both directions, so they are shared."""
        return Index(self.structure.transpose(), self.plans)


jax.tree_util.register_dataclass(Index, data_fields=["structure", "plans"], meta_fields=[])


csr_matmul_p = Primitive("csr_matmul")


def _unpack(operands: Any, index_tree, has_data: bool) -> tuple[Any, Any, Index]:
    x, *rest = operands
    data = rest.pop(0) if has_data else None
    return x, data, jax.tree_util.tree_unflatten(index_tree, rest)


def product(x, data, index: Index, *, accumulate: bool = False, **params) -> jax.Array:
    """Binds the primitive: ``A @ x`` for a 2-D ``x``; ``params`` are ``reduce``,
    ``impl`` and ``interpret``. Returns ``(m, F)`` in the product dtype, or in its
    accumulation dtype with ``accumulate=True``."""
    leaves, index_tree = jax.tree_util.tree_flatten(index)
    operands = [x, *([] if data is None else [data]), *leaves]
    return csr_matmul_p.bind(
        *operands,
        index_tree=index_tree,
        has_data=data is not None,
        accumulate=accumulate,
        **params,
    )


def opaque(index: Index) -> Index:
    """``index`` behind an optimization barrier.

    A matrix closed over by a jitted function makes its index arrays XLA constants.
    The data gradient (SDDMM) gathers ``X[indices]`` and ``ct[rows]``; when ``X`` is
    a closed-over constant too (features in a GCN), XLA constant-folds that
    ``(nnz, F)`` gather at every compilation (1.3 s for 1M entries, F = 16, on
    tolokers). Behind the barrier the indices are opaque and the gather runs at run
    time. The products themselves keep constant indices: XLA:CPU runs some gathers
    with constant indices faster (bfloat16 row gathers: 4.2 vs 6.1 ms on tolokers).
    """
    leaves, tree = jax.tree_util.tree_flatten(index)
    if not leaves:
        return index
    return jax.tree_util.tree_unflatten(tree, jax.lax.optimization_barrier(leaves))


def _out_dtype(x_dtype, data_dtype, accumulate: bool):
    dtype = product_dtype(x_dtype, data_dtype)
    return accumulation_dtype(dtype) if accumulate else dtype


# ---------------------------------------------------------------- impl / eval
def kernel_for(impl: str | None, platform: str, index: Index, x_dtype, data_dtype) -> str | None:
    """The Pallas backend that runs the view on ``platform``, or ``None`` for XLA.

    An explicit kernel ``impl`` runs where its plan is present (the caller checked);
    ``impl=None`` runs the platform's kernel when the matrix carries its plan, the
    dtypes suit it and this jax ships what the kernel is written in (else one warning
    per process and XLA); an explicit kernel this jax cannot run raises. One-per-row
    views (row gathers) run on XLA everywhere.
    """
    if index.structure.one_per_row or impl == "xla":
        return None
    if impl is not None:
        kernels.BACKENDS[impl].require_available()
        return impl
    name = kernels.platform_kernel(platform)
    if name is None or name not in index.plans:
        return None
    if not kernels.BACKENDS[name].available():
        kernels.BACKENDS[name].warn_unavailable()
        return None
    return name if kernels.BACKENDS[name].supports(x_dtype, data_dtype) else None


def _lowered_impl(
    *operands,
    index_tree,
    has_data,
    accumulate: bool,
    reduce: str,
    impl,
    interpret: bool,
    platform: str,
) -> jax.Array:
    """What runs on one platform: a Pallas kernel or an XLA strategy."""
    x, data, index = _unpack(operands, index_tree, has_data)
    s = index.structure
    data_dtype = None if data is None else data.dtype
    kernel = kernel_for(impl, platform, index, x.dtype, data_dtype)
    m, n = s.shape
    if kernel is not None:
        backend = kernels.BACKENDS[kernel]
        if platform != backend.platform and not interpret:
            raise NotImplementedError(
                f"impl={kernel!r} needs platform {backend.platform!r} (platform is "
                f"{platform!r}); pass interpret=True to run it in Pallas interpret mode"
            )
        out_dtype = _out_dtype(x.dtype, data_dtype, accumulate)
        if m == 0 or n == 0 or x.shape[1] == 0 or s.nnz == 0:
            return jnp.zeros((m, x.shape[1]), out_dtype)
        # The kernels return ``out_dtype`` with empty rows zero for every reduction.
        return backend.product(
            x,
            data,
            s,
            index.plans[kernel],
            reduce=reduce,
            out_dtype=out_dtype,
            interpret=interpret,
        )
    elif reduce == "sum":
        strategy = xla_kernels.choose_strategy(s, on_cpu=platform == "cpu", width=x.shape[1])
        out = xla_kernels.spmm(x, data, s, strategy=strategy)
    else:
        out = xla_kernels.spmm_extreme(x, data, s, reduce=reduce)
    return out.astype(_out_dtype(x.dtype, data_dtype, accumulate))


@functools.cache
def _jitted_bind(primitive: Primitive, **params):
    return jax.jit(functools.partial(primitive.bind, **params))


def def_jitted_impl(primitive: Primitive) -> None:
    """Eager calls of ``primitive`` run its lowering, jitted once per set of params."""
    primitive.def_impl(lambda *operands, **params: _jitted_bind(primitive, **params)(*operands))


def_jitted_impl(csr_matmul_p)


@csr_matmul_p.def_abstract_eval
def _abstract_eval(*operands, index_tree, has_data, accumulate, **params):
    del params
    x, data, index = _unpack(operands, index_tree, has_data)
    dtype = _out_dtype(x.dtype, None if data is None else data.dtype, accumulate)
    return ShapedArray((index.structure.shape[0], x.shape[1]), dtype)


# ------------------------------------------------------------------------ JVP
def _jvp(primals, tangents, *, index_tree, has_data, **params):
    x, data, index = _unpack(primals, index_tree, has_data)
    x_dot, data_dot, _ = _unpack(tangents, index_tree, has_data)
    out = product(x, data, index, **params)
    if params["reduce"] != "sum":
        return out, _extreme_tangent(x, data, index, out, x_dot, data_dot, params)
    parts = []
    if type(x_dot) is not ad.Zero:
        parts.append(product(x_dot, data, index, **params))
    if data_dot is not None and type(data_dot) is not ad.Zero:
        parts.append(product(x, data_dot, index, **params))
    if not parts:
        return out, jnp.zeros_like(out)
    tangent = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return out, tangent.astype(out.dtype)


def _extreme_tangent(x, data, index: Index, out, x_dot, data_dot, params) -> jax.Array:
    """Tangent of a max/min: the input tangents taken at the attaining entries."""
    s = index.structure
    nnz = s.nnz
    x_live = type(x_dot) is not ad.Zero
    data_live = data_dot is not None and type(data_dot) is not ad.Zero
    if nnz == 0 or not (x_live or data_live):
        return jnp.zeros_like(out)
    sum_params = {**params, "reduce": "sum", "accumulate": False}
    if s.one_per_column:
        # <= 1 nonzero per column (from_indices): the tangent is a masked sum,
        # A @ (mask * x_dot), whose transpose is a row gather times the mask.
        mask = jax.lax.stop_gradient(xla_kernels.extreme_column_mask(x, data, s, out))
        tangent = jnp.zeros(out.shape, out.dtype)
        if x_live:
            masked = jnp.where(mask, x_dot, jnp.zeros((), x_dot.dtype))
            tangent = tangent + product(masked, data, index, **sum_params)
        if data_live:
            masked = jnp.where(mask, x, jnp.zeros((), x.dtype))
            tangent = tangent + product(masked, data_dot, index, **sum_params)
        return tangent.astype(out.dtype)
    position = jax.lax.stop_gradient(xla_kernels.extreme_positions(x, data, s, out))
    valid = position < nnz
    position = jnp.minimum(position, nnz - 1)
    columns = s.view_indices()[position]  # (m, F)
    acc = accumulation_dtype(out.dtype)
    tangent = jnp.zeros(out.shape, acc)
    if x_live:
        part = jnp.take_along_axis(x_dot, columns, axis=0).astype(acc)
        tangent = tangent + (part if data is None else part * data[position].astype(acc))
    if data_live:
        part = jnp.take_along_axis(x, columns, axis=0).astype(acc)
        tangent = tangent + part * data_dot[position].astype(acc)
    return jnp.where(valid, tangent, 0).astype(out.dtype)


ad.primitive_jvps[csr_matmul_p] = _jvp


# ------------------------------------------------------------------ transpose
def _transpose(ct, *operands, index_tree, has_data, **params):
    if params["reduce"] != "sum":  # their JVPs bind only the sum on tangents
        raise ValueError(f"csr_matmul with reduce={params['reduce']!r} is not linear")
    x, data, index = _unpack(operands, index_tree, has_data)
    if any(ad.is_undefined_primal(a) for a in jax.tree_util.tree_leaves(index)):
        raise ValueError("csr_matmul is not linear in the matrix's index arrays")
    cts: list[Any] = [None] * len(operands)
    if type(ct) is ad.Zero:
        return cts
    if ad.is_undefined_primal(x) and data is not None and ad.is_undefined_primal(data):
        raise ValueError("csr_matmul is bilinear: transpose w.r.t. only one of X, data")
    s = index.structure
    if ad.is_undefined_primal(x):
        t_data = None if data is None else s.transpose_values(data)
        x_ct = product(ct, t_data, index.transpose(), **params)
        cts[0] = x_ct.astype(x.aval.dtype)
    if data is not None and ad.is_undefined_primal(data):
        cts[1] = xla_kernels.sddmm(ct, x, opaque(index).structure, out_dtype=data.aval.dtype)
    return cts


ad.primitive_transposes[csr_matmul_p] = _transpose


# ------------------------------------------------------------------- batching
def _batch(batched_args, batch_dims, *, index_tree, has_data, **params):
    x, data, index = _unpack(batched_args, index_tree, has_data)
    x_bd, *index_bd = batch_dims
    data_bd = index_bd.pop(0) if has_data else None
    if any(bd is not None for bd in index_bd):
        raise ValueError(STATIC_STRUCTURE_MESSAGE)
    m = index.structure.shape[0]
    if data_bd is None:
        # Fold the batch into the feature axis: (n, B, F) -> (n, B * F).
        x3 = jnp.moveaxis(x, x_bd, 1)
        n, b, f = x3.shape
        out = product(x3.reshape(n, b * f), data, index, **params)
        return out.reshape(m, b, f), 1
    # Batched values: one product per set of values.
    data = jnp.moveaxis(data, data_bd, 0)
    if x_bd is None:
        out = jax.lax.map(lambda d: product(x, d, index, **params), data)
    else:
        x = jnp.moveaxis(x, x_bd, 0)
        out = jax.lax.map(lambda dx: product(dx[1], dx[0], index, **params), (data, x))
    return out, 0


batching.primitive_batchers[csr_matmul_p] = _batch


# ------------------------------------------------------------------ lowerings
for _platform in ("cpu", "cuda", "rocm", "tpu"):
    mlir.register_lowering(
        csr_matmul_p,
        mlir.lower_fun(
            functools.partial(_lowered_impl, platform=_platform), multiple_results=False
        ),
        platform=_platform,
    )
