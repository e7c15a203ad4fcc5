"""A call task's retry while the broker is unreachable (worker/retry_sending.py, issue 25 item 9).

The broker is a Redis of its own here, so it can stay away while the result backend and the
idempotency store (the session's private Redis) answer: what the task answers when its retry can
never be sent is then visible. When the broker comes back in time the retry is sent and the call
runs (tests/test_faults_not_executed.py, Redis down when a worker claims the call).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster_helpers import TOOLS, effects, send_call, settings_for, task_meta, wait_for
from toolchord.orchestrator.bench.processes import RedisServer, WorkerProcess
from toolchord.worker import ErrorCode, Registry
from toolchord.worker.celery_app import create_app
from toolchord.worker.idempotency import RedisIdempotencyStore

pytestmark = pytest.mark.slow



def _retry_publish_failed(worker: WorkerProcess) -> bool:
    """The worker tried to publish a retry and could not: toolchord says so, and before it waited
    for the broker Celery dropped the message ("reject requeue=False")."""
    log = worker.log.read_bytes()
    return b"could not send the retry" in log or b"reject requeue=False" in log


@pytest.fixture
def broker_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server used as the broker alone."""
    workdir = tmp_path / "broker"
    workdir.mkdir()
    server = RedisServer(workdir)
    server.start()
    yield server
    server.stop()


@pytest.mark.timeout(120)
def test_retry_of_an_unclaimed_call_that_never_reaches_the_broker_is_not_executed(
        start_worker, redis_server, redis_url, broker_redis, clean_redis):
    """Both Redis servers are down when the worker claims: after the claim's patience its retry
    waits for the broker; the store comes back, the broker does not before the deadline, and the
    task answers NOT_EXECUTED itself (nothing ran) instead of being dropped."""
    worker = start_worker(TOOLS, concurrency=1, TOOLCHORD_BROKER_URL=broker_redis.url)
    app = create_app(settings_for(redis_url, broker_redis.url), Registry.from_modules([TOOLS]))
    redis_server.stop()
    task = send_call(app, "effect_unsafe", {"key": "k-never"}, "idem-k-never", time.time() + 20)
    wait_for(lambda: b"unreachable before call call_0 started" in worker.log.read_bytes(), 30,
             "the worker to find the store down at its claim")
    broker_redis.stop()
    wait_for(lambda: _retry_publish_failed(worker), 30, "the retry's publish to fail")
    redis_server.start()
    # The deadline is 20 s after sending.
    wait_for(lambda: task_meta(app, task.id).get("status") == "SUCCESS", 60, "the task's own result")
    (returned,) = task_meta(app, task.id)["result"]
    assert returned["error"]["code"] == ErrorCode.NOT_EXECUTED.value, returned
    assert "idempotency store was unreachable" in returned["error"]["message"], returned
    assert effects(clean_redis, "k-never") == 0


@pytest.mark.timeout(120)
def test_retry_after_a_transient_failure_that_never_reaches_the_broker_returns_the_failure(
        start_worker, redis_url, broker_redis, clean_redis):
    """A handler fails transiently while the broker is away: the retry waits for it until shortly
    before the task's hard time limit (gated_flaky's is 15 s), then the call's own result (the
    failure) is stored and returned, as when no retries are left."""
    worker = start_worker(TOOLS, concurrency=1, TOOLCHORD_BROKER_URL=broker_redis.url)
    app = create_app(settings_for(redis_url, broker_redis.url), Registry.from_modules([TOOLS]))
    task = send_call(app, "gated_flaky", {"key": "k-gated"}, "idem-k-gated", time.time() + 60)
    wait_for(lambda: clean_redis.get("tc-test:attempts:k-gated") == b"1", 30, "the handler to start")
    broker_redis.stop()
    clean_redis.set("tc-test:gate:k-gated", 1)
    wait_for(lambda: _retry_publish_failed(worker), 30, "the retry's publish to fail")
    store = RedisIdempotencyStore.from_url(redis_url)
    wait_for(lambda: task_meta(app, task.id).get("status") == "SUCCESS", 60, "the task's own result")
    (returned,) = task_meta(app, task.id)["result"]
    assert (returned["status"], returned["error"]["code"]) == ("error", ErrorCode.EXECUTION_ERROR.value), returned
    assert "attempt 1 failed" in returned["error"]["message"], returned
    assert json.loads(store.result("idem-k-gated") or "{}") == returned
    assert clean_redis.get("tc-test:attempts:k-gated") == b"1"

