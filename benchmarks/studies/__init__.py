"""Studies behind the design choices: ``python -m benchmarks.studies.<name>``."""
