"""Celery's time limits around a slow or partitioned Redis (issue 25 item 10).

- Call tasks get no Celery soft time limit: it was raised wherever the task was, Celery's chord
  bookkeeping included, and lost the turn's callback. An in-process handler is stopped at its
  timeout by its own timer (`HandlerTimeout`, worker/handler_deadline.py).
- A pool process ends itself shortly after the hard time limit when the worker's main process,
  blocked on a partitioned socket, cannot end it (worker/hard_limit.py).

Real private redis-server, real `toolchord worker` processes; a partition or a slow link is a
`Forwarder` between a worker and Redis (tests/tcp_forwarder.py).
"""

from __future__ import annotations

import re
import time

import pytest
import redis
from celery import states

from tests.cluster_helpers import TOOLS, call, orchestrator, run_in_thread, wait_for
from tests.tcp_forwarder import Forwarder
from toolchord.orchestrator.bench.processes import RedisServer
from toolchord.worker import ErrorCode
from toolchord.worker.hard_limit import GRACE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# tests/celery_tools.py: `nap_inproc`, `nap_inproc_noting` and `hang_inproc` have a 1 s timeout;
# Celery's hard limit is the timeout + 10 s (orchestrator/dispatch.py).
TIMEOUT = 1.0
HARD_LIMIT = TIMEOUT + 10.0


def _callbacks_done(client: redis.Redis) -> int:
    """How many turn callbacks (`toolchord.collect`) stored a successful result."""
    metas = [client.get(key) for key in client.scan_iter("celery-task-meta-tc-collect-*")]
    return sum(1 for meta in metas if meta is not None and f'"status": "{states.SUCCESS}"'.encode() in meta)


def test_chord_bookkeeping_held_past_the_tools_timeout_still_sends_the_callback(
        start_worker, redis_server: RedisServer, redis_url, clean_redis):
    # The worker reaches Celery's result backend (the chord counter) through a link that freezes.
    backend = Forwarder(redis_server.port)
    try:
        start_worker(TOOLS, concurrency=1, TOOLCHORD_RESULT_BACKEND=backend.url())
        orch = orchestrator(redis_url, turn_timeout=30)
        assert orch.run_calls("s-warm", [call(0, "echo", text="warm")]).results[0].status == "ok"
        assert _callbacks_done(clean_redis) == 1
        backend.freeze()
        try:
            thread, box = run_in_thread(orch.run_calls, "s-held", [call(0, "nap_inproc", seconds=0.2)])
            # The handler ends in time; the call's chord counter (on_chord_part_return) then waits on
            # the partition while the tool's 1 s timeout passes, where Celery's soft limit used to be
            # raised (inside that wait). Thawed well within the 5 s socket timeout.
            wait_for(lambda: backend.held_from_clients > 0, 30, "the chord counter to wait on the partition")
            held_at = time.monotonic()
            wait_for(lambda: time.monotonic() > held_at + TIMEOUT + 0.5, 10, "the tool's timeout to pass")
        finally:
            backend.thaw()
        thread.join(60)
        turn = box["value"]
        assert (turn.results[0].status, turn.results[0].content) == ("ok", "rested"), turn.results[0]
        # The callback ran: the turn did not depend on its fallback, the look at stored results every 5 s.
        wait_for(lambda: _callbacks_done(clean_redis) == 2, 10, "the turn's callback to run")
    finally:
        backend.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_pool_process_ends_soon_after_the_hard_limit_while_redis_is_partitioned(
        start_worker, redis_server: RedisServer, redis_url, clean_redis):
    # Every connection of the worker (broker, result backend, claims and results) crosses the link.
    link = Forwarder(redis_server.port)
    try:
        worker = start_worker(TOOLS, concurrency=1, TOOLCHORD_BROKER_URL=link.url(), TOOLCHORD_REDIS_URL=link.url(),
                              TOOLCHORD_RESULT_BACKEND=link.url())
        orch = orchestrator(redis_url, turn_timeout=20)
        assert orch.run_calls("s-warm", [call(0, "echo", text="warm")]).results[0].status == "ok"
        thread, box = run_in_thread(orch.run_calls, "s-hang", [call(0, "hang_inproc", key="hang")])
        # The handler writes its pool process's pid straight to Redis (not through the link).
        wait_for(lambda: clean_redis.llen("tc-test:pids:hang") == 1, 30, "the handler to start")
        started = time.monotonic()
        pid = int(clean_redis.lindex("tc-test:pids:hang", 0) or 0)
        link.freeze()
        try:
            # Before: the main process, blocked on the partition, never ended it (alive 40 s later).
            wait_for(lambda: not _alive(pid), HARD_LIMIT + GRACE + 6, "the pool process to end")
            lived = time.monotonic() - started
        finally:
            link.thaw()
        assert lived > HARD_LIMIT - 1, f"ended {lived:.1f} s after the handler started, before the hard limit"
        thread.join(60)
        assert box["value"].results[0].error is not None
        # The watchdog wrote where the pool process was stuck to the worker's log before ending it.
        log = worker.log.read_text(errors="replace")
        assert re.search(r'File ".*celery_tools\.py", line \d+ in hang_inproc', log), log[-3000:]
    finally:
        link.close()


def test_in_process_handler_over_its_timeout_gets_handler_timeout(start_worker, redis_url, broker_url, clean_redis):
    start_worker(TOOLS, concurrency=1)
    orch = orchestrator(redis_url, broker_url)
    result, = orch.run_calls("s-inproc", [call(0, "nap_inproc_noting", key="nap", seconds=20)]).results
    assert result.error is not None and result.error.code == ErrorCode.TIMEOUT, result
    assert "1 s" in result.error.message
    # Stopped inside the handler by HandlerTimeout (which a handler may catch to clean up), at its
    # timeout counted from the handler's start.
    stopped_by, after = clean_redis.lrange("tc-test:stopped:nap", 0, -1)
    assert stopped_by == b"HandlerTimeout"
    assert TIMEOUT - 0.05 <= float(after) < TIMEOUT + 1.0, after

