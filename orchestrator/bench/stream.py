"""Turn latency with and without eager dispatch, against a model that streams at a fixed rate.

Run with `toolchord bench stream [--rounds R] [--provider anthropic|responses|chat] [--json PATH]`
(or `python -m toolchord.orchestrator.bench.stream`). It starts a private redis-server on a free
loopback port and one prefork worker, serves a scripted model (`ScriptedModelServer`) whose message
makes three `read` calls of 1.5, 1.0 and 0.5 s whose arguments complete at about 0.5, 1.0 and 1.5 s
into a 2 s stream, and runs `Agent(stream=True)` with `eager=True` and `eager=False` alternately in
the same run. A turn's latency is from the model request to the last result.

Without eager dispatch a turn costs the stream plus the slowest tool (about 3.5 s); with it, the
larger of the two. Target: eager turn (median) <= max(stream, slowest tool) + 50 ms, for each
provider (a chat call is complete when its arguments' JSON object closes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import get_args

from pydantic import BaseModel

from toolchord.orchestrator.agent import Agent, AgentStep
from toolchord.orchestrator.bench.processes import RedisServer, WorkerProcess, worker_env
from toolchord.orchestrator.event_stores import JsonlEventLog
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.orchestrator.scripted_model import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.registry import Provider, Registry

TOOL_MODULE = "toolchord.orchestrator.bench.stream_tools"
NAPS = (1.5, 1.0, 0.5)
CALLS_SECONDS = 1.5  # the three calls' arguments stream over this long ...
TAIL_SECONDS = 0.5  # ... and the message ends this much later
STREAM_SECONDS = CALLS_SECONDS + TAIL_SECONDS
TARGET_SLACK = 0.05


class Report(BaseModel):
    provider: str
    rounds: int
    stream_s: float
    slowest_tool_s: float
    eager_s: list[float]
    buffered_s: list[float]
    target_s: float

    @property
    def met(self) -> bool:
        return statistics.median(self.eager_s) <= self.target_s


def _script() -> list[ScriptedTurn]:
    calls = [ScriptedCall(name="bench_nap", arguments={"seconds": nap}) for nap in NAPS]
    return [ScriptedTurn(calls=calls, stream_seconds=CALLS_SECONDS, tail_seconds=TAIL_SECONDS), ScriptedTurn(text="ok")]


def _turn_seconds(orchestrator: Orchestrator, registry: Registry, provider: Provider, log: JsonlEventLog,
                  eager: bool) -> float:
    """One model request with three calls, to its last result (seconds)."""
    done: list[float] = []
    with ScriptedModelServer(_script()) as server:
        base = server.base_url if provider == "anthropic" else server.base_url + "/v1"
        agent = Agent(registry, model="bench", provider=provider, base_url=base, api_key="-",
                      orchestrator=orchestrator, event_log=log, stream=True, eager=eager,
                      on_step=lambda step: _first(done, step))
        started = time.perf_counter()
        result = agent.run("go")
        if [r.status for r in result.steps[0].results] != ["ok"] * len(NAPS):
            raise RuntimeError(f"a bench call failed: {result.steps[0].results}")
    return done[0] - started


def _first(done: list[float], step: AgentStep) -> None:
    if step.calls and not done:
        done.append(time.perf_counter())


def run(provider: Provider, rounds: int, workdir: Path) -> Report:
    """Start Redis and a worker, alternate eager and buffered turns, stop both whatever happens."""
    with ExitStack() as cleanup:
        server = RedisServer(workdir)
        cleanup.callback(server.stop)
        server.start()
        env = worker_env(server.url, TOOL_MODULE, TOOLCHORD_BROKER_URL=server.url, TOOLCHORD_REDIS_URL=server.url)
        worker = WorkerProcess(env, "toolchord", len(NAPS), "bench", workdir / "worker.log", loglevel="WARNING")
        cleanup.callback(worker.kill)
        worker.start()
        registry = Registry.from_modules([TOOL_MODULE])
        settings = Settings(broker_url=server.url, result_backend=server.url, redis_url=server.url)
        orchestrator = Orchestrator(registry, create_app(settings, registry))
        cleanup.callback(orchestrator.close)
        log = JsonlEventLog(workdir / "logs")
        _turn_seconds(orchestrator, registry, provider, log, True)  # warm-up: connections, imports
        eager: list[float] = []
        buffered: list[float] = []
        for _ in range(rounds):
            eager.append(_turn_seconds(orchestrator, registry, provider, log, True))
            buffered.append(_turn_seconds(orchestrator, registry, provider, log, False))
        return Report(provider=provider, rounds=rounds, stream_s=STREAM_SECONDS, slowest_tool_s=max(NAPS),
                      eager_s=eager, buffered_s=buffered,
                      target_s=max(STREAM_SECONDS, max(NAPS)) + TARGET_SLACK)


def render(report: Report) -> str:
    """The report as text: medians, every round, the target and MET or MISSED."""
    def ms(values: list[float]) -> str:
        return f"median {statistics.median(values) * 1000:.0f} ms (" + ", ".join(f"{v * 1000:.0f}" for v in values) + ")"

    return "\n".join([
        f"toolchord bench stream ({report.provider}): 3 calls of {', '.join(f'{n:g}' for n in NAPS)} s "
        f"in a {report.stream_s:g} s stream, {report.rounds} rounds",
        f"  eager dispatch:   {ms(report.eager_s)}",
        f"  after the stream: {ms(report.buffered_s)}",
        f"  target: eager turn <= max(stream, slowest tool) + {TARGET_SLACK * 1000:.0f} ms = "
        f"{report.target_s * 1000:.0f} ms: {'MET' if report.met else 'MISSED'}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `toolchord bench stream`; returns 0 when the target is met, 1 when missed."""
    parser = argparse.ArgumentParser(prog="toolchord bench stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--provider", choices=get_args(Provider), default="anthropic")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="toolchord-bench-") as tmp:
            report = run(args.provider, args.rounds, Path(tmp))
    except KeyboardInterrupt:
        print("interrupted: Redis and the worker were stopped", file=sys.stderr)
        return 130
    print(render(report))
    if args.json is not None:
        args.json.write_text(report.model_dump_json(indent=2) + "\n")
    return 0 if report.met else 1


if __name__ == "__main__":
    sys.exit(main())
