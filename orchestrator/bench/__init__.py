"""Benchmarks for toolchord (run as `python -m toolchord.orchestrator.bench.<name>`)."""
