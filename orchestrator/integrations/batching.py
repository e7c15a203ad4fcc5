"""One toolchord turn per model response, for frameworks that invoke each tool call separately.

The OpenAI Agents SDK and Pydantic AI run the calls of one model response as concurrent asyncio
tasks, one tool invocation each. `TurnBatcher` gathers the invocations that share a response key
(session and response) during a short window and runs them as one turn (`Orchestrator.arun_calls`):
one chord, one deadline, calls on a shared resource in model order, late results reported once.
Each invocation gets the result carrying its own call id.

The turn id is toolchord's default (a digest of the session and the call ids), and each call's
idempotency key is derived from the session and the framework's call id, so a framework that
invokes the same call again (a resumed or replayed run) joins the same turn and the same keys:
stored results come back without running, and an `unsafe` call is never run a second time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass, field

from toolchord.orchestrator.runtime import Orchestrator
from toolchord.orchestrator.turn import TurnResult
from toolchord.worker.models import ToolCall, ToolResult

DEFAULT_BATCH_WINDOW = 0.01
"""Seconds an invocation waits for the other calls of its model response before the turn starts."""


@dataclass
class _Batch:
    """The calls of one model response gathered so far, and the task that will run them."""

    session_id: str
    calls: list[ToolCall] = field(default_factory=list)
    waiting: int = 0
    task: asyncio.Task[TurnResult] | None = None


def with_late_results(turn: TurnResult, result: ToolResult) -> str:
    """The text a framework hands the model for `result`: its content, and on the turn's first
    result only (so the model reads it once) the note on earlier calls' late results."""
    note = turn.late_results_text()
    if note is None or not turn.results or turn.results[0].call_id != result.call_id:
        return result.content
    return f"{result.content}\n\n{note}"


class TurnBatcher:
    """Gathers single tool invocations into turns, keyed by (session, model response)."""

    def __init__(self, orchestrator: Orchestrator, *, window: float = DEFAULT_BATCH_WINDOW) -> None:
        self.orchestrator = orchestrator
        self.window = window
        self._open: dict[tuple[str, Hashable], _Batch] = {}

    async def run(
        self, session_id: str, response_key: Hashable, call_id: str, name: str, arguments_raw: str
    ) -> tuple[TurnResult, ToolResult]:
        """Run one call as part of its response's turn; returns the turn and this call's result.

        Cancelling the invocation stops waiting, never the turn: its calls go on, and the same
        call invoked again later (a retried run) finds their results by key.
        """
        key = (session_id, response_key)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Batch(session_id=session_id)
            batch.task = asyncio.get_running_loop().create_task(self._dispatch(key, batch))
        if all(call.id != call_id for call in batch.calls):
            batch.calls.append(ToolCall(id=call_id, name=name, arguments_raw=arguments_raw, index=len(batch.calls)))
        batch.waiting += 1
        assert batch.task is not None
        try:
            turn = await asyncio.shield(batch.task)
        except asyncio.CancelledError:
            batch.waiting -= 1
            if batch.waiting == 0:
                # Nobody waits for this turn any more: stop watching it (the workers carry on),
                # and let calls arriving from now on start a turn of their own.
                if self._open.get(key) is batch:
                    del self._open[key]
                batch.task.cancel()
            raise
        batch.waiting -= 1
        return turn, next(r for r in turn.results if r.call_id == call_id)

    async def _dispatch(self, key: tuple[str, Hashable], batch: _Batch) -> TurnResult:
        try:
            await asyncio.sleep(self.window)
        finally:
            # Calls of this response arriving from now on start a turn of their own.
            if self._open.get(key) is batch:
                del self._open[key]
        return await self.orchestrator.arun_calls(batch.session_id, list(batch.calls))


__all__ = ["DEFAULT_BATCH_WINDOW", "TurnBatcher", "with_late_results"]
