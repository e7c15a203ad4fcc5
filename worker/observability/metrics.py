"""Prometheus metrics (optional `metrics` extra; every recorder here is a no-op without it).

Worker processes (prefork) write to PROMETHEUS_MULTIPROC_DIR, set by `toolchord worker
--metrics-port`; the worker's main process serves the merged values. An orchestrator serves its
own through `toolchord.orchestrator.observability.metrics_app()`. docs/operations.md lists every metric.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

from amqp.exceptions import ChannelError

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily
except ImportError:  # the `metrics` extra is not installed
    prometheus_client = None  # type: ignore[assignment]

log = logging.getLogger("toolchord.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Tool calls last from milliseconds to minutes.
_CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Claims that took the call's key (run the handler); the other states refuse it.
CLAIM_TAKEN = frozenset({"claimed", "reclaimed"})


class _Metrics:
    def __init__(self) -> None:
        self.calls = Counter(
            "toolchord_calls", "Calls finished on workers, by tool, side-effect class and result code.",
            ["tool", "side_effect", "code"])
        self.retries = Counter("toolchord_call_retries", "Call attempts that ended in a retry.", ["tool", "side_effect"])
        self.call_seconds = Histogram(
            "toolchord_call_duration_seconds", "Time a worker spent on one delivery of a call (claim to store).",
            ["tool", "side_effect"], buckets=_CALL_BUCKETS)
        self.queue_seconds = Histogram(
            "toolchord_call_queue_seconds", "Time a call waited in its queue between publish and start.",
            ["queue"], buckets=_CALL_BUCKETS)
        self.claims = Counter(
            "toolchord_claims", "Idempotency claims by state: claimed/reclaimed take the key, "
            "stored/busy/cancelled refuse it.", ["state", "taken"])
        self.sandbox_kills = Counter(
            "toolchord_sandbox_kills", "Handler runs the sandbox ended early, by tool and reason.", ["tool", "reason"])
        self.turns = Counter("toolchord_turns", "Turns finished by orchestrators.", [])
        self.turn_seconds = Histogram(
            "toolchord_turn_duration_seconds", "Duration of a turn, dispatch to one result per call.", [],
            buckets=_CALL_BUCKETS)
        self.turn_results = Counter(
            "toolchord_turn_results", "Results handed to the model, by tool and result code.", ["tool", "code"])
        self.outcome_unknown = Counter(
            "toolchord_outcome_unknown", "Results reported to the model as OUTCOME_UNKNOWN.", ["tool"])
        self.late_results = Counter(
            "toolchord_late_results", "Results that arrived after their turn ended (reported in a later turn).",
            ["tool"])
        self.limit_refusals = Counter(
            "toolchord_limit_refusals", "Admissions a fleet-wide limit refused (the call waited in the broker, or "
            "got NOT_EXECUTED at its deadline), by limit.", ["limit"])


_METRICS: _Metrics | None = _Metrics() if prometheus_client is not None else None


def metrics() -> _Metrics | None:
    """The process's metric objects, or None when prometheus-client is not installed."""
    return _METRICS


def result_code(result: dict[str, Any]) -> str:
    """`ok`, or the result's error code (what the `code` label holds)."""
    error = result.get("error") or {}
    return "ok" if result.get("status") == "ok" else str(error.get("code") or "error")


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def registry(extra: Iterable[Any] = ()) -> Any:
    """The registry to serve: merged per-process files in multiprocess mode, else the default one."""
    if prometheus_client is None:
        raise RuntimeError("metrics need prometheus-client: pip install 'toolchord[metrics]'")
    # A registry per endpoint, so each may add collectors of its own (queue depth).
    served = CollectorRegistry(auto_describe=True)
    if multiprocess_mode():
        _StartedFilesCollector(served)
    else:
        served.register(prometheus_client.REGISTRY)
    for collector in extra:
        served.register(collector)
    return served


