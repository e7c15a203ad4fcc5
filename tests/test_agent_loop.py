"""The agent loop end to end: the real `openai` and `anthropic` clients against the scripted model
server, the real embedded Orchestrator, and the event log the requests are rebuilt from."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from toolchord.orchestrator.agent import Agent
from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog
from toolchord.orchestrator.events import ModelFailed, ModelRequest
from toolchord.orchestrator.history_repair import History, plan_repair
from toolchord.orchestrator.model_clients import ModelError
from toolchord.orchestrator.request_builder import render, request_bytes
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import Provider, Registry, tool

ROOT = Path(__file__).resolve().parent.parent
PROVIDERS = ("chat", "anthropic", "responses")


@tool(side_effect="read", timeout=5)
def weather(city: str) -> str:
    """Current weather for a city."""
    return f"sunny in {city}"


@tool(side_effect="idempotent", timeout=5)
def save_note(title: str, text: str) -> str:
    """Save a note under a title."""
    return f"saved {title}"


REGISTRY = Registry([weather, save_note])

SCRIPT = [
    ScriptedTurn(reasoning="check the weather first", text="Checking.", calls=[
        ScriptedCall(name="weather", arguments={"city": "Oslo"}),
        ScriptedCall(name="teleport", arguments={"to": "Oslo"}),
        ScriptedCall(name="save_note", arguments='{"title": "x", '),
    ]),
    ScriptedTurn(calls=[ScriptedCall(name="save_note", arguments={"title": "trip", "text": "sunny"})]),
    ScriptedTurn(text="It is sunny in Oslo; I saved a note."),
]


@pytest.fixture(scope="module")
def orchestrator() -> Iterator[Orchestrator]:
    runtime = Orchestrator(REGISTRY)
    yield runtime
    runtime.close()


def base_url(server: ScriptedModelServer, provider: Provider) -> str:
    return server.base_url if provider == "anthropic" else server.base_url + "/v1"


def rebuilt_requests(log: EventLog, session_id: str) -> list[dict[str, Any]]:
    """The request of every step, rebuilt from the log prefix before its ModelRequest event."""
    events = log.read(session_id)
    out = []
    for end, event in enumerate(events):
        if isinstance(event, ModelRequest):
            prefix = events[:end]
            request, _ = render(History.from_events(prefix + plan_repair(History.from_events(prefix))))
            out.append(json.loads(request_bytes(request)))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_multi_turn_conversation_through_the_real_clients(
    tmp_path: Path, orchestrator: Orchestrator, provider: Provider, stream: bool
) -> None:
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer(SCRIPT) as server:
        agent = Agent(REGISTRY, model="scripted", provider=provider, base_url=base_url(server, provider),
                      api_key="test", orchestrator=orchestrator, event_log=log, system="Be helpful.", stream=stream)
        result = agent.run("What is the weather in Oslo? Save a note.")
        agent.close()
    assert result.stop_reason == "final"
    assert result.text == "It is sunny in Oslo; I saved a note."
    first, second, final = result.steps
    # Anthropic's tool_use input is always an object, so the truncated JSON arrives as {} there.
    bad_arguments = "INVALID_ARGUMENTS" if provider == "anthropic" else "INVALID_JSON"
    assert [(r.name, r.status, r.error.code.value if r.error else None) for r in first.results] == [
        ("weather", "ok", None), ("teleport", "error", "UNKNOWN_TOOL"), ("save_note", "error", bad_arguments)
    ], [r.content for r in first.results]
    assert [r.content for r in second.results] == ["saved trip"]
    assert final.calls == []

    assert len(server.requests) == 3
    assert all(r.body.get("stream", False) is stream for r in server.requests)
    key = "input" if provider == "responses" else "messages"
    # What the server received is exactly what the log rebuilds, step by step.
    for received, rebuilt in zip(server.requests, rebuilt_requests(log, result.session_id), strict=True):
        assert received.body[key] == rebuilt[key]
        assert received.body["tools"] == rebuilt["tools"]
    second_request = json.dumps(server.requests[1].body)
    assert "sunny in Oslo" in second_request and "UNKNOWN_TOOL" in second_request
    if provider == "responses":
        reasoning = [i for i in server.requests[1].body["input"] if i.get("type") == "reasoning"]
        assert reasoning and reasoning[0]["encrypted_content"] == "enc::1::check the weather first"
    if provider == "anthropic":
        assistant = server.requests[1].body["messages"][1]
        assert assistant["content"][0] == {"type": "thinking", "thinking": "check the weather first",
                                           "signature": "sig::1"}
    # A later request only appends to the earlier ones.
    bodies = [r.body[key] for r in server.requests]
    assert bodies[1][: len(bodies[0])] == bodies[0] and bodies[2][: len(bodies[1])] == bodies[1]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_arun_runs_the_same_loop_on_asyncio(tmp_path: Path, orchestrator: Orchestrator, provider: Provider) -> None:
    with ScriptedModelServer(SCRIPT) as server:
        agent = Agent(REGISTRY, model="scripted", provider=provider, base_url=base_url(server, provider),
                      api_key="test", orchestrator=orchestrator, event_log=JsonlEventLog(tmp_path), stream=True)
        result = asyncio.run(agent.arun("weather?"))
    assert result.stop_reason == "final" and len(result.steps) == 3
    assert result.steps[0].results[0].content == "sunny in Oslo"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_rate_limits_are_retried_by_the_sdk(tmp_path: Path, orchestrator: Orchestrator, provider: Provider) -> None:
    script = [ScriptedTurn(error_status=429), ScriptedTurn(error_status=503), ScriptedTurn(text="fine")]
    with ScriptedModelServer(script) as server:
        agent = Agent(REGISTRY, model="scripted", provider=provider, base_url=base_url(server, provider),
                      api_key="test", orchestrator=orchestrator, event_log=JsonlEventLog(tmp_path), max_retries=2)
        result = agent.run("hi")
    assert result.text == "fine"
    assert len(server.requests) == 3


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_model_failure_raises_a_model_error(tmp_path: Path, orchestrator: Orchestrator, provider: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer([ScriptedTurn(error_status=500)] * 2) as server:
        agent = Agent(REGISTRY, model="scripted", provider=provider, base_url=base_url(server, provider),
                      api_key="test", orchestrator=orchestrator, event_log=log, max_retries=1)
        with pytest.raises(ModelError, match="HTTP 500") as caught:
            agent.run("hi", session_id="failing")
    assert caught.value.status_code == 500
    assert len(server.requests) == 2  # one try plus one SDK retry
    failures = [e for e in log.read("failing") if isinstance(e, ModelFailed)]
    assert len(failures) == 1 and "500" in failures[0].message


def test_the_step_limit_stops_a_model_that_never_finishes(tmp_path: Path, orchestrator: Orchestrator) -> None:
    looping = ScriptedTurn(calls=[ScriptedCall(name="weather", arguments={"city": "Bergen"})])
    with ScriptedModelServer([looping] * 5) as server:
        agent = Agent(REGISTRY, model="scripted", base_url=base_url(server, "chat"), api_key="test",
                      orchestrator=orchestrator, event_log=JsonlEventLog(tmp_path), max_steps=2)
        result = agent.run("loop")
    assert result.stop_reason == "max_steps" and len(result.steps) == 2 and server.remaining == 3


def test_a_session_continues_from_its_log(tmp_path: Path, orchestrator: Orchestrator) -> None:
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer([ScriptedTurn(text="first"), ScriptedTurn(text="second")]) as server:
        agent = Agent(REGISTRY, model="scripted", base_url=base_url(server, "chat"), api_key="test",
                      orchestrator=orchestrator, event_log=log)
        agent.run("one", session_id="conv")
        agent.run("two", session_id="conv")
    messages = server.requests[1].body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "first"


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from toolchord.orchestrator.cli import main; main()", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False)


@pytest.mark.slow
@pytest.mark.timeout(60)  # loaded 2-core machine: about 9 s
def test_toolchord_demo_prints_the_timeline_and_replays(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    env["TOOLCHORD_LOG_DIR"] = str(tmp_path / "logs")
    done = _cli("demo", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for expected in ("step 1", "lookup_order", "[read]", "[idempotent]", "[unsafe]", "[not in registry]",
                     "UNKNOWN_TOOL", "TIMEOUT", "INVALID_ARGUMENTS", "final answer: Done"):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    session = json.loads(out.strip().splitlines()[-1])["session_id"]
    replay = _cli("replay", session, env=env)
    assert replay.returncode == 0, replay.stderr
    assert replay.stdout.count("identical to the request sent") == 4
    assert "DIFFERS" not in replay.stdout
    converted = _cli("replay", session, "--provider", "anthropic", env=env)
    assert converted.returncode == 0 and '"tool_result"' in converted.stdout


def test_toolchord_tools_prints_declarations() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    done = _cli("tools", "--provider", "anthropic", "--tools", "toolchord.worker.demo_tools", env=env)
    assert done.returncode == 0, done.stderr
    names = [d["name"] for d in json.loads(done.stdout)]
    assert set(names) == {"lookup_order", "set_shipping_address", "send_email", "slow_report"}
    assert all("input_schema" in d for d in json.loads(done.stdout))


@pytest.mark.slow
@pytest.mark.timeout(60)  # loaded 2-core machine: about 8 s
@pytest.mark.parametrize("provider", PROVIDERS)
def test_toolchord_run_against_a_model_server(tmp_path: Path, provider: Provider) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    env.update(TOOLCHORD_LOG_DIR=str(tmp_path / "logs"), OPENAI_API_KEY="test", ANTHROPIC_API_KEY="test")
    script = [ScriptedTurn(calls=[ScriptedCall(name="lookup_order", arguments={"order_id": "A-1001"})]),
              ScriptedTurn(text="A-1001 has shipped.")]
    with ScriptedModelServer(script) as server:
        done = _cli("run", "--base-url", base_url(server, provider), "--model", "m", "--provider", provider,
                    "--tools", "toolchord.worker.demo_tools", "Where is order A-1001?", env=env)
        received = [r.body for r in server.requests]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lookup_order" in done.stdout and "final answer: A-1001 has shipped." in done.stdout
    assert len(received) == 2 and "espresso machine" in json.dumps(received[1])


EXTENSIONS = {"reasoning_content": "The user wants the weather; call the tool.",
              "reasoning_details": [{"type": "reasoning.encrypted", "data": "opaque==", "index": 0}]}
THOUGHT = {"extra_content": {"google": {"thought_signature": "c2lnbmF0dXJl"}}}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_provider_extension_fields_go_back_in_the_next_request(
    tmp_path: Path, orchestrator: Orchestrator, stream: bool
) -> None:
    # DeepSeek, OpenRouter and Gemini reject the next request when these are missing.
    script = [ScriptedTurn(extra=EXTENSIONS, calls=[ScriptedCall(name="weather", arguments={"city": "Oslo"},
                                                                 extra=THOUGHT)]),
              ScriptedTurn(text="Sunny.")]
    with ScriptedModelServer(script) as server:
        agent = Agent(REGISTRY, model="scripted", base_url=base_url(server, "chat"), api_key="test",
                      orchestrator=orchestrator, event_log=JsonlEventLog(tmp_path), stream=stream)
        assert agent.run("Weather in Oslo?").text == "Sunny."
        second = server.requests[1].body["messages"]
    (assistant,) = [m for m in second if m["role"] == "assistant"]
    assert {key: assistant[key] for key in EXTENSIONS} == EXTENSIONS
    assert assistant["tool_calls"][0]["extra_content"] == THOUGHT["extra_content"]
    assert "index" not in assistant["tool_calls"][0]
