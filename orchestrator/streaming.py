"""Eager dispatch: start each tool call as soon as its arguments are complete in the model's stream.

A turn otherwise costs the whole stream plus the slowest tool; started call by call it costs about
the larger of the two. `StreamingTurn` takes the calls a stream accumulator hands out (`add`), sends
each one that may start early as its own Celery signature, and when the message ends (`end`) plans
the whole message as an ordinary turn, reusing the calls already sent and sending the rest. `wait`
then collects every result from the idempotency store (there is no chord to wait for) through the
same `TurnWait` decisions as any turn, and finishes it into one result per call in model order.

Which calls start early (docs/agent-loop.md, "Eager dispatch"): the tool's `eager` option, else its
side-effect class's row (`worker/policy.py`: `read` and `idempotent` yes, `unsafe` no); never a
call held for approval or one whose tool declares a `resource` (chains keep model order, so they
start at the end). A call started early has a key from the session, the model request (`scope`),
its occurrence in the message, its name and arguments, not the provider's call id: a message that
never completes leaves no call in the history, and a retried request that returns the same call
reuses the first run's stored result.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterable, Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from kombu.exceptions import OperationalError

from toolchord.orchestrator.approvals import needs_approval
from toolchord.orchestrator.observability.turns import finished_turn, start_attributes
from toolchord.orchestrator.pipeline import prepare_call
from toolchord.orchestrator.planning import call_deadline, dispatched_call
from toolchord.orchestrator.turn import DispatchedCall, TurnRecord, TurnResult
from toolchord.orchestrator.turn_wait import ASYNC_SLICE, BLOCKING_SLICE, wait_async, wait_blocking
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.observability.tracing import span
from toolchord.worker.policy import policy_of
from toolchord.worker.registry import Provider
from toolchord.worker.tools import PriorityClass, ToolSpec

if TYPE_CHECKING:
    from toolchord.orchestrator.runtime import Orchestrator

log = logging.getLogger("toolchord.orchestrator")


def starts_eagerly(spec: ToolSpec) -> bool:
    """Whether the tool's calls may start before their message ended: its `eager` option, else its class's row."""
    return spec.eager if spec.eager is not None else policy_of(spec.side_effect).eager


class StreamingTurn:
    """One turn whose calls arrive while the model's message streams: `add` each completed call,
    `end` the message (its final calls, or None when it never completed), then `wait`/`await_`."""

    def __init__(self, orchestrator: Orchestrator, session_id: str, turn_id: str, provider: Provider, *,
                 scope: str, eager: bool = True, on_sent: Callable[[ToolCall], None] | None = None,
                 tenant: str | None = None, priority: PriorityClass | None = None) -> None:
        """`scope` names the model request the message answers (the same on a retry of that request:
        the Agent passes the request's digest); `on_sent` hears each call sent before the end;
        `tenant` and `priority` override the orchestrator's for this turn."""
        self._orc = orchestrator
        self._stub = TurnRecord(session_id=session_id, turn_id=turn_id, provider=provider, calls=[],
                                deadline=time.time(), tenant=tenant if tenant is not None else orchestrator.tenant,
                                priority=priority or orchestrator.priority)
        self._scope = scope
        self._eager = eager
        self._on_sent = on_sent
        self._sent: dict[str, DispatchedCall] = {}
        self._deadlines: list[float] = []
        self._occurrences: Counter[tuple[str, str]] = Counter()
        self._added = 0
        self._ended_at: float | None = None
        self._record: TurnRecord | None = None
        self._result: TurnResult | None = None
        self._started = time.monotonic()
        # The turn's span is current while calls are sent, so each call's worker span is its child.
        self._trace = ExitStack()
        self._span = self._trace.enter_context(span("toolchord.turn", start_attributes(session_id, [], turn_id)))

    @property
    def turn_id(self) -> str:
        return self._stub.turn_id

    @property
    def sent_early(self) -> list[str]:
        """Ids of the calls sent before the message ended."""
        return list(self._sent)

    def add(self, call: ToolCall) -> bool:
        """Take one call whose arguments are complete; send it now when it may start early (True)."""
        if self._ended_at is not None:
            raise RuntimeError(f"turn {self.turn_id}: a call was added after its message ended")
        position, self._added = self._added, self._added + 1
        occurrence = self._occurrences[(call.name, call.arguments_raw)]
        self._occurrences[(call.name, call.arguments_raw)] += 1
        orc = self._orc
        settings = orc.runtime.settings
        spec = orc.registry.get(call.name)
        if (not self._eager or position >= settings.max_calls_per_turn or spec is None or not starts_eagerly(spec)
                or spec.resource is not None):
            return False
        prepared = prepare_call(call, orc.registry, self._stub.session_id, orc.permission_hook,
                                max_argument_bytes=settings.max_argument_bytes,
                                eager_scope=f"{self._scope}\0{occurrence}")
        if isinstance(prepared, ToolResult) or needs_approval(spec, prepared.arguments):
            return False  # the end answers it (an invalid call) or holds it (approval), as in any turn
        dc = dispatched_call(prepared, orc.registry)
        deadline = call_deadline(dc, orc.registry, orc.turn_timeout)
        orc.watch(self._stub)
        try:
            orc.dispatcher.send_call(self._stub.model_copy(update={"deadline": deadline}), dc)
        except OperationalError as exc:
            log.warning("turn %s: call %s could not be sent early (%s); it is sent with the turn", self.turn_id,
                        call.id, exc)
            return False
        self._sent[call.id] = dc
        self._deadlines.append(deadline)
        if self._on_sent is not None:
            self._on_sent(call)
        return True

    def end(self, calls: list[ToolCall] | None) -> None:
        """The message ended: `calls` are its final tool calls (all of them, any order), or None when
        it never completed (cut, dropped, refused). Then nothing else starts, the calls already
        sent run on (their results stay stored by key for a retry) and the turn has no result."""
        if self._ended_at is not None:
            raise RuntimeError(f"turn {self.turn_id} already ended")
        self._ended_at = time.time()
        if self._span is not None:
            self._span.add_event("toolchord.message_ended",
                                 {"toolchord.complete": calls is not None, "toolchord.sent_early": len(self._sent)})
        orc = self._orc
        if not calls:  # incomplete, or a final answer without calls: no turn to run
            orc.unwatch(self._stub)
            self._trace.close()
            return
        record = orc.plan(self._stub.session_id, self.turn_id, calls, self._stub.provider, sent=self._sent,
                          tenant=self._stub.tenant, priority=self._stub.priority)
        record.deadline = max([record.deadline, *self._deadlines])
        self._record = record
        try:
            orc.start_streamed(record, set(self._sent))
        except OperationalError as exc:
            log.warning("turn %s: the broker was unreachable: %s", self.turn_id, exc)
            self._close(orc.finish_streamed(record, "the broker could not be reached"))

    def _close(self, turn: TurnResult) -> TurnResult:
        self._result = turn
        finished_turn(self._span, turn, time.monotonic() - self._started)
        self._trace.close()
        return turn

    def _waiting_record(self) -> TurnRecord:
        if self._record is None:
            raise RuntimeError(f"turn {self.turn_id}: wait after a message that did not complete, or before its end")
        return self._record

    def wait(self) -> TurnResult:
        """Block until every call has its one result (or the turn's deadline or a cancel)."""
        if self._result is not None:
            return self._result
        record = self._waiting_record()
        end = wait_blocking(self._orc.store_wait(record, BLOCKING_SLICE), None)
        return self._close(self._orc.finish_streamed(record, end.reason))

    async def await_(self) -> TurnResult:
        """Async twin of `wait`."""
        if self._result is not None:
            return self._result
        record = self._waiting_record()
        end = await wait_async(self._orc.store_wait(record, ASYNC_SLICE), None, None)
        return self._close(self._orc.finish_streamed(record, end.reason))


def run_stream(turn: StreamingTurn, calls: Iterable[ToolCall],
               message_complete: Callable[[list[ToolCall]], list[ToolCall] | None] | None = None) -> TurnResult | None:
    """Feed a turn the calls of a stream as they complete (see `Orchestrator.run_stream`)."""
    seen: list[ToolCall] = []
    with _ended_on_error(turn):
        for call in calls:
            turn.add(call)
            seen.append(call)
    final = _end(turn, seen, message_complete)
    return turn.wait() if final is not None else None


async def arun_stream(turn: StreamingTurn, calls: AsyncIterable[ToolCall],
                      message_complete: Callable[[list[ToolCall]], list[ToolCall] | None] | None = None,
                      ) -> TurnResult | None:
    """Async twin of `run_stream`."""
    seen: list[ToolCall] = []
    with _ended_on_error(turn):
        async for call in calls:
            turn.add(call)
            seen.append(call)
    final = _end(turn, seen, message_complete)
    return await turn.await_() if final is not None else None


@contextmanager
def _ended_on_error(turn: StreamingTurn) -> Iterator[None]:
    """A stream that fails ends its turn as a message that never completed, then raises on."""
    try:
        yield
    except BaseException:
        turn.end(None)
        raise


def _end(turn: StreamingTurn, seen: list[ToolCall],
         message_complete: Callable[[list[ToolCall]], list[ToolCall] | None] | None) -> list[ToolCall] | None:
    """End the turn with the complete message's calls (None: the message did not complete)."""
    final = message_complete(seen) if message_complete is not None else seen
    turn.end(final)
    return final


__all__: list[str] = ["StreamingTurn", "arun_stream", "run_stream", "starts_eagerly"]
