"""Finished calls keep their real results through Redis restarts and worker pauses past their
timeout; resource chains stop after an unknown outcome; spilled outputs stay in their session.

Real private redis-server, real `toolchord worker` processes (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.cluster_helpers import TOOLS, call, effects, orchestrator, run_in_thread, wait_for
from toolchord.orchestrator.bench.processes import RedisServer, WorkerProcess
from toolchord.worker import ErrorCode

pytestmark = pytest.mark.slow


@pytest.fixture
def persistent_redis(redis_server: RedisServer, clean_redis: redis.Redis) -> Iterator[RedisServer]:
    """The session's Redis with its append-only file on (fsync per write): restarts lose nothing."""
    redis_server.stop()
    redis_server.start(appendonly=True)
    yield redis_server
    redis_server.stop()
    shutil.rmtree(redis_server.workdir / "appendonlydir", ignore_errors=True)
    redis_server.start()


def test_redis_restart_keeps_finished_results(start_worker, persistent_redis, redis_url):
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url, turn_timeout=25)
    client = redis.Redis.from_url(redis_url)
    calls = [call(0, "effect_unsafe", key="k-u", seconds=1), call(1, "effect_read", key="k-r", seconds=1)]
    thread, box = run_in_thread(orch.run_calls, "s-aof", calls)
    wait_for(lambda: effects(client, "k-u") == 1 and effects(client, "k-r") == 1, 20, "both handlers to start")
    # The handlers finish while Redis is down (1.5 s): their results must still be stored and reported.
    persistent_redis.stop()
    time.sleep(1.5)  # the fault itself: how long Redis stays away
    persistent_redis.start(appendonly=True)
    thread.join(60)
    assert not thread.is_alive(), "the turn hung after a Redis restart"
    turn = box["value"]
    assert [(r.status, r.content) for r in turn.results] == [("ok", "1"), ("ok", "1")], turn.results
    assert effects(client, "k-u") == 1 and effects(client, "k-r") == 1


def test_turn_waits_to_its_deadline_when_a_result_is_lost_to_an_outage(start_worker, persistent_redis, redis_url):
    # A worker that gives up storing at once: its result never reaches Redis, and the chord's
    # callback fails. The turn must not report the call early: it waits up to its deadline.
    start_worker(TOOLS, concurrency=1, TOOLCHORD_RESULT_STORE_PATIENCE="0")
    orch = orchestrator(redis_url, turn_timeout=12)
    client = redis.Redis.from_url(redis_url)
    thread, box = run_in_thread(orch.run_calls, "s-lost", [call(0, "effect_unsafe", key="k-l", seconds=1)])
    wait_for(lambda: effects(client, "k-l") == 1, 20, "the handler to start")
    persistent_redis.stop()
    time.sleep(1.5)  # the fault itself: how long Redis stays away
    persistent_redis.start(appendonly=True)
    thread.join(60)
    error = box["value"].results[0].error
    assert error is not None and error.code == ErrorCode.OUTCOME_UNKNOWN
    assert "the turn's 12 s deadline passed" in error.message, error.message


def _pool_children(worker: WorkerProcess) -> list[int]:
    assert worker.proc is not None
    pid = worker.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_worker_paused_past_the_tools_timeout_keeps_a_finished_unsafe_result(start_worker, redis_url, clean_redis):
    worker = start_worker(TOOLS, concurrency=1)
    (pool_child,) = _pool_children(worker)
    orch = orchestrator(redis_url, turn_timeout=40)
    thread, box = run_in_thread(orch.run_calls, "s-soft", [call(0, "brief_unsafe", key="k-soft", seconds=0.5)])
    wait_for(lambda: effects(clean_redis, "k-soft") == 1, 20, "the handler to start")
    paused_at = time.monotonic()
    # Pause the pool process (not its sandbox child, which finishes the call meanwhile) past the
    # tool's 2 s timeout and past where Celery's soft time limit used to be raised (5 s later):
    # the worker reads the finished result, and stores it, only after the call's deadline.
    os.kill(pool_child, signal.SIGSTOP)
    try:
        wait_for(lambda: time.monotonic() > paused_at + 2 + 5 + 0.5, 30, "the old soft limit to pass")
    finally:
        os.kill(pool_child, signal.SIGCONT)
    thread.join(60)
    turn = box["value"]
    assert (turn.results[0].status, turn.results[0].content) == ("ok", "1"), turn.results[0]
    key = orch.turns.record("s-soft", turn.turn_id).dispatched[0].key
    assert json.loads(orch.runtime.store.result(key) or "{}").get("content") == "1"
    assert effects(clean_redis, "k-soft") == 1
    # Call tasks carry no soft time limit that could land in the bookkeeping (tests/test_celery_limits.py).
    assert b"Soft time limit" not in worker.log.read_bytes()


