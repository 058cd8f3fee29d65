"""The ``csr_matmul`` primitive, ``A @ X``, and the ``sddmm`` primitive, each with all
its transformation rules, one after the other.

They live together because each is the other's transpose: the product's values'
gradient is the sampled product, and the sampled product transposes into two products.
Reading order for each (as in ``jax.experimental.sparse``): primitive -> binding ->
impl -> abstract eval -> JVP -> transpose -> batching -> lowerings; the sampled
product's section is the last in the file. The public function is
:func:`jaxcsr.matmul` (in :mod:`jaxcsr.matrix`); this module knows nothing of
``CSRMatrix``: it takes an :class:`Index`, the matrix's planned structure, and runs
whatever backend the registry (:mod:`jaxcsr.kernels`) names -- it never branches on
a backend's name.

:func:`reduce_rows` is what every product means: the primitive for ``"sum"``,
``"max"`` and ``"min"`` (the semiring) and ``"mean"`` (the sum in the accumulation
dtype divided by the row degrees: in the kernel where the backend divides itself,
:attr:`Capabilities.mean <jaxcsr.kernels.Capabilities>`, else after it), and
``return_arg``'s search for the attaining columns. Empty products (no stored entry, or
no feature) are answered here, once, before any backend runs.

Operands of the primitive: ``x`` (2-D, ``(n, F)``), then ``data`` when the matrix
has values, then the leaves of the :class:`Index` (the portable
:class:`~jaxcsr.structure.Structure` and the per-backend plans). Static params:
``index_tree`` (the Index's treedef: layout, view and which plans are present),
``has_data``, ``reduce`` (``"sum"``, ``"mean"``, ``"max"`` or ``"min"``; a mean is
row-major with one value per entry), ``accumulate`` (return
the sum in the accumulation dtype -- float32 for 16-bit floats -- instead of rounding
it to the product dtype; what the mean divides), ``feature_major`` (``x`` is ``(F, n)``
and the result ``(F, m)``: the layout of ``values @ A.T``; sums only), ``impl`` and
``interpret``. A backend without feature-major products (:attr:`Capabilities.feature_major
<jaxcsr.kernels.Capabilities>`) gets the transposes around its row-major product.

The sum is bilinear in ``(X, data)``: its JVP binds the primitive on the tangents and
its transpose is the product with the transposed view (and an SDDMM for ``data``). So
is the mean: its transpose divides ``ct`` by the row degrees first, in the accumulation
dtype, and continues as the sum's.
Max and min are piecewise linear: their JVP takes the tangents at the entry that
attains each output, so the gradient reaches the arg positions only. For at most one
nonzero per column (``from_indices``) it is ``dX`` taken at the attaining columns
(:func:`jaxcsr.take_attaining.take_attaining`, a linear primitive whose transpose puts
``ct`` there in one pass) where a kernel has its own search, else the masked sum ``A @ (mask * dX)``
(:func:`arg_search`'s ``column_mask``), transposed by the sum's own rule;
otherwise a gather at its ``positions``, which JAX transposes into a scatter-add.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxcsr import kernels
from jaxcsr.dtypes import accumulation_dtype, product_dtype
from jaxcsr.primitive import ShapedArray, def_jitted_impl, map_over_batch
from jaxcsr.structure import Structure
from jaxcsr.take_attaining import take_attaining

__all__ = [
    "EXTREMES",
    "REDUCTIONS",
    "Index",
    "arg_search",
    "backend_for",
    "behind_barrier",
    "csr_matmul_p",
    "product",
    "reduce_rows",
    "sample",
    "sampler_for",
    "sddmm_p",
]

REDUCTIONS: tuple[str, ...] = ("sum", "mean", "max", "min")
"""``reduce=`` values of every product."""
EXTREMES: tuple[str, ...] = ("max", "min")
"""The reductions with an arg (``return_arg``) and a piecewise-linear gradient."""


@dataclasses.dataclass(frozen=True)
class Index:
    """What the product reads besides the values: the core and the backends' plans.

    Attributes:
      structure: the portable :class:`~jaxcsr.structure.Structure` (a view).
      plans: backend name -> that backend's plan pytree (``None`` for XLA).
    """

    structure: Structure
    plans: dict[str, Any]

    @classmethod
    def planned(cls, structure: Structure, backends: Any = None, *, required: bool = True) -> Index:
        """Plans ``backends`` (names, validated by
        :func:`~jaxcsr.kernels.resolve_backends`; ``None``: the defaults) on
        ``structure``: a host one (numpy leaves) gets host plans and stays on the host
        (moving the index to the device is the caller's), a device one (traced ids,
        :mod:`jaxcsr.device_plan`) gets the same plans computed in the trace. A backend
        whose plan takes host structures only (:attr:`~jaxcsr.kernels.Capabilities.plans_traced`)
        is left out of a device one (its platform runs the fallback) when it is a
        default or ``required`` is False; a requested one raises."""
        on_device = not structure.on_host
        plans = {}
        for name in kernels.resolve_backends(backends):
            backend = kernels.BACKENDS[name]
            if on_device and not backend.capabilities.plans_traced:
                if backends is not None and required:
                    raise ValueError(
                        f"backends: {name!r} cannot be planned on the device (traced "
                        "ids); build the matrix from concrete ids, or leave it out"
                    )
                continue
            plans[name] = backend.plan(structure)
        return cls(structure, plans)

    def transpose(self) -> Index:
        """The transposed view; plans cover both directions, so they are shared."""
        return Index(self.structure.transpose(), self.plans)


jax.tree_util.register_dataclass(Index, data_fields=["structure", "plans"], meta_fields=[])


csr_matmul_p = Primitive("csr_matmul")


def _unpack(operands: Any, index_tree, has_data: bool) -> tuple[Any, Any, Index]:
    x, *rest = operands
    data = rest.pop(0) if has_data else None
    return x, data, jax.tree_util.tree_unflatten(index_tree, rest)


def product(
    x,
    data,
    index: Index,
    *,
    accumulate: bool = False,
    feature_major: bool = False,
    data_transposed: bool = False,
    **params,
) -> jax.Array:
    """Binds the primitive: ``A @ x`` for a 2-D ``x``; ``params`` are ``reduce``,
    ``impl`` and ``interpret``. Returns ``(m, F)`` in the product dtype, or in its
    accumulation dtype with ``accumulate=True``; with ``feature_major=True`` (sums
    only), ``x`` is ``(F, n)`` and the result ``(F, m)``. With ``data_transposed=True``
    (sums of ``"general"`` views with values; the backward pass binds it), ``data`` is in
    the CSR order of the view's transpose: the lowering puts it in the view's order, or
    a backend that declares :attr:`~jaxcsr.kernels.Capabilities.transposed_data` reads it
    through the planned permutation itself. ``data`` of shape ``(nnz, H)`` (row-major
    sums; what ``vmap`` over per-head values and features binds) holds ``H`` values per
    entry, the ``h``-th weighing the ``h``-th of ``H`` equal blocks of ``x``'s features."""
    if (
        data is not None
        and data.ndim == 2
        and (
            feature_major
            or params["reduce"] != "sum"
            or (x.shape[1] % data.shape[1] if data.shape[1] else x.shape[1])  # 0 heads: 0 wide
        )
    ):
        raise ValueError("values per head: row-major sums over H equal blocks of features")
    if feature_major and params["reduce"] != "sum":
        raise ValueError(f"feature_major products are sums, got reduce={params['reduce']!r}")
    if params["reduce"] == "mean" and accumulate:
        raise ValueError("a mean is returned in the product dtype, not accumulated")
    if data_transposed and (
        params["reduce"] != "sum" or data is None or index.structure.layout.kind != "general"
    ):
        raise ValueError("data_transposed products are sums of general views with values")
    leaves, index_tree = jax.tree_util.tree_flatten(index)
    operands = [x, *([] if data is None else [data]), *leaves]
    return csr_matmul_p.bind(
        *operands,
        index_tree=index_tree,
        has_data=data is not None,
        accumulate=accumulate,
        feature_major=feature_major,
        data_transposed=data_transposed,
        **params,
    )


