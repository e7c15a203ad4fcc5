"""Traces and metrics of real calls on a real prefork worker (tests/celery_tools.py).

The orchestrator side (this process) exports to the SDK's InMemorySpanExporter; the worker writes
its spans as JSON lines to TOOLCHORD_TRACE_FILE and serves its metrics over HTTP.
"""

from __future__ import annotations

import calendar
import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster_helpers import TOOLS, call, orchestrator, wait_for
from tests.conftest import free_port
from toolchord.orchestrator.observability import metrics_app
from toolchord.worker.launch import worker_command

SECRET = "s3cret-argument-value"


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """This process's spans (the global provider can be set once per process)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    # Later tests in this process keep the provider; a stopped exporter keeps nothing of theirs.
    exporter.shutdown()


def _worker_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


@pytest.mark.slow
def test_one_trace_per_turn_across_the_worker_even_for_a_retried_call(
    start_worker, redis_url, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    trace_file = tmp_path / "worker-spans.jsonl"
    start_worker(TOOLS, TOOLCHORD_TRACE_FILE=str(trace_file))
    spans.clear()
    orch = orchestrator(redis_url)
    turn = orch.run_calls("s-trace", [call(0, "echo", text=SECRET), call(1, "flaky_read", key="t", failures=1)])
    assert [r.status for r in turn.results] == ["ok", "ok"] and turn.results[1].attempts == 2

    turn_spans = [s for s in spans.get_finished_spans() if s.name == "toolchord.turn"]
    assert len(turn_spans) == 1
    turn_span = turn_spans[0]
    trace_id = f"0x{turn_span.context.trace_id:032x}"
    assert dict(turn_span.attributes or {})["toolchord.session_id"] == "s-trace"
    assert dict(turn_span.attributes or {})["toolchord.turn_id"] == turn.turn_id

    def worker_side() -> list[dict[str, Any]]:
        return [s for s in _worker_spans(trace_file) if s["context"]["trace_id"] == trace_id]

    # The worker writes a call's spans as the delivery ends, which may be just after the chord joined.
    wait_for(lambda: len([s for s in worker_side() if s["name"] == "toolchord.call"]) == 3, 30, "3 call spans")
    wait_for(lambda: len([s for s in worker_side() if s["name"] == "toolchord.result_store"]) == 2, 30, "stores")
    found = worker_side()
    by_id = {s["context"]["span_id"]: s for s in found}
    turn_span_id = f"0x{turn_span.context.span_id:016x}"
    calls = [s for s in found if s["name"] == "toolchord.call"]
    # Every delivery, the retried one included, is a child of the turn; nothing left the trace.
    assert {s["parent_id"] for s in calls} == {turn_span_id}
    assert {s["context"]["trace_id"] for s in _worker_spans(trace_file)} == {trace_id}
    attempts = sorted((s["attributes"]["toolchord.tool"], s["attributes"]["toolchord.attempt"]) for s in calls)
    assert attempts == [("echo", 1), ("flaky_read", 1), ("flaky_read", 2)]
    for s in calls:
        attributes = s["attributes"]
        assert attributes["toolchord.session_id"] == "s-trace" and attributes["toolchord.turn_id"] == turn.turn_id
        assert attributes["toolchord.side_effect"] == "read" and attributes["toolchord.call_id"] in ("call_0", "call_1")
    steps: dict[str, list[str]] = {}
    for s in found:
        if s["name"] != "toolchord.call":
            parent = by_id[s["parent_id"]]
            steps.setdefault(parent["context"]["span_id"], []).append(s["name"])
    for s in calls:
        names = sorted(steps[s["context"]["span_id"]])
        retried = s["attributes"].get("toolchord.retry", False)
        expected = ["toolchord.claim", "toolchord.sandbox.run"] + ([] if retried else ["toolchord.result_store"])
        assert names == sorted(expected), (s["attributes"], names)
    # Redaction holds: ids and names only, never the arguments or the output.
    assert SECRET not in trace_file.read_text()
    assert all(SECRET not in json.dumps(dict(s.attributes or {})) for s in spans.get_finished_spans())


def test_worker_command_sets_up_multiprocess_metrics() -> None:
    args, env = worker_command(["--metrics-port", "9300"], env={"TOOLCHORD_BROKER_URL": "redis://x:1/0",
                                                                  "TOOLCHORD_TOOL_MODULES": TOOLS})
    assert env["TOOLCHORD_METRICS_PORT"] == "9300" and env["TOOLCHORD_METRICS_ADDRESS"] == "127.0.0.1"
    assert Path(env["PROMETHEUS_MULTIPROC_DIR"]).is_dir() and not list(Path(env["PROMETHEUS_MULTIPROC_DIR"]).iterdir())
    assert "--metrics-port" not in args


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def serve_wsgi() -> Iterator[Any]:
    servers = []

    def serve(app: Any) -> str:
        server = make_server("127.0.0.1", 0, app, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/metrics"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_metrics_of_real_calls_are_scraped_over_http(start_worker, redis_url, tmp_path: Path, serve_wsgi) -> None:
    port = free_port()
    (tmp_path / "prom").mkdir()
    start_worker(TOOLS, concurrency=2, TOOLCHORD_METRICS_PORT=str(port),
                 PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"))
    orch = orchestrator(redis_url)
    orchestrator_url = serve_wsgi(metrics_app(orch))
    before = _scrape(orchestrator_url)

    calls = [call(i, "echo", text=f"e{i}") for i in range(3)]
    calls += [call(3, "flaky_read", key="m", failures=1), call(4, "slow", seconds=5)]
    turn = orch.run_calls("s-metrics", calls)
    codes = [r.error.code.value if r.error else "ok" for r in turn.results]
    assert codes == ["ok", "ok", "ok", "ok", "TIMEOUT"], codes
    # A call on a queue no worker consumes waits there until its turn gives up.
    waiting = orchestrator(redis_url, turn_timeout=1.0).run_calls("s-waiting", [call(0, "where", x=1)])
    assert waiting.results[0].error.code.value == "NOT_EXECUTED"

    worker_url = f"http://127.0.0.1:{port}/metrics"

    def worker_counts() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _scrape(worker_url)

    wait_for(lambda: _value(worker_counts(), "toolchord_calls_total") == 5, 30, "5 finished calls counted")
    samples = worker_counts()
    assert _value(samples, "toolchord_calls_total", tool="echo", side_effect="read", code="ok") == 3
    assert _value(samples, "toolchord_calls_total", tool="flaky_read", code="ok") == 1
    assert _value(samples, "toolchord_calls_total", tool="slow", code="TIMEOUT") == 1
    assert _value(samples, "toolchord_call_retries_total", tool="flaky_read") == 1
    assert _value(samples, "toolchord_call_duration_seconds_count", tool="echo") == 3
    assert _value(samples, "toolchord_sandbox_kills_total", tool="slow", reason="timeout") >= 1
    assert _value(samples, "toolchord_claims_total", taken="true") >= 6  # 5 calls and a retry, at least
    assert _value(samples, "toolchord_call_queue_seconds_count") == 5  # first attempts only
    assert ("toolchord_queue_depth", (("queue", "toolchord"),)) in samples

    after = _scrape(orchestrator_url)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("toolchord_turns_total") == 2
    assert delta("toolchord_turn_duration_seconds_count") == 2
    assert delta("toolchord_turn_results_total", tool="echo", code="ok") == 3
    assert delta("toolchord_turn_results_total", tool="slow", code="TIMEOUT") == 1
    assert delta("toolchord_turn_results_total", tool="where", code="NOT_EXECUTED") == 1
    assert _value(after, "toolchord_queue_depth", queue="b") == 1


_SCRAPE_WITH_A_FILE_AT_ZERO_BYTES = """
import os
from prometheus_client import generate_latest
from toolchord.worker.observability.metrics import metrics, registry

