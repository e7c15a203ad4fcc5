"""Plain JSON data from SDK models and dicts, and the JSON reading rules shared by all providers."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from toolchord.orchestrator.providers.protocol import AssistantText, ProviderFormatError
from toolchord.worker.errors import json_problem
from toolchord.worker.models import ToolCall
from toolchord.worker.redaction import well_formed
from toolchord.worker.registry import ToolDeclaration

# Values under these keys are the model's own data (tool arguments): a null inside them is meaningful.
OPAQUE_KEYS = frozenset({"input", "arguments"})
# In a str, a surrogate is always lone: JSON decoding joins the pairs into one code point.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def to_plain(value: Any) -> Any:
    """SDK models, mappings and sequences as plain JSON data (dicts, lists, scalars).

    SDK models are dumped with their own `to_dict`, which uses the API's field names and keeps only
    the fields that were received (or set), so the result is what the API sent, not the SDK defaults.
    Dumped in Python mode, then made JSON-able with infinite floats kept: pydantic's JSON mode
    would turn a tool input's 1e400 (read as infinity) into null, another value than the model sent.
    """
    if isinstance(value, BaseModel):
        sdk_to_dict = getattr(value, "to_dict", None)
        if callable(sdk_to_dict):
            # Leniently built SDK objects are normal: no serialization warnings.
            return to_jsonable_python(sdk_to_dict(mode="python", warnings=False), inf_nan_mode="constants")
        return to_jsonable_python(value.model_dump(by_alias=True, exclude_unset=True), inf_nan_mode="constants")
    if isinstance(value, Mapping):
        return {str(key): to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    return value


def without_nulls(value: Any) -> Any:
    """A copy without null fields, which the APIs treat as absent (and some reject in requests).

    Tool arguments (keys in OPAQUE_KEYS) are copied untouched: there a null is the model's value.
    """
    if isinstance(value, dict):
        return {
            key: (item if key in OPAQUE_KEYS else without_nulls(item))
            for key, item in value.items()
            if item is not None
        }
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class ArgumentsProblem(ValueError):
    """Why argument text is not a JSON object; the message is what the model is told."""


_JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number",
                    bool: "boolean", type(None): "null"}


def json_type_name(value: Any) -> str:
    """The JSON name of a parsed value's type ("array", "string", "null", ...)."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def load_arguments(raw: str) -> dict[str, Any]:
    """Argument text as a JSON object, or ArgumentsProblem saying why it is not one.

    Empty (or whitespace-only) text means no arguments: `{}` (Chat models send "" for tools without
    parameters). Strict JSON: NaN and Infinity are rejected (not JSON, no provider sends them), and
    so are lone surrogates (`"\\ud800"`): they are not Unicode, so the arguments could not be
    encoded for the sandbox, a worker or the event log.
    """
    if not raw.strip():
        return {}
    try:
        parsed = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ArgumentsProblem(json_problem(exc)) from None
    except ValueError as exc:
        raise ArgumentsProblem(f"{exc} (use a number or null)") from None
    except RecursionError:
        raise ArgumentsProblem("unreadable input (RecursionError: nested too deeply)") from None
    if not isinstance(parsed, dict):
        raise ArgumentsProblem(f"got a JSON {json_type_name(parsed)}, expected an object")
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end]
        raise ArgumentsProblem(
            f"it contains a lone surrogate ({bad.encode('unicode_escape').decode()}), which is not valid Unicode"
        ) from None
    except (ValueError, RecursionError):
        raise ArgumentsProblem("unreadable input (nested too deeply)") from None
    return parsed


def parse_arguments(raw: str) -> dict[str, Any] | None:
    """The arguments as a dict when `raw` is a JSON object by `load_arguments`' rules, else None."""
    try:
        return load_arguments(raw)
    except ArgumentsProblem:
        return None


def escaped_surrogates(text: str) -> str:
    """`text` with each lone surrogate written as its JSON escape (`\\ud800`), as a stream delivers it.

    Argument text keeps saying what the model sent (and stays INVALID_JSON: `load_arguments` refuses
    the escape too), but becomes Unicode that UTF-8, pydantic and the event log can store.
    """
    return _LONE_SURROGATE.sub(lambda match: f"\\u{ord(match[0]):04x}", text)


def well_formed_output(value: Any) -> Any:
    """A non-streamed model output (plain data) fit for the log: lone surrogates in argument text
    escaped (`escaped_surrogates`), in any other text replaced by U+FFFD, as streamed text comes out.
    Values without lone surrogates are returned as they are."""
    if isinstance(value, dict):
        return {key: (escaped_surrogates(item) if key == "arguments" and isinstance(item, str)
                      else well_formed_output(item)) for key, item in value.items()}
    if isinstance(value, list):
        return [well_formed_output(item) for item in value]
    if isinstance(value, str):
        return well_formed(value)
    return value


