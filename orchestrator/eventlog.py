"""The append-only event log of a session (shared/DESIGN.md section 8).

Everything the next model request is built from is an event here, in order: user input, model
request metadata, the model's output, each parsed call, each result, and every transformation of
history (compaction, redaction, format migration, repair) with its reason and range. Events are
pydantic models written as JSON; one `EventLog` Protocol has two stores: Redis Streams (XADD /
XRANGE) when distributed and a local JSONL file per session when embedded.

Secrets are redacted before an event is written (`SessionRecorder`), and raw tool arguments are kept
only for tools whose `ToolSpec.store_raw_arguments` allows it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, TypeAdapter

from toolchord.worker.models import SideEffect, ToolCall, ToolResult
from toolchord.worker.redaction import MASK, is_secret_key, redact, redact_text
from toolchord.worker.registry import Provider, Registry, ToolDeclaration

LOG_DIR_ENV = "TOOLCHORD_LOG_DIR"
DEFAULT_LOG_DIR = ".toolchord/logs"
STREAM_PREFIX = "toolchord:log:"
RAW_ARGUMENTS_WITHHELD = "(raw arguments not stored for this tool)"

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
    | CallStarted | CallResult | LateResult | ApprovalRequested | ApprovalDecided | ModelFailed | Transformation,
    Field(discriminator="type"),
]
_EVENT = TypeAdapter(Event)


def encode_event(event: BaseModel) -> str:
    """One event as a JSON line (without newline)."""
    return event.model_dump_json()


def decode_event(text: str | bytes) -> Event:
    return _EVENT.validate_json(text)


@runtime_checkable
class EventLog(Protocol):
    """An append-only log of events per session."""

    def append(self, session_id: str, event: BaseModel) -> int:
        """Append one event; returns its position (seq, from 0) in the session's log."""
        ...

    def read(self, session_id: str) -> list[Event]:
        """All events of the session, in order (empty for an unknown session)."""
        ...

    def sessions(self) -> list[str]:
        """Known session ids."""
        ...


_SAFE_SESSION = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def _check_session_id(session_id: str) -> str:
    # Session ids become file names and Redis keys: refuse anything that could escape the directory.
    if not _SAFE_SESSION.match(session_id) or session_id in (".", ".."):
        raise ValueError(f"invalid session id {session_id!r}: use letters, digits, '.', '_' or '-'")
    return session_id