def behind_barrier(index: Index) -> Index:
    """``index`` behind an optimization barrier.

    A matrix closed over by a jitted function makes its index arrays XLA constants.
    The data gradient (SDDMM) and the arg search gather ``X[indices]`` and
    ``ct[rows]``; when ``X`` is a closed-over constant too (features in a GCN), XLA
    would constant-fold that ``(nnz, F)`` gather at every compilation. Behind the
    barrier the indices are opaque and the gather runs at run time. The products
    themselves keep constant indices (XLA:CPU runs some gathers with constant indices
    faster). Measurements: docs/design.md, "Matrices closed over as constants".
    """
    leaves, tree = jax.tree_util.tree_flatten(index)
    if not leaves:
        return index
    return jax.tree_util.tree_unflatten(tree, jax.lax.optimization_barrier(leaves))


def _out_dtype(x_dtype, data_dtype, accumulate: bool):
    dtype = product_dtype(x_dtype, data_dtype)
    return accumulation_dtype(dtype) if accumulate else dtype


def _is_empty(structure: Structure, width: int) -> bool:
    """No stored entry, no feature, or no row or column (a padded layout's entries are
    then all dropped): every product, arg and tangent is a constant. Answered here so
    that no backend sees an empty operand."""
    return structure.nnz == 0 or width == 0 or 0 in structure.shape