def test_turn_deadline_timeout_says_who_stopped_waiting_and_result_arrives_late(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=1)
    orch = orchestrator(redis_url, turn_timeout=1.5)
    first = orch.run_calls("s-wait", [call(0, "effect_read", key="k-wait", seconds=3)])
    error = first.results[0].error
    assert error is not None and error.code == ErrorCode.TIMEOUT
    # Not "was stopped": the turn stopped waiting, at its own 1.5 s deadline; the call goes on.
    assert "turn's 1.5 s deadline" in error.message and "was stopped" not in error.message, error.message
    key = orch.turns.record("s-wait", first.turn_id).dispatched[0].key
    wait_for(lambda: orch.runtime.store.result(key) is not None, 30, "the real result to be stored")
    orch.turn_timeout = 10
    second = orch.run_calls("s-wait", [call(1, "echo", text="next")])
    assert [(r.call_id, r.status, r.content) for r in second.late_results] == [("call_0", "ok", "1")]


def test_chain_stops_after_an_unknown_outcome(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url)
    calls = [
        call(0, "chained_unsafe", resource="db", key="k-c1", seconds=5),
        call(1, "chained_unsafe", resource="db", key="k-c2"),
        call(2, "chained_unsafe", resource="other", key="k-c3"),
    ]
    first, second, other = orch.run_calls("s-chain", calls).results
    assert first.error is not None and first.error.code == ErrorCode.OUTCOME_UNKNOWN
    assert second.error is not None and second.error.code == ErrorCode.NOT_EXECUTED, second
    assert "call_0" in second.error.message and "unknown" in second.error.message
    assert effects(clean_redis, "k-c2") == 0
    # Another resource's chain is not affected.
    assert other.status == "ok" and effects(clean_redis, "k-c3") == 1


def test_spilled_output_is_readable_only_in_its_session(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url)
    cut = orch.run_calls("s-owner", [call(0, "long_text", word="w")]).results[0]
    assert cut.truncated is not None and cut.truncated.spill_ref is not None
    ref = cut.truncated.spill_ref
    assert re.search(rf'read_output\(ref="{ref}"', cut.content)
    mine = orch.run_calls("s-owner", [call(1, "read_output", ref=ref)]).results[0]
    assert mine.status == "ok" and "w499" in mine.content
    theirs = orch.run_calls("s-other", [call(0, "read_output", ref=ref)]).results[0]
    assert theirs.status == "error" and "w499" not in theirs.content
    assert "no stored output" in theirs.content


def test_turn_finishes_from_the_store_when_the_chord_callback_is_never_sent(start_worker, redis_url):
    # A worker SIGKILLed right after taking Celery's callback-dispatch claim (a Redis key that
    # outlives the broker's redelivery) leaves a complete chord that nobody sends the callback
    # of. Emulated here: another "worker" holds the claim before the calls finish.
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url, turn_timeout=60)
    client = redis.Redis.from_url(redis_url)
    calls = [call(0, "effect_read", key="k-cb-r", seconds=2), call(1, "effect_unsafe", key="k-cb-u", seconds=2)]
    started = time.monotonic()
    thread, box = run_in_thread(orch.run_calls, "s-lost-callback", calls)

    def chord_size_keys() -> list[bytes]:
        return list(client.scan_iter("celery-taskset-meta-*.s"))

    wait_for(lambda: bool(chord_size_keys()), 20, "the chord to be registered")
    claim = chord_size_keys()[0][: -len(b".s")] + b".c"
    client.set(claim, "a-worker-that-died", ex=600)
    thread.join(50)
    assert not thread.is_alive(), "the turn waited for a callback that never comes"
    elapsed = time.monotonic() - started
    turn = box["value"]
    assert [(r.status, r.content) for r in turn.results] == [("ok", "1"), ("ok", "1")], turn.results
    # Found in the store within a poll or two of the calls' end, not at the 60 s deadline.
    assert elapsed < 30, elapsed
    assert effects(client, "k-cb-r") == 1 and effects(client, "k-cb-u") == 1
