"""Scripts for accelerators (CUDA, TPU) and models of them:
``python -m benchmarks.hardware.<name>``."""
