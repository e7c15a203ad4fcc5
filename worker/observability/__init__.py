"""Observability of calls on workers: OpenTelemetry spans, Prometheus metrics, call timings.

All optional: without the `otel` / `metrics` extras the hooks do nothing. See docs/operations.md.
"""

from __future__ import annotations

from toolchord.worker.observability.call_timeline import CallTiming, read_timings
from toolchord.worker.observability.hooks import ObservedStore, observe_sandbox_run
from toolchord.worker.observability.metrics import QueueDepthCollector, metrics
from toolchord.worker.observability.tracing import (
    TRACE_FILE_ENV,
    JsonLinesSpanExporter,
    configure_from_env,
    span,
)

__all__ = [
    "TRACE_FILE_ENV",
    "CallTiming",
    "JsonLinesSpanExporter",
    "ObservedStore",
    "QueueDepthCollector",
    "configure_from_env",
    "metrics",
    "observe_sandbox_run",
    "read_timings",
    "span",
]
