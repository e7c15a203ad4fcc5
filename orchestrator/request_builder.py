"""Rebuilding the next model request of a session from its event log (shared/DESIGN.md section 8).

The same log always gives byte-identical request JSON: the request is rendered from the log in
log order (nothing with an order is sorted) and serialized with one fixed `json.dumps`
configuration (`request_bytes`). A new turn only appends to the log, so it only appends to the
request, and the prefix stays stable for provider prompt caches.

Before returning a request the builder repairs pairing (`history_repair.plan_repair`, logged as a
`repair` transformation) and then checks it (`check_pairing`). Tool arguments that cannot be sent
back are sanitized in the request only (Chat/Responses need a JSON object string, Anthropic an
object: they become `{}`); the log keeps the original. Reasoning (Responses `reasoning` items with
`encrypted_content`, Anthropic `thinking`/`redacted_thinking` blocks with signatures) is passed back
verbatim to the provider that wrote it. Rendering for another provider converts every turn to the
target's shape, keeps every call paired, and drops the reasoning the target cannot take — logged as
a `format_migration` transformation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

from orchestrator.eventlog import EventLog, LateResult, ToolDeclaration, Transformation, UserInput
from orchestrator.history_repair import History, Turn, plan_repair
from orchestrator.providers import get_adapter, parse_arguments
from worker.models import ToolCall
from worker.registry import Provider

DEFAULT_MAX_TOKENS = 4096
_REASONING_TYPES = frozenset({"reasoning", "thinking", "redacted_thinking"})
_PORTABLE_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


class PairingError(RuntimeError):
    """A rendered request breaks call/result pairing: a broken invariant, never sent to a provider."""


def request_bytes(request: dict[str, Any]) -> bytes:
    """The one serialization of a request: key order as built, compact, UTF-8, NaN refused."""
    return json.dumps(request, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def request_digest(request: dict[str, Any]) -> str:
    return hashlib.sha256(request_bytes(request)).hexdigest()


def render_tools(tools: list[ToolDeclaration], provider: Provider) -> list[dict[str, Any]]:
    """Tool declarations in the provider's request format (same shapes as worker.registry.declaration)."""
    out: list[dict[str, Any]] = []
    for decl in tools:
        if provider == "anthropic":
            out.append({"name": decl.name, "description": decl.description, "input_schema": decl.parameters})
            continue
        function = {"name": decl.name, "description": decl.description, "parameters": decl.parameters,
                    "strict": decl.strict}
        out.append({"type": "function", "function": function} if provider == "chat" else {"type": "function", **function})
    return out


# --- sanitizing stored items ------------------------------------------------------------------


def _json_object_text(text: Any) -> str:
    return text if isinstance(text, str) and parse_arguments(text) is not None else "{}"


