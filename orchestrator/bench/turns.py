"""Turn latency and pipelined throughput of toolchord against a bare Celery chord of the same size.

Run with `python -m toolchord.orchestrator.bench.turns [--rounds R] [--sizes 1,4,16] [--concurrency C] [--json PATH]`
(or `toolchord bench turns ...`). The script starts a private redis-server on a free loopback
port and one prefork worker, runs every variant in the same process against the same Redis and
worker, alternating variants turn by turn so they share the machine's noise, prints a table, and
stops everything on exit, Ctrl-C included.

Variants, all with the same trivial work (return the argument as text) and JSON serialization:
- `bare`: `chord(group of N plain tasks, plain callback)` waited with `AsyncResult.get`;
- `toolchord-nosandbox`: `Orchestrator.run_calls` with N calls of a tool that runs in the pool
  process (`sandbox={"isolate": False}`): toolchord's whole runtime against the same work;
- `toolchord`: the same tool in the default sandbox (a confined child process per call).
Throughput keeps `--inflight` turns in flight on a thread pool (the same harness for every
variant), plus toolchord's asyncio path (`arun_calls`, without sandbox) against the same bare figure.

Targets, each printed with MET/MISSED: without sandbox (the bare chord's work), p50 at most 1.15x
bare and throughput at least 0.9x on both the threaded and the asyncio path; sandboxed (a fork,
confinement and a result pipe per call, which a bare chord does not do at all), p50 at most 1.5x
bare, throughput at least 0.6x, and at most 3 ms more worker CPU per call than without sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Literal

import celery
import kombu
import redis
from celery import chord
from pydantic import BaseModel, Field

from toolchord.orchestrator.bench.bare_tasks import BARE_CALL_TASK, BARE_COLLECT_TASK
from toolchord.orchestrator.bench.processes import RedisServer, WorkerProcess, worker_env
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.models import ToolCall
from toolchord.worker.redis_clients import scheme_of
from toolchord.worker.registry import Registry

# The tools (imported by the worker's sandbox zygote too) and the bare chord's tasks (by the
# worker's Celery app alone): the zygote's heap, which every sandboxed call's fork touches, stays
# that of a small tool module.
TOOL_MODULE = "toolchord.worker.bench_tools"
BARE_TASKS_MODULE = "toolchord.orchestrator.bench.bare_tasks"
QUEUE = "toolchord"
P50_TARGET = 1.15
THROUGHPUT_TARGET = 0.9
SANDBOX_P50_TARGET = 1.5
SANDBOX_THROUGHPUT_TARGET = 0.6
SANDBOX_CPU_MS_TARGET = 3.0
"""Worker CPU per sandboxed call (all its processes) minus the same without sandbox."""
TARGETS = {
    "p50_ratio_max": P50_TARGET,
    "throughput_ratio_min": THROUGHPUT_TARGET,
    "sandbox_p50_ratio_max": SANDBOX_P50_TARGET,
    "sandbox_throughput_ratio_min": SANDBOX_THROUGHPUT_TARGET,
    "sandbox_cpu_ms_per_call_max": SANDBOX_CPU_MS_TARGET,
}

Variant = Literal["bare", "toolchord", "toolchord-nosandbox"]
VARIANTS: tuple[Variant, ...] = ("bare", "toolchord", "toolchord-nosandbox")
TOOL_OF: dict[Variant, str] = {"toolchord": "bench_echo", "toolchord-nosandbox": "bench_echo_inproc"}
ASYNC_SUFFIX = "+asyncio"
# What the targets are checked on: toolchord doing what the bare chord does (see the docstring).
TARGETED = ("toolchord-nosandbox", "toolchord-nosandbox" + ASYNC_SUFFIX)


class Parameters(BaseModel):
    """What the run did (also written to the JSON report)."""

    sizes: list[int]
    rounds: int = Field(ge=1)
    turns_per_round: int = Field(ge=1, description="Latency samples per variant and size in each round.")
    concurrency: int = Field(ge=1, description="Prefork pool processes of the one worker.")
    inflight: int = Field(ge=1, description="Turns in flight at once in the throughput phase.")
    pipeline_calls: int = Field(ge=0, description="Calls per variant, size and round in the throughput phase "
                                "(at least 2 x inflight turns); 0 skips the phase.")
    warmup_turns: int = Field(ge=0)
    redis_stats_turns: int = Field(ge=0, description="Sequential turns per variant and size counted in Redis.")
    broker: str = Field(default="redis", description="The broker's kind: the private Redis, or amqp (RabbitMQ).")


class Environment(BaseModel):
    cpu_count: int | None
    cpus_usable: int
    machine: str
    python: str
    celery: str
    kombu: str
    redis_py: str
    redis_server: str
    sandbox_layers: str


class Latency(BaseModel):
    samples: int
    p50_ms: float
    p95_ms: float
    mean_ms: float


class Throughput(BaseModel):
    mode: Literal["threads", "asyncio"]
    turns_per_s: float = Field(description="Median over rounds.")
    calls_per_s: float
    per_round_turns_per_s: list[float]


class RedisCost(BaseModel):
    """Redis server counters over sequential turns (worker, orchestrator and Celery traffic together),
    and the CPU time each process spent on them."""

    turns: int
    cpu_ms_per_turn: dict[str, float] = Field(
        description="CPU time (user + system) per turn of the orchestrator (this process), the worker "
        "(main process, pool processes and sandboxes) and redis-server.")
    commands_per_turn: float
    reads_per_turn: float = Field(description="Socket read events: about one per client round trip.")
    top_commands_per_turn: dict[str, float]


class SizeResult(BaseModel):
    size: int
    latency: dict[str, Latency]
    throughput: dict[str, Throughput]
    redis: dict[str, RedisCost]
    p50_ratio: dict[str, float] = Field(description="toolchord variant p50 / bare p50.")
    throughput_ratio: dict[str, float] = Field(description="toolchord variant throughput / bare throughput.")
    targets_met: dict[str, bool] = Field(
        description="Per targeted figure (p50:<variant>, throughput:<variant>, sandbox-cpu:toolchord).")
    sandbox_cpu_ms_per_call: float | None = Field(
        default=None, description="Worker CPU per call, sandboxed minus without sandbox.")
    sandbox_p50_ms: float = Field(description="What the sandbox adds to a turn's p50 (toolchord - toolchord-nosandbox).")


class Report(BaseModel):
    environment: Environment
    parameters: Parameters
    targets: dict[str, float]
    results: list[SizeResult]
    elapsed_s: float


def _percentile(samples: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _latency(samples_s: list[float]) -> Latency:
    ms = [s * 1000 for s in samples_s]
    return Latency(samples=len(ms), p50_ms=_percentile(ms, 50), p95_ms=_percentile(ms, 95),
                   mean_ms=statistics.fmean(ms))


def _rotated(items: Sequence[Variant], by: int) -> list[Variant]:
    by %= len(items)
    return [*items[by:], *items[:by]]


class TurnRunner:
    """Runs one turn of each variant on an app that talks to the benchmark's Redis."""

    def __init__(self, redis_url: str, broker_url: str | None = None) -> None:
        settings = Settings(broker_url=broker_url or redis_url, result_backend=redis_url, redis_url=redis_url)
        registry = Registry.from_modules([TOOL_MODULE])
        self.app = create_app(settings, registry)
        self.orchestrator = Orchestrator(registry, self.app)

    def run(self, variant: Variant, size: int) -> None:
        """Run one turn of `size` calls and check every call succeeded."""
        if variant == "bare":
            self._bare(size)
        else:
            calls = self._calls(TOOL_OF[variant], size)
            turn = self.orchestrator.run_calls(f"bench-{uuid.uuid4().hex}", calls)
            self._check([(r.status, r.content) for r in turn.results], size)

    async def arun(self, variant: Variant, size: int) -> None:
        """`run` through `Orchestrator.arun_calls` (toolchord variants only)."""
        calls = self._calls(TOOL_OF[variant], size)
        turn = await self.orchestrator.arun_calls(f"bench-{uuid.uuid4().hex}", calls)
        self._check([(r.status, r.content) for r in turn.results], size)

    def _bare(self, size: int) -> None:
        header = [self.app.signature(BARE_CALL_TASK, args=(i,), queue=QUEUE) for i in range(size)]
        body = self.app.signature(BARE_COLLECT_TASK, queue=QUEUE)
        sent = chord(header, body).apply_async()
        # Wait exactly as run_calls does: on the callback's result alone. The result apply_async
        # returns would also poll every header task's state while waiting (Celery checks parents
        # for errors), which costs the bare side ~4x the Redis round trips of toolchord at size 16.
        value = self.app.AsyncResult(sent.id).get(timeout=60, interval=0.002, disable_sync_subtasks=False)
        self._check([("ok", v) for v in value], size)

    @staticmethod
    def _calls(tool: str, size: int) -> list[ToolCall]:
        return [ToolCall(id=f"call_{i}", name=tool, arguments_raw=json.dumps({"n": i}), index=i) for i in range(size)]

    @staticmethod
    def _check(outcomes: list[tuple[str, str]], size: int) -> None:
        expected = [("ok", str(i)) for i in range(size)]
        if outcomes != expected:
            raise RuntimeError(f"a benchmark turn returned unexpected results: {outcomes[:4]!r}")

    def close(self) -> None:
        self.orchestrator.close()
        self.app.close()


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_latency(runner: TurnRunner, params: Parameters) -> dict[int, dict[Variant, list[float]]]:
    """Sequential turns, variants alternating turn by turn (start rotating) to share the noise."""
    samples: dict[int, dict[Variant, list[float]]] = {s: {v: [] for v in VARIANTS} for s in params.sizes}
    for round_no in range(params.rounds):
        for size in params.sizes:
            for turn_no in range(params.turns_per_round):
                for variant in _rotated(VARIANTS, round_no + turn_no):
                    samples[size][variant].append(_timed(partial(runner.run, variant, size)))
    return samples


