"""Fault injection with real Redis and real workers killed with SIGKILL (issue 4).

Each test adds a row to the fault summary printed at the end of the run: calls, side effects
observed, results returned, lost (calls without exactly one result) — lost must be 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.cluster_helpers import (
    TOOLS,
    call,
    effects,
    orchestrator,
    run_in_thread,
    settings_for,
    wait_for,
)
from tests.conftest import FAULT_ROW, ROOT, worker_env
from toolchord.orchestrator.turn import TurnResult
from toolchord.worker import ErrorCode, Registry
from toolchord.worker.celery_app import create_app
from toolchord.worker.payloads import CallPayload
from toolchord.worker.tasks import TASK_NAMES

# Loaded 2-core machine: up to about 20 s (a redelivery after the 8 s visibility timeout).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

# Rows of the fault summary, handed to the test's report (tests/conftest.py prints them at the end
# of the run, also from pytest-xdist workers).
ROWS: list[tuple[str, int, int, int, int]] = []


@pytest.fixture(autouse=True)
def _report_rows(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    request.node.user_properties.extend((FAULT_ROW, row) for row in ROWS)
    ROWS.clear()


def record(name: str, turn: TurnResult, side_effects: int) -> None:
    ids = [c.id for c in turn.calls]
    result_ids = [r.call_id for r in turn.results]
    lost = sum(1 for i in ids if result_ids.count(i) != 1)
    ROWS.append((name, len(ids), side_effects, len(turn.results), lost))
    assert lost == 0


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_worker_sigkilled_mid_call_for_each_side_effect_class(start_worker, redis_url, broker_url, clean_redis):
    first = start_worker(TOOLS, concurrency=3, name="victim")
    orch = orchestrator(redis_url, broker_url)
    calls = [call(0, "effect_read", key="k-read", seconds=3), call(1, "effect_idempotent", key="k-idem", seconds=3),
             call(2, "effect_unsafe", key="k-unsafe", seconds=3)]
    thread, box = run_in_thread(orch.run_calls, "s-kill", calls)
    wait_for(lambda: all(effects(clean_redis, k) == 1 for k in ("k-read", "k-idem", "k-unsafe")), 20, "handlers to start")
    first.kill()
    start_worker(TOOLS, concurrency=3, name="rescuer")
    thread.join(90)
    turn: TurnResult = box["value"]
    read, idem, unsafe = turn.results
    # read and idempotent calls are redelivered and re-run to completion.
    assert read.status == "ok" and effects(clean_redis, "k-read") == 2
    assert idem.status == "ok" and effects(clean_redis, "k-idem") == 2
    # The unsafe call ran exactly once and the model is told the truth.
    assert unsafe.error is not None and unsafe.error.code == ErrorCode.OUTCOME_UNKNOWN
    assert effects(clean_redis, "k-unsafe") == 1
    broker = "RabbitMQ" if broker_url.startswith("amqp") else "Redis"
    record(f"worker SIGKILL mid-call (3 classes), {broker}", turn,
           sum(effects(clean_redis, k) for k in ("k-read", "k-idem", "k-unsafe")))


@pytest.mark.parametrize("broker_url", ["amqp"], indirect=True)
def test_rabbitmq_restarted_mid_turn(start_worker, redis_url, broker_url, rabbitmq, clean_redis):
    start_worker(TOOLS, concurrency=3)
    orch = orchestrator(redis_url, broker_url)
    keys = ("q-read", "q-idem", "q-unsafe")
    calls = [call(0, "effect_read", key=keys[0], seconds=2), call(1, "effect_idempotent", key=keys[1], seconds=2),
             call(2, "effect_unsafe", key=keys[2], seconds=2), call(3, "echo", text="queued")]
    thread, box = run_in_thread(orch.run_calls, "s-rabbit", calls)
    wait_for(lambda: all(effects(clean_redis, k) == 1 for k in keys), 30, "handlers to start")
    # Every connection drops while three calls run and one waits in the queue: their messages are
    # unacknowledged, so RabbitMQ delivers them again once the worker reconnects.
    rabbitmq.restart_app()
    thread.join(90)
    assert not thread.is_alive(), "the turn hung after a RabbitMQ restart"
    turn: TurnResult = box["value"]
    assert [r.status for r in turn.results] == ["ok"] * 4, [r.error for r in turn.results]
    assert turn.results[3].content == "queued"
    # A redelivered call whose result is stored returns that result: nothing ran twice.
    assert [effects(clean_redis, k) for k in keys] == [1, 1, 1]
    # The same orchestrator publishes again on a fresh connection.
    after = orch.run_calls("s-rabbit-after", [call(0, "effect_unsafe", key="q-after")])
    assert after.results[0].status == "ok" and effects(clean_redis, "q-after") == 1
    record("RabbitMQ restarted mid-turn (stop_app/start_app)", turn, sum(effects(clean_redis, k) for k in keys))


def test_same_task_delivered_twice_concurrently(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=4)
    app = create_app(settings_for(redis_url), Registry.from_modules([TOOLS]))
    outcomes = []
    for side_effect in ("read", "idempotent", "unsafe"):
        key = f"dup-{side_effect}"
        payload = CallPayload(
            call=call(0, f"effect_{side_effect}", key=key, seconds=0.5), arguments={"key": key, "seconds": 0.5},
            key=f"idem-{key}", session_id="s-dup", turn_id="t-dup", deadline=time.time() + 60,
        ).model_dump(mode="json")
        # Two deliveries of one call (as a redelivering broker would), in flight together. Call
        # tasks keep no result of their own in the backend (the chord gets it): ask for one here.
        pair = [app.signature(TASK_NAMES[side_effect], kwargs={"payload": payload}).apply_async(ignore_result=False)
                for _ in range(2)]
        # Not inside a task: an embedded worker started earlier in this process sets Celery's
        # "inside a worker" flag, which would refuse a plain get().
        results = [r.get(timeout=30, disable_sync_subtasks=False) for r in pair]
        assert results[0] == results[1]
        assert effects(clean_redis, key) == 1
        outcomes.append(results[0][0])
    # Three calls, each delivered twice: six deliveries, three side effects, one result per call.
    assert [o["status"] for o in outcomes] == ["ok"] * 3
    ROWS.append(("same task delivered twice concurrently (x3)", 3,
                 sum(effects(clean_redis, f"dup-{s}") for s in ("read", "idempotent", "unsafe")), 3, 0))


def test_redis_restarted_between_dispatch_and_collect(start_worker, redis_server, redis_url, clean_redis, tmp_path):
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url, turn_timeout=12)
    ledger = tmp_path / "ledger"
    thread, box = run_in_thread(orch.run_calls, "s-redis", [call(0, "effect_unsafe", key="k-r", seconds=2)])
    wait_for(lambda: effects(clean_redis, "k-r") == 1, 20, "the handler to start")
    ledger.write_text("1")
    redis_server.stop()
    time.sleep(0.5)
    redis_server.start()
    thread.join(60)
    assert not thread.is_alive(), "the turn hung after a Redis restart"
    turn = box.get("value")
    assert turn is not None, "run_calls raised instead of returning"
    result = turn.results[0]
    # Redis lost everything (no persistence): the result is the handler's if it was stored after the
    # restart, otherwise the truth for an unsafe call is OUTCOME_UNKNOWN — never a second run.
    assert result.status == "ok" or result.error.code in (ErrorCode.OUTCOME_UNKNOWN, ErrorCode.NOT_EXECUTED)
    assert effects(clean_redis, "k-r") == 0  # the ledger was in the restarted Redis: no run after it
    record("Redis restarted between dispatch and collect", turn, int(ledger.read_text()))


@pytest.mark.timeout(120)
def test_worker_with_a_call_in_flight_and_a_free_slot_survives_a_redis_restart(start_worker, redis_server, redis_url,
                                                                               clean_redis):
    # kombu 5.7.0 restored the unacked message through a released connection when the channel
    # closed and the worker exited with "Unrecoverable error" (issue 25 item 5).
    worker = start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url, turn_timeout=40)
    thread, box = run_in_thread(orch.run_calls, "s-restart", [call(0, "effect_read", key="k-flight", seconds=4)])
    wait_for(lambda: effects(clean_redis, "k-flight") == 1, 20, "the handler to start")
    redis_server.stop()
    time.sleep(1.5)  # the outage itself: the broker is down this long
    redis_server.start()
    thread.join(90)
    assert not thread.is_alive(), "the turn hung after a Redis restart"
    assert worker.proc is not None and worker.proc.poll() is None, "the worker exited after a Redis restart"
    turn: TurnResult = box["value"]
    assert turn.results[0].status == "ok", turn.results[0].error
    after = orch.run_calls("s-restart-after", [call(0, "effect_unsafe", key="k-after-restart")])
    assert after.results[0].status == "ok", after.results[0].error
    assert effects(clean_redis, "k-after-restart") == 1
    assert worker.proc.poll() is None


ORCHESTRATOR_SCRIPT = """
import json, sys
from tests.cluster_helpers import orchestrator, call
orch = orchestrator(sys.argv[1])
orch.run_calls("s-resume", [call(0, "effect_unsafe", key="k-o1", seconds=3), call(1, "effect_read", key="k-o2", seconds=3)])
"""


def test_orchestrator_killed_mid_turn_and_resumed(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=2)
    env = worker_env(redis_url, TOOLS)
    proc = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR_SCRIPT, redis_url], cwd=ROOT, env=env)
    wait_for(lambda: effects(clean_redis, "k-o1") == 1 and effects(clean_redis, "k-o2") == 1, 30, "calls to start")
    proc.kill()
    proc.wait()
    orch = orchestrator(redis_url)
    turn = orch.resume("s-resume")
    assert turn is not None
    assert [r.status for r in turn.results] == ["ok", "ok"]
    assert effects(clean_redis, "k-o1") == 1 and effects(clean_redis, "k-o2") == 1
    # Resuming again returns the finished turn without running anything.
    assert orch.resume("s-resume") is None
    assert orch.run_calls("s-resume", turn.calls, turn_id=turn.turn_id).results == turn.results
    record("orchestrator SIGKILL mid-turn, then resume", turn,
           effects(clean_redis, "k-o1") + effects(clean_redis, "k-o2"))


def test_late_result_reported_in_next_turn(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=2)
    # The call must start before the deadline (TIMEOUT, not NOT_EXECUTED): 3 s leave room for a loaded machine.
    orch = orchestrator(redis_url, turn_timeout=3.0)
    first = orch.run_calls("s-late", [call(0, "effect_read", key="k-late", seconds=4)])
    assert first.results[0].error.code == ErrorCode.TIMEOUT
    key = orch.turns.record("s-late", first.turn_id).dispatched[0].key
    wait_for(lambda: orch.runtime.store.result(key) is not None, 30, "the late result to be stored")
    orch.turn_timeout = 10
    second = orch.run_calls("s-late", [call(1, "echo", text="next")])
    assert [r.call_id for r in second.late_results] == ["call_0"]
    assert second.late_results[0].status == "ok" and second.late_results[0].content == "1"
    assert "call_0" in (second.late_results_text() or "")
    # Reported once only.
    third = orch.run_calls("s-late", [call(2, "echo", text="again")])
    assert third.late_results == []
    record("turn deadline passed, result arrived late", first, effects(clean_redis, "k-late"))


def test_stalled_worker_unsafe_call_reported_unknown_then_its_real_result(start_worker, redis_url, clean_redis):
    stalled = start_worker(TOOLS, concurrency=1, name="stalled")
    orch = orchestrator(redis_url)
    thread, box = run_in_thread(orch.run_calls, "s-stall", [call(0, "effect_unsafe", key="k-stall", seconds=1)])
    wait_for(lambda: effects(clean_redis, "k-stall") == 1, 20, "the handler to start")
    # Freeze the whole worker (not its sandbox child, which finishes the call meanwhile): its lease
    # lapses and, after the visibility timeout, another worker gets the message again.
    os.killpg(stalled.proc.pid, signal.SIGSTOP)
    try:
        start_worker(TOOLS, concurrency=1, name="other")
        thread.join(60)
        turn: TurnResult = box["value"]
        # The redelivery sees a start and no live claim: the outcome is unknown, the call is not re-run.
        assert turn.results[0].error.code == ErrorCode.OUTCOME_UNKNOWN
        assert effects(clean_redis, "k-stall") == 1
    finally:
        os.killpg(stalled.proc.pid, signal.SIGCONT)
    # The stalled worker wakes up with the real result: it replaces the stand-in, and the session's
    # next turn reports it as a late result, once.
    key = orch.turns.record("s-stall", turn.turn_id).dispatched[0].key
    wait_for(lambda: json.loads(orch.runtime.store.result(key) or "{}").get("status") == "ok", 30,
             "the real result to be stored")
    second = orch.run_calls("s-stall", [call(1, "echo", text="next")])
    assert [(r.call_id, r.status, r.content) for r in second.late_results] == [("call_0", "ok", "1")]
    assert orch.run_calls("s-stall", [call(2, "echo", text="again")]).late_results == []
    assert effects(clean_redis, "k-stall") == 1
    record("worker stalled (SIGSTOP) mid-call, unsafe", turn, effects(clean_redis, "k-stall"))


def test_business_key_dedupes_across_turns(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=2)
    orch = orchestrator(redis_url)
    one = orch.run_calls("s-biz", [call(0, "charge", order_id="o-1", cents=500)])
    two = orch.run_calls("s-biz", [call(1, "charge", order_id="o-1", cents=500)])
    assert one.results[0].content == two.results[0].content == "charged 500 for o-1 (charge #1)"
    assert two.results[0].call_id == "call_1"
    assert int(clean_redis.get("tc-test:charges:o-1")) == 1
    record("same business action re-issued in a later turn", two, 1)
