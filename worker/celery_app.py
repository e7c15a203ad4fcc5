"""The Celery app: configuration, the per-process worker runtime, and the embedded mode.

`create_app()` builds an app from the environment (or explicit `Settings`); `app` is the one
configured from the environment for `celery -A toolchord.worker.celery_app` and `toolchord worker`, built
lazily on first access (`default_app()`).
With no broker configured, the app is embedded: in-memory transport and result backend, and
`start_embedded_worker()` runs a worker thread in this process — the same tasks, one process.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from celery import Celery
from celery.app.amqp import AMQP

import toolchord.worker.hard_limit  # noqa: F401 - connects its signal receivers
from toolchord.worker.config import Settings
from toolchord.worker.kombu_redis import TRANSPORTS as REDIS_TRANSPORTS
from toolchord.worker.observability import signals as _observability  # noqa: F401 - connects its signal receivers
from toolchord.worker.rabbit_queues import queue_config, queue_mismatch_named
from toolchord.worker.redis_clients import REDIS_SOCKET_TIMEOUT, is_redis_url, is_sentinel_url, scheme_of
from toolchord.worker.registry import Registry
from toolchord.worker.tasks import register_tasks
from toolchord.worker.worker_runtime import WorkerRuntime, queues_of, runtime_of

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
        # Workers send task events only with TOOLCHORD_TASK_EVENTS=on, or once a Flower asks them
        # to (Flower broadcasts `enable_events` while it runs): each event is a PUBLISH in the
        # worker's main process, up to three per task, and the main process also fetches and acks.
        # Publishers don't send "sent" events and no STARTED state is stored: each costs a round
        # trip per call, and toolchord knows a call started from its idempotency claim.
        "worker_send_task_events": settings.task_events,
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
        config.update(
            broker_url=settings.broker_url,
            result_backend=settings.result_backend,
            result_chord_join_timeout=10,
            **_broker_config(settings),
            **_backend_config(settings),
        )
    return config


def _broker_config(settings: Settings) -> dict[str, Any]:
    """Settings that belong to the broker in use (docs/operations.md, "Choosing a broker")."""
    if settings.broker_kind == "amqp":
        return {
            # The publisher waits for RabbitMQ's confirm: a call the orchestrator recorded as sent
            # is on the queue, not in a socket buffer when the broker restarts.
            "broker_transport_options": {"confirm_publish": True},
            # Quorum queues (replicated, no priorities) or classic queues with priorities for the
            # default queue and every tool queue (worker/rabbit_queues.py).
            **queue_config(settings.rabbitmq_queue_type),
        }
    if settings.broker_kind == "redis":
        transport: dict[str, Any] = {
            # Redis has no acks: a message taken and not acknowledged within the visibility timeout
            # is given to another worker (RabbitMQ redelivers when the consumer's connection drops).
            "visibility_timeout": settings.visibility_timeout,
            # Kombu sweeps for messages of dead workers every interval x throttle seconds (100 s
            # by default); sweep a few times per visibility timeout so redelivery follows it.
            "unacked_restore_interval": max(1, settings.visibility_timeout // 4),
            "unacked_restore_throttle": 1,
            # The sweep holds a Redis lock (300 s by default): a worker killed mid-sweep would
            # stop every redelivery until it lapses. A sweep takes milliseconds.
            "unacked_mutex_expire": min(300, max(5, settings.visibility_timeout // 2)),
            # Ten priority lists per queue (0 is taken first): fair share (orchestrator/fair_share.py).
            "priority_steps": list(range(10)),
            # A partitioned Redis is an error after this long, not a block without end: a publish
            # in a pool process, the worker's main process (which enforces Celery's hard limit).
            # BRPOP waits 1 s per call, well within it.
            "socket_timeout": REDIS_SOCKET_TIMEOUT,
            "socket_connect_timeout": REDIS_SOCKET_TIMEOUT,
        }
        if is_sentinel_url(settings.broker_url):
            transport["master_name"] = settings.redis_master_name
        config: dict[str, Any] = {"broker_transport_options": transport}
        # kombu's Redis transport with a fix for a worker exiting on a short Redis restart
        # (toolchord.worker.kombu_redis).
        patched = REDIS_TRANSPORTS.get(scheme_of(settings.broker_url))
        if patched is not None:
            config["broker_transport"] = patched
        return config
    return {}


def _backend_config(settings: Settings) -> dict[str, Any]:
    """Settings of the Redis result backend (a server or a Sentinel group)."""
    if not is_redis_url(settings.result_backend):
        return {}
    config: dict[str, Any] = {
        "redis_backend_health_check_interval": 30,
        # As the broker's (Celery's default is 120 s, and no connect timeout): the chord counter in
        # a pool process and the orchestrator's reads fail over a partition instead of hanging.
        "redis_socket_timeout": REDIS_SOCKET_TIMEOUT,
        "redis_socket_connect_timeout": REDIS_SOCKET_TIMEOUT,
    }
    if is_sentinel_url(settings.result_backend):
        timeouts = {"socket_timeout": REDIS_SOCKET_TIMEOUT, "socket_connect_timeout": REDIS_SOCKET_TIMEOUT}
        # The sentinels are asked with the same timeouts (Celery passes none of its own to them).
        config["result_backend_transport_options"] = {"master_name": settings.redis_master_name,
                                                      "sentinel_kwargs": timeouts}
    return config


def _backend_class(settings: Settings) -> str | None:
    """The result backend for a Redis URL: toolchord's class that does not subscribe to a result
    channel per call task (worker/result_backend.py), with the URL in Celery's `module:Class+url`
    form; None lets Celery pick by `result_backend` alone."""
    if settings.embedded:
        return None
    url, scheme = settings.result_backend, scheme_of(settings.result_backend)
    if is_sentinel_url(url):
        return f"toolchord.worker.result_backend:CallAwareSentinelBackend+{url}"
    if scheme in ("redis", "rediss"):
        return f"toolchord.worker.result_backend:CallAwareRedisBackend+{url}"
    return None


class ToolchordAMQP(AMQP):
    """Celery's AMQP layer, naming a RabbitMQ queue that exists as another type (QueueMismatch) when
    the worker declares the queues it consumes, at start and after every reconnection."""

    def TaskConsumer(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Celery's name
        with queue_mismatch_named(runtime_of(self.app).settings.rabbitmq_queue_type):
            return super().TaskConsumer(*args, **kwargs)


class ToolchordCelery(Celery):
    """Celery, with retry countdowns RabbitMQ's quorum queues can carry, and QueueMismatch for a
    queue that exists as another type, on the worker and on the publisher.

    On quorum queues Celery delays a message through its native delayed delivery, which counts in
    whole seconds and rejects a countdown in (0, 1) ("countdown must be a positive number") after
    the attempt has already ended; toolchord's jittered backoff is often below a second. A
    fractional countdown is rounded up, so a retry never comes sooner than its backoff asked.
    Classic queues need none of this: the worker holds a countdown until it is due.
    """

    amqp_cls = ToolchordAMQP
    whole_second_countdowns = False

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        countdown = options.get("countdown")
        if self.whole_second_countdowns and countdown:
            options["countdown"] = math.ceil(countdown)
        # Every publish declares its queue first (kombu), so a mismatch shows here on the publisher.
        with queue_mismatch_named(runtime_of(self).settings.rabbitmq_queue_type):
            return super().send_task(name, *args, **options)


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> Celery:
    """A Celery app with toolchord's tasks. Tools come from `registry` plus TOOLCHORD_TOOL_MODULES."""
    settings = settings if settings is not None else Settings.from_env()
    tools = Registry.from_modules(settings.tool_modules)
    if registry is not None:
        tools.add_missing(registry)
    app = ToolchordCelery("toolchord", set_as_current=False)
    app.conf.update(_celery_config(settings))
    # Celery builds its backend from `backend_cls` before `result_backend`, which stays the plain URL.
    app.backend_cls = _backend_class(settings)
    app.whole_second_countdowns = settings.broker_kind == "amqp" and settings.rabbitmq_queue_type == "quorum"
    runtime = app.toolchord = WorkerRuntime(settings, tools)
    app.conf.task_default_queue = runtime.queue()
    register_tasks(app)
    return app


app: Celery  # built on first access by __getattr__ below (annotation only: no value at import)
_app: Celery | None = None
_app_lock = threading.Lock()


def default_app() -> Celery:
    """The app configured from the environment, built on first use (once per process).

    Importing this module (or `toolchord`, or `toolchord.orchestrator`) reads no environment and imports no tool modules;
    `toolchord.worker.celery_app.app`, which `celery -A toolchord.worker.celery_app` and `toolchord worker` load, is
    this app.
    """
    global _app
    with _app_lock:
        if _app is None:
            _app = create_app()
        return _app


def __getattr__(name: str) -> Any:
    if name == "app":
        return default_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "EMBEDDED_POLL_SECONDS",
    "ToolchordAMQP",
    "ToolchordCelery",
    "WorkerRuntime",
    "app",
    "create_app",
    "default_app",
    "queues_of",
    "runtime_of",
]
