"""The backend registry: the one way from the primitive to a kernel.

Every backend -- the XLA path included -- is a :class:`Backend` entry in
:data:`BACKENDS` with the same contract: a ``plan`` (what it reads beyond the portable
core, :class:`~jaxcsr.structure.Structure`), a ``product`` and a ``describe`` (what
:meth:`jaxcsr.CSRMatrix.plan_info` prints), plus three small records: its
:class:`Coverage` (the dtypes and views it runs, and where ``impl=None`` picks it), its
:class:`Capabilities` beyond the product (sampled product, arg search, fused softmax,
layouts it reads, planning traced ids) and its :class:`Requirement` (what this
installation must have).
The primitive (:mod:`jaxcsr.ops`) only ever calls entries of this registry, and no
module outside ``jaxcsr/kernels/`` imports a backend module. Adding a backend means
one module and one :func:`register` call (here, or from user code: the set of valid
``impl=`` names, :data:`IMPLS`, is read from the registry when asked).

* :mod:`jaxcsr.kernels.xla` -- pure XLA (and kernels jaxlib already ships); runs on
  every platform, plans nothing, and is the :func:`fallback`: what runs when no
  kernel is planned or chosen, and what answers the values' gradient (``sddmm``) and
  the max/min arg search for every backend without its own.
* :mod:`jaxcsr.kernels.gpu` -- Pallas Triton kernel (load-balanced row work items).
* :mod:`jaxcsr.kernels.tpu` -- Pallas Mosaic kernel (one-hot MXU windows over blocks of nonzeros).
* :mod:`jaxcsr.kernels.cpu` -- C++ kernels through XLA FFI (multithreaded sums).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from jaxcsr.dtypes import KERNEL_DTYPES
from jaxcsr.kernels import cpu, gpu, tpu, xla
from jaxcsr.structure import Structure

__all__ = [
    "BACKENDS",
    "FALLBACK",
    "IMPLS",
    "ArgSearch",
    "Backend",
    "Capabilities",
    "Coverage",
    "ExtremeSearchFn",
    "ProductFn",
    "PutAttainingFn",
    "Requirement",
    "SddmmFn",
    "SoftmaxFn",
    "default_backends",
    "fallback",
    "platform_kernel",
    "register",
    "resolve_backends",
    "traced_scatters_on_cpu",
]


class ProductFn(Protocol):
    """``Backend.product``: the viewed matrix times ``x`` (``(n, F)``) with ``reduce``,
    ``(m, F)`` in ``out_dtype``. Backends with ``feature_major`` also take the keywords
    ``feature_major`` and ``data_transposed`` (:class:`Backend`)."""

    def __call__(
        self, x: jax.Array, data: jax.Array | None, view: Structure, plan: Any, /, *,
        reduce: str, out_dtype: Any, interpret: bool, platform: str,
    ) -> jax.Array: ...  # fmt: skip


class SddmmFn(Protocol):
    """``Capabilities.sddmm``: ``ct (m, H, F)`` and ``x (n, H, F)`` at the view's stored
    entries, ``(nnz, H)``: ``sum_f ct[row_k, h, f] * x[col_k, h, f]``."""

    def __call__(
        self, ct: jax.Array, x: jax.Array, view: Structure, /, *, out_dtype: Any
    ) -> jax.Array: ...


class SoftmaxFn(Protocol):
    """``Capabilities.softmax``: the fused softmax over rows (``g`` None) or its tangent."""

    def __call__(
        self, x: jax.Array, g: jax.Array | None, view: Structure, /, *, out_dtype: Any,
        fallback: Callable[[], jax.Array],
    ) -> jax.Array: ...  # fmt: skip


class ExtremeSearchFn(Protocol):
    """:class:`ArgSearch` ``positions`` / ``columns`` / ``column_mask``."""

    def __call__(
        self, x: jax.Array, data: jax.Array | None, view: Structure, out: jax.Array, /
    ) -> jax.Array: ...


class PutAttainingFn(Protocol):
    """:class:`ArgSearch` ``put_attaining``: ``(ct, columns, rows) -> (n, F)``."""

    def __call__(self, ct: jax.Array, columns: jax.Array, rows: jax.Array, /) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class ArgSearch:
    """How to find the stored entry attaining each output of a max/min (``return_arg``
    and the max/min gradient). Each takes ``(x, data, view, out)``, non-empty.

    Attributes:
      positions: ``(m, F)`` CSR positions, sentinel ``nnz`` for empty rows.
      columns: ``(m, F)`` columns, sentinel ``n`` for empty rows.
      column_mask: one-per-column views: ``(n, F)`` bool, True at each row's winner.
      put_attaining: one-per-column views, ``(ct, columns, rows) -> (n, F)``: the
        transpose of taking ``x`` at the ``(m, F)`` attaining ``columns`` (``n``: none),
        ``ct[rows[k]]`` where ``columns[rows[k]] == k``, else 0 (``rows``: the row of
        each column, ``m`` for none); the max/min gradient's last step.
    """

    positions: ExtremeSearchFn
    columns: ExtremeSearchFn
    column_mask: ExtremeSearchFn
    put_attaining: PutAttainingFn


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Which products a backend runs; the rest run on the fallback.

    Attributes:
      dtypes: value/operand dtypes it takes (``None``: every numeric dtype).
      covers: ``view -> bool``: whether it runs that view.
      default_for: ``(view, dtype, reduce) -> bool``: whether ``impl=None`` runs it on
        a view it covers, for a product in ``dtype`` (the operands' promoted dtype) with
        ``reduce`` (``"sum"``, ``"max"``, ``"min"``; ``None``: the fused softmax), else
        the fallback does (an explicit ``impl=`` still runs it): the rule for where the
        fallback measured faster on the backend's platform.
    """

    dtypes: tuple[np.dtype, ...] | None = None
    covers: Callable[[Structure], bool] = lambda view: True
    default_for: Callable[[Structure, np.dtype, str | None], bool] = lambda *_: True

    def supports(self, *dtypes) -> bool:
        """Whether every non-``None`` dtype is one of :attr:`dtypes`."""
        if self.dtypes is None:
            return True
        return all(d is None or np.dtype(d) in self.dtypes for d in dtypes)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend does beyond its product; each is optional.

    Attributes:
      sddmm: ``(ct, x, view, *, out_dtype) -> (nnz, H)``, the sampled product of ``ct
        (m, H, F)`` and ``x (n, H, F)``, every head (the
        fallback's is used for every backend; ``None``: none of its own).
      arg_search: an :class:`ArgSearch`, run on this backend's platform (chosen when
        lowered, :func:`jaxcsr.ops.arg_search`) where the matrix carries its plan;
        ``None``: the fallback's. With one, one-per-column max/min tangents are taken
        at its ``columns``; ``column_mask`` serves the fallback's masked sum.
      softmax: ``(x, g, view, *, out_dtype, fallback) -> (n, H)``, fused: the softmax
        of ``x`` over the rows of a one-per-column ``view`` (``g`` is ``None``), or
        the softmax's tangent from its output ``x = p``, ``p * g - p * rowsum(p *
        g)[row]``; calls ``fallback()`` (the XLA composition) for what it does not
        take. ``None``: the composition runs, on this backend's products.
      feature_major: whether ``product`` takes ``feature_major=True``: ``x`` as ``(F, n)``
        and the result as ``(F, m)`` (the layout of ``values @ A.T``), without
        transposes. Without it the primitive transposes around the row-major product.
      transposed_data: ``(view, platform, x_dtype, data_dtype, out_dtype) -> bool``,
        whether ``product`` takes ``data_transposed=True`` for that product (a sum of a
        ``"general"`` view whose values are in the CSR order of the view's transpose,
        as the backward pass has them) and reads them through the planned permutation.
        Where it says no (``None``: never), the primitive permutes the values first
        (one gather of ``nnz`` values per product).
      plans_traced: whether ``plan`` also takes device structures (one function over
        numpy and ``jax.numpy``, :func:`~jaxcsr.structure.array_namespace`); without,
        matrices of traced ids leave the backend out and run on the fallback.
      heads: ``(view, platform, x_dtype, data_dtype, out_dtype) -> bool``, whether
        ``product`` takes values of shape ``(nnz, H)`` for that sum: entry ``k``'s value
        for head ``h`` weighs the ``h``-th of ``H`` equal blocks of ``x``'s features (what
        ``vmap`` over per-head values and features binds, attention heads). Where it
        says no (``None``: never), the primitive runs one product per head.
      mean: ``(view, platform, x_dtype, data_dtype, out_dtype, n_features) -> bool``,
        whether ``product`` takes ``reduce="mean"`` for that product (row-major, one
        value per entry): each row's sum, accumulated as the sum's, times the float32
        reciprocal of the row's entry count (1 for an empty row), rounded once into
        ``out_dtype``: the bits of the sum in the accumulation dtype followed by the
        primitive's own division (:func:`jaxcsr.ops.reduce_rows`).
        Where it says no (``None``: never), the primitive divides the sum after it.
    """

    sddmm: SddmmFn | None = None
    arg_search: ArgSearch | None = None
    softmax: SoftmaxFn | None = None
    feature_major: bool = False
    transposed_data: Callable[..., bool] | None = None
    plans_traced: bool = False
    heads: Callable[..., bool] | None = None
    mean: Callable[..., bool] | None = None


@dataclasses.dataclass(frozen=True)
class Requirement:
    """What a backend needs of this installation.

    Attributes:
      available: whether this jax (and build) can run it (a Pallas backend may be
        missing, the CPU library may not be compiled).
      missing: what is missing when :attr:`available` is False (for the messages).
    """

    available: Callable[[], bool] = lambda: True
    missing: str = "the Pallas backend this kernel is written in"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to compute the product: a core of five, and what it covers, can do
    beyond the product and needs.

    Attributes:
      name: what ``backends=`` and ``impl=`` call it.
      platform: the JAX platform whose default it is (``None``: none, the fallback).
      plan: ``Structure -> plan pytree or None``: for host structures (numpy leaves,
        planned once) and, with :attr:`Capabilities.plans_traced`, device ones too
        (traced ids, planned inside the trace), with equal results element for element.
      product: ``(x, data, view, plan, *, reduce, out_dtype, interpret, platform) ->
        (m, F)`` in ``out_dtype``, empty rows zero for every reduction (``"sum"``,
        ``"max"``, ``"min"``). Called with non-empty operands only (entries and
        features > 0) and views its :class:`Coverage` covers.
      describe: ``(view, n_features or None) -> {label: what runs}`` for
        :meth:`~jaxcsr.CSRMatrix.plan_info` (host-side; may read the view back).
      coverage: which products it runs (:class:`Coverage`).
      capabilities: what it does beyond the product (:class:`Capabilities`).
      requirement: what it needs of this installation (:class:`Requirement`).
    """

    name: str
    platform: str | None
    plan: Callable[[Structure], Any]
    product: ProductFn
    describe: Callable[[Structure, int | None], dict[str, str]]
    coverage: Coverage = Coverage()
    capabilities: Capabilities = Capabilities()
    requirement: Requirement = Requirement()

    def available(self) -> bool:
        """Whether this installation can run it (:class:`Requirement`)."""
        return self.requirement.available()

    def require_available(self) -> None:
        """Raises a ``RuntimeError`` naming the jax version if this jax cannot run it."""
        if not self.available():
            raise RuntimeError(
                f"impl={self.name!r} cannot run (jax {jax.__version__}): missing "
                f"{self.requirement.missing}; use impl=None (falls back to {FALLBACK}) or "
                f"impl={FALLBACK!r}"
            )

    def warn_unavailable(self) -> None:
        """One warning per process and backend that its platform falls back."""
        if self.name not in _WARNED:
            _WARNED.add(self.name)
            warnings.warn(
                f"the {self.name!r} kernel cannot run (jax {jax.__version__}): missing "
                f"{self.requirement.missing}; products on {self.platform!r} run on the "
                f"fallback, {FALLBACK!r}",
                RuntimeWarning,
                stacklevel=2,
            )


