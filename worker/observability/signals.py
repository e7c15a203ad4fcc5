"""Celery signal receivers that observe toolchord calls without touching the task code.

- `before_task_publish` (the orchestrator, or a worker retrying): the trace context and the publish
  time go into the message headers.
- `task_prerun` / `task_postrun` (the worker): a `toolchord.call` span per delivery, child of the
  turn that published it; call metrics; the call's timing record for the timeline page (a delivery
  sent back to wait for a limit is recorded as `waiting`, not as a retry).
- `celeryd_after_setup` / `worker_process_init` / `worker_process_shutdown`: the metrics endpoint
  and the trace exporter of `toolchord worker`.

Importing this module connects the receivers (toolchord.worker.celery_app does).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery.exceptions import Retry
from celery.signals import (
    before_task_publish,
    celeryd_after_setup,
    task_postrun,
    task_prerun,
    worker_process_init,
    worker_process_shutdown,
)
from pydantic import ValidationError

from toolchord.worker.limits import declared_limits
from toolchord.worker.models import ToolResult
from toolchord.worker.observability.call_timeline import CallTiming, add_timing, append_timing, read_timing, save_timing
from toolchord.worker.observability.metrics import (
    LimitUsageCollector,
    QueueDepthCollector,
    mark_process_dead,
    metrics,
    result_code,
    start_server,
)
from toolchord.worker.observability.tracing import OpenSpan, configure_from_env, inject
from toolchord.worker.payloads import CallPayload
from toolchord.worker.pending_writes import Write
from toolchord.worker.tasks import TASK_NAMES
from toolchord.worker.worker_runtime import WorkerRuntime, runtime_of

log = logging.getLogger("toolchord.observability")

METRICS_PORT_ENV = "TOOLCHORD_METRICS_PORT"
METRICS_ADDRESS_ENV = "TOOLCHORD_METRICS_ADDRESS"
# Two small Redis writes per call (start, end) feed the timeline page, riding in the claim's and the
# stored result's pipelines; `off` saves them.
CALL_TIMELINE_ENV = "TOOLCHORD_CALL_TIMELINE"
PUBLISHED_HEADER = "toolchord_published_at"
_OFF = ("0", "off", "false", "no")
_CALL_TASKS = {name: side_effect for side_effect, name in TASK_NAMES.items()}


@dataclass
class _Delivery:
    runtime: WorkerRuntime
    payload: CallPayload
    timing: CallTiming
    span: OpenSpan
    # The "done" record queued to go with the stored result (None until the result is ready).
    done_write: Write | None = None


# Deliveries between prerun and postrun, by task id (thread pools run several at once).
_open: dict[str, _Delivery] = {}
_open_lock = threading.Lock()


@before_task_publish.connect
def _on_publish(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is None or not (sender or "").startswith("toolchord."):
        return
    inject(headers)
    headers[PUBLISHED_HEADER] = time.time()


def _timeline(runtime: WorkerRuntime) -> redis.Redis | None:
    """Where call timings go: None when embedded without Redis or switched off."""
    if os.environ.get(CALL_TIMELINE_ENV, "on").lower() in _OFF:
        return None
    return runtime.redis


def _save(runtime: WorkerRuntime, timing: CallTiming) -> None:
    client = _timeline(runtime)
    if client is None:
        if runtime.timeline_dir is not None and os.environ.get(CALL_TIMELINE_ENV, "on").lower() not in _OFF:
            try:
                append_timing(runtime.timeline_dir, timing)
            except OSError as exc:
                log.debug("call timing of %s not saved: %s", timing.call_id, exc)
        return
    try:
        save_timing(client, timing, runtime.settings.result_ttl)
    except redis.RedisError as exc:
        # The timeline is a view: a lost record must not touch the call.
        log.debug("call timing of %s not saved: %s", timing.call_id, exc)


def _first_start(runtime: WorkerRuntime, payload: CallPayload, attempt: int, now: float) -> float:
    """When the call's first attempt started (one read, on retries only)."""
    client = _timeline(runtime)
    if attempt == 1 or client is None:
        return now
    try:
        earlier = read_timing(client, payload.session_id, payload.turn_id, payload.call.id)
    except redis.RedisError:
        return now
    return (earlier.first_started_at or earlier.started_at) if earlier is not None else now


@task_prerun.connect
def _on_prerun(task_id: str = "", task: Any = None, kwargs: dict[str, Any] | None = None, **_: Any) -> None:
    side_effect = _CALL_TASKS.get(getattr(task, "name", ""))
    if side_effect is None:
        return
    try:
        payload = CallPayload.model_validate((kwargs or {}).get("payload"))
        runtime = runtime_of(task.app)
    except (ValidationError, TypeError):
        return  # the task reports the bad payload itself
    request = task.request
    now = time.time()
    published = getattr(request, PUBLISHED_HEADER, None)
    queue = (request.delivery_info or {}).get("routing_key")
    timing = CallTiming(
        session_id=payload.session_id, turn_id=payload.turn_id, call_id=payload.call.id, tool=payload.call.name,
        side_effect=side_effect, key=payload.key, queue=queue,
        published_at=published if isinstance(published, (int, float)) else None,
        started_at=now, worker=request.hostname, attempts=request.retries + 1 - payload.waits,
        waiting_for=payload.waiting_for, waiting_since=payload.waiting_since,
    )
    timing.first_started_at = _first_start(runtime, payload, timing.attempts, now)
    span = OpenSpan("toolchord.call", request, {
        "toolchord.session_id": payload.session_id, "toolchord.turn_id": payload.turn_id,
        "toolchord.call_id": payload.call.id, "toolchord.tool": payload.call.name,
        "toolchord.side_effect": side_effect, "toolchord.attempt": timing.attempts,
        "toolchord.worker": request.hostname, "celery.task_id": task_id,
    })
    delivery = _Delivery(runtime, payload, timing, span)
    with _open_lock:
        _open[task_id] = delivery
    m = metrics()
    # First attempts only: a retry's wait is mostly its backoff.
    if m is not None and timing.published_at is not None and timing.attempts == 1:
        m.queue_seconds.labels(queue or "").observe(max(now - timing.published_at, 0.0))
    if _timeline(runtime) is not None:
        # The "running" record goes with the call's claim, the "done" one with its stored result:
        # the same round trips. The running record's TTL also covers the time the call may still
        # run (up to its deadline), so the done record needs no EXPIRE of its own.
        ttl, running = runtime.settings.result_ttl, timing.model_copy()
        running_ttl = ttl + max(int(payload.deadline - now) + 1, 0)
        runtime.pending_writes.add(lambda pipe: add_timing(pipe, running, running_ttl))
        runtime.pending_writes.on_result(lambda result: _done_write(delivery, result))
    else:
        _save(runtime, timing)


