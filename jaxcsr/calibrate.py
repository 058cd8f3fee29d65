"""Measure this machine for jaxcsr's choices: ``python -m jaxcsr.calibrate``.

Measures the bandwidths and the call floor (about half a second), stores the profile in
``jaxcsr.machine.cache_file()`` for every later process, and prints it. ``--show``
prints the profile in use, the file it was read from, when and under what load it was
measured, and the timed choices stored (:mod:`jaxcsr.timed_choices`), and stores
nothing. Measuring again drops the timed choices: each shape class is timed again at
its first product.
"""

from __future__ import annotations

import argparse
import time

from jaxcsr import machine, timed_choices


def main(argv: list[str] | None = None) -> machine.MachineProfile:
    parser = argparse.ArgumentParser(
        prog="python -m jaxcsr.calibrate",
        description="Measure this machine for jaxcsr's choices and store the profile.",
    )
    parser.add_argument(
        "--show",
        action="store_true",
        help="print the profile in use and where it comes from; measure and store nothing",
    )
    args = parser.parse_args(argv)
    if args.show:
        shown = _show()
        _show_choices()
        return shown
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()  # jax started: what follows is the measurement
    start = time.perf_counter()
    found = machine.calibrate(store=True)
    print(f"measured in {time.perf_counter() - start:.2f} s")
    print(found.summary())
    print(f"stored in {machine.cache_file()}")
    choices = timed_choices.choices_file()
    if choices.exists():
        choices.unlink()
        print(f"removed {choices}: each shape class is timed again at its first product")
    return found


def _show() -> machine.MachineProfile:
    """The profile a product would read now, and where it comes from, then the timed
    choices stored (nothing stored)."""
    path = machine.cache_file()
    found = machine.stored(path)
    if found is not None:
        print(found.profile.summary())
        print(found.describe())
        why = found.stale()
        if why is not None:
            print(f"stale ({why}): the next process that needs it measures again")
        print("(--show stores nothing)")
        return found.profile
    print(machine.DEFAULT.summary())
    exists = "holds no valid profile" if path.exists() else "does not exist"
    print(
        f"{path} {exists}: these are the defaults; the first product that needs the "
        "profile measures this machine (unless JAXCSR_CALIBRATE=0)\n(--show stores nothing)"
    )
    return machine.DEFAULT


def _show_choices() -> None:
    path = timed_choices.choices_file()
    stored = timed_choices.stored()
    if not stored:
        print(f"timed choices: none stored for this library build ({path})")
        return
    print(f"timed choices ({path}):")
    for key, found in sorted(stored.items()):
        times = ", ".join(f"{k} {t:.0f} us" for k, t in sorted(found.times_us.items()))
        print(f"  {key}: {found.kernel} (rule: {found.rule}; {times})")


if __name__ == "__main__":
    main()