def reduce_rows(
    x: jax.Array,
    data: jax.Array | None,
    index: Index,
    *,
    reduce: str,
    return_arg: bool,
    impl: str | None,
    interpret: bool,
    feature_major: bool = False,
    data_transposed: bool = False,
) -> Any:
    """``A @ x`` for a 2-D ``x`` with any of :data:`REDUCTIONS` (validated by the caller).

    ``"mean"`` divides the sum, carried in the accumulation dtype, by the row degrees
    (floor division for integers) and rounds once; a view with one entry per row is
    its own max/min, so it runs the sum. ``return_arg`` adds the column attaining each
    max/min (sentinel ``n`` for empty rows), found by :func:`arg_search`. With
    ``feature_major`` (sum and mean, no arg), ``x`` is ``(F, n)`` and the result
    ``(F, m)``; ``data_transposed`` (sums) as in :func:`product`.
    """
    s = index.structure
    # the primitive's mean: row-major, one value per entry; else the sum, divided here
    divide_after = reduce == "mean" and (feature_major or (data is not None and data.ndim == 2))
    semiring = reduce
    if divide_after or (reduce in EXTREMES and s.one_per_row):
        semiring = "sum"
    if feature_major and return_arg:  # (product refuses a feature-major max/min)
        raise ValueError("feature_major products have no return_arg")
    out = product(
        x,
        data,
        index,
        reduce=semiring,
        accumulate=divide_after,
        feature_major=feature_major,
        data_transposed=data_transposed,
        impl=impl,
        interpret=interpret,
    )
    if divide_after:
        dtype = product_dtype(x.dtype, None if data is None else data.dtype)
        out = _divide_by_degree(out, s, dtype, feature_major)
    if not return_arg:
        return out
    x, data, found = jax.lax.stop_gradient((x, data, out))
    if _is_empty(s, x.shape[1]):
        return out, jnp.full(out.shape, s.shape[1], jnp.int32)
    return out, arg_search("columns", x, data, behind_barrier(index), found, impl)


def arg_search(kind: str, x, data, index: Index, out, impl: str | None) -> jax.Array:
    """The :class:`~jaxcsr.kernels.ArgSearch` function ``kind`` (``"positions"``,
    ``"columns"`` or ``"column_mask"``) of ``out``, the max/min of ``index``'s view.

    Each platform runs its kernel's own search where the matrix carries that kernel's
    plan, the kernel is available and has one, and ``impl`` is ``None`` or names it
    (chosen when lowered, by ``lax.platform_dependent``); every other case runs the
    fallback's. All answer the same (first hits)."""
    structure = index.structure
    fallback = getattr(kernels.fallback().capabilities.arg_search, kind)
    own = _own_searches(index, impl)
    branches = {p: _at_view(getattr(search, kind), structure) for p, search in own.items()}
    if not branches:
        return fallback(x, data, structure, out)
    return jax.lax.platform_dependent(
        x, data, out, default=_at_view(fallback, structure), **branches
    )


def _own_searches(index: Index, impl: str | None) -> dict[str, kernels.ArgSearch]:
    """Platform -> the :class:`~jaxcsr.kernels.ArgSearch` of its kernel, where the
    matrix carries that kernel's plan, the kernel is available and has one, and
    ``impl`` is ``None`` or names it."""
    own = {}
    for platform in PLATFORMS:
        name = kernels.platform_kernel(platform)
        if name is None or name not in index.plans or impl not in (None, name):
            continue
        backend = kernels.BACKENDS[name]
        search = backend.capabilities.arg_search
        if search is not None and backend.available():
            own[platform] = search
    return own


def _at_view(search, structure: Structure):
    return lambda x, data, out: search(x, data, structure, out)


def _divide_by_degree(
    total: jax.Array, structure: Structure, dtype, feature_major: bool = False
) -> jax.Array:
    """Row sums (accumulation dtype; ``(m, F)``, or ``(F, m)`` feature-major) -> row
    means in ``dtype``: each sum times the float reciprocal of its row's degree, rounded
    once; empty rows stay 0. Integers use floor division."""
    degree = jnp.maximum(structure.degrees(), 1).astype(total.dtype)
    degree = degree[None, :] if feature_major else degree[:, None]
    if jnp.issubdtype(total.dtype, jnp.integer):
        return jnp.floor_divide(total, degree).astype(dtype)
    # times the reciprocals, as XLA rewrites a division by a broadcast anyway (and as the
    # kernels that divide their own means do): one rounding more than a division
    return (total * (1 / degree)).astype(dtype)


