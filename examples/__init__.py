"""Runnable model clients of jaxcsr: ``python -m examples.gcn``, ``python -m examples.gat``."""
