"""Anthropic Messages adapter: parsing, rendering, streaming and corruption."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.types import (
    Message,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from toolchord.orchestrator.providers import AnthropicMessagesAdapter, ProviderFormatError
from toolchord.worker.models import ErrorCode, ToolCall, ToolError, ToolResult

ADAPTER = AnthropicMessagesAdapter()


def tool_use(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def message(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": list(blocks),
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 1},
    }


THINKING = {"type": "thinking", "thinking": "I should read it.", "signature": "c2lnbmF0dXJl"}


def test_adapter_is_the_anthropic_adapter() -> None:
    assert isinstance(ADAPTER, AnthropicMessagesAdapter)
    assert ADAPTER.name == "anthropic"


def test_single_tool_use_is_read_with_compact_raw_arguments() -> None:
    (call,) = ADAPTER.parse_calls(Message.model_validate(message(tool_use("toolu_1", "read_file", {"path": "é.txt", "n": 1}))))
    assert call == ToolCall(
        id="toolu_1", name="read_file", arguments_raw='{"path":"é.txt","n":1}', arguments={"path": "é.txt", "n": 1}, index=0
    )


def test_parallel_tool_uses_keep_ids_and_order_among_other_blocks() -> None:
    output = message(
        THINKING,
        {"type": "text", "text": "Reading both.", "citations": None},
        tool_use("toolu_z", "b", {"n": 2}),
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
        tool_use("toolu_a", "a", {}),
    )
    calls = ADAPTER.parse_calls(output)
    assert [(call.id, call.name, call.index, call.arguments_raw) for call in calls] == [
        ("toolu_z", "b", 0, '{"n":2}'),
        ("toolu_a", "a", 1, "{}"),
    ]


@pytest.mark.parametrize("invalid", ['{"path": "a', "[1]", "not json"])
def test_invalid_json_input_is_kept_raw_not_raised(invalid: str) -> None:
    # Streamed input that is not a JSON object is kept wrapped, as Anthropic documents.
    (call,) = ADAPTER.parse_calls([tool_use("toolu_1", "f", {"INVALID_JSON": invalid})])
    assert (call.arguments_raw, call.arguments) == (invalid, None)
    # Hand-written histories may carry the input as text or a non-object: not an input, never parsed.
    (text_call,) = ADAPTER.parse_calls([tool_use("toolu_1", "f", invalid)])
    assert (text_call.arguments_raw, text_call.arguments) == (json.dumps(invalid), None)
    (list_call,) = ADAPTER.parse_calls([tool_use("toolu_1", "f", [1, 2])])
    assert (list_call.arguments_raw, list_call.arguments) == ("[1,2]", None)


def test_sdk_objects_and_dicts_give_equal_calls() -> None:
    blocks = [THINKING, tool_use("toolu_a", "f", {"a": [1, None]}), tool_use("toolu_b", "g", {})]
    from_dict = ADAPTER.parse_calls(message(*blocks))
    sdk_blocks = [ThinkingBlock.model_validate(blocks[0]), ToolUseBlock.model_validate(blocks[1]), ToolUseBlock.model_validate(blocks[2])]
    assert ADAPTER.parse_calls(Message.model_validate(message(*blocks))) == from_dict
    assert ADAPTER.parse_calls(sdk_blocks) == from_dict
    assert ADAPTER.parse_calls(blocks) == from_dict
    assert ADAPTER.parse_calls({"role": "assistant", "content": sdk_blocks}) == from_dict
    assert from_dict[0].arguments == {"a": [1, None]}


def test_plain_text_content_has_no_calls() -> None:
    assert ADAPTER.parse_calls({"role": "assistant", "content": "hello"}) == []
    assert ADAPTER.parse_calls(Message.model_validate(message(TextBlock(type="text", text="hi").model_dump()))) == []


def test_assistant_items_keep_thinking_signatures_and_null_arguments() -> None:
    output = message(
        THINKING,
        {"type": "redacted_thinking", "data": "opaque=="},
        {"type": "text", "text": "x", "citations": None},
        tool_use("toolu_a", "f", {"a": None}),
    )
    (item,) = ADAPTER.assistant_items(Message.model_validate(output))
    assert item == {
        "role": "assistant",
        "content": [
            THINKING,
            {"type": "redacted_thinking", "data": "opaque=="},
            {"type": "text", "text": "x"},
            tool_use("toolu_a", "f", {"a": None}),
        ],
    }
    json.dumps(item)


def ok(call_id: str, content: str) -> ToolResult:
    return ToolResult(call_id=call_id, name="f", status="ok", content=content)


def failed(call_id: str, content: str) -> ToolResult:
    error = ToolError(code=ErrorCode.EXECUTION_ERROR, message="boom", hint="")
    return ToolResult(call_id=call_id, name="f", status="error", content=content, error=error)


def test_results_are_tool_result_blocks_first_in_one_user_message() -> None:
    items = ADAPTER.result_items(
        [ok("toolu_b", "two"), failed("toolu_a", "EXECUTION_ERROR: boom")],
        extra_content=["Also consider this.", {"type": "text", "text": "And this."}],
    )
    assert items == [
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_b", "content": "two", "is_error": False},
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "EXECUTION_ERROR: boom", "is_error": True},
                {"type": "text", "text": "Also consider this."},
                {"type": "text", "text": "And this."},
            ],
        }
    ]


def test_extra_content_as_text_or_sdk_blocks() -> None:
    (text_item,) = ADAPTER.result_items([ok("toolu_a", "one")], extra_content="Keep going.")
    assert text_item["content"][1:] == [{"type": "text", "text": "Keep going."}]
    (sdk_item,) = ADAPTER.result_items([ok("toolu_a", "one")], extra_content=[TextBlock(type="text", text="t")])
    assert sdk_item["content"][1:] == [{"type": "text", "text": "t"}]
    assert ADAPTER.result_items([]) == []


@pytest.mark.parametrize(
    "output",
    [
        [{"type": "tool_use", "name": "f", "input": {}}],
        [{"type": "tool_use", "id": "toolu_1", "input": {}}],
        [{"type": "tool_use", "id": "toolu_1", "name": "f"}],
        [tool_use("toolu_1", "f", {}), tool_use("toolu_1", "g", {})],
        ["a string block"],
        {"role": "assistant", "content": {"type": "text"}},
        {"role": "user", "content": []},
        {"no": "content"},
        42,
    ],
)
def test_unreadable_output_is_protocol_corruption(output: Any) -> None:
    with pytest.raises(ProviderFormatError):
        ADAPTER.parse_calls(output)
    with pytest.raises(ProviderFormatError):
        ADAPTER.assistant_items(output)


# --- streaming ---------------------------------------------------------------------------------

EVENT_MODELS: dict[str, type[BaseModel]] = {
    "message_start": RawMessageStartEvent,
    "content_block_start": RawContentBlockStartEvent,
    "content_block_delta": RawContentBlockDeltaEvent,
    "content_block_stop": RawContentBlockStopEvent,
    "message_delta": RawMessageDeltaEvent,
    "message_stop": RawMessageStopEvent,
}


def as_sdk_event(event: dict[str, Any]) -> BaseModel:
    return EVENT_MODELS[event["type"]].model_validate(event)


def message_start() -> dict[str, Any]:
    start = message()
    start.update(stop_reason=None)
    return {"type": "message_start", "message": start}


def block_events(index: int, block: dict[str, Any], pieces: list[str]) -> list[dict[str, Any]]:
    """The stream events of one content block, its text/input split into `pieces`."""
    if block["type"] == "tool_use":
        start = {**block, "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": piece} for piece in pieces]
    elif block["type"] == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": piece} for piece in pieces]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    else:
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
    return (
        [{"type": "content_block_start", "index": index, "content_block": start}]
        + [{"type": "content_block_delta", "index": index, "delta": delta} for delta in deltas]
        + [{"type": "content_block_stop", "index": index}]
    )


def test_stream_hands_out_each_call_at_its_block_stop() -> None:
    accumulator = ADAPTER.stream_accumulator()
    assert accumulator.feed(as_sdk_event(message_start())) == []
    for event in block_events(0, THINKING, ["I should ", "read it."]):
        assert accumulator.feed(as_sdk_event(event)) == []
    first = block_events(1, tool_use("toolu_a", "f", {"a": 1}), ['{"a"', ": 1}"])
    second = block_events(2, tool_use("toolu_b", "g", {}), [])
    for event in first[:-1] + second[:-1]:
        assert accumulator.feed(as_sdk_event(event)) == []
    assert accumulator.feed(as_sdk_event(second[-1])) == [
        ToolCall(id="toolu_b", name="g", arguments_raw="{}", arguments={}, index=1)
    ]
    assert accumulator.feed(as_sdk_event(first[-1])) == [
        ToolCall(id="toolu_a", name="f", arguments_raw='{"a":1}', arguments={"a": 1}, index=0)
    ]
    accumulator.feed(
        as_sdk_event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 9},
            }
        )
    )
    accumulator.feed(as_sdk_event({"type": "message_stop"}))
    assert accumulator.finish() == []
    output = accumulator.assistant_output()
    assert output["content"][0] == THINKING
    assert output["stop_reason"] == "tool_use"
    assert Message.model_validate(output).content[1] == ToolUseBlock(
        type="tool_use", id="toolu_a", name="f", input={"a": 1}
    )


def test_streamed_invalid_json_is_wrapped_and_read_back_raw() -> None:
    accumulator = ADAPTER.stream_accumulator()
    (call,) = [
        call
        for event in block_events(0, tool_use("toolu_a", "f", {}), ['{"path": ', '"a'])
        for call in accumulator.feed(event)
    ]
    assert (call.arguments_raw, call.arguments) == ('{"path": "a', None)
    output = accumulator.assistant_output()
    assert output["content"][0]["input"] == {"INVALID_JSON": '{"path": "a'}
    assert ADAPTER.parse_calls(output) == [call]


def test_a_call_waits_until_every_earlier_block_has_started() -> None:
    accumulator = ADAPTER.stream_accumulator()
    later = block_events(1, tool_use("toolu_b", "g", {}), ["{}"])
    assert [accumulator.feed(event) for event in later] == [[], [], []]
    (call,) = [
        call for event in block_events(0, tool_use("toolu_a", "f", {}), ["{}"])[:1] for call in accumulator.feed(event)
    ]
    assert (call.id, call.index) == ("toolu_b", 1)


def test_finish_closes_a_cut_stream() -> None:
    accumulator = ADAPTER.stream_accumulator()
    for event in block_events(0, tool_use("toolu_a", "f", {}), ['{"a": 1', ", "])[:-1]:
        accumulator.feed(event)
    (call,) = accumulator.finish()
    assert (call.id, call.arguments_raw, call.arguments) == ("toolu_a", '{"a": 1, ', None)


@pytest.mark.parametrize(
    "events",
    [
        [{"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{}"}}],
        [{"type": "content_block_stop", "index": 3}],
        [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}] * 2,
        block_events(0, tool_use("toolu_a", "f", {}), []) + [{"type": "content_block_stop", "index": 0}],
        [
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "tool_use", "name": "f", "input": {}},
            },
            {"type": "content_block_stop", "index": 0},
        ],
        block_events(0, tool_use("toolu_a", "f", {}), []) + block_events(1, tool_use("toolu_a", "g", {}), []),
        [{"type": "content_block_start", "content_block": {"type": "text", "text": ""}}],
    ],
)
def test_corrupt_streams_raise(events: list[dict[str, Any]]) -> None:
    accumulator = ADAPTER.stream_accumulator()
    with pytest.raises(ProviderFormatError):
        for event in events:
            accumulator.feed(event)
        accumulator.finish()


JSON_VALUES = st.one_of(
    st.integers(), st.text(max_size=8), st.none(), st.booleans(), st.lists(st.integers(), max_size=3)
)
INPUTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
BLOCKS = st.one_of(
    st.tuples(st.just("tool_use"), INPUTS),
    st.tuples(st.just("text"), st.text(min_size=1, max_size=12)),
    st.tuples(st.just("thinking"), st.text(min_size=1, max_size=12)),
    st.tuples(st.just("invalid"), st.sampled_from(['{"a": ', "[1, 2]", "nope", '{"a": 1}}'])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(BLOCKS, min_size=1, max_size=5), data=st.data())
def test_streamed_events_in_any_split_and_order_equal_the_parsed_message(
    blocks: list[tuple[str, Any]], data: st.DataObject
) -> None:
    content: list[dict[str, Any]] = []
    texts: list[str] = []
    for position, (kind, value) in enumerate(blocks):
        if kind == "tool_use":
            indent = data.draw(st.sampled_from([None, 2]), label="json layout")
            content.append(tool_use(f"toolu_{position}", "tool", value))
            texts.append(json.dumps(value, indent=indent))
        elif kind == "invalid":
            content.append(tool_use(f"toolu_{position}", "tool", {"INVALID_JSON": value}))
            texts.append(value)
        elif kind == "thinking":
            content.append({"type": "thinking", "thinking": value, "signature": "sig"})
            texts.append(value)
        else:
            content.append({"type": "text", "text": value})
            texts.append(value)
    expected = ADAPTER.parse_calls(Message.model_validate(message(*content)))

    queues = []
    for position, (block, text) in enumerate(zip(content, texts, strict=True)):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4), label=f"cuts {position}"))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        queues.append(block_events(position, block, pieces))
    events = [message_start()]
    while any(queues):
        events.append(data.draw(st.sampled_from([queue for queue in queues if queue]), label="next block").pop(0))
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 1},
        }
    )
    events.append({"type": "message_stop"})
    as_sdk = data.draw(st.booleans(), label="SDK objects")

    accumulator = ADAPTER.stream_accumulator()
    streamed: list[ToolCall] = []
    for event in events:
        streamed += accumulator.feed(as_sdk_event(event) if as_sdk else event)
    assert accumulator.finish() == []
    assert sorted(streamed, key=lambda call: call.index) == expected
    assert len({call.id for call in streamed}) == len(streamed)
    output = accumulator.assistant_output()
    assert ADAPTER.parse_calls(output) == expected
    assert [block.get("thinking") for block in output["content"]] == [block.get("thinking") for block in content]
    assert [block.get("text") for block in output["content"]] == [block.get("text") for block in content]


def test_a_streamed_compaction_block_keeps_its_summary_through_the_log_and_replay(tmp_path: Any) -> None:
    from anthropic.types.beta import BetaCompactionBlockParam, BetaRawMessageStreamEvent
    from pydantic import TypeAdapter

    from toolchord.orchestrator.event_stores import JsonlEventLog
    from toolchord.orchestrator.events import SessionStarted
    from toolchord.orchestrator.recorder import SessionRecorder
    from toolchord.orchestrator.request_builder import RequestBuilder

    summary = "The user asked for refunds; password=hunter22 was shared earlier."
    events = [
        message_start(),
        {"type": "content_block_start", "index": 0, "content_block": {"type": "compaction", "content": None}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "compaction_delta", "content": summary, "encrypted_content": "opaque=="}},
        {"type": "content_block_stop", "index": 0},
        *block_events(1, {"type": "text"}, ["Go", "ing on."]),
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}},
    ]
    accumulator = ADAPTER.stream_accumulator()
    for event in events:
        accumulator.feed(TypeAdapter(BetaRawMessageStreamEvent).validate_python(event))
    output = accumulator.assistant_output()
    compaction = {"type": "compaction", "content": summary, "encrypted_content": "opaque=="}
    assert output["content"][0] == compaction
    log = JsonlEventLog(tmp_path)
    recorder = SessionRecorder(log, "s")
    recorder.append(SessionStarted(provider="anthropic", model="claude"))
    recorder.user_input("hello")
    recorder.model_output("anthropic", "claude", "t1", output, ADAPTER.assistant_items(output), [])
    recorder.user_input("and now?")
    replayed = RequestBuilder(log).build("s")["messages"][1]["content"][0]
    # Byte for byte: the summary is signed, so not even a secret in it is masked.
    assert replayed == compaction
    TypeAdapter(BetaCompactionBlockParam).validate_python(replayed)
