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
    if "xla_force_host_platform_device_count" in block:
        # forces several CPU devices, which must happen before jax is imported
        import subprocess
        import sys

        result = subprocess.run(
            [sys.executable, "-c", block], capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return
    exec(compile(block, "<docs>", "exec"), {})


def test_user_docs_speak_of_the_project_only():
    """No paths a user does not have, no issue numbers, no claims the code contradicts."""
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text, page.name
        assert not re.search(r"\bissues? #?\d", text, re.IGNORECASE), page.name
    migration = (ROOT / "docs" / "migration.md").read_text()
    assert "integer atomics" not in migration  # the GPU kernel has no atomics
    assert "uses no" in migration and "atomics" in migration
