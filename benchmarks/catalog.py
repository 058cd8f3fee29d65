"""Names of the main benchmark's peers and workloads (no imports: ``--help`` is instant)."""

PEERS = (
    "segment_sum",
    "segment_sum_sorted",
    "bcsr",
    "bcoo",
    "scipy",
    "torch_index_add",
    "torch_scatter_reduce",
    "torch_sparse_csr",
)
WORKLOADS = ("segment", "spmm", "last_axis", "segment_mean", "segment_max", "segment_softmax")
PASSES = {
    "segment": 2,
    "last_axis": 2,
    "spmm": 3,
    "segment_mean": 2,
    "segment_max": 2,
    "segment_softmax": 2,
}
"""Cells (passes) each workload yields per graph, width and dtype."""