# ---------------------------------------------------------------- impl / eval
def backend_for(
    impl: str | None, platform: str, index: Index, x_dtype, data_dtype, reduce: str | None
) -> kernels.Backend:
    """The registry entry that runs the view on ``platform``.

    A view the backend does not cover (one entry per row, for the Pallas kernels)
    runs on the fallback. An explicit ``impl`` runs where its plan is present (the
    caller checked); an explicit backend this jax cannot run raises. ``impl=None``
    runs the platform's kernel when the matrix carries its plan, the dtypes suit it,
    the backend is the default for the view (:attr:`~jaxcsr.kernels.Coverage.default_for`)
    and this jax ships what the kernel is written in (else one warning per process),
    and the fallback otherwise.
    """
    view = index.structure
    if impl is not None:
        backend = kernels.BACKENDS[impl]
        if not backend.coverage.covers(view):
            return kernels.fallback()
        backend.require_available()
        return backend
    name = kernels.platform_kernel(platform)
    if name is None or name not in index.plans:
        return kernels.fallback()
    backend = kernels.BACKENDS[name]
    if not backend.available():
        backend.warn_unavailable()
        return kernels.fallback()
    if not (backend.coverage.supports(x_dtype, data_dtype) and backend.coverage.covers(view)):
        return kernels.fallback()
    if backend.coverage.default_for(view, product_dtype(x_dtype, data_dtype), reduce):
        return backend
    return kernels.fallback()


def _lowered_impl(
    *operands,
    index_tree,
    has_data,
    accumulate: bool,
    feature_major: bool,
    data_transposed: bool,
    reduce: str,
    impl,
    interpret: bool,
    platform: str,
) -> jax.Array:
    """What runs on one platform: the chosen backend's product (between transposes,
    for a feature-major product on a backend without them; after the values are put
    in the view's order, for ``data_transposed`` on a backend that does not read them
    through the permutation itself; one product per head, for values per head on a
    backend that does not take them)."""
    x, data, index = _unpack(operands, index_tree, has_data)
    s = index.structure
    data_dtype = None if data is None else data.dtype
    out_dtype = _out_dtype(x.dtype, data_dtype, accumulate)
    width = x.shape[0] if feature_major else x.shape[1]
    if _is_empty(s, width):
        shape = (width, s.shape[0]) if feature_major else (s.shape[0], width)
        return jnp.zeros(shape, out_dtype)
    mean = reduce == "mean"
    summed = "sum" if mean else reduce
    backend = backend_for(impl, platform, index, x.dtype, data_dtype, summed)
    if backend.platform not in (None, platform) and not interpret:
        raise NotImplementedError(
            f"impl={backend.name!r} needs platform {backend.platform!r} (platform is "
            f"{platform!r}); pass interpret=True to run it in Pallas interpret mode"
        )
    native = feature_major and backend.capabilities.feature_major
    options = {"feature_major": True} if native else {}
    reads = backend.capabilities.transposed_data
    if data_transposed and reads is not None and reads(s, platform, x.dtype, data_dtype, out_dtype):
        options["data_transposed"] = True
    elif data_transposed:
        data = s.transpose().transpose_values(data)

    def run(x, data, reduce=reduce, out_dtype=out_dtype):
        return backend.product(
            x, data, s, index.plans.get(backend.name), reduce=reduce, out_dtype=out_dtype,
            interpret=interpret, platform=platform, **options,
        )  # fmt: skip

    if mean:  # row-major, one value per entry (product checked)
        divides = backend.capabilities.mean
        if divides is not None and divides(s, platform, x.dtype, data_dtype, out_dtype, width):
            return run(x, data)
        total = run(x, data, "sum", accumulation_dtype(out_dtype))
        return _divide_by_degree(total, s, out_dtype)

    if data is not None and data.ndim == 2:  # values per head
        takes = backend.capabilities.heads
        if takes is None or not takes(s, platform, x.dtype, data_dtype, out_dtype):
            width = x.shape[1] // data.shape[1]
            blocks = [x[:, h * width : (h + 1) * width] for h in range(data.shape[1])]
            return jnp.concatenate([run(b, data[:, h]) for h, b in enumerate(blocks)], axis=1)
        return run(x, data)
    out = run(x.T if feature_major and not native else x, data)
    return out.T if feature_major and not native else out