# A JSON string, or Python's spelling of an infinite float outside one.
_STRING_OR_INFINITY = re.compile(r'"(?:[^"\\]|\\.)*"|-?Infinity')


def json_text(value: Any) -> str:
    """JSON text without whitespace, non-ASCII kept as is. An infinite float is written as `1e400`
    (`-1e400`): JSON numbers have no size limit, so that is how an overflowing number arrived, and
    it reads back as the same infinity. NaN stays `NaN`, which no JSON text can carry."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if "Infinity" not in text:
        return text
    return _STRING_OR_INFINITY.sub(lambda m: m[0] if m[0].startswith('"') else m[0].replace("Infinity", "1e400"), text)


def compact_json(value: Any) -> str:
    """`json_text` with lone surrogates escaped (they are not Unicode). Used for arguments that
    arrive as objects: an SDK reads a number too large for a float as infinity, which must stay a
    number (INVALID_ARGUMENTS, as the same text in a string of arguments), not become `Infinity`."""
    return escaped_surrogates(json_text(value))


def read_arguments(value: Any) -> tuple[str, dict[str, Any] | None]:
    """(arguments_raw, arguments) for arguments that arrive as JSON text or as an object.

    Text is kept verbatim (lone surrogates escaped) and parsed; an object is serialized compactly and used as is; a missing
    value reads as empty text, which means no arguments (`{}`).
    """
    if value is None:
        return "", {}
    if isinstance(value, str):
        value = escaped_surrogates(value)
        return value, parse_arguments(value)
    text = compact_json(value)
    return text, parse_arguments(text) if isinstance(value, dict) else None


def replayable_arguments(text: Any) -> str:
    """Argument text to send back in an assistant message: itself when it is a JSON object, else `{}`.

    Some providers reject (HTTP 400) a replayed call whose arguments are not a JSON object; the
    result the model got for the call already quotes what it sent.
    """
    return text if isinstance(text, str) and text.strip() and parse_arguments(text) is not None else "{}"


def call_arguments_json(call: ToolCall) -> str:
    """A call's arguments as JSON object text for a migrated turn (`{}` when they were unreadable)."""
    return json.dumps(call.arguments if call.arguments is not None else {}, ensure_ascii=False)


def function_declaration(declaration: ToolDeclaration) -> dict[str, Any]:
    """The function-tool body OpenAI's APIs share (Chat nests it under "function", Responses does not)."""
    return {"name": declaration.name, "description": declaration.description,
            "parameters": declaration.parameters, "strict": declaration.strict}


def text_parts(content: Any, reasoning_types: frozenset[str]) -> tuple[list[str], int]:
    """The text of a content string or list of parts, and how many parts were reasoning."""
    if isinstance(content, str):
        return ([content] if content else []), 0
    texts: list[str] = []
    reasoning = 0
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        if part.get("type") in reasoning_types:
            reasoning += 1
        elif isinstance(part.get("text"), str) and part["text"]:
            texts.append(part["text"])
    return texts, reasoning


def messages_text(messages: list[dict[str, Any]], reasoning_types: frozenset[str],
                  reasoning_fields: tuple[str, ...] = ()) -> AssistantText:
    """The text of stored assistant messages, counting reasoning parts and reasoning fields."""
    texts: list[str] = []
    reasoning = 0
    for message in messages:
        found, parts = text_parts(message.get("content"), reasoning_types)
        texts += found
        reasoning += parts + sum(1 for key in reasoning_fields if message.get(key))
    return AssistantText(texts, reasoning)


def indexed_across(calls: list[ToolCall]) -> list[ToolCall]:
    """Calls of several stored messages of one turn, indexed by their position among all of them."""
    return [call.model_copy(update={"index": index}) for index, call in enumerate(calls)]


def as_mapping(value: Any, what: str) -> dict[str, Any]:
    """`value` (already plain) as a dict, or ProviderFormatError naming `what` it should have been."""
    if not isinstance(value, dict):
        raise ProviderFormatError(f"{what} must be an object, got {type(value).__name__}")
    return value


