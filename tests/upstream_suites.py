"""Runs JAX's and jraph's own segment tests with jaxcsr's functions swapped in.

    python tests/upstream_suites.py jax PATH/TO/lax_numpy_indexing_test.py [pytest args]
    python tests/upstream_suites.py jraph [pytest args]
    (add --baseline first to run the suite on jax.ops itself)

``jax``: JAX's ``tests/lax_numpy_indexing_test.py`` of the installed version (from a
checkout of jax-ml/jax at the tag ``jax-v<version>``; it needs ``absl-py``), its
segment tests only. ``jraph``: jraph's ``utils_test.py`` and ``models_test.py``, which
ship inside the installed package. Before either suite is imported,
``jax.ops.segment_{sum,max,min,prod}`` and jraph's ``segment_softmax`` are replaced by
jaxcsr's (jraph's own ``segment_*`` call ``jax.ops``), so every call the tests make
runs jaxcsr. jraph's ``utils_test.py`` imports ``jax.lib.xla_bridge``, which newer JAX
no longer has; it is pointed at ``jax._src.xla_bridge``. Not part of the repository's
test run: the upstream files are not in
this repository. ``docs/migration.md`` gives the counts last measured.
"""

from __future__ import annotations

import os
import sys

import jax
import pytest

import jaxcsr

SWAPPED = ("segment_sum", "segment_max", "segment_min", "segment_prod")


def swap_in() -> None:
    """Points ``jax.ops``' segment functions (and jraph's softmax) at jaxcsr's."""
    for name in SWAPPED:
        setattr(jax.ops, name, getattr(jaxcsr, name))
    try:
        from jraph._src import utils
    except ImportError:
        return
    utils.segment_softmax = jaxcsr.segment_softmax


def main(argv: list[str]) -> int:
    baseline = bool(argv) and argv[0] == "--baseline"
    argv = argv[1:] if baseline else argv
    if not argv or argv[0] not in ("jax", "jraph"):
        raise SystemExit(__doc__)
    if not baseline:
        swap_in()
    if argv[0] == "jax":
        if len(argv) < 2:
            raise SystemExit("give the path of JAX's tests/lax_numpy_indexing_test.py")
        return pytest.main([argv[1], "-k", "Segment", "-p", "no:cacheprovider", *argv[2:]])
    import jraph
    from jax._src import xla_bridge

    sys.modules.setdefault("jax.lib.xla_bridge", xla_bridge)
    jax.lib.xla_bridge = xla_bridge  # gone from jax.lib in newer JAX; jraph's tests use it
    root = os.path.join(os.path.dirname(jraph.__file__), "_src")
    tests = [os.path.join(root, name) for name in ("utils_test.py", "models_test.py")]
    return pytest.main([*tests, "-p", "no:cacheprovider", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
