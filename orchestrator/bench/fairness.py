"""Fair share: do small turns keep their latency next to a large fan-out on the same fleet?

Run with `python -m toolchord.orchestrator.bench.fairness [--fanout 128] [--small 20] [--work-ms 200]`
(or `toolchord bench fairness`). Starts a private redis-server and one prefork worker with 2
processes. First the idle figure: `--small` sessions each send one call of `--work-ms` at once, on
an idle fleet. Then the loaded figure: one session fans out `--fanout` such calls, and once they
queue, the small sessions send theirs again. The target: the small turns' p95 latency under load
at most 2x the idle p95 (docs/flow-control.md, "Fair share"); the bench prints MET or MISSED and
exits 1 when missed.

The broker is the private Redis, or RabbitMQ with `--broker-url amqp://...` (results and claims stay
in the private Redis) and `--rabbitmq-queue-type quorum|classic` (TOOLCHORD_RABBITMQ_QUEUE_TYPE).
On RabbitMQ the bench uses a queue of its own (`toolchord-fairness-<random>`), so it never takes
or leaves messages in the vhost's other queues, and deletes that queue and its exchange at the end;
Celery's shared exchanges and delay queues (`celery.pidbox`, `celeryev`, `celery_delayed_*`) stay.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kombu import Connection
from kombu.utils.url import maybe_sanitize_url

from toolchord.orchestrator.bench.processes import RedisServer, WorkerProcess, worker_env
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import RabbitQueueType, Settings
from toolchord.worker.models import ToolCall
from toolchord.worker.registry import Registry

TOOL_MODULE = "toolchord.worker.bench_tools"
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


def run(fanout: int, small: int, work_ms: float, workdir: Path, broker_url: str | None = None,
        queue_type: RabbitQueueType = "quorum") -> tuple[float, float]:
    """The small turns' p95 on an idle fleet and next to the fan-out; the broker is the private
    Redis unless `broker_url` names another (RabbitMQ, with queues of `queue_type`)."""
    server = RedisServer(workdir)
    server.start()
    queue = f"toolchord-fairness-{uuid.uuid4().hex[:12]}"
    broker = broker_url or server.url
    env = worker_env(server.url, TOOL_MODULE, TOOLCHORD_BROKER_URL=broker, TOOLCHORD_REDIS_URL=server.url,
                     TOOLCHORD_DEFAULT_QUEUE=queue, TOOLCHORD_RABBITMQ_QUEUE_TYPE=queue_type)
    worker = WorkerProcess(env, queue, 2, "fairness", workdir / "worker.log", loglevel="WARNING")
    try:
        worker.start()
        settings = Settings(broker_url=broker, result_backend=server.url, redis_url=server.url, default_queue=queue,
                            rabbitmq_queue_type=queue_type, max_calls_per_turn=max(fanout, 1))
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
        # Celery result objects unsubscribe from Redis when collected: let them, before Redis goes.
        gc.collect()
        server.stop()
        if broker_url is not None:
            _delete_queue(broker_url, queue)


def _delete_queue(broker_url: str, queue: str) -> None:
    """Delete the bench's queue and the exchange of the same name Celery declared for it."""
    with Connection(broker_url) as connection:
        channel = connection.channel()
        channel.queue_delete(queue)
        channel.exchange_delete(queue)


def main(argv: Sequence[str] | None = None) -> int:
    """`toolchord bench fairness`: print the figures and MET or MISSED (exit 1)."""
    parser = argparse.ArgumentParser(prog="toolchord bench fairness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fanout", type=int, default=128, help="calls of the large turn")
    parser.add_argument("--small", type=int, default=20, help="sessions with one call each")
    parser.add_argument("--work-ms", type=float, default=200.0, help="time each call works")
    parser.add_argument("--broker-url", help="broker to use instead of the private Redis: an amqp:// URL of a "
                                             "RabbitMQ vhost (results and claims stay in the private Redis)")
    parser.add_argument("--rabbitmq-queue-type", choices=["quorum", "classic"],
                        help="with an amqp:// --broker-url: the queue type (TOOLCHORD_RABBITMQ_QUEUE_TYPE, default quorum)")
    args = parser.parse_args(argv)
    amqp = args.broker_url is not None and Settings(broker_url=args.broker_url).broker_kind == "amqp"
    if args.rabbitmq_queue_type is not None and not amqp:
        parser.error("--rabbitmq-queue-type needs an amqp:// --broker-url")
    queue_type: RabbitQueueType = "classic" if args.rabbitmq_queue_type == "classic" else "quorum"
    with tempfile.TemporaryDirectory(prefix="toolchord-fairness-") as tmp:
        idle, loaded = run(args.fanout, args.small, args.work_ms, Path(tmp), args.broker_url, queue_type)
    broker = (f"RabbitMQ, {queue_type} queues" if amqp else
              "the private Redis" if args.broker_url is None else maybe_sanitize_url(args.broker_url))
    print(f"broker: {broker}")
    ratio = loaded / idle
    print(f"small turns p95: idle {idle:.2f} s, next to a {args.fanout}-call fan-out {loaded:.2f} s ({ratio:.2f}x)")
    verdict = "MET" if ratio <= TARGET else "MISSED"
    print(f"target: p95 next to the fan-out <= {TARGET:g}x idle: {verdict}")
    return 0 if verdict == "MET" else 1


if __name__ == "__main__":
    sys.exit(main())
