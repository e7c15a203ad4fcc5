"""Load test: many concurrent sessions driven by ONE asyncio orchestrator against real workers.

Run with `python -m toolchord.orchestrator.bench.load` (or `toolchord bench load`); `--help` lists the knobs. Everything
runs on loopback: a private redis-server and W `celery worker --pool prefork` processes.

Each scenario runs in its own Python process (so RSS figures are not polluted by the previous
one) and does:
1. dispatch turn 1 of every session before any worker runs, and measure the orchestrator's RSS
   with all N turns waiting against its RSS before (one warm-up turn in flight);
2. start the workers; every session runs its T turns of K calls (a mix of read, idempotent and
   unsafe tools) one after the other, all sessions at once;
3. optionally SIGKILL a worker's whole process group half-way, while it runs chosen calls of each
   side-effect class (held in their handlers, see bench.load_tools), and start it again at once;
4. balance the ledger: each tool counts its runs in Redis per call (see bench.load_ledger).
Turn latencies are over turns 2..T (turn 1 waited for the workers to start on purpose).

The `bare` scenario is the baseline: the same sessions, turns and calls, driven by the same
event loop against the same workers, as plain Celery chords of plain tasks doing the tools' work
(`bench.load_tools.bare_call`), each waited for on the pub/sub waiter toolchord's asyncio path
uses. The report states toolchord's calls/s and CPU per call as ratios against it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from celery import Celery, chord
from kombu.utils.url import maybe_sanitize_url
from pydantic import BaseModel, Field

from toolchord.orchestrator.bench.load_cluster import TOOL_MODULE, RedisProcess, WorkerProcess, worker_env
from toolchord.orchestrator.bench.load_ledger import CallOutcome, LedgerReport, check_ledger
from toolchord.orchestrator.bench.load_tools import (
    BARE_CALL_TASK,
    BARE_COLLECT_TASK,
    EFFECTS_PREFIX,
    HELD_PREFIX,
    RELEASE_KEY,
    WORKER_NAME_ENV,
)
from toolchord.orchestrator.dispatch import release_pending
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.orchestrator.turn import TurnRecord, TurnResult
from toolchord.orchestrator.waiting import RedisResultWaiter
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.models import SideEffect, ToolCall
from toolchord.worker.registry import Registry

_CLASSES: tuple[SideEffect, ...] = ("read", "idempotent", "unsafe")
# How often the loop-lag probe wakes up: its overshoot is time the event loop was blocked.
_LAG_PROBE = 0.01
# What "waiting" looks like from Redis: the waiter subscribes to the chord body's result channel.
_WAITING_PATTERN = "celery-task-meta-tc-collect-*"
_BARE_COLLECT_PREFIX = "bare-collect-"
_BARE_WAITING_PATTERN = f"celery-task-meta-{_BARE_COLLECT_PREFIX}*"
# The queue the load workers consume (bench.load_cluster).
_QUEUE = "toolchord"
# Targets against the bare-Celery baseline (issue: toolchord without sandbox at load).
CALLS_PER_S_TARGET = 0.8
CPU_PER_CALL_TARGET = 1.5
LOOP_LAG_P99_TARGET_MS = 50.0


class LoadConfig(BaseModel):
    """One scenario of the load test."""

    name: str = "steady"
    sessions: int = 1000
    turns: int = 3
    calls: int = 2
    workers: int = 2
    concurrency: int = 2
    work_ms: float = 0.0
    sandboxed: bool = False
    bare: bool = Field(default=False, description="Plain Celery chords of plain tasks: the baseline.")
    kill: bool = False
    visibility_timeout: int = 10
    claim_lease: float = 2.0
    max_seconds: float = 600.0
    broker_url: str | None = Field(default=None, description="Broker other than the private Redis (RabbitMQ).")
    # How long the kill scenario waits for its chosen calls to be running before it gives up on the kill.
    hold_seconds: float = 60.0


class LoadReport(BaseModel):
    """The figures of one scenario."""

    config: LoadConfig
    calls: int
    seconds: float
    calls_per_s: float
    latency_ms: dict[str, float]
    rss_before_mb: float
    rss_inflight_mb: float
    inflight_turns: int
    rss_per_waiting_turn_kb: float
    dispatch_turns_per_s: float
    loop_lag_ms: dict[str, float]
    sync_ms_per_turn: dict[str, float]
    redis_clients_orchestrator: int
    cpu_seconds: dict[str, float]
    killed_at_s: float | None
    killed_running: dict[str, str] = {}
    ledger: LedgerReport
    completed: bool

    @property
    def balanced(self) -> bool:
        return self.completed and self.ledger.balanced

    @property
    def cpu_ms_per_call(self) -> float:
        """CPU of the orchestrator, the workers and redis-server, per call."""
        return sum(self.cpu_seconds.values()) * 1000 / max(self.calls, 1)


class _TimedOrchestrator(Orchestrator):
    """Times the orchestrator's synchronous steps, which run on the event loop in `arun_calls`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_seconds: list[float] = []
        self.finish_seconds: list[float] = []
        # A turn's start is two synchronous steps (record, then send) with a wait between them.
        self._opening: dict[tuple[str, str], float] = {}

    def _open(self, *args: Any, **kwargs: Any) -> TurnResult | TurnRecord:
        began = time.perf_counter()
        opened = super()._open(*args, **kwargs)
        if isinstance(opened, TurnRecord):
            self._opening[(opened.session_id, opened.turn_id)] = time.perf_counter() - began
        return opened

    def _send(self, record: TurnRecord, body_id: str) -> TurnResult | str:
        began = time.perf_counter()
        try:
            return super()._send(record, body_id)
        finally:
            opening = self._opening.pop((record.session_id, record.turn_id), 0.0)
            self.start_seconds.append(opening + time.perf_counter() - began)

    def _finish(self, record: TurnRecord, collected: list[dict[str, Any]] | None, reason: str) -> TurnResult:
        began = time.perf_counter()
        try:
            return super()._finish(record, collected, reason)
        finally:
            self.finish_seconds.append(time.perf_counter() - began)


