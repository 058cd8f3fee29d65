"""pytorch_scatter's published test vectors, run through jaxcsr's functional API.

Source: https://github.com/rusty1s/pytorch_scatter (MIT licence, (c) 2020 Matthias
Fey), commit 648dda3cf964731ffb4de11eafc445a83133eda4: the input/expected tables of
``test/test_scatter.py`` (``scatter_*``), ``test/test_segment.py``
(``segment_*_csr``/``segment_*_coo``) and ``test/composite/test_softmax.py`` /
``test_logsumexp.py``. Only the numbers are taken; the harness is ours.

How torch_scatter's conventions map onto jaxcsr, each checked below:

* ``dim_size`` defaults to ``index.max() + 1`` -> ``num_segments=None``.
* Empty segments give 0 for every reduce and the arg sentinel ``src.size(dim)``:
  the same in jaxcsr.
* A 2-D ``index`` that differs per leading row (``scatter(src, index, dim=1)`` with
  ``index.shape == src.shape[:2]``) has no single static matrix: each leading slice
  is one call with its own ids (one planned matrix per distinct id row).
* ``reduce="mul"`` is not a jaxcsr reduce (products are not a sparse-dense semiring
  it plans for): ``matmul`` rejects it with ``ValueError``.
* Integer ``mean`` floor-divides, as torch_scatter does (the tables cast 1.5 -> 1).
* int64 needs ``jax_enable_x64``; the integer rows run as int32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcsr

REDUCES = ["sum", "mean", "min", "max"]  # "add" is torch_scatter's alias of "sum"
DTYPES = [np.float16, jnp.bfloat16, np.float32, np.int32]

SCATTER_CASES = [
    dict(
        src=[1, 3, 2, 4, 5, 6],
        index=[0, 1, 0, 1, 1, 3],
        dim=-1,
        sum=[3, 12, 0, 6],
        mean=[1.5, 4, 0, 6],
        min=[1, 3, 0, 6],
        arg_min=[0, 1, 6, 5],
        max=[2, 5, 0, 6],
        arg_max=[2, 4, 6, 5],
    ),
    dict(
        src=[[1, 2], [5, 6], [3, 4], [7, 8], [9, 10], [11, 12]],
        index=[0, 1, 0, 1, 1, 3],
        dim=0,
        sum=[[4, 6], [21, 24], [0, 0], [11, 12]],
        mean=[[2, 3], [7, 8], [0, 0], [11, 12]],
        min=[[1, 2], [5, 6], [0, 0], [11, 12]],
        arg_min=[[0, 0], [1, 1], [6, 6], [5, 5]],
        max=[[3, 4], [9, 10], [0, 0], [11, 12]],
        arg_max=[[2, 2], [4, 4], [6, 6], [5, 5]],
    ),
    dict(
        src=[[1, 5, 3, 7, 9, 11], [2, 4, 8, 6, 10, 12]],
        index=[[0, 1, 0, 1, 1, 3], [0, 0, 1, 0, 1, 2]],
        dim=1,
        sum=[[4, 21, 0, 11], [12, 18, 12, 0]],
        mean=[[2, 7, 0, 11], [4, 9, 12, 0]],
        min=[[1, 5, 0, 11], [2, 8, 12, 0]],
        arg_min=[[0, 1, 6, 5], [0, 2, 5, 6]],
        max=[[3, 9, 0, 11], [6, 10, 12, 0]],
        arg_max=[[2, 4, 6, 5], [3, 4, 5, 6]],
    ),
    dict(
        src=[[[1, 2], [5, 6], [3, 4]], [[10, 11], [7, 9], [12, 13]]],
        index=[[0, 1, 0], [2, 0, 2]],
        dim=1,
        sum=[[[4, 6], [5, 6], [0, 0]], [[7, 9], [0, 0], [22, 24]]],
        mean=[[[2, 3], [5, 6], [0, 0]], [[7, 9], [0, 0], [11, 12]]],
        min=[[[1, 2], [5, 6], [0, 0]], [[7, 9], [0, 0], [10, 11]]],
        arg_min=[[[0, 0], [1, 1], [3, 3]], [[1, 1], [3, 3], [0, 0]]],
        max=[[[3, 4], [5, 6], [0, 0]], [[7, 9], [0, 0], [12, 13]]],
        arg_max=[[[2, 2], [1, 1], [3, 3]], [[1, 1], [3, 3], [2, 2]]],
    ),
    dict(
        src=[[1, 3], [2, 4]],
        index=[[0, 0], [0, 0]],
        dim=1,
        sum=[[4], [6]],
        mean=[[2], [3]],
        min=[[1], [2]],
        arg_min=[[0], [0]],
        max=[[3], [4]],
        arg_max=[[1], [1]],
    ),
    dict(
        src=[[[1, 1], [3, 3]], [[2, 2], [4, 4]]],
        index=[[0, 0], [0, 0]],
        dim=1,
        sum=[[[4, 4]], [[6, 6]]],
        mean=[[[2, 2]], [[3, 3]]],
        min=[[[1, 1]], [[2, 2]]],
        arg_min=[[[0, 0]], [[0, 0]]],
        max=[[[3, 3]], [[4, 4]]],
        arg_max=[[[1, 1]], [[1, 1]]],
    ),
]

# segment_csr / segment_coo: sorted ids, given both as index and as indptr.
SEGMENT_CASES = [
    dict(
        src=[1, 2, 3, 4, 5, 6],
        index=[0, 0, 1, 1, 1, 3],
        indptr=[0, 2, 5, 5, 6],
        sum=[3, 12, 0, 6],
        mean=[1.5, 4, 0, 6],
        min=[1, 3, 0, 6],
        arg_min=[0, 2, 6, 5],
        max=[2, 5, 0, 6],
        arg_max=[1, 4, 6, 5],
    ),
    dict(
        src=[[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]],
        index=[0, 0, 1, 1, 1, 3],
        indptr=[0, 2, 5, 5, 6],
        sum=[[4, 6], [21, 24], [0, 0], [11, 12]],
        mean=[[2, 3], [7, 8], [0, 0], [11, 12]],
        min=[[1, 2], [5, 6], [0, 0], [11, 12]],
        arg_min=[[0, 0], [2, 2], [6, 6], [5, 5]],
        max=[[3, 4], [9, 10], [0, 0], [11, 12]],
        arg_max=[[1, 1], [4, 4], [6, 6], [5, 5]],
    ),
    dict(
        src=[[1, 3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12]],
        index=[[0, 0, 1, 1, 1, 3], [0, 0, 0, 1, 1, 2]],
        indptr=[[0, 2, 5, 5, 6], [0, 3, 5, 6, 6]],
        sum=[[4, 21, 0, 11], [12, 18, 12, 0]],
        mean=[[2, 7, 0, 11], [4, 9, 12, 0]],
        min=[[1, 5, 0, 11], [2, 8, 12, 0]],
        arg_min=[[0, 2, 6, 5], [0, 3, 5, 6]],
        max=[[3, 9, 0, 11], [6, 10, 12, 0]],
        arg_max=[[1, 4, 6, 5], [2, 4, 5, 6]],
    ),
    dict(
        src=[[[1, 2], [3, 4], [5, 6]], [[7, 9], [10, 11], [12, 13]]],
        index=[[0, 0, 1], [0, 2, 2]],
        indptr=[[0, 2, 3, 3], [0, 1, 1, 3]],
        sum=[[[4, 6], [5, 6], [0, 0]], [[7, 9], [0, 0], [22, 24]]],
        mean=[[[2, 3], [5, 6], [0, 0]], [[7, 9], [0, 0], [11, 12]]],
        min=[[[1, 2], [5, 6], [0, 0]], [[7, 9], [0, 0], [10, 11]]],
        arg_min=[[[0, 0], [2, 2], [3, 3]], [[0, 0], [3, 3], [1, 1]]],
        max=[[[3, 4], [5, 6], [0, 0]], [[7, 9], [0, 0], [12, 13]]],
        arg_max=[[[1, 1], [2, 2], [3, 3]], [[0, 0], [3, 3], [2, 2]]],
    ),
    dict(
        src=[[1, 3], [2, 4]],
        index=[[0, 0], [0, 0]],
        indptr=[[0, 2], [0, 2]],
        sum=[[4], [6]],
        mean=[[2], [3]],
        min=[[1], [2]],
        arg_min=[[0], [0]],
        max=[[3], [4]],
        arg_max=[[1], [1]],
    ),
    dict(
        src=[[[1, 1], [3, 3]], [[2, 2], [4, 4]]],
        index=[[0, 0], [0, 0]],
        indptr=[[0, 2], [0, 2]],
        sum=[[[4, 4]], [[6, 6]]],
        mean=[[[2, 2]], [[3, 3]]],
        min=[[[1, 1]], [[2, 2]]],
        arg_min=[[[0, 0]], [[0, 0]]],
        max=[[[3, 3]], [[4, 4]]],
        arg_max=[[[1, 1]], [[1, 1]]],
    ),
]

FUNCTIONS = {
    "sum": jaxcsr.segment_sum,
    "mean": jaxcsr.segment_mean,
    "min": functools.partial(jaxcsr.segment_min, empty=0),  # torch_scatter's empty value
    "max": functools.partial(jaxcsr.segment_max, empty=0),
}


def torch_cast(values, dtype) -> np.ndarray:
    """torch's ``tensor(x).to(dtype)``: floats truncate toward zero for integers."""
    return (
        np.trunc(np.asarray(values, np.float64)).astype(dtype)
        if np.issubdtype(np.dtype(dtype), np.integer)
        else np.asarray(values, np.float64).astype(dtype)
    )


