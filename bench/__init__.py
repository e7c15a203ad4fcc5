"""Benchmarks for toolchord (run as `python -m bench.<name>`)."""