def rss_mb() -> float:
    """This process's resident set size, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "max": ordered[-1]}


class _LagProbe:
    """Measures how late a short sleep wakes up: the event loop was blocked for that long."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await asyncio.sleep(_LAG_PROBE)
            self.samples.append(loop.time() - began - _LAG_PROBE)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-lag-probe")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class _Plan:
    """The calls of the whole run: tags, tools and ids, decided up front."""

    def __init__(self, config: LoadConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self.suffix = "sandboxed" if config.sandboxed else "inproc"
        self.outcomes: dict[str, CallOutcome] = {}
        self.doomed = self._doomed() if config.kill else {}

    def _doomed(self) -> dict[tuple[int, int, int], SideEffect]:
        """The calls the kill lands on: the first call of the middle turn of sessions from the middle
        on, one per side-effect class, unsafe first, at most one per pool process of a worker (a
        worker must be able to run them all at once)."""
        order: tuple[SideEffect, ...] = ("unsafe", "read", "idempotent")
        wanted = order[: self.config.concurrency]
        turn = self.config.turns // 2
        doomed: dict[tuple[int, int, int], SideEffect] = {}
        for session in range(self.config.sessions // 2, self.config.sessions):
            side_effect = self._class_of(session, turn, 0)
            if side_effect in wanted and side_effect not in doomed.values():
                doomed[(session, turn, 0)] = side_effect
        return doomed

    def _class_of(self, session: int, turn: int, k: int) -> SideEffect:
        return _CLASSES[(session + turn * self.config.calls + k) % len(_CLASSES)]

    def tag(self, session: int, turn: int, k: int) -> str:
        return f"{self.run_id}:{session}:{turn}:{k}"

    def expect(self, session: int, turn: int) -> list[str]:
        """The tags of a turn's calls, each entered in the ledger as expected, not yet answered."""
        tags = [self.tag(session, turn, k) for k in range(self.config.calls)]
        for k, tag in enumerate(tags):
            self.outcomes[tag] = CallOutcome(tag=tag, side_effect=self._class_of(session, turn, k), results=0)
        return tags

    def calls(self, session: int, turn: int) -> list[ToolCall]:
        calls = []
        for k, tag in enumerate(self.expect(session, turn)):
            side_effect = self._class_of(session, turn, k)
            args: dict[str, Any] = {"tag": tag, "work_ms": self.config.work_ms}
            if (session, turn, k) in self.doomed:
                args["hold"] = True
            calls.append(ToolCall(id=f"call_{turn}_{k}", name=f"load_{side_effect}_{self.suffix}",
                                  arguments_raw=json.dumps(args), arguments=args, index=k))
        return calls

    def record_bare(self, session: int, turn: int, values: list[Any] | None) -> None:
        """A baseline turn: its callback's list of the calls' results (None: it never came)."""
        for k in range(self.config.calls):
            outcome = self.outcomes[self.tag(session, turn, k)]
            value = values[k] if values is not None and k < len(values) else None
            outcome.results = 0 if value is None else 1
            outcome.status = "ok" if isinstance(value, int) and value >= 1 else None

    def record(self, session: int, turn: int, result: TurnResult) -> None:
        for k in range(self.config.calls):
            call_id = f"call_{turn}_{k}"
            matching = [r for r in result.results if r.call_id == call_id]
            outcome = self.outcomes[self.tag(session, turn, k)]
            outcome.results = len(matching)
            if matching:
                outcome.status = matching[0].status
                outcome.code = matching[0].error.code.value if matching[0].error else None
        # No result may be there that was not asked for.
        asked = {f"call_{turn}_{k}" for k in range(self.config.calls)}
        for extra in (r for r in result.results if r.call_id not in asked):
            self.outcomes[f"{self.run_id}:{session}:{turn}:extra:{extra.call_id}"] = CallOutcome(
                tag="(unrequested)", side_effect="read", results=2)


class _BareTurns:
    """The baseline's turns: a chord of plain tasks doing the tools' work, waited for on the same
    pub/sub waiter as toolchord's asyncio path."""

    def __init__(self, app: Celery, waiter: RedisResultWaiter, config: LoadConfig) -> None:
        self.app, self.waiter, self.config = app, waiter, config

    async def run(self, plan: _Plan, session: int, turn: int) -> list[Any] | None:
        """Send one turn's chord and wait for its callback; the calls' results, or None."""
        tags = plan.expect(session, turn)
        ids = [f"bare-{uuid.uuid4().hex}" for _ in tags]
        header = [self.app.signature(BARE_CALL_TASK, args=(tag, self.config.work_ms), queue=_QUEUE, task_id=task_id)
                  for tag, task_id in zip(tags, ids, strict=True)]
        body = self.app.signature(BARE_COLLECT_TASK, queue=_QUEUE, task_id=_BARE_COLLECT_PREFIX + uuid.uuid4().hex)
        sent = chord(header, body).apply_async()
        # Celery's Redis backend registers the header's results while applying the chord; nobody
        # reads them here, so they are let go as toolchord does (neither side keeps subscriptions).
        release_pending(self.app.backend, ids)
        meta = await self.waiter.wait(sent.id, self.config.max_seconds)
        if meta is None or meta.get("status") != "SUCCESS":
            return None
        result = meta.get("result")
        return result if isinstance(result, list) else None


async def _wait_for_held(admin: redis.Redis, tags: list[str], timeout: float) -> dict[str, str]:
    """Until every call of `tags` is held in a handler (or the timeout passes): {tag: worker name}."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        values = admin.mget([HELD_PREFIX + tag for tag in tags])
        held = {tag: value.decode() for tag, value in zip(tags, values, strict=True) if value is not None}
        if len(held) == len(tags) or loop.time() >= end:
            return held
        await asyncio.sleep(0.02)


async def _wait_for_waiting(admin: redis.Redis, expected: int, timeout: float, pattern: str) -> int:
    """Until `expected` turns are subscribed to their chord's result (or the timeout passes)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    count = 0
    while loop.time() < end:
        count = len(admin.pubsub_channels(pattern))
        if count >= expected:
            return count
        await asyncio.sleep(0.05)
    return count


def _cpu_now(server: RedisProcess, workers: list[WorkerProcess]) -> dict[str, float]:
    """CPU seconds so far: this (orchestrator) process, the workers (pool processes and
    sandboxes), redis-server.

    A worker killed mid-run takes its CPU time with it; its restarted process counts from zero.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "orchestrator": usage.ru_utime + usage.ru_stime,
        "workers": sum(w.cpu_seconds() for w in workers),
        "redis": server.cpu_seconds(),
    }


async def _drive(config: LoadConfig, orch: _TimedOrchestrator, admin: redis.Redis, server: RedisProcess,
                 workers: list[WorkerProcess]) -> dict[str, Any]:
    plan = _Plan(config, run_id=f"r{time.time_ns()}")
    latencies: list[float] = []
    probe = _LagProbe()
    probe.start()
    bare = _BareTurns(orch.app, RedisResultWaiter(server.url), config) if config.bare else None
    pattern = _BARE_WAITING_PATTERN if bare else _WAITING_PATTERN

    async def session(index: int) -> None:
        for turn in range(config.turns):
            began = time.perf_counter()
            if bare is not None:
                values = await bare.run(plan, index, turn)
            else:
                result = await orch.arun_calls(f"{plan.run_id}-s{index}", plan.calls(index, turn), turn_id=f"t{turn}")
            if turn > 0:
                latencies.append(time.perf_counter() - began)
            if bare is not None:
                plan.record_bare(index, turn, values)
            else:
                plan.record(index, turn, result)

    # A warm-up session: connections, pools and the waiter exist before the "before" figure.
    warm = asyncio.create_task(session(config.sessions))
    await _wait_for_waiting(admin, 1, 30, pattern)
    gc.collect()
    rss_before = rss_mb()
    dispatch_began = time.perf_counter()
    tasks = [asyncio.create_task(session(i)) for i in range(config.sessions)]
    waiting = await _wait_for_waiting(admin, config.sessions + 1, 120, pattern)
    dispatch_seconds = time.perf_counter() - dispatch_began
    gc.collect()
    rss_inflight = rss_mb()
    clients = int(admin.info("clients")["connected_clients"]) - 1  # minus this admin connection

    await asyncio.gather(*(asyncio.to_thread(w.start) for w in workers))
    # Throughput counts from the moment the workers consume (turn 1 of every session is queued).
    began = time.perf_counter()

    killed_at: list[float] = []
    killed_running: dict[str, str] = {}

    async def chaos() -> None:
        # Kill the workers running the doomed calls once all of them are in their handlers: the
        # SIGKILL then lands on running calls of each class. A kill at a random moment may land
        # between a chord's last call and its callback's dispatch, whose claim outlives the
        # redelivery: that turn then waits for its deadline (see docs/load.md).
        doomed = {plan.tag(*call): side_effect for call, side_effect in plan.doomed.items()}
        if not doomed:
            return
        held = await _wait_for_held(admin, list(doomed), config.hold_seconds)
        if len(held) < len(doomed):
            admin.set(RELEASE_KEY, "1")  # no kill: let them finish; the report shows what held
            return
        killed_at.append(time.perf_counter() - began)
        victims = [w for w in workers if w.name in held.values()]
        await asyncio.gather(*(asyncio.to_thread(w.kill) for w in victims))
        killed_running.update({side_effect: tag for tag, side_effect in doomed.items()})
        await asyncio.gather(*(asyncio.to_thread(w.start) for w in victims))

    chaos_task = asyncio.create_task(chaos()) if config.kill else None
    cpu_before = _cpu_now(server, workers)
    completed = True
    try:
        await asyncio.wait_for(asyncio.gather(warm, *tasks), config.max_seconds)
    except TimeoutError:
        completed = False
    seconds = time.perf_counter() - began
    cpu_after = _cpu_now(server, workers)
    if chaos_task is not None:
        chaos_task.cancel()
        await asyncio.gather(chaos_task, return_exceptions=True)
    await probe.stop()
    if bare is not None:
        await bare.waiter.close()
    return {
        "plan": plan,
        "latencies": latencies,
        "seconds": seconds,
        "rss_before": rss_before,
        "rss_inflight": rss_inflight,
        "waiting": waiting,
        "dispatch_seconds": dispatch_seconds,
        "lag": probe.samples,
        "clients": clients,
        "completed": completed,
        "cpu": {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_after},
        "killed_at": round(killed_at[0], 1) if killed_at else None,
        "killed_running": killed_running,
    }


def _effects(admin: redis.Redis, tags: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for start in range(0, len(tags), 1000):
        chunk = tags[start:start + 1000]
        for tag, value in zip(chunk, admin.mget([EFFECTS_PREFIX + t for t in chunk]), strict=True):
            counts[tag] = int(value) if value is not None else 0
    return counts


def run_scenario(config: LoadConfig, workdir: Path | None = None) -> LoadReport:
    """Run one scenario on a fresh private cluster and return its figures (in this process)."""
    with tempfile.TemporaryDirectory(prefix="toolchord-load-") as tmp:
        base = workdir or Path(tmp)
        server = RedisProcess(base)
        admin = redis.Redis.from_url(server.url)
        env = worker_env(server.url, config.visibility_timeout, config.claim_lease, config.broker_url)
        workers = [WorkerProcess({**env, WORKER_NAME_ENV: f"load{i + 1}"}, config.concurrency, f"load{i + 1}",
                                 base / f"worker{i + 1}.log") for i in range(config.workers)]
        settings = Settings(broker_url=config.broker_url or server.url, result_backend=server.url,
                            redis_url=server.url, visibility_timeout=config.visibility_timeout,
                            claim_lease=config.claim_lease)
        registry = Registry.from_modules([TOOL_MODULE])
        orch = _TimedOrchestrator(registry, create_app(settings, registry))
        loop = asyncio.new_event_loop()
        try:
            figures = loop.run_until_complete(_drive(config, orch, admin, server, workers))
            # Orchestrator.close() closes the waiter on its loop, which must be idle and still open.
            orch.close()
            plan: _Plan = figures["plan"]
            effects = _effects(admin, [o.tag for o in plan.outcomes.values()])
        finally:
            loop.close()
            for worker in workers:
                worker.close()
            # Celery's result objects unsubscribe from Redis when collected: let them, before Redis goes.
            gc.collect()
            orch.app.close()
            admin.close()
            server.stop()
    outcomes = list(plan.outcomes.values())
    calls = len(outcomes)
    waiting = max(figures["waiting"] - 1, 1)
    sync = [s * 1000 for s in orch.start_seconds], [s * 1000 for s in orch.finish_seconds]
    return LoadReport(
        config=config,
        calls=calls,
        seconds=round(figures["seconds"], 3),
        calls_per_s=round(calls / figures["seconds"], 1),
        latency_ms={k: round(v * 1000, 1) for k, v in _percentiles(figures["latencies"]).items()},
        rss_before_mb=round(figures["rss_before"], 1),
        rss_inflight_mb=round(figures["rss_inflight"], 1),
        inflight_turns=figures["waiting"],
        rss_per_waiting_turn_kb=round((figures["rss_inflight"] - figures["rss_before"]) * 1024 / waiting, 1),
        dispatch_turns_per_s=round(config.sessions / max(figures["dispatch_seconds"], 1e-9), 1),
        loop_lag_ms={k: round(v * 1000, 1) for k, v in _percentiles(figures["lag"]).items()},
        sync_ms_per_turn={
            "start_mean": round(statistics.fmean(sync[0]), 2) if sync[0] else 0.0,
            "finish_mean": round(statistics.fmean(sync[1]), 2) if sync[1] else 0.0,
            "total_s": round((sum(sync[0]) + sum(sync[1])) / 1000, 2),
        },
        redis_clients_orchestrator=figures["clients"],
        ledger=check_ledger(outcomes, effects),
        completed=figures["completed"],
        cpu_seconds=figures["cpu"],
        killed_at_s=figures["killed_at"],
        killed_running=figures["killed_running"],
    )


def _run_isolated(config: LoadConfig) -> LoadReport:
    """Run one scenario in a fresh Python process, so its RSS is its own."""
    proc = subprocess.run(
        [sys.executable, "-m", "toolchord.orchestrator.bench.load", "--scenario-json", config.model_dump_json()],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, check=False,
        timeout=config.max_seconds + 180,
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"scenario {config.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return LoadReport.model_validate_json(proc.stdout.strip().splitlines()[-1])


def _row(report: LoadReport) -> list[str]:
    c, lat, led = report.config, report.latency_ms, report.ledger
    return [
        c.name, f"{c.sessions}x{c.turns}x{c.calls}", f"{c.workers}x{c.concurrency}",
        "bare Celery" if c.bare else "default" if c.sandboxed else "isolate=False", f"{report.calls_per_s:.0f}",
        f"{lat['p50']:.0f}/{lat['p95']:.0f}/{lat['p99']:.0f}", f"{lat['p99'] / max(lat['p50'], 1e-9):.1f}",
        f"{report.rss_before_mb:.0f}->{report.rss_inflight_mb:.0f}", f"{report.rss_per_waiting_turn_kb:.1f}",
        f"{report.loop_lag_ms['p99']:.0f}/{report.loop_lag_ms['max']:.0f}",
        "/".join(f"{report.cpu_seconds[k]:.0f}" for k in ("orchestrator", "workers", "redis")),
        f"{report.cpu_ms_per_call:.1f}",
        f"{led.ok}/{led.calls}", str(led.reran), str(led.unsafe_twice), str(led.outcome_unknown), str(led.lost),
        "yes" if report.balanced else "NO",
    ]


_HEADER = ["scenario", "N x T x K", "W x c", "sandbox", "calls/s", "turn p50/p95/p99 ms", "p99/p50",
           "RSS MB before->N waiting", "KB/waiting turn", "loop lag p99/max ms", "CPU s orch/workers/redis", "CPU ms/call",
           "ok/calls", "re-ran",
           "unsafe 2x", "OUTCOME_UNKNOWN", "lost", "balanced"]


def format_table(reports: Sequence[LoadReport]) -> str:
    """The summary table (markdown)."""
    rows = [_HEADER, ["---"] * len(_HEADER), *(_row(r) for r in reports)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _targets(reports: Sequence[LoadReport]) -> list[str]:
    lines: list[str] = []
    steady = next((r for r in reports if r.config.name == "steady"), None)
    if steady is not None:
        lat = steady.latency_ms
        lines.append(f"orchestrator RSS with {steady.inflight_turns} turns waiting: {steady.rss_inflight_mb:.0f} MB "
                     f"(target < 300 MB): {'met' if steady.rss_inflight_mb < 300 else 'MISSED'}")
        ratio = lat["p99"] / max(lat["p50"], 1e-9)
        lines.append(f"p99/p50 turn latency: {ratio:.1f} (target < 10): {'met' if ratio < 10 else 'MISSED'}")
    bare = next((r for r in reports if r.config.bare), None)
    if steady is not None and bare is not None:
        lines.extend(_against_bare(steady, bare))
    one = next((r for r in reports if r.config.name == "scale-1w"), None)
    two = next((r for r in reports if r.config.name == "steady" and r.config.workers == 2), None)
    if one is not None and two is not None:
        lines.append(f"scaling 1 -> 2 worker processes: {one.calls_per_s:.0f} -> {two.calls_per_s:.0f} calls/s "
                     f"(x{two.calls_per_s / max(one.calls_per_s, 1e-9):.2f})")
    balanced = all(r.balanced for r in reports)
    lines.append(f"ledger balanced in every run: {'yes' if balanced else 'NO'}")
    for report in reports:
        if report.killed_at_s is not None:
            lines.append(f"{report.config.name}: worker SIGKILLed (process group) {report.killed_at_s:.1f} s into the run "
                         f"while running {', '.join(sorted(report.killed_running))} calls, and started again")
        if not report.balanced:
            lines.append(f"  {report.config.name}: completed={report.completed} {report.ledger.model_dump_json()}")
    return lines


def _verdict(met: bool) -> str:
    return "MET" if met else "MISSED"


def _against_bare(steady: LoadReport, bare: LoadReport) -> list[str]:
    """The steady run (toolchord without sandbox) as ratios against the bare-Celery baseline."""
    rate = steady.calls_per_s / max(bare.calls_per_s, 1e-9)
    cpu = steady.cpu_ms_per_call / max(bare.cpu_ms_per_call, 1e-9)
    lag = steady.loop_lag_ms["p99"]
    return [
        f"calls/s against bare Celery: {steady.calls_per_s:.0f} / {bare.calls_per_s:.0f} = {rate:.2f}x "
        f"(target >= {CALLS_PER_S_TARGET}x): {_verdict(rate >= CALLS_PER_S_TARGET)}",
        f"CPU per call against bare Celery: {steady.cpu_ms_per_call:.1f} / {bare.cpu_ms_per_call:.1f} ms = {cpu:.2f}x "
        f"(target <= {CPU_PER_CALL_TARGET}x): {_verdict(cpu <= CPU_PER_CALL_TARGET)}",
        f"event-loop lag p99: {lag:.0f} ms (target <= {LOOP_LAG_P99_TARGET_MS:.0f} ms): "
        f"{_verdict(lag <= LOOP_LAG_P99_TARGET_MS)}",
    ]


def _public(report: dict[str, Any]) -> dict[str, Any]:
    """A report fit to publish: the broker URL without its password."""
    if report["config"].get("broker_url"):
        report["config"]["broker_url"] = maybe_sanitize_url(report["config"]["broker_url"])
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """`toolchord bench load`: run the scenarios and print the summary; exit 1 if a ledger is off."""
    parser = argparse.ArgumentParser(prog="toolchord bench load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1000, help="concurrent sessions (N)")
    parser.add_argument("--turns", type=int, default=3, help="turns per session (T)")
    parser.add_argument("--calls", type=int, default=2, help="tool calls per turn (K)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (W) of the main run")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool processes per worker")
    parser.add_argument("--work-ms", type=float, default=0.0, help="time each tool call works")
    parser.add_argument("--scenarios", default="steady,bare,kill,scale",
                        help="comma-separated: steady, bare (the bare-Celery baseline), kill (SIGKILL + restart a "
                             "worker mid-run), scale (1 worker), sandbox (default sandbox profile)")
    parser.add_argument("--visibility-timeout", type=int, default=10, help="TOOLCHORD_VISIBILITY_TIMEOUT")
    parser.add_argument("--claim-lease", type=float, default=2.0, help="TOOLCHORD_CLAIM_LEASE")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="give up on a scenario after this")
    parser.add_argument("--broker-url", help="broker to use instead of the private Redis, e.g. an amqp:// URL of an "
                                             "empty RabbitMQ vhost (results and claims stay in the private Redis)")
    parser.add_argument("--json", type=Path, help="also write the reports to this file")
    parser.add_argument("--scenario-json", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.scenario_json:
        print(run_scenario(LoadConfig.model_validate_json(options.scenario_json)).model_dump_json())
        return 0
    base = LoadConfig(sessions=options.sessions, turns=options.turns, calls=options.calls, workers=options.workers,
                      concurrency=options.concurrency, work_ms=options.work_ms,
                      visibility_timeout=options.visibility_timeout, claim_lease=options.claim_lease,
                      max_seconds=options.max_seconds, broker_url=options.broker_url)
    variants = {
        "steady": {},
        "bare": {"name": "bare", "bare": True},
        # Calls that take a while, so the SIGKILL lands on running handlers of every class.
        "kill": {"name": "kill", "workers": max(options.workers, 2), "kill": True,
                 "work_ms": max(options.work_ms, 50.0)},
        "scale": {"name": "scale-1w", "workers": 1},
        "sandbox": {"name": "sandbox", "sandboxed": True},
    }
    wanted = [s.strip() for s in options.scenarios.split(",") if s.strip()]
    unknown = set(wanted) - set(variants)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    reports = []
    for name in wanted:
        config = base.model_copy(update=variants[name])
        broker = maybe_sanitize_url(config.broker_url) if config.broker_url else "the private Redis"
        print(f"running {config.name}: {config.sessions} sessions x {config.turns} turns x {config.calls} calls, "
              f"{config.workers} worker(s) x {config.concurrency}, broker {broker}", file=sys.stderr, flush=True)
        reports.append(_run_isolated(config))
    print(format_table(reports))
    print()
    for line in _targets(reports):
        print(line)
    if options.json:
        options.json.write_text(json.dumps([_public(r.model_dump()) for r in reports], indent=2))
    return 0 if all(r.balanced for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
