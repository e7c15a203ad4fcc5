"""The Celery app: configuration, the per-process worker runtime, and the embedded mode.

`create_app()` builds an app from the environment (or explicit `Settings`); `app` is the one
configured from the environment for `celery -A worker.celery_app` and `toolchord worker`.
With no broker configured, the app is embedded: in-memory transport and result backend, and
`start_embedded_worker()` runs a worker thread in this process — the same tasks, one process.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from worker.config import Settings
from worker.observability import signals as _observability  # noqa: F401 - connects its signal receivers
from worker.registry import Registry
from worker.tasks import register_tasks
from worker.worker_runtime import WorkerRuntime, queues_of, runtime_of

# The in-memory transport polls; the default one-second poll would make every embedded turn slow.
EMBEDDED_POLL_SECONDS = 0.002


def _celery_config(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "result_expires": settings.result_ttl,
        "result_extended": False,
        "worker_prefetch_multiplier": 1,
        # Workers send task events (Flower shows every call from "received" on); publishers don't
        # send "sent" events and no STARTED state is stored: each costs a round trip per call, and
        # toolchord knows a call started from its idempotency claim.
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "task_track_started": False,
        "broker_connection_retry_on_startup": True,
    }
    if settings.embedded:
        config.update(
            broker_url="memory://localhost/",
            result_backend="cache+memory://",
            broker_transport_options={"polling_interval": EMBEDDED_POLL_SECONDS},
            worker_send_task_events=False,
            # The embedded worker lives in the user's process: leave its logging alone.
            worker_hijack_root_logger=False,
        )
    else:
        transport = {
            "visibility_timeout": settings.visibility_timeout,
            # Kombu sweeps for messages of dead workers every interval x throttle seconds (100 s
            # by default); sweep a few times per visibility timeout so redelivery follows it.
            "unacked_restore_interval": max(1, settings.visibility_timeout // 4),
            "unacked_restore_throttle": 1,
        }
        config.update(
            broker_url=settings.broker_url,
            result_backend=settings.result_backend,
            broker_transport_options=transport,
            result_backend_transport_options=transport,
            redis_backend_health_check_interval=30,
            result_chord_join_timeout=10,
        )
    return config


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> Celery:
    """A Celery app with toolchord's tasks. Tools come from `registry` plus TOOLCHORD_TOOL_MODULES."""
    settings = settings if settings is not None else Settings.from_env()
    tools = Registry.from_modules(settings.tool_modules)
    if registry is not None:
        tools.add_missing(registry)
    app = Celery("toolchord", set_as_current=False)
    app.conf.update(_celery_config(settings))
    runtime = app.toolchord = WorkerRuntime(settings, tools)  # type: ignore[attr-defined]
    app.conf.task_default_queue = runtime.queue()
    register_tasks(app)
    return app


app = create_app()

__all__ = ["EMBEDDED_POLL_SECONDS", "WorkerRuntime", "app", "create_app", "queues_of", "runtime_of"]
