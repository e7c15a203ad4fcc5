"""The bare Celery chord's tasks `bench.turns` compares toolchord against.

Not a tool module: the bench's worker imports it through Celery's `--include` (its main process,
before the pool forks), so its sandbox zygote, which imports the tool modules, never does (this
module imports Celery and the orchestrator; see `toolchord.worker.bench_tools`). `shared_task`
attaches the tasks to every app, finalized or not, so the worker's app and the benchmark's own
know them by name.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

BARE_CALL_TASK = "bench.bare.call"
BARE_COLLECT_TASK = "bench.bare.collect"


@shared_task(name=BARE_CALL_TASK)
def bare_call(n: int) -> str:
    """The bare chord's header task: the same trivial work as the tools."""
    return str(n)


@shared_task(name=BARE_COLLECT_TASK)
def bare_collect(results: list[Any]) -> list[Any]:
    """The bare chord's callback: hand the header's results back."""
    return results
