"""Anthropic Messages: `tool_use` blocks in, `tool_result` blocks in one user message out.

Assistant output is an SDK `Message`, a dict with a "content" list (a message or message param),
or a list of content blocks (SDK blocks or dicts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from toolchord.orchestrator.providers.pairing import PairingEntry, check_entries
from toolchord.orchestrator.providers.plain_data import (
    DeltaBuffer,
    as_list,
    as_mapping,
    check_unique_ids,
    compact_json,
    indexed_across,
    messages_text,
    newly_rankable,
    parse_arguments,
    read_arguments,
    required_text,
    to_plain,
    without_nulls,
)
from toolchord.orchestrator.providers.protocol import AssistantText, ProviderFormatError, ProviderName
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import ToolDeclaration

INVALID_JSON_KEY = "INVALID_JSON"
"""A tool_use `input` must be an object. When streamed input is not a JSON object, the block keeps
the text as `{"INVALID_JSON": text}` (the wrapping Anthropic documents for fine-grained tool
streaming), and reading such a block gives back the text with `arguments=None`."""

# Blocks whose input arrives as input_json_delta fragments when streamed.
_STREAMED_INPUT_BLOCKS = frozenset({"tool_use", "server_tool_use"})
_REASONING_BLOCKS = frozenset({"thinking", "redacted_thinking"})
# Anthropic refuses an empty assistant message; a migrated turn without text or calls says so.
EMPTY_TURN_TEXT = "(no output)"


def _content_blocks(output: Any) -> list[Any] | str:
    data = to_plain(output)
    if isinstance(data, list):
        return data
    message = as_mapping(data, "anthropic assistant output")
    role = message.get("role", "assistant")
    if role != "assistant":
        raise ProviderFormatError(f"anthropic assistant output has role {role!r}, expected 'assistant'")
    content = message.get("content")
    if isinstance(content, str):
        return content  # a message param may carry plain text: no calls
    if not isinstance(content, list):
        raise ProviderFormatError("anthropic assistant output has no 'content' list")
    return content


def _input_arguments(block: dict[str, Any], what: str) -> tuple[str, dict[str, Any] | None]:
    if "input" not in block:
        raise ProviderFormatError(f"{what} has no 'input'")
    value = block["input"]
    if _is_invalid_json_wrapper(value):
        return value[INVALID_JSON_KEY], None
    if isinstance(value, dict):
        return read_arguments(value)
    # A string, null, number or list is not a tool input: the call is answered INVALID_JSON with
    # the value's JSON as what the model sent (a string is not parsed: "{...}" text is not an object).
    return compact_json(value), None


def _is_invalid_json_wrapper(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {INVALID_JSON_KEY} and isinstance(value[INVALID_JSON_KEY], str)


def _request_block(block: Any) -> Any:
    """A content block as a request takes it: a tool_use `input` that is not an object becomes `{}`."""
    if isinstance(block, dict) and block.get("type") == "tool_use":
        value = block.get("input")
        if not isinstance(value, dict) or _is_invalid_json_wrapper(value):
            return {**block, "input": {}}
    return block


def _request_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [_request_block(block) for block in content]}
    return message


def _read_calls(content: list[Any] | str) -> list[ToolCall]:
    if isinstance(content, str):
        return []
    calls: list[ToolCall] = []
    for position, item in enumerate(content):
        block = as_mapping(item, f"content[{position}]")
        if block.get("type") != "tool_use":
            continue  # text, thinking, server tools and their results are not ours to run
        what = f"tool_use block content[{position}]"
        arguments_raw, arguments = _input_arguments(block, what)
        calls.append(
            ToolCall(
                id=required_text(block, "id", what),
                name=required_text(block, "name", what),
                arguments_raw=arguments_raw,
                arguments=arguments,
                index=len(calls),
            )
        )
    check_unique_ids([call.id for call in calls], "anthropic assistant message")
    return calls


def _extra_blocks(extra_content: str | Sequence[Any] | dict[str, Any] | None) -> list[dict[str, Any]]:
    """Extra user content as blocks: text becomes a text block, SDK blocks become dicts."""
    if extra_content is None:
        return []
    plain = to_plain(extra_content)
    blocks: list[dict[str, Any]] = []
    for block in plain if isinstance(plain, list) else [plain]:
        if isinstance(block, str):
            if block:
                blocks.append({"type": "text", "text": block})
        elif isinstance(block, dict):
            blocks.append(block)
        else:
            raise TypeError(f"extra user content must be text or content blocks, got {type(block).__name__}")
    return blocks


class AnthropicMessagesAdapter:
    """Adapter for the Anthropic Messages API (`provider="anthropic"`)."""

    name: ProviderName = "anthropic"

    def parse_calls(self, output: Any) -> list[ToolCall]:
        """Calls of the `tool_use` blocks, in block order.

        arguments_raw is `input` as compact JSON and arguments is `input` itself. Raises
        ProviderFormatError for a block without id, name or input, or duplicate ids.
        """
        return _read_calls(_content_blocks(output))

    def assistant_items(self, output: Any) -> list[dict[str, Any]]:
        """One assistant message with every content block verbatim (thinking signatures included)."""
        content = _content_blocks(output)
        _read_calls(content)
        return [_request_message({"role": "assistant", "content": without_nulls(content)})]

    def result_items(
        self,
        results: list[ToolResult],
        extra_content: str | Sequence[Any] | dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """One user message: a `tool_result` block per result (in order) first, then `extra_content`.

        The API requires tool results to open the user message that follows the tool use, so any
        extra user text or blocks come after them. Returns [] when there is nothing to send.
        """
        blocks: list[dict[str, Any]] = [
            {
                "type": "tool_result",
                "tool_use_id": result.call_id,
                "content": result.content,
                "is_error": result.status == "error",
            }
            for result in results
        ]
        blocks.extend(_extra_blocks(extra_content))
        return [{"role": "user", "content": blocks}] if blocks else []

    def stream_accumulator(self) -> AnthropicStreamAccumulator:
        """A fresh accumulator for raw Messages stream events."""
        return AnthropicStreamAccumulator()

    def render_tool(self, declaration: ToolDeclaration) -> dict[str, Any]:
        """`{name, description, input_schema}` (Anthropic has no strict flag here)."""
        return {"name": declaration.name, "description": declaration.description,
                "input_schema": declaration.parameters}

    def clean_items(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each stored assistant message as `assistant_items` writes it."""
        return [_request_message(item) for item in items]

    def calls_in_items(self, items: list[dict[str, Any]]) -> list[ToolCall]:
        """The calls of every stored message, indexed across them."""
        return indexed_across([call for item in items for call in _read_calls(_content_blocks(item))])

    def assistant_text(self, items: list[dict[str, Any]]) -> AssistantText:
        """The text blocks; thinking and redacted_thinking blocks are counted, not kept."""
        return messages_text(items, _REASONING_BLOCKS)

    def assistant_turn(self, texts: list[str], calls: list[ToolCall]) -> list[dict[str, Any]]:
        """One assistant message: a text block per text, then a tool_use block per call."""
        blocks: list[dict[str, Any]] = [{"type": "text", "text": text} for text in texts]
        blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments if c.arguments is not None
                    else {}} for c in calls]
        return [{"role": "assistant", "content": blocks or [{"type": "text", "text": EMPTY_TURN_TEXT}]}]

    def append_message(self, messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
        """Consecutive user messages are merged into one: Anthropic's turns must alternate."""
        if messages and message.get("role") == "user" and messages[-1].get("role") == "user":
            messages[-1]["content"] = _as_blocks(messages[-1]["content"]) + _as_blocks(message["content"])
            return
        messages.append(message)

    def place_conversation(self, request: dict[str, Any], system: str | None, messages: list[dict[str, Any]],
                           max_tokens: int) -> None:
        """`max_tokens` is required; the system prompt is the top-level `system` field."""
        request.setdefault("max_tokens", max_tokens)
        if system:
            request["system"] = system
        request["messages"] = messages

    def check_pairing(self, request: dict[str, Any]) -> None:
        """The tool_result blocks are in the (user) message right after their tool_use."""
        entries: list[PairingEntry] = []
        for position, message in enumerate(request.get("messages", [])):
            content = message.get("content")
            for block in content if isinstance(content, list) else []:
                if block.get("type") == "tool_use":
                    entries.append(("call", block["id"], position))
                elif block.get("type") == "tool_result":
                    entries.append(("result", block["tool_use_id"], position))

        def misplaced(call_id: str, call_at: int, result_at: int) -> str | None:
            if result_at != call_at + 1:
                return f"tool_result for {call_id!r} is not in the message after its tool_use"
            return None

        check_entries(entries, misplaced)


def _as_blocks(content: Any) -> list[Any]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


@dataclass
class _BlockDraft:
    data: dict[str, Any]
    json_parts: list[str] = field(default_factory=list)
    stopped: bool = False
    handed_out: bool = False

    @property
    def is_call(self) -> bool:
        return self.data.get("type") == "tool_use"

    def finalize(self) -> None:
        """Turn the streamed input text into the block's `input` object."""
        self.stopped = True
        if self.data.get("type") not in _STREAMED_INPUT_BLOCKS:
            return
        text = "".join(self.json_parts)
        if not text:
            return  # no input deltas: the input from content_block_start is complete
        parsed = parse_arguments(text)
        self.data["input"] = parsed if parsed is not None else {INVALID_JSON_KEY: text}


class AnthropicStreamAccumulator:
    """Assembles raw Messages stream events (`message_start`, `content_block_start/delta/stop`,
    `message_delta`), SDK event objects or dicts.

    A `tool_use` block is complete at its `content_block_stop`; it is handed out once every block
    before it has started, so its index among the calls is final. Input arrives as
    `input_json_delta.partial_json` text, which is parsed once at the stop (or at `finish`).
    """

    def __init__(self) -> None:
        self._message: dict[str, Any] = {"role": "assistant"}
        self._blocks: dict[int, _BlockDraft] = {}
        self._deltas = DeltaBuffer()
        # Call ranks of the blocks ranked so far (blocks below _ranked_upto), and the ids handed out.
        self._call_rank: dict[int, int] = {}
        self._ranked_upto = 0
        self._handed_ids: set[str] = set()

    def feed(self, event: Any) -> list[ToolCall]:
        """Apply one event; returns the calls it completed."""
        data = as_mapping(to_plain(event), "anthropic stream event")
        kind = data.get("type")
        if kind != "content_block_delta":
            self._deltas.flush()
        if kind == "message_start":
            message = dict(as_mapping(data.get("message"), "message_start.message"))
            for position, block in enumerate(as_list(message.pop("content", None), "message_start content")):
                self._blocks[position] = _BlockDraft(data=as_mapping(block, "content block"), stopped=True)
            self._message.update(message)
        elif kind == "content_block_start":
            index = self._event_index(data)
            if index in self._blocks:
                raise ProviderFormatError(f"content block {index} started twice")
            block = dict(as_mapping(data.get("content_block"), "content_block_start.content_block"))
            self._blocks[index] = _BlockDraft(data=block)
        elif kind == "content_block_delta":
            self._apply_delta(self._open_block(data), as_mapping(data.get("delta"), "content_block_delta.delta"), self._deltas)
            return []  # a delta completes nothing
        elif kind == "content_block_stop":
            self._open_block(data).finalize()
            return self._hand_out(final=False, stopped=self._event_index(data))
        elif kind == "message_delta":
            delta = as_mapping(data.get("delta") or {}, "message_delta.delta")
            self._message.update({key: value for key, value in delta.items() if value is not None})
            # message_delta usage holds the counts that changed; the rest stay from message_start.
            if isinstance(data.get("usage"), dict):
                usage = {key: value for key, value in data["usage"].items() if value is not None}
                self._message["usage"] = {**(self._message.get("usage") or {}), **usage}
        return self._hand_out(final=False)

    def finish(self) -> list[ToolCall]:
        """End of stream: blocks still open are closed with what arrived; remaining calls in order."""
        self._deltas.flush()
        for draft in self._blocks.values():
            if not draft.stopped:
                draft.finalize()
        return self._hand_out(final=True)

    def ended_cleanly(self) -> bool:
        """Whether the model finished the message itself (not cut by `max_tokens`, a refusal or the connection)."""
        return self._message.get("stop_reason") in ("tool_use", "end_turn", "stop_sequence")

    def assistant_output(self) -> dict[str, Any]:
        """The assembled message as a dict with a "content" list (what `parse_calls` accepts)."""
        self._deltas.flush()
        content = []
        for index in sorted(self._blocks):
            draft = self._blocks[index]
            block = dict(draft.data)
            if not draft.stopped and draft.json_parts:
                block["input"] = {INVALID_JSON_KEY: "".join(draft.json_parts)}  # still streaming
            content.append(block)
        return {**self._message, "content": content}

    @staticmethod
    def _event_index(data: dict[str, Any]) -> int:
        index = data.get("index")
        if not isinstance(index, int):
            raise ProviderFormatError(f"{data.get('type')} event has no block index")
        return index

    def _open_block(self, data: dict[str, Any]) -> _BlockDraft:
        index = self._event_index(data)
        draft = self._blocks.get(index)
        if draft is None:
            raise ProviderFormatError(f"{data.get('type')} for content block {index}, which never started")
        if draft.stopped:
            raise ProviderFormatError(f"{data.get('type')} for content block {index}, which already stopped")
        return draft

    @staticmethod
    def _apply_delta(draft: _BlockDraft, delta: dict[str, Any], deltas: DeltaBuffer) -> None:
        kind = delta.get("type")
        block = draft.data
        if kind == "input_json_delta":
            draft.json_parts.append(delta.get("partial_json") or "")
        elif kind == "text_delta":
            deltas.add(block, "text", delta.get("text") or "")
        elif kind == "thinking_delta":
            deltas.add(block, "thinking", delta.get("thinking") or "")
        elif kind == "signature_delta":
            deltas.add(block, "signature", delta.get("signature") or "")
        elif kind == "compaction_delta":
            # The summary arrives whole in one delta (the SDK's accumulator assigns, not appends);
            # a block replayed without it is a failed compaction to the API.
            block.update({key: delta[key] for key in ("content", "encrypted_content") if delta.get(key) is not None})
        elif kind == "citations_delta":
            if not isinstance(block.get("citations"), list):
                block["citations"] = []
            block["citations"].append(delta.get("citation"))

    def _rank_blocks(self, *, final: bool) -> list[int]:
        """Give call ranks to blocks whose rank is now known; returns the call blocks just ranked.

        Each block is ranked once (`newly_rankable`): a stream of N calls costs O(N), not O(N) per event.
        """
        pending = newly_rankable(self._ranked_upto, self._blocks, final=final)
        ranked = []
        for index in pending:
            if self._blocks[index].is_call:
                self._call_rank[index] = len(self._call_rank)
                ranked.append(index)
        if pending:
            self._ranked_upto = pending[-1] + 1
        return ranked

    def _hand_out(self, *, final: bool, stopped: int | None = None) -> list[ToolCall]:
        """The calls that became complete and ranked: newly ranked ones, or the block that just stopped."""
        candidates = set(self._rank_blocks(final=final))
        if stopped is not None:
            candidates.add(stopped)
        if final:
            candidates.update(self._call_rank)
        ready = sorted(
            (self._call_rank[index], self._blocks[index])
            for index in candidates
            if index in self._call_rank and self._blocks[index].stopped and not self._blocks[index].handed_out
        )
        calls = []
        for rank, draft in ready:
            draft.handed_out = True
            (call,) = _read_calls([draft.data])
            if call.id in self._handed_ids:
                raise ProviderFormatError(f"anthropic stream: two tool calls share the id {call.id!r}")
            self._handed_ids.add(call.id)
            calls.append(call.model_copy(update={"index": rank}))
        return calls