def run_scatter(src, index, dim: int, reduce: str, num_segments: int | None = None):
    """torch_scatter's ``scatter_<reduce>(src, index, dim, dim_size)`` in terms of jaxcsr."""
    index = np.asarray(index)
    if num_segments is None:  # torch_scatter's dim_size default
        num_segments = int(index.max()) + 1
    arg = reduce in ("min", "max")
    if index.ndim == 1:
        return FUNCTIONS[reduce](src, index, num_segments, axis=dim, **_arg(arg))
    # one index row per leading slice; the segmented axis is the index's last one
    assert dim % src.ndim == index.ndim - 1
    outs = [
        FUNCTIONS[reduce](src[b], index[b], num_segments, axis=0, **_arg(arg))
        for b in np.ndindex(*index.shape[:-1])
    ]
    if arg:
        return tuple(
            jnp.stack([o[i] for o in outs]).reshape(*index.shape[:-1], *outs[0][i].shape)
            for i in range(2)
        )
    return jnp.stack(outs).reshape(*index.shape[:-1], *outs[0].shape)


def _arg(arg: bool) -> dict:
    return {"return_arg": True} if arg else {}


def check(result, case, reduce, dtype) -> None:
    expected = torch_cast(case[reduce], dtype)
    out = result[0] if isinstance(result, tuple) else result
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float64), expected.astype(np.float64))
    if isinstance(result, tuple):
        np.testing.assert_array_equal(np.asarray(result[1]), np.asarray(case["arg_" + reduce]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("case", range(len(SCATTER_CASES)))
def test_scatter_vectors(case, reduce, dtype):
    case = SCATTER_CASES[case]
    src = jnp.asarray(torch_cast(case["src"], dtype))
    check(run_scatter(src, case["index"], case["dim"], reduce), case, reduce, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("case", range(len(SEGMENT_CASES)))
def test_segment_csr_and_coo_vectors(case, reduce, dtype):
    case = SEGMENT_CASES[case]
    src = jnp.asarray(torch_cast(case["src"], dtype))
    indptr = np.asarray(case["indptr"])
    index = np.asarray(case["index"])
    # segment_csr's indptr and segment_coo's index describe the same sorted ids
    rows = indptr.reshape(-1, indptr.shape[-1])
    ids = np.stack([np.repeat(np.arange(r.size - 1), np.diff(r)) for r in rows])
    np.testing.assert_array_equal(ids.reshape(index.shape), index)
    # segment_* reduce along the index's last dim into len(indptr) - 1 segments
    result = run_scatter(src, index, index.ndim - 1, reduce, indptr.shape[-1] - 1)
    check(result, case, reduce, dtype)
    if indptr.ndim == 1:  # segment_csr itself: the CSR matrix over src's rows
        A = jaxcsr.CSRMatrix.from_arrays(
            indptr, np.arange(src.shape[0]), shape=(indptr.size - 1, src.shape[0])
        )
        extreme = reduce in ("min", "max")
        check(jaxcsr.matmul(A, src, reduce=reduce, return_arg=extreme), case, reduce, dtype)


# composite/test_softmax.py and composite/test_logsumexp.py
SOFTMAX_SRC = [0.2, 0, 0.2, -2.1, 3.2, 7, -1, float("-inf")]
SOFTMAX_INDEX = [0, 1, 0, 1, 1, 2, 4, 4]
LOGSUMEXP_SRC = [0.5, 0.5, 0.0, -2.1, 3.2, 7.0, -1.0, -100.0]
LOGSUMEXP_INDEX = [0, 0, 1, 1, 1, 2, 4, 4]  # segment 3 is empty: torch_scatter gives 0


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_softmax_vectors():
    src = np.asarray(SOFTMAX_SRC, np.float32)
    index = np.asarray(SOFTMAX_INDEX)
    expected = np.empty(src.size)
    for s in np.unique(index):
        sel = index == s
        expected[sel] = _np_softmax(src[sel].astype(np.float64))
    out = jaxcsr.segment_softmax(src, index)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)
    log_out = jaxcsr.segment_log_softmax(src, index)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(np.asarray(log_out), np.log(expected), rtol=1e-5)


def test_logsumexp_vectors():
    src = np.asarray(LOGSUMEXP_SRC, np.float32)
    index = np.asarray(LOGSUMEXP_INDEX)
    out = np.asarray(jaxcsr.segment_logsumexp(src, index))
    splits = [2, 3, 1, 0, 2]
    for s, part in enumerate(np.split(src.astype(np.float64), np.cumsum(splits)[:-1])):
        if part.size:
            peak = part.max()
            np.testing.assert_allclose(out[s], np.log(np.exp(part - peak).sum()) + peak, 1e-6)
        else:
            assert out[s] == 0.0
