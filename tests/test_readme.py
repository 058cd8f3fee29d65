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
