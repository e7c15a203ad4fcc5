"""The tools the benchmarks run on workers, in a module that imports only toolchord's worker side,
as a small tool module does. The zygote imports it: a tool module that drags in the orchestrator
or Celery doubles the zygote's heap (about 60 MB against 36 MB resident), and every spare's fork
and first touches of that memory cost CPU in proportion (docs/benchmarks.md). The bare Celery
chord `bench turns` compares against has its tasks in `toolchord.orchestrator.bench.bare_tasks`,
which its worker's Celery app imports and its zygote does not."""

from __future__ import annotations

import time

from toolchord.worker.tools import tool


@tool(side_effect="read", timeout=10)
def add(a: int, b: int) -> int:
    """Add two integers (`bench sandbox`)."""
    return a + b


@tool(side_effect="read", timeout=10)
def bench_echo(n: int) -> str:
    """Return the number as text (`bench turns`; the handler runs in the default sandbox: a child process per call)."""
    return str(n)


@tool(side_effect="read", timeout=10, sandbox={"isolate": False})
def bench_echo_inproc(n: int) -> str:
    """Return the number as text (`bench turns`; run in the worker's pool process, without a sandbox child)."""
    return str(n)


@tool(side_effect="read", timeout=10, sandbox={"isolate": False})
def bench_nap(ms: float) -> str:
    """Work for `ms` milliseconds (`bench fairness`'s call)."""
    time.sleep(ms / 1000)
    return "ok"
