"""A `toolchord.turn` span and the turn metrics around `Orchestrator.run_calls` / `arun_calls`.

The span is current while the chord is published, so every call's span on a worker (carried in
the task headers) is its child: one trace per turn.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

from toolchord.orchestrator.turn import TurnResult
from toolchord.worker.models import ErrorCode
from toolchord.worker.observability.metrics import metrics
from toolchord.worker.observability.tracing import set_attributes, span

F = TypeVar("F", bound=Callable[..., Any])


def start_attributes(session_id: str, calls: list[Any], turn_id: str | None) -> dict[str, Any]:
    return {"toolchord.session_id": session_id, "toolchord.turn_id": turn_id, "toolchord.calls": len(calls)}


def finished_turn(current: Any, turn: TurnResult, seconds: float) -> None:
    """Put the turn's outcome on its span (`current`) and count it in the turn metrics."""
    codes = [r.error.code.value for r in turn.results if r.error is not None]
    set_attributes(current, {
        "toolchord.turn_id": turn.turn_id,
        "toolchord.errors": len(codes),
        "toolchord.error_code": ",".join(sorted(set(codes))) or None,
        "toolchord.late_results": len(turn.late_results),
    })
    m = metrics()
    if m is None:
        return
    m.turns.inc()
    m.turn_seconds.observe(seconds)
    for result in turn.results:
        code = result.error.code.value if result.error is not None else "ok"
        m.turn_results.labels(result.name, code).inc()
        if code == ErrorCode.OUTCOME_UNKNOWN.value:
            m.outcome_unknown.labels(result.name).inc()
    for result in turn.late_results:
        m.late_results.labels(result.name).inc()


def observed_turn(method: F) -> F:
    """Decorate `run_calls(self, session_id, calls, *, turn_id=None, ...)` or its async twin."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(self: Any, session_id: str, calls: list[Any], *args: Any, **kwargs: Any) -> TurnResult:
            started = time.monotonic()
            with span("toolchord.turn", start_attributes(session_id, calls, kwargs.get("turn_id"))) as current:
                turn = await method(self, session_id, calls, *args, **kwargs)
                finished_turn(current, turn, time.monotonic() - started)
            return turn

        return run_async  # type: ignore[return-value]

    @functools.wraps(method)
    def run(self: Any, session_id: str, calls: list[Any], *args: Any, **kwargs: Any) -> TurnResult:
        started = time.monotonic()
        with span("toolchord.turn", start_attributes(session_id, calls, kwargs.get("turn_id"))) as current:
            turn = method(self, session_id, calls, *args, **kwargs)
            finished_turn(current, turn, time.monotonic() - started)
        return turn

    return run  # type: ignore[return-value]


__all__ = ["finished_turn", "observed_turn", "start_attributes"]
