"""Benchmarks: `python -m minivllm.benchmarks.NAME`. Speed is measured here, never in tests."""