def _finish(timing: CallTiming, result: dict[str, Any]) -> None:
    """Mark `timing` done with `result` (a result dict; empty when the task returned none)."""
    timing.phase = "done"
    timing.code = result_code(result) if result else "error"
    timing.attempts = int(result.get("attempts") or timing.attempts)


def _done_write(delivery: _Delivery, result: ToolResult) -> Write:
    """The "done" record of a call whose result is about to be stored (the delivery remembers it).

    It goes in the pipeline of the stored result, never before the delivery's "running" record
    (queued ahead of it, or sent already), whose TTL covers it."""
    done = delivery.timing.model_copy()
    done.finished_at = time.time()
    _finish(done, result.model_dump(mode="json", include={"status", "error", "attempts"}))

    def write(pipe: Any) -> None:
        add_timing(pipe, done, None)

    delivery.done_write = write
    return write


@task_postrun.connect
def _on_postrun(task_id: str = "", retval: Any = None, state: str | None = None, **_: Any) -> None:
    with _open_lock:
        delivery = _open.pop(task_id, None)
    if delivery is None:
        return
    # A delivery that never claimed (unknown tool, deadline passed) still holds its "running"
    # record: the final record below replaces it. A "done" record that went with the stored result
    # is not written again; one whose pipeline failed is still queued, and written below.
    pending = delivery.runtime.pending_writes
    pending.on_result(None)
    done_sent = delivery.done_write is not None and delivery.done_write not in pending.take()
    timing = delivery.timing
    timing.finished_at = time.time()
    m = metrics()
    waited = _waited(retval, delivery.payload) if state == "RETRY" else None
    if waited is not None:
        # Back in the broker until a limit admits it: no attempt, no run.
        timing.phase, timing.finished_at = "waiting", None
        timing.waiting_for, timing.waiting_since = waited.waiting_for, waited.waiting_since
        delivery.span.end({"toolchord.waiting_for": waited.waiting_for})
        _save(delivery.runtime, timing)
        return
    if state == "RETRY":
        timing.phase = "retrying"
        delivery.span.end({"toolchord.retry": True})
        if m is not None:
            m.retries.labels(timing.tool, timing.side_effect).inc()
    else:
        result = retval[-1] if isinstance(retval, list) and retval and isinstance(retval[-1], dict) else {}
        _finish(timing, result)
        failed = timing.code != "ok"
        delivery.span.end({"toolchord.error_code": timing.code if failed else None}, error=failed)
        if m is not None:
            m.calls.labels(timing.tool, timing.side_effect, timing.code).inc()
    if m is not None:
        m.call_seconds.labels(timing.tool, timing.side_effect).observe(timing.finished_at - timing.started_at)
    if not done_sent:
        _save(delivery.runtime, timing)


def _waited(retry: Any, payload: CallPayload) -> CallPayload | None:
    """The payload re-published by a retry that only waits for a limit (its `waits` grew), else None."""
    sent = retry.sig.kwargs.get("payload") if isinstance(retry, Retry) and retry.sig is not None else None
    try:
        again = CallPayload.model_validate(sent)
    except ValidationError:
        return None
    return again if again.waits > payload.waits and again.waiting_for else None


@celeryd_after_setup.connect
def _serve_metrics(instance: Any = None, **_: Any) -> None:
    # In the worker's main process, before the pool forks: the children write, this one serves
    # (`toolchord worker --metrics-port` prepared the directory).
    port = os.environ.get(METRICS_PORT_ENV)
    if not port or instance is None:
        return
    queues = list(instance.app.amqp.queues.consume_from or instance.app.amqp.queues)
    address = os.environ.get(METRICS_ADDRESS_ENV, "127.0.0.1")
    runtime = runtime_of(instance.app)
    start_server(int(port), address, [QueueDepthCollector(instance.app, queues),
                                      LimitUsageCollector(runtime.limiter, declared_limits(runtime.registry))])
    log.info("metrics on http://%s:%s/metrics", address, port)


@worker_process_init.connect
def _configure_tracing(**_: Any) -> None:
    configure_from_env("toolchord-worker")


@worker_process_shutdown.connect
def _forget_process(**_: Any) -> None:
    mark_process_dead(os.getpid())


__all__ = ["CALL_TIMELINE_ENV", "METRICS_ADDRESS_ENV", "METRICS_PORT_ENV", "PUBLISHED_HEADER"]
