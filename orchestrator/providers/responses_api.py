"""OpenAI Responses: `function_call` output items in, `function_call_output` input items out.

Assistant output is an SDK `Response`, a dict with an "output" list, or a list of output items
(SDK items or dicts).
"""

from __future__ import annotations

from typing import Any

from toolchord.orchestrator.providers.pairing import PairingEntry, check_entries
from toolchord.orchestrator.providers.plain_data import (
    DeltaBuffer,
    as_list,
    as_mapping,
    call_arguments_json,
    check_unique_ids,
    function_declaration,
    newly_rankable,
    read_arguments,
    replayable_arguments,
    required_text,
    text_parts,
    to_plain,
    without_nulls,
)
from toolchord.orchestrator.providers.protocol import AssistantText, ProviderFormatError, ProviderName
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import ToolDeclaration

# Output items the client must answer but cannot answer with a function_call_output.
_UNSUPPORTED_CALL_ITEMS = frozenset({"custom_tool_call"})
_REASONING_ITEMS = frozenset({"reasoning"})


def _request_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as an input item: a function_call's arguments that are not an object become `{}`."""
    item = without_nulls(item)
    if item.get("type") == "function_call":
        item["arguments"] = replayable_arguments(item.get("arguments"))
    return item

# Events that only append text: buffered, and they complete no call.
_DELTA_EVENTS = frozenset({"response.function_call_arguments.delta", "response.output_text.delta"})


def _output_items(output: Any) -> list[Any]:
    data = to_plain(output)
    if isinstance(data, list):
        return data
    response = as_mapping(data, "responses assistant output")
    items = response.get("output")
    if not isinstance(items, list):
        raise ProviderFormatError("responses assistant output has no 'output' list")
    return items


def _read_call(item: dict[str, Any], position: int, index: int) -> ToolCall:
    what = f"function_call item output[{position}]"
    arguments_raw, arguments = read_arguments(item.get("arguments"))
    return ToolCall(
        id=required_text(item, "call_id", what),
        name=required_text(item, "name", what),
        arguments_raw=arguments_raw,
        arguments=arguments,
        index=index,
    )


