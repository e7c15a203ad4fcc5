"""What the timeline page shows, assembled from the event log, the turn records and call timings.

The event log gives each turn's calls in model order, the dispatch time, the results the model
got and, for a streamed turn, when its message ended and which calls were sent before that (eager
dispatch); the workers' call timings (toolchord.worker.observability.call_timeline) give when and where each call
ran; the turn record gives the idempotency keys of calls that never reached a worker.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog, RedisEventLog
from toolchord.orchestrator.events import (
    CallParsed,
    CallResult,
    CallSentEarly,
    LateResult,
    MessageEnded,
    ModelOutput,
    TurnDispatched,
)
from toolchord.orchestrator.turn_store import RedisTurnStore
from toolchord.worker.observability.call_timeline import TIMELINE_DIR, CallTiming, read_timing_file, read_timings

BarPhase = Literal["queued", "waiting", "running", "retrying", "done"]


class CallBar(BaseModel):
    """One call on the time axis: queued from dispatch to its first start (or to its first wait for a
    fleet-wide limit, then waiting for `waiting_for` until admitted), earlier attempts and their
    backoff up to the last attempt's start, running to its end, then done."""

    call_id: str
    tool: str
    side_effect: str | None = None
    key: str | None = None
    queued_at: float | None = None
    first_started_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    attempts: int = 0
    phase: BarPhase = "queued"
    code: str | None = None
    late_code: str | None = None
    waiting_for: str | None = None
    waiting_since: float | None = None
    sent_early: bool = Field(default=False, description="Sent while its message still streamed (eager "
                             "dispatch); queued from then on.")


class TurnView(BaseModel):
    turn_id: str
    started_at: float
    dispatched_at: float | None = None
    finished_at: float | None = None
    message_ended_at: float | None = Field(default=None, description="When the model's streamed message ended; "
                                           "None for a turn whose message was not streamed.")
    calls: list[CallBar]


class SessionView(BaseModel):
    session_id: str
    now: float
    turns: list[TurnView]


class SessionSummary(BaseModel):
    session_id: str
    last_activity: float | None = None


def _code(result: Any) -> str:
    return "ok" if result.status == "ok" else (result.error.code.value if result.error is not None else "error")


def recent_sessions(log: EventLog, limit: int = 200) -> list[SessionSummary]:
    """The most recently active sessions first (stream ids and file times carry the last write)."""
    names = log.sessions()
    last: dict[str, float | None] = dict.fromkeys(names)
    if isinstance(log, RedisEventLog) and names:
        pipe = log.redis.pipeline(transaction=False)
        for name in names:
            pipe.xrevrange(log.key(name), count=1)
        for name, entries in zip(names, pipe.execute(), strict=True):
            if entries:
                entry_id = entries[0][0].decode() if isinstance(entries[0][0], bytes) else entries[0][0]
                last[name] = int(entry_id.split("-", 1)[0]) / 1000
    elif isinstance(log, JsonlEventLog):
        for name in names:
            last[name] = log.path(name).stat().st_mtime
    ordered = sorted(names, key=lambda n: last[n] or 0.0, reverse=True)
    return [SessionSummary(session_id=n, last_activity=last[n]) for n in ordered[:limit]]


def _apply_timing(bar: CallBar, timing: CallTiming) -> None:
    bar.key = timing.key
    bar.waiting_for, bar.waiting_since = timing.waiting_for, timing.waiting_since
    if timing.phase == "waiting":
        # Not started yet: back in the broker until the limit admits it (or the turn gives up).
        if bar.phase != "done":
            bar.phase = "waiting"
        return
    bar.started_at = timing.started_at
    bar.first_started_at = timing.first_started_at
    bar.worker = timing.worker
    bar.attempts = max(bar.attempts, timing.attempts)
    if bar.queued_at is None or (bar.sent_early and timing.published_at is not None):
        # An early call is logged as sent once its publish returned: the publish time is its queue start.
        bar.queued_at = timing.published_at
    if timing.phase == "done":
        bar.finished_at = timing.finished_at
        bar.phase = "done"
        bar.code = bar.code or timing.code
    elif bar.phase != "done":
        bar.phase = "retrying" if timing.phase == "retrying" else "running"
    # else: the turn answered for it (TIMEOUT, OUTCOME_UNKNOWN) while a worker had it, or its
    # worker was lost mid-call: the bar ends where the model got its answer.