def _pipeline_turns(params: Parameters, size: int) -> int:
    return max(2 * params.inflight, params.pipeline_calls // size)


def _threads_rate(runner: TurnRunner, variant: Variant, size: int, params: Parameters, pool: ThreadPoolExecutor) -> float:
    def run_all() -> None:
        for future in [pool.submit(runner.run, variant, size) for _ in range(turns)]:
            future.result()

    turns = _pipeline_turns(params, size)
    return turns / _timed(run_all)


def _asyncio_rate(runner: TurnRunner, variant: Variant, size: int, params: Parameters,
                  loop: asyncio.AbstractEventLoop) -> float:
    async def run_all() -> None:
        gate = asyncio.Semaphore(params.inflight)

        async def one() -> None:
            async with gate:
                await runner.arun(variant, size)

        await asyncio.gather(*(one() for _ in range(turns)))

    turns = _pipeline_turns(params, size)
    return turns / _timed(lambda: loop.run_until_complete(run_all()))


def measure_throughput(runner: TurnRunner, params: Parameters,
                       loop: asyncio.AbstractEventLoop) -> dict[int, dict[str, list[float]]]:
    """Turns per second with `inflight` turns at once; rounds alternate the variants' order."""
    rates: dict[int, dict[str, list[float]]] = {s: {} for s in params.sizes}
    if params.pipeline_calls == 0:
        return rates
    with ThreadPoolExecutor(params.inflight, thread_name_prefix="bench-turn") as pool:
        for round_no in range(params.rounds):
            for size in params.sizes:
                for variant in _rotated(VARIANTS, round_no):
                    rate = _threads_rate(runner, variant, size, params, pool)
                    rates[size].setdefault(variant, []).append(rate)
                    # The asyncio path differs from the threaded one only on the orchestrator side,
                    # so it is measured without the sandbox, whose cost is on the worker side.
                    if variant == "toolchord-nosandbox":
                        rate = _asyncio_rate(runner, variant, size, params, loop)
                        rates[size].setdefault(variant + ASYNC_SUFFIX, []).append(rate)
    return rates


def _server_counters(client: redis.Redis) -> tuple[int, int, dict[str, int]]:
    stats = client.info("stats")
    commands = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}
    return int(stats["total_commands_processed"]), int(stats["total_reads_processed"]), commands


