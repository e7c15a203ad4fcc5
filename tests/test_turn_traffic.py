"""A turn's broker traffic grows linearly with its calls, and a turn runs at most a capped number.

Each task message carries its own call only: the messages of a 48-call turn are no larger than
those of a 3-call turn (measured on the real Redis broker queue before a worker takes them).
"""

from __future__ import annotations

import pytest
import redis

from tests.cluster_helpers import TOOLS, call, orchestrator, run_in_thread, settings_for, wait_for
from toolchord.orchestrator import Orchestrator
from toolchord.worker import ErrorCode, Registry
from toolchord.worker.celery_app import create_app

pytestmark = pytest.mark.slow

QUEUE = "toolchord"
# The Redis transport keeps one list per priority step (kombu's separator between name and step).
QUEUE_LISTS = [QUEUE, *(f"{QUEUE}\x06\x16{step}" for step in range(1, 10))]


def _queued_message_sizes(client: redis.Redis, count: int) -> list[int]:
    """Sizes in bytes of the `count` task messages waiting in the broker queue (no worker runs yet)."""
    wait_for(lambda: sum(client.llen(q) for q in QUEUE_LISTS) >= count, 30, f"{count} task messages in the queue")
    return [len(message) for q in QUEUE_LISTS for message in client.lrange(q, 0, -1)]


def _run_queued_turn(orch: Orchestrator, client: redis.Redis, session: str, n: int, start_worker) -> tuple[list[int], object]:
    calls = [call(i, "echo", text=f"t{i % 10}") for i in range(n)]
    thread, box = run_in_thread(orch.run_calls, session, calls)
    sizes = _queued_message_sizes(client, n)
    assert len(sizes) == n, "only the call tasks are queued before a worker runs them"
    worker = start_worker(TOOLS, concurrency=2, name=session)
    thread.join(120)
    worker.stop()
    turn = box["value"]
    assert [r.content for r in turn.results] == [f"t{i % 10}" for i in range(n)]
    return sizes, turn


def test_task_messages_do_not_grow_with_the_number_of_calls(start_worker, redis_url, clean_redis):
    orch = orchestrator(redis_url, turn_timeout=120)
    small, _ = _run_queued_turn(orch, clean_redis, "s-small", 3, start_worker)
    clean_redis.delete(*QUEUE_LISTS)
    large, _ = _run_queued_turn(orch, clean_redis, "s-large", 48, start_worker)
    # Ids and task ids differ by a few characters between turns; the call list would add ~4 KB.
    assert max(large) <= max(small) + 64, (max(small), max(large))


def test_calls_over_the_per_turn_cap_get_an_error_each_and_the_rest_run(start_worker, redis_url):
    start_worker(TOOLS, concurrency=2)
    registry = Registry.from_modules([TOOLS])
    settings = settings_for(redis_url).model_copy(update={"max_calls_per_turn": 3})
    orch = Orchestrator(registry, create_app(settings, registry))
    # Model order is the calls' index, not list order: the cap keeps the first three the model made.
    calls = [call(i, "echo", text=str(i)) for i in range(5)][::-1]
    turn = orch.run_calls("s-cap", calls)
    assert [r.call_id for r in turn.results] == [f"call_{i}" for i in range(5)]
    assert [r.content for r in turn.results[:3]] == ["0", "1", "2"]
    for result in turn.results[3:]:
        assert result.error is not None and result.error.code == ErrorCode.NOT_EXECUTED
        assert "at most 3 calls" in result.content and "TOOLCHORD_MAX_CALLS_PER_TURN" in result.content
    record = orch.turns.record("s-cap", turn.turn_id)
    assert [dc.call.id for dc in record.dispatched] == ["call_0", "call_1", "call_2"]


def test_a_turn_subscribes_to_its_callback_s_result_only(start_worker, redis_url, clean_redis):
    # Call tasks keep no result of their own on a Redis backend, so listening for one is two wasted
    # commands per call (SUBSCRIBE, then UNSUBSCRIBE); only the turn's callback is listened for.
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url)
    assert orch.run_calls("s-warm", [call(0, "echo", text="w")]).results[0].content == "w"
    clean_redis.config_resetstat()
    turn = orch.run_calls("s-subscriptions", [call(i, "echo", text=str(i)) for i in range(6)])
    assert [r.content for r in turn.results] == [str(i) for i in range(6)]
    stats = clean_redis.info("commandstats")
    assert stats.get("cmdstat_subscribe", {}).get("calls", 0) == 1, stats.get("cmdstat_subscribe")
    assert stats.get("cmdstat_unsubscribe", {}).get("calls", 0) <= 1, stats.get("cmdstat_unsubscribe")
