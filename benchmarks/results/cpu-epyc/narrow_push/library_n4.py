"""Static ids, N = 4, float32, jitted ``A @ x`` through the library on uniform random ids:
the push in the pieces the sizes fix (the one-piece cells pinned to the push, which
``cpu.choose`` would send to XLA's scatter). Prints ``ids/rows/pieces:ms`` per cell, the
best of three medians of 30 calls. Run with ``JAXCSR_CPU_LIBRARY=<old .so>`` for the
other build, alternating (the README's commands).
Run from the repository root with ``PYTHONPATH=.`` (it uses ``benchmarks.measure``)."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure
from jaxcsr.kernels import cpu


def median_ms(f, *args, reps=30):
    """The median of ``reps`` timed calls after one untimed call, in ms."""
    return measure.time_thunk(lambda: f(*args), reps, warmup=0)[0].median_s * 1e3


rng = np.random.default_rng(1)
cells = []
for n, m, pin in [
    (1000000, 10000, None), (1000000, 100000, None), (2000000, 100000, None),
    (100000, 60000, "push"), (1000000, 1000000, "push"),
]:  # fmt: skip
    ids = rng.integers(0, m, n).astype(np.int32)
    A = jaxcsr.CSRMatrix.from_indices(ids, m)
    x = jnp.asarray(rng.standard_normal((n, 4)).astype(np.float32))
    if pin:
        with cpu.unsorted_kernel(pin):
            f = jax.jit(lambda A, x: A @ x)
            f(A, x).block_until_ready()
    else:
        f = jax.jit(lambda A, x: A @ x)
    best = min(median_ms(f, A, x) for _ in range(3))
    cells.append(f"{n}/{m}/p{cpu.push_pieces(m, n, 4, 4)}:{best:.3f}")
print(" ".join(cells))
