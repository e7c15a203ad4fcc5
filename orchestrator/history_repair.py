"""Reading a session log as a conversation, and repairing its pairing after a crash.

`History.from_events` indexes the log: turns (model outputs) with their calls, the first result
of each call, and results that pair with nothing (orphans) or with an already answered call
(duplicates). `plan_repair` returns the events that make every call paired again, all derived
from the log alone so every process computes the same repair:

- a call that was never dispatched gets a NOT_EXECUTED result (it had no effect);
- a dispatched (or started) call without a recorded end gets OUTCOME_UNKNOWN when its tool is
  `unsafe`, ABORTED otherwise — both with a "do not retry blindly; verify first" hint;
- orphan and duplicate results are left out of requests;
and one `Transformation(kind="repair")` event says what was done, why, and to which range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolchord.orchestrator.events import (
    CallParsed,
    CallResult,
    CallStarted,
    Event,
    LateResult,
    ModelOutput,
    SessionStarted,
    ToolsDeclared,
    Transformation,
    TurnDispatched,
    UserInput,
)
from toolchord.orchestrator.providers import ProviderFormatError, get_adapter
from toolchord.worker import errors
from toolchord.worker.models import SideEffect, ToolCall, ToolResult
from toolchord.worker.policy import policy_of
from toolchord.worker.registry import Provider

RESTORE_REASON = "the conversation was restored after an interruption before it started"


@dataclass
class Turn:
    """One model output and the calls it made, with what the log says happened to each."""

    seq: int
    output: ModelOutput
    calls: list[ToolCall]
    side_effects: dict[str, SideEffect | None] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    results: dict[str, ToolResult] = field(default_factory=dict)

    @property
    def turn_id(self) -> str:
        return self.output.turn_id

    def missing(self) -> list[ToolCall]:
        return [call for call in self.calls if call.id not in self.results]


@dataclass
class History:
    """A session log read as a conversation."""

    events: list[Event]
    session: SessionStarted | None = None
    tools: ToolsDeclared | None = None
    entries: list[tuple[int, UserInput | Turn | LateResult]] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)

    @classmethod
    def from_events(cls, events: list[Event]) -> History:
        history = cls(events=events)
        turns: dict[str, Turn] = {}
        parsed: dict[tuple[str, str], CallParsed] = {}
        for seq, event in enumerate(events):
            if isinstance(event, SessionStarted):
                history.session = event
            elif isinstance(event, ToolsDeclared):
                history.tools = event
            elif isinstance(event, (UserInput, LateResult)):
                history.entries.append((seq, event))
            elif isinstance(event, ModelOutput):
                turn = Turn(seq=seq, output=event, calls=[])
                turns[event.turn_id] = turn
                history.entries.append((seq, turn))
            elif isinstance(event, CallParsed):
                parsed[(event.turn_id, event.call.id)] = event
            elif isinstance(event, TurnDispatched) and event.turn_id in turns:
                turns[event.turn_id].started.update(event.call_ids)
            elif isinstance(event, CallStarted) and event.turn_id in turns:
                turns[event.turn_id].started.add(event.call_id)
        for turn in turns.values():
            turn.calls = _turn_calls(turn.output, parsed)
            for call in turn.calls:
                entry = parsed.get((turn.turn_id, call.id))
                turn.side_effects[call.id] = entry.side_effect if entry else None
        # A set per turn: a turn of N calls must not cost N lookups of N ids each.
        call_ids = {turn_id: {call.id for call in turn.calls} for turn_id, turn in turns.items()}
        for seq, event in enumerate(events):
            if not isinstance(event, CallResult):
                continue
            owner = turns.get(event.turn_id)
            call_id = event.result.call_id
            if owner is None or call_id not in call_ids[event.turn_id]:
                history.orphans.append(seq)
            elif call_id in owner.results:
                history.duplicates.append(seq)
            else:
                owner.results[call_id] = event.result
        return history

    @property
    def turns(self) -> list[Turn]:
        return [entry for _, entry in self.entries if isinstance(entry, Turn)]

    def transformations(self, kind: str) -> list[tuple[int, Transformation]]:
        return [(seq, e) for seq, e in enumerate(self.events) if isinstance(e, Transformation) and e.kind == kind]


def calls_in_items(provider: Provider, items: list[dict[str, Any]]) -> list[ToolCall]:
    """The calls of an assistant turn stored as request items (read with the provider's adapter)."""
    return get_adapter(provider).calls_in_items(items)


def _turn_calls(output: ModelOutput, parsed: dict[tuple[str, str], CallParsed]) -> list[ToolCall]:
    """The calls of a turn in model order: as recorded when parsed, else read back from the items."""
    try:
        from_items = calls_in_items(output.provider, output.items)
    except ProviderFormatError:
        from_items = []
    by_id = {call.id: call for call in from_items}
    ids = output.call_ids or [call.id for call in from_items]
    calls = []
    for call_id in ids:
        entry = parsed.get((output.turn_id, call_id))
        call = entry.call if entry is not None else by_id.get(call_id)
        if call is not None:
            calls.append(call)
    return calls


def synthesized_result(turn: Turn, call: ToolCall) -> ToolResult:
    """The deterministic result of a call that has none: depends only on the log."""
    if call.id not in turn.started:
        error = errors.not_executed(call, RESTORE_REASON)
    elif policy_of(turn.side_effects.get(call.id)).unobserved_is_unknown:
        error = errors.outcome_unknown(call, "the conversation was restored after an interruption")
    else:
        error = errors.aborted(call)
    return errors.error_result(call, error)


def plan_repair(history: History) -> list[Event]:
    """Events that restore pairing (synthesized results, then one repair Transformation), or []."""
    reported: set[int] = set()
    for _, transformation in history.transformations("repair"):
        reported.update(transformation.details.get("dropped_results", []))
    planned: list[Event] = []
    synthesized: dict[str, str] = {}
    affected: list[int] = []
    for turn in history.turns:
        for call in turn.missing():
            result = synthesized_result(turn, call)
            planned.append(CallResult(turn_id=turn.turn_id, result=result, synthesized=True))
            synthesized[call.id] = result.error.code.value if result.error else "ok"
            affected.append(turn.seq)
    dropped = [seq for seq in history.orphans + history.duplicates if seq not in reported]
    if not planned and not dropped:
        return []
    affected.extend(dropped)
    reasons = []
    if synthesized:
        reasons.append(f"{len(synthesized)} call(s) had no recorded result")
    if dropped:
        reasons.append(f"{len(dropped)} result(s) paired with no call or an already answered call")
    planned.append(Transformation(
        kind="repair",
        reason="; ".join(reasons) + ": history restored so that every call has exactly one result",
        range=(min(affected), len(history.events) - 1),
        details={"synthesized": synthesized, "dropped_results": sorted(dropped)},
    ))
    return planned


__all__ = ["History", "Turn", "calls_in_items", "plan_repair", "synthesized_result"]
