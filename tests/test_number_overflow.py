"""A number too large for a float (`1e400`) in a model's tool call, as each provider's API sends it,
streamed or not: answered INVALID_ARGUMENTS before dispatch (never a worker-side EXECUTION_ERROR),
the handler never runs, and the next request and its rebuild from the log are valid JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolchord import Agent, JsonlEventLog, Registry, SandboxProfile, tool
from toolchord.orchestrator.request_builder import RequestBuilder
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import ErrorCode
from toolchord.worker.registry import Provider

SCALED: list[float] = []


@tool(side_effect="unsafe", sandbox=SandboxProfile(isolate=False))
def scale(factor: float) -> str:
    """Scale by a factor."""
    SCALED.append(factor)
    return "scaled"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("provider", ["chat", "anthropic", "responses"])
def test_an_overflowing_number_is_answered_invalid_arguments(tmp_path: Path, provider: Provider, stream: bool) -> None:
    SCALED.clear()
    script = [ScriptedTurn(calls=[ScriptedCall(name="scale", arguments='{"factor": -1e400}')]), ScriptedTurn(text="Done.")]
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer(script) as server:
        base = server.base_url if provider == "anthropic" else server.base_url + "/v1"
        with Agent(Registry([scale]), model="scripted", provider=provider, base_url=base, api_key="-",
                   event_log=log, stream=stream) as agent:
            result = agent.run("scale it", session_id="overflow")
            second = server.requests[1].raw
    assert result.stop_reason == "final"
    (answer,) = result.steps[0].results
    assert answer.error is not None and answer.error.code == ErrorCode.INVALID_ARGUMENTS, answer
    assert answer.attempts == 0 and SCALED == []
    assert "- factor: Input should be a finite number" in answer.content, answer.content
    json.loads(second)  # the request that carried the answer was valid JSON
    json.loads(RequestBuilder(log).build_bytes("overflow"))