def _sanitize_items(provider: Provider, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored assistant items with arguments the provider would reject replaced by `{}`."""
    items = copy.deepcopy(items)
    for item in items:
        if provider == "chat":
            for call in item.get("tool_calls") or []:
                function = call.get("function")
                if isinstance(function, dict):
                    function["arguments"] = _json_object_text(function.get("arguments"))
        elif provider == "responses":
            if item.get("type") == "function_call":
                item["arguments"] = _json_object_text(item.get("arguments"))
        elif isinstance(item.get("content"), list):
            for block in item["content"]:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    value = block.get("input")
                    # Invalid streamed input is stored as {"INVALID_JSON": text} (see the adapter).
                    if not isinstance(value, dict) or set(value) == {"INVALID_JSON"}:
                        block["input"] = {}
    return items


# --- provider-neutral conversion --------------------------------------------------------------


def _portable_id(call_id: str) -> str:
    """An id every provider accepts (Anthropic: [A-Za-z0-9_-]; Chat: at most 40 chars), stable per input."""
    if _PORTABLE_ID.match(call_id):
        return call_id
    return "call_" + hashlib.sha256(call_id.encode()).hexdigest()[:24]


def _texts(provider: Provider, items: list[dict[str, Any]]) -> tuple[list[str], int]:
    """The assistant text parts of stored items, and how many reasoning parts they had."""
    texts: list[str] = []
    reasoning = 0
    for item in items:
        if provider == "responses":
            if item.get("type") in _REASONING_TYPES:
                reasoning += 1
            elif item.get("type", "message") == "message":
                content = item.get("content")
                if isinstance(content, str):
                    texts.append(content)
                else:
                    texts.extend(p["text"] for p in content or [] if isinstance(p, dict) and isinstance(p.get("text"), str))
            continue
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        for part in content or []:
            if not isinstance(part, dict):
                continue
            if part.get("type") in _REASONING_TYPES:
                reasoning += 1
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
        if provider == "chat" and item.get("reasoning_content"):
            reasoning += 1
    return [t for t in texts if t], reasoning


def assistant_text(provider: Provider, items: list[dict[str, Any]]) -> str:
    """The text of an assistant turn stored as request items (reasoning left out)."""
    return "\n\n".join(_texts(provider, items)[0])


def _arguments_for(call: ToolCall) -> dict[str, Any]:
    return call.arguments if call.arguments is not None else {}


def _assistant_in(target: Provider, texts: list[str], calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant turn (text and calls) in the target provider's request shape."""
    text = "\n\n".join(texts)
    if target == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = [
                {"id": _portable_id(c.id), "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(_arguments_for(c), ensure_ascii=False)}}
                for c in calls
            ]
        return [message]
    if target == "anthropic":
        blocks: list[dict[str, Any]] = [{"type": "text", "text": t} for t in texts]
        blocks += [{"type": "tool_use", "id": _portable_id(c.id), "name": c.name, "input": _arguments_for(c)}
                   for c in calls]
        # Anthropic refuses an empty assistant message; an empty turn is written as such.
        return [{"role": "assistant", "content": blocks or [{"type": "text", "text": "(no output)"}]}]
    items: list[dict[str, Any]] = [{"role": "assistant", "content": text}] if text else []
    items += [{"type": "function_call", "call_id": _portable_id(c.id), "name": c.name,
               "arguments": json.dumps(_arguments_for(c), ensure_ascii=False)} for c in calls]
    return items


# --- rendering --------------------------------------------------------------------------------


def late_result_note(late: LateResult) -> str:
    """What the model is told when a call it was given up on has finished after all.

    The call already has a result (TIMEOUT, OUTCOME_UNKNOWN, ...) in its own turn; providers allow
    one result per call, so the real outcome arrives as a note in the next user message.
    """
    result = late.result
    return (
        f"[toolchord] Call {result.call_id} ({result.name}) from an earlier turn finished after its "
        f"turn had ended; this supersedes the error reported for it then. Status: {result.status}.\n"
        f"{result.content}"
    )


def _user_message(target: Provider, text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _append_message(target: Provider, messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """Append, merging consecutive Anthropic user messages (its turns must alternate)."""
    if target == "anthropic" and messages and message.get("role") == "user" and messages[-1].get("role") == "user":
        previous = messages[-1]
        def blocks(content: Any) -> list[Any]:
            return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        previous["content"] = blocks(previous["content"]) + blocks(message["content"])
        return
    messages.append(message)


def render(history: History, provider: Provider | None = None, *, model: str | None = None,
           max_tokens: int | None = None) -> tuple[dict[str, Any], Transformation | None]:
    """The request for `provider` (default: the session's) and the migration it needed, if any.

    Pure: reads only `history`. Expects a repaired history (every call has a result); raises
    PairingError otherwise.
    """
    session = history.session
    target: Provider = provider or (session.provider if session else "chat")
    adapter = get_adapter(target)
    messages: list[dict[str, Any]] = []
    migrated: list[int] = []
    dropped_reasoning = 0
    for _, entry in history.entries:
        if isinstance(entry, UserInput):
            _append_message(target, messages, _user_message(target, entry.text))
            continue
        if isinstance(entry, LateResult):
            _append_message(target, messages, _user_message(target, late_result_note(entry)))
            continue
        turn: Turn = entry
        missing = turn.missing()
        if missing:
            raise PairingError(f"call(s) {[c.id for c in missing]} of turn {turn.turn_id} have no result; repair first")
        results = [turn.results[call.id] for call in turn.calls]
        if turn.output.provider == target:
            assistant = _sanitize_items(target, turn.output.items)
        else:
            texts, reasoning = _texts(turn.output.provider, turn.output.items)
            dropped_reasoning += reasoning
            migrated.append(turn.seq)
            assistant = _assistant_in(target, texts, turn.calls)
            results = [r.model_copy(update={"call_id": _portable_id(r.call_id)}) for r in results]
        for message in assistant:
            _append_message(target, messages, message)
        for message in adapter.result_items(results) if results else []:
            _append_message(target, messages, message)
    request: dict[str, Any] = {"model": model or (session.model if session else "")}
    if session:
        request.update(session.request_options)
    system = session.system if session else None
    if target == "anthropic":
        request.setdefault("max_tokens", max_tokens or DEFAULT_MAX_TOKENS)
        if system:
            request["system"] = system
        request["messages"] = messages
    elif target == "chat":
        request["messages"] = ([{"role": "system", "content": system}] if system else []) + messages
    else:
        if system:
            request["instructions"] = system
        request["input"] = messages
    if history.tools and history.tools.tools:
        request["tools"] = render_tools(history.tools.tools, target)
    check_pairing(target, request)
    migration = None
    if migrated:
        migration = Transformation(
            kind="format_migration", target=target, range=(min(migrated), max(migrated)),
            reason=(f"rendered {len(migrated)} assistant turn(s) written for another provider as {target}; "
                    f"dropped {dropped_reasoning} reasoning part(s) {target} cannot take"),
            details={"outputs": migrated, "dropped_reasoning": dropped_reasoning},
        )
    return request, migration


def _calls_and_results(provider: Provider, request: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(kind, call id, position) for every call and result of a rendered request, in order."""
    seen: list[tuple[str, str, int]] = []
    if provider == "responses":
        for position, item in enumerate(request.get("input", [])):
            if item.get("type") == "function_call":
                seen.append(("call", item["call_id"], position))
            elif item.get("type") == "function_call_output":
                seen.append(("result", item["call_id"], position))
        return seen
    for position, message in enumerate(request.get("messages", [])):
        if provider == "chat":
            for call in message.get("tool_calls") or []:
                seen.append(("call", call["id"], position))
            if message.get("role") == "tool":
                seen.append(("result", message["tool_call_id"], position))
            continue
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if block.get("type") == "tool_use":
                seen.append(("call", block["id"], position))
            elif block.get("type") == "tool_result":
                seen.append(("result", block["tool_use_id"], position))
    return seen


def check_pairing(provider: Provider, request: dict[str, Any]) -> None:
    """Raise PairingError unless every call has exactly one result, placed where the provider wants it.

    Chat: tool messages right after the assistant message that made the calls. Anthropic: the
    tool_result blocks open the next (user) message. Responses: the output comes after its call.
    """
    entries = _calls_and_results(provider, request)
    calls: dict[str, int] = {}
    answered: set[str] = set()
    for kind, call_id, position in entries:
        if kind == "call":
            if call_id in calls:
                raise PairingError(f"duplicate call id {call_id!r}")
            calls[call_id] = position
            continue
        if call_id not in calls:
            raise PairingError(f"result for unknown call {call_id!r}")
        if call_id in answered:
            raise PairingError(f"second result for call {call_id!r}")
        answered.add(call_id)
        call_at = calls[call_id]
        if provider == "anthropic" and position != call_at + 1:
            raise PairingError(f"tool_result for {call_id!r} is not in the message after its tool_use")
        if provider == "responses" and position <= call_at:
            raise PairingError(f"function_call_output for {call_id!r} precedes its call")
    unanswered = [c for c in calls if c not in answered]
    if unanswered:
        raise PairingError(f"call(s) without result: {unanswered}")
    if provider == "chat":
        messages = request.get("messages", [])
        for position, message in enumerate(messages):
            ids = [c["id"] for c in message.get("tool_calls") or []]
            following = [m.get("tool_call_id") for m in messages[position + 1:position + 1 + len(ids)]]
            if ids and sorted(following) != sorted(ids):
                raise PairingError(f"tool messages for {ids} do not directly follow their assistant message")


class RequestBuilder:
    """Builds the next request of a session from its log, repairing pairing first.

    With `persist=True` (the default) repairs and migrations are appended to the log as events, so
    every later build — in any process — renders the same bytes.
    """

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def history(self, session_id: str, *, persist: bool = True) -> History:
        """The session's history with pairing repaired (repair events appended when `persist`)."""
        events = self.log.read(session_id)
        repair = plan_repair(History.from_events(events))
        if repair:
            if persist:
                for event in repair:
                    self.log.append(session_id, event)
                events = self.log.read(session_id)
            else:
                events = events + repair
        return History.from_events(events)

    def build(self, session_id: str, provider: Provider | None = None, *, model: str | None = None,
              persist: bool = True) -> dict[str, Any]:
        """The next request (a JSON-ready dict) for `provider` (default: the session's provider)."""
        history = self.history(session_id, persist=persist)
        request, migration = render(history, provider, model=model)
        if migration is not None and persist and not _covered(history, migration):
            self.log.append(session_id, migration)
        return request

    def build_bytes(self, session_id: str, provider: Provider | None = None, *, model: str | None = None,
                    persist: bool = True) -> bytes:
        """`build` serialized with `request_bytes`: what is compared for byte-identical rebuilds."""
        return request_bytes(self.build(session_id, provider, model=model, persist=persist))


def _covered(history: History, migration: Transformation) -> bool:
    """True when the log already records this migration (same target, every output in it)."""
    outputs = set(migration.details["outputs"])
    for _, done in history.transformations("format_migration"):
        if done.target == migration.target:
            outputs -= set(done.details.get("outputs", []))
    return not outputs


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "PairingError",
    "RequestBuilder",
    "assistant_text",
    "check_pairing",
    "late_result_note",
    "render",
    "render_tools",
    "request_bytes",
    "request_digest",
]
