"""The ``csr_matmul`` primitive: ``A @ X`` with every transformation rule in one place.

Reading order (as in ``jax.experimental.sparse``): primitive -> public function ->
impl -> abstract eval -> JVP -> transpose -> batching -> lowerings.

Operands of the primitive: ``x`` (2-D, ``(n, F)``), then ``data`` when the matrix
has values, then the index arrays of :class:`~jaxcsr.kernels.xla.Pattern` that are
present. Static params: ``info`` (:class:`MatmulInfo`), ``reduce`` (``"sum"``,
``"max"`` or ``"min"``: the semiring; ``"mean"`` is a sum divided outside the
primitive), ``impl`` and ``interpret``.

The sum is bilinear in ``(X, data)``: its JVP binds the primitive on the tangents and
its transpose is the product with the planned transpose (and an SDDMM for ``data``).
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
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

try:  # the public spelling; jax.core's aliases are being retired
    from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future jax
    from jax._src.core import ShapedArray
from jax.interpreters import ad, batching, mlir

from jaxcsr.kernels import gpu as gpu_kernels
from jaxcsr.kernels import tpu as tpu_kernels
from jaxcsr.kernels import xla as xla_kernels
from jaxcsr.kernels.xla import Pattern

if TYPE_CHECKING:
    from jaxcsr.matrix import CSRMatrix

__all__ = ["IMPLS", "REDUCTIONS", "MatmulInfo", "csr_matmul_p", "matmul"]

IMPLS: tuple[str | None, ...] = (None, "xla", "pallas_gpu", "pallas_tpu")
REDUCTIONS: tuple[str, ...] = ("sum", "mean", "max", "min")
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class MatmulInfo:
    """Static description of the matrix side of a product (hashable)."""

    shape: tuple[int, int]
    has_data: bool
    has_row_of_col: bool
    has_col_of_row: bool
    identity_columns: bool
    t_identity_columns: bool

    def transpose(self) -> MatmulInfo:
        return MatmulInfo(
            (self.shape[1], self.shape[0]),
            self.has_data,
            self.has_col_of_row,
            self.has_row_of_col,
            self.t_identity_columns,
            self.identity_columns,
        )


csr_matmul_p = Primitive("csr_matmul")


def _pack(x: jax.Array, data: jax.Array | None, pattern: Pattern) -> list[Any]:
    operands: list[Any] = [x]
    if data is not None:
        operands.append(data)
    operands.extend(pattern.flat())
    return operands


def _unpack(operands: Any, info: MatmulInfo) -> tuple[Any, Any, Pattern]:
    x, *rest = operands
    data = rest.pop(0) if info.has_data else None
    return x, data, Pattern.unflat(rest, info.has_row_of_col, info.has_col_of_row)


def _bind(x, data, pattern: Pattern, info: MatmulInfo, **params) -> jax.Array:
    """Binds the primitive; ``params`` are the static ``reduce``, ``impl``, ``interpret``."""
    return csr_matmul_p.bind(*_pack(x, data, pattern), info=info, **params)


def _check_impl(impl: str | None, interpret: bool) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {interpret!r}")


def matmul(
    A: CSRMatrix,
    X: Any,
    *,
    reduce: str = "sum",
    return_arg: bool = False,
    impl: str | None = None,
    interpret: bool = False,
) -> Any:
    """Sparse x dense product ``A @ X``, or its max/min/mean semiring variant.

    ``out[i] = reduce_k data[k] * X[indices[k]]`` over the stored entries ``k`` of row
    ``i`` (duplicate entries count separately; a one-valued matrix has no multiply).

    Args:
      A: a :class:`~jaxcsr.CSRMatrix` of shape ``(m, n)``.
      X: dense array of shape ``(n,)`` or ``(n, *features)``; float16, bfloat16,
        float32, float64 (with x64) or integer. Trailing dimensions are flattened
        into one feature axis internally.
      reduce: ``"sum"`` (the matrix product), ``"mean"`` (the sum divided by the
        row's number of stored entries; floor division for integers, as
        torch_scatter), ``"max"`` or ``"min"``. Empty rows give 0 for every reduce
        (torch_scatter's convention; ``jax.ops.segment_max`` gives ``-inf``). NaN
        propagates into every reduce.
      return_arg: with ``reduce="max"``/``"min"``, also return the column index
        attaining each output element (ties: the first stored entry of the row,
        i.e. the smallest column); empty rows get the sentinel ``n = A.shape[1]``.
      impl: ``None`` picks the backend for the platform (the Pallas GPU kernel on
        CUDA for 16/32-bit floats, else XLA); ``"xla"`` forces the XLA path;
        ``"pallas_gpu"`` forces the Triton kernel, ``"pallas_tpu"`` the Mosaic
        block-sparse kernel (both float16/bfloat16/float32 only). ``None`` picks the
        TPU kernel on TPU as well. Every reduce runs on every impl.
      interpret: run a Pallas impl in Pallas interpret mode on CPU.

    Returns:
      Array of shape ``(m,)`` or ``(m, *features)``, or ``(out, arg)`` with
      ``return_arg=True`` (``arg`` int32, same shape). The dtype is ``X.dtype`` for a
      one-valued matrix, else the promotion of ``A.dtype`` and ``X.dtype``. Sums of
      16-bit floats are accumulated in float32. Gradients: exact for ``mean``; for
      ``max``/``min`` they flow to the attaining entry only (the tie choice above).

    Raises:
      TypeError: ``X`` is not a numeric array (booleans included), complex ``X`` with
        ``reduce="max"``/``"min"``, or ``impl="pallas_gpu"``/``"pallas_tpu"`` with a
        dtype the kernel does not support.
      ValueError: ``X`` has rank 0 or ``X.shape[0] != A.shape[1]``; unknown ``impl``
        or ``reduce``; ``return_arg`` with a reduce other than max/min.
      NotImplementedError: (when traced) a Pallas impl on a platform it does not
        target, without ``interpret=True``.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> from jaxcsr import CSRMatrix, matmul
      >>> A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0]), num_rows=4)
      >>> matmul(A, jnp.arange(5.0))
      Array([4., 3., 3., 0.], dtype=float32)
      >>> matmul(A, jnp.arange(5.0), reduce="max", return_arg=True)
      (Array([4., 3., 2., 0.], dtype=float32), Array([4, 3, 2, 5], dtype=int32))
    """
    from jaxcsr.matrix import CSRMatrix

    if not isinstance(A, CSRMatrix):
        raise TypeError(f"A must be a jaxcsr.CSRMatrix, got {type(A).__name__}")
    _check_impl(impl, interpret)
    _check_reduce(reduce, return_arg)
    if isinstance(X, CSRMatrix):
        raise TypeError("X must be a dense array; sparse @ sparse is not supported")
    X = jnp.asarray(X)
    if X.dtype == np.bool_ or not (jnp.issubdtype(X.dtype, jnp.number)):
        raise TypeError(f"X must have a numeric dtype, got {X.dtype}")
    if X.ndim == 0:
        raise ValueError("X must have rank >= 1, got a scalar (shape ())")
    if reduce in xla_kernels.EXTREMES and (
        jnp.issubdtype(X.dtype, jnp.complexfloating)
        or (A.dtype is not None and jnp.issubdtype(A.dtype, jnp.complexfloating))
    ):
        raise TypeError(f"reduce={reduce!r} needs real dtypes, got X {X.dtype}, A {A.dtype}")
    if impl in _KERNEL_PLATFORMS:  # fail before tracing, naming the dtypes
        _pallas_kernel(impl, _KERNEL_PLATFORMS[impl], X.dtype, A.dtype)
    m, n = A.shape
    if X.shape[0] != n:
        raise ValueError(f"X.shape[0] must equal A.shape[1] = {n}, got X.shape = {X.shape}")
    features = X.shape[1:]
    x2 = X.reshape(n, int(np.prod(features, dtype=np.int64)))
    semiring = "sum" if reduce == "mean" else reduce
    params = dict(reduce=semiring, impl=impl, interpret=interpret)
    out = _bind(x2, A.data, A.pattern, A.matmul_info, **params)
    if reduce == "mean":
        out = _divide_by_degree(out, A.pattern)
    if not return_arg:
        return out.reshape((m, *features))
    arg = _arg_columns(x2, A.data, A.pattern, out, n)
    return out.reshape((m, *features)), arg.reshape((m, *features))


def _check_reduce(reduce: str, return_arg: bool) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if not isinstance(return_arg, bool):
        raise TypeError(f"return_arg must be a bool, got {return_arg!r}")
    if return_arg and reduce not in xla_kernels.EXTREMES:
        raise ValueError(f"return_arg=True needs reduce='max' or 'min', got {reduce!r}")


def _divide_by_degree(total: jax.Array, pattern: Pattern) -> jax.Array:
    """Row sums -> row means; empty rows stay 0. Integers use floor division."""
    degree = jnp.maximum(xla_kernels.row_degrees(pattern), 1)[:, None]
    if jnp.issubdtype(total.dtype, jnp.integer):
        return jnp.floor_divide(total, degree.astype(total.dtype))
    acc = xla_kernels.accumulation_dtype(total.dtype)
    return (total.astype(acc) / degree.astype(acc)).astype(total.dtype)


def _arg_columns(x, data, pattern: Pattern, out: jax.Array, n: int) -> jax.Array:
    """Column attaining each max/min (``n`` for empty rows); not differentiable."""
    x, data, out = jax.lax.stop_gradient((x, data, out))
    position = xla_kernels.extreme_positions(x, data, pattern, out)
    columns = jnp.append(pattern.indices.astype(jnp.int32), jnp.int32(n))
    return columns[position]


# ---------------------------------------------------------------- impl / eval
def _strategy_for(info: MatmulInfo, on_cpu: bool) -> str:
    return xla_kernels.choose_strategy(
        has_row_of_col=info.has_row_of_col,
        has_col_of_row=info.has_col_of_row,
        identity_columns=info.identity_columns,
        on_cpu=on_cpu,
    )


_KERNEL_PLATFORMS = {"pallas_gpu": "cuda", "pallas_tpu": "tpu"}


def _pallas_kernel(impl: str | None, platform: str, x_dtype, data_dtype) -> str | None:
    """The Pallas impl that runs (``"pallas_gpu"``/``"pallas_tpu"``), or ``None`` for XLA."""
    dtypes_ok = np.dtype(x_dtype) in _KERNEL_DTYPES and (
        data_dtype is None or np.dtype(data_dtype) in _KERNEL_DTYPES
    )
    if impl in _KERNEL_PLATFORMS:
        if not dtypes_ok:
            raise TypeError(
                f"impl={impl!r} supports float16/bfloat16/float32, got X {x_dtype}"
                f" and data {data_dtype}"
            )
        return impl
    if impl is None and dtypes_ok:
        return {p: k for k, p in _KERNEL_PLATFORMS.items()}.get(platform)
    return None


def _lowered_impl(
    *operands, info: MatmulInfo, reduce: str, impl: str | None, interpret: bool, platform: str
) -> jax.Array:
    """What runs on one platform: a Pallas kernel or an XLA strategy."""
    x, data, pattern = _unpack(operands, info)
    data_dtype = None if data is None else data.dtype
    kernel = _pallas_kernel(impl, platform, x.dtype, data_dtype)
    m, n = info.shape
    if kernel is not None:
        if platform != _KERNEL_PLATFORMS[kernel] and not interpret:
            raise NotImplementedError(
                f"impl={kernel!r} needs platform {_KERNEL_PLATFORMS[kernel]!r} (platform is "
                f"{platform!r}); pass interpret=True to run it in Pallas interpret mode"
            )
        if m == 0 or n == 0 or x.shape[1] == 0 or pattern.indices.shape[0] == 0:
            out = jnp.zeros((m, x.shape[1]), jnp.float32)
        elif kernel == "pallas_gpu":
            out = gpu_kernels.spmm(
                x,
                data,
                pattern.items,
                pattern.indices,
                num_rows=m,
                reduce=reduce,
                interpret=interpret,
            )
        else:
            out = _tpu_spmm(x, data, pattern, m, reduce, interpret)
        if reduce != "sum":  # the kernels leave -inf/+inf in empty rows
            out = xla_kernels.zero_empty_rows(out, pattern)
    elif reduce == "sum":
        strategy = _strategy_for(info, on_cpu=platform == "cpu")
        out = xla_kernels.spmm(x, data, pattern, shape=info.shape, strategy=strategy)
    else:
        strategy = _strategy_for(info, on_cpu=platform == "cpu")
        out = xla_kernels.spmm_extreme(
            x, data, pattern, shape=info.shape, strategy=strategy, reduce=reduce
        )
    return out.astype(xla_kernels.product_dtype(x.dtype, data_dtype))


def _tpu_spmm(x, data, pattern: Pattern, m: int, reduce: str, interpret: bool) -> jax.Array:
    """Gathers X's rows into nonzero order (XLA), then the block-sparse TPU kernel."""
    values = xla_kernels.entry_values(x, data, pattern)
    if values.dtype == np.float16:  # the MXU takes bfloat16 and float32
        values = values.astype(jnp.float32)
    return tpu_kernels.spmm(
        values,
        xla_kernels.row_ids(pattern),
        pattern.tiles,
        num_rows=m,
        reduce=reduce,
        # The TPU interpreter (pltpu.InterpretParams) runs on io_callbacks with ordered
        # effects, which a primitive's lowering cannot host; the primitive uses the
        # generic Pallas interpreter and tests run the kernel under both.
        interpret=interpret,
    )


