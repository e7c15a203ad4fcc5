"""Flow control made visible (docs/flow-control.md): tenant and priority per turn, the waiting state
on the timeline, Prometheus gauges and counter per limit, `toolchord limits`. Real workers, a real
Redis, a limit of one call per tenant (`lane_call`): one call holds the lane, the next one waits."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.cluster_helpers import call, run_in_thread, settings_for, wait_for
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.bench.processes import WorkerProcess
from toolchord.orchestrator.event_stores import RedisEventLog
from toolchord.orchestrator.recorder import SessionRecorder
from toolchord.orchestrator.turn import TurnResult
from toolchord.orchestrator.ui import session_view
from toolchord.worker import Registry, tool
from toolchord.worker.celery_app import create_app
from toolchord.worker.limits import Limit, LimitContext, RedisLimiter, buckets_for
from toolchord.worker.observability.call_timeline import read_timings

TOOLS = "tests.limit_tools"
LANE = "toolchord:limit:tc-test-lane:holders:"
HOLD = "tc-test:lane:hold"


def lane_orchestrator(url: str, **kwargs: Any) -> Orchestrator:
    registry = Registry.from_modules([TOOLS])
    return Orchestrator(registry, create_app(settings_for(url), registry), **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_turns_of_one_orchestrator_count_against_their_own_tenants_buckets(
        redis_url: str, clean_redis: redis.Redis, start_worker: Callable[..., WorkerProcess]) -> None:
    start_worker(TOOLS, concurrency=4)
    orch = lane_orchestrator(redis_url, turn_timeout=50, tenant="default")
    clean_redis.set(HOLD, 1)
    turns = [run_in_thread(orch.run_calls, "s-acme", [call(0, "lane_call", n=0)], turn_id="t-acme", tenant="acme"),
             run_in_thread(orch.run_calls, "s-globex", [call(0, "lane_call", n=1)], turn_id="t-globex",
                           tenant="globex", priority="batch")]
    # A lane holds one call at a time: both run at once only because each tenant has its own.
    wait_for(lambda: clean_redis.scard("tc-test:lane:started") == 2, 30, "both tenants' calls running")
    assert clean_redis.zcard(LANE + "acme") == 1 and clean_redis.zcard(LANE + "globex") == 1
    assert not clean_redis.exists(LANE + "default")
    acme, globex = orch.turns.record("s-acme", "t-acme"), orch.turns.record("s-globex", "t-globex")
    assert acme is not None and globex is not None
    assert (acme.tenant, acme.priority) == ("acme", "interactive")
    assert (globex.tenant, globex.priority) == ("globex", "batch")
    clean_redis.delete(HOLD)
    for thread, box in turns:
        thread.join(60)
        assert [r.status for r in box["value"].results] == ["ok"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed-eager"])
def test_an_agent_s_turns_carry_its_tenant_to_the_limit_keys(stream: bool) -> None:
    from toolchord.orchestrator.agent import Agent
    from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn

    seen: list[str | None] = []

    def tenant_of(args: dict[str, Any], ctx: LimitContext) -> str | None:
        seen.append(ctx.tenant)
        return ctx.tenant

    limit = Limit(name="seen", concurrency=4, key=tenant_of)

    @tool(side_effect="read", limits=limit, sandbox={"isolate": False})
    def look(x: int) -> int:
        """Look."""
        return x

    script = [ScriptedTurn(text="", calls=[ScriptedCall(name="look", arguments={"x": 1})]), ScriptedTurn(text="Done.")]
    orch = Orchestrator(Registry([look]), tenant="default")
    with ScriptedModelServer(script, model="scripted") as model:
        agent = Agent(Registry([look]), model="scripted", base_url=model.base_url + "/v1", api_key="test",
                      orchestrator=orch, tenant="acme", stream=stream)
        assert agent.run("look").stop_reason == "final"
    assert seen == ["acme"]


@contextmanager
def one_holds_one_waits(redis_url: str, clean_redis: redis.Redis, session_id: str) -> Iterator[dict[str, Any]]:
    """A turn of two lane calls with one tenant: call_0 or call_1 holds the lane (until the block ends),
    the other waits in the broker. The turn's events are in the session's Redis log."""
    log = RedisEventLog(redis_url)
    recorder = SessionRecorder(log, session_id)
    calls = [call(0, "lane_call", n=0), call(1, "lane_call", n=1)]
    recorder.model_output("chat", "scripted", "t-1", output={}, items=[], calls=calls)
    recorder.dispatched("t-1", ["call_0", "call_1"])
    clean_redis.set(HOLD, 1)
    thread, box = run_in_thread(lane_orchestrator(redis_url, turn_timeout=50).run_calls, session_id, calls,
                                turn_id="t-1")
    wait_for(lambda: clean_redis.scard("tc-test:lane:started") == 1, 30, "one call holding the lane")
    try:
        yield {"log": log}
    finally:
        clean_redis.delete(HOLD)
        thread.join(60)
    turn: TurnResult = box["value"]
    for result in turn.results:
        recorder.result("t-1", result)
    assert [r.status for r in turn.results] == ["ok", "ok"]


def _bars(log: RedisEventLog, client: redis.Redis, session_id: str) -> dict[str, Any]:
    return {bar.phase: bar for bar in session_view(log, session_id, client).turns[0].calls}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_timeline_shows_a_call_waiting_for_its_limit_and_how_long_it_waited(
        redis_url: str, clean_redis: redis.Redis, start_worker: Callable[..., WorkerProcess]) -> None:
    start_worker(TOOLS, concurrency=4)
    with one_holds_one_waits(redis_url, clean_redis, "s-wait") as scene:
        log = scene["log"]
        wait_for(lambda: set(_bars(log, clean_redis, "s-wait")) == {"running", "waiting"}, 30,
                 "one bar running, one waiting")
        waiting = _bars(log, clean_redis, "s-wait")["waiting"]
        assert waiting.waiting_for == "tc-test-lane" and waiting.waiting_since is not None
        assert waiting.started_at is None and waiting.attempts == 0
        # Several looks at the limit later it still waits: a wait is no attempt, no retry.
        wait_for(lambda: time.time() - waiting.waiting_since > 1.0, 10, "a second of waiting")
        timing = read_timings(clean_redis, "s-wait")[("t-1", waiting.call_id)]
        assert (timing.phase, timing.attempts, timing.waiting_for) == ("waiting", 1, "tc-test-lane")
    bars = session_view(log, "s-wait", clean_redis).turns[0].calls
    waited = next(bar for bar in bars if bar.call_id == waiting.call_id)
    assert (waited.phase, waited.code, waited.attempts) == ("done", "ok", 1)
    assert waited.waiting_for == "tc-test-lane"
    assert waited.waiting_since is not None and waited.started_at is not None
    assert waited.started_at - waited.waiting_since > 1.0
    other = next(bar for bar in bars if bar.call_id != waiting.call_id)
    assert other.waiting_for is None and other.waiting_since is None


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_limit_gauges_are_read_from_redis_at_scrape_time(clean_redis: redis.Redis) -> None:
    from toolchord.worker.observability.metrics import LimitUsageCollector, registry

    limiter = RedisLimiter(clean_redis)
    lane = Limit(name="lane", concurrency=1)
    buckets = buckets_for([lane], {}, LimitContext(tool="t", session_id="s"))
    served = registry([LimitUsageCollector(limiter, ["lane", "idle"])])
    assert served.get_sample_value("toolchord_limit_in_use", {"limit": "lane"}) == 0
    assert limiter.acquire(buckets, "a", lease=30, wait_ttl=30).admitted
    assert not limiter.acquire(buckets, "b", lease=30, wait_ttl=30).admitted
    assert served.get_sample_value("toolchord_limit_in_use", {"limit": "lane"}) == 1
    assert served.get_sample_value("toolchord_limit_waiting", {"limit": "lane"}) == 1
    assert served.get_sample_value("toolchord_limit_waiting", {"limit": "idle"}) == 0
    limiter.release(buckets, "a")
    limiter.release(buckets, "b")
    assert served.get_sample_value("toolchord_limit_in_use", {"limit": "lane"}) == 0
    assert served.get_sample_value("toolchord_limit_waiting", {"limit": "lane"}) == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_s_metrics_show_permits_waits_and_refusals_per_limit(
        redis_url: str, clean_redis: redis.Redis, start_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    from tests.conftest import free_port

    port = free_port()
    (tmp_path / "prom").mkdir()
    start_worker(TOOLS, concurrency=4, TOOLCHORD_METRICS_PORT=str(port), PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"))
    url = f"http://127.0.0.1:{port}/metrics"
    lane = (("limit", "tc-test-lane"),)
    with one_holds_one_waits(redis_url, clean_redis, "s-metrics"):
        wait_for(lambda: _scrape(url).get(("toolchord_limit_refusals_total", lane), 0) >= 2, 30, "refusals counted")
        samples = _scrape(url)
        assert samples[("toolchord_limit_in_use", lane)] == 1
        assert samples[("toolchord_limit_waiting", lane)] == 1
        assert samples[("toolchord_limit_in_use", (("limit", "tc-test-pool"),))] == 0
        # Waiting is not retrying.
        assert samples.get(("toolchord_call_retries_total", (("side_effect", "read"), ("tool", "lane_call"))), 0) == 0
    wait_for(lambda: _scrape(url).get(("toolchord_limit_in_use", lane)) == 0, 30, "the permit given back")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_toolchord_limits_lists_the_declared_limits_and_their_use(
        redis_url: str, clean_redis: redis.Redis, start_worker: Callable[..., WorkerProcess]) -> None:
    from tests.conftest import ROOT

    start_worker(TOOLS, concurrency=4)

    def limits(*extra: str) -> str:
        env = {"PATH": "/usr/bin:/bin", "TOOLCHORD_BROKER_URL": redis_url, "TOOLCHORD_TOOL_MODULES": TOOLS}
        done = subprocess.run([sys.executable, "-m", "toolchord.orchestrator.cli", "limits", *extra], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    with one_holds_one_waits(redis_url, clean_redis, "s-cli"):
        wait_for(lambda: '"waiting": 1' in limits("--json"), 30, "the waiting call listed")
        rows = {row["limit"]: row for row in map(json.loads, limits("--json").splitlines())}
        assert rows["tc-test-lane"] == {"limit": "tc-test-lane", "in_use": 1, "concurrency": 1, "waiting": 1,
                                        "rate": None, "burst": 1, "per_key": True, "tools": ["lane_call"]}
        assert rows["tc-test-payments"]["rate"] == "20/s" and rows["tc-test-payments"]["in_use"] == 0
        text = limits()
        assert "tc-test-lane: in flight 1/1, waiting 1, rate -, per key; tools: lane_call" in text.splitlines()


def test_toolchord_limits_needs_redis(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from toolchord.orchestrator.cli import main

    for name in ("TOOLCHORD_BROKER_URL", "TOOLCHORD_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["limits", "--tools", TOOLS])
    assert exited.value.code == 2
    assert "TOOLCHORD_REDIS_URL" in capsys.readouterr().err


