"""jaxcsr benchmark suite: ``python -m benchmarks --help``.

Systems are timed in turns in one process, torch among them. torch's OpenMP threads
spin after each call (the active wait policy) and take the cores from the next
system's threads: measured on 2 cores, jaxcsr's 2-thread segment sum ran at its
1-thread speed after a torch call. The suite sets ``OMP_WAIT_POLICY=PASSIVE`` (unless
the environment sets it) before torch can be imported, so every system gets the
cores it asks for.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