@functools.cache
def _jitted_primitive(info: MatmulInfo, reduce: str, impl: str | None, interpret: bool):
    return jax.jit(
        functools.partial(
            csr_matmul_p.bind, info=info, reduce=reduce, impl=impl, interpret=interpret
        )
    )


def _eager_impl(
    *operands, info: MatmulInfo, reduce: str, impl: str | None, interpret: bool
) -> jax.Array:
    return _jitted_primitive(info, reduce, impl, interpret)(*operands)


csr_matmul_p.def_impl(_eager_impl)


@csr_matmul_p.def_abstract_eval
def _abstract_eval(*operands, info: MatmulInfo, **params):
    del params
    x, data, _ = _unpack(operands, info)
    dtype = xla_kernels.product_dtype(x.dtype, None if data is None else data.dtype)
    return ShapedArray((info.shape[0], x.shape[1]), dtype)


# ------------------------------------------------------------------------ JVP
def _jvp(primals, tangents, *, info: MatmulInfo, **params):
    x, data, pattern = _unpack(primals, info)
    x_dot, data_dot, _ = _unpack(tangents, info)
    out = _bind(x, data, pattern, info, **params)
    if params["reduce"] != "sum":
        return out, _extreme_tangent(x, data, pattern, out, x_dot, data_dot, info, params)
    parts = []
    if type(x_dot) is not ad.Zero:
        parts.append(_bind(x_dot, data, pattern, info, **params))
    if data_dot is not None and type(data_dot) is not ad.Zero:
        parts.append(_bind(x, data_dot, pattern, info, **params))
    if not parts:
        return out, jnp.zeros_like(out)
    tangent = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return out, tangent.astype(out.dtype)


