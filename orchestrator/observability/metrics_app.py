"""The orchestrator's Prometheus endpoint, as an app users mount in their own web server."""

from __future__ import annotations

from typing import Any

from toolchord.worker.limits import declared_limits
from toolchord.worker.observability.metrics import LimitUsageCollector, QueueDepthCollector, registry
from toolchord.worker.worker_runtime import queues_of


def _registry(orchestrator: Any | None) -> Any:
    extra: list[Any] = []
    if orchestrator is not None:
        runtime = orchestrator.runtime
        queues = [runtime.queue(name) for name in queues_of(orchestrator.registry, runtime.settings)]
        extra.append(QueueDepthCollector(orchestrator.app, queues))
        extra.append(LimitUsageCollector(runtime.limiter, declared_limits(orchestrator.registry)))
    return registry(extra)


def metrics_app(orchestrator: Any | None = None) -> Any:
    """A WSGI app serving this process's metrics (and, given an Orchestrator, its queues' depth and
    its tools' limits' use).

    Mount it at /metrics, e.g. with werkzeug's DispatcherMiddleware or `wsgiref`.
    """
    from prometheus_client import make_wsgi_app

    return make_wsgi_app(_registry(orchestrator))


def metrics_asgi_app(orchestrator: Any | None = None) -> Any:
    """The same as an ASGI app (FastAPI/Starlette: `app.mount("/metrics", metrics_asgi_app(orch))`)."""
    from prometheus_client import make_asgi_app

    return make_asgi_app(_registry(orchestrator))


__all__ = ["metrics_app", "metrics_asgi_app"]
