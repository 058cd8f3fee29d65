"""The package's import graph: no circles, and only :mod:`jaxcsr.kernels` reaches a backend.

Walks every module's imports with ``ast`` -- module level and inside functions (lazy
imports) -- so a rule broken anywhere in the source fails here, whether or not a test
runs that line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jaxcsr
from jaxcsr import kernels

PACKAGE = Path(jaxcsr.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, module: str, modules: set[str]) -> set[str]:
    """Package modules ``source`` imports anywhere (``from pkg import name`` counts as
    ``pkg.name`` when that is a module, else as ``pkg``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against this module's package
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
    return {name for name in found if name in modules}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> package modules it imports (``sources``: module name -> source)."""
    modules = set(sources)
    return {name: _imports(src, name, modules) - {name} for name, src in sources.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def _package_sources() -> dict[str, str]:
    return {_module_name(p, PACKAGE): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def backend_modules() -> set[str]:
    """Modules that implement a registered backend's product."""
    return {backend.product.__module__ for backend in kernels.BACKENDS.values()}


def leaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(module, imported)`` pairs where a module outside ``jaxcsr.kernels`` imports a
    module inside it other than the registry itself."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        if not module.startswith("jaxcsr.kernels")
        for target in targets
        if target.startswith("jaxcsr.kernels.")
    )


def test_no_import_circle():
    graph = import_graph(_package_sources())
    # the package __init__ imports every module; only modules below it count
    graph = {k: v - {"jaxcsr"} for k, v in graph.items()}
    assert find_circle(graph) is None, find_circle(graph)


def test_only_the_registry_imports_backend_modules():
    graph = import_graph(_package_sources())
    assert backend_modules() == {f"jaxcsr.kernels.{m}" for m in ("xla", "gpu", "tpu", "cpu")}
    assert leaks(graph) == []
    assert backend_modules() <= graph["jaxcsr.kernels"]  # reached through the registry


def test_ops_never_branches_on_a_backend_name():
    tree = ast.parse((PACKAGE / "ops.py").read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    # the platform names the primitive lowers for (a backend may share one: "cpu")
    platforms = {
        id(const)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        if any(getattr(t, "id", "") == "PLATFORMS" for t in node.targets)
        for const in ast.walk(node.value)
    }
    strings = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings and id(node) not in platforms
    ]
    assert strings  # the walk sees the module's strings
    assert not set(strings) & set(kernels.BACKENDS)


def test_the_checks_catch_what_they_look_for():
    """The detectors themselves: a circle through a lazy import, a leak from
    ``from pkg import module`` and from a function-level import."""
    sources = {
        "jaxcsr.matrix": "import numpy\ndef f():\n    from jaxcsr import sharding\n",
        "jaxcsr.sharding": "from jaxcsr.matrix import CSRMatrix\n",
        "jaxcsr.kernels": "from jaxcsr.kernels import xla\n",
        "jaxcsr.kernels.xla": "import jax\n",
        "jaxcsr.softmax": "def g():\n    from jaxcsr.kernels import xla\n",
        "jaxcsr.ops": "from jaxcsr.kernels.xla import sddmm\n",
    }
    graph = import_graph(sources)
    assert find_circle(graph) == ["jaxcsr.matrix", "jaxcsr.sharding", "jaxcsr.matrix"]
    assert leaks(graph) == [
        ("jaxcsr.ops", "jaxcsr.kernels.xla"),
        ("jaxcsr.softmax", "jaxcsr.kernels.xla"),
    ]
    del sources["jaxcsr.matrix"]
    assert find_circle(import_graph(sources)) is None


def private_uses(source: str) -> list[str]:
    """Private names of ``jaxcsr`` a module outside the package reaches: imported
    (``from jaxcsr.x import _y``, ``import jaxcsr._x``) or read as an attribute of a name
    bound to a ``jaxcsr`` import (``cpu._gather_stores``); dunders are not private."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found, bound = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcsr"):
            found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
            found += [node.module] if any(map(private, node.module.split("."))) else []
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jaxcsr":
                    found += [alias.name] if any(map(private, alias.name.split("."))) else []
                    bound.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"{root.id}...{node.attr}")
    return found


def test_examples_and_benchmarks_use_the_public_api_only():
    root = PACKAGE.parent
    offenders = {
        str(path.relative_to(root)): uses
        for folder in ("examples", "benchmarks")
        for path in sorted((root / folder).rglob("*.py"))
        if (uses := private_uses(path.read_text()))
    }
    assert offenders == {}


def test_the_private_use_check_catches_what_it_looks_for():
    source = (
        "import jaxcsr\nfrom jaxcsr.kernels import cpu, _x\nimport jaxcsr._y as y\n"
        "from jaxcsr.kernels._z import w\nimport numpy as np\n"
        "cpu._gather_stores('auto')\njaxcsr.kernels._REGISTRY\nnp._private\ncpu.__doc__\n"
    )
    assert sorted(private_uses(source)) == sorted(
        ["jaxcsr.kernels._x", "jaxcsr._y", "jaxcsr.kernels._z", "cpu..._gather_stores",
         "jaxcsr..._REGISTRY"]
    )  # fmt: skip


def test_every_choice_rule_names_its_evidence():
    """Each rule that sends a product one way rather than another says where it was
    measured: a results folder or file that exists (a rule's numbers live there, not in
    the code: no timing figure in its docstring)."""
    import inspect
    import re

    from jaxcsr.kernels import cpu, xla

    rules = [b.coverage.default_for for b in kernels.BACKENDS.values()]
    rules = [r for r in rules if r.__name__ != "<lambda>"]
    rules += [cpu.choose, cpu.traced_scatters, xla]
    assert len(rules) >= 4
    root = PACKAGE.parent
    for rule in rules:
        source = inspect.getsource(rule) if inspect.ismodule(rule) else inspect.getdoc(rule)
        paths = re.findall(r"benchmarks/results/[\w./-]*\w/?", source or "")
        assert paths, f"{getattr(rule, '__qualname__', rule)} names no results file"
        for path in paths:
            assert (root / path).exists(), (rule, path)
        doc = inspect.getdoc(rule) or ""
        assert not re.search(r"\d\.\d+x|\d+(\.\d+)? ?ms\b|geometric mean", doc), rule
