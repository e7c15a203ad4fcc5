"""Eager dispatch on real workers and the private Redis, through the three providers' streams and
the real SDK clients (orchestrator/streaming.py, docs/agent-loop.md "Eager dispatch")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.cluster_helpers import TOOLS, effects, orchestrator
from toolchord.orchestrator import Agent
from toolchord.orchestrator.event_stores import JsonlEventLog, RedisEventLog
from toolchord.orchestrator.events import CallSentEarly, MessageEnded, ModelOutput
from toolchord.orchestrator.model_clients import ModelError
from toolchord.orchestrator.request_builder import RequestBuilder
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import Provider

PROVIDERS: list[Provider] = ["chat", "anthropic", "responses"]


def _starts(client: redis.Redis, key: str) -> list[float]:
    return [float(v) for v in client.lrange(f"tc-test:starts:{key}", 0, -1)]


def _agent(server: ScriptedModelServer, provider: Provider, url: str, log: JsonlEventLog, **options: Any) -> Agent:
    runtime = orchestrator(url)
    base = server.base_url if provider == "anthropic" else server.base_url + "/v1"
    return Agent(runtime.registry, model="scripted", provider=provider, base_url=base, api_key="-",
                 orchestrator=runtime, event_log=log, stream=True, **options)


def one_eager_turn(redis_url: str, session_id: str) -> None:
    """A streamed turn (chat, the real SDK client): a read call starts while the message streams on
    for three more seconds, an unsafe one only after it ended."""
    calls = [ScriptedCall(name="stamp_read", arguments={"key": f"{session_id}-r", "seconds": 1.0}),
             ScriptedCall(name="stamp_unsafe", arguments={"key": f"{session_id}-u", "seconds": 0.5})]
    script = [ScriptedTurn(calls=calls, stream_seconds=0.5, tail_seconds=3.0), ScriptedTurn(text="Done.")]
    runtime = orchestrator(redis_url)
    with ScriptedModelServer(script) as model:
        agent = Agent(runtime.registry, model="scripted", base_url=model.base_url + "/v1", api_key="-",
                      orchestrator=runtime, event_log=RedisEventLog(redis_url), stream=True)
        assert agent.run("go", session_id=session_id).stop_reason == "final"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_read_call_starts_while_the_message_streams_an_unsafe_one_after_it_ended(
    provider: Provider, tmp_path: Path, redis_url: str, clean_redis: redis.Redis,
    start_worker: Callable[..., Any],
) -> None:
    start_worker(TOOLS)
    script = [
        ScriptedTurn(calls=[ScriptedCall(name="stamp_read", arguments={"key": "r"}),
                            ScriptedCall(name="stamp_unsafe", arguments={"key": "u"}),
                            ScriptedCall(name="stamp_read", arguments={"key": "r2", "seconds": 0.0})],
                     stream_seconds=4.0),
        ScriptedTurn(text="done"),
    ]
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer(script) as server:
        result = _agent(server, provider, redis_url, log).run("go", session_id="s-eager")
    assert result.stop_reason == "final"
    assert [r.status for r in result.steps[0].results] == ["ok", "ok", "ok"]
    events = log.read("s-eager")
    ended = next(e for e in events if isinstance(e, MessageEnded))
    assert ended.complete
    assert _starts(clean_redis, "r")[0] < ended.ts  # started while the model was still streaming
    assert _starts(clean_redis, "u")[0] > ended.ts  # unsafe: only once the message ended cleanly
    assert {e.tool for e in events if isinstance(e, CallSentEarly)} == {"stamp_read"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_cut_stream_loses_and_doubles_nothing(
    provider: Provider, tmp_path: Path, redis_url: str, clean_redis: redis.Redis,
    start_worker: Callable[..., Any],
) -> None:
    start_worker(TOOLS)
    calls = [ScriptedCall(name="effect_read", arguments={"key": f"read-{provider}"}),
             ScriptedCall(name="effect_unsafe", arguments={"key": f"unsafe-{provider}"})]
    script = [ScriptedTurn(calls=calls, cut_at_call=1), ScriptedTurn(calls=calls), ScriptedTurn(text="done")]
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer(script) as server:
        agent = _agent(server, provider, redis_url, log)
        with pytest.raises(ModelError):
            agent.run("go", session_id="s-cut")
        events = log.read("s-cut")
        # The cut message is not in the history: its early call is logged as sent, nothing else.
        assert not any(isinstance(e, ModelOutput) for e in events)
        assert [e.complete for e in events if isinstance(e, MessageEnded)] == [False]
        assert len([e for e in events if isinstance(e, CallSentEarly)]) == 1
        RequestBuilder(log).build("s-cut", provider, model="scripted")  # pairing checked: no orphan result
        assert effects(clean_redis, f"unsafe-{provider}") == 0  # never started: the message never ended
        result = agent.resume("s-cut")  # the retried request returns the same calls
        requests = [r.raw for r in server.requests]
    assert result.stop_reason == "final"
    assert requests[0] == requests[1]
    assert [r.status for r in result.steps[0].results] == ["ok", "ok"]
    assert effects(clean_redis, f"read-{provider}") == 1  # the eager run's result was reused
    assert effects(clean_redis, f"unsafe-{provider}") == 1