class JsonlEventLog:
    """One `<session>.jsonl` file per session under `directory` (embedded mode).

    Each event is written with a single O_APPEND write and fsync, so a crash leaves at most one
    partial last line, which `read` ignores (it was never acknowledged to the caller) and the next
    `append` cuts off before writing. Appends know each file's size and event count from the last
    append, so they read the file only when it changed behind their back.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory or os.environ.get(LOG_DIR_ENV) or DEFAULT_LOG_DIR)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._known: dict[Path, tuple[int, int]] = {}  # path -> (size, events) after our last append

    def path(self, session_id: str) -> Path:
        return self.directory / f"{_check_session_id(session_id)}.jsonl"

    def append(self, session_id: str, event: BaseModel) -> int:
        path = self.path(session_id)
        line = (encode_event(event) + "\n").encode()
        with self._lock:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                known = self._known.get(path)
                if known is not None and known[0] == size:
                    seq = known[1]
                else:
                    data = os.pread(fd, size, 0)
                    complete = data[: data.rfind(b"\n") + 1]
                    if len(complete) != size:
                        # A torn last line from a crash: appending after it would glue the two.
                        os.ftruncate(fd, len(complete))
                        size = len(complete)
                    seq = sum(1 for part in complete.split(b"\n") if part)
                os.write(fd, line)
                os.fsync(fd)
                self._known[path] = (size + len(line), seq + 1)
            finally:
                os.close(fd)
        return seq

    def read(self, session_id: str) -> list[Event]:
        return [decode_event(line) for line in self._lines(self.path(session_id))]

    def sessions(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.jsonl"))

    @staticmethod
    def _lines(path: Path) -> list[bytes]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        # The last element is b"" after a complete write, or a torn partial line after a crash.
        return [line for line in lines[:-1] if line]


class RedisEventLog:
    """One Redis Stream per session (`toolchord:log:<session>`), one JSON field per entry."""

    def __init__(self, url: str | None = None, *, client: Any = None, prefix: str = STREAM_PREFIX,
                 master_name: str | None = None) -> None:
        from toolchord.worker.redis_clients import redis_client

        self.redis = (
            client if client is not None
            else redis_client(url or "redis://127.0.0.1:6379/0", master_name=master_name)
        )
        self.prefix = prefix

    def key(self, session_id: str) -> str:
        return self.prefix + _check_session_id(session_id)

    def append(self, session_id: str, event: BaseModel) -> int:
        key = self.key(session_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(key, {"e": encode_event(event)})
        pipe.xlen(key)
        _, length = pipe.execute()
        return int(length) - 1

    def read(self, session_id: str) -> list[Event]:
        key = self.key(session_id)
        events: list[Event] = []
        start = "-"
        while True:
            batch = self.redis.xrange(key, min=start, max="+", count=1000)
            if not batch:
                return events
            for _entry_id, fields in batch:
                events.append(decode_event(fields.get(b"e") or fields.get("e")))
            last = batch[-1][0]
            last = last.decode() if isinstance(last, bytes) else last
            start = "(" + last  # exclusive range start: continue after the last entry read

    def sessions(self) -> list[str]:
        names = (k.decode() if isinstance(k, bytes) else k for k in self.redis.scan_iter(match=self.prefix + "*"))
        return sorted(name.removeprefix(self.prefix) for name in names)


def open_event_log(*, redis_url: str | None = None, log_dir: str | os.PathLike[str] | None = None) -> EventLog:
    """The log for the configuration: Redis Streams when distributed, a JSONL file per session when embedded.

    Explicit arguments win; otherwise `toolchord.worker.config.Settings.from_env()` decides (a configured
    broker means distributed, and its Redis URL holds the streams).
    """
    from toolchord.worker.config import Settings

    if redis_url:
        return RedisEventLog(redis_url, master_name=os.environ.get("TOOLCHORD_REDIS_MASTER_NAME"))
    if log_dir is not None:
        return JsonlEventLog(log_dir)
    settings = Settings.from_env()
    if not settings.embedded and settings.redis_url:
        return RedisEventLog(client=settings.redis_client())
    return JsonlEventLog(settings.log_dir)


def tools_digest(tools: Iterable[ToolDeclaration]) -> str:
    """A stable digest of a tool set (in declaration order)."""
    data = json.dumps([t.model_dump(mode="json") for t in tools], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()[:16]


# --- redaction of what goes into the log -------------------------------------------------------

# Provider-signed or provider-opaque content: altering a byte makes the provider reject the history.
# OpenRouter's `reasoning_details` entries and Gemini's `thought_signature` are signed too.
_VERBATIM_TYPES = frozenset({"reasoning", "thinking", "redacted_thinking", "reasoning.text", "reasoning.summary",
                             "reasoning.encrypted"})
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
        self.session_id = _check_session_id(session_id)
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


def declarations_from_registry(registry: Registry) -> list[ToolDeclaration]:
    """Provider-neutral declarations of a registry's tools, in registry order."""
    return registry.neutral_declarations()


__all__ = [
    "ApprovalDecided",
    "ApprovalRequested",
    "CallParsed",
    "CallResult",
    "CallStarted",
    "Event",
    "EventLog",
    "JsonlEventLog",
    "LateResult",
    "ModelFailed",
    "ModelOutput",
    "ModelRequest",
    "RedisEventLog",
    "SessionRecorder",
    "SessionStarted",
    "ToolDeclaration",
    "ToolsDeclared",
    "Transformation",
    "TurnDispatched",
    "UserInput",
    "declarations_from_registry",
    "decode_event",
    "encode_event",
    "open_event_log",
    "redact_json_text",
    "redact_payload",
    "tools_digest",
]