metrics().calls.labels("echo", "read", "ok").inc()
# What a pool process leaves between creating its file and sizing it (or forever, if it is
# killed right then).
open(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "counter_4242.db"), "wb").close()
print(generate_latest(registry()).decode())
"""


def test_a_scrape_while_a_pool_process_creates_its_metrics_file_succeeds(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _SCRAPE_WITH_A_FILE_AT_ZERO_BYTES], check=False,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 'toolchord_calls_total{code="ok",side_effect="read",tool="echo"} 1.0' in done.stdout, done.stdout


_WITHOUT_EXTRAS = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("opentelemetry", "prometheus_client"):
            raise ImportError(f"{name} is blocked")
        return None

sys.meta_path.insert(0, Block())
from toolchord.orchestrator import Orchestrator
from toolchord.worker.config import Settings
from toolchord.worker.demo_tools import registry
from toolchord.worker.models import ToolCall
from toolchord.worker.observability import metrics
from toolchord.worker.observability.tracing import enabled

assert not enabled() and metrics() is None
orch = Orchestrator(registry, settings=Settings())
turn = orch.run_calls("s-plain", [ToolCall(id="c1", name="lookup_order", arguments_raw='{"order_id": "A-1001"}')])
result = turn.results[0]
print(result.status if result.error is None else f"{result.error.code.value}: {result.error.message}")
"""


def test_without_the_extras_every_hook_is_a_no_op(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOOLCHORD_", "PROMETHEUS_"))}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok", done.stdout[-3000:] + done.stderr[-3000:]


def _ns(iso: str) -> int:
    """A JSON-lines span time (ISO 8601, UTC, microseconds) in nanoseconds since the epoch."""
    when = datetime.fromisoformat(iso)
    return calendar.timegm(when.utctimetuple()) * 1_000_000_000 + when.microsecond * 1_000


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_early_call_s_worker_span_starts_before_its_turn_s_message_ended(
    start_worker, redis_url, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    from tests.test_eager_dispatch import one_eager_turn

    trace_file = tmp_path / "worker-spans.jsonl"
    start_worker(TOOLS, TOOLCHORD_TRACE_FILE=str(trace_file))
    spans.clear()
    one_eager_turn(redis_url, "s-eager-trace")

    # Each streamed message has its turn span: the one with the calls, then the final answer's.
    ends = [(s, e) for s in spans.get_finished_spans() if s.name == "toolchord.turn"
            for e in s.events if e.name == "toolchord.message_ended"]
    assert [dict(e.attributes or {}) for _, e in ends] == [
        {"toolchord.complete": True, "toolchord.sent_early": 1}, {"toolchord.complete": True, "toolchord.sent_early": 0}]
    turn_span, ended = ends[0]
    turn_span_id = f"0x{turn_span.context.span_id:016x}"

    def call_spans() -> dict[str, dict[str, Any]]:
        return {s["attributes"]["toolchord.tool"]: s for s in _worker_spans(trace_file)
                if s["name"] == "toolchord.call" and s["parent_id"] == turn_span_id}

    wait_for(lambda: len(call_spans()) == 2, 30, "both calls' spans")
    found = call_spans()
    # Both calls are children of the one turn span: the early one started while the model streamed.
    assert _ns(found["stamp_read"]["start_time"]) < ended.timestamp < _ns(found["stamp_unsafe"]["start_time"])
