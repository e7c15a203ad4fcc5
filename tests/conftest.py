"""Shared fixtures: a private redis-server and real Celery worker processes (prefork pool)."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A private redis-server on a free loopback port, with nothing persisted."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: the distributed tests need a real Redis. "
                "Install it (Debian/Ubuntu: apt-get install redis-server) and run again.",
                pytrace=False,
            )
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        pytest.fail(f"redis-server did not start on port {self.port}", pytrace=False)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    # Celery result objects unsubscribe from Redis when collected: let them, before Redis goes.
    gc.collect()
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's private redis-server (database 0)."""
    return redis_server.url


@pytest.fixture
def clean_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on an emptied database; the test owns all of Redis while it runs."""
    if redis_server.proc is None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


def worker_env(redis_url: str, tool_modules: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    env.update(
        TOOLCHORD_BROKER_URL=redis_url,
        TOOLCHORD_TOOL_MODULES=tool_modules,
        # Short enough that tests see redelivery after a worker is killed, far above any retry backoff.
        TOOLCHORD_VISIBILITY_TIMEOUT="8",
        TOOLCHORD_CLAIM_LEASE="2",
        TC_TEST_LEDGER=redis_url,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
    )
    env.update(extra)
    return env


class WorkerProcess:
    """A real worker (`toolchord worker`, prefork pool) in its own process group."""

    def __init__(self, env: dict[str, str], queues: str, concurrency: int, name: str, log: Path) -> None:
        self.env, self.queues, self.concurrency, self.name, self.log = env, queues, concurrency, name, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        handle = self.log.open("ab")
        self.proc = subprocess.Popen(
            # `toolchord worker` as users run it (it execs `celery worker` on toolchord's app).
            [sys.executable, "-m", "orchestrator.cli", "worker", "--concurrency", str(self.concurrency),
             "--queues", self.queues, "--hostname", f"{self.name}@%h", "--loglevel", "INFO",
             "--without-mingle", "--without-gossip"],
            env=self.env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited early:\n{self.log.read_text()[-3000:]}")
            if b" ready." in self.log.read_bytes():
                return
            time.sleep(0.05)
        raise RuntimeError(f"worker {self.name} not ready in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the whole process group: main process, pool children and sandboxes."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture
def start_worker(redis_url: str, clean_redis: redis.Redis, tmp_path: Path) -> Iterator:
    """Start real worker processes: `start_worker(tools, queues="toolchord", concurrency=2, **env)`."""
    started: list[WorkerProcess] = []

    def start(tool_modules: str, queues: str = "toolchord", concurrency: int = 2, name: str | None = None,
              **extra_env: str) -> WorkerProcess:
        name = name or f"w{len(started) + 1}"
        worker = WorkerProcess(worker_env(redis_url, tool_modules, **extra_env), queues, concurrency, name,
                               tmp_path / f"{name}.log")
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
