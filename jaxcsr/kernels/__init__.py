"""The backend registry: which backends compute ``A @ X``, where, and what each plans.

A :class:`Backend` is one module's entry: its name, the platform whose lowering runs
it by default, the dtypes it takes, a host ``plan`` (what the backend reads beyond
the portable core, :class:`~jaxcsr.structure.Structure`; ``None`` when nothing) and
the kernel entry ``product``. Adding a backend means adding a module and one
:func:`register` call here.

* :mod:`jaxcsr.kernels.xla` -- pure XLA (and kernels jaxlib already ships); runs on
  every platform, plans nothing, and is what runs when no kernel is planned.
* :mod:`jaxcsr.kernels.gpu` -- Pallas Triton kernel (load-balanced row work items).
* :mod:`jaxcsr.kernels.tpu` -- Pallas Mosaic kernel (block-sparse one-hot MXU tiles).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxcsr.dtypes import KERNEL_DTYPES
from jaxcsr.kernels import gpu, tpu

__all__ = ["BACKENDS", "Backend", "default_backends", "register", "resolve_backends"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to compute the product.

    Attributes:
      name: what ``backends=`` and ``impl=`` call it.
      platform: the JAX platform whose default it is (``None``: none, the fallback).
      dtypes: value/operand dtypes it takes (``None``: every numeric dtype).
      plan: host function ``Structure (numpy leaves) -> plan pytree or None``.
      product: ``(x, data, structure, plan, *, reduce, out_dtype, interpret) -> (m, F)``
        in ``out_dtype`` with empty rows zero for every reduction; ``None`` for the
        XLA path, which the primitive runs itself.
      available: whether this jax can run it (a Pallas backend may be missing).
    """

    name: str
    platform: str | None
    dtypes: tuple[np.dtype, ...] | None
    plan: Callable[[Any], Any]
    product: Callable[..., jax.Array] | None
    available: Callable[[], bool] = lambda: True

    def require_available(self) -> None:
        """Raises a ``RuntimeError`` naming the jax version if this jax cannot run it."""
        if not self.available():
            raise RuntimeError(
                f"impl={self.name!r}: jax {jax.__version__} does not ship the Pallas backend "
                "this kernel is written in; use impl=None (falls back to XLA) or impl='xla'"
            )

    def warn_unavailable(self) -> None:
        """One warning per process and backend that its platform falls back to XLA."""
        if self.name not in _WARNED:
            _WARNED.add(self.name)
            warnings.warn(
                f"jax {jax.__version__} cannot run the {self.name!r} kernel (its Pallas "
                f"backend is missing); products on {self.platform!r} run on the XLA path",
                RuntimeWarning,
                stacklevel=2,
            )

    def supports(self, *dtypes) -> bool:
        """Whether every non-``None`` dtype is one this backend takes."""
        if self.dtypes is None:
            return True
        return all(d is None or np.dtype(d) in self.dtypes for d in dtypes)


BACKENDS: dict[str, Backend] = {}
_WARNED: set[str] = set()


def register(backend: Backend) -> None:
    """Adds (or replaces) a backend in :data:`BACKENDS`."""
    BACKENDS[backend.name] = backend


register(Backend("xla", None, None, lambda structure: None, None))
register(Backend("pallas_gpu", "cuda", KERNEL_DTYPES, gpu.plan, gpu.product, gpu.available))
register(Backend("pallas_tpu", "tpu", KERNEL_DTYPES, tpu.plan, tpu.product))


def platform_kernel(platform: str) -> str | None:
    """The backend that is the default on ``platform`` (``None``: XLA)."""
    for backend in BACKENDS.values():
        if backend.platform == platform:
            return backend.name
    return None


def default_backends(platform: str | None = None) -> tuple[str, ...]:
    """``("xla",)`` plus the kernel of ``platform`` (default: ``jax.default_backend()``)."""
    platform = jax.default_backend() if platform is None else platform
    kernel = platform_kernel({"gpu": "cuda"}.get(platform, platform))
    return ("xla",) if kernel is None else ("xla", kernel)


def resolve_backends(backends: Any) -> tuple[str, ...]:
    """Validates a ``backends=`` argument; ``None`` means :func:`default_backends`.

    ``"xla"`` is always included (it plans nothing). Returns a sorted tuple.
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
    return tuple(sorted(set(names) | {"xla"}))
