"""The OpenAI Agents SDK and Pydantic AI integrations end to end: each real framework drives the
scripted model server, and its tool calls run on real `toolchord worker` processes on the private
Redis. What the model server received in the next request is what the model was told."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
from openai import AsyncOpenAI

from tests.cluster_helpers import TOOLS, effects, orchestrator
from tests.conftest import ROOT
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.turn import TurnRecord
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn

RunAgent = Callable[[Orchestrator, ScriptedModelServer, str], Awaitable[str]]


async def run_openai_agents(orch: Orchestrator, server: ScriptedModelServer, session: str) -> str:
    from agents import Agent, OpenAIChatCompletionsModel, Runner

    from toolchord.orchestrator.integrations.openai_agents import ToolchordTools

    tools = ToolchordTools(orch, session_id=session)
    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="test", max_retries=0)
    agent = Agent(name="assistant", model=OpenAIChatCompletionsModel(model="scripted", openai_client=client),
                  tools=tools.tools)
    result = await Runner.run(agent, "go", run_config=tools.run_config(tracing_disabled=True))
    return str(result.final_output)


async def run_pydantic_ai(orch: Orchestrator, server: ScriptedModelServer, session: str) -> str:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    from toolchord.orchestrator.integrations.pydantic_ai import ToolchordCapability, ToolchordToolset

    model = OpenAIChatModel("scripted", provider=OpenAIProvider(base_url=server.base_url + "/v1", api_key="test"))
    # The toolset's default session is the run's conversation id.
    agent = Agent(model, capabilities=[ToolchordCapability(ToolchordToolset(orch))])
    return (await agent.run("go", conversation_id=session)).output


FRAMEWORKS = pytest.mark.parametrize("run_agent", [run_openai_agents, run_pydantic_ai], ids=["openai-agents", "pydantic-ai"])


def tool_messages(body: dict[str, Any]) -> dict[str, str]:
    """The tool results of a Chat Completions request, by call id."""
    return {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}


def turn_records(client: redis.Redis, session: str) -> list[TurnRecord]:
    return [TurnRecord.model_validate_json(client.get(key) or b"{}")
            for key in client.scan_iter(f"toolchord:turn:{session}:*:record")]


@pytest.mark.slow
@FRAMEWORKS
def test_parallel_calls_one_turn_and_errors_reach_the_model_as_results(
    run_agent: RunAgent, start_worker: Callable[..., Any], redis_url: str, clean_redis: redis.Redis
) -> None:
    start_worker(TOOLS, concurrency=3)
    orch = orchestrator(redis_url)
    script = [ScriptedTurn(calls=[ScriptedCall(name="echo", arguments={"text": "first"}),
                                  ScriptedCall(name="echo", arguments={"text": "second"}),
                                  ScriptedCall(name="slow", arguments={"seconds": 5}),
                                  ScriptedCall(name="teleport", arguments={"to": "Oslo"}),
                                  ScriptedCall(name="echo", arguments='{"text": ')]),
              ScriptedTurn(text="all done")]

    async def scenario() -> str:
        with ScriptedModelServer(script) as server:
            text = await run_agent(orch, server, "s-parallel")
            bodies.extend(r.body for r in server.requests)
        await orch.aclose()
        return text

    bodies: list[dict[str, Any]] = []
    assert asyncio.run(scenario()) == "all done"
    assert len(bodies) == 2
    results = tool_messages(bodies[1])
    # Every call of the response has exactly one result, paired by the model's call id.
    assert set(results) == {"call_001_0", "call_001_1", "call_001_2", "call_001_3", "call_001_4"}
    assert results["call_001_0"] == "first" and results["call_001_1"] == "second"
    assert results["call_001_2"].startswith("TIMEOUT: 'slow' did not finish within the tool's own 1 s timeout")
    assert "UNKNOWN_TOOL: there is no tool named 'teleport'. Available tools:" in results["call_001_3"]
    # Malformed arguments reach toolchord as sent, not the framework's own validation.
    assert results["call_001_4"].startswith("INVALID_JSON: the arguments for 'echo' are not a JSON object")
    # The framework invoked the known calls one by one; toolchord ran them as one turn.
    [record] = turn_records(clean_redis, "s-parallel")
    assert [c.id for c in record.calls] == ["call_001_0", "call_001_1", "call_001_2", "call_001_4"]


@pytest.mark.slow
@FRAMEWORKS
def test_unsafe_call_not_run_twice_when_the_worker_dies_and_the_run_is_retried(
    run_agent: RunAgent, start_worker: Callable[..., Any], redis_url: str, clean_redis: redis.Redis
) -> None:
    victim = start_worker(TOOLS, concurrency=1, name="victim")
    orch = orchestrator(redis_url)
    # The model replays the same response on the retry, so the call keeps its id (call_001_0).
    script = [ScriptedTurn(calls=[ScriptedCall(name="effect_unsafe", arguments={"key": "k-once", "seconds": 3})]),
              ScriptedTurn(text="checked")]
    retried: list[dict[str, Any]] = []

    async def scenario() -> str:
        with ScriptedModelServer(script) as server:
            first = asyncio.ensure_future(run_agent(orch, server, "s-retry"))
            while effects(clean_redis, "k-once") == 0:
                assert not first.done(), first
                await asyncio.sleep(0.05)
            # The worker dies mid-call; the agent process gives up on the run (a crash, a deploy).
            victim.kill()
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
        start_worker(TOOLS, concurrency=1, name="rescuer")
        with ScriptedModelServer(script) as server:
            text = await run_agent(orch, server, "s-retry")
            retried.extend(r.body for r in server.requests)
        await orch.aclose()
        return text

    assert asyncio.run(scenario()) == "checked"
    told = tool_messages(retried[1])["call_001_0"]
    assert told.startswith("OUTCOME_UNKNOWN: 'effect_unsafe' started but its end was not observed"), told
    assert effects(clean_redis, "k-once") == 1


@pytest.mark.slow
@pytest.mark.parametrize("example", ["openai_agents_example.py", "pydantic_ai_example.py"])
def test_example_runs_embedded(example: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / example)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for expected in ("call_001_0 lookup_order", "UNKNOWN_TOOL", "TIMEOUT", "INVALID_ARGUMENTS", "final answer: Done"):
        assert expected in done.stdout, f"{expected!r} missing from:\n{done.stdout}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["openai_agents_example.py", "pydantic_ai_example.py", "langgraph_example.py"])
def test_examples_show_the_safe_path_and_each_error_code_once(example: str) -> None:
    # What a new user sees: no tool outside the sandbox zygote, no "TIMEOUT: TIMEOUT:".
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / example)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = done.stdout + done.stderr
    assert "direct fork" not in seen and "worker's memory" not in seen, seen
    assert "TIMEOUT" in done.stdout
    doubled = re.findall(r"\b([A-Z][A-Z_]+): \1:", seen)
    assert not doubled, seen
