"""The events of a session's log: one pydantic model per kind, and their JSON form.

Everything the next model request is built from is an event, in order: user input, model request
metadata, the model's output, each parsed call, each result, and every transformation of history
(compaction, redaction, format migration, repair) with its reason and range (docs/agent-loop.md,
"Event log"). The stores (`event_stores`) write them as JSON; `recorder` decides what of them
may be written.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from toolchord.worker.models import SideEffect, ToolCall, ToolResult
from toolchord.worker.registry import Provider, Registry, ToolDeclaration

TransformationKind = Literal["compaction", "redaction", "format_migration", "repair"]


class _Event(BaseModel):
    ts: float = Field(default_factory=time.time, description="Wall-clock time of writing; never rendered.")


class SessionStarted(_Event):
    """The session's defaults: the provider and model it talks to, and the system prompt."""

    type: Literal["session_started"] = "session_started"
    provider: Provider
    model: str
    system: str | None = None
    request_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra request fields (max_tokens, temperature, ...), in this order.")


class ToolsDeclared(_Event):
    """The tools offered to the model from here on; `digest` identifies the set."""

    type: Literal["tools_declared"] = "tools_declared"
    tools: list[ToolDeclaration]
    digest: str


class UserInput(_Event):
    type: Literal["user_input"] = "user_input"
    text: str


class ModelRequest(_Event):
    """Metadata of one request sent to the model (the request itself is rebuilt from the log)."""

    type: Literal["model_request"] = "model_request"
    provider: Provider
    model: str
    tools_digest: str
    step: int
    stream: bool = False
    request_digest: str = Field(description="sha256 of the request JSON bytes that were sent.")


class ModelOutput(_Event):
    """The model's answer: raw output (redacted) and the assistant turn as request items."""

    type: Literal["model_output"] = "model_output"
    provider: Provider
    model: str
    turn_id: str
    output: Any = Field(description="The raw output as the provider sent it (plain JSON, redacted).")
    items: list[dict[str, Any]] = Field(description="The assistant turn as request messages/items for `provider`.")
    call_ids: list[str] = Field(default_factory=list)


class CallParsed(_Event):
    """One tool call read from a model output."""

    type: Literal["call_parsed"] = "call_parsed"
    turn_id: str
    call: ToolCall
    side_effect: SideEffect | None = Field(default=None, description="The tool's class; None when unknown.")
    raw_stored: bool = True


class TurnDispatched(_Event):
    """The calls were handed to the runtime: from here on each of them may have started."""

    type: Literal["turn_dispatched"] = "turn_dispatched"
    turn_id: str
    call_ids: list[str]


class CallStarted(_Event):
    """A runtime that observes handler starts may record them; repair treats them like dispatch."""

    type: Literal["call_started"] = "call_started"
    turn_id: str
    call_id: str


class CallSentEarly(_Event):
    """A call was sent to the workers while its message still streamed (eager dispatch). Not part
    of requests or repair: the call enters the history only with its message (`model_output`)."""

    type: Literal["call_sent_early"] = "call_sent_early"
    turn_id: str
    call_id: str
    tool: str


class MessageEnded(_Event):
    """The model's streamed message ended (`ts`): completed cleanly, or not (then its model output is
    never written, and its calls sent early stay out of the history). Not part of requests."""

    type: Literal["message_ended"] = "message_ended"
    turn_id: str
    complete: bool
    reason: str = ""


class CallResult(_Event):
    type: Literal["call_result"] = "call_result"
    turn_id: str
    result: ToolResult
    synthesized: bool = Field(default=False, description="Written by history repair, not by a run.")


class LateResult(_Event):
    """A result that arrived after its call had already been answered (TIMEOUT, OUTCOME_UNKNOWN...).

    Rendered as a note in the next user message (request_builder.late_result_note), never as a
    second result for the call.
    """

    type: Literal["late_result"] = "late_result"
    turn_id: str
    result: ToolResult


class ApprovalRequested(_Event):
    """A call waits for a person's decision: it was not dispatched (toolchord.orchestrator.approvals)."""

    type: Literal["approval_requested"] = "approval_requested"
    turn_id: str
    call_id: str
    tool: str
    arguments: dict[str, Any] = Field(description="The validated arguments, redacted.")
    expires_at: float


class ApprovalDecided(_Event):
    """Who decided a waiting call, when, and what (`expired`: nobody decided before the deadline)."""

    type: Literal["approval_decided"] = "approval_decided"
    turn_id: str
    call_id: str
    tool: str
    decision: Literal["approved", "denied", "expired"]
    by: str
    note: str | None = None
    decided_at: float


class ModelFailed(_Event):
    type: Literal["model_failed"] = "model_failed"
    provider: Provider
    model: str
    error_type: str
    message: str


class Transformation(_Event):
    """An explicit change of history: what was done, why, and to which events (seq range, inclusive)."""

    type: Literal["transformation"] = "transformation"
    kind: TransformationKind
    reason: str
    range: tuple[int, int]
    target: str | None = Field(default=None, description="The provider a format migration rendered for.")
    details: dict[str, Any] = Field(default_factory=dict)


Event = Annotated[
    SessionStarted | ToolsDeclared | UserInput | ModelRequest | ModelOutput | CallParsed | TurnDispatched
    | CallStarted | CallSentEarly | MessageEnded | CallResult | LateResult | ApprovalRequested | ApprovalDecided
    | ModelFailed | Transformation,
    Field(discriminator="type"),
]
_EVENT = TypeAdapter(Event)


def encode_event(event: BaseModel) -> str:
    """One event as a JSON line (without newline)."""
    return event.model_dump_json()


def decode_event(text: str | bytes) -> Event:
    return _EVENT.validate_json(text)


def tools_digest(tools: Iterable[ToolDeclaration]) -> str:
    """A stable digest of a tool set (in declaration order)."""
    data = json.dumps([t.model_dump(mode="json") for t in tools], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def declarations_from_registry(registry: Registry) -> list[ToolDeclaration]:
    """Provider-neutral declarations of a registry's tools, in registry order."""
    return registry.neutral_declarations()


__all__ = [
    "ApprovalDecided",
    "ApprovalRequested",
    "CallParsed",
    "CallResult",
    "CallSentEarly",
    "CallStarted",
    "Event",
    "LateResult",
    "MessageEnded",
    "ModelFailed",
    "ModelOutput",
    "ModelRequest",
    "SessionStarted",
    "ToolDeclaration",
    "ToolsDeclared",
    "Transformation",
    "TransformationKind",
    "TurnDispatched",
    "UserInput",
    "declarations_from_registry",
    "decode_event",
    "encode_event",
    "tools_digest",
]
