"""Fleet-wide limits with real workers (docs/flow-control.md): concurrency, rate, a worker killed
while it holds permits, waiting in the broker rather than in a pool process, on both brokers."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.cluster_helpers import call, run_in_thread, settings_for, wait_for
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.bench.processes import WorkerProcess
from toolchord.worker import Registry, ToolResult
from toolchord.worker.celery_app import create_app
from toolchord.worker.limits import Limit, LimitContext, MemoryLimiter, RedisLimiter, buckets_for, parse_rate

TOOLS = "tests.limit_tools"
def orchestrator(url: str, broker: str, turn_timeout: float) -> Orchestrator:
    registry = Registry.from_modules([TOOLS])
    return Orchestrator(registry, create_app(settings_for(url, broker), registry), turn_timeout=turn_timeout)


BROKERS = pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)


def test_rates_parse_and_a_limit_needs_a_bound() -> None:
    assert parse_rate("100/s") == (100, 1.0)
    assert parse_rate("5000/h") == (5000, 3600.0)
    assert parse_rate("10/2m") == (10, 120.0)
    with pytest.raises(ValueError):
        parse_rate("fast")
    with pytest.raises(ValueError, match="concurrency=, rate="):
        Limit(name="nothing")


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_limiter_admits_all_or_nothing_and_purges_expired_holders(kind: str, clean_redis: redis.Redis) -> None:
    limiter = RedisLimiter(clean_redis) if kind == "redis" else MemoryLimiter()
    db = Limit(name="db", concurrency=2, key=lambda args, ctx: ctx.tenant)
    api = Limit(name="api", rate="1/h", burst=1)
    ctx = LimitContext(tool="t", session_id="s", tenant="acme")
    both = buckets_for([db, api], {}, ctx)
    assert limiter.acquire(both, "a", lease=0.3, wait_ttl=5).admitted
    # The rate refuses b, and nothing of b is taken: db still has one permit free.
    refused = limiter.acquire(both, "b", lease=0.3, wait_ttl=5)
    assert not refused.admitted and refused.limit == "api" and refused.retry_after is not None
    assert limiter.usage(["db", "api"])[0].in_use == 1
    only_db = buckets_for([db], {}, ctx)
    assert limiter.acquire(only_db, "c", lease=0.3, wait_ttl=5).admitted
    full = limiter.acquire(only_db, "d", lease=0.3, wait_ttl=5)
    assert not full.admitted and full.limit == "db" and full.retry_after is None
    assert limiter.usage(["db"])[0].waiting == 1
    # Another tenant has its own bucket; a holder asking again is not counted twice.
    other = buckets_for([db], {}, ctx.model_copy(update={"tenant": "other"}))
    assert limiter.acquire(other, "d", lease=0.3, wait_ttl=5).admitted
    assert limiter.acquire(only_db, "a", lease=0.3, wait_ttl=5).admitted
    # Leases that are not renewed run out: the permits come back without a release.
    time.sleep(0.35)
    assert limiter.acquire(only_db, "d", lease=0.3, wait_ttl=5).admitted
    limiter.release(only_db, "d")
    assert limiter.usage(["db"])[0] == ("db", 0, 0)


def _turns(url: str, broker: str, tool: str, count: int, per_turn: int, **args: object) -> list[ToolResult]:
    orch = orchestrator(url, broker, turn_timeout=55)
    threads = []
    for t in range(count // per_turn):
        calls = [call(i, tool, n=t * per_turn + i, **args) for i in range(per_turn)]
        threads.append(run_in_thread(orch.run_calls, f"s{t}", calls))
    results: list[ToolResult] = []
    for thread, box in threads:
        thread.join(60)
        results.extend(box["value"].results)
    return results


@BROKERS
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_200_calls_never_run_more_than_5_at_once(
        redis_url: str, broker_url: str, clean_redis: redis.Redis, start_worker: Callable[..., WorkerProcess]) -> None:
    start_worker(TOOLS, concurrency=4, name="a")
    start_worker(TOOLS, concurrency=4, name="b")
    results = _turns(redis_url, broker_url, "pool_call", 200, 50, seconds=0.05)
    assert [r.status for r in results] == ["ok"] * 200
    assert int(clean_redis.get("tc-test:pool:done") or 0) == 200
    assert int(clean_redis.get("tc-test:pool:max") or 0) == 5
    # Every permit was given back, and no call is counted as waiting.
    assert clean_redis.zcard("toolchord:limit:tc-test-pool:holders:_") == 0


@BROKERS
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rate_of_20_per_second_holds_in_every_one_second_window(
        redis_url: str, broker_url: str, clean_redis: redis.Redis, start_worker: Callable[..., WorkerProcess]) -> None:
    start_worker(TOOLS, concurrency=4)
    results = _turns(redis_url, broker_url, "pay", 200, 50)
    assert [r.status for r in results] == ["ok"] * 200
    starts = sorted(float(t) for t in clean_redis.lrange("tc-test:payments:starts", 0, -1))
    assert len(starts) == 200
    busiest = max(sum(1 for t in starts[i:] if t < start + 1.0) for i, start in enumerate(starts))
    # The limiter admits at most 25 calls in any second; the handlers record when they start, a
    # fork and a sandbox later, so two admissions 50 ms apart may start closer: two starts of slack.
    # Without the limit, 4 processes start about 80 calls a second here.
    assert busiest <= 20 + 5 + 2
    # 200 calls at 20/s after a burst of 5 take most of 10 s: the limit did hold them back.
    assert starts[-1] - starts[0] > 8.5


@BROKERS
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_permits_of_a_killed_worker_come_back_within_the_lease_and_no_call_is_lost(
        redis_url: str, broker_url: str, clean_redis: redis.Redis, start_worker: Callable[..., WorkerProcess]) -> None:
    doomed = start_worker(TOOLS, concurrency=5, name="doomed")
    orch = orchestrator(redis_url, broker_url, turn_timeout=50)
    clean_redis.set("tc-test:pool:hold", 1)
    thread, box = run_in_thread(orch.run_calls, "s", [call(i, "pool_call", n=i, seconds=40, hold=True) for i in range(5)])
    holders = "toolchord:limit:tc-test-pool:holders:_"
    wait_for(lambda: clean_redis.zcard(holders) == 5 and int(clean_redis.get("tc-test:pool:inflight") or 0) == 5,
             30, "five calls holding the pool's permits")
    # Renewed while the calls run: still held after several leases (the tests' lease is 2 s).
    time.sleep(5)
    assert clean_redis.zcount(holders, time.time() * 1000, "+inf") == 5
    doomed.kill()
    killed_at = time.time()
    # Within the lease (2 s) and one renewal period, every permit has expired.
    wait_for(lambda: clean_redis.zcount(holders, time.time() * 1000, "+inf") == 0, 4, "the permits to expire")
    assert time.time() - killed_at < 2 + 1.5
    clean_redis.set("tc-test:pool:inflight", 0)
    clean_redis.delete("tc-test:pool:hold")
    start_worker(TOOLS, concurrency=5, name="rescuer")
    # Redelivered, admitted again under the same permits (a holder is its call's key: never
    # counted twice) and run again (read calls may), so no call is lost.
    thread.join(60)
    results = box["value"].results
    assert [r.status for r in results] == ["ok"] * 5, [r.error for r in results]
    assert int(clean_redis.get("tc-test:pool:max") or 0) <= 5
    assert clean_redis.zcard(holders) == 0


def test_the_worked_example_in_the_docs_runs_as_written() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "flow-control.md").read_text()
    code = text.split("## Worked example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/flow-control.md", "exec"), {"__name__": "flow_control_example"})


def test_a_call_that_cannot_start_before_the_deadline_is_not_executed_naming_the_limit() -> None:
    from toolchord import tool

    @tool(side_effect="unsafe", rate="1/h", sandbox={"isolate": False})
    def send(n: int) -> int:
        """Send once an hour."""
        return n

    orch = Orchestrator(Registry([send]), turn_timeout=3)
    turn = orch.run_calls("s", [call(0, "send", n=0), call(1, "send", n=1)])
    statuses = sorted((r.status, r.error.code.value if r.error else "") for r in turn.results)
    assert statuses == [("error", "NOT_EXECUTED"), ("ok", "")]
    refused = next(r for r in turn.results if r.error)
    assert "limit 'send'" in refused.error.message and "waited" in refused.error.message
