"""Benchmarks for toolchord (run as `python -m orchestrator.bench.<name>`)."""
