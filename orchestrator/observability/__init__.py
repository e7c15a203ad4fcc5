"""Orchestrator observability: a span and metrics per turn, and the metrics endpoint to mount.

See docs/operations.md. Tracing needs the `otel` extra, metrics the `metrics` extra.
"""

from __future__ import annotations

from toolchord.orchestrator.observability.metrics_app import metrics_app, metrics_asgi_app
from toolchord.orchestrator.observability.turns import observed_turn

__all__ = ["metrics_app", "metrics_asgi_app", "observed_turn"]
