"""A call reported NOT_EXECUTED never runs afterwards, and outages of Redis or RabbitMQ before a
call starts end in its result or a documented answer (issue 25, items 1 and 9); a worker killed
the moment a broker hands it a call loses the message on Redis (truthfully NOT_EXECUTED), not on
RabbitMQ.

Real private redis-server, real `toolchord worker` processes (tests/conftest.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import termios
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from celery import Celery

from tests.cluster_helpers import (
    TOOLS,
    call,
    effects,
    orchestrator,
    run_in_thread,
    send_call,
    settings_for,
    task_meta,
    wait_for,
)
from tests.tcp_forwarder import Forwarder
from toolchord.orchestrator.bench.processes import WorkerProcess, free_port
from toolchord.worker import ErrorCode, Registry
from toolchord.worker.celery_app import create_app
from toolchord.worker.idempotency import RedisIdempotencyStore
from toolchord.worker.payloads import cancel_scope
from toolchord.worker.store_errors import StoreUnavailable

pytestmark = pytest.mark.slow


def _succeeded(workers: list[WorkerProcess], task_id: str) -> int:
    """How many deliveries of a task the workers have finished (Celery logs each at INFO)."""
    needle = f"[{task_id}] succeeded".encode()
    return sum(w.log.read_bytes().count(needle) for w in workers if Path(w.log).exists())


@pytest.mark.timeout(240)
def test_chained_call_reported_not_executed_never_runs_when_the_paused_chain_resumes(
        start_worker, redis_url, clean_redis):
    stalled = start_worker(TOOLS, concurrency=1, name="stalled")
    orch = orchestrator(redis_url)
    calls = [call(0, "serial_unsafe", resource="db", key="k-n0", seconds=1),
             call(1, "serial_unsafe", resource="db", key="k-n1")]
    thread, box = run_in_thread(orch.run_calls, "s-not-run", calls)
    wait_for(lambda: effects(clean_redis, "k-n0") == 1, 60, "the first call's handler to start")
    # Freeze the worker (its sandbox child finishes the call meanwhile) past its lease and the
    # visibility timeout: another worker gets the chain's first message again, stores the stand-in
    # OUTCOME_UNKNOWN and goes on with its copy of the chain, where the second call is NOT_EXECUTED.
    os.killpg(stalled.proc.pid, signal.SIGSTOP)
    try:
        other = start_worker(TOOLS, concurrency=1, name="other")
        thread.join(120)
        assert not thread.is_alive(), "the turn hung"
    finally:
        os.killpg(stalled.proc.pid, signal.SIGCONT)
    first, second = box["value"].results
    assert first.error is not None and first.error.code == ErrorCode.OUTCOME_UNKNOWN, first
    assert second.error is not None and second.error.code == ErrorCode.NOT_EXECUTED, second
    # The paused worker wakes up, stores the first call's real result, and Celery goes on with the
    # original chain: its second call must not start now (the model was told to call it again).
    record = orch.turns.record("s-not-run", box["value"].turn_id)
    first_key = record.dispatched[0].key
    wait_for(lambda: json.loads(orch.runtime.store.result(first_key) or "{}").get("status") == "ok", 40,
             "the first call's real result")
    wait_for(lambda: _succeeded([stalled, other], record.dispatched[1].task_id) >= 2, 40,
             "the original chain to reach the second call")
    assert effects(clean_redis, "k-n0") == 1
    assert effects(clean_redis, "k-n1") == 0, "a call reported NOT_EXECUTED ran afterwards"


def _nothing_active(app: Celery) -> bool:
    """Whether the workers answered a remote-control `active` query and run no task."""
    # A connection of its own: Redis may have been restarted since the app's pooled ones were made.
    with app.connection_for_write() as connection:
        answers = app.control.inspect(timeout=1.0, connection=connection).active() or {}
    return bool(answers) and not any(answers.values())


def _pool_children(worker: WorkerProcess) -> list[int]:
    assert worker.proc is not None
    pid = worker.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _stored(store: RedisIdempotencyStore, key: str) -> str | None:
    try:
        return store.result(key)
    except StoreUnavailable:
        return None


def _pipe_bytes(pid: int) -> dict[str, int]:
    """Bytes waiting in each pipe a process holds open, by pipe: FIONREAD on a pipe counts its
    buffer whichever end asks, and /proc opens the process's pipe itself."""
    waiting: dict[str, int] = {}
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(entry)
            if not target.startswith("pipe:"):
                continue
            fd = os.open(entry, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue  # closed meanwhile
        try:
            waiting[target] = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
        finally:
            os.close(fd)
    return waiting


@pytest.mark.timeout(150)
@pytest.mark.parametrize("outage", [1.5, 8.0], ids=["short-outage", "outage-past-claim-patience"])
def test_redis_down_when_a_worker_claims_the_call_still_runs_once(
        outage, start_worker, redis_server, redis_url, clean_redis):
    """Redis (broker, result backend and idempotency store) is down when a pool process claims a
    call, then comes back empty: within the claim's 5 s of patience the claim itself succeeds;
    past it, the worker's retry waits for the broker instead of being dropped. Either way the call
    runs once and its real result is stored and returned (not NOT_EXECUTED)."""
    worker = start_worker(TOOLS, concurrency=1)
    (pool_child,) = _pool_children(worker)
    app = create_app(settings_for(redis_url), Registry.from_modules([TOOLS]))
    store = RedisIdempotencyStore.from_url(redis_url)
    # A first call runs to its end: billiard has reported the pool process up and the main process
    # has seen it finish. A job for a process not yet up (or busy) stays in the worker's main
    # process, which discards it when the broker connection drops; with Redis back empty it
    # would be gone, and that is not what this test is about (docs/operations.md, "Redis: persistence, memory, failover").
    ready = send_call(app, "echo", {"text": "up"}, "k-ready", time.time() + 60)
    wait_for(lambda: _succeeded([worker], ready.id) == 1, 60, "a first call to finish")
    # The pool process logs "succeeded" before it reports the job done to the main process, which
    # only then counts it free: paused in between, it would never be handed the next call.
    wait_for(lambda: _nothing_active(app), 60, "the main process to see the first call done")
    key = f"k-claim-{outage:g}"
    os.kill(pool_child, signal.SIGSTOP)
    try:
        before = _pipe_bytes(pool_child)
        task = send_call(app, "effect_unsafe", {"key": key}, "idem-" + key, time.time() + 60)
        # The paused pool process has the call in its pipe: the main process handed it over.
        wait_for(lambda: any(n > before.get(pipe, 0) for pipe, n in _pipe_bytes(pool_child).items()), 30,
                 "the call to reach the paused pool process")
        redis_server.stop()
    finally:
        os.kill(pool_child, signal.SIGCONT)
    wait_for(lambda: b"unreachable before call call_0 started" in worker.log.read_bytes(), 30,
             "the pool process to find Redis down at its claim")
    time.sleep(outage)  # the fault itself: how long Redis stays away after the first failed claim
    redis_server.start()
    # Redis came back empty (no persistence): what is in it now was written after the restart.
    wait_for(lambda: _stored(store, "idem-" + key) is not None, 60, "the call's result")
    result = json.loads(store.result("idem-" + key) or "{}")
    assert (result["status"], result["content"]) == ("ok", "1"), result
    wait_for(lambda: task_meta(app, task.id).get("status") == "SUCCESS", 30, "the task's own result")
    (returned,) = task_meta(app, task.id)["result"]
    assert (returned["status"], returned["content"]) == ("ok", "1"), returned
    assert effects(clean_redis, key) == 1


@pytest.mark.parametrize("broker_url", ["amqp"], indirect=True)
@pytest.mark.timeout(60)
def test_turn_published_while_rabbitmq_is_unreachable_ends_settled_at_its_deadline(redis_url, broker_url, clean_redis):
    closed = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    orch = orchestrator(redis_url, closed, turn_timeout=3)
    started = time.monotonic()
    turn = orch.run_calls("s-no-broker", [call(0, "effect_unsafe", key="k-nb")])
    # kombu kept trying to publish until about the deadline; then the call was settled, not raised.
    assert time.monotonic() - started >= 2
    error = turn.results[0].error
    assert error is not None and error.code == ErrorCode.NOT_EXECUTED, turn.results[0]
    assert "broker could not be reached" in error.message
    dc = orch.turns.record("s-no-broker", turn.turn_id).dispatched[0]
    assert orch.runtime.store.cancelled(cancel_scope(turn.turn_id, dc.key))
    assert orch.turns.active("s-no-broker") is None


@pytest.mark.parametrize("broker_url", ["amqp"], indirect=True)
@pytest.mark.timeout(60)
def test_streamed_turn_whose_broker_is_unreachable_ends_settled_when_its_message_ends(
        redis_url, broker_url, clean_redis):
    closed = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    orch = orchestrator(redis_url, closed, turn_timeout=30)
    turn = orch.streaming_turn("s-stream-no-broker")
    streamed = call(0, "effect_read", key="k-snb")
    assert not turn.add(streamed), "an eager call was sent to a broker nobody listens on"
    started = time.monotonic()
    turn.end([streamed])
    result = turn.wait().results[0]
    # No wait for the broker: the turn ends when its message does, not at its 30 s deadline.
    assert time.monotonic() - started < 20
    assert result.error is not None and result.error.code == ErrorCode.NOT_EXECUTED, result
    assert "broker could not be reached" in result.error.message
    dc = orch.turns.record("s-stream-no-broker", turn.turn_id).dispatched[0]
    assert orch.runtime.store.cancelled(cancel_scope(turn.turn_id, dc.key))
    assert orch.turns.active("s-stream-no-broker") is None


def _via(url: str, port: int) -> str:
    """`url` with its host and port replaced by the loopback `port` (credentials and path kept)."""
    parts = urlsplit(url)
    credentials = f"{parts.username}:{parts.password}@" if parts.username else ""
    return parts._replace(netloc=f"{credentials}127.0.0.1:{port}").geturl()


def _redis_broker_messages(client: redis.Redis) -> int:
    """Messages a Redis broker holds: queued (the queue's lists) or taken and not acknowledged."""
    queued = sum(client.llen(key) for key in client.scan_iter("toolchord*") if client.type(key) == b"list")
    return queued + int(client.hlen("unacked"))


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
@pytest.mark.timeout(120)
def test_worker_killed_just_after_the_broker_handed_it_a_call(start_worker, redis_url, broker_url, clean_redis):
    """docs/operations.md, "Choosing a broker": a worker SIGKILLed the moment a call's message is its.

    Redis: kombu has taken the message off the list (BRPOP) and is killed before it records it as
    unacknowledged (the HSET is held back here): the message is gone, and with another worker up the
    call is still truthfully NOT_EXECUTED at the turn's deadline (past the visibility timeout).
    RabbitMQ (the delivery is held back): the unacknowledged delivery is redelivered when the
    worker's connection closes, and the call runs once.
    """
    on_redis = urlsplit(broker_url).scheme == "redis"

    def taken(to_broker: bool, chunk: bytes) -> bool:
        if on_redis:
            return to_broker and b"HSET" in chunk and b"toolchord.call." in chunk
        return not to_broker and b"toolchord.call." in chunk

    real = urlsplit(broker_url)
    port = free_port()
    proxy = Forwarder(real.port or 6379, host=real.hostname or "127.0.0.1", port=port, hold=taken)
    try:
        taker = start_worker(TOOLS, concurrency=1, name="taker", TOOLCHORD_BROKER_URL=_via(broker_url, port))
        proxy.armed.set()
        # 12 s: past the Redis broker's visibility timeout (8 s) and its next sweep.
        orch = orchestrator(redis_url, broker_url, turn_timeout=12)
        thread, box = run_in_thread(orch.run_calls, "s-taken", [call(0, "effect_unsafe", key="k-taken")])
        assert proxy.held.wait(30), "the worker never took the call's message"
        taker.kill()
        proxy.close()  # the broker sees the dead worker's connections close
        if on_redis:
            assert _redis_broker_messages(clean_redis) == 0, "the message is still queued or recorded"
        start_worker(TOOLS, concurrency=1, name="other")
        thread.join(60)
        assert not thread.is_alive(), "the turn hung"
    finally:
        proxy.close()
    result = box["value"].results[0]
    if on_redis:
        assert result.error is not None and result.error.code == ErrorCode.NOT_EXECUTED, result
        assert effects(clean_redis, "k-taken") == 0
    else:
        assert (result.status, result.content) == ("ok", "1"), result
        assert effects(clean_redis, "k-taken") == 1


@pytest.mark.parametrize("broker_url", ["amqp"], indirect=True)
@pytest.mark.timeout(120)
def test_turn_published_while_rabbitmq_is_unreachable_runs_once_it_is_back(
        start_worker, redis_url, broker_url, clean_redis, caplog):
    start_worker(TOOLS, concurrency=1)
    real = urlsplit(broker_url)
    port = free_port()
    # The orchestrator reaches RabbitMQ through a port that refuses connections until it opens.
    orch = orchestrator(redis_url, _via(broker_url, port),
                        turn_timeout=40)
    thread, box = run_in_thread(orch.run_calls, "s-broker-back", [call(0, "effect_unsafe", key="k-back")])
    wait_for(lambda: "waiting for it until the deadline" in caplog.text, 30, "the turn to wait for the broker")
    forwarder = Forwarder(real.port or 5672, host=real.hostname or "127.0.0.1", port=port)
    try:
        thread.join(90)
        assert not thread.is_alive(), "the turn hung"
    finally:
        forwarder.close()
    result = box["value"].results[0]
    assert (result.status, result.content) == ("ok", "1"), result
    assert effects(clean_redis, "k-back") == 1