def _cpu_now(worker: WorkerProcess, server: RedisServer) -> dict[str, float]:
    return {"orchestrator": time.process_time(), "worker": worker.cpu_seconds(), "redis": server.cpu_seconds()}


def measure_redis(runner: TurnRunner, client: redis.Redis, params: Parameters, worker: WorkerProcess,
                  server: RedisServer) -> dict[int, dict[Variant, RedisCost]]:
    """Redis commands, round trips and CPU per sequential turn (includes idle worker polling: small)."""
    costs: dict[int, dict[Variant, RedisCost]] = {s: {} for s in params.sizes}
    if params.redis_stats_turns == 0:
        return costs
    for size in params.sizes:
        for variant in VARIANTS:
            # Garbage from the phases before is not this cell's cost.
            gc.collect()
            client.config_resetstat()
            cpu_before = _cpu_now(worker, server)
            for _ in range(params.redis_stats_turns):
                runner.run(variant, size)
            cpu_after = _cpu_now(worker, server)
            # INFO itself is counted: subtract the two reads and commands it costs.
            commands, reads, per_command = _server_counters(client)
            n = params.redis_stats_turns
            top = sorted(per_command.items(), key=lambda kv: -kv[1])[:8]
            costs[size][variant] = RedisCost(
                turns=n,
                cpu_ms_per_turn={k: round((cpu_after[k] - cpu_before[k]) / n * 1000, 2) for k in cpu_before},
                commands_per_turn=round((commands - 2) / n, 1),
                reads_per_turn=round((reads - 2) / n, 1),
                top_commands_per_turn={k: round(v / n, 1) for k, v in top if k not in ("info", "config|resetstat")},
            )
    return costs


