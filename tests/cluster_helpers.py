"""Helpers for tests that run turns on the private Redis and real workers (tests/celery_tools.py)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult

from toolchord.orchestrator import Orchestrator
from toolchord.worker import Registry, ToolCall
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.payloads import CallPayload
from toolchord.worker.result_backend import call_task_id
from toolchord.worker.tasks import TASK_NAMES

TOOLS = "tests.celery_tools"


def settings_for(url: str, broker_url: str | None = None) -> Settings:
    """Settings matching the workers the fixtures start (see tests/conftest.py worker_env); the
    broker is the Redis at `url` unless `broker_url` names another (RabbitMQ)."""
    return Settings(broker_url=broker_url or url, result_backend=url, redis_url=url, visibility_timeout=8,
                    claim_lease=2)


def orchestrator(url: str, broker_url: str | None = None, **kwargs: Any) -> Orchestrator:
    """An orchestrator on the test cluster with the test tools."""
    registry = Registry.from_modules([TOOLS])
    return Orchestrator(registry, create_app(settings_for(url, broker_url), registry), **kwargs)


def call(i: int, name: str, **args: object) -> ToolCall:
    """The model's i-th call of a turn."""
    return ToolCall(id=f"call_{i}", name=name, arguments_raw=json.dumps(args), index=i)


def effects(client: redis.Redis, key: str) -> int:
    """How many times a counting tool acted for `key`."""
    return int(client.get(f"tc-test:effects:{key}") or 0)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start `fn` in a thread; its return value lands in the box under "value"."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, box


def send_call(app: Celery, name: str, arguments: dict[str, Any], key: str, deadline: float) -> AsyncResult:
    """Send one call of a test tool straight to the workers, as the orchestrator sends a call (its
    task, payload and time limits) but outside any turn: its task keeps its own result, which
    `task_meta` reads, and the idempotency store has it under `key`."""
    spec = Registry.from_modules([TOOLS])[name]
    payload = CallPayload(call=call(0, name, **arguments), arguments=arguments, key=key, session_id="s-" + key,
                          turn_id="t-" + key, deadline=deadline)
    # A call task's id, as the orchestrator gives: the result backend subscribes to nothing for it,
    # so the call can be sent while the backend's Redis is away.
    return app.signature(TASK_NAMES[spec.side_effect], kwargs={"payload": payload.model_dump(mode="json")},
                         task_id=call_task_id(uuid.uuid4().hex), time_limit=spec.timeout + 10).apply_async()


def task_meta(app: Celery, task_id: str) -> dict[str, Any]:
    """What the result backend holds for a task (nothing while its Redis is away)."""
    try:
        return dict(app.backend.get_task_meta(task_id))
    except redis.ConnectionError:
        return {}
