"""A scripted model server for demos and tests.

A small HTTP server on 127.0.0.1 that speaks enough of the OpenAI Chat Completions, OpenAI
Responses and Anthropic Messages APIs (JSON and SSE streaming) for the official `openai` and
`anthropic` clients. It replays a script of model turns in order — tool calls, final text,
reasoning, or an HTTP error — and records every request it received so tests can assert on them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from pydantic import BaseModel, Field

from toolchord.orchestrator.providers.plain_data import compact_json, json_text


def _wire(payload: Any) -> str:
    # As a real API sends them: a lone surrogate as its JSON escape, an infinite number as 1e400.
    return compact_json(payload)


class ScriptedCall(BaseModel):
    """A tool call the scripted model makes. `arguments` as a string is sent verbatim (may be invalid JSON)."""

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Chat: extension fields of the tool call (e.g. Gemini `extra_content`).")

    def arguments_text(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json_text(self.arguments)

    def arguments_object(self) -> dict[str, Any]:
        """Anthropic's `input` must be an object: invalid text becomes {}."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


class ScriptedTurn(BaseModel):
    """One model answer: optional reasoning, optional text, tool calls; or an HTTP error status."""

    text: str | None = None
    calls: list[ScriptedCall] = Field(default_factory=list)
    reasoning: str | None = Field(default=None, description="Rendered as Responses reasoning / Anthropic thinking.")
    error_status: int | None = Field(default=None, description="Answer with this HTTP error instead (e.g. 429, 500).")
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Chat: extension fields of the message (e.g. DeepSeek `reasoning_content`); text streams in pieces.")
    stream_seconds: float = Field(
        default=0.0, ge=0, description="A streamed answer spreads its events evenly over this many seconds.")
    tail_seconds: float = Field(
        default=0.0, ge=0, description="A streamed answer pauses this long before its last event (on top of stream_seconds).")
    cut_at_call: int | None = Field(
        default=None, ge=0,
        description="A streamed answer stops right after call N (0-based) starts, as a dropped connection: "
                    "the calls before it are complete, no terminal event is sent.")


class RecordedRequest(BaseModel):
    """A request the server received."""

    path: str
    api: str
    body: dict[str, Any]
    raw: bytes
    headers: dict[str, str]


def _api_for(path: str) -> str | None:
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/messages"):
        return "anthropic"
    return None


class _Ids:
    """Deterministic ids per model turn so scripted conversations are reproducible."""

    def __init__(self, turn_number: int) -> None:
        self.n = turn_number

    def call(self, api: str, index: int) -> str:
        prefix = "toolu" if api == "anthropic" else "call"
        return f"{prefix}_{self.n:03d}_{index}"

    def item(self, kind: str, index: int) -> str:
        return f"{kind}_{self.n:03d}_{index}"


def _usage(api: str) -> dict[str, Any]:
    if api == "anthropic":
        return {"input_tokens": 10, "output_tokens": 5}
    if api == "responses":
        return {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def chat_completion(turn: ScriptedTurn, ids: _Ids, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.text, "refusal": None, **turn.extra}
    if turn.calls:
        message["tool_calls"] = [
            {"id": ids.call("chat", i), "type": "function", "function": {"name": c.name, "arguments": c.arguments_text()},
             **c.extra}
            for i, c in enumerate(turn.calls)
        ]
    return {
        "id": ids.item("chatcmpl", 0), "object": "chat.completion", "created": 1700000000, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "tool_calls" if turn.calls else "stop"}],
        "usage": _usage("chat"),
    }


def _chat_chunks(turn: ScriptedTurn, ids: _Ids, model: str) -> Iterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": ids.item("chatcmpl", 0), "object": "chat.completion.chunk", "created": 1700000000,
                "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for key, value in turn.extra.items():
        for piece in _pieces(value) if isinstance(value, str) else [value]:
            yield chunk({key: piece})
    if turn.text:
        for piece in _pieces(turn.text):
            yield chunk({"content": piece})
    for i, call in enumerate(turn.calls):
        yield chunk({"tool_calls": [{"index": i, "id": ids.call("chat", i), "type": "function",
                                     "function": {"name": call.name, "arguments": ""}, **call.extra}]})
        for piece in _pieces(call.arguments_text()):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, "tool_calls" if turn.calls else "stop")


