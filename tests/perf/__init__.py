"""Benchmarks, run by hand (``python -m tests.perf.<name>``); pytest does not collect them."""
