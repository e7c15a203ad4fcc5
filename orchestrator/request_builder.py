"""Rebuilding the next model request of a session from its event log (docs/agent-loop.md, "Requests").

The same log always gives byte-identical request JSON: the request is rendered from the log in
log order (nothing with an order is sorted, except that results, late ones too, follow the model's
call order) and serialized with one fixed `json.dumps`
configuration (`request_bytes`). A new turn only appends to the log, so it only appends to the
request, and the prefix stays stable for provider prompt caches.

Before returning a request the builder repairs pairing (`history_repair.plan_repair`, logged as a
`repair` transformation) and then checks it (`check_pairing`). Everything provider-specific is
the provider adapter's (orchestrator/providers): the builder walks the log and asks the target's
adapter to clean stored items, convert other providers' turns, place the system prompt, render the
tools and check pairing. Tool arguments that cannot be sent back are sanitized in the request only
(Chat/Responses need a JSON object string, Anthropic an object: they become `{}`); the log keeps
the original output. Reasoning (Responses `reasoning` items with
`encrypted_content`, Anthropic `thinking`/`redacted_thinking` blocks with signatures) is passed back
verbatim to the provider that wrote it. Rendering for another provider converts every turn to the
target's shape, keeps every call paired, and drops the reasoning the target cannot take — logged as
a `format_migration` transformation.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from toolchord.orchestrator.event_stores import EventLog
from toolchord.orchestrator.events import LateResult, ToolDeclaration, Transformation, UserInput
from toolchord.orchestrator.history_repair import History, Turn, plan_repair
from toolchord.orchestrator.providers import PairingError, ProviderAdapter, get_adapter
from toolchord.worker.registry import Provider

DEFAULT_MAX_TOKENS = 4096
_PORTABLE_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


def request_bytes(request: dict[str, Any]) -> bytes:
    """The one serialization of a request: key order as built, compact, UTF-8, NaN refused."""
    return json.dumps(request, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def request_digest(request: dict[str, Any]) -> str:
    return hashlib.sha256(request_bytes(request)).hexdigest()


def render_tools(tools: list[ToolDeclaration], provider: Provider) -> list[dict[str, Any]]:
    """Tool declarations in the provider's request format (the adapter's `render_tool`)."""
    adapter = get_adapter(provider)
    return [adapter.render_tool(declaration) for declaration in tools]


def _portable_id(call_id: str) -> str:
    """An id every provider accepts (Anthropic: [A-Za-z0-9_-]; Chat: at most 40 chars), stable per input."""
    if _PORTABLE_ID.match(call_id):
        return call_id
    return "call_" + hashlib.sha256(call_id.encode()).hexdigest()[:24]


def assistant_text(provider: Provider, items: list[dict[str, Any]]) -> str:
    """The text of an assistant turn stored as request items (reasoning left out)."""
    return "\n\n".join(get_adapter(provider).assistant_text(items).texts)


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


def _user_message(text: str) -> dict[str, Any]:
    # Every provider takes a plain {"role": "user", "content": text} message/input item.
    return {"role": "user", "content": text}


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
    for entry in _late_in_model_order(history):
        if isinstance(entry, UserInput):
            adapter.append_message(messages, _user_message(entry.text))
            continue
        if isinstance(entry, LateResult):
            adapter.append_message(messages, _user_message(late_result_note(entry)))
            continue
        turn: Turn = entry
        missing = turn.missing()
        if missing:
            raise PairingError(f"call(s) {[c.id for c in missing]} of turn {turn.turn_id} have no result; repair first")
        results = [turn.results[call.id] for call in turn.calls]
        if turn.output.provider == target:
            assistant = adapter.clean_items(turn.output.items)
        else:
            assistant, reasoning = _migrated(adapter, turn)
            dropped_reasoning += reasoning
            migrated.append(turn.seq)
            results = [r.model_copy(update={"call_id": _portable_id(r.call_id)}) for r in results]
        for message in assistant + (adapter.result_items(results) if results else []):
            adapter.append_message(messages, message)
    request: dict[str, Any] = {"model": model or (session.model if session else "")}
    if session:
        request.update(session.request_options)
    adapter.place_conversation(request, session.system if session else None, messages,
                               max_tokens or DEFAULT_MAX_TOKENS)
    if history.tools and history.tools.tools:
        request["tools"] = [adapter.render_tool(declaration) for declaration in history.tools.tools]
    adapter.check_pairing(request)
    migration = None
    if migrated:
        migration = Transformation(
            kind="format_migration", target=target, range=(min(migrated), max(migrated)),
            reason=(f"rendered {len(migrated)} assistant turn(s) written for another provider as {target}; "
                    f"dropped {dropped_reasoning} reasoning part(s) {target} cannot take"),
            details={"outputs": migrated, "dropped_reasoning": dropped_reasoning},
        )
    return request, migration


def _late_in_model_order(history: History) -> list[UserInput | Turn | LateResult]:
    """The history's entries with each run of late results in the model's call order (earlier turn
    first, then the call's place in its turn): they are stored in the order they were found."""
    place = {(turn.turn_id, call.id): (turn.seq, n) for turn in history.turns for n, call in enumerate(turn.calls)}
    unknown = (len(history.events), 0)

    def model_order(late: LateResult) -> tuple[int, int]:
        return place.get((late.turn_id, late.result.call_id), unknown)

    entries: list[UserInput | Turn | LateResult] = []
    run: list[LateResult] = []
    for _, entry in [*history.entries, (-1, None)]:
        if isinstance(entry, LateResult):
            run.append(entry)
            continue
        # sorted() is stable: results whose call the log does not know keep their order, last.
        ordered: list[LateResult] = sorted(run, key=model_order)
        entries.extend(ordered)
        run = []
        if entry is not None:
            entries.append(entry)
    return entries


def _migrated(adapter: ProviderAdapter, turn: Turn) -> tuple[list[dict[str, Any]], int]:
    """A turn written for another provider, as `adapter`'s items, and the reasoning parts dropped."""
    text = get_adapter(turn.output.provider).assistant_text(turn.output.items)
    calls = [call.model_copy(update={"id": _portable_id(call.id)}) for call in turn.calls]
    return adapter.assistant_turn(text.texts, calls), text.reasoning


def check_pairing(provider: Provider, request: dict[str, Any]) -> None:
    """Raise PairingError unless every call has exactly one result, placed where the provider wants it.

    Chat: tool messages right after the assistant message that made the calls. Anthropic: the
    tool_result blocks open the next (user) message. Responses: the output comes after its call.
    """
    get_adapter(provider).check_pairing(request)


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