if prometheus_client is not None:
    from prometheus_client.multiprocess import MultiProcessCollector

    class _StartedFilesCollector(MultiProcessCollector):
        """The merged per-process files, without those still at 0 bytes.

        prometheus-client creates a process's file before it sizes it, and reading one at 0
        bytes raises out of the whole merge (prometheus/client_python#1199): a scrape while a
        pool process starts, or forever after one is killed in that window, answered 500. A
        file at 0 bytes holds no value yet, so leaving it out loses nothing."""

        def collect(self) -> Any:
            files = []
            for path in glob.glob(os.path.join(self._path, "*.db")):
                try:
                    if os.path.getsize(path) > 0:
                        files.append(path)
                except FileNotFoundError:  # a live gauge's file, its process marked dead
                    continue
            return self.merge(files, accumulate=True)


class QueueDepthCollector:
    """`toolchord_queue_depth{queue}`: messages waiting per broker queue, read at scrape time.

    Asks the broker with a passive queue declare (kombu), so it works for Redis and AMQP alike.
    """

    def __init__(self, app: Any, queues: Iterable[str]) -> None:
        self.app = app
        self.queues = sorted(set(queues))

    @staticmethod
    def _depth(connection: Any, queue: str) -> int:
        # A channel per queue: AMQP closes the channel of a failed passive declare.
        with connection.channel() as channel:
            try:
                return int(channel.queue_declare(queue=queue, passive=True).message_count)
            except ChannelError:
                # Not declared yet, or (Redis) an empty list, which Redis does not keep: nothing waits.
                return 0

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily("toolchord_queue_depth", "Messages waiting in each toolchord queue.",
                                   labels=["queue"])
        try:
            with self.app.connection_for_read() as connection:
                for queue in self.queues:
                    family.add_metric([queue], self._depth(connection, queue))
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because the broker is away
            log.warning("queue depth unavailable: %s", exc)
        yield family


class LimitUsageCollector:
    """`toolchord_limit_in_use{limit}` and `toolchord_limit_waiting{limit}`: permits held and calls
    waiting per fleet-wide limit, read from the limiter (Redis) at scrape time, one round trip."""

    def __init__(self, limiter: Any, names: Iterable[str]) -> None:
        self.limiter = limiter
        self.names = sorted(set(names))

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        in_use = GaugeMetricFamily("toolchord_limit_in_use", "Concurrency permits held per limit, fleet-wide.",
                                   labels=["limit"])
        waiting = GaugeMetricFamily("toolchord_limit_waiting", "Calls waiting in the broker for a limit.",
                                    labels=["limit"])
        try:
            for usage in self.limiter.usage(self.names):
                in_use.add_metric([usage.name], usage.in_use)
                waiting.add_metric([usage.name], usage.waiting)
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because Redis is away
            log.warning("limit usage unavailable: %s", exc)
        yield in_use
        yield waiting


def wipe_multiprocess_dir(directory: str) -> None:
    """Create the directory, or empty it of a previous run's files (prometheus-client requires
    an empty directory when the processes start, and every process writes there at import)."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        if name.endswith(".db"):
            os.unlink(os.path.join(directory, name))


def start_server(port: int, address: str, extra: Iterable[Any] = ()) -> None:
    """Serve /metrics on `address:port` from a background thread of this process."""
    assert prometheus_client is not None
    prometheus_client.start_http_server(port, addr=address, registry=registry(extra))


def mark_process_dead(pid: int) -> None:
    """Drop a finished pool child's live gauges (multiprocess mode only)."""
    if prometheus_client is not None and multiprocess_mode():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


__all__ = [
    "CLAIM_TAKEN",
    "MULTIPROC_ENV",
    "LimitUsageCollector",
    "QueueDepthCollector",
    "mark_process_dead",
    "metrics",
    "multiprocess_mode",
    "registry",
    "result_code",
    "start_server",
    "wipe_multiprocess_dir",
]
