"""Chat Completions adapter: parsing, rendering, streaming and corruption."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage

from toolchord.orchestrator.providers import ChatCompletionsAdapter, ProviderFormatError, get_adapter
from toolchord.worker.models import ErrorCode, ToolCall, ToolError, ToolResult

ADAPTER = get_adapter("chat")


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant(*calls: dict[str, Any], content: str | None = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "refusal": None, "annotations": [], "tool_calls": list(calls)}


def completion(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-test",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": message}],
    }


def test_adapter_is_the_chat_adapter() -> None:
    assert isinstance(ADAPTER, ChatCompletionsAdapter)
    assert ADAPTER.name == "chat"


def test_single_call_is_read_with_raw_arguments_kept() -> None:
    message = ChatCompletionMessage.model_validate(assistant(tool_call("call_a", "read_file", '{"path": "a.txt"}')))
    assert ADAPTER.parse_calls(message) == [
        ToolCall(id="call_a", name="read_file", arguments_raw='{"path": "a.txt"}', arguments={"path": "a.txt"}, index=0)
    ]


def test_parallel_calls_keep_ids_and_order() -> None:
    message = assistant(
        tool_call("call_z", "b", '{"n": 2}'),
        tool_call("call_a", "a", '{"n": 1}'),
        tool_call("call_m", "b", "{}"),
    )
    calls = ADAPTER.parse_calls(message)
    assert [(call.id, call.name, call.index) for call in calls] == [("call_z", "b", 0), ("call_a", "a", 1), ("call_m", "b", 2)]
    assert [call.arguments for call in calls] == [{"n": 2}, {"n": 1}, {}]


@pytest.mark.parametrize("raw", ['{"path": "a.txt"', "[1, 2]", '"text"', "NaN", '{"x": NaN}', "{'a': 1}"])
def test_arguments_that_are_not_a_json_object_are_kept_raw_not_raised(raw: str) -> None:
    (call,) = ADAPTER.parse_calls(assistant(tool_call("call_a", "f", raw)))
    assert call.arguments is None
    assert call.arguments_raw == raw


def test_sdk_objects_and_dicts_give_equal_calls() -> None:
    message = assistant(tool_call("call_a", "f", '{"a": [1, null]}'), tool_call("call_b", "g", "oops"), content="thinking aloud")
    from_dict = ADAPTER.parse_calls(message)
    assert ADAPTER.parse_calls(ChatCompletionMessage.model_validate(message)) == from_dict
    assert ADAPTER.parse_calls(ChatCompletion.model_validate(completion(message))) == from_dict
    assert ADAPTER.parse_calls(completion(message)) == from_dict
    assert from_dict[0].arguments == {"a": [1, None]}


def test_message_without_tool_calls_has_no_calls() -> None:
    assert ADAPTER.parse_calls(ChatCompletionMessage(role="assistant", content="done")) == []


def test_custom_tool_call_is_read_with_its_input_as_arguments() -> None:
    message = {"role": "assistant", "tool_calls": [{"id": "call_c", "type": "custom", "custom": {"name": "grammar", "input": "x = 1"}}]}
    (call,) = ADAPTER.parse_calls(ChatCompletionMessage.model_validate(message))
    assert (call.id, call.name, call.arguments_raw, call.arguments) == ("call_c", "grammar", "x = 1", None)


def test_assistant_items_keep_the_message_verbatim_without_nulls_or_response_fields() -> None:
    message = assistant(tool_call("call_a", "f", '{"a":null}'))
    message["audio"] = {"id": "audio_1", "data": "AAAA", "expires_at": 5, "transcript": "hi"}
    message["reasoning_content"] = "provider extension kept"
    (item,) = ADAPTER.assistant_items(ChatCompletion.model_validate(completion(message)))
    assert item == {
        "role": "assistant",
        "tool_calls": [tool_call("call_a", "f", '{"a":null}')],
        "audio": {"id": "audio_1"},
        "reasoning_content": "provider extension kept",
    }
    json.dumps(item)


def ok(call_id: str, content: str) -> ToolResult:
    return ToolResult(call_id=call_id, name="f", status="ok", content=content)


def failed(call_id: str, content: str) -> ToolResult:
    error = ToolError(code=ErrorCode.INVALID_JSON, message="bad", hint="fix")
    return ToolResult(call_id=call_id, name="f", status="error", content=content, error=error)


def test_results_render_as_tool_messages_in_the_given_order() -> None:
    items = ADAPTER.result_items([ok("call_b", "two"), failed("call_a", "INVALID_JSON: bad"), ok("call_c", "three")])
    assert items == [
        {"role": "tool", "tool_call_id": "call_b", "content": "two"},
        {"role": "tool", "tool_call_id": "call_a", "content": "INVALID_JSON: bad"},
        {"role": "tool", "tool_call_id": "call_c", "content": "three"},
    ]


@pytest.mark.parametrize(
    "output",
    [
        assistant({"type": "function", "function": {"name": "f", "arguments": "{}"}}),
        assistant({"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}),
        assistant({"id": "call_a", "type": "function", "function": {"arguments": "{}"}}),
        assistant({"id": "call_a", "type": "function"}),
        assistant(tool_call("call_a", "f", "{}"), tool_call("call_a", "g", "{}")),
        assistant({"id": "call_a", "type": "mystery"}),
        {"role": "assistant", "tool_calls": "not a list"},
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "user", "content": "hi"},
        {"choices": []},
        "just text",
        ["a", "list"],
    ],
)
def test_unreadable_output_is_protocol_corruption(output: Any) -> None:
    with pytest.raises(ProviderFormatError):
        ADAPTER.parse_calls(output)
    with pytest.raises(ProviderFormatError):
        ADAPTER.assistant_items(output)


# --- streaming ---------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "gpt-test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def first_fragment(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def later_fragment(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def test_stream_interleaved_and_out_of_order_gives_the_same_calls() -> None:
    accumulator = ADAPTER.stream_accumulator()
    events = [
        chunk({"role": "assistant", "content": "Let me "}),
        chunk({"tool_calls": [first_fragment(1, "call_b", "g", '{"b"')]}),
        chunk({"content": "look."}),
        chunk({"tool_calls": [first_fragment(0, "call_a", "f", ""), later_fragment(1, ": 2")]}),
        chunk({"tool_calls": [later_fragment(0, '{"a": 1}')]}),
        chunk({"tool_calls": [later_fragment(1, "}")]}),
    ]
    # Each call is handed out by the fragment that closes its arguments' object.
    handed = [accumulator.feed(ChatCompletionChunk.model_validate(event)) for event in events]
    expected = ADAPTER.parse_calls(assistant(tool_call("call_a", "f", '{"a": 1}'), tool_call("call_b", "g", '{"b": 2}')))
    assert handed == [[], [], [], [], expected[:1], expected[1:]]
    assert accumulator.feed(chunk({}, finish_reason="tool_calls")) == []
    assert accumulator.finish() == []
    output = accumulator.assistant_output()
    assert output["content"] == "Let me look."
    assert ADAPTER.parse_calls(output) == expected


def test_stream_without_finish_reason_completes_at_finish() -> None:
    accumulator = ADAPTER.stream_accumulator()
    assert accumulator.feed(chunk({"tool_calls": [first_fragment(0, "call_a", "f", '{"a": ')]})) == []
    assert accumulator.feed(chunk({"tool_calls": [later_fragment(0, "1")]})) == []
    (call,) = accumulator.finish()
    assert (call.arguments_raw, call.arguments) == ('{"a": 1', None)


def test_stream_fragments_keyed_by_id_when_the_index_is_missing() -> None:
    accumulator = ADAPTER.stream_accumulator()
    calls = accumulator.feed(chunk({"tool_calls": [{"id": "call_a", "function": {"name": "f", "arguments": "{"}}]}))
    calls += accumulator.feed(chunk({"tool_calls": [{"id": "call_b", "function": {"name": "g", "arguments": "{}"}}]}))
    calls += accumulator.feed(chunk({"tool_calls": [{"id": "call_a", "function": {"arguments": "}"}}]}))
    assert accumulator.finish() == []
    calls.sort(key=lambda call: call.index)
    assert [(call.id, call.arguments_raw, call.index) for call in calls] == [("call_a", "{}", 0), ("call_b", "{}", 1)]


@pytest.mark.parametrize(
    "events",
    [
        [chunk({"tool_calls": [later_fragment(0, "{}")]}), chunk({}, "tool_calls")],  # never got id/name
        [chunk({"tool_calls": [{"function": {"arguments": "{}"}}]})],
        [chunk({"tool_calls": [first_fragment(0, "call_a", "f", "{}")]}, "tool_calls"), chunk({"tool_calls": [later_fragment(0, "x")]})],
        [chunk({"tool_calls": [first_fragment(0, "call_a", "f", "{}"), first_fragment(1, "call_a", "f", "{}")]}, "tool_calls")],
        [chunk({"function_call": {"name": "f", "arguments": "{}"}})],
    ],
)
def test_corrupt_streams_raise(events: list[dict[str, Any]]) -> None:
    accumulator = ADAPTER.stream_accumulator()
    with pytest.raises(ProviderFormatError):
        for event in events:
            accumulator.feed(event)
        accumulator.finish()


ARGUMENT_TEXTS = st.one_of(
    st.dictionaries(
        st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=8), st.none(), st.booleans()), max_size=4
    ).map(json.dumps),
    st.sampled_from(['{"path": "a', "{}", "", "[1]", '{"a": 1}}', "not json"]),
    st.text(max_size=20),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(st.tuples(st.sampled_from(["read", "write", "search"]), ARGUMENT_TEXTS), min_size=1, max_size=4),
    data=st.data(),
)
def test_streamed_fragments_in_any_split_and_order_equal_the_parsed_message(
    calls: list[tuple[str, str]], data: st.DataObject
) -> None:
    message = assistant(*[tool_call(f"call_{i}", name, arguments) for i, (name, arguments) in enumerate(calls)])
    expected = ADAPTER.parse_calls(message)

    queues: list[list[dict[str, Any]]] = []
    for index, (name, arguments) in enumerate(calls):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(arguments)), max_size=4), label=f"cuts {index}"))
        pieces = [arguments[a:b] for a, b in zip([0, *cuts], [*cuts, len(arguments)], strict=True)]
        queues.append(
            [first_fragment(index, f"call_{index}", name, pieces[0])]
            + [later_fragment(index, piece) for piece in pieces[1:]]
        )

    # Interleave the calls' fragments (each call's own order kept); several fragments may share a chunk.
    chunks: list[dict[str, Any]] = []
    while any(queues):
        batch = []
        for _ in range(data.draw(st.integers(1, 3), label="fragments per chunk")):
            open_queues = [queue for queue in queues if queue]
            if not open_queues:
                break
            batch.append(data.draw(st.sampled_from(open_queues), label="next call").pop(0))
        chunks.append(chunk({"tool_calls": batch}))
    end_with_finish_reason = data.draw(st.booleans(), label="finish_reason chunk")
    if end_with_finish_reason:
        chunks.append(chunk({}, "tool_calls"))
    as_sdk = data.draw(st.booleans(), label="SDK objects")

    accumulator = ADAPTER.stream_accumulator()
    streamed: list[ToolCall] = []
    for event in chunks:
        streamed += accumulator.feed(ChatCompletionChunk.model_validate(event) if as_sdk else event)
    streamed += accumulator.finish()
    # A call may be handed out early (when a later call starts); one amended after that comes again
    # in its final form, which wins (what the model client keeps, `model_clients._Assembly`).
    final = {call.id: call for call in streamed}
    assert sorted(final.values(), key=lambda call: call.index) == expected
    assert ADAPTER.parse_calls(accumulator.assistant_output()) == expected


def test_a_call_is_handed_out_when_its_arguments_object_closes() -> None:
    accumulator = ADAPTER.stream_accumulator()
    # Braces, brackets and escaped quotes inside strings do not close anything.
    for piece in ['{"a": "}', ']\\', '"{", "b": [{"c": "\\\\"}', "]"]:
        assert accumulator.feed(chunk({"tool_calls": [first_fragment(0, "call_0", "read", piece)]})) == []
    early = accumulator.feed(chunk({"tool_calls": [later_fragment(0, "}  ")]}))
    assert [(c.id, c.arguments) for c in early] == [("call_0", {"a": '}]"{', "b": [{"c": "\\"}]})]
    # The last call of a message too: before the message ends, and nothing comes again at its end.
    last = accumulator.feed(chunk({"tool_calls": [first_fragment(1, "call_1", "read", "{}")]}))
    assert [c.id for c in last] == ["call_1"]
    assert not accumulator.ended_cleanly()
    assert accumulator.feed(chunk({}, "tool_calls")) == []
    assert accumulator.ended_cleanly()


def test_a_call_amended_after_its_object_closed_comes_again_in_its_final_form() -> None:
    accumulator = ADAPTER.stream_accumulator()
    (early,) = accumulator.feed(chunk({"tool_calls": [first_fragment(0, "call_0", "read", '{"a": 1}')]}))
    assert early.arguments == {"a": 1}
    assert accumulator.feed(chunk({"tool_calls": [later_fragment(0, ', "b": 2}')]})) == []
    (final,) = accumulator.feed(chunk({}, "tool_calls"))
    assert (final.id, final.arguments_raw, final.arguments) == ("call_0", '{"a": 1}, "b": 2}', None)


def test_arguments_that_are_not_an_object_wait_for_the_message_end() -> None:
    accumulator = ADAPTER.stream_accumulator()
    assert accumulator.feed(chunk({"tool_calls": [first_fragment(0, "call_0", "read", "[1]")]})) == []
    (call,) = accumulator.feed(chunk({}, "tool_calls"))
    assert (call.arguments_raw, call.arguments) == ("[1]", None)


def test_parallel_calls_a_proxy_streams_all_at_index_0_are_separate_calls() -> None:
    accumulator = ADAPTER.stream_accumulator()
    events = [
        chunk({"role": "assistant", "tool_calls": [first_fragment(0, "call_a", "f", '{"a"')]}),
        chunk({"tool_calls": [later_fragment(0, ": 1}")]}),
        chunk({"tool_calls": [first_fragment(0, "call_b", "g", "")]}),
        chunk({"tool_calls": [later_fragment(0, '{"b": 2}')]}),
        # Some proxies repeat the id in later fragments, even after the next call started.
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "function": {"arguments": ""}}]}),
    ]
    early = [call for event in events for call in accumulator.feed(ChatCompletionChunk.model_validate(event))]
    calls = accumulator.feed(ChatCompletionChunk.model_validate(chunk({}, finish_reason="tool_calls")))
    expected = ADAPTER.parse_calls(assistant(tool_call("call_a", "f", '{"a": 1}'), tool_call("call_b", "g", '{"b": 2}')))
    assert early == expected  # each handed out as its object closed; unchanged since, so not again
    assert calls == []
    assert ADAPTER.parse_calls(accumulator.assistant_output()) == expected


def test_stream_from_a_server_that_repeats_id_and_name_in_every_fragment() -> None:
    accumulator = ADAPTER.stream_accumulator()
    for piece in ['{"a"', ": 1", "}"]:
        handed = accumulator.feed(chunk({"tool_calls": [first_fragment(0, "call_a", "f", piece)]}))
    (call,) = handed
    assert accumulator.feed(chunk({}, "tool_calls")) == []
    assert (call.id, call.name, call.arguments) == ("call_a", "f", {"a": 1})