def_jitted_impl(csr_matmul_p)


@csr_matmul_p.def_abstract_eval
def _abstract_eval(*operands, index_tree, has_data, accumulate, feature_major, **params):
    del params
    x, data, index = _unpack(operands, index_tree, has_data)
    dtype = _out_dtype(x.dtype, None if data is None else data.dtype, accumulate)
    m = index.structure.shape[0]
    return ShapedArray((x.shape[0], m) if feature_major else (m, x.shape[1]), dtype)


# ------------------------------------------------------------------------ JVP
def _jvp(primals, tangents, *, index_tree, has_data, **params):
    x, data, index = _unpack(primals, index_tree, has_data)
    x_dot, data_dot, _ = _unpack(tangents, index_tree, has_data)
    out = product(x, data, index, **params)
    if params["reduce"] in EXTREMES:
        return out, _extreme_tangent(x, data, index, out, x_dot, data_dot, params)
    mean = params["reduce"] == "mean"
    if mean:  # the tangent as the sum, accumulated, then divided: rounded once
        params = {**params, "reduce": "sum", "accumulate": True}
    parts = []
    if type(x_dot) is not ad.Zero:
        parts.append(product(x_dot, data, index, **params))
    if data_dot is not None and type(data_dot) is not ad.Zero:
        parts.append(product(x, data_dot, index, **params))
    if not parts:
        return out, jnp.zeros_like(out)
    tangent = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    if mean:
        return out, _divide_by_degree(tangent, index.structure, out.dtype)
    return out, tangent.astype(out.dtype)


def _extreme_tangent(x, data, index: Index, out, x_dot, data_dot, params) -> jax.Array:
    """Tangent of a max/min: the input tangents taken at the attaining entries."""
    s = index.structure
    nnz = s.nnz
    x_live = type(x_dot) is not ad.Zero
    data_live = data_dot is not None and type(data_dot) is not ad.Zero
    if _is_empty(s, x.shape[1]) or not (x_live or data_live):
        return jnp.zeros_like(out)
    impl = params["impl"]
    sum_params = {**params, "reduce": "sum", "accumulate": False}
    if s.one_per_column:
        own = _own_searches(index, impl)

        def masked_sum(x, data, out, x_dot, data_dot):
            # <= 1 nonzero per column (from_indices): the tangent is a masked sum,
            # A @ (mask * x_dot), whose transpose is a row gather times the mask.
            search = kernels.fallback().capabilities.arg_search.column_mask
            mask = search(*jax.lax.stop_gradient((x, data)), s, jax.lax.stop_gradient(out))
            tangent = jnp.zeros(out.shape, out.dtype)
            if x_live:
                masked = jnp.where(mask, x_dot, jnp.zeros((), x_dot.dtype))
                tangent = tangent + product(masked, data, index, **sum_params)
            if data_live:
                masked = jnp.where(mask, x, jnp.zeros((), x.dtype))
                tangent = tangent + product(masked, data_dot, index, **sum_params)
            return tangent.astype(out.dtype)

        if not own:
            return masked_sum(x, data, out, x_dot, data_dot)
        # A kernel's own search: the tangents at the (m, F) attaining columns
        # (take_attaining), whose transpose writes the (n, F) gradient in one pass
        # (the mask's product and where pass n * F twice).
        branches = {p: _at_columns(own[p], s) for p in own}
        return jax.lax.platform_dependent(
            x, data, out, x_dot if x_live else None, data_dot if data_live else None,
            default=masked_sum, **branches,
        )  # fmt: skip
    # the searches are integer-valued: their inputs carry no tangent (higher orders)
    found_in = jax.lax.stop_gradient((x, data, out))
    position = arg_search("positions", *found_in[:2], index, found_in[2], impl)
    valid = position < nnz
    position = jnp.minimum(position, nnz - 1)
    columns = s.view_indices()[position]  # (m, F)
    at = _Attaining(columns, valid, lambda values: values[position])
    return at.tangent(x, data, out, x_dot if x_live else None, data_dot if data_live else None)