def _extreme_tangent(
    x, data, pattern: Pattern, out, x_dot, data_dot, info: MatmulInfo, params
) -> jax.Array:
    """Tangent of a max/min: the input tangents taken at the attaining entries."""
    nnz = pattern.indices.shape[0]
    x_live = type(x_dot) is not ad.Zero
    data_live = data_dot is not None and type(data_dot) is not ad.Zero
    if nnz == 0 or not (x_live or data_live):
        return jnp.zeros_like(out)
    sum_params = {**params, "reduce": "sum"}
    if pattern.row_of_col is not None:
        # <= 1 nonzero per column (from_indices): the tangent is a masked sum,
        # A @ (mask * x_dot), whose transpose is a row gather times the mask.
        mask = jax.lax.stop_gradient(xla_kernels.extreme_column_mask(x, data, pattern, out))
        tangent = jnp.zeros(out.shape, out.dtype)
        if x_live:
            masked = jnp.where(mask, x_dot, jnp.zeros((), x_dot.dtype))
            tangent = tangent + _bind(masked, data, pattern, info, **sum_params)
        if data_live:
            masked = jnp.where(mask, x, jnp.zeros((), x.dtype))
            tangent = tangent + _bind(masked, data_dot, pattern, info, **sum_params)
        return tangent.astype(out.dtype)
    position = jax.lax.stop_gradient(xla_kernels.extreme_positions(x, data, pattern, out))
    valid = position < nnz
    position = jnp.minimum(position, nnz - 1)
    columns = pattern.indices[position]  # (m, F)
    acc = xla_kernels.accumulation_dtype(out.dtype)
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
def _transpose(ct, *operands, info: MatmulInfo, **params):
    if params["reduce"] != "sum":  # their JVPs bind only the sum on tangents
        raise ValueError(f"csr_matmul with reduce={params['reduce']!r} is not linear")
    x, data, pattern = _unpack(operands, info)
    if any(ad.is_undefined_primal(a) for a in pattern.flat()):
        raise ValueError("csr_matmul is not linear in the matrix's index arrays")
    cts: list[Any] = [None] * len(operands)
    if type(ct) is ad.Zero:
        return cts
    if ad.is_undefined_primal(x) and data is not None and ad.is_undefined_primal(data):
        raise ValueError("csr_matmul is bilinear: transpose w.r.t. only one of X, data")
    if ad.is_undefined_primal(x):
        t_data = None if data is None else data[pattern.t_perm]
        x_ct = _bind(ct, t_data, pattern.transpose(), info.transpose(), **params)
        cts[0] = x_ct.astype(x.aval.dtype)
    if data is not None and ad.is_undefined_primal(data):
        cts[1] = xla_kernels.sddmm(ct, x, pattern, out_dtype=data.aval.dtype)
    return cts


