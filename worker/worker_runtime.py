"""Per-process worker state: settings, tools, and the idempotency and spill stores."""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from functools import cached_property
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.concurrency.thread import TaskPool as ThreadTaskPool
from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_ready

from toolchord.worker.config import Settings
from toolchord.worker.idempotency import IdempotencyStore, LeaseRenewer
from toolchord.worker.limits import Limiter, MemoryLimiter, RedisLimiter
from toolchord.worker.pending_writes import PendingWrites
from toolchord.worker.registry import Registry
from toolchord.worker.spill import SpillStore, read_output_tool
from toolchord.worker.stores import WorkerStores, stores_for

_RUNTIMES: weakref.WeakSet[WorkerRuntime] = weakref.WeakSet()


class WorkerRuntime:
    """Per-process state the tasks use: settings, tools, the idempotency and spill stores."""

    def __init__(self, settings: Settings, registry: Registry) -> None:
        _RUNTIMES.add(self)
        self.settings = settings
        self.registry = registry
        registry.add_missing([read_output_tool(_RuntimeSpill(self))])
        # Bookkeeping writes sent with the next claim (the call timeline's "running" record).
        self.pending_writes = PendingWrites()
        self._embedded_worker: threading.Thread | None = None
        self._lock = threading.Lock()
        # The in-memory transport keeps its queues process-wide: each embedded app gets queues of
        # its own, or one embedded worker would take another's calls (and not know their tools).
        self._queue_prefix = f"embedded-{uuid.uuid4().hex[:12]}." if settings.embedded else ""
        # Where the embedded worker appends call timings for the timeline page (no Redis to hold them).
        self.timeline_dir: Path | None = None

    def queue(self, name: str | None = None) -> str:
        """The broker queue for a tool's queue name (the default queue when None)."""
        return self._queue_prefix + (name or self.settings.default_queue)

    @cached_property
    def stores(self) -> WorkerStores:
        # This runtime's own stores: several embedded apps in one process never share spills.
        return stores_for(self.settings, pending=self.pending_writes)

    @property
    def redis(self) -> redis.Redis | None:
        """The client of the configured Redis (None in embedded mode without one)."""
        return self.stores.redis

    @property
    def store(self) -> IdempotencyStore:
        return self.stores.idempotency

    @cached_property
    def lease_renewer(self) -> LeaseRenewer:
        return LeaseRenewer(self.store, self.settings.claim_lease)

    @cached_property
    def limiter(self) -> Limiter:
        """The tools' fleet-wide limits: on the configured Redis, else this process is the fleet."""
        client = self.redis
        return RedisLimiter(client) if client is not None else MemoryLimiter()

    @property
    def spill(self) -> SpillStore:
        return self.stores.spill

    def reset_connections(self) -> None:
        """Forget connections inherited over fork; each pool child opens its own."""
        stores = self.__dict__.get("stores")
        if stores is not None and stores.redis is not None:  # in-memory stores hold no connection to drop
            for name in ("stores", "lease_renewer", "limiter"):
                self.__dict__.pop(name, None)

    def start_embedded_worker(self, app: Celery) -> None:
        """Start the in-process worker thread once (embedded mode only)."""
        with self._lock:
            if self._embedded_worker is not None:
                return
            # WorkController, not app.Worker: the latter installs signal handlers (main thread only).
            worker = app.WorkController(
                pool_cls=AppBoundThreadPool,
                concurrency=8,
                loglevel="WARNING",
                without_heartbeat=True,
                without_mingle=True,
                without_gossip=True,
                queues=sorted(self.queue(name) for name in queues_of(self.registry, self.settings)),
                hostname="embedded@toolchord",
            )
            from toolchord.worker.sandbox import log_layers

            log_layers()
            thread = threading.Thread(target=worker.start, name="toolchord-embedded-worker", daemon=True)
            thread.start()
            self._embedded_worker = thread


class _RuntimeSpill:
    """A runtime's spill store as its `read_output` reads it: looked up at each call, so a pool
    child (which reopens its connections after fork) reads through its own."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self._runtime = runtime

    def put(self, session_id: str, text: str) -> str:
        return self._runtime.spill.put(session_id, text)

    def read(self, session_id: str, ref: str, offset: int, limit: int) -> tuple[str, int] | None:
        return self._runtime.spill.read(session_id, ref, offset, limit)


class AppBoundThreadPool(ThreadTaskPool):
    """Celery's thread pool, running tasks of its own app.

    The stock pool resolves task names on `current_app`, which is another app when several
    embedded orchestrators live in one process (tests, notebooks); passing `app` pins it.
    """

    def on_apply(self, target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        return super().on_apply(target, args, {**(kwargs or {}), "app": self.app}, **options)


def queues_of(registry: Registry, settings: Settings) -> set[str]:
    """Every queue the registry's tools use, plus the default one."""
    return {settings.default_queue} | {spec.queue for spec in registry if spec.queue}


def runtime_of(app: Celery) -> WorkerRuntime:
    """The toolchord runtime attached to an app made by `create_app`."""
    runtime = getattr(app, "toolchord", None)
    if not isinstance(runtime, WorkerRuntime):
        raise TypeError("this Celery app was not made by toolchord.create_app()")
    return runtime


@worker_init.connect
def _probe_sandbox(**_: Any) -> None:
    # In the main process, before the pool forks: children reuse the cached probe.
    from toolchord.worker.sandbox.capabilities import tools_missing_required

    missing = tools_missing_required(spec for runtime in _RUNTIMES for spec in runtime.registry)
    if missing:
        # Every call of these tools would fail: stop here, where the operator sees it. SystemExit,
        # because Celery logs and ignores the exceptions its signal handlers raise.
        message = "toolchord worker refuses to start: required sandbox layers unavailable here: " + "; ".join(
            f"tool {name} requires {', '.join(layers)}" for name, layers in sorted(missing.items())
        ) + " (see the sandbox layer lines of this log and docs/sandbox.md)"
        from toolchord.worker.sandbox import log_layers

        log_layers()
        logging.getLogger("toolchord.sandbox").error(message)
        raise SystemExit(message)


@worker_ready.connect
def _report_sandbox_layers(**_: Any) -> None:
    # Once logging is set up, so the line reaches the worker's log.
    from toolchord.worker.sandbox import log_layers

    log_layers()


@worker_process_init.connect
def _fresh_connections_after_fork(**_: Any) -> None:
    for runtime in _RUNTIMES:
        runtime.reset_connections()


@worker_process_init.connect
def _start_sandbox_zygote(**_: Any) -> None:
    # In the background, so the pool child reports to Celery in time; calls wait for it if needed.
    from toolchord.worker.sandbox import start_zygote

    start_zygote([m for runtime in _RUNTIMES for m in runtime.settings.tool_modules], wait=False)


@worker_process_shutdown.connect
def _release_sandbox(**_: Any) -> None:
    # A pool process ends with os._exit (billiard), past the exit hooks that let the zygote's spares
    # go: without this, every pool process that ends (a warm stop, a recycled process) would leave
    # the workdirs of its spares behind for good, and their cgroups until another worker starts.
    from toolchord.worker.sandbox import release_before_exit

    release_before_exit()