@dataclasses.dataclass(frozen=True)
class _Attaining:
    """The entries attaining a max/min: ``columns`` ``(m, F)`` of X (valid where
    ``valid``), ``weights(v)``, per-entry values ``v`` (the matrix data or its
    tangent) taken there, and ``take(v)``, ``v (n, F)`` taken at the columns (by
    default ``take_along_axis``, which JAX transposes into a scatter-add)."""

    columns: jax.Array
    valid: jax.Array
    weights: Any
    take: Any = None

    def tangent(self, x, data, out, x_dot, data_dot) -> jax.Array:
        """``x_dot * data + x * data_dot`` at the attaining entries (a ``None``
        tangent: none), 0 where none attains; in ``out``'s dtype."""
        acc = accumulation_dtype(out.dtype)
        total = jnp.zeros(out.shape, acc)
        if x_dot is not None:
            if self.take is None:
                part = jnp.take_along_axis(x_dot, self.columns, axis=0).astype(acc)
            else:
                part = self.take(x_dot).astype(acc)
            total = total + (part if data is None else part * self.weights(data).astype(acc))
        if data_dot is not None:
            part = jnp.take_along_axis(x, self.columns, axis=0).astype(acc)
            total = total + part * self.weights(data_dot).astype(acc)
        return jnp.where(self.valid, total, 0).astype(out.dtype)


def _at_columns(search: kernels.ArgSearch, structure: Structure):
    """One-per-column views: the max/min's tangent from the ``(m, F)`` columns that
    ``search`` finds (``n``: an empty row, tangent 0), ``x_dot[column] * data`` plus
    ``x[column] * data_dot`` at each; its transpose is the search's ``put_attaining``."""

    def tangent(x, data, out, x_dot, data_dot):
        n = x.shape[0]
        x_, data_, out_ = jax.lax.stop_gradient((x, data, out))
        found = search.columns(x_, data_, structure, out_)
        valid = found < n
        columns = jnp.minimum(found, n - 1)
        rows = structure.column_rows()
        at = _Attaining(
            columns,
            valid,
            lambda values: structure.column_values(values)[columns],
            lambda values: take_attaining(values, found, rows, put=search.put_attaining),
        )
        return at.tangent(x, data, out, x_dot, data_dot)

    return tangent


ad.primitive_jvps[csr_matmul_p] = _jvp


# ------------------------------------------------------------------ transpose
def _transpose(ct, *operands, index_tree, has_data, **params):
    if params["reduce"] in EXTREMES:  # their JVPs bind only the sum on tangents
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
    if params["reduce"] == "mean":
        # the mean's rounding transposes into ct in the accumulation dtype, its division
        # into ct divided by the degrees; the rest is the accumulated sum's transpose
        acc = accumulation_dtype(ct.dtype)
        ct = _divide_by_degree(ct.astype(acc), s, acc)
        params = {**params, "reduce": "sum", "accumulate": True}
    flipped = params["data_transposed"]
    if ad.is_undefined_primal(x):
        t_data, t_params = data, params
        if data is not None and s.layout.kind == "general":
            # the values stay as they are: in the transpose's order, the product on the
            # transpose reads them as its own (flag off) or through the permutation
            t_params = {**params, "data_transposed": not flipped}
        elif data is not None:
            t_data = s.transpose_values(data)
        params = t_params
        t_index = index.transpose()
        if params["accumulate"] and data is None and t_index.structure.one_per_row:
            # a row gather (the mean's backward): each value is one of ct's, so round
            # ct to x's dtype first and gather that, not an (n, F) float32 copy
            ct = ct.astype(x.aval.dtype)
            params = {**params, "accumulate": False}
        x_ct = product(ct, t_data, t_index, **params)
        cts[0] = x_ct.astype(x.aval.dtype)
    if data is not None and ad.is_undefined_primal(data):  # the sampled product
        ct_rows, x_rows = (ct.T, x.T) if params["feature_major"] else (ct, x)
        per_head = len(data.aval.shape) == 2  # values (nnz, H)
        heads = data.aval.shape[1] if per_head else 1
        width = ct_rows.shape[1] // heads if heads else 0  # no -1: arrays may be empty
        sampled = sample(
            ct_rows.reshape(ct_rows.shape[0], heads, width),
            x_rows.reshape(x_rows.shape[0], heads, width),
            behind_barrier(index),
            out_dtype=data.aval.dtype,
        )
        sampled = sampled if per_head else sampled[:, 0]
        cts[1] = s.transpose_values(sampled) if flipped else sampled
    return cts


ad.primitive_transposes[csr_matmul_p] = _transpose


