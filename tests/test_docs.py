"""Every Python block in the README and in docs/ runs as written (each in a fresh
namespace); the README's example is also checked value by value in test_readme.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{page.name}:{n}")
    for page in PAGES
    for n, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("block", BLOCKS)
def test_python_block_runs(block):
    exec(compile(block, "<docs>", "exec"), {})
