"""Responses adapter: parsing, rendering, streaming and corruption."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningItem,
    ResponseTextDeltaEvent,
)
from pydantic import BaseModel

from toolchord.orchestrator.providers import ProviderFormatError, ResponsesAdapter, get_adapter
from toolchord.worker.models import ErrorCode, ToolCall, ToolError, ToolResult

ADAPTER = get_adapter("responses")

REASONING: dict[str, Any] = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-opaque", "status": None}


def function_call(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def text_message(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def response(*items: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "gpt-test",
        "status": status,
        "output": list(items),
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def test_adapter_is_the_responses_adapter() -> None:
    assert isinstance(ADAPTER, ResponsesAdapter)
    assert ADAPTER.name == "responses"


def test_function_call_uses_call_id_as_the_call_id() -> None:
    (call,) = ADAPTER.parse_calls(Response.model_validate(response(function_call("call_1", "read_file", '{"path":"a"}', "fc_9"))))
    assert call == ToolCall(id="call_1", name="read_file", arguments_raw='{"path":"a"}', arguments={"path": "a"}, index=0)


def test_parallel_calls_keep_ids_and_order_among_other_items() -> None:
    output = response(
        REASONING,
        function_call("call_z", "b", '{"n": 2}'),
        text_message("msg_1", "and"),
        function_call("call_a", "a", "{}"),
    )
    calls = ADAPTER.parse_calls(output)
    assert [(call.id, call.name, call.index) for call in calls] == [("call_z", "b", 0), ("call_a", "a", 1)]


@pytest.mark.parametrize("raw", ['{"path": "a', "[1]", "null", "nope"])
def test_invalid_json_arguments_are_kept_raw_not_raised(raw: str) -> None:
    (call,) = ADAPTER.parse_calls([function_call("call_1", "f", raw)])
    assert (call.arguments_raw, call.arguments) == (raw, None)


def test_sdk_objects_and_dicts_give_equal_calls() -> None:
    items = [REASONING, function_call("call_a", "f", '{"a": [1, null]}'), function_call("call_b", "g", "bad")]
    from_dict = ADAPTER.parse_calls(response(*items))
    assert ADAPTER.parse_calls(Response.model_validate(response(*items))) == from_dict
    assert ADAPTER.parse_calls(items) == from_dict
    sdk_items = [ResponseReasoningItem.model_validate(items[0]), *(ResponseFunctionToolCall.model_validate(item) for item in items[1:])]
    assert ADAPTER.parse_calls(sdk_items) == from_dict
    assert from_dict[0].arguments == {"a": [1, None]}


def test_assistant_items_keep_item_ids_and_encrypted_reasoning() -> None:
    output = Response.model_validate(response(REASONING, text_message("msg_1", "hi"), function_call("call_a", "f", "{}", "fc_1")))
    items = ADAPTER.assistant_items(output)
    assert items == [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-opaque"},
        text_message("msg_1", "hi"),
        function_call("call_a", "f", "{}", "fc_1"),
    ]
    json.dumps(items)


def test_results_render_as_function_call_outputs_in_the_given_order() -> None:
    error = ToolError(code=ErrorCode.UNKNOWN_TOOL, message="no such tool", hint="use one of: a, b")
    results = [
        ToolResult(call_id="call_b", name="g", status="ok", content="two"),
        ToolResult(call_id="call_a", name="nope", status="error", content="UNKNOWN_TOOL: no such tool", error=error),
    ]
    assert ADAPTER.result_items(results) == [
        {"type": "function_call_output", "call_id": "call_b", "output": "two"},
        {"type": "function_call_output", "call_id": "call_a", "output": "UNKNOWN_TOOL: no such tool"},
    ]


@pytest.mark.parametrize(
    "output",
    [
        [{"type": "function_call", "id": "fc_1", "name": "f", "arguments": "{}"}],
        [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "arguments": "{}"}],
        [function_call("call_1", "f", "{}"), function_call("call_1", "g", "{}", "fc_2")],
        [{"type": "custom_tool_call", "call_id": "call_1", "name": "f", "input": "x"}],
        ["not an item"],
        {"output": "not a list"},
        {"id": "resp_1"},
        None,
    ],
)
def test_unreadable_output_is_protocol_corruption(output: Any) -> None:
    with pytest.raises(ProviderFormatError):
        ADAPTER.parse_calls(output)
    with pytest.raises(ProviderFormatError):
        ADAPTER.assistant_items(output)


# --- streaming ---------------------------------------------------------------------------------

EVENT_MODELS: dict[str, type[BaseModel]] = {
    "response.created": ResponseCreatedEvent,
    "response.output_item.added": ResponseOutputItemAddedEvent,
    "response.output_item.done": ResponseOutputItemDoneEvent,
    "response.function_call_arguments.delta": ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": ResponseFunctionCallArgumentsDoneEvent,
    "response.content_part.added": ResponseContentPartAddedEvent,
    "response.output_text.delta": ResponseTextDeltaEvent,
    "response.completed": ResponseCompletedEvent,
}


def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def as_sdk_event(event: dict[str, Any]) -> BaseModel:
    return EVENT_MODELS[event["type"]].model_validate(event)


def item_events(index: int, item: dict[str, Any], pieces: list[str], *, arguments_done: bool, item_done: bool) -> list[dict[str, Any]]:
    """The stream events of one output item, its arguments or text split into `pieces`."""
    if item["type"] == "function_call":
        added = {**item, "arguments": "", "status": "in_progress"}
        middle = [
            {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index, "delta": piece}
            for piece in pieces
        ]
        if arguments_done:
            middle.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "arguments": item["arguments"]})
    elif item["type"] == "message":
        added = {**item, "content": [], "status": "in_progress"}
        part = {"type": "output_text", "text": "", "annotations": []}
        middle = [
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            }
        ]
        middle += [
            {
                "type": "response.output_text.delta",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "delta": piece,
                "logprobs": [],
            }
            for piece in pieces
        ]
    else:
        added = item
        middle = []
    done = [{"type": "response.output_item.done", "output_index": index, "item": item}] if item_done else []
    return [{"type": "response.output_item.added", "output_index": index, "item": added}, *middle, *done]


def created() -> dict[str, Any]:
    return {"type": "response.created", "response": response(status="in_progress")}


def test_stream_hands_out_a_call_at_arguments_done() -> None:
    accumulator = ADAPTER.stream_accumulator()
    call = function_call("call_a", "f", '{"a": 1}')
    events = numbered(
        [
            created(),
            *item_events(0, REASONING, [], arguments_done=False, item_done=True),
            *item_events(1, call, ['{"a"', ": 1}"], arguments_done=True, item_done=True),
        ]
    )
    handed = [accumulator.feed(as_sdk_event(event)) for event in events]
    expected = ToolCall(id="call_a", name="f", arguments_raw='{"a": 1}', arguments={"a": 1}, index=0)
    assert handed[-2:] == [[expected], []]  # at arguments.done, and not again at output_item.done
    assert all(result == [] for result in handed[:-2])
    output = accumulator.assistant_output()
    assert output["output"] == [REASONING, call]
    assert output["id"] == "resp_1"


def test_a_call_waits_until_every_earlier_item_was_added() -> None:
    accumulator = ADAPTER.stream_accumulator()
    later = item_events(1, function_call("call_b", "g", "{}"), ["{}"], arguments_done=True, item_done=False)
    assert [accumulator.feed(event) for event in later] == [[], [], []]
    (call,) = accumulator.feed(item_events(0, text_message("msg_1", "x"), [], arguments_done=False, item_done=False)[0])
    assert (call.id, call.index) == ("call_b", 0)


def test_completed_response_settles_calls_without_done_events() -> None:
    accumulator = ADAPTER.stream_accumulator()
    call = function_call("call_a", "f", '{"a": 1}')
    for event in item_events(0, call, ['{"a": 1}'], arguments_done=False, item_done=False):
        assert accumulator.feed(event) == []
    (handed,) = accumulator.feed({"type": "response.completed", "response": response(call)})
    assert handed.arguments == {"a": 1}
    assert accumulator.finish() == []


def test_finish_hands_out_a_cut_call_with_what_arrived() -> None:
    accumulator = ADAPTER.stream_accumulator()
    for event in item_events(
        0, function_call("call_a", "f", '{"a": 1}'), ['{"a"'], arguments_done=False, item_done=False
    ):
        accumulator.feed(event)
    (call,) = accumulator.finish()
    assert (call.id, call.arguments_raw, call.arguments) == ("call_a", '{"a"', None)


@pytest.mark.parametrize(
    "events",
    [
        [{"type": "response.function_call_arguments.delta", "item_id": "fc_x", "output_index": 0, "delta": "{"}],
        [{"type": "response.function_call_arguments.delta", "item_id": "fc_x", "delta": "{"}],
        item_events(0, function_call("call_a", "f", "{}"), [], arguments_done=False, item_done=False) * 2,
        item_events(0, text_message("msg_1", "x"), [], arguments_done=False, item_done=False)
        + [{"type": "response.function_call_arguments.delta", "item_id": "msg_1", "output_index": 0, "delta": "{"}],
        item_events(0, function_call("call_a", "f", "{}"), ["{}"], arguments_done=True, item_done=False)
        + [{"type": "response.function_call_arguments.delta", "item_id": "fc_call_a", "output_index": 0, "delta": "x"}],
        item_events(0, function_call("call_a", "f", "{}"), ["{}"], arguments_done=True, item_done=False)
        + [{"type": "response.output_item.done", "output_index": 0, "item": function_call("call_a", "f", '{"x": 1}')}],
        [
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {"type": "function_call", "id": "fc_1", "name": "f", "arguments": ""},
            }
        ],
        item_events(0, function_call("call_a", "f", "{}"), [], arguments_done=True, item_done=True)
        + item_events(1, function_call("call_a", "g", "{}", "fc_2"), [], arguments_done=True, item_done=True),
        [
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {"type": "custom_tool_call", "call_id": "c", "name": "f", "input": ""},
            }
        ],
    ],
)
def test_corrupt_streams_raise(events: list[dict[str, Any]]) -> None:
    accumulator = ADAPTER.stream_accumulator()
    with pytest.raises(ProviderFormatError):
        for event in events:
            accumulator.feed(event)
        accumulator.finish()


ARGUMENT_TEXTS = st.one_of(
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=4).map(
        json.dumps
    ),
    st.sampled_from(['{"path": "a', "{}", "", "[1]", "nope"]),
)
ITEMS = st.one_of(
    st.tuples(st.just("function_call"), ARGUMENT_TEXTS),
    st.tuples(st.just("message"), st.text(min_size=1, max_size=12)),
    st.tuples(st.just("reasoning"), st.just("")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(ITEMS, min_size=1, max_size=5), data=st.data())
def test_streamed_events_in_any_split_and_order_equal_the_parsed_response(
    kinds: list[tuple[str, str]], data: st.DataObject
) -> None:
    items: list[dict[str, Any]] = []
    for position, (kind, text) in enumerate(kinds):
        if kind == "function_call":
            items.append(function_call(f"call_{position}", "tool", text))
        elif kind == "message":
            items.append(text_message(f"msg_{position}", text))
        else:
            items.append({**REASONING, "id": f"rs_{position}", "status": "completed"})
    expected = ADAPTER.parse_calls(Response.model_validate(response(*items)))

    queues = []
    for position, (item, (_, text)) in enumerate(zip(items, kinds, strict=True)):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4), label=f"cuts {position}"))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        arguments_done = data.draw(st.booleans(), label=f"arguments.done {position}")
        item_done = data.draw(st.booleans(), label=f"output_item.done {position}")
        queues.append(item_events(position, item, pieces, arguments_done=arguments_done, item_done=item_done))
    events = [created()]
    while any(queues):
        events.append(data.draw(st.sampled_from([queue for queue in queues if queue]), label="next item").pop(0))
    end_with_completed = data.draw(st.booleans(), label="response.completed")
    if end_with_completed:
        events.append({"type": "response.completed", "response": response(*items)})
    as_sdk = data.draw(st.booleans(), label="SDK objects")

    accumulator = ADAPTER.stream_accumulator()
    streamed: list[ToolCall] = []
    for event in numbered(events):
        streamed += accumulator.feed(as_sdk_event(event) if as_sdk else event)
    if end_with_completed:
        assert accumulator.finish() == []
    else:
        streamed += accumulator.finish()
    assert sorted(streamed, key=lambda call: call.index) == expected
    assert len({call.id for call in streamed}) == len(streamed)
    output = accumulator.assistant_output()
    assert ADAPTER.parse_calls(output) == expected
    texts = [part["text"] for item in output["output"] if item["type"] == "message" for part in item["content"]]
    assert texts == [item["content"][0]["text"] for item in items if item["type"] == "message"]
