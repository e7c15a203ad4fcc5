"""Writing a session's events with secrets masked and the tools' raw-argument policy applied.

Secrets are redacted before an event is written, and a redaction that changed something is
logged as a `Transformation`; raw tool arguments are kept only for tools whose
`ToolSpec.store_raw_arguments` allows it. Provider-signed content stays byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from toolchord.orchestrator.event_stores import EventLog, check_session_id
from toolchord.orchestrator.events import (
    CallParsed,
    CallResult,
    LateResult,
    ModelOutput,
    Transformation,
    TurnDispatched,
    UserInput,
)
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.redaction import MASK, is_secret_key, redact, redact_text
from toolchord.worker.registry import Provider, Registry

RAW_ARGUMENTS_WITHHELD = "(raw arguments not stored for this tool)"

# Provider-signed or provider-opaque content: altering a byte makes the provider reject the history.
# OpenRouter's `reasoning_details` entries and Gemini's `thought_signature` are signed too.
# Anthropic `compaction` blocks carry a signature over their summary.
_VERBATIM_TYPES = frozenset({"reasoning", "thinking", "redacted_thinking", "reasoning.text", "reasoning.summary",
                             "reasoning.encrypted", "compaction"})
_OPAQUE_KEYS = frozenset({"id", "call_id", "tool_call_id", "tool_use_id", "type", "role", "model", "signature",
                          "thought_signature", "encrypted_content", "status", "object", "finish_reason",
                          "stop_reason", "name"})


def redact_json_text(text: str) -> str:
    """Redact text that may be JSON (tool arguments) so that valid JSON stays valid JSON.

    Unchanged text is returned as is (byte for byte); text that needed masking is re-serialized
    compactly; text that is not JSON is redacted as free text.
    """
    try:
        parsed = json.loads(text)
    except ValueError:
        return redact_text(text)
    masked = redact(parsed)
    if masked == parsed:
        return text
    return json.dumps(masked, ensure_ascii=False, separators=(",", ":"))


def redact_payload(value: Any) -> Any:
    """Redact provider payloads (outputs, items) without breaking them.

    Text and tool arguments are redacted; ids, types, signatures, encrypted reasoning and numbers
    (token counts) are kept, and reasoning/thinking blocks stay byte-for-byte because providers
    verify them.
    """
    if isinstance(value, dict):
        if value.get("type") in _VERBATIM_TYPES:
            return value
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in _OPAQUE_KEYS:
                out[key] = item
            elif key == "input" and isinstance(item, dict):
                out[key] = redact(item)
            elif key == "arguments" and isinstance(item, str):
                out[key] = redact_json_text(item)
            elif isinstance(item, str) and item and is_secret_key(key):
                out[key] = MASK
            else:
                out[key] = redact_payload(item)
        return out
    if isinstance(value, list):
        return [redact_payload(item) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _replace_nodes(value: Any, replacements: list[tuple[Any, Any]]) -> Any:
    for old, new in replacements:
        if value == old and type(value) is type(old):
            return new
    if isinstance(value, dict):
        if value.get("type") in _VERBATIM_TYPES:
            return value
        return {key: _replace_nodes(item, replacements) for key, item in value.items()}
    if isinstance(value, list):
        return [_replace_nodes(item, replacements) for item in value]
    return value


def stored_call(call: ToolCall, store_raw: bool) -> ToolCall:
    """The call as it may be written: secrets masked; raw text withheld unless the tool allows it."""
    arguments = redact(call.arguments) if call.arguments is not None else None
    if store_raw:
        raw = redact_json_text(call.arguments_raw)
    elif arguments is not None:
        raw = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    else:
        raw = RAW_ARGUMENTS_WITHHELD
    return call.model_copy(update={"arguments_raw": raw, "arguments": arguments})


def stored_result(result: ToolResult) -> ToolResult:
    return result.model_copy(update={"content": redact_text(result.content) or MASK, "data": redact(result.data)})


class SessionRecorder:
    """Writes a session's events with redaction and the tools' raw-argument policy applied."""

    def __init__(self, log: EventLog, session_id: str, registry: Registry | None = None) -> None:
        self.log = log
        self.session_id = check_session_id(session_id)
        self.registry = registry

    def append(self, event: BaseModel) -> int:
        return self.log.append(self.session_id, event)

    def _append_redacted(self, original: BaseModel, stored: BaseModel, what: str) -> int:
        seq = self.append(stored)
        if original.model_dump(mode="json", exclude={"ts"}) != stored.model_dump(mode="json", exclude={"ts"}):
            self.append(Transformation(kind="redaction", reason=f"masked secrets in {what} before writing",
                                       range=(seq, seq)))
        return seq

    def _store_raw(self, name: str) -> bool:
        spec = self.registry.get(name) if self.registry is not None else None
        return True if spec is None else spec.store_raw_arguments

    def user_input(self, text: str) -> int:
        original = UserInput(text=text)
        return self._append_redacted(original, UserInput(text=redact_text(text), ts=original.ts), "the user input")

    def model_output(self, provider: Provider, model: str, turn_id: str, output: Any,
                     items: list[dict[str, Any]], calls: list[ToolCall]) -> int:
        """Write the output and its parsed calls; withheld raw arguments are replaced in output and items too."""
        replacements: list[tuple[Any, Any]] = []
        stored_calls: list[tuple[ToolCall, ToolCall]] = []
        for call in calls:
            keep_raw = self._store_raw(call.name)
            kept = stored_call(call, keep_raw)
            stored_calls.append((call, kept))
            if not keep_raw:
                replacements.append((call.arguments_raw, kept.arguments_raw))
                if call.arguments is not None:
                    replacements.append((call.arguments, kept.arguments))
        original = ModelOutput(provider=provider, model=model, turn_id=turn_id, output=output, items=items,
                               call_ids=[c.id for c in calls])
        stored = original.model_copy(update={
            "output": redact_payload(_replace_nodes(output, replacements)),
            "items": redact_payload(_replace_nodes(items, replacements)),
        })
        seq = self._append_redacted(original, stored, "the model output")
        for call, kept in stored_calls:
            spec = self.registry.get(call.name) if self.registry is not None else None
            self._append_redacted(
                CallParsed(turn_id=turn_id, call=call, side_effect=spec.side_effect if spec else None),
                CallParsed(turn_id=turn_id, call=kept, side_effect=spec.side_effect if spec else None,
                           raw_stored=self._store_raw(call.name)),
                f"the arguments of call {call.id}",
            )
        return seq

    def dispatched(self, turn_id: str, call_ids: list[str]) -> int:
        return self.append(TurnDispatched(turn_id=turn_id, call_ids=call_ids))

    def result(self, turn_id: str, result: ToolResult, *, late: bool = False) -> int:
        kept = stored_result(result)
        if late:
            return self.append(LateResult(turn_id=turn_id, result=kept))
        return self._append_redacted(CallResult(turn_id=turn_id, result=result),
                                     CallResult(turn_id=turn_id, result=kept), f"the result of call {result.call_id}")


__all__ = ["SessionRecorder", "redact_json_text", "redact_payload", "stored_call", "stored_result"]
