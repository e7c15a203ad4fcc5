"""Planning a turn: check every call, hold those that need a decision, group the rest for the chord.

Only the first `max_calls_per_turn` calls (model order) are checked and may run; each call past the
cap gets a NOT_EXECUTED result without being read. Valid calls sharing a `resource` are chained in
model order, the others run alone; the turn's deadline leaves room for the longest chain.
"""

from __future__ import annotations

import time

from toolchord.orchestrator.approvals import needs_approval
from toolchord.orchestrator.dispatch import digest
from toolchord.orchestrator.pipeline import PermissionHook, PreparedCall, prepare_call
from toolchord.orchestrator.turn import DispatchedCall, TurnRecord
from toolchord.worker import errors
from toolchord.worker.config import Settings
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.policy import policy_of
from toolchord.worker.registry import Provider, Registry
from toolchord.worker.result_backend import call_task_id
from toolchord.worker.tools import PriorityClass


def plan_turn(
    session_id: str,
    turn_id: str,
    calls: list[ToolCall],
    provider: Provider,
    *,
    registry: Registry,
    settings: Settings,
    permission_hook: PermissionHook | None,
    turn_timeout: float | None,
    tenant: str | None = None,
    priority: PriorityClass = "interactive",
    sent: dict[str, DispatchedCall] | None = None,
) -> TurnRecord:
    """Check every call and group the valid ones: one chain per shared resource, in model order.

    `sent`: calls already dispatched while the message streamed, by call id; a call of the final
    message with the same id, name and arguments keeps that plan (its key and task) instead of
    being checked again."""
    sent = sent or {}
    early: list[ToolResult] = []
    by_resource: dict[str, list[DispatchedCall]] = {}
    groups: list[list[DispatchedCall]] = []
    dispatched: list[DispatchedCall] = []
    awaiting: list[DispatchedCall] = []
    for position, call in enumerate(sorted(calls, key=lambda c: c.index)):
        if position >= settings.max_calls_per_turn:
            early.append(errors.error_result(call, errors.over_call_cap(call, len(calls), settings.max_calls_per_turn)))
            continue
        early_dc = sent.get(call.id)
        if early_dc is not None and early_dc.call.name == call.name and early_dc.call.arguments_raw == call.arguments_raw:
            dispatched.append(early_dc)
            groups.append([early_dc])
            continue
        prepared = prepare_call(
            call, registry, session_id, permission_hook, max_argument_bytes=settings.max_argument_bytes
        )
        if isinstance(prepared, ToolResult):
            early.append(prepared)
            continue
        dc = dispatched_call(prepared, registry)
        if needs_approval(registry[call.name], prepared.arguments):
            awaiting.append(dc)
            continue
        dispatched.append(dc)
        if prepared.resource is None:
            groups.append([dc])
        elif prepared.resource in by_resource:
            by_resource[prepared.resource].append(dc)
        else:
            by_resource[prepared.resource] = [dc]
            groups.append(by_resource[prepared.resource])
    return TurnRecord(
        session_id=session_id,
        turn_id=turn_id,
        provider=provider,
        calls=list(calls),
        early=early,
        dispatched=dispatched,
        awaiting=awaiting,
        groups=[[dc.call.id for dc in group] for group in groups],
        deadline=_deadline(groups, registry, turn_timeout),
        tenant=tenant,
        priority=priority,
    )


def call_deadline(dc: DispatchedCall, registry: Registry, turn_timeout: float | None) -> float:
    """The deadline of one call sent on its own (as a turn of that call alone would have)."""
    return _deadline([[dc]], registry, turn_timeout)


def _deadline(groups: list[list[DispatchedCall]], registry: Registry, turn_timeout: float | None) -> float:
    if turn_timeout is not None:
        return time.time() + turn_timeout
    longest = 0.0
    for group in groups:
        total = 0.0
        for dc in group:
            spec = registry[dc.call.name]
            # Repeatable calls may be retried once after a timeout.
            total += spec.timeout * policy_of(spec.side_effect).deadline_attempts + 2
        longest = max(longest, total)
    return time.time() + longest + 5


def dispatched_call(prepared: PreparedCall, registry: Registry) -> DispatchedCall:
    """The plan of a checked call: its key, its task id (stable across resubmission), its class."""
    spec = registry[prepared.call.name]
    return DispatchedCall(
        call=prepared.call,
        arguments=prepared.arguments,
        key=prepared.idempotency_key,
        # Stable across resubmission (same key and call), unique within a turn.
        task_id=call_task_id(digest(prepared.idempotency_key, prepared.call.id)),
        side_effect=spec.side_effect,
    )
