"""Backends that compute the CSR x dense product.

* :mod:`jaxcsr.kernels.xla` -- pure XLA (and kernels jaxlib already ships); runs on
  every platform and is the default on CPU.

The Pallas GPU (Triton) and TPU (Mosaic) kernels live in their own modules here.
"""