ad.primitive_transposes[csr_matmul_p] = _transpose


# ------------------------------------------------------------------- batching
def _batch(batched_args, batch_dims, *, info: MatmulInfo, **params):
    x, data, pattern = _unpack(batched_args, info)
    x_bd, data_bd, pattern_bd = _unpack(batch_dims, info)
    if any(bd is not None for bd in pattern_bd.flat()):
        raise ValueError(
            "vmap over the index structure of a CSRMatrix is not supported: the "
            "structure is static. Map over the values (with_data) or the dense operand."
        )
    if data_bd is None:
        # Fold the batch into the feature axis: (n, B, F) -> (n, B * F).
        x3 = jnp.moveaxis(x, x_bd, 1)
        n, b, f = x3.shape
        out = _bind(x3.reshape(n, b * f), data, pattern, info, **params)
        return out.reshape(info.shape[0], b, f), 1
    # Batched values: one product per set of values.
    data = jnp.moveaxis(data, data_bd, 0)
    if x_bd is None:
        out = jax.lax.map(lambda d: _bind(x, d, pattern, info, **params), data)
    else:
        x = jnp.moveaxis(x, x_bd, 0)
        out = jax.lax.map(lambda dx: _bind(dx[1], dx[0], pattern, info, **params), (data, x))
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
