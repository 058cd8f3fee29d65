"""Row-sharded products over a ``jax.sharding.Mesh`` with ``shard_map``.

:func:`shard` splits a :class:`~jaxcsr.matrix.CSRMatrix` into contiguous row blocks,
one per device along a mesh axis, balanced by nonzeros (planned on the host, once).
Each block is an ordinary matrix of the same static layout -- padded to equal rows
(plus one trash row that absorbs padding entries) and equal nonzeros -- so every
device runs the backend's normal kernel on its block inside one ``shard_map``.

The blocks are planned on the host by :mod:`jaxcsr.sharding.row_blocks`. Two forms:

* **SpMM** (any matrix but ``from_indices``): ``x`` holds one row per column of ``A``
  (node features). It is gathered to every device (all-gather; its transpose, a
  reduce-scatter, is what JAX derives for the gradient).
* **Segment** (``from_indices``: one entry per column, columns are per-edge values):
  each device holds only its own edges. ``S``'s columns are the edges *laid out*
  shard by shard (``S.input_order``; padding slots are empty columns), and values in
  that layout, sharded as ``S.input_sharding``, need no communication at all.

The result has exactly ``A``'s rows, sharded evenly along the axis (JAX's layout).
Row blocks balanced by nonzeros are not the even row split, so each device sends the
rows it computed for another device's part with ``ppermute`` (a halo between
neighbours, ``S.communication`` counts it). ``balance="rows"`` uses the even row split
itself: no relayout, no communication in the segment form, but the nonzeros may be
unbalanced (``S.imbalance``).

The package, by concern: :mod:`~jaxcsr.sharding.row_blocks` (host planning of the
blocks, numpy), :mod:`~jaxcsr.sharding.spec` (the static description and the layout),
:mod:`~jaxcsr.sharding.blocks` (blocks on the host and their placement),
:mod:`~jaxcsr.sharding.product` (the ``shard_map`` product and relayout),
:mod:`~jaxcsr.sharding.operand` (:class:`ShardedCSR`) and
:mod:`~jaxcsr.sharding.constructors` (:func:`shard`, :func:`shard_rows`).
"""

from jaxcsr.sharding.constructors import shard, shard_rows
from jaxcsr.sharding.operand import ShardedCSR

__all__ = ["ShardedCSR", "shard", "shard_rows"]
