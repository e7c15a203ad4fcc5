"""OpenAI Chat Completions: `message.tool_calls` in, `role: "tool"` messages out.

Assistant output is the assistant message: an SDK `ChatCompletionMessage`, a dict message, or a
whole `ChatCompletion` (SDK object or dict), of which `choices[0].message` is taken.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from toolchord.orchestrator.providers.pairing import PairingEntry, check_entries
from toolchord.orchestrator.providers.plain_data import (
    DeltaFields,
    as_list,
    as_mapping,
    call_arguments_json,
    check_unique_ids,
    function_declaration,
    indexed_across,
    messages_text,
    read_arguments,
    replayable_arguments,
    required_text,
    to_plain,
    without_nulls,
)
from toolchord.orchestrator.providers.protocol import AssistantText, PairingError, ProviderFormatError, ProviderName
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import ToolDeclaration

# Fields of a response message (and of its tool calls) that a request's assistant message does not
# take: `parsed`, `index` and `parsed_arguments` come from the SDK's parse helpers and accumulator.
# Every other field is kept: providers' extensions must go back (DeepSeek `reasoning_content`,
# OpenRouter `reasoning_details`, Gemini `extra_content.google.thought_signature`).
_RESPONSE_ONLY_FIELDS = frozenset({"annotations", "parsed"})
_RESPONSE_ONLY_CALL_FIELDS = frozenset({"index"})
_RESPONSE_ONLY_FUNCTION_FIELDS = frozenset({"parsed_arguments"})
# Delta fields the stream accumulator interprets; any other field is merged as it comes.
_INTERPRETED_DELTA_FIELDS = frozenset({"role", "content", "refusal", "tool_calls", "function_call"})
_INTERPRETED_FRAGMENT_FIELDS = frozenset({"index", "id", "type", "function"})
_INTERPRETED_FUNCTION_FIELDS = frozenset({"name", "arguments"})
_REASONING_PART_TYPES = frozenset({"reasoning", "thinking", "redacted_thinking"})
_REASONING_FIELDS = ("reasoning_content", "reasoning_details", "reasoning")
# What ends a run of characters that cannot change a JSON text's nesting: outside strings, brackets
# and quotes; inside a string, its closing quote or an escape.
_STRUCTURE = re.compile(r'[{}\[\]"]')
_STRING_END = re.compile(r'["\\]')


class _ObjectEnd:
    """Watches a call's arguments as they stream and tells when they form a whole JSON object.

    Once the outermost `{` is closed nothing but whitespace can follow in valid JSON, so the call
    is complete then, not only when the next call starts or the message ends (a chat stream marks
    neither). Each character is looked at once, across fragments (an escape may end one).
    """

    def __init__(self) -> None:
        self._depth = 0
        self._started = False
        self._in_string = False
        self._escaped = False
        self.closed = False

    def feed(self, piece: str) -> bool:
        """Take the next piece of the arguments; True when this piece closed the outermost object."""
        if self.closed:
            return False
        position = 0
        if not self._started:
            stripped = piece.lstrip()
            if not stripped:
                return False
            if stripped[0] != "{":
                self.closed = True  # not an object: the call completes with the message
                return False
            position = len(piece) - len(stripped)
            self._started = True
        while position < len(piece):
            if self._escaped:
                self._escaped = False
                position += 1
                continue
            if self._in_string:
                match = _STRING_END.search(piece, position)
                if match is None:
                    return False
                self._in_string = match.group() != '"'
                self._escaped = match.group() == "\\"
            else:
                match = _STRUCTURE.search(piece, position)
                if match is None:
                    return False
                char = match.group()
                self._in_string = char == '"'
                self._depth += 1 if char in "{[" else -1 if char in "}]" else 0
                if self._depth == 0 and char in "}]":
                    self.closed = True
                    return True
            position = match.end()
        return False


def _assistant_message(output: Any) -> dict[str, Any]:
    data = as_mapping(to_plain(output), "chat assistant output")
    if "choices" in data:
        choices = as_list(data["choices"], "chat completion choices")
        if not choices:
            raise ProviderFormatError("chat completion has no choices")
        data = as_mapping(as_mapping(choices[0], "chat completion choice").get("message"), "choices[0].message")
    role = data.get("role", "assistant")
    if role != "assistant":
        raise ProviderFormatError(f"chat assistant output has role {role!r}, expected 'assistant'")
    return data


def _read_call(item: Any, position: int) -> ToolCall:
    entry = as_mapping(item, f"tool_calls[{position}]")
    what = f"tool_calls[{position}]"
    kind = entry.get("type", "function")
    if kind == "function":
        body = as_mapping(entry.get("function"), f"{what}.function")
        raw_arguments = body.get("arguments")
    elif kind == "custom":
        # A freeform tool call is answered like a function call (a tool message by id); its input
        # text goes through the same JSON check, so the pipeline can tell the model what is wrong.
        body = as_mapping(entry.get("custom"), f"{what}.custom")
        raw_arguments = body.get("input")
    else:
        raise ProviderFormatError(f"{what} has unsupported type {kind!r}")
    arguments_raw, arguments = read_arguments(raw_arguments)
    return ToolCall(
        id=required_text(entry, "id", what),
        name=required_text(body, "name", what),
        arguments_raw=arguments_raw,
        arguments=arguments,
        index=position,
    )


def _read_calls(message: dict[str, Any]) -> list[ToolCall]:
    if message.get("function_call") is not None:
        # The deprecated single function_call has no id, so its result cannot be paired.
        raise ProviderFormatError("legacy 'function_call' is not supported; declare tools instead of functions")
    calls = [_read_call(item, position) for position, item in enumerate(as_list(message.get("tool_calls"), "tool_calls"))]
    check_unique_ids([call.id for call in calls], "chat assistant message")
    return calls


def _without(data: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if key not in keys}


def _request_call(call: Any) -> Any:
    """A tool call as a request takes it: response-only fields out, function arguments that are not
    a JSON object as `{}` (a custom tool's freeform input is text by design: kept)."""
    if not isinstance(call, dict):
        return call
    request = _without(call, _RESPONSE_ONLY_CALL_FIELDS)
    function = request.get("function")
    if isinstance(function, dict):
        request["function"] = {**_without(function, _RESPONSE_ONLY_FUNCTION_FIELDS),
                               "arguments": replayable_arguments(function.get("arguments"))}
    return request


def _request_message(message: dict[str, Any]) -> dict[str, Any]:
    request = _without(without_nulls(message), _RESPONSE_ONLY_FIELDS)
    if isinstance(request.get("tool_calls"), list):
        request["tool_calls"] = [_request_call(call) for call in request["tool_calls"]]
    audio = request.pop("audio", None)
    if isinstance(audio, dict) and audio.get("id"):
        # A request refers to earlier audio by id only; data and transcript are response fields.
        request["audio"] = {"id": audio["id"]}
    request["role"] = "assistant"
    return request


class ChatCompletionsAdapter:
    """Adapter for the Chat Completions API (`provider="chat"`)."""

    name: ProviderName = "chat"

    def parse_calls(self, output: Any) -> list[ToolCall]:
        """Calls of `message.tool_calls`; arguments_raw is the JSON text as received.

        `arguments` is the parsed object, or None when the text is not a JSON object (not an error
        here). Raises ProviderFormatError for a call without id or name, or duplicate ids.
        """
        return _read_calls(_assistant_message(output))

    def assistant_items(self, output: Any) -> list[dict[str, Any]]:
        """The assistant message as one request message: verbatim, minus nulls and response-only fields."""
        message = _assistant_message(output)
        _read_calls(message)
        return [_request_message(message)]

    def result_items(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        """One `{"role": "tool", "tool_call_id", "content"}` message per result, in order."""
        return [{"role": "tool", "tool_call_id": result.call_id, "content": result.content} for result in results]

    def stream_accumulator(self) -> ChatStreamAccumulator:
        """A fresh accumulator for `ChatCompletionChunk` events."""
        return ChatStreamAccumulator()

    def render_tool(self, declaration: ToolDeclaration) -> dict[str, Any]:
        """`{"type": "function", "function": {name, description, parameters, strict}}`."""
        return {"type": "function", "function": function_declaration(declaration)}

    def clean_items(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each stored assistant message as `assistant_items` writes it."""
        return [_request_message(item) for item in items]

    def calls_in_items(self, items: list[dict[str, Any]]) -> list[ToolCall]:
        """The calls of every stored message, indexed across them."""
        return indexed_across([call for item in items for call in _read_calls(_assistant_message(item))])

    def assistant_text(self, items: list[dict[str, Any]]) -> AssistantText:
        """Content text; reasoning parts and reasoning extension fields are counted, not kept."""
        return messages_text(items, _REASONING_PART_TYPES, _REASONING_FIELDS)

    def assistant_turn(self, texts: list[str], calls: list[ToolCall]) -> list[dict[str, Any]]:
        """One assistant message: the text joined, then the calls."""
        message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts) or None}
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": call_arguments_json(c)}}
                for c in calls
            ]
        return [message]

    def append_message(self, messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
        """Chat takes consecutive messages of one role as they are."""
        messages.append(message)

    def place_conversation(self, request: dict[str, Any], system: str | None, messages: list[dict[str, Any]],
                           max_tokens: int) -> None:
        """The system prompt is the first message; max_tokens is optional in Chat, so left out."""
        request["messages"] = ([{"role": "system", "content": system}] if system else []) + messages

    def check_pairing(self, request: dict[str, Any]) -> None:
        """Tool messages come right after the assistant message that made the calls."""
        messages = request.get("messages", [])
        entries: list[PairingEntry] = []
        for position, message in enumerate(messages):
            entries += [("call", call["id"], position) for call in message.get("tool_calls") or []]
            if message.get("role") == "tool":
                entries.append(("result", message["tool_call_id"], position))
        check_entries(entries, lambda call_id, call_at, result_at: None)
        for position, message in enumerate(messages):
            ids = [c["id"] for c in message.get("tool_calls") or []]
            following = [m.get("tool_call_id") for m in messages[position + 1:position + 1 + len(ids)]]
            if ids and sorted(following) != sorted(ids):
                raise PairingError(f"tool messages for {ids} do not directly follow their assistant message")


@dataclass
class _CallDraft:
    stream_index: int
    id: str | None = None
    name: str | None = None
    kind: str = "function"
    argument_parts: list[str] = field(default_factory=list)
    object_end: _ObjectEnd = field(default_factory=_ObjectEnd)
    extra: DeltaFields = field(default_factory=DeltaFields)
    function_extra: DeltaFields = field(default_factory=DeltaFields)

    def as_tool_call_dict(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": "".join(self.argument_parts), **self.function_extra.value()}
        return {"id": self.id, "type": "function", "function": function, **self.extra.value()}


class ChatStreamAccumulator:
    """Assembles `choices[0].delta` of `ChatCompletionChunk` events (SDK objects or dicts).

    The first fragment of a call carries its index, id and name; later ones the index and a piece
    of the arguments. Fragments may interleave across calls and indices may start out of order. A
    new id at an index already in use starts another call there (OpenAI-compatible proxies stream
    parallel calls all at index 0); calls at one index keep the order they started in.
    A chat stream does not mark a single call as finished, but valid arguments end where their
    outermost JSON object closes: a call is handed out the moment that happens (and its arguments
    parse); the others complete together when `finish_reason` is set or the stream ends
    (`finish`), in index order. A fragment that still arrives for a call handed out early (a proxy
    interleaving calls, or invalid JSON) amends it: `finish` returns its final form again.
    """

    def __init__(self) -> None:
        # Drafts by (stream index, arrival): a proxy that streams parallel calls all at index 0 with
        # distinct ids gives several calls per index, kept in the order they started.
        self._drafts: dict[tuple[int, int], _CallDraft] = {}
        # The latest call at each stream index: fragments without an id continue it.
        self._current: dict[int, _CallDraft] = {}
        # Drafts by call id, for servers that send fragments without an index (or repeat the id).
        self._by_id: dict[str, _CallDraft] = {}
        self._content: list[str] = []
        self._refusal: list[str] = []
        self._extra = DeltaFields()
        self._completed = False
        self._finish_reason: str | None = None
        # The calls handed out before the message ended, by id.
        self._handed: dict[str, ToolCall] = {}

    def feed(self, event: Any) -> list[ToolCall]:
        """Apply one chunk; returns all calls when this chunk carries the finish_reason."""
        chunk = as_mapping(to_plain(event), "chat completion chunk")
        for choice in as_list(chunk.get("choices"), "chunk choices"):
            choice = as_mapping(choice, "chunk choice")
            if choice.get("index", 0) != 0:
                continue  # like parse_calls, only the first choice is the assistant turn
            early = self._apply_delta(as_mapping(choice.get("delta") or {}, "chunk delta"))
            if choice.get("finish_reason") is not None:
                self._finish_reason = str(choice["finish_reason"])
                return early + self._complete()
            if early:
                return early
        return []

    def finish(self) -> list[ToolCall]:
        """End of stream: every call not yet returned, in index order."""
        return self._complete()

    def ended_cleanly(self) -> bool:
        """Whether the model finished the message itself (not cut by a length limit, a filter or the connection)."""
        return self._finish_reason in ("tool_calls", "stop")

    def assistant_output(self) -> dict[str, Any]:
        """The assembled assistant message as a dict (what `parse_calls` accepts)."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        message.update(self._extra.value())
        if self._refusal:
            message["refusal"] = "".join(self._refusal)
        if self._drafts:
            message["tool_calls"] = [self._drafts[key].as_tool_call_dict() for key in sorted(self._drafts)]
        return message

    def _apply_delta(self, delta: dict[str, Any]) -> list[ToolCall]:
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        if isinstance(delta.get("refusal"), str):
            self._refusal.append(delta["refusal"])
        if delta.get("function_call") is not None:
            raise ProviderFormatError("legacy 'function_call' is not supported; declare tools instead of functions")
        self._extra.add(delta, _INTERPRETED_DELTA_FIELDS)
        early: list[ToolCall] = []
        for fragment in as_list(delta.get("tool_calls"), "delta.tool_calls"):
            early.extend(self._apply_fragment(as_mapping(fragment, "tool call fragment")))
        return early

    def _apply_fragment(self, fragment: dict[str, Any]) -> list[ToolCall]:
        if self._completed:
            raise ProviderFormatError("tool call fragment after the message finished")
        draft = self._draft_for(fragment)
        fragment_id = fragment.get("id")
        if fragment_id:
            draft.id = fragment_id
            self._by_id[fragment_id] = draft
        function = as_mapping(fragment.get("function") or {}, "tool call fragment function")
        name = function.get("name")
        # Some compatible servers repeat the name in every fragment; the same name again is not new.
        if name and name != draft.name:
            draft.name = name if draft.name is None else draft.name + name
        arguments = function.get("arguments")
        draft.extra.add(fragment, _INTERPRETED_FRAGMENT_FIELDS)
        draft.function_extra.add(function, _INTERPRETED_FUNCTION_FIELDS)
        if isinstance(arguments, str):
            draft.argument_parts.append(arguments)
            if draft.object_end.feed(arguments):
                return self._early(draft)
        return []

    def _early(self, draft: _CallDraft) -> list[ToolCall]:
        """The call whose arguments just closed, when it has its id and name and they parse."""
        if draft.id is None or draft.name is None or draft.id in self._handed:
            return []
        position = sorted(self._drafts).index(next(key for key, known in self._drafts.items() if known is draft))
        call = _read_call(draft.as_tool_call_dict(), position)
        if call.arguments is None:
            return []
        self._handed[call.id] = call
        return [call]

    def _draft_for(self, fragment: dict[str, Any]) -> _CallDraft:
        index = fragment.get("index")
        fragment_id = fragment.get("id")
        known = self._by_id.get(fragment_id) if fragment_id else None
        if isinstance(index, int):
            if known is not None and known.stream_index == index:
                return known
            draft = self._current.get(index)
            if draft is not None and not (fragment_id and draft.id is not None and draft.id != fragment_id):
                return draft
            # A new index, or a new id at a used one (parallel calls some proxies stream all at index 0).
            return self._new_draft(index)
        # Without an index (some compatible servers), the id is the only key.
        if not fragment_id:
            raise ProviderFormatError("tool call fragment has neither index nor id")
        if known is not None:
            return known
        return self._new_draft(max(self._current, default=-1) + 1)

    def _new_draft(self, index: int) -> _CallDraft:
        draft = self._current[index] = self._drafts[(index, len(self._drafts))] = _CallDraft(stream_index=index)
        return draft

    def _complete(self) -> list[ToolCall]:
        if self._completed:
            return []
        self._completed = True
        # Calls handed out early come again only when later fragments changed them.
        return [call for call in _read_calls(self.assistant_output()) if self._handed.get(call.id) != call]
