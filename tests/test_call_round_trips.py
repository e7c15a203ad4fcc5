"""How many Redis round trips one call's bookkeeping costs on a real worker (issue 25 item 10).

A worker far from Redis pays every round trip of a call's path in latency, against the turn's
deadline and Celery's hard time limit (docs/deployment.md, "How far workers may be from Redis"):
the count must stay a small fixed number. The worker reaches toolchord's Redis (claims, results, timeline) through a proxy that
counts round trips; Redis MONITOR on the test's private Redis sees every command of the turn.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

import pytest
import redis

from tests.cluster_helpers import TOOLS, call, orchestrator, wait_for
from tests.tcp_forwarder import Forwarder
from toolchord.worker import idempotency
from toolchord.worker.observability.call_timeline import read_timing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# The lease renewer's script: it runs beside the handler on its own thread, not on the call's path.
_RENEW_SHA = hashlib.sha1(idempotency._RENEW.encode()).hexdigest()
# Beside the handler too: while a sandboxed handler runs the worker looks at the turn's cancel
# flag every CANCEL_POLL_SECONDS, so a handler slowed by a loaded machine is looked at more often.
_CANCEL_POLL = re.compile(r"^EXISTS \S+:cancel$")
# The worker's own records of a call: its claim and result, and its timeline entry.
_WORKER_KEYS = ("toolchord:idem:", "toolchord:calls:")


class Monitor:
    """Every command Redis runs between `start()` and `stop()`, as (connection, command)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.commands: list[tuple[str, str]] = []
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with self.client.monitor() as monitor:
            for event in monitor.listen():
                entry: dict[str, Any] = event
                if entry.get("client_type") == "lua":
                    continue  # run inside a script: part of that script's round trip
                self.commands.append((f"{entry['client_address']}:{entry['client_port']}", entry["command"]))
                if entry["command"] == "ECHO monitor-stop":
                    return

    def start(self, probe: redis.Redis) -> None:
        self._thread.start()
        wait_for(lambda: probe.echo("monitor-start") is not None and any(
            c == "ECHO monitor-start" for _, c in self.commands), 10, "MONITOR to see commands")
        self.commands.clear()

    def stop(self, probe: redis.Redis) -> None:
        probe.echo("monitor-stop")
        self._thread.join(10)


def _watched_turn(redis_url: str, clean_redis: redis.Redis) -> list[tuple[str, str]]:
    """Every command Redis ran for one turn of one `unsafe` call, after a warm-up turn."""
    orch = orchestrator(redis_url)
    # Warm up: connections, loaded scripts, the worker's sandbox zygote.
    assert orch.run_calls("s-warm", [call(0, "effect_unsafe", key="warm")]).results[0].status == "ok"
    monitor = Monitor(redis.Redis.from_url(redis_url))
    monitor.start(clean_redis)
    turn = orch.run_calls("s-count", [call(0, "effect_unsafe", key="counted")])
    monitor.stop(clean_redis)
    assert turn.results[0].status == "ok"
    return monitor.commands


def _task_events(commands: list[tuple[str, str]]) -> list[str]:
    return [c for _, c in commands if c.startswith("PUBLISH /0.celeryev/")]


def test_one_unsafe_call_costs_a_bounded_number_of_redis_commands(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=1)
    commands = _watched_turn(redis_url, clean_redis)
    worker_side = [c for _, c in commands
                   if any(k in c for k in _WORKER_KEYS) and _RENEW_SHA not in c and "HGET " not in c[:5]
                   and not _CANCEL_POLL.match(c)]
    # The timeline's "running" record (HSET + EXPIRE) and the claim (one script) in one pipeline,
    # the timeline's "done" record (HSET: the running record's TTL covers it) and the result (one
    # script) in another: 5 commands, 2 round trips.
    assert len(worker_side) <= 5, "\n".join(c[:100] for c in worker_side)
    # Everything Redis did for the call, Celery's broker and chord included.
    total = len([c for _, c in commands if not c.startswith("ECHO ")])
    assert total <= 70, total
    # Task events are off by default (a running Flower switches them on): no PUBLISH for them.
    assert _task_events(commands) == []
    print(f"\nworker bookkeeping commands: {len(worker_side)}; all commands for the turn: {total}")


def test_task_events_on_publishes_them(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=1, TOOLCHORD_TASK_EVENTS="on")
    commands = _watched_turn(redis_url, clean_redis)
    assert _task_events(commands)


def test_one_unsafe_call_costs_two_redis_round_trips_of_bookkeeping(start_worker, redis_server, redis_url,
                                                                      clean_redis):
    # Round trips of a client sending after Redis answered it; lease renewals run on their own
    # thread beside the handler, so they are left out.
    proxy = Forwarder(redis_server.port, counted=lambda chunk: _RENEW_SHA.encode() not in chunk)
    # Claims, results and the timeline through the proxy; the broker and Celery's backend direct.
    start_worker(TOOLS, concurrency=1, TOOLCHORD_REDIS_URL=proxy.url(),
                 TOOLCHORD_RESULT_BACKEND=redis_url)
    orch = orchestrator(redis_url)

    def done(session: str, turn_id: str) -> bool:
        timing = read_timing(clean_redis, session, turn_id, "call_0")
        return timing is not None and timing.phase == "done"

    warm = orch.run_calls("s-warm", [call(0, "effect_unsafe", key="warm")])
    wait_for(lambda: done("s-warm", warm.turn_id), 10, "the warm-up call's timeline record")
    before = proxy.round_trips
    turn = orch.run_calls("s-trips", [call(0, "effect_unsafe", key="trips")])
    assert turn.results[0].status == "ok"
    wait_for(lambda: done("s-trips", turn.turn_id), 10, "the call's timeline record")
    # The claim (with the timeline's "running" record), the result (with its "done" record).
    assert proxy.round_trips - before == 2