def environment(client: redis.Redis) -> Environment:
    from toolchord.worker.sandbox import describe_layers

    return Environment(
        cpu_count=os.cpu_count(),
        cpus_usable=len(os.sched_getaffinity(0)),
        machine=f"{platform.system()} {platform.release()} {platform.machine()}",
        python=platform.python_version(),
        celery=celery.__version__,
        kombu=kombu.__version__,
        redis_py=redis.__version__,
        redis_server=str(client.info("server")["redis_version"]),
        sandbox_layers=describe_layers(),
    )


def summarize(params: Parameters, latencies: dict[int, dict[Variant, list[float]]],
              rates: dict[int, dict[str, list[float]]], costs: dict[int, dict[Variant, RedisCost]]) -> list[SizeResult]:
    results = []
    for size in params.sizes:
        latency = {v: _latency(latencies[size][v]) for v in VARIANTS}
        throughput = {
            name: Throughput(
                mode="asyncio" if name.endswith(ASYNC_SUFFIX) else "threads",
                turns_per_s=round(statistics.median(per_round), 1),
                calls_per_s=round(statistics.median(per_round) * size, 1),
                per_round_turns_per_s=[round(r, 1) for r in per_round],
            )
            for name, per_round in rates[size].items()
        }
        bare_p50 = latency["bare"].p50_ms
        p50_ratio = {v: round(latency[v].p50_ms / bare_p50, 2) for v in VARIANTS if v != "bare"}
        throughput_ratio = (
            {name: round(t.turns_per_s / throughput["bare"].turns_per_s, 2) for name, t in throughput.items()
             if name != "bare"}
            if "bare" in throughput else {}
        )
        met = {f"p50:{v}": p50_ratio[v] <= P50_TARGET for v in TARGETED if v in p50_ratio}
        met |= {f"throughput:{v}": throughput_ratio[v] >= THROUGHPUT_TARGET for v in TARGETED if v in throughput_ratio}
        met["p50:toolchord"] = p50_ratio["toolchord"] <= SANDBOX_P50_TARGET
        if "toolchord" in throughput_ratio:
            met["throughput:toolchord"] = throughput_ratio["toolchord"] >= SANDBOX_THROUGHPUT_TARGET
        sandbox_cpu = None
        if "toolchord" in costs[size] and "toolchord-nosandbox" in costs[size]:
            sandbox_cpu = round((costs[size]["toolchord"].cpu_ms_per_turn["worker"]
                                 - costs[size]["toolchord-nosandbox"].cpu_ms_per_turn["worker"]) / size, 2)
            met["sandbox-cpu:toolchord"] = sandbox_cpu <= SANDBOX_CPU_MS_TARGET
        results.append(SizeResult(
            size=size, latency=latency, throughput=throughput, redis=costs[size], p50_ratio=p50_ratio,
            throughput_ratio=throughput_ratio, targets_met=met, sandbox_cpu_ms_per_call=sandbox_cpu,
            sandbox_p50_ms=round(latency["toolchord"].p50_ms - latency["toolchord-nosandbox"].p50_ms, 2),
        ))
    return results


def _verdict(result: SizeResult, figure: str, variant: str) -> str:
    met = result.targets_met.get(f"{figure}:{variant}")
    if met is None:
        return ""
    verdict = "MET" if met else "MISSED"
    if figure == "p50" and variant == "toolchord":
        verdict += f" (sandbox: +{result.sandbox_p50_ms:.1f} ms/turn)"
    return verdict


