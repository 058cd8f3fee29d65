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
    """No paths a user does not have, no issue numbers (the GPU kernel's lack of atomics,
    which migration.md states, is checked in its machine code: test_gpu_sass.py)."""
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text, page.name
        assert not re.search(r"\bissues? #?\d", text, re.IGNORECASE), page.name


RESULTS = ROOT / "benchmarks" / "results"
# folders a run writes by default, never committed
UNCOMMITTED = {"latest", "quick", "gpu-latest", "tpu-latest"}


def _named_results(text: str) -> set[str]:
    """``benchmarks/results/...`` paths a page names (trailing punctuation dropped)."""
    found = re.findall(r"benchmarks/results/([A-Za-z0-9_./<>-]+)", text)
    return {path.rstrip(".,:;)`") for path in found}


def test_every_results_path_the_docs_name_exists():
    for page in [*PAGES, ROOT / "DEVELOPMENT.md"]:
        for path in _named_results(page.read_text()):
            if path.split("/")[0] in UNCOMMITTED or "<" in path:
                continue
            assert (RESULTS / path).exists(), f"{page.name}: benchmarks/results/{path}"


def test_every_results_folder_is_linked():
    """Each machine's folder from the docs, each study folder from its machine's README."""
    docs = "\n".join(page.read_text() for page in [*PAGES, ROOT / "DEVELOPMENT.md"])
    committed = (p for p in RESULTS.iterdir() if p.is_dir() and p.name not in UNCOMMITTED)
    for machine in sorted(committed):  # not a run's default output (after a main job)
        assert f"benchmarks/results/{machine.name}" in docs, machine.name
        readme = (machine / "README.md").read_text()
        for folder in sorted(p for p in machine.iterdir() if p.is_dir()):
            assert f"`{folder.name}/`" in readme, f"{machine.name}/{folder.name}"


def test_the_results_checks_catch_what_they_look_for():
    assert _named_results("see `benchmarks/results/cpu-epyc/main_job/`.") == {"cpu-epyc/main_job/"}
    assert not (RESULTS / "cpu" / "main_job_xeon_final").exists()


def test_code_fences_pair_up():
    """Every code block opens with a language and closes: an opening fence lost in an
    edit would leave a Python example unrun and the page misrendered."""
    for page in [*PAGES, ROOT / "DEVELOPMENT.md"]:
        fences = [line for line in page.read_text().splitlines() if line.startswith("```")]
        assert len(fences) % 2 == 0, page.name
        assert all(f != "```" for f in fences[0::2]), page.name  # openers name a language
        assert all(f == "```" for f in fences[1::2]), page.name


def _markdown_pages() -> list[Path]:
    """Every committed markdown page: the guides and the results folders' READMEs and
    tables."""
    skip = {".venv", ".git", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+\s+(.*)$", page.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
        anchors.add(slug.replace(" ", "-"))
    return anchors


def broken_links(page: Path) -> list[str]:
    """Intra-repository links of ``page`` (``[text](target)``, not URLs) whose file or
    heading anchor does not exist, and links left unclosed (``[text](target`` without
    its parenthesis)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not prose
    broken = [f"unclosed: {m}" for m in re.findall(r"\]\([^)\s]*\s*\n", text)]
    broken += [f"unclosed: {m}" for m in re.findall(r"\[[^\]\n]*\(#[^)\n]*\)", text)]
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    return broken


def test_intra_repository_links_resolve():
    broken = {
        p.relative_to(ROOT).as_posix(): b for p in _markdown_pages() if (b := broken_links(p))
    }
    assert not broken, broken


def test_the_link_check_catches_what_it_looks_for(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# A heading, here\n")
    page.write_text(
        "[ok](other.md#a-heading-here) [gone](missing.md) [anchor](other.md#nope)\n"
        "[web](https://example.com) [open](other.md\n"
        "[Measured(#measured-runs) are\n"
    )
    assert broken_links(page) == [
        "unclosed: ](other.md\n",
        "unclosed: [Measured(#measured-runs)",
        "missing.md",
        "other.md#nope",
    ]
