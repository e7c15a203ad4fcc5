"""Rebuilding requests from the event log: byte-identical across processes, append-only, sanitized,
convertible between providers with every call paired, and accepted by the SDKs' request types."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog, RedisEventLog
from toolchord.orchestrator.events import (
    SessionStarted,
    ToolsDeclared,
    Transformation,
    declarations_from_registry,
    tools_digest,
)
from toolchord.orchestrator.providers import get_adapter
from toolchord.orchestrator.recorder import SessionRecorder
from toolchord.orchestrator.request_builder import RequestBuilder, check_pairing, request_bytes
from toolchord.orchestrator.scripted_model import (
    ScriptedCall,
    ScriptedTurn,
    _Ids,
    anthropic_message,
    chat_completion,
    responses_response,
)
from toolchord.worker import Provider, Registry, ToolResult, tool
from toolchord.worker.models import ErrorCode, ToolError

ROOT = Path(__file__).resolve().parent.parent
PROVIDERS = ("chat", "anthropic", "responses")


@tool(side_effect="read")
def lookup(key: str) -> str:
    """Look a key up."""
    return key


@tool(side_effect="unsafe", store_raw_arguments=False)
def charge(account: str, amount: int, api_key: str = "") -> str:
    """Charge an account."""
    return "charged"


@tool(side_effect="idempotent")
def upsert(key: str, value: str) -> str:
    """Upsert a value."""
    return "ok"


REGISTRY = Registry([lookup, charge, upsert])

SCRIPT = [
    ScriptedTurn(reasoning="first look things up", text="Looking.", calls=[
        ScriptedCall(name="lookup", arguments={"key": "a"}),
        ScriptedCall(name="upsert", arguments='{"key": "b", "value": '),  # truncated JSON
        ScriptedCall(name="charge", arguments={"account": "acme", "amount": 5, "api_key": "sk-abcdefghijklmnopqrstu"}),
    ]),
    ScriptedTurn(calls=[ScriptedCall(name="missing_tool", arguments={"x": 1})]),
    ScriptedTurn(text="All done."),
]


def model_output(provider: Provider, turn: ScriptedTurn, number: int) -> dict[str, Any]:
    """What the provider would answer for a scripted turn (the scripted server's own rendering)."""
    render = {"chat": chat_completion, "responses": responses_response, "anthropic": anthropic_message}[provider]
    return render(turn, _Ids(number), "model-x")


def result_for(call_id: str, name: str, number: int) -> ToolResult:
    if name == "missing_tool":
        return ToolResult(call_id=call_id, name=name, status="error", content="UNKNOWN_TOOL: no such tool",
                          error=ToolError(code=ErrorCode.UNKNOWN_TOOL, message="no such tool"))
    return ToolResult(call_id=call_id, name=name, status="ok", content=f"result {number} of {name} token=abc123",
                      duration_ms=1.5)


def write_conversation(log: EventLog, session_id: str, provider: Provider, *, turns: int = len(SCRIPT),
                       with_results: bool = True) -> None:
    """Write a session the way the agent does: start, tools, user input, then per turn output/calls/results."""
    recorder = SessionRecorder(log, session_id, REGISTRY)
    declared = declarations_from_registry(REGISTRY)
    recorder.append(SessionStarted(provider=provider, model="model-x", system="Be brief."))
    recorder.append(ToolsDeclared(tools=declared, digest=tools_digest(declared)))
    recorder.user_input("Please handle account acme. My password=hunter22")
    adapter = get_adapter(provider)
    for number, turn in enumerate(SCRIPT[:turns], start=1):
        output = model_output(provider, turn, number)
        calls = adapter.parse_calls(output)
        turn_id = f"turn-{number}"
        recorder.model_output(provider, "model-x", turn_id, output, adapter.assistant_items(output), calls)
        if calls:
            recorder.dispatched(turn_id, [c.id for c in calls])
        if with_results:
            for call in calls:
                recorder.result(turn_id, result_for(call.id, call.name, number))


SHAPES = {
    "chat": ("messages", "openai.types.chat", "ChatCompletionMessageParam"),
    "anthropic": ("messages", "anthropic.types", "MessageParam"),
    "responses": ("input", "openai.types.responses", "ResponseInputItemParam"),
}


def assert_provider_accepts(provider: Provider, request: dict[str, Any]) -> None:
    """Validate against the SDK's request param types, and the pairing rules."""
    import importlib

    key, module, name = SHAPES[provider]
    param: Any = getattr(importlib.import_module(module), name)
    TypeAdapter(list[param]).validate_python(request[key])
    check_pairing(provider, request)
    json.loads(request_bytes(request))


def rebuild_in_subprocess(store: str, location: str, session_id: str, provider: Provider) -> bytes:
    code = (
        "import sys\n"
        "from toolchord.orchestrator.event_stores import JsonlEventLog, RedisEventLog\n"
        "from toolchord.orchestrator.request_builder import RequestBuilder\n"
        f"log = {'JsonlEventLog' if store == 'jsonl' else 'RedisEventLog'}({location!r})\n"
        f"sys.stdout.buffer.write(RequestBuilder(log).build_bytes({session_id!r}, {provider!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT, timeout=60, check=True)
    return done.stdout


@pytest.mark.parametrize("provider", PROVIDERS)
def test_jsonl_rebuild_is_byte_identical_across_processes(tmp_path: Path, provider: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s1", provider)
    here = RequestBuilder(log).build_bytes("s1")
    there = rebuild_in_subprocess("jsonl", str(tmp_path), "s1", provider)
    assert here == there
    assert RequestBuilder(log).build_bytes("s1") == here


@pytest.mark.parametrize("provider", PROVIDERS)
def test_redis_rebuild_is_byte_identical_across_processes(redis_url: str, provider: Provider) -> None:
    log = RedisEventLog(redis_url)
    session = f"rebuild-{provider}"
    log.redis.delete(log.key(session))
    write_conversation(log, session, provider)
    here = RequestBuilder(log).build_bytes(session)
    assert rebuild_in_subprocess("redis", redis_url, session, provider) == here


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_new_turn_only_appends_to_the_request(tmp_path: Path, provider: Provider) -> None:
    key = SHAPES[provider][0]
    previous: list[Any] | None = None
    for turns in range(1, len(SCRIPT) + 1):
        log = JsonlEventLog(tmp_path / str(turns))
        write_conversation(log, "s", provider, turns=turns)
        request = RequestBuilder(log).build("s")
        assert_provider_accepts(provider, request)
        if previous is not None:
            assert request[key][: len(previous)] == previous
            assert len(request[key]) > len(previous)
        previous = request[key]


def _assistant_calls(provider: Provider, request: dict[str, Any]) -> list[dict[str, Any]]:
    if provider == "responses":
        return [i for i in request["input"] if i.get("type") == "function_call"]
    calls = []
    for message in request["messages"]:
        if provider == "chat":
            calls += [c["function"] for c in message.get("tool_calls") or []]
        elif isinstance(message["content"], list):
            calls += [b for b in message["content"] if b.get("type") == "tool_use"]
    return calls


@pytest.mark.parametrize("provider", PROVIDERS)
def test_invalid_arguments_are_sanitized_in_the_request_and_kept_in_the_log(tmp_path: Path, provider: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", provider)
    request = RequestBuilder(log).build("s")
    calls = _assistant_calls(provider, request)
    upsert_call = next(c for c in calls if c["name"] == "upsert")
    if provider == "anthropic":
        assert upsert_call["input"] == {}
    else:
        assert upsert_call["arguments"] == "{}"
    for call in calls:  # every call's arguments can be read back by the provider
        if provider != "anthropic":
            assert isinstance(json.loads(call["arguments"]), dict)
    if provider != "anthropic":  # Anthropic's SDK already turned the invalid text into {}
        parsed = [e for e in log.read("s") if e.type == "call_parsed" and e.call.name == "upsert"]
        assert parsed[0].call.arguments_raw == '{"key": "b", "value": '


@pytest.mark.parametrize("provider", ["responses", "anthropic"])
def test_reasoning_is_passed_back_verbatim_to_its_provider(tmp_path: Path, provider: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", provider)
    request = RequestBuilder(log).build("s")
    text = request_bytes(request).decode()
    if provider == "responses":
        reasoning = [i for i in request["input"] if i.get("type") == "reasoning"]
        assert len(reasoning) == 1
        assert reasoning[0]["id"] == "rs_001_0"
        assert reasoning[0]["encrypted_content"] == "enc::1::first look things up"
    else:
        first_assistant = next(m for m in request["messages"] if m["role"] == "assistant")
        assert first_assistant["content"][0] == {"signature": "sig::1", "thinking": "first look things up",
                                                 "type": "thinking"}
    assert "first look things up" in text


@pytest.mark.parametrize("source", PROVIDERS)
@pytest.mark.parametrize("target", PROVIDERS)
def test_cross_provider_rendering_keeps_every_call_paired(tmp_path: Path, source: Provider, target: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", source)
    builder = RequestBuilder(log)
    request = builder.build("s", target)
    assert_provider_accepts(target, request)
    assert len(_assistant_calls(target, request)) == 4
    migrations = [e for e in log.read("s") if isinstance(e, Transformation) and e.kind == "format_migration"]
    if source == target:
        assert migrations == []
        return
    assert len(migrations) == 1 and migrations[0].target == target
    if source in ("responses", "anthropic"):
        assert migrations[0].details["dropped_reasoning"] == 1
        assert "first look things up" not in request_bytes(request).decode()
    # Rendering again logs nothing new and gives the same bytes.
    assert request_bytes(builder.build("s", target)) == request_bytes(request)
    assert len([e for e in log.read("s") if isinstance(e, Transformation) and e.kind == "format_migration"]) == 1


def test_system_prompt_and_tools_are_placed_per_provider(tmp_path: Path) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", "chat")
    builder = RequestBuilder(log)
    chat = builder.build("s", "chat")
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert [t["function"]["name"] for t in chat["tools"]] == ["lookup", "charge", "upsert"]
    anthropic = builder.build("s", "anthropic")
    assert anthropic["system"] == "Be brief." and anthropic["max_tokens"] > 0
    assert [t["name"] for t in anthropic["tools"]] == ["lookup", "charge", "upsert"]
    responses = builder.build("s", "responses")
    assert responses["instructions"] == "Be brief."
    assert responses["tools"][0]["type"] == "function" and responses["tools"][0]["name"] == "lookup"