def session_view(log: EventLog, session_id: str, redis_client: Any | None = None) -> SessionView:
    """Every turn of the session with its calls as bars; live while calls run."""
    turns: dict[str, TurnView] = {}
    bars: dict[tuple[str, str], CallBar] = {}
    # A streamed turn logs its early calls and its message's end before its model output.
    sent_early: dict[tuple[str, str], float] = {}
    ended: dict[str, float] = {}
    for event in log.read(session_id):
        if isinstance(event, CallSentEarly):
            sent_early[(event.turn_id, event.call_id)] = event.ts
        elif isinstance(event, MessageEnded):
            ended[event.turn_id] = event.ts
        elif isinstance(event, ModelOutput) and event.call_ids:
            turns[event.turn_id] = TurnView(turn_id=event.turn_id, started_at=event.ts,
                                            message_ended_at=ended.get(event.turn_id), calls=[])
        elif isinstance(event, CallParsed) and event.turn_id in turns:
            parsed = CallBar(call_id=event.call.id, tool=event.call.name, side_effect=event.side_effect)
            bars[(event.turn_id, event.call.id)] = parsed
            turns[event.turn_id].calls.append(parsed)
        elif isinstance(event, TurnDispatched) and event.turn_id in turns:
            turns[event.turn_id].dispatched_at = event.ts
            for call_id in event.call_ids:
                if (queued := bars.get((event.turn_id, call_id))) is not None:
                    sent_at = sent_early.get((event.turn_id, call_id))
                    queued.sent_early = sent_at is not None
                    queued.queued_at = sent_at if sent_at is not None else event.ts
        elif isinstance(event, CallResult) and (bar := bars.get((event.turn_id, event.result.call_id))):
            # The result the model got is the final word (a worker may have stored another later).
            bar.code, bar.phase = _code(event.result), "done"
            bar.attempts = max(bar.attempts, event.result.attempts)
            turns[event.turn_id].finished_at = max(turns[event.turn_id].finished_at or 0.0, event.ts)
            bar.finished_at = bar.finished_at or event.ts
        elif isinstance(event, LateResult):
            for (_, call_id), bar in bars.items():
                if call_id == event.result.call_id:
                    bar.late_code = _code(event.result)
    timings: dict[tuple[str, str], CallTiming] = {}
    if redis_client is not None:
        timings = read_timings(redis_client, session_id)
    elif isinstance(log, JsonlEventLog):
        # An embedded run's worker wrote them beside the logs.
        timings = read_timing_file(log.directory / TIMELINE_DIR, session_id)
    if redis_client is not None or timings:
        store = RedisTurnStore(redis_client, ttl=1) if redis_client is not None else None
        for turn in turns.values():
            record = store.record(session_id, turn.turn_id) if store is not None else None
            keys = {dc.call.id: dc.key for dc in record.dispatched} if record is not None else {}
            early = {r.call_id for r in record.early} if record is not None else set()
            for bar in turn.calls:
                bar.key = keys.get(bar.call_id, bar.key)
                if bar.call_id in early:
                    # Answered by the checks before dispatch: never queued, a mark at the turn's start.
                    bar.queued_at = None
                    bar.started_at = bar.finished_at = turn.dispatched_at or turn.started_at
                timing = timings.get((turn.turn_id, bar.call_id))
                if timing is not None:
                    _apply_timing(bar, timing)
    for turn in turns.values():
        for bar in turn.calls:
            if bar.phase == "done" and bar.started_at is None:
                # Answered without running (checks, deadline): a mark at its answer time.
                bar.started_at = bar.finished_at
    return SessionView(session_id=session_id, now=time.time(), turns=list(turns.values()))


__all__ = ["CallBar", "SessionSummary", "SessionView", "TurnView", "recent_sessions", "session_view"]