def render(report: Report) -> str:
    """The human-readable report: environment, parameters, latency, throughput and Redis tables."""
    env, params = report.environment, report.parameters
    lines = [
        "== environment",
        (f"cpus {env.cpu_count} (usable {env.cpus_usable}), {env.machine}, Python {env.python}, "
         f"Celery {env.celery}, kombu {env.kombu}, redis-py {env.redis_py}, redis-server {env.redis_server}"),
        env.sandbox_layers,
        "== parameters",
        (f"sizes {params.sizes}, rounds {params.rounds}, latency turns/round {params.turns_per_round}, "
         f"worker concurrency {params.concurrency} (prefork, 1 worker), in flight {params.inflight}, "
         f"throughput calls/round {params.pipeline_calls} (>= {2 * params.inflight} turns), "
         f"warm-up turns {params.warmup_turns}, broker {params.broker}"),
        "",
        (f"== per-turn latency (sequential turns; targets: p50 <= {P50_TARGET}x bare without sandbox, "
         f"<= {SANDBOX_P50_TARGET}x sandboxed)"),
        f"{'size':>4}  {'variant':<22}{'p50 ms':>8}{'p95 ms':>8}{'mean ms':>9}{'p50/bare':>10}  target",
    ]
    for result in report.results:
        for variant, lat in result.latency.items():
            ratio = result.p50_ratio.get(variant)
            tail = f"{ratio:>10.2f}  {_verdict(result, 'p50', variant)}" if ratio is not None else f"{'':>10}"
            lines.append(f"{result.size:>4}  {variant:<22}{lat.p50_ms:>8.2f}{lat.p95_ms:>8.2f}{lat.mean_ms:>9.2f}{tail}")
    if params.pipeline_calls:
        lines += [
            "",
            (f"== pipelined throughput ({params.inflight} turns in flight, median over rounds; "
             f"targets: >= {THROUGHPUT_TARGET}x bare without sandbox, both paths, "
             f">= {SANDBOX_THROUGHPUT_TARGET}x sandboxed)"),
            f"{'size':>4}  {'variant':<30}{'turns/s':>9}{'calls/s':>9}{'x bare':>8}  target",
        ]
        for result in report.results:
            for name, thr in result.throughput.items():
                label = f"{name} ({thr.mode})"
                ratio = result.throughput_ratio.get(name)
                tail = f"{ratio:>8.2f}  {_verdict(result, 'throughput', name)}" if ratio is not None else ""
                lines.append(f"{result.size:>4}  {label:<30}{thr.turns_per_s:>9.1f}{thr.calls_per_s:>9.1f}{tail}")
    if params.redis_stats_turns:
        lines += ["", (f"== Redis work and CPU per turn ({params.redis_stats_turns} sequential turns; Redis counts "
                       "all clients; CPU ms of orchestrator / worker incl. sandboxes / redis-server)"),
                  f"{'size':>4}  {'variant':<22}{'cmds':>7}{'reads':>7}{'CPU ms o/w/r':>20}  top commands per turn"]
        for result in report.results:
            for variant, cost in result.redis.items():
                top = ", ".join(f"{k} {v:g}" for k, v in list(cost.top_commands_per_turn.items())[:5])
                cpu = "/".join(f"{v:.1f}" for v in cost.cpu_ms_per_turn.values())
                lines.append(f"{result.size:>4}  {variant:<22}{cost.commands_per_turn:>7.1f}{cost.reads_per_turn:>7.1f}"
                             f"{cpu:>20}  {top}")
        lines.append(f"target: worker CPU per sandboxed call <= {SANDBOX_CPU_MS_TARGET:g} ms more than without: "
                     + ", ".join(f"{r.sandbox_cpu_ms_per_call:.2f} ms at {r.size} calls "
                                 f"{'MET' if r.targets_met['sandbox-cpu:toolchord'] else 'MISSED'}"
                                 for r in report.results if r.sandbox_cpu_ms_per_call is not None))
    missed = [f"{figure} at {result.size} calls" for result in report.results
              for figure, met in result.targets_met.items() if not met]
    lines.append("\ntargets: " + (f"MISSED: {', '.join(missed)}" if missed else "all MET"))
    lines.append(f"total {report.elapsed_s:.1f} s")
    return "\n".join(lines)


@contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C so the same cleanup path stops Redis and the worker."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _progress(message: str) -> None:
    print(f"[bench.turns] {message}", file=sys.stderr, flush=True)


def _close_orchestrator(runner: TurnRunner, loop: asyncio.AbstractEventLoop) -> None:
    """Release the runner's connections; an interrupted event loop may refuse, which is fine at exit."""
    try:
        runner.orchestrator.close()
    except Exception as exc:  # noqa: BLE001 - teardown must go on to stop Redis and the worker
        _progress(f"closing the orchestrator failed ({exc!r}); continuing teardown")
    finally:
        loop.close()


