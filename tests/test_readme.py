"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    namespace: dict = {}
    exec(compile(block.group(1), str(README), "exec"), namespace)
    values, idx = np.asarray(namespace["values"]), namespace["idx"]
    expected = np.zeros((3, 2))
    np.add.at(expected, idx, values)
    np.testing.assert_allclose(np.asarray(namespace["s"]), expected)
    np.testing.assert_allclose(np.asarray(namespace["y"]), expected)
    counts = np.bincount(idx, minlength=3)[:, None]
    np.testing.assert_allclose(np.asarray(namespace["mean"]), expected / counts, rtol=1e-6)
    # the adjacency form: mean of h[senders] per receiver, and its gradient
    h, senders, receivers = (np.asarray(namespace[k]) for k in ("h", "senders", "receivers"))
    msg = np.zeros_like(h)
    np.add.at(msg, receivers, h[senders])
    degree = np.maximum(np.bincount(receivers, minlength=4), 1)[:, None]
    np.testing.assert_allclose(np.asarray(namespace["msg"]), msg / degree, rtol=1e-6)
    dense = np.zeros((4, 4))
    np.add.at(dense, (receivers, senders), 1.0)
    t = np.tanh(dense @ h)
    np.testing.assert_allclose(
        np.asarray(namespace["dh"]), dense.T @ (2 * t * (1 - t**2)), rtol=1e-5, atol=1e-6
    )
