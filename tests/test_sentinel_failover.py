"""Claims and results in a Redis Sentinel group: a failover mid-turn loses no result and runs no unsafe call twice.

A private primary, replica and sentinel run on free loopback ports (`redis-server --sentinel`).
The broker and the tests' side-effect ledger stay on the session's plain Redis, so the ledger
counts every run whatever the failover does to the group's data.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.cluster_helpers import TOOLS, call, effects, run_in_thread, wait_for
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.bench.processes import free_port
from toolchord.orchestrator.turn import TurnResult
from toolchord.worker import ErrorCode, Registry
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.idempotency import PREFIX, idempotency_key

pytestmark = pytest.mark.slow

MASTER = "tc"


class SentinelGroup:
    """A primary, one replica and one sentinel watching them, each a redis-server process."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.primary, self.replica, self.sentinel = free_port(), free_port(), free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.sentinel}/0"

    def _server(self, *args: str) -> None:
        self.procs.append(subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL,
                                           start_new_session=True))

    def start(self) -> None:
        """Start all three and wait until the replica is in sync and the sentinel knows both servers."""
        common = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                  "--loglevel", "warning")
        self._server("--port", str(self.primary), *common)
        self._server("--port", str(self.replica), "--replicaof", "127.0.0.1", str(self.primary), *common)
        config = self.workdir / "sentinel.conf"  # a sentinel rewrites its config file: it must be its own
        config.write_text(
            f"port {self.sentinel}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary} 1\n"
            # Known from the start: a sentinel otherwise finds replicas in the primary's INFO, which
            # it reads every 10 s.
            f"sentinel known-replica {MASTER} 127.0.0.1 {self.replica}\n"
            f"sentinel down-after-milliseconds {MASTER} 2000\nsentinel failover-timeout {MASTER} 10000\n"
        )
        self._server(str(config), "--sentinel")
        wait_for(lambda: self._info(self.replica, "replication").get("master_link_status") == "up", 30,
                 "the replica to sync")
        wait_for(self._sentinel_sees_replica, 30, "the sentinel to discover the replica")

    def _info(self, port: int, section: str) -> dict[str, object]:
        try:
            with redis.Redis(port=port, socket_timeout=2) as client:
                return client.info(section)
        except redis.ConnectionError:
            return {}

    def _sentinel_sees_replica(self) -> bool:
        try:
            with redis.Redis(port=self.sentinel, socket_timeout=2, decode_responses=True) as client:
                replicas = client.sentinel_slaves(MASTER)
        except (redis.ConnectionError, redis.ResponseError):
            return False
        return any(int(r["port"]) == self.replica and "s_down" not in r["flags"] for r in replicas)

    def master_port(self) -> int | None:
        try:
            with redis.Redis(port=self.sentinel, socket_timeout=2) as client:
                address = client.sentinel_get_master_addr_by_name(MASTER)
        except redis.ConnectionError:
            return None
        return int(address[1]) if address else None

    def kill_primary(self) -> None:
        """SIGKILL the primary and wait until the sentinel has promoted the replica."""
        self.procs[0].kill()
        self.procs[0].wait()
        wait_for(lambda: self.master_port() == self.replica, 30, "the sentinel to name the replica primary")
        wait_for(lambda: self._info(self.replica, "replication").get("role") == "master", 30,
                 "the replica to become primary")

    def cut_replica_off(self) -> None:
        """Freeze the replica (SIGSTOP) and drop its link on the primary: every write from now on
        reaches only the primary (a frozen replica alone would still read what its socket buffered)."""
        os.kill(self.procs[1].pid, signal.SIGSTOP)
        with redis.Redis(port=self.primary, socket_timeout=5) as primary:
            primary.client_kill_filter(_type="replica")

    def fail_over_to_lagging_replica(self) -> None:
        """SIGKILL the primary while the replica is frozen, then let the replica run: it is promoted
        without the writes it missed."""
        self.procs[0].kill()
        self.procs[0].wait()
        os.kill(self.procs[1].pid, signal.SIGCONT)
        wait_for(lambda: self.master_port() == self.replica, 60, "the sentinel to name the replica primary")
        wait_for(lambda: self._info(self.replica, "replication").get("role") == "master", 30,
                 "the replica to become primary")
        wait_for(self._master_healthy, 30, "the sentinel to see the promoted primary up")

    def _master_healthy(self) -> bool:
        try:
            with redis.Redis(port=self.sentinel, socket_timeout=2, decode_responses=True) as client:
                state = client.sentinel_master(MASTER)
        except (redis.ConnectionError, redis.ResponseError):
            return False
        return bool(state.get("is_master")) and not state.get("is_sdown") and not state.get("is_odown")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[SentinelGroup]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: the Sentinel tests need it", pytrace=False)
    group = SentinelGroup(tmp_path)
    try:
        group.start()
        yield group
    finally:
        # Celery's result objects of the test's orchestrator unsubscribe when they are collected, and
        # reconnect to the group to do it: let them while it is up. Once it is gone each one retries
        # the dead sentinels for minutes, and the session's last collection sat in those retries.
        gc.collect()
        group.stop()


