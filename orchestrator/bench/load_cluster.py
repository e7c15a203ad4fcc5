"""A private loopback cluster for the load test: one redis-server and real prefork workers.

Built on `bench.processes` (shared with the tests and the turn benchmark, CPU accounting
included); what the load test adds is a readiness signal that works with worker logging turned
down (log lines cost throughput at load).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from toolchord.orchestrator.bench import processes
from toolchord.orchestrator.bench.load_tools import LEDGER_URL_ENV, READY_PREFIX
from toolchord.orchestrator.bench.processes import ROOT, ProcessStartError, RedisServer

TOOL_MODULE = "toolchord.orchestrator.bench.load_tools"


class RedisProcess(RedisServer):
    """A private redis-server, started on creation."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.start()


def worker_env(redis_url: str, visibility_timeout: int, claim_lease: float,
               broker_url: str | None = None) -> dict[str, str]:
    """The environment of a load worker: this cluster's Redis (and broker, when not that Redis) and the load tools."""
    return processes.worker_env(
        redis_url,
        TOOL_MODULE,
        TOOLCHORD_BROKER_URL=broker_url or redis_url,
        TOOLCHORD_REDIS_URL=redis_url,
        TOOLCHORD_VISIBILITY_TIMEOUT=str(visibility_timeout),
        TOOLCHORD_CLAIM_LEASE=str(claim_lease),
        **{LEDGER_URL_ENV: redis_url},
    )


class WorkerProcess(processes.WorkerProcess):
    """A load worker: ready when it says so in Redis, with its process group's CPU time readable."""

    def __init__(self, env: dict[str, str], concurrency: int, name: str, log: Path) -> None:
        super().__init__(env, "toolchord", concurrency, name, log, loglevel=env.get("TC_BENCH_LOGLEVEL", "WARNING"))
        self._redis = redis.Redis.from_url(env[LEDGER_URL_ENV])

    @property
    def hostname(self) -> str:
        return f"{self.name}@{socket.gethostname()}"

    def start(self, timeout: float = 60.0) -> None:
        """Start the worker and wait until it consumes."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        ready_key = READY_PREFIX + self.hostname
        self._redis.delete(ready_key)
        with self.log.open("ab") as handle:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "toolchord.orchestrator.cli", "worker", "--concurrency", str(self.concurrency),
                 "--queues", self.queues, "--hostname", self.hostname, "--loglevel", self.loglevel,
                 "--without-mingle", "--without-gossip", "--without-heartbeat"],
                env=self.env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProcessStartError(f"worker {self.name} exited early:\n{self._tail_from(offset)}")
            if self._redis.exists(ready_key):
                return
            time.sleep(0.05)
        raise ProcessStartError(f"worker {self.name} not ready in {timeout:.0f}s:\n{self._tail_from(offset)}")

    def _tail_from(self, offset: int) -> str:
        with self.log.open("rb") as handle:
            handle.seek(offset)
            return handle.read()[-3000:].decode(errors="replace")

    def close(self) -> None:
        """Stop the worker and drop the driver's connection."""
        self.stop(timeout=15)
        self._redis.close()
