"""The adapters against the real openai and anthropic clients and a scripted local HTTP server.

Each test streams a turn with tool calls through the SDK, feeds the SDK's own event objects to the
accumulator, sends the assistant items and results back in the next request, and checks what
reached the server and what the adapter reads from the SDK's non-streamed response.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import openai
import pytest

from toolchord.orchestrator.providers import AnthropicMessagesAdapter, get_adapter
from toolchord.worker.models import ToolCall, ToolResult


class ScriptedServer:
    """Answers each POST with the next scripted reply (a JSON body or a list of SSE events)."""

    def __init__(self) -> None:
        self.replies: list[dict[str, Any] | list[tuple[str | None, dict[str, Any] | str]]] = []
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                server.requests.append(json.loads(self.rfile.read(length)))
                reply = server.replies.pop(0)
                if isinstance(reply, dict):
                    body = json.dumps(reply).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for event, data in reply:
                    text = data if isinstance(data, str) else json.dumps(data)
                    self.wfile.write((f"event: {event}\n" if event else "").encode() + f"data: {text}\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    scripted.thread.start()
    yield scripted
    scripted.httpd.shutdown()
    scripted.httpd.server_close()


def results_for(calls: list[ToolCall]) -> list[ToolResult]:
    return [
        ToolResult(
            call_id=call.id,
            name=call.name,
            status="ok" if call.arguments is not None else "error",
            content=f"result of {call.name}",
        )
        for call in calls
    ]


def test_chat_completions_round_trip(server: ScriptedServer) -> None:
    adapter = get_adapter("chat")

    def chunk(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
        return None, {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    server.replies.append(
        [
            chunk({"role": "assistant", "content": "Checking."}),
            chunk(
                {
                    "tool_calls": [
                        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"x"'}}
                    ]
                }
            ),
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ]
                }
            ),
            chunk({"tool_calls": [{"index": 1, "function": {"arguments": ": 1"}}]}),
            chunk({}, "tool_calls"),
            (None, "[DONE]"),
        ]
    )
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="test", max_retries=0)
    accumulator = adapter.stream_accumulator()
    calls: list[ToolCall] = []
    for event in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], stream=True):
        calls += accumulator.feed(event)
    calls += accumulator.finish()
    assert [(call.id, call.name, call.arguments_raw, call.arguments) for call in calls] == [
        ("call_a", "f", "{}", {}),
        ("call_b", "g", '{"x": 1', None),
    ]

    history = [
        {"role": "user", "content": "go"},
        *adapter.assistant_items(accumulator.assistant_output()),
        *adapter.result_items(results_for(calls)),
    ]
    server.replies.append(
        {
            "id": "c2",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "logprobs": None,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "refusal": None,
                        "annotations": [],
                        "tool_calls": [
                            {"id": "call_c", "type": "function", "function": {"name": "f", "arguments": '{"y": 2}'}}
                        ],
                    },
                }
            ],
        }
    )
    completion = client.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
    assert server.requests[-1]["messages"] == history
    assert [message["role"] for message in history] == ["user", "assistant", "tool", "tool"]
    assert adapter.parse_calls(completion) == [
        ToolCall(id="call_c", name="f", arguments_raw='{"y": 2}', arguments={"y": 2}, index=0)
    ]
    assert adapter.assistant_items(completion) == [adapter.assistant_items(completion.choices[0].message)[0]]


def test_anthropic_messages_round_trip(server: ScriptedServer) -> None:
    adapter = get_adapter("anthropic")
    start_message: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": start_message},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Need both."}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig=="}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
        },
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"a": '}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "[1, 2]}"}},
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_b", "name": "g", "input": {}},
        },
        {"type": "content_block_stop", "index": 2},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 20},
        },
        {"type": "message_stop"},
    ]
    server.replies.append([(event["type"], event) for event in events])
    client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
    accumulator = adapter.stream_accumulator()
    handed_out_per_event: list[list[ToolCall]] = []
    for event in client.messages.create(
        model="m", max_tokens=100, messages=[{"role": "user", "content": "go"}], stream=True
    ):
        handed_out_per_event.append(accumulator.feed(event))
    assert accumulator.finish() == []
    assert [len(handed) for handed in handed_out_per_event] == [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0]
    calls = [call for handed in handed_out_per_event for call in handed]
    assert [(call.id, call.arguments_raw, call.index) for call in calls] == [
        ("toolu_a", '{"a":[1,2]}', 0),
        ("toolu_b", "{}", 1),
    ]

    history = [
        {"role": "user", "content": "go"},
        *adapter.assistant_items(accumulator.assistant_output()),
        *AnthropicMessagesAdapter().result_items(results_for(calls), extra_content="Now summarize."),
    ]
    assert history[1]["content"][0] == {"type": "thinking", "thinking": "Need both.", "signature": "sig=="}
    server.replies.append(
        {
            **start_message,
            "id": "msg_2",
            "stop_reason": "tool_use",
            "content": [{"type": "tool_use", "id": "toolu_c", "name": "f", "input": {"a": []}}],
        }
    )
    reply = client.messages.create(model="m", max_tokens=100, messages=history)  # type: ignore[arg-type]
    assert server.requests[-1]["messages"] == history
    assert [block["type"] for block in history[2]["content"]] == ["tool_result", "tool_result", "text"]
    assert adapter.parse_calls(reply) == [
        ToolCall(id="toolu_c", name="f", arguments_raw='{"a":[]}', arguments={"a": []}, index=0)
    ]


def test_responses_round_trip(server: ScriptedServer) -> None:
    adapter = get_adapter("responses")
    base = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "m",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "enc=="}
    call_a = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_a",
        "name": "f",
        "arguments": '{"q": "x"}',
        "status": "completed",
    }
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**base, "status": "in_progress", "output": []}},
        {"type": "response.output_item.added", "output_index": 0, "item": reasoning},
        {"type": "response.output_item.done", "output_index": 0, "item": reasoning},
        {
            "type": "response.output_item.added",
            "output_index": 1,
            "item": {**call_a, "arguments": "", "status": "in_progress"},
        },
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 1, "delta": '{"q": '},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 1, "delta": '"x"}'},
        {
            "type": "response.function_call_arguments.done",
            "item_id": "fc_1",
            "output_index": 1,
            "arguments": '{"q": "x"}',
        },
        {"type": "response.output_item.done", "output_index": 1, "item": call_a},
        {"type": "response.completed", "response": {**base, "status": "completed", "output": [reasoning, call_a]}},
    ]
    server.replies.append(
        [(event["type"], {**event, "sequence_number": number}) for number, event in enumerate(events)]
    )
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="test", max_retries=0)
    accumulator = adapter.stream_accumulator()
    handed_out_per_event = [
        accumulator.feed(event) for event in client.responses.create(model="m", input="go", stream=True)
    ]
    assert accumulator.finish() == []
    assert [len(handed) for handed in handed_out_per_event] == [0, 0, 0, 0, 0, 0, 1, 0, 0]
    (call,) = handed_out_per_event[6]
    assert (call.id, call.arguments) == ("call_a", {"q": "x"})

    history = [
        {"role": "user", "content": "go"},
        *adapter.assistant_items(accumulator.assistant_output()),
        *adapter.result_items(results_for([call])),
    ]
    assert history[1] == reasoning and history[2]["id"] == "fc_1"
    server.replies.append(
        {**base, "id": "resp_2", "status": "completed", "output": [{**call_a, "id": "fc_2", "call_id": "call_b"}]}
    )
    response = client.responses.create(model="m", input=history)  # type: ignore[arg-type]
    assert server.requests[-1]["input"] == history
    assert [(c.id, c.arguments_raw) for c in adapter.parse_calls(response)] == [("call_b", '{"q": "x"}')]
