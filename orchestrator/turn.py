"""What a turn is made of: its persisted record (for resume) and its result."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr

from toolchord.orchestrator.approval_store import Approval
from toolchord.worker.models import SideEffect, ToolCall, ToolResult
from toolchord.worker.registry import Provider
from toolchord.worker.tools import PriorityClass

TurnStatus = Literal["running", "done"]


class DispatchedCall(BaseModel):
    """A call that passed the checks and went to the workers."""

    call: ToolCall
    arguments: dict[str, Any]
    key: str
    task_id: str
    side_effect: SideEffect


class LateCall(BaseModel):
    """A call whose turn ended before its result: its result is reported in a later turn."""

    call: ToolCall
    key: str
    turn_id: str
    reported: str = Field(description="The error code the model was given when the turn ended.")


class TurnRecord(BaseModel):
    """The persisted plan of a turn: enough to resume it after an orchestrator restart."""

    session_id: str
    turn_id: str
    provider: Provider
    calls: list[ToolCall]
    early: list[ToolResult] = Field(default_factory=list, description="Results decided before dispatch.")
    dispatched: list[DispatchedCall] = Field(default_factory=list)
    awaiting: list[DispatchedCall] = Field(
        default_factory=list, description="Calls held for a person's decision (not dispatched with the turn).")
    groups: list[list[str]] = Field(
        default_factory=list, description="Header elements: call ids run in order (a resource chain) or alone."
    )
    deadline: float
    started_at: float = Field(default_factory=time.time, description="When the turn was planned (epoch seconds).")
    status: TurnStatus = "running"
    tenant: str | None = Field(default=None, description="Whose turn it is, for per-tenant limits.")
    priority: PriorityClass = "interactive"
    # The session's late calls as found when the turn started (not persisted): the turn reports
    # those whose results have arrived when it ends, without reading the list again.
    _late: tuple[LateCall, ...] = PrivateAttr(default=())


class TurnResult(BaseModel):
    """The outcome of one turn: exactly one result per call, in the model's order, except for calls
    that wait for a person's decision: those are in `awaiting_approval` instead (see `waiting`)."""

    session_id: str
    turn_id: str
    provider: Provider
    calls: list[ToolCall]
    results: list[ToolResult]
    late_results: list[ToolResult] = Field(
        default_factory=list,
        description="Results of earlier turns' calls that finished after their turn had ended.",
    )
    awaiting_approval: list[Approval] = Field(
        default_factory=list, description="Calls not dispatched: they wait for approve/deny (docs/approvals.md).")

    @property
    def waiting(self) -> bool:
        """True while some calls of the turn wait for a decision (their results are not in `results`)."""
        return bool(self.awaiting_approval)

    def to_messages(self) -> list[dict[str, Any]]:
        """The results as the provider's request messages/items, paired with their calls by id."""
        from toolchord.orchestrator.providers import get_adapter

        return get_adapter(self.provider).result_items(self.results)

    def late_results_text(self) -> str | None:
        """A note for the model about late results (None when there are none)."""
        if not self.late_results:
            return None
        lines = ["Results that arrived after their turn had ended (the earlier report is superseded):"]
        for result in self.late_results:
            lines.append(f"- call {result.call_id} ({result.name}): {result.status}\n{result.content}")
        return "\n".join(lines)
