"""A private loopback cluster for the load test: one redis-server and real prefork workers.

Mirrors tests/conftest.py without pytest: every process runs in its own process group, so a
worker can be SIGKILLed whole (main process, pool children, sandboxes) and started again.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from bench.load_tools import LEDGER_URL_ENV, READY_PREFIX

ROOT = Path(__file__).resolve().parent.parent
TOOL_MODULE = "bench.load_tools"


class ClusterError(RuntimeError):
    """A process of the cluster could not be started."""


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes in a process group (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command name: state ppid pgrp ... utime(14th) stime(15th) of the full line.
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / ticks


class RedisProcess:
    """A private redis-server on a free loopback port, persisting nothing."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ClusterError("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--loglevel", "warning", "--maxclients", "10000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        client = redis.Redis(port=self.port)
        for _ in range(250):
            try:
                client.ping()
                client.close()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise ClusterError(f"redis-server did not start on port {self.port}")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cpu_seconds(self) -> float:
        return process_group_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def worker_env(redis_url: str, visibility_timeout: int, claim_lease: float) -> dict[str, str]:
    """The environment of a load worker: only this cluster's Redis and the load tools."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    env.update(
        TOOLCHORD_BROKER_URL=redis_url,
        TOOLCHORD_TOOL_MODULES=TOOL_MODULE,
        TOOLCHORD_VISIBILITY_TIMEOUT=str(visibility_timeout),
        TOOLCHORD_CLAIM_LEASE=str(claim_lease),
        **{LEDGER_URL_ENV: redis_url},
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
    )
    return env


class WorkerProcess:
    """A `celery worker --pool prefork` in its own process group."""

    def __init__(self, env: dict[str, str], concurrency: int, name: str, log: Path) -> None:
        self.env, self.concurrency, self.name, self.log = env, concurrency, name, log
        self.proc: subprocess.Popen[bytes] | None = None
        self._redis = redis.Redis.from_url(env["TOOLCHORD_BROKER_URL"])

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
                [sys.executable, "-m", "celery", "-A", "worker.celery_app:app", "worker", "--pool", "prefork",
                 "--concurrency", str(self.concurrency), "--queues", "toolchord", "--hostname", self.hostname,
                 "--loglevel", self.env.get("TC_BENCH_LOGLEVEL", "WARNING"), "--without-mingle", "--without-gossip", "--without-heartbeat"],
                env=self.env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ClusterError(f"worker {self.name} exited early:\n{self._log_tail(offset)}")
            if self._redis.exists(ready_key):
                return
            time.sleep(0.05)
        raise ClusterError(f"worker {self.name} not ready in {timeout:.0f}s:\n{self._log_tail(offset)}")

    def _log_tail(self, offset: int) -> str:
        with self.log.open("rb") as handle:
            handle.seek(offset)
            return handle.read()[-3000:].decode(errors="replace")

    def cpu_seconds(self) -> float:
        """CPU time used so far by the live processes of this worker's process group."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        return process_group_cpu_seconds(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL the whole process group: main process, pool children and sandboxes."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        """Stop the worker and drop the driver's connection."""
        self.stop()
        self._redis.close()

    def stop(self) -> None:
        """Warm shutdown, then a kill if it does not end in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()
