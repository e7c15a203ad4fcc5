"""Turns on real prefork worker processes, Redis for results, with each broker: Redis and RabbitMQ (issue 3)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.cluster_helpers import TOOLS, call, orchestrator, wait_for
from toolchord.worker import ErrorCode

# Loaded 2-core machine: up to about 18 s with the workers' teardown.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60),
              pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)]


def test_parallel_calls_return_in_model_order(start_worker, redis_url, broker_url):
    start_worker(TOOLS, concurrency=4)
    orch = orchestrator(redis_url, broker_url)
    # The first call is the slowest, so completion order is the reverse of model order.
    calls = [call(i, "slow", seconds=0.3 - 0.1 * i) for i in range(3)] + [call(3, "nope"), call(4, "echo", text=1)]
    turn = orch.run_calls("s-order", calls)
    assert [r.call_id for r in turn.results] == [c.id for c in calls]
    assert [r.status for r in turn.results[:3]] == ["ok"] * 3
    assert turn.results[3].error.code == ErrorCode.UNKNOWN_TOOL
    assert turn.results[4].error.code == ErrorCode.INVALID_ARGUMENTS


def test_slow_call_hits_time_limit_and_others_return(start_worker, redis_url, broker_url):
    start_worker(TOOLS, concurrency=4)
    orch = orchestrator(redis_url, broker_url)
    start = time.monotonic()
    turn = orch.run_calls("s-timeout", [call(0, "slow", seconds=30), call(1, "echo", text="hi")])
    elapsed = time.monotonic() - start
    assert turn.results[0].error.code == ErrorCode.TIMEOUT
    assert turn.results[0].attempts == 2  # a read tool is retried once after a timeout
    assert turn.results[1].content == "hi"
    # Two 1 s attempts, not the 30 s the handler asked for (the rest is room for a loaded machine).
    assert elapsed < 20


def test_transient_error_retried_for_read_not_for_unsafe(start_worker, redis_url, broker_url, clean_redis):
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url, broker_url)
    turn = orch.run_calls(
        "s-retry", [call(0, "flaky_read", key="r", failures=2), call(1, "flaky_unsafe", key="u", failures=2)]
    )
    read, unsafe = turn.results
    assert read.status == "ok" and read.content == "3" and read.attempts == 3, read.content
    assert unsafe.error.code == ErrorCode.EXECUTION_ERROR and unsafe.attempts == 1
    assert int(clean_redis.get("tc-test:attempts:u")) == 1


def test_calls_sharing_a_resource_run_serially(start_worker, redis_url, broker_url, clean_redis):
    start_worker(TOOLS, concurrency=4)
    orch = orchestrator(redis_url, broker_url)
    calls = [call(i, "serial_step", resource="file-a", label=str(i)) for i in range(3)]
    calls.append(call(3, "serial_step", resource="file-b", label="b"))
    turn = orch.run_calls("s-serial", calls)
    assert [r.content for r in turn.results] == ["0", "1", "2", "b"]
    steps = [s.decode() for s in clean_redis.lrange("tc-test:steps:file-a", 0, -1)]
    assert steps == ["start:0", "end:0", "start:1", "end:1", "start:2", "end:2"]


def test_call_results_are_stored_once_by_key_not_per_task(start_worker, redis_url, broker_url, clean_redis):
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url, broker_url)
    # A resource chain and a lone call: both shapes of header element reach the callback.
    calls = [call(0, "serial_step", resource="f", label="a"), call(1, "serial_step", resource="f", label="b"),
             call(2, "echo", text="c")]
    turn = orch.run_calls("s-store-once", calls)
    assert [r.content for r in turn.results] == ["a", "b", "c"]
    record = orch.turns.record("s-store-once", turn.turn_id)
    call_task_ids = {dc.task_id for dc in record.dispatched}
    # The call tasks keep no result in the backend (ignore_result): the chord and the
    # idempotency store have it; only the callback's result is there for the orchestrator.
    assert not any(clean_redis.exists(f"celery-task-meta-{task_id}") for task_id in call_task_ids)
    assert [raw is not None for raw in orch.runtime.store.results([dc.key for dc in record.dispatched])] == [True] * 3
    # Nor does the orchestrator stay subscribed to result channels that will never carry anything.
    wait_for(lambda: not clean_redis.pubsub_channels("celery-task-meta-tc-*"), 5, "result channels to be released")


@pytest.mark.parametrize("size", [1, 64])
def test_chord_of_one_and_of_64(start_worker, redis_url, broker_url, size):
    start_worker(TOOLS, concurrency=4)
    orch = orchestrator(redis_url, broker_url)
    calls = [call(i, "echo", text=f"t{i}") for i in range(size)]
    turn = orch.run_calls(f"s-size-{size}", calls)
    assert [r.content for r in turn.results] == [f"t{i}" for i in range(size)]


def test_two_queues_two_workers(start_worker, redis_url, broker_url):
    first = start_worker(TOOLS, queues="toolchord", name="wa", TC_TEST_WORKER="wa")
    start_worker(TOOLS, queues="b", name="wb", TC_TEST_WORKER="wb")
    orch = orchestrator(redis_url, broker_url)
    turn = orch.run_calls("s-queues", [call(0, "where", x=1), call(1, "echo", text="default")])
    assert turn.results[0].content == "wb:1"
    assert turn.results[1].content == "default"
    # Each worker says at start which sandbox layers are active.
    assert "sandbox layers: rlimits=" in first.log.read_text()


def test_turn_deadline_never_hangs(start_worker, redis_url, broker_url):
    start_worker(TOOLS, concurrency=1)
    # The first call must start before the deadline (3 s leave room for a loaded machine) and
    # outlast it; one pool process: the second call cannot start before the deadline.
    orch = orchestrator(redis_url, broker_url, turn_timeout=3)
    turn = orch.run_calls("s-deadline", [call(0, "effect_read", key="d0", seconds=5), call(1, "echo", text="x")])
    codes = [r.error.code if r.error else None for r in turn.results]
    assert codes == [ErrorCode.TIMEOUT, ErrorCode.NOT_EXECUTED]


def test_async_turns_share_one_loop(start_worker, redis_url, broker_url):
    start_worker(TOOLS, concurrency=4)
    orch = orchestrator(redis_url, broker_url)

    async def many() -> list:
        return await asyncio.gather(
            *(orch.arun_calls(f"s-async-{i}", [call(0, "echo", text=str(i))]) for i in range(20))
        )

    turns = asyncio.run(many())
    assert [t.results[0].content for t in turns] == [str(i) for i in range(20)]


def test_in_process_tool_stopped_at_its_timeout_is_a_timeout(start_worker, redis_url, broker_url):
    # A tool that runs in the worker process is stopped by its own timer (worker/handler_deadline.py):
    # the model is told TIMEOUT, on every broker.
    start_worker(TOOLS, concurrency=1)
    orch = orchestrator(redis_url, broker_url)
    result, = orch.run_calls("s-inproc-timeout", [call(0, "nap_inproc", seconds=20)]).results
    assert result.error is not None and result.error.code == ErrorCode.TIMEOUT, result
    assert "1 s" in result.error.message
