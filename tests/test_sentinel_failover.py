"""Claims and results in a Redis Sentinel group: a failover mid-turn loses no result and runs no unsafe call twice.

A private primary, replica and sentinel run on free loopback ports (`redis-server --sentinel`).
The broker and the tests' side-effect ledger stay on the session's plain Redis, so the ledger
counts every run whatever the failover does to the group's data.
"""

from __future__ import annotations

import shutil
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

    def stop(self) -> None:
        for proc in self.procs:
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
    again = orch.run_calls("s-failover-after", [call(0, "effect_unsafe", key="f-after")])
    assert again.results[0].status == "ok" and effects(clean_redis, "f-after") == 1
