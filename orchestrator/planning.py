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
) -> TurnRecord:
    """Check every call and group the valid ones: one chain per shared resource, in model order."""
    early: list[ToolResult] = []
    by_resource: dict[str, list[DispatchedCall]] = {}
    groups: list[list[DispatchedCall]] = []
    dispatched: list[DispatchedCall] = []
    awaiting: list[DispatchedCall] = []
    for position, call in enumerate(sorted(calls, key=lambda c: c.index)):
        if position >= settings.max_calls_per_turn:
            early.append(errors.error_result(call, errors.over_call_cap(call, len(calls), settings.max_calls_per_turn)))
            continue
        prepared = prepare_call(
            call, registry, session_id, permission_hook, max_argument_bytes=settings.max_argument_bytes
        )
        if isinstance(prepared, ToolResult):
            early.append(prepared)
            continue
        dc = _dispatched(prepared, registry)
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


def _dispatched(prepared: PreparedCall, registry: Registry) -> DispatchedCall:
    spec = registry[prepared.call.name]
    return DispatchedCall(
        call=prepared.call,
        arguments=prepared.arguments,
        key=prepared.idempotency_key,
        # Stable across resubmission (same key and call), unique within a turn.
        task_id="tc-" + digest(prepared.idempotency_key, prepared.call.id),
        side_effect=spec.side_effect,
    )