BACKENDS: dict[str, Backend] = {}
_WARNED: set[str] = set()
FALLBACK = "xla"
"""The backend that runs every view on every platform and plans nothing."""


def register(backend: Backend) -> None:
    """Adds (or replaces) a backend in :data:`BACKENDS`; ``impl=`` and ``backends=``
    accept its name from then on."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a jaxcsr.kernels.Backend, got {type(backend).__name__}")
    BACKENDS[backend.name] = backend


def fallback() -> Backend:
    """The :data:`FALLBACK` backend's entry."""
    return BACKENDS[FALLBACK]


class _ImplNames(Sequence):
    """``(None, *BACKENDS)``, read from the registry at every use (a live view)."""

    def _names(self) -> tuple[str | None, ...]:
        return (None, *BACKENDS)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str | None]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name is None or (isinstance(name, str) and name in BACKENDS)

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


IMPLS: Sequence[str | None] = _ImplNames()
"""``impl=`` values: ``None`` (the platform's planned kernel, else the fallback) or a
registered backend's name; always current with :data:`BACKENDS`."""


register(
    Backend(
        FALLBACK,
        None,
        xla.plan,
        xla.product,
        xla.describe,
        Coverage(covers=xla.covers),
        Capabilities(
            sddmm=xla.sddmm,
            arg_search=ArgSearch(
                xla.extreme_positions,
                xla.extreme_columns,
                xla.extreme_column_mask,
                xla.put_attaining,
            ),
            plans_traced=True,
        ),
    )
)
register(
    Backend(
        "pallas_gpu",
        "cuda",
        gpu.plan,
        gpu.product,
        gpu.describe,
        Coverage(KERNEL_DTYPES, gpu.covers, gpu.default_for),
        Capabilities(plans_traced=True),
        Requirement(gpu.available),
    )
)
register(
    Backend(
        "pallas_tpu",
        "tpu",
        tpu.plan,
        tpu.product,
        tpu.describe,
        Coverage(KERNEL_DTYPES, tpu.covers, tpu.default_for),
        Capabilities(plans_traced=True),
    )
)
register(
    Backend(
        "cpu",
        "cpu",
        cpu.plan,
        cpu.product,
        cpu.describe,
        Coverage(KERNEL_DTYPES),
        Capabilities(
            sddmm=cpu.sddmm,
            arg_search=ArgSearch(
                cpu.arg_positions, cpu.arg_columns, xla.extreme_column_mask, cpu.put_attaining
            ),
            softmax=cpu.softmax,
            feature_major=True,
            transposed_data=cpu.reads_transposed_data,
            plans_traced=True,
            heads=cpu.takes_heads,
            mean=cpu.divides_means,
        ),
        Requirement(
            cpu.available,
            "jaxcsr's compiled CPU library (built by pip install with a C++17 compiler)",
        ),
    )
)


