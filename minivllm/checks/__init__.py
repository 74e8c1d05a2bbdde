"""Correctness checks too large for the CPU tests: `python -m minivllm.checks.NAME` on a GPU. Speed
is measured in `minivllm.benchmarks`, correctness here and in tests/."""
