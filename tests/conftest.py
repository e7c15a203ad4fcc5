"""Shared fixtures: a private redis-server and real worker processes (`toolchord worker`, prefork).

The process helpers live in `orchestrator/bench/processes.py`, shared with the benchmarks; here they are
wrapped as fixtures that fail with a clear message when something cannot start.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from tests.brokers import RabbitVhost, private_vhost, using_rabbitmq
from toolchord.orchestrator.bench import processes
from toolchord.orchestrator.bench.processes import ROOT, ProcessStartError, RedisServer, WorkerProcess, free_port

__all__ = ["ROOT", "free_port", "worker_env"]


def worker_env(redis_url: str, tool_modules: str, **extra: str) -> dict[str, str]:
    """A worker environment with the tests' settings: short visibility timeout and claim lease."""
    return processes.worker_env(
        redis_url,
        tool_modules,
        # Short enough that tests see redelivery after a worker is killed, far above any retry backoff.
        TOOLCHORD_VISIBILITY_TIMEOUT="8",
        TOOLCHORD_CLAIM_LEASE="2",
        TC_TEST_LEDGER=redis_url,
        **extra,
    )


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    try:
        server = RedisServer(tmp_path_factory.mktemp("redis"))
        server.start()
    except ProcessStartError as exc:
        pytest.fail(f"{exc}: the distributed tests need a real Redis.", pytrace=False)
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


@pytest.fixture(scope="session")
def rabbit_vhost() -> Iterator[RabbitVhost]:
    """A private vhost on the local RabbitMQ for this session, deleted afterwards; skip without RabbitMQ."""
    yield from private_vhost()


@pytest.fixture
def rabbitmq(rabbit_vhost: RabbitVhost) -> Iterator[RabbitVhost]:
    """The session's vhost, with the server held in shared use for the test (see tests/brokers.py)."""
    with using_rabbitmq():
        yield rabbit_vhost


@pytest.fixture
def broker_url(request: pytest.FixtureRequest, redis_url: str, clean_redis: redis.Redis) -> str:
    """The broker workers and orchestrators use: the private Redis, or with
    `@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)` also RabbitMQ
    (a private vhost, its queues emptied before the test)."""
    if getattr(request, "param", "redis") == "redis":
        return redis_url
    vhost: RabbitVhost = request.getfixturevalue("rabbitmq")
    vhost.purge()
    return vhost.url


@pytest.fixture
def start_worker(redis_url: str, broker_url: str, clean_redis: redis.Redis,
                 tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start real worker processes: `start_worker(tools, queues="toolchord", concurrency=2, **env)`;
    `args` are more `toolchord worker` options."""
    started: list[WorkerProcess] = []

    def start(tool_modules: str, queues: str = "toolchord", concurrency: int = 2, name: str | None = None,
              args: Sequence[str] = (), **extra_env: str) -> WorkerProcess:
        name = name or f"w{len(started) + 1}"
        env = worker_env(redis_url, tool_modules,
                         **{"TOOLCHORD_BROKER_URL": broker_url, "TOOLCHORD_REDIS_URL": redis_url, **extra_env})
        worker = WorkerProcess(env, queues, concurrency, name, tmp_path / f"{name}.log", args=args)
        worker.start()
        started.append(worker)
        return worker

    yield start
    # Killed, not stopped warm: nothing is checked after the test, and a warm stop costs each worker
    # over a second (billiard's pool processes sleep 1 s before they exit), a minute of the suite.
    # The zygotes and their children die with their pool process (PDEATHSIG); the next worker
    # removes the call cgroups and workdirs left behind, as after any killed worker.
    for worker in started:
        worker.kill()


@pytest.fixture
def readable_secret() -> Iterator[str]:
    """A world-readable secret file in a world-searchable directory, as a `*_FILE` setting names
    it: file modes alone would let any sandboxed call read it."""
    directory = tempfile.mkdtemp(prefix="toolchord-test-secrets-")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "redis-url")
    with open(path, "w") as secret:
        secret.write("redis://toolchord:hunter2@redis:6379/0")
    os.chmod(path, 0o644)
    yield path
    shutil.rmtree(directory)


FAULT_ROW = "fault_summary_row"
_fault_rows: list[Sequence[Any]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect the fault summary's rows (test reports carry them here from pytest-xdist workers too)."""
    if report.when == "teardown":
        _fault_rows.extend(cast(Sequence[Any], value) for key, value in report.user_properties if key == FAULT_ROW)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the fault-injection summary when the fault tests ran."""
    if _fault_rows:
        terminalreporter.section("fault injection summary")
        terminalreporter.write_line(f"{'fault':<52} {'calls':>5} {'effects':>7} {'results':>7} {'lost':>4}")
        for name, calls, effects, results, lost in _fault_rows:
            terminalreporter.write_line(f"{name:<52} {calls:>5} {effects:>7} {results:>7} {lost:>4}")