# ------------------------------------------------------------------- batching
def _batch(batched_args, batch_dims, *, index_tree, has_data, **params):
    x, data, index = _unpack(batched_args, index_tree, has_data)
    x_bd, *index_bd = batch_dims
    data_bd = index_bd.pop(0) if has_data else None
    per_head = has_data and data.ndim - (data_bd is not None) == 2  # values (nnz, H)
    if any(bd is not None for bd in index_bd) or (per_head and data_bd is None):
        # one structure per batch element, or a batch of features for values per head

        def bind(*operands):
            return csr_matmul_p.bind(*operands, index_tree=index_tree, has_data=has_data, **params)

        return map_over_batch(bind, batched_args, batch_dims), 0
    m = index.structure.shape[0]
    if data_bd is None and params["feature_major"]:
        # Fold the batch into the feature axis: (B, F, n) -> (B * F, n).
        x3 = jnp.moveaxis(x, x_bd, 0)
        b, f, n = x3.shape
        out = product(x3.reshape(b * f, n), data, index, **params)
        return out.reshape(b, f, m), 0
    if data_bd is None:
        # Fold the batch into the feature axis: (n, B, F) -> (n, B * F).
        x3 = jnp.moveaxis(x, x_bd, 1)
        n, b, f = x3.shape
        out = product(x3.reshape(n, b * f), data, index, **params)
        return out.reshape(m, b, f), 1
    heads = data.shape[data_bd]
    row_major_sum = params["reduce"] == "sum" and not params["feature_major"]
    if not per_head and x_bd is not None and row_major_sum and heads <= UNROLLED_VALUE_SETS:
        # Values and features per head (attention): one product with H values per entry,
        # (n, H, F) -> (n, H * F), each head's values weighing its block of features.
        x3 = jnp.moveaxis(x, x_bd, 1)
        n, _, f = x3.shape
        out = product(x3.reshape(n, heads * f), jnp.moveaxis(data, data_bd, 1), index, **params)
        return out.reshape(m, heads, f), 1
    # Other batched values: one product per set of values; a few sets as separate
    # products in the program, more in a loop.
    data = jnp.moveaxis(data, data_bd, 0)
    x = x if x_bd is None else jnp.moveaxis(x, x_bd, 0)

    def one(d, x_one):
        return product(x_one, d, index, **params)

    if data.shape[0] <= UNROLLED_VALUE_SETS:
        return jnp.stack([one(d, x if x_bd is None else x[i]) for i, d in enumerate(data)]), 0
    if x_bd is None:
        return jax.lax.map(lambda d: one(d, x), data), 0
    return jax.lax.map(lambda dx: one(*dx), (data, x)), 0


UNROLLED_VALUE_SETS = 16
"""``vmap`` over at most this many sets of values (per-head attention weights) binds one
product per set; more run in a ``lax.map`` loop, whose per-iteration cost small
products cannot repay."""


batching.primitive_batchers[csr_matmul_p] = _batch


# ------------------------------------------------------------------ lowerings
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
"""JAX platforms the primitive lowers for (one lowering each, told its platform)."""


def _register_lowerings(primitive: Primitive, lowered: Any) -> None:
    """One lowering of ``primitive`` per platform in :data:`PLATFORMS`, told its platform."""
    for platform in PLATFORMS:
        mlir.register_lowering(
            primitive,
            mlir.lower_fun(functools.partial(lowered, platform=platform), multiple_results=False),
            platform=platform,
        )


_register_lowerings(csr_matmul_p, _lowered_impl)


# ----------------------------------------------------------------------- sddmm
sddmm_p = Primitive("sddmm")
"""``(nnz, H)`` = ``x (m, H, F)`` and ``y (n, H, F)`` sampled at the index's stored
entries: ``sum_f x[row_k, h, f] * y[col_k, h, f]`` (the values' gradient of
:data:`csr_matmul_p`; public as :func:`jaxcsr.sddmm`). Bilinear in ``(x, y)``: its JVP
binds it on the tangents, its transpose is two planned products, ``dx = A_h @ y`` and
``dy = A_h.T @ x`` with ``A_h`` the pattern holding ``ct[:, h]``; ``vmap`` folds the
batch into the heads axis."""


def sample(x: jax.Array, y: jax.Array, index: Index, *, out_dtype) -> jax.Array:
    """:data:`sddmm_p` of ``x (m, H, F)``, ``y (n, H, F)`` at ``index``: ``(nnz, H)``."""
    leaves, index_tree = jax.tree_util.tree_flatten(index)
    return sddmm_p.bind(x, y, *leaves, index_tree=index_tree, out_dtype=jnp.dtype(out_dtype))


@sddmm_p.def_abstract_eval
def _sddmm_abstract_eval(x, y, *leaves, index_tree, out_dtype):
    nnz = jax.tree_util.tree_unflatten(index_tree, leaves).structure.nnz
    return ShapedArray((nnz, x.shape[1]), out_dtype)


