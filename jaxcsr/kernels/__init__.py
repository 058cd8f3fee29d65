"""Backends that compute the CSR x dense product.

* :mod:`jaxcsr.kernels.xla` -- pure XLA (and kernels jaxlib already ships); runs on
  every platform and is the default on CPU.

* :mod:`jaxcsr.kernels.gpu` -- Pallas Triton kernel (load-balanced row work items).
* :mod:`jaxcsr.kernels.tpu` -- Pallas Mosaic kernel (block-sparse one-hot MXU tiles).
"""
