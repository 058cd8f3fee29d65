"""Traced float32 ``segment_sum`` against ``jax.ops.segment_sum`` on uniform random ids,
both jitted with the ids an argument, in turns (3 rounds of 7 or 9 calls; the median of
the rounds' medians, ms). Each argument is ``IDS,ROWS,N``. Prints the push's pieces,
the ids a row and whether ``cpu.traced_scatters`` sends the cell to XLA's scatter.
Run from the repository root with ``PYTHONPATH=.`` (it uses ``benchmarks.measure``)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxcsr
from benchmarks import measure
from jaxcsr.kernels import cpu


def median_ms(f, *args, reps):
    """The median of ``reps`` timed calls after one untimed call, in ms."""
    return measure.time_thunk(lambda: f(*args), reps, warmup=0)[0].median_s * 1e3


rng = np.random.default_rng(1)
for cell in sys.argv[1:]:
    n, m, f = map(int, cell.split(","))
    x = jnp.asarray(rng.standard_normal((n, f)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, m, n).astype(np.int32))
    ours = jax.jit(lambda x, i, m=m: jaxcsr.segment_sum(x, i, m))
    theirs = jax.jit(lambda x, i, m=m: jax.ops.segment_sum(x, i, m))
    reps = 7 if n * f >= 64_000_000 else 9
    times = {"jaxcsr": [], "jax.ops": []}
    for _ in range(3):
        times["jaxcsr"].append(median_ms(ours, x, ids, reps=reps))
        times["jax.ops"].append(median_ms(theirs, x, ids, reps=reps))
    a, b = np.median(times["jaxcsr"]), np.median(times["jax.ops"])
    scatters = cpu.traced_scatters("sum", n, f, np.float32, num_segments=m)
    print(
        f"ids={n} rows={m} N={f} pieces={cpu.push_pieces(m, n, f, 4)} ids/row={n / m:.1f} "
        f"scatters={scatters} jaxcsr={a:.2f} jax.ops={b:.2f} ratio={b / a:.2f}",
        flush=True,
    )