def _read_calls(items: list[Any]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for position, entry in enumerate(items):
        item = as_mapping(entry, f"output[{position}]")
        kind = item.get("type")
        if kind in _UNSUPPORTED_CALL_ITEMS:
            raise ProviderFormatError(
                f"output[{position}] is a {kind!r}, which toolchord cannot answer (it declares function tools only)"
            )
        if kind == "function_call":
            calls.append(_read_call(item, position, len(calls)))
    check_unique_ids([call.id for call in calls], "responses output")
    return calls


class ResponsesAdapter:
    """Adapter for the Responses API (`provider="responses"`)."""

    name: ProviderName = "responses"

    def parse_calls(self, output: Any) -> list[ToolCall]:
        """Calls of the `function_call` items; ToolCall.id is the item's `call_id`.

        arguments_raw is the JSON text as received; arguments is the parsed object or None.
        Raises ProviderFormatError for an item without call_id or name, duplicate call ids, or a
        `custom_tool_call` (it would need a different output item).
        """
        return _read_calls(_output_items(output))

    def assistant_items(self, output: Any) -> list[dict[str, Any]]:
        """Every output item as an input item, verbatim: item ids, reasoning `encrypted_content`."""
        items = _output_items(output)
        _read_calls(items)
        return [_request_item(as_mapping(item, "output item")) for item in items]

    def result_items(self, results: list[ToolResult]) -> list[dict[str, Any]]:
        """One `{"type": "function_call_output", "call_id", "output"}` item per result, in order."""
        return [{"type": "function_call_output", "call_id": result.call_id, "output": result.content} for result in results]

    def stream_accumulator(self) -> ResponsesStreamAccumulator:
        """A fresh accumulator for Responses stream events."""
        return ResponsesStreamAccumulator()

    def render_tool(self, declaration: ToolDeclaration) -> dict[str, Any]:
        """`{"type": "function", name, description, parameters, strict}`."""
        return {"type": "function", **function_declaration(declaration)}

    def clean_items(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each stored item as `assistant_items` writes it."""
        return [_request_item(item) for item in items]

    def calls_in_items(self, items: list[dict[str, Any]]) -> list[ToolCall]:
        """The calls of the stored items (one turn is a flat list of items)."""
        return _read_calls(list(items))

    def assistant_text(self, items: list[dict[str, Any]]) -> AssistantText:
        """The text of message items; reasoning items are counted, not kept."""
        texts: list[str] = []
        reasoning = 0
        for item in items:
            if item.get("type") in _REASONING_ITEMS:
                reasoning += 1
            elif item.get("type", "message") == "message":
                texts += text_parts(item.get("content"), frozenset())[0]
        return AssistantText(texts, reasoning)

    def assistant_turn(self, texts: list[str], calls: list[ToolCall]) -> list[dict[str, Any]]:
        """An assistant message with the text (when there is any), then a function_call item per call."""
        text = "\n\n".join(texts)
        items: list[dict[str, Any]] = [{"role": "assistant", "content": text}] if text else []
        items += [{"type": "function_call", "call_id": c.id, "name": c.name, "arguments": call_arguments_json(c)}
                  for c in calls]
        return items

    def append_message(self, messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
        """Input items are taken as they are."""
        messages.append(message)

    def place_conversation(self, request: dict[str, Any], system: str | None, messages: list[dict[str, Any]],
                           max_tokens: int) -> None:
        """The system prompt is `instructions`; the conversation is `input`."""
        if system:
            request["instructions"] = system
        request["input"] = messages

    def check_pairing(self, request: dict[str, Any]) -> None:
        """A function_call_output comes after its function_call."""
        entries: list[PairingEntry] = []
        for position, item in enumerate(request.get("input", [])):
            if item.get("type") == "function_call":
                entries.append(("call", item["call_id"], position))
            elif item.get("type") == "function_call_output":
                entries.append(("result", item["call_id"], position))

        def misplaced(call_id: str, call_at: int, result_at: int) -> str | None:
            return f"function_call_output for {call_id!r} precedes its call" if result_at <= call_at else None

        check_entries(entries, misplaced)


class ResponsesStreamAccumulator:
    """Assembles Responses stream events (SDK event objects or dicts) by `output_index`.

    `response.output_item.added` starts an item, `response.function_call_arguments.delta` adds
    argument text (found by output_index or item_id), and `response.function_call_arguments.done`
    or `response.output_item.done` completes a function call. A call is handed out once every
    earlier output item has been added, so its index among the calls is final.
    `response.completed`/`response.incomplete` carry the final output and settle everything.
    """

    def __init__(self) -> None:
        self._response: dict[str, Any] = {}
        self._items: dict[int, dict[str, Any]] = {}
        self._index_by_item_id: dict[str, int] = {}
        self._done: set[int] = set()
        self._deltas = DeltaBuffer()
        self._handed_out: dict[int, ToolCall] = {}
        # Call ranks of the items ranked so far (items below _ranked_upto), calls completed since
        # the last hand-out, and the ids handed out.
        self._call_rank: dict[int, int] = {}
        self._ranked_upto = 0
        self._newly_done: set[int] = set()
        self._handed_ids: set[str] = set()

    def feed(self, event: Any) -> list[ToolCall]:
        """Apply one event; returns the calls it completed."""
        data = as_mapping(to_plain(event), "responses stream event")
        kind = data.get("type")
        if kind not in _DELTA_EVENTS:
            self._deltas.flush()
        if kind in ("response.created", "response.in_progress"):
            self._take_response(as_mapping(data.get("response"), f"{kind}.response"))
        elif kind == "response.output_item.added":
            index = self._event_index(data, known=False)
            if index in self._items:
                raise ProviderFormatError(f"output item {index} added twice")
            self._store(index, dict(as_mapping(data.get("item"), "output_item.added.item")))
        elif kind == "response.function_call_arguments.delta":
            item = self._open_call(data)
            self._deltas.add(item, "arguments", data.get("delta") or "")
            return []  # a delta completes nothing
        elif kind == "response.function_call_arguments.done":
            index = self._event_index(data, known=True)
            item = self._open_call(data)
            if isinstance(data.get("arguments"), str):
                item["arguments"] = data["arguments"]
            self._mark_done(index)
        elif kind == "response.output_item.done":
            index = self._event_index(data, known=False)
            self._settle(index, dict(as_mapping(data.get("item"), "output_item.done.item")))
        elif kind == "response.content_part.added":
            item = self._items[self._event_index(data, known=True)]
            if not isinstance(item.get("content"), list):
                item["content"] = []
            content = item["content"]
            position = data.get("content_index", len(content))
            part = dict(as_mapping(data.get("part"), "content_part.added.part"))
            content[position:position + 1] = [part]
        elif kind == "response.output_text.delta":
            item = self._items[self._event_index(data, known=True)]
            content = item.get("content")
            position = data.get("content_index", 0)
            if isinstance(content, list) and isinstance(position, int) and position < len(content):
                self._deltas.add(content[position], "text", data.get("delta") or "")
            return []
        elif kind in ("response.completed", "response.incomplete"):
            response = as_mapping(data.get("response"), f"{kind}.response")
            self._take_response(response)
            for index, item in enumerate(as_list(response.get("output"), f"{kind}.response.output")):
                self._settle(index, dict(as_mapping(item, "response output item")))
        return self._hand_out(final=False)

    def finish(self) -> list[ToolCall]:
        """End of stream: every call not yet handed out, with the arguments that arrived, in order."""
        self._deltas.flush()
        for index, item in self._items.items():
            if item.get("type") == "function_call":
                self._mark_done(index)
        return self._hand_out(final=True)

    def ended_cleanly(self) -> bool:
        """Whether the response completed (not `incomplete`, `failed` or cut with the connection)."""
        return self._response.get("status") == "completed"

    def assistant_output(self) -> dict[str, Any]:
        """The assembled response as a dict with an "output" list (what `parse_calls` accepts)."""
        self._deltas.flush()
        return {**self._response, "output": [self._items[index] for index in sorted(self._items)]}

    def _take_response(self, response: dict[str, Any]) -> None:
        self._response.update({key: value for key, value in response.items() if key != "output"})

    def _store(self, index: int, item: dict[str, Any]) -> None:
        self._items[index] = item
        if isinstance(item.get("id"), str):
            self._index_by_item_id[item["id"]] = index

    def _settle(self, index: int, item: dict[str, Any]) -> None:
        """Take a finished item as authoritative."""
        earlier = self._handed_out.get(index)
        self._store(index, item)
        if item.get("type") != "function_call":
            return
        self._mark_done(index)
        if earlier is not None:
            (settled,) = _read_calls([item])
            if (settled.id, settled.name, settled.arguments_raw) != (earlier.id, earlier.name, earlier.arguments_raw):
                raise ProviderFormatError(f"output item {index} changed after its call was complete")

    def _event_index(self, data: dict[str, Any], *, known: bool) -> int:
        index = data.get("output_index")
        if not isinstance(index, int):
            item_id = data.get("item_id")
            index = self._index_by_item_id.get(item_id) if isinstance(item_id, str) else None
        if not isinstance(index, int):
            raise ProviderFormatError(f"{data.get('type')} event names no output item")
        if known and index not in self._items:
            raise ProviderFormatError(f"{data.get('type')} for output item {index}, which was never added")
        return index

    def _open_call(self, data: dict[str, Any]) -> dict[str, Any]:
        index = self._event_index(data, known=True)
        item = self._items[index]
        if item.get("type") != "function_call":
            raise ProviderFormatError(f"{data.get('type')} for output item {index}, which is not a function_call")
        if index in self._done:
            raise ProviderFormatError(f"{data.get('type')} for output item {index}, which is already complete")
        return item

    def _rank_items(self, *, final: bool) -> list[int]:
        """Give call ranks to items whose rank is now known; returns the function calls just ranked.

        Each item is ranked once (`newly_rankable`): a stream of N calls costs O(N), not O(N) per event.
        """
        pending = newly_rankable(self._ranked_upto, self._items, final=final)
        ranked = []
        for index in pending:
            item = self._items[index]
            if item.get("type") in _UNSUPPORTED_CALL_ITEMS:
                _read_calls([item])  # raises: the turn cannot be answered
            if item.get("type") == "function_call":
                self._call_rank[index] = len(self._call_rank)
                ranked.append(index)
        if pending:
            self._ranked_upto = pending[-1] + 1
        return ranked

    def _hand_out(self, *, final: bool) -> list[ToolCall]:
        """The calls that became complete and ranked since the last event, in call order."""
        candidates = set(self._rank_items(final=final)) | self._newly_done
        self._newly_done = set()
        if final:
            candidates.update(self._call_rank)
        ready = sorted(
            (self._call_rank[index], index)
            for index in candidates
            if index in self._call_rank and index in self._done and index not in self._handed_out
        )
        calls: list[ToolCall] = []
        for rank, index in ready:
            (call,) = _read_calls([self._items[index]])
            call = call.model_copy(update={"index": rank})
            if call.id in self._handed_ids:
                raise ProviderFormatError(f"responses stream: two tool calls share the id {call.id!r}")
            self._handed_ids.add(call.id)
            self._handed_out[index] = call
            calls.append(call)
        return calls

    def _mark_done(self, index: int) -> None:
        self._done.add(index)
        self._newly_done.add(index)