def test_failover_mid_turn_loses_no_result_and_runs_no_unsafe_call_twice(
    start_worker, redis_url, clean_redis, sentinel_group
):
    group_env = {"TOOLCHORD_REDIS_URL": sentinel_group.url, "TOOLCHORD_RESULT_BACKEND": sentinel_group.url,
                 "TOOLCHORD_REDIS_MASTER_NAME": MASTER}
    start_worker(TOOLS, concurrency=3, **group_env)
    settings = Settings.from_env({"TOOLCHORD_BROKER_URL": redis_url, **group_env,
                                  "TOOLCHORD_VISIBILITY_TIMEOUT": "8", "TOOLCHORD_CLAIM_LEASE": "2"})
    registry = Registry.from_modules([TOOLS])
    orch = Orchestrator(registry, create_app(settings, registry))
    keys = ("f-read", "f-idem", "f-unsafe")
    calls = [call(0, "effect_read", key=keys[0], seconds=5), call(1, "effect_idempotent", key=keys[1], seconds=5),
             call(2, "effect_unsafe", key=keys[2], seconds=5)]
    thread, box = run_in_thread(orch.run_calls, "s-failover", calls)
    wait_for(lambda: all(effects(clean_redis, k) == 1 for k in keys), 30, "handlers to start")
    # The primary dies while three handlers run: Sentinel needs its down-after time and a failover,
    # during which every Redis command of the workers and the orchestrator fails.
    sentinel_group.kill_primary()
    assert thread.is_alive(), "the turn ended before the failover: make the handlers slower"
    thread.join(90)
    assert not thread.is_alive(), "the turn hung after a Sentinel failover"
    turn: TurnResult = box["value"]
    assert [r.call_id for r in turn.results] == [c.id for c in calls]
    read, idem, unsafe = turn.results
    assert read.status == "ok" and idem.status == "ok", (read.error, idem.error)
    assert unsafe.status == "ok" or unsafe.error.code == ErrorCode.OUTCOME_UNKNOWN, unsafe.error
    assert effects(clean_redis, keys[2]) == 1
    # The results were written to the promoted replica: the next turn finds them there.
    with redis.Redis(port=sentinel_group.replica) as promoted:
        assert promoted.dbsize() > 0
    # The group has no replica left: an unsafe call's claim cannot be replicated, so it does not run
    # (TOOLCHORD_REDIS_MIN_REPLICAS is 1 with a sentinel:// URL) and says it may be called again.
    again = orch.run_calls("s-failover-after", [call(0, "effect_unsafe", key="f-after")])
    assert again.results[0].error is not None and again.results[0].error.code == ErrorCode.NOT_EXECUTED
    assert "replicated" in again.results[0].error.message and effects(clean_redis, "f-after") == 0
    read_after = orch.run_calls("s-failover-after", [call(1, "effect_read", key="f-after-read")])
    assert read_after.results[0].status == "ok" and effects(clean_redis, "f-after-read") == 1


def _result_key(session: str, call_id: str) -> str:
    spec = Registry.from_modules([TOOLS]).get("effect_unsafe")
    assert spec is not None
    return f"{PREFIX}{idempotency_key(spec, session, call_id, {})}:result"


