"""The ``csr_matmul`` primitive: ``A @ X`` with every transformation rule in one place.

Reading order (as in ``jax.experimental.sparse``): primitive -> public function ->
impl -> abstract eval -> JVP -> transpose -> batching -> lowerings.

Operands of the primitive: ``x`` (2-D, ``(n, F)``), then ``data`` when the matrix
has values, then the index arrays of :class:`~jaxcsr.kernels.xla.Pattern` that are
present. Static params: ``info`` (:class:`MatmulInfo`), ``impl`` and ``interpret``.
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

__all__ = ["IMPLS", "MatmulInfo", "csr_matmul_p", "matmul"]

IMPLS: tuple[str | None, ...] = (None, "xla", "pallas_gpu", "pallas_tpu")
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
    """Binds the primitive; ``params`` are the static ``impl`` and ``interpret``."""
    return csr_matmul_p.bind(*_pack(x, data, pattern), info=info, **params)


def _result_dtype(x_dtype: Any, data_dtype: Any | None) -> np.dtype:
    if data_dtype is None:
        return np.dtype(x_dtype)
    return np.dtype(jnp.result_type(data_dtype, x_dtype))


def _check_impl(impl: str | None, interpret: bool) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {interpret!r}")


def matmul(A: CSRMatrix, X: Any, *, impl: str | None = None, interpret: bool = False) -> jax.Array:
    """Sparse x dense product ``A @ X``.

    Args:
      A: a :class:`~jaxcsr.CSRMatrix` of shape ``(m, n)``.
      X: dense array of shape ``(n,)`` or ``(n, *features)``; float16, bfloat16,
        float32, float64 (with x64) or integer. Trailing dimensions are flattened
        into one feature axis internally.
      impl: ``None`` picks the backend for the platform (the Pallas GPU kernel on
        CUDA for 16/32-bit floats, else XLA); ``"xla"`` forces the XLA path;
        ``"pallas_gpu"`` forces the Triton kernel, ``"pallas_tpu"`` the Mosaic
        block-sparse kernel (both float16/bfloat16/float32 only). ``None`` picks the
        TPU kernel on TPU as well.
      interpret: run a Pallas impl in Pallas interpret mode on CPU.

    Returns:
      Array of shape ``(m,)`` or ``(m, *features)``. Its dtype is ``X.dtype`` for a
      one-valued matrix, else the promotion of ``A.dtype`` and ``X.dtype``. Sums of
      16-bit floats are accumulated in float32.

    Raises:
      TypeError: ``X`` is not a numeric array (booleans included), or
        ``impl="pallas_gpu"`` with a dtype the kernel does not support.
      ValueError: ``X`` has rank 0 or ``X.shape[0] != A.shape[1]``; unknown ``impl``.
      NotImplementedError: (when traced) a Pallas impl on a platform it does not
        target, without ``interpret=True``.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> from jaxcsr import CSRMatrix, matmul
      >>> A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0]), num_rows=3)
      >>> matmul(A, jnp.arange(5.0))
      Array([4., 3., 3.], dtype=float32)
    """
    from jaxcsr.matrix import CSRMatrix

    if not isinstance(A, CSRMatrix):
        raise TypeError(f"A must be a jaxcsr.CSRMatrix, got {type(A).__name__}")
    _check_impl(impl, interpret)
    if isinstance(X, CSRMatrix):
        raise TypeError("X must be a dense array; sparse @ sparse is not supported")
    X = jnp.asarray(X)
    if X.dtype == np.bool_ or not (jnp.issubdtype(X.dtype, jnp.number)):
        raise TypeError(f"X must have a numeric dtype, got {X.dtype}")
    if X.ndim == 0:
        raise ValueError("X must have rank >= 1, got a scalar (shape ())")
    if impl in _KERNEL_PLATFORMS:  # fail before tracing, naming the dtypes
        _pallas_kernel(impl, _KERNEL_PLATFORMS[impl], X.dtype, A.dtype)
    m, n = A.shape
    if X.shape[0] != n:
        raise ValueError(f"X.shape[0] must equal A.shape[1] = {n}, got X.shape = {X.shape}")
    features = X.shape[1:]
    x2 = X.reshape(n, int(np.prod(features, dtype=np.int64)))
    out = _bind(x2, A.data, A.pattern, A.matmul_info, impl=impl, interpret=interpret)
    return out.reshape((m, *features))


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
    *operands, info: MatmulInfo, impl: str | None, interpret: bool, platform: str
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
                x, data, pattern.items, pattern.indices, num_rows=m, interpret=interpret
            )
        else:
            out = _tpu_spmm(x, data, pattern, m, interpret)
    else:
        strategy = _strategy_for(info, on_cpu=platform == "cpu")
        out = xla_kernels.spmm(x, data, pattern, shape=info.shape, strategy=strategy)
    return out.astype(_result_dtype(x.dtype, data_dtype))


def _tpu_spmm(x, data, pattern: Pattern, m: int, interpret: bool) -> jax.Array:
    """Gathers X's rows into nonzero order (XLA), then the block-sparse MXU kernel."""
    values = x[pattern.indices]
    if data is not None:
        values = data[:, None] * values
    if values.dtype == np.float16:  # the MXU takes bfloat16 and float32
        values = values.astype(jnp.float32)
    return tpu_kernels.spmm(
        values,
        xla_kernels.row_ids(pattern),
        pattern.tiles,
        num_rows=m,
        # The TPU interpreter (pltpu.InterpretParams) runs on io_callbacks with ordered
        # effects, which a primitive's lowering cannot host; the primitive uses the
        # generic Pallas interpreter and tests run the kernel under both.
        interpret=interpret,
    )


@functools.cache
def _jitted_primitive(info: MatmulInfo, impl: str | None, interpret: bool):
    return jax.jit(functools.partial(csr_matmul_p.bind, info=info, impl=impl, interpret=interpret))


def _eager_impl(*operands, info: MatmulInfo, impl: str | None, interpret: bool) -> jax.Array:
    return _jitted_primitive(info, impl, interpret)(*operands)


csr_matmul_p.def_impl(_eager_impl)


@csr_matmul_p.def_abstract_eval
def _abstract_eval(*operands, info: MatmulInfo, **params):
    del params
    x, data, _ = _unpack(operands, info)
    dtype = _result_dtype(x.dtype, None if data is None else data.dtype)
    return ShapedArray((info.shape[0], x.shape[1]), dtype)


# ------------------------------------------------------------------------ JVP
def _jvp(primals, tangents, *, info: MatmulInfo, **params):
    x, data, pattern = _unpack(primals, info)
    x_dot, data_dot, _ = _unpack(tangents, info)
    out = _bind(x, data, pattern, info, **params)
    parts = []
    if type(x_dot) is not ad.Zero:
        parts.append(_bind(x_dot, data, pattern, info, **params))
    if data_dot is not None and type(data_dot) is not ad.Zero:
        parts.append(_bind(x, data_dot, pattern, info, **params))
    if not parts:
        return out, jnp.zeros_like(out)
    tangent = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    return out, tangent.astype(out.dtype)


ad.primitive_jvps[csr_matmul_p] = _jvp


# ------------------------------------------------------------------ transpose
def _transpose(ct, *operands, info: MatmulInfo, **params):
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