def _pieces(text: str, size: int = 7) -> list[str]:
    """Split text into small fragments, the way models stream it."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def _responses_items(turn: ScriptedTurn, ids: _Ids) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        items.append({"type": "reasoning", "id": ids.item("rs", 0),
                      "summary": [{"type": "summary_text", "text": turn.reasoning}],
                      "encrypted_content": f"enc::{ids.n}::{turn.reasoning}"})
    if turn.text is not None:
        items.append({"type": "message", "id": ids.item("msg", 0), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": turn.text, "annotations": []}]})
    for i, call in enumerate(turn.calls):
        items.append({"type": "function_call", "id": ids.item("fc", i), "call_id": ids.call("responses", i),
                      "name": call.name, "arguments": call.arguments_text(), "status": "completed"})
    return items


def responses_response(turn: ScriptedTurn, ids: _Ids, model: str, status: str = "completed",
                       output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "id": ids.item("resp", 0), "object": "response", "created_at": 1700000000, "model": model,
        "status": status, "output": _responses_items(turn, ids) if output is None else output,
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
        "incomplete_details": None, "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0,
        "usage": _usage("responses") if status == "completed" else None,
    }


def _responses_events(turn: ScriptedTurn, ids: _Ids, model: str) -> Iterator[dict[str, Any]]:
    yield {"type": "response.created", "response": responses_response(turn, ids, model, "in_progress", [])}
    items = _responses_items(turn, ids)
    for index, item in enumerate(items):
        if item["type"] == "reasoning":
            yield {"type": "response.output_item.added", "output_index": index, "item": item}
        elif item["type"] == "message":
            yield {"type": "response.output_item.added", "output_index": index,
                   "item": {**item, "status": "in_progress", "content": []}}
            part = {"type": "output_text", "text": "", "annotations": []}
            yield {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "part": part}
            text = item["content"][0]["text"]
            for piece in _pieces(text):
                yield {"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "delta": piece, "logprobs": []}
            yield {"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "text": text, "logprobs": []}
            yield {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "part": item["content"][0]}
        else:
            yield {"type": "response.output_item.added", "output_index": index,
                   "item": {**item, "arguments": "", "status": "in_progress"}}
            for piece in _pieces(item["arguments"]):
                yield {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                       "output_index": index, "delta": piece}
            yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                   "name": item["name"], "arguments": item["arguments"]}
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
    yield {"type": "response.completed", "response": responses_response(turn, ids, model)}


def _anthropic_blocks(turn: ScriptedTurn, ids: _Ids) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": f"sig::{ids.n}"})
    if turn.text is not None:
        blocks.append({"type": "text", "text": turn.text})
    for i, call in enumerate(turn.calls):
        blocks.append({"type": "tool_use", "id": ids.call("anthropic", i), "name": call.name,
                       "input": call.arguments_object()})
    return blocks


def anthropic_message(turn: ScriptedTurn, ids: _Ids, model: str) -> dict[str, Any]:
    return {
        "id": ids.item("msg", 0), "type": "message", "role": "assistant", "model": model,
        "content": _anthropic_blocks(turn, ids), "stop_reason": "tool_use" if turn.calls else "end_turn",
        "stop_sequence": None, "usage": _usage("anthropic"),
    }


def _anthropic_events(turn: ScriptedTurn, ids: _Ids, model: str) -> Iterator[dict[str, Any]]:
    start = {**anthropic_message(turn, ids, model), "content": [], "stop_reason": None}
    yield {"type": "message_start", "message": start}
    for index, block in enumerate(_anthropic_blocks(turn, ids)):
        if block["type"] == "thinking":
            yield {"type": "content_block_start", "index": index,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
            for piece in _pieces(block["thinking"]):
                yield {"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": piece}}
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "signature_delta", "signature": block["signature"]}}
        elif block["type"] == "text":
            yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
            for piece in _pieces(block["text"]):
                yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}}
        else:
            yield {"type": "content_block_start", "index": index,
                   "content_block": {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}}
            for piece in _pieces(json_text(block["input"])):
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": piece}}
        yield {"type": "content_block_stop", "index": index}
    yield {"type": "message_delta", "delta": {"stop_reason": "tool_use" if turn.calls else "end_turn",
                                              "stop_sequence": None}, "usage": {"output_tokens": 5}}
    yield {"type": "message_stop"}


def _starts_call(api: str, event: dict[str, Any]) -> bool:
    """Whether a stream event is the first one of a tool call."""
    if api == "anthropic":
        return event.get("type") == "content_block_start" and event["content_block"].get("type") == "tool_use"
    if api == "responses":
        return event.get("type") == "response.output_item.added" and event["item"].get("type") == "function_call"
    fragments = event["choices"][0]["delta"].get("tool_calls") or []
    return any("id" in fragment for fragment in fragments)


class _Paced:
    """A scripted stream's events, sent evenly over `stream_seconds` (the last one `tail_seconds`
    later), stopped at `cut_at_call`."""

    def __init__(self, api: str, turn: ScriptedTurn, events: list[dict[str, Any]]) -> None:
        self.api = api
        self.turn = turn
        self.events = events
        self.cut = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        pause = self.turn.stream_seconds / max(len(self.events), 1)
        started = 0
        for position, event in enumerate(self.events):
            if position and pause:
                time.sleep(pause)
            if position == len(self.events) - 1 and self.turn.tail_seconds:
                time.sleep(self.turn.tail_seconds)
            yield event
            if _starts_call(self.api, event):
                started += 1
                if self.turn.cut_at_call is not None and started > self.turn.cut_at_call:
                    self.cut = True
                    return


def _error_body(api: str, status: int) -> dict[str, Any]:
    kind = "rate_limit_error" if status == 429 else "api_error"
    message = f"scripted error {status}"
    if api == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "code": None, "param": None}}


class ScriptedModelServer:
    """Replays `script` turn by turn to whichever API is called; use as a context manager.

    `base_url` is what to give the clients (`openai.OpenAI(base_url=server.base_url + "/v1")` or
    `anthropic.Anthropic(base_url=server.base_url)`); `requests` lists what was received. When the
    script runs out the server answers 500 with a clear message, so a runaway loop fails loudly.
    """

    def __init__(self, script: list[ScriptedTurn], *, model: str = "scripted-model") -> None:
        self.script = list(script)
        self.model = model
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._position = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def remaining(self) -> int:
        """Scripted turns not yet served."""
        return len(self.script) - self._position

    def start(self) -> ScriptedModelServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="scripted-model", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next_turn(self, request: RecordedRequest) -> tuple[ScriptedTurn | None, int]:
        with self._lock:
            self.requests.append(request)
            if self._position >= len(self.script):
                return None, self._position
            turn = self.script[self._position]
            self._position += 1
            return turn, self._position

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: tests and the demo print their own timeline."""

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                api = _api_for(self.path)
                if api is None:
                    self._json(404, {"error": {"message": f"unknown path {self.path}"}})
                    return
                body = json.loads(raw or b"{}")
                request = RecordedRequest(path=self.path, api=api, body=body, raw=raw,
                                          headers={k.lower(): v for k, v in self.headers.items()})
                turn, number = server._next_turn(request)
                if turn is None:
                    self._json(500, _error_body(api, 500) | {"detail": "script exhausted"}, retry=False)
                    return
                if turn.error_status is not None:
                    self._json(turn.error_status, _error_body(api, turn.error_status), retry=True)
                    return
                ids = _Ids(number)
                model = str(body.get("model") or server.model)
                if body.get("stream"):
                    events = {"chat": _chat_chunks, "responses": _responses_events, "anthropic": _anthropic_events}[api]
                    self._sse(api, _Paced(api, turn, list(events(turn, ids, model))))
                else:
                    render = {"chat": chat_completion, "responses": responses_response, "anthropic": anthropic_message}[api]
                    self._json(200, render(turn, ids, model))

            def _json(self, status: int, payload: dict[str, Any], *, retry: bool | None = None) -> None:
                data = _wire(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                if retry is not None:
                    # Retry quickly: the SDKs honour retry-after-ms, so scripted retries stay fast.
                    self.send_header("x-should-retry", "true" if retry else "false")
                    self.send_header("retry-after-ms", "10")
                self.end_headers()
                self.wfile.write(data)

            def _sse(self, api: str, events: _Paced) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.send_header("connection", "close")
                self.end_headers()
                for sequence, event in enumerate(events):
                    if api == "responses":
                        event = {**event, "sequence_number": sequence}
                    lines = "" if api == "chat" else f"event: {event['type']}\n"
                    self.wfile.write(f"{lines}data: {_wire(event)}\n\n".encode())
                    self.wfile.flush()
                if api == "chat" and not events.cut:
                    self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

        return Handler


__all__ = ["RecordedRequest", "ScriptedCall", "ScriptedModelServer", "ScriptedTurn"]