@pytest.mark.timeout(240)
def test_failover_to_a_lagging_replica_runs_no_unsafe_call_twice_and_loses_no_unsafe_result(
    start_worker, redis_url, clean_redis, sentinel_group
):
    group_env = {"TOOLCHORD_REDIS_URL": sentinel_group.url, "TOOLCHORD_RESULT_BACKEND": sentinel_group.url,
                 "TOOLCHORD_REDIS_MASTER_NAME": MASTER}
    # Long enough for the results to wait out the failover (Sentinel's 2 s down-after and the promotion).
    worker = start_worker(TOOLS, concurrency=4, TOOLCHORD_RESULT_STORE_PATIENCE="60", **group_env)
    settings = Settings.from_env({"TOOLCHORD_BROKER_URL": redis_url, **group_env,
                                  "TOOLCHORD_VISIBILITY_TIMEOUT": "8", "TOOLCHORD_CLAIM_LEASE": "2"})
    registry = Registry.from_modules([TOOLS])
    orch = Orchestrator(registry, create_app(settings, registry), turn_timeout=90)
    # Turn one: three unsafe calls start while the replica keeps up (their claims reach it) and
    # finish while it lags (their results reach only the primary).
    first = [call(i, "effect_unsafe", key=f"lag-1-{i}", seconds=2) for i in range(3)]
    thread, _ = run_in_thread(orch.run_calls, "s-lag-1", first)
    wait_for(lambda: all(effects(clean_redis, f"lag-1-{i}") == 1 for i in range(3)), 30, "handlers to start")
    sentinel_group.cut_replica_off()
    with redis.Redis(port=sentinel_group.primary) as primary:
        wait_for(lambda: all(primary.exists(_result_key("s-lag-1", c.id)) for c in first), 30,
                 "the results to be stored on the primary")
    # Turn two starts while the replica lags: its claims reach only the primary. Fail over once they
    # were taken (the calls ran) or refused (the claim reached no replica).
    # Its results can be lost with the primary (they reach no replica), so it may have to wait for
    # its deadline: a shorter one, still past the failover.
    second = [call(i, "effect_unsafe", key=f"lag-2-{i}") for i in range(2)]
    lagging = Orchestrator(registry, create_app(settings, registry), turn_timeout=20)
    second_thread, second_box = run_in_thread(lagging.run_calls, "s-lag-2", second)
    wait_for(lambda: all(effects(clean_redis, f"lag-2-{i}") == 1 for i in range(2))
             or worker.log.read_bytes().count(b"the claim reached 0 of 1") >= 2, 30, "turn two's claims")
    sentinel_group.fail_over_to_lagging_replica()
    # The same turns again (as a client retrying them would): every stored result of an unsafe
    # call that ran is on the promoted replica, and nothing runs a second time.
    with redis.Redis(port=sentinel_group.replica) as promoted:
        wait_for(lambda: all(promoted.exists(_result_key("s-lag-1", c.id)) for c in first), 45,
                 "the results of turn one on the promoted replica")
    again = orch.run_calls("s-lag-1", first, turn_id="t-lag-1-again")
    assert [(r.status, r.content) for r in again.results] == [("ok", "1")] * 3, [r.error for r in again.results]
    second_thread.join(60)
    assert not second_thread.is_alive(), "turn two hung"
    second_turn: TurnResult = second_box["value"]
    second_again = orch.run_calls("s-lag-2", second, turn_id=second_turn.turn_id)
    assert all(effects(clean_redis, f"lag-1-{i}") == 1 for i in range(3))
    assert all(effects(clean_redis, f"lag-2-{i}") <= 1 for i in range(2)), [
        effects(clean_redis, f"lag-2-{i}") for i in range(2)]
    # A call of turn two that ran is never reported NOT_EXECUTED (the model would call it again).
    for turn in (second_turn, second_again):
        for i, result in enumerate(turn.results):
            if effects(clean_redis, f"lag-2-{i}") == 1:
                assert result.error is None or result.error.code == ErrorCode.OUTCOME_UNKNOWN, result.error
            else:
                assert result.error is not None and result.error.code in (
                    ErrorCode.NOT_EXECUTED, ErrorCode.OUTCOME_UNKNOWN), result
    thread.join(60)
    assert not thread.is_alive()