def as_list(value: Any, what: str) -> list[Any]:
    """`value` (already plain) as a list; None reads as empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProviderFormatError(f"{what} must be a list, got {type(value).__name__}")
    return value


def required_text(container: Mapping[str, Any], key: str, what: str) -> str:
    """A non-empty string field, or ProviderFormatError: a call without id or name cannot be answered."""
    value = container.get(key)
    if not isinstance(value, str) or not value:
        raise ProviderFormatError(f"{what} has no {key!r} (got {value!r})")
    return value


class DeltaBuffer:
    """Streamed text deltas kept as parts and joined once, when the text is read.

    `item[key] = item[key] + delta` copies the whole text at every delta: a 5 MB argument in 1 KB
    deltas would copy gigabytes. Call `flush` before reading any buffered field.
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[int, str], tuple[dict[str, Any], list[str]]] = {}

    def add(self, target: dict[str, Any], key: str, delta: str) -> None:
        """Append `delta` to the text `target[key]` (missing or None reads as empty)."""
        entry = self._pending.get((id(target), key))
        if entry is None:
            entry = self._pending[(id(target), key)] = (target, [target.get(key) or ""])
        entry[1].append(delta)

    def flush(self) -> None:
        """Write every buffered text into its field."""
        for (_, key), (target, parts) in self._pending.items():
            target[key] = "".join(parts)
        self._pending.clear()


def newly_rankable(start: int, present: Mapping[int, Any], *, final: bool) -> list[int]:
    """Stream positions from `start` on whose rank among the calls is now known, in order.

    A rank is known once every earlier position has arrived: the contiguous run of present
    positions from `start` (at the end of the stream, every remaining one). Streams call this with
    `start` just past the last position ranked, so each position is looked at once.
    """
    if final:
        return sorted(index for index in present if index >= start)
    pending: list[int] = []
    while start + len(pending) in present:
        pending.append(start + len(pending))
    return pending


def check_unique_ids(ids: list[str], what: str) -> None:
    """Two calls with one id could not be paired with their results."""
    seen: set[str] = set()
    for call_id in ids:
        if call_id in seen:
            raise ProviderFormatError(f"{what}: two tool calls share the id {call_id!r}")
        seen.add(call_id)


class _Text:
    """Streamed text as its parts, joined once at the end (linear in the stream's length)."""

    __slots__ = ("parts",)

    def __init__(self, first: str) -> None:
        self.parts = [first]


def _is_indexed(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(entry, dict) and "index" in entry for entry in value)


def _merge_into(target: dict[str, Any], delta: Mapping[str, Any]) -> None:
    for key, value in delta.items():
        if value is None:
            continue
        current = target.get(key)
        if key in ("index", "type"):
            target[key] = value  # identify an entry or a union member: replaced, never concatenated
        elif current is None and _is_indexed(value):
            target[key] = []
            _merge_list(target[key], value)
        elif current is None:
            target[key] = _opened(value)
        elif isinstance(current, _Text) and isinstance(value, str):
            current.parts.append(value)
        elif isinstance(current, dict) and isinstance(value, dict):
            _merge_into(current, value)
        elif isinstance(current, list) and isinstance(value, list):
            _merge_list(current, value)
        else:
            target[key] = _opened(value)


def _merge_list(target: list[Any], delta: list[Any]) -> None:
    if not _is_indexed(delta):
        target.extend(_opened(entry) for entry in delta)
        return
    for entry in delta:
        index = entry.get("index") if isinstance(entry, dict) else None
        if not isinstance(index, int):
            raise ProviderFormatError(f"a streamed list entry has no integer 'index': {entry!r}")
        if index < len(target) and isinstance(target[index], dict):
            _merge_into(target[index], entry)
        else:
            target.insert(index, _opened(entry))


def _opened(value: Any) -> Any:
    """A delta value in the mergeable form: text as parts, containers copied."""
    if isinstance(value, str):
        return _Text(value)
    if isinstance(value, dict):
        merged: dict[str, Any] = {}
        _merge_into(merged, value)
        return merged
    if isinstance(value, list):
        return [_opened(entry) for entry in value]
    return value


def _closed(value: Any) -> Any:
    if isinstance(value, _Text):
        return "".join(value.parts)
    if isinstance(value, dict):
        return {key: _closed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_closed(entry) for entry in value]
    return value


class DeltaFields:
    """Stream delta fields an accumulator does not interpret itself, merged like the openai SDK's
    accumulator: text concatenated, objects merged, lists of `index`ed objects merged by index,
    other lists appended, `index`/`type` and other values replaced.

    Provider extensions (DeepSeek `reasoning_content`, OpenRouter `reasoning_details`, Gemini
    `extra_content`) must go back in the next request, so nothing unknown is dropped.
    """

    def __init__(self) -> None:
        self._fields: dict[str, Any] = {}

    def add(self, delta: Mapping[str, Any], known: frozenset[str]) -> None:
        """Merge the fields of `delta` not in `known` (null values are no news)."""
        _merge_into(self._fields, {key: value for key, value in delta.items() if key not in known})

    def value(self) -> dict[str, Any]:
        """The merged fields as plain JSON data."""
        closed: dict[str, Any] = _closed(self._fields)
        return closed
