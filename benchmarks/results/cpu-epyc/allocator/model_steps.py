"""The main job's training steps (``benchmarks.models``: GCN, GAT, jraph and molecule
batches), jaxcsr's model against the jax.ops model timed in turns, in this process's
environment: run it once per setting of ``JAXCSR_HUGE_PAGES`` (and without
``GLIBC_TUNABLES``, which would give every system huge pages) to see what the kernels'
huge-page advice does to whole steps. Prints one JSON line: the setting and, per step,
both systems' median ms. Run from the repository root with ``PYTHONPATH=.``."""

import json
import os
import sys

from benchmarks import models

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 9
rows = models.run(models.MAIN_JOB, models.BATCHES, repeats, progress=lambda *a, **k: None)
steps = {
    f"{row['graph']} {row['model']}": {k: round(row["ms"][k], 3) for k in ("jaxcsr", "jax.ops")}
    for row in rows
}
setting = {k: os.environ.get(k, "") for k in ("JAXCSR_HUGE_PAGES", "GLIBC_TUNABLES")}
print(json.dumps({"setting": setting, "steps": steps}), flush=True)
