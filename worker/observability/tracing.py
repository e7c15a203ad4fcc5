"""Optional OpenTelemetry tracing: spans when `opentelemetry-api` is installed, no-ops otherwise.

toolchord only uses the OpenTelemetry API; which SDK, exporter and sampler run is the operator's
choice (`opentelemetry-instrument`, or a `TracerProvider` set up by the application). For a worker
that should write spans without any collector, `TOOLCHORD_TRACE_FILE=<path>` installs the SDK with
`JsonLinesSpanExporter` (one JSON span per line), which the tests read across processes.

Span attributes name the session, turn, call, tool, side-effect class, attempt and error code;
never the arguments or the output (docs/architecture.md, "Output shaping": redaction holds in every sink).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind
except ImportError:  # the `otel` extra is not installed: every helper here is a no-op
    trace = None  # type: ignore[assignment]

TRACER_NAME = "toolchord"
TRACE_FILE_ENV = "TOOLCHORD_TRACE_FILE"
# W3C trace-context fields carried in the Celery message headers.
_PROPAGATED = ("traceparent", "tracestate")

Attributes = Mapping[str, str | int | float | bool | None]


def enabled() -> bool:
    """Whether the OpenTelemetry API is importable (spans may still be dropped by a no-op provider)."""
    return trace is not None


def _tracer() -> Any:
    """toolchord's tracer, or None while no SDK provider is installed: the API's default provider
    only hands out no-op spans, which still cost tens of microseconds each on every call's path."""
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return provider.get_tracer(TRACER_NAME)


def _clean(attributes: Attributes | None) -> dict[str, str | int | float | bool]:
    return {k: v for k, v in (attributes or {}).items() if v is not None}


@contextlib.contextmanager
def span(name: str, attributes: Attributes | None = None) -> Iterator[Any]:
    """A span around a block, child of the current one; yields the span (None without a tracer provider)."""
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(name, attributes=_clean(attributes)) as current:
        yield current


def set_attributes(target: Any, attributes: Attributes) -> None:
    """Set attributes on a span from `span()` or `OpenSpan` (ignores None values and no span)."""
    if target is not None:
        target.set_attributes(_clean(attributes))


def inject(headers: MutableMapping[str, Any]) -> None:
    """Put the current trace context into a message's headers, unless they already carry one.

    A retried task is republished with its original headers: keeping them makes every attempt a
    child of the turn that asked for the call.
    """
    if trace is None or any(headers.get(field) for field in _PROPAGATED):
        return
    propagate.inject(headers)


def _carrier(request: Any) -> dict[str, str]:
    """The trace-context fields of a Celery task request (custom headers become request attributes)."""
    nested = getattr(request, "headers", None) or {}
    found: dict[str, str] = {}
    for field in _PROPAGATED:
        value = getattr(request, field, None) or nested.get(field)
        if isinstance(value, str):
            found[field] = value
    return found


class OpenSpan:
    """A span started in one callback and ended in another (Celery's task_prerun / task_postrun),
    current in between so the work's own spans become its children."""

    def __init__(self, name: str, request: Any, attributes: Attributes) -> None:
        self.span: Any = None
        self._token: Any = None
        if trace is None:
            return
        parent = propagate.extract(_carrier(request))
        tracer = _tracer()
        if tracer is None:
            # No span here, but the caller's trace context stays current: messages the task
            # publishes (a retry, the chord's callback) still carry it.
            self._token = otel_context.attach(parent)
            return
        self.span = tracer.start_span(
            name, context=parent, kind=SpanKind.CONSUMER, attributes=_clean(attributes)
        )
        self._token = otel_context.attach(trace.set_span_in_context(self.span))

    def end(self, attributes: Attributes, error: bool = False) -> None:
        if self.span is None:
            if self._token is not None:
                otel_context.detach(self._token)
            return
        self.span.set_attributes(_clean(attributes))
        if error:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR))
        otel_context.detach(self._token)
        self.span.end()


_configured = threading.Lock()


def configure_from_env(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Install the SDK with a JSON-lines file exporter when TOOLCHORD_TRACE_FILE is set.

    Returns whether it did. Leaves an application's own provider alone (the API keeps the first).
    """
    path = (os.environ if env is None else env).get(TRACE_FILE_ENV)
    if not path or trace is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    except ImportError:
        return False
    with _configured:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        # Simple (synchronous) processing: no export thread to lose over a prefork fork.
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
        trace.set_tracer_provider(provider)
    return True


def _exporter_base() -> type:
    try:
        from opentelemetry.sdk.trace.export import SpanExporter
    except ImportError:
        return object
    return SpanExporter


class JsonLinesSpanExporter(_exporter_base()):  # type: ignore[misc]
    """An SDK span exporter appending each finished span as one JSON line to a file.

    Opens the file per batch in append mode, so every process (prefork children included) can
    share one path.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(s.to_json(indent=None) + "\n" for s in spans)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


__all__ = [
    "TRACER_NAME",
    "TRACE_FILE_ENV",
    "JsonLinesSpanExporter",
    "OpenSpan",
    "configure_from_env",
    "enabled",
    "inject",
    "set_attributes",
    "span",
]
