"""Measure this machine for jaxcsr's choices: ``python -m jaxcsr.calibrate``.

Measures the bandwidths and the call floor (about half a second), stores the profile in
:func:`jaxcsr.machine.cache_file` for every later process, and prints it. ``--show``
prints the profile in use without measuring (``JAXCSR_CALIBRATE=0`` and no stored file:
the defaults).
"""

from __future__ import annotations

import argparse
import time

from jaxcsr import machine


def main(argv: list[str] | None = None) -> machine.MachineProfile:
    parser = argparse.ArgumentParser(prog="python -m jaxcsr.calibrate", description=__doc__)
    parser.add_argument("--show", action="store_true", help="print the profile in use only")
    args = parser.parse_args(argv)
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # jax started: what follows is the measurement
    start = time.perf_counter()
    found = machine.profile() if args.show else machine.calibrate(store=True)
    if not args.show:
        print(f"measured in {time.perf_counter() - start:.2f} s")
    print(found.summary())
    print(f"stored in {machine.cache_file()}" if found.source != "defaults" else "not stored")
    return found


if __name__ == "__main__":
    main()
