"""Fair share: do small turns keep their latency next to a large fan-out on the same fleet?

Run with `python -m toolchord.orchestrator.bench.fairness [--fanout 128] [--small 20] [--work-ms 200]`
(or `toolchord bench fairness`). Starts a private redis-server (the broker) and one prefork worker
with 2 processes. First the idle figure: `--small` sessions each send one call of `--work-ms` at
once, on an idle fleet. Then the loaded figure: one session fans out `--fanout` such calls, and
once they queue, the small sessions send theirs again. The target: the small turns' p95 latency
under load at most 2x the idle p95 (docs/flow-control.md, "Fair share"); the bench prints MET or
MISSED and exits 1 when missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from toolchord.orchestrator.bench.processes import RedisServer, WorkerProcess, worker_env
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import Settings
from toolchord.worker.models import ToolCall
from toolchord.worker.registry import Registry

TOOL_MODULE = "toolchord.orchestrator.bench.turn_tools"
TARGET = 2.0


def _calls(count: int, work_ms: float, prefix: str) -> list[ToolCall]:
    return [ToolCall(id=f"{prefix}{i}", name="bench_nap", arguments_raw=f'{{"ms": {work_ms}}}', index=i)
            for i in range(count)]


def _small_turns(orch: Orchestrator, sessions: int, work_ms: float, tag: str) -> list[float]:
    """Seconds each small session's one-call turn took, all sent at once."""
    def one(i: int) -> float:
        start = time.perf_counter()
        turn = orch.run_calls(f"{tag}-small-{i}", _calls(1, work_ms, "c"))
        assert turn.results[0].status == "ok", turn.results[0].error
        return time.perf_counter() - start

    with ThreadPoolExecutor(sessions) as pool:
        return list(pool.map(one, range(sessions)))


def p95(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def run(fanout: int, small: int, work_ms: float, workdir: Path) -> tuple[float, float]:
    """The small turns' p95 on an idle fleet and next to the fan-out."""
    server = RedisServer(workdir)
    server.start()
    worker = WorkerProcess(worker_env(server.url, TOOL_MODULE), "toolchord", 2, "fairness", workdir / "worker.log",
                           loglevel="WARNING")
    try:
        worker.start()
        settings = Settings(broker_url=server.url, result_backend=server.url, redis_url=server.url,
                            max_calls_per_turn=max(fanout, 1))
        registry = Registry.from_modules([TOOL_MODULE])
        orch = Orchestrator(registry, create_app(settings, registry), turn_timeout=fanout * work_ms / 1000 + 60)
        _small_turns(orch, 2, work_ms, "warmup")
        idle = p95(_small_turns(orch, small, work_ms, "idle"))
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(orch.run_calls, "fanout", _calls(fanout, work_ms, "f"))
            time.sleep(0.5)  # the fan-out is queued
            loaded = p95(_small_turns(orch, small, work_ms, "loaded"))
            big.result()
        return idle, loaded
    finally:
        worker.stop()
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """`toolchord bench fairness`: print the figures and MET or MISSED (exit 1)."""
    parser = argparse.ArgumentParser(prog="toolchord bench fairness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fanout", type=int, default=128, help="calls of the large turn")
    parser.add_argument("--small", type=int, default=20, help="sessions with one call each")
    parser.add_argument("--work-ms", type=float, default=200.0, help="time each call works")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="toolchord-fairness-") as tmp:
        idle, loaded = run(args.fanout, args.small, args.work_ms, Path(tmp))
    ratio = loaded / idle
    print(f"small turns p95: idle {idle:.2f} s, next to a {args.fanout}-call fan-out {loaded:.2f} s ({ratio:.2f}x)")
    verdict = "MET" if ratio <= TARGET else "MISSED"
    print(f"target: p95 next to the fan-out <= {TARGET:g}x idle: {verdict}")
    return 0 if verdict == "MET" else 1


if __name__ == "__main__":
    sys.exit(main())