def platform_kernel(platform: str) -> str | None:
    """The backend that is the default on ``platform`` (``None``: the fallback)."""
    for backend in BACKENDS.values():
        if backend.platform == platform:
            return backend.name
    return None


def default_backends(platform: str | None = None) -> tuple[str, ...]:
    """The fallback plus the kernel of ``platform`` (default: ``jax.default_backend()``)."""
    platform = jax.default_backend() if platform is None else platform
    kernel = platform_kernel({"gpu": "cuda"}.get(platform, platform))
    return (FALLBACK,) if kernel is None else (FALLBACK, kernel)


def resolve_backends(backends: Any) -> tuple[str, ...]:
    """Validates a ``backends=`` argument; ``None`` means :func:`default_backends`.

    The fallback is always included (it plans nothing). Returns a sorted tuple.
    """
    if backends is None:
        names = default_backends()
    else:
        if isinstance(backends, str):
            backends = (backends,)
        try:
            names = tuple(backends)
        except TypeError as err:
            raise TypeError(
                f"backends must be a sequence of backend names, got {backends!r}"
            ) from err
        for name in names:
            if name not in BACKENDS:
                raise ValueError(f"backends: unknown backend {name!r}; known: {tuple(BACKENDS)}")
    return tuple(sorted(set(names) | {FALLBACK}))


def traced_scatters_on_cpu(
    reduce: str, num_ids: int, width: int, dtype: Any, gradient: bool = False,
    num_segments: int | None = None,
) -> bool:  # fmt: skip
    """Whether ``segment_<reduce>`` of traced ids (``gradient``: a max/min's gradient)
    into ``num_segments`` segments lowers to XLA's scatter on CPU
    (:func:`jaxcsr.kernels.cpu.traced_scatters`)."""
    return cpu.traced_scatters(reduce, num_ids, width, dtype, gradient, num_segments)
