"""Provider extension fields survive a turn (streamed or not), and what goes back is a valid request.

Built from the SDKs' own types: `ChatCompletionChunk`s assembled by toolchord's accumulator are
compared with the openai SDK's own accumulator (`ChatCompletionStreamState`).
"""

from __future__ import annotations

from typing import Any

import pytest
from anthropic._models import construct_type
from anthropic.types import Message
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from toolchord.orchestrator.pipeline import Pipeline
from toolchord.orchestrator.providers import get_adapter
from toolchord.worker import ErrorCode, Registry, ToolCall, tool


def _chunk(delta: dict[str, Any], finish: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    })


# DeepSeek `reasoning_content`, OpenRouter `reasoning_details`, Gemini `extra_content` on a call.
EXTENSION_CHUNKS = [
    _chunk({"role": "assistant", "content": "", "reasoning_content": "Let me "}),
    _chunk({"reasoning_content": "think.",
            "reasoning_details": [{"type": "reasoning.text", "text": "Let ", "index": 0, "format": "x"}]}),
    _chunk({"reasoning_details": [{"type": "reasoning.text", "text": "me think.", "index": 0}]}),
    _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                            "function": {"name": "weather", "arguments": ""},
                            "extra_content": {"google": {"thought_signature": "sig-A"}}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk({}, "tool_calls"),
]


def _sdk_message() -> dict[str, Any]:
    state = ChatCompletionStreamState()
    for chunk in EXTENSION_CHUNKS:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0].message.to_dict(mode="json")


def test_a_streamed_chat_turn_keeps_every_extension_field_like_the_sdk_accumulator() -> None:
    accumulator = get_adapter("chat").stream_accumulator()
    calls = [call for chunk in EXTENSION_CHUNKS for call in accumulator.feed(chunk)] + accumulator.finish()
    assert [(c.id, c.arguments) for c in calls] == [("call_a", {"city": "Paris"})]
    (item,) = get_adapter("chat").assistant_items(accumulator.assistant_output())
    assert item["reasoning_content"] == "Let me think."
    assert item["reasoning_details"] == [{"type": "reasoning.text", "text": "Let me think.", "index": 0, "format": "x"}]
    assert item["tool_calls"][0]["extra_content"] == {"google": {"thought_signature": "sig-A"}}
    # The same request message as the SDK's own accumulator gives (minus its response-only fields;
    # the SDK keeps the opening chunk's empty content, toolchord writes no text as no content).
    sdk_item = get_adapter("chat").assistant_items(_sdk_message())[0]
    assert sdk_item.pop("content") == "" and "content" not in item
    assert item == sdk_item


def test_the_sdks_parsed_completion_leaks_no_response_only_fields_into_the_request() -> None:
    sdk = _sdk_message()
    assert "index" in sdk["tool_calls"][0] and "parsed_arguments" in sdk["tool_calls"][0]["function"]
    (item,) = get_adapter("chat").assistant_items(sdk)
    assert set(item["tool_calls"][0]) == {"id", "type", "function", "extra_content"}
    assert set(item["tool_calls"][0]["function"]) == {"name", "arguments"}
    assert "parsed" not in item


def test_a_non_streamed_chat_message_keeps_its_extension_fields() -> None:
    completion = ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "reasoning_content": "hm",
            "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "w", "arguments": "{}"},
                            "extra_content": {"google": {"thought_signature": "sig"}}}]}}],
    })
    (item,) = get_adapter("chat").assistant_items(completion)
    assert item["reasoning_content"] == "hm"
    assert item["tool_calls"][0]["extra_content"] == {"google": {"thought_signature": "sig"}}


@pytest.mark.parametrize("provider", ["chat", "responses"])
@pytest.mark.parametrize("broken", ['{"city": "Par', "[1]", "NaN"])
def test_broken_arguments_are_replayed_as_an_empty_object(provider: str, broken: str) -> None:
    if provider == "chat":
        output: Any = {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": broken}}]}
    else:
        output = [{"type": "function_call", "call_id": "c1", "name": "w", "arguments": broken}]
    adapter = get_adapter(provider)  # type: ignore[arg-type]
    (call,) = adapter.parse_calls(output)
    assert call.arguments is None and call.arguments_raw == broken
    items = adapter.assistant_items(output)
    replayed = items[0]["tool_calls"][0]["function"]["arguments"] if provider == "chat" else items[0]["arguments"]
    assert replayed == "{}"


@pytest.mark.parametrize("provider", ["chat", "responses"])
def test_empty_arguments_mean_no_arguments_everywhere(provider: str) -> None:
    if provider == "chat":
        output: Any = {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": " "}}]}
    else:
        output = [{"type": "function_call", "call_id": "c1", "name": "ping", "arguments": ""}]
    (call,) = get_adapter(provider).parse_calls(output)  # type: ignore[arg-type]
    assert call.arguments == {}
    (result,) = Pipeline(Registry([ping])).run_all([call])
    assert result.status == "ok" and result.content == "pong"


@tool(side_effect="read", sandbox={"isolate": False})
def ping() -> str:
    """Answer pong."""
    return "pong"


@tool(side_effect="read")
def echo_sandboxed(text: str) -> str:
    """Echo the text (runs in the sandbox)."""
    return text


@pytest.mark.parametrize("value", [None, "{\"city\": \"Paris\"}", ["Paris"], 3])
def test_anthropic_tool_use_input_that_is_not_an_object_gets_an_error_and_a_valid_block(value: Any) -> None:
    # The SDK builds responses leniently (construct_type), so such a block reaches user code as is.
    message = construct_type(type_=Message, value={
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
        "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1},
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "echo_sandboxed", "input": value}],
    })
    adapter = get_adapter("anthropic")
    (call,) = adapter.parse_calls(message)
    assert call.arguments is None
    (result,) = Pipeline(Registry([echo_sandboxed])).run_all([call])
    assert result.error is not None and result.error.code == ErrorCode.INVALID_JSON
    assert "expected an object" in result.content
    (item,) = adapter.assistant_items(message)
    assert item["content"][0]["input"] == {}


@pytest.mark.parametrize("raw", ['{"text": "\\ud800"}', '{"text": "\ud800"}', '{"\\udfff": 1}'])
def test_lone_surrogates_are_invalid_json_not_an_execution_error(raw: str) -> None:
    call = ToolCall(id="c1", name="echo_sandboxed", arguments_raw=raw)
    result = Pipeline(Registry([echo_sandboxed])).run(call)  # the sandbox path: must not raise
    assert result.error is not None and result.error.code == ErrorCode.INVALID_JSON, result.content
    assert "surrogate" in result.content
    (parsed,) = get_adapter("chat").parse_calls({"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "echo_sandboxed", "arguments": raw}}]})
    assert parsed.arguments is None