def run(params: Parameters, workdir: Path, broker_url: str | None = None) -> Report:
    """Start Redis and the worker, measure, and stop both whatever happens (each stop is independent).

    The broker is the private Redis unless `broker_url` names another one (an empty RabbitMQ vhost)."""
    started = time.perf_counter()
    with ExitStack() as cleanup:
        server = RedisServer(workdir)
        cleanup.callback(server.stop)
        server.start()
        env = worker_env(server.url, TOOL_MODULE, TOOLCHORD_BROKER_URL=broker_url or server.url,
                         TOOLCHORD_REDIS_URL=server.url)
        worker = WorkerProcess(env, QUEUE, params.concurrency, "bench",
                               workdir / "worker.log", loglevel="WARNING", include=[BARE_TASKS_MODULE])
        # Registered before start(): a Ctrl-C during start-up must not leave the worker running.
        cleanup.callback(worker.kill)
        worker.start()
        _progress(f"redis-server on port {server.port} and a worker with {params.concurrency} pool processes ready")
        loop = asyncio.new_event_loop()
        runner = TurnRunner(server.url, broker_url)
        cleanup.callback(_close_orchestrator, runner, loop)
        client = cleanup.enter_context(redis.Redis.from_url(server.url))
        for _ in range(params.warmup_turns):
            for variant in VARIANTS:
                runner.run(variant, max(params.sizes))
        loop.run_until_complete(runner.arun("toolchord-nosandbox", 1))
        _progress("measuring latency")
        latencies = measure_latency(runner, params)
        _progress(f"latency done at {time.perf_counter() - started:.1f} s; measuring throughput")
        rates = measure_throughput(runner, params, loop)
        _progress(f"throughput done at {time.perf_counter() - started:.1f} s; counting Redis commands")
        costs = measure_redis(runner, client, params, worker, server)
        return Report(
            environment=environment(client),
            parameters=params,
            targets=TARGETS,
            results=summarize(params, latencies, rates, costs),
            elapsed_s=round(time.perf_counter() - started, 1),
        )


def _sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("sizes are positive integers, comma-separated (e.g. 1,4,16)")
    return sizes


def parse_args(argv: Sequence[str] | None) -> tuple[Parameters, Path | None, str | None]:
    parser = argparse.ArgumentParser(prog="toolchord bench turns",
                                     description="Turn latency and throughput: toolchord against a bare Celery chord.")
    parser.add_argument("--sizes", type=_sizes, default=[1, 4, 16], help="calls per turn, comma-separated (default 1,4,16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every measurement (default 3)")
    parser.add_argument("--turns-per-round", type=int, default=16, help="latency samples per variant, size and round")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool processes of the worker (default 2)")
    parser.add_argument("--inflight", type=int, default=4, help="turns in flight in the throughput phase (default 4)")
    parser.add_argument("--pipeline-calls", type=int, default=256,
                        help="calls per variant, size and round in the throughput phase, at least 2 x inflight "
                             "turns (default 256; 0 skips the phase)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up turns per variant before measuring")
    parser.add_argument("--redis-stats-turns", type=int, default=40,
                        help="sequential turns per variant and size counted in Redis (0 skips it)")
    parser.add_argument("--broker-url", help="broker to use instead of the private Redis, e.g. an amqp:// URL of an "
                                             "empty RabbitMQ vhost (results and claims stay in the private Redis)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this path")
    options = parser.parse_args(argv)
    params = Parameters(sizes=options.sizes, rounds=options.rounds, turns_per_round=options.turns_per_round,
                        concurrency=options.concurrency, inflight=options.inflight,
                        pipeline_calls=options.pipeline_calls, warmup_turns=options.warmup,
                        redis_stats_turns=options.redis_stats_turns,
                        broker=scheme_of(options.broker_url) if options.broker_url else "redis")
    return params, options.json, options.broker_url


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m toolchord.orchestrator.bench.turns` and `toolchord bench turns`; returns the exit status."""
    params, json_path, broker_url = parse_args(argv)
    try:
        with _interrupt_on_sigterm(), tempfile.TemporaryDirectory(prefix="toolchord-bench-") as tmp:
            report = run(params, Path(tmp), broker_url)
    except KeyboardInterrupt:
        print("interrupted: Redis and the worker were stopped", file=sys.stderr)
        return 130
    print(render(report))
    if json_path is not None:
        json_path.write_text(report.model_dump_json(indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
