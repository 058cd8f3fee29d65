"""jaxcsr benchmark suite: ``python -m benchmarks --help``."""
