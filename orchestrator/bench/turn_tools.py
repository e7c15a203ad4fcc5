"""What `bench.turns` runs on the workers: two trivial tools and a bare Celery chord's tasks.

Workers load this module through TOOLCHORD_TOOL_MODULES: `Registry.from_modules` imports it before
`create_app()` builds the app, and `shared_task` attaches the bare tasks to every app finalized
after the import, so the worker's app (and the benchmark's own app) knows them by name.
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from toolchord.worker import tool

BARE_CALL_TASK = "bench.bare.call"
BARE_COLLECT_TASK = "bench.bare.collect"


@tool(side_effect="read", timeout=10)
def bench_echo(n: int) -> str:
    """Return the number as text (the handler runs in the default sandbox: a child process per call)."""
    return str(n)


@tool(side_effect="read", timeout=10, sandbox={"isolate": False})
def bench_echo_inproc(n: int) -> str:
    """Return the number as text (run in the worker's pool process, without a sandbox child)."""
    return str(n)


@shared_task(name=BARE_CALL_TASK)
def bare_call(n: int) -> str:
    """The bare chord's header task: the same trivial work as the tools."""
    return str(n)


@shared_task(name=BARE_COLLECT_TASK)
def bare_collect(results: list[Any]) -> list[Any]:
    """The bare chord's callback: hand the header's results back."""
    return results


@tool(side_effect="read", timeout=10, sandbox={"isolate": False})
def bench_nap(ms: float) -> str:
    """Work for `ms` milliseconds (the fairness bench's call)."""
    time.sleep(ms / 1000)
    return "ok"
