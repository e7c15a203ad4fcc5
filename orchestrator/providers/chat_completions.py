"""OpenAI Chat Completions: `message.tool_calls` in, `role: "tool"` messages out.

Assistant output is the assistant message: an SDK `ChatCompletionMessage`, a dict message, or a
whole `ChatCompletion` (SDK object or dict), of which `choices[0].message` is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.providers.plain_data import (
    as_list,
    as_mapping,
    check_unique_ids,
    read_arguments,
    required_text,
    to_plain,
    without_nulls,
)
from orchestrator.providers.protocol import ProviderFormatError, ProviderName
from worker.models import ToolCall, ToolResult

# Fields of a response message that the request's assistant message does not take.
_RESPONSE_ONLY_FIELDS = frozenset({"annotations"})


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


def _request_message(message: dict[str, Any]) -> dict[str, Any]:
    request = {key: value for key, value in without_nulls(message).items() if key not in _RESPONSE_ONLY_FIELDS}
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


@dataclass
class _CallDraft:
    stream_index: int
    id: str | None = None
    name: str | None = None
    kind: str = "function"
    argument_parts: list[str] = field(default_factory=list)

    def as_tool_call_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": "".join(self.argument_parts)},
        }


class ChatStreamAccumulator:
    """Assembles `choices[0].delta` of `ChatCompletionChunk` events (SDK objects or dicts).

    The first fragment of a call carries its index, id and name; later ones the index and a piece
    of the arguments. Fragments may interleave across calls and indices may start out of order.
    A chat stream does not mark a single call as finished, so every call completes together when
    `finish_reason` is set or the stream ends (`finish`), in index order.
    """

    def __init__(self) -> None:
        self._drafts: dict[int, _CallDraft] = {}
        # Drafts by call id, for servers that send fragments without an index.
        self._by_id: dict[str, _CallDraft] = {}
        self._content: list[str] = []
        self._refusal: list[str] = []
        self._completed = False

    def feed(self, event: Any) -> list[ToolCall]:
        """Apply one chunk; returns all calls when this chunk carries the finish_reason."""
        chunk = as_mapping(to_plain(event), "chat completion chunk")
        for choice in as_list(chunk.get("choices"), "chunk choices"):
            choice = as_mapping(choice, "chunk choice")
            if choice.get("index", 0) != 0:
                continue  # like parse_calls, only the first choice is the assistant turn
            self._apply_delta(as_mapping(choice.get("delta") or {}, "chunk delta"))
            if choice.get("finish_reason") is not None:
                return self._complete()
        return []

    def finish(self) -> list[ToolCall]:
        """End of stream: every call not yet returned, in index order."""
        return self._complete()

    def assistant_output(self) -> dict[str, Any]:
        """The assembled assistant message as a dict (what `parse_calls` accepts)."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._refusal:
            message["refusal"] = "".join(self._refusal)
        if self._drafts:
            message["tool_calls"] = [self._drafts[index].as_tool_call_dict() for index in sorted(self._drafts)]
        return message

    def _apply_delta(self, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        if isinstance(delta.get("refusal"), str):
            self._refusal.append(delta["refusal"])
        if delta.get("function_call") is not None:
            raise ProviderFormatError("legacy 'function_call' is not supported; declare tools instead of functions")
        for fragment in as_list(delta.get("tool_calls"), "delta.tool_calls"):
            self._apply_fragment(as_mapping(fragment, "tool call fragment"))

    def _apply_fragment(self, fragment: dict[str, Any]) -> None:
        if self._completed:
            raise ProviderFormatError("tool call fragment after the message finished")
        draft = self._draft_for(fragment)
        fragment_id = fragment.get("id")
        if fragment_id:
            if draft.id is not None and draft.id != fragment_id:
                raise ProviderFormatError(
                    f"tool call at index {draft.stream_index} changed id from {draft.id!r} to {fragment_id!r}"
                )
            draft.id = fragment_id
            self._by_id[fragment_id] = draft
        function = as_mapping(fragment.get("function") or {}, "tool call fragment function")
        name = function.get("name")
        # Some compatible servers repeat the name in every fragment; the same name again is not new.
        if name and name != draft.name:
            draft.name = name if draft.name is None else draft.name + name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            draft.argument_parts.append(arguments)

    def _draft_for(self, fragment: dict[str, Any]) -> _CallDraft:
        index = fragment.get("index")
        if isinstance(index, int):
            return self._drafts.setdefault(index, _CallDraft(stream_index=index))
        # Without an index (some compatible servers), the id is the only key.
        fragment_id = fragment.get("id")
        if not fragment_id:
            raise ProviderFormatError("tool call fragment has neither index nor id")
        draft = self._by_id.get(fragment_id)
        if draft is None:
            new_index = max(self._drafts, default=-1) + 1
            draft = self._drafts.setdefault(new_index, _CallDraft(stream_index=new_index, id=fragment_id))
        return draft

    def _complete(self) -> list[ToolCall]:
        if self._completed:
            return []
        self._completed = True
        return _read_calls(self.assistant_output())