def sampler_for(platform: str, index: Index, *dtypes) -> Any:
    """The ``sddmm`` that runs on ``platform``: its kernel's own, when the matrix carries
    that kernel's plan, the kernel is available and takes these dtypes; else the
    fallback's."""
    name = kernels.platform_kernel(platform)
    backend = None if name is None else kernels.BACKENDS[name]
    if (
        backend is not None
        and backend.capabilities.sddmm is not None
        and name in index.plans
        and backend.available()
        and backend.coverage.supports(*dtypes)
    ):
        return backend.capabilities.sddmm
    return kernels.fallback().capabilities.sddmm


def _sddmm_lowered(x, y, *leaves, index_tree, out_dtype, platform: str) -> jax.Array:
    """What runs on one platform: the sampled product of :func:`sampler_for`, all heads."""
    index = jax.tree_util.tree_unflatten(index_tree, leaves)
    structure = index.structure
    if _is_empty(structure, x.shape[2]):
        return jnp.zeros((structure.nnz, x.shape[1]), out_dtype)
    sampler = sampler_for(platform, index, x.dtype, y.dtype)
    return sampler(x, y, structure, out_dtype=out_dtype)


def _sddmm_jvp(primals, tangents, *, index_tree, out_dtype):
    x, y, *leaves = primals
    dx, dy, *_ = tangents
    params = {"index_tree": index_tree, "out_dtype": out_dtype}
    out = sddmm_p.bind(x, y, *leaves, **params)
    parts = []
    if type(dx) is not ad.Zero:
        parts.append(sddmm_p.bind(dx, y, *leaves, **params))
    if type(dy) is not ad.Zero:
        parts.append(sddmm_p.bind(x, dy, *leaves, **params))
    if not parts:
        return out, ad.Zero.from_primal_value(out)
    return out, parts[0] if len(parts) == 1 else parts[0] + parts[1]


ad.primitive_jvps[sddmm_p] = _sddmm_jvp


def _sddmm_batch(args, dims, *, index_tree, out_dtype):
    """The batch joins the heads axis: ``(m, B, H, F) -> (m, B * H, F)``."""
    x, y, *leaves = args
    x_bd, y_bd, *leaf_bds = dims
    if any(bd is not None for bd in leaf_bds):  # one structure per batch element

        def bind(*operands):
            return sddmm_p.bind(*operands, index_tree=index_tree, out_dtype=out_dtype)

        return map_over_batch(bind, args, dims), 0
    size = x.shape[x_bd] if x_bd is not None else y.shape[y_bd]

    def fold(v, bd):  # (m, H, F) batched at bd -> (m, size * H, F)
        if bd is None:
            v = jnp.broadcast_to(v[:, None], (v.shape[0], size, *v.shape[1:]))
        else:
            v = jnp.moveaxis(v, bd, 1)
        return v.reshape(v.shape[0], size * v.shape[2], v.shape[3])

    out = sddmm_p.bind(
        fold(x, x_bd), fold(y, y_bd), *leaves, index_tree=index_tree, out_dtype=out_dtype
    )
    return out.reshape(out.shape[0], size, -1), 1


batching.primitive_batchers[sddmm_p] = _sddmm_batch


def _sddmm_transpose(ct, x, y, *leaves, index_tree, out_dtype):
    """``dx[:, h] = A_h @ y[:, h]`` and ``dy[:, h] = A_h.T @ x[:, h]``, ``A_h`` the
    pattern holding ``ct[:, h]``: the planned products, one per head."""
    if any(ad.is_undefined_primal(leaf) for leaf in leaves):
        raise ValueError("sddmm is not linear in the matrix's index arrays")
    cts: list[Any] = [None] * (2 + len(leaves))
    if type(ct) is ad.Zero:
        return cts
    index = jax.tree_util.tree_unflatten(index_tree, leaves)
    view = index.structure

    def products(ct_h, dense_h, transposed):
        if transposed:  # A_h.T: its values in the transposed view's CSR order
            return product(
                dense_h, view.transpose_values(ct_h), index.transpose(),
                reduce="sum", impl=None, interpret=False,
            )  # fmt: skip
        return product(dense_h, ct_h, index, reduce="sum", impl=None, interpret=False)

    if ad.is_undefined_primal(x):
        dx = jax.vmap(products, in_axes=(1, 1, None), out_axes=1)(ct, y, False)
        cts[0] = dx.astype(x.aval.dtype)
    if ad.is_undefined_primal(y):
        dy = jax.vmap(products, in_axes=(1, 1, None), out_axes=1)(ct, x, True)
        cts[1] = dy.astype(y.aval.dtype)
    return cts


ad.primitive_transposes[sddmm_p] = _sddmm_transpose
def_jitted_impl(sddmm_p)
_register_lowerings(sddmm_p, _sddmm_lowered)
