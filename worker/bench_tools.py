"""The tool `toolchord bench sandbox` runs: in a module that imports only toolchord's worker side,
as a small tool module does. The zygote imports it: a tool module that drags in the orchestrator
or Celery doubles the zygote's heap (about 60 MB against 36 MB resident), and every spare's fork
and first touches of that memory cost CPU in proportion (docs/benchmarks.md)."""

from __future__ import annotations

from toolchord.worker.tools import tool


@tool(side_effect="read", timeout=10)
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b
