"""jaxcsr: static scatter-add and segment reductions as planned sparse x dense products.

Example:
  >>> import numpy as np, jax, jax.numpy as jnp
  >>> from jaxcsr import CSRMatrix
  >>> A = CSRMatrix.from_indices(np.array([0, 2, 2, 1, 0]), num_rows=3)
  >>> (A @ jnp.ones((5, 2))).tolist()
  [[2.0, 2.0], [1.0, 1.0], [2.0, 2.0]]
"""

from jaxcsr.kernels import BACKENDS, IMPLS
from jaxcsr.matrix import CSRMatrix, PlanInfo, matmul
from jaxcsr.ops import REDUCTIONS
from jaxcsr.sddmm import sddmm
from jaxcsr.segment import (
    segment_log_softmax,
    segment_logsumexp,
    segment_matrix,
    segment_max,
    segment_mean,
    segment_min,
    segment_order,
    segment_prod,
    segment_softmax,
    segment_sum,
)
from jaxcsr.sharding import ShardedCSR, shard, shard_rows
from jaxcsr.softmax import edge_softmax

__version__ = "0.2.0"

__all__ = [
    "BACKENDS",
    "IMPLS",
    "REDUCTIONS",
    "CSRMatrix",
    "PlanInfo",
    "ShardedCSR",
    "__version__",
    "edge_softmax",
    "matmul",
    "sddmm",
    "segment_log_softmax",
    "segment_logsumexp",
    "segment_matrix",
    "segment_max",
    "segment_mean",
    "segment_min",
    "segment_order",
    "segment_prod",
    "segment_softmax",
    "segment_sum",
    "shard",
    "shard_rows",
]
