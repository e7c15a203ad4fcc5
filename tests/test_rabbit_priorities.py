"""RabbitMQ queue types with real workers (docs/flow-control.md, "Fair share and priorities"): classic
queues with priorities let an interactive call overtake a batch queued before it, quorum queues (the
default) keep queue order, a retried call works on classic queues, and a queue that exists as the
other type is a QueueMismatch naming it, on the worker and on the publisher; the fairness bench runs
on RabbitMQ without leaving a queue behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.transport.native_delayed_delivery import level_name

from tests.brokers import RabbitVhost, private_vhost, rabbitmqctl, using_rabbitmq
from tests.cluster_helpers import call, run_in_thread, settings_for, wait_for
from tests.priority_tools import GATE, ORDER
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.bench import fairness
from toolchord.orchestrator.bench.processes import ProcessStartError, WorkerProcess
from toolchord.worker import Registry
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import RabbitQueueType
from toolchord.worker.rabbit_queues import QueueMismatch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

TOOLS = "tests.priority_tools"


@pytest.fixture(scope="module")
def classic_vhost() -> Iterator[RabbitVhost]:
    """A vhost of this module's own: the session's vhost holds quorum queues of the same names."""
    yield from private_vhost()


@pytest.fixture
def classic(classic_vhost: RabbitVhost) -> Iterator[RabbitVhost]:
    """The module's vhost, its default queue emptied, with the server held in shared use for the test."""
    with using_rabbitmq():
        classic_vhost.purge(("toolchord",))
        yield classic_vhost


def orchestrator(redis_url: str, broker_url: str, queue_type: RabbitQueueType, **settings: object) -> Orchestrator:
    registry = Registry.from_modules([TOOLS])
    config = settings_for(redis_url, broker_url).model_copy(update={"rabbitmq_queue_type": queue_type, **settings})
    return Orchestrator(registry, create_app(config, registry), turn_timeout=40)


def ready_messages(broker_url: str, queue: str = "toolchord") -> int:
    """Messages waiting in a queue (not those a worker holds)."""
    with Connection(broker_url) as connection:
        return int(connection.default_channel.queue_declare(queue, passive=True).message_count)


def queue_exists(broker_url: str, queue: str) -> bool:
    with Connection(broker_url) as connection:
        try:
            connection.channel().queue_declare(queue, passive=True)
        except connection.channel_errors:
            return False
        return True


def declare(broker_url: str, queue: str, arguments: dict[str, object]) -> None:
    """Declare a queue as an earlier deployment (or another tool) would have."""
    with Connection(broker_url) as connection:
        Queue(queue, Exchange(queue, "topic"), queue, queue_arguments=arguments).bind(connection.default_channel).declare()


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_an_interactive_call_overtakes_a_batch_queued_before_it_on_classic_queues_only(
        queue_type: RabbitQueueType, request: pytest.FixtureRequest, redis_url: str, clean_redis: redis.Redis,
        start_worker: Callable[..., WorkerProcess]) -> None:
    vhost: RabbitVhost = request.getfixturevalue("classic" if queue_type == "classic" else "rabbitmq")
    vhost.purge()
    # One pool process, prefetch 1 and late acks: while the blocker runs the worker takes nothing
    # else, so every later call waits in the queue, in the order the queue gives them out.
    start_worker(TOOLS, concurrency=1, TOOLCHORD_BROKER_URL=vhost.url, TOOLCHORD_RABBITMQ_QUEUE_TYPE=queue_type)
    orch = orchestrator(redis_url, vhost.url, queue_type)
    turns = [run_in_thread(orch.run_calls, "s-blocker", [call(0, "gate", label="blocker")])]
    wait_for(lambda: clean_redis.lrange(ORDER, 0, -1) == [b"blocker"], 30, "the blocker to start")
    # The batch calls hold the worker too, each until the test pushes to the gate once more.
    batch = [call(i, "gate", label=f"batch{i}") for i in range(4)]
    turns.append(run_in_thread(orch.run_calls, "s-batch", batch, priority="batch"))
    wait_for(lambda: ready_messages(vhost.url) == 4, 30, "the batch calls to be queued")
    interactive = run_in_thread(orch.run_calls, "s-interactive", [call(0, "mark", label="interactive")])
    turns.append(interactive)
    wait_for(lambda: ready_messages(vhost.url) == 5, 30, "the interactive call to be queued")
    clean_redis.rpush(GATE, "blocker")
    if queue_type == "classic":
        # The interactive call, then both turns' callbacks (sent at the top priority, not at
        # RabbitMQ's lowest) run before the batch: once the first batch call holds the worker, only
        # the other three wait in the queue, and the interactive turn is back.
        wait_for(lambda: b"batch0" in clean_redis.lrange(ORDER, 0, -1), 30, "the first batch call to start")
        assert ready_messages(vhost.url) == 3
        interactive[0].join(30)
        assert interactive[1]["value"].results[0].content == "interactive"
    clean_redis.rpush(GATE, *[f"batch{i}" for i in range(4)])
    for thread, box in turns:
        thread.join(40)
        assert [r.status for r in box["value"].results] == ["ok"] * len(box["value"].results)
    order = [label.decode() for label in clean_redis.lrange(ORDER, 0, -1)]
    batch_labels = [f"batch{i}" for i in range(4)]
    if queue_type == "classic":
        # The interactive call (AMQP priority 9) first, then the batch by fair share (4, 3, 2, 2).
        assert order == ["blocker", "interactive", *batch_labels]
    else:
        # RabbitMQ 3.x quorum queues have no priorities: queue order, as before the setting existed.
        assert order == ["blocker", *batch_labels, "interactive"]


def test_a_retried_call_runs_again_on_classic_queues_with_the_worker_holding_its_countdown(
        classic: RabbitVhost, redis_url: str, clean_redis: redis.Redis,
        start_worker: Callable[..., WorkerProcess]) -> None:
    start_worker(TOOLS, concurrency=1, TOOLCHORD_BROKER_URL=classic.url, TOOLCHORD_RABBITMQ_QUEUE_TYPE="classic")
    orch = orchestrator(redis_url, classic.url, "classic")
    result = orch.run_calls("s-retry", [call(0, "flaky", key="k", failures=2)]).results[0]
    assert (result.status, result.content, result.attempts) == ("ok", "3", 3), result.error
    # Celery's native delayed delivery (quorum queues only) was not set up: the countdowns were
    # Celery's plain ETA, held by the worker, at their fraction of a second.
    assert not queue_exists(classic.url, level_name(0))


def test_a_worker_refuses_to_start_on_a_queue_of_the_other_type_naming_it_and_the_fix(
        classic: RabbitVhost, tmp_path: Path, start_worker: Callable[..., WorkerProcess]) -> None:
    declare(classic.url, "tc-was-quorum", {"x-queue-type": "quorum"})
    with pytest.raises(ProcessStartError, match="exited early"):
        start_worker(TOOLS, queues="tc-was-quorum", concurrency=1, name="mismatch", TOOLCHORD_BROKER_URL=classic.url,
                     TOOLCHORD_RABBITMQ_QUEUE_TYPE="classic", TOOLCHORD_DEFAULT_QUEUE="tc-was-quorum")
    log = (tmp_path / "mismatch.log").read_text()
    assert "QueueMismatch: RabbitMQ queue 'tc-was-quorum'" in log
    assert "exists as a quorum queue, but toolchord is configured for a classic queue with priorities" in log
    assert f"rabbitmqctl delete_queue -p {classic.name} tc-was-quorum" in log
    assert "or set TOOLCHORD_RABBITMQ_QUEUE_TYPE=quorum" in log
    # Said once, as toolchord's error: not amqp's own exception and traceback.
    assert "amqp.exceptions.PreconditionFailed" not in log


@pytest.mark.parametrize(("queue", "arguments", "configured", "existing", "switch"), [
    ("tc-was-classic", {"x-max-priority": 9}, "quorum", "a classic queue with x-max-priority 9", "classic"),
    ("tc-was-plain", {}, "classic", "a queue without priorities (no x-max-priority)", None),
], ids=["quorum-publisher-on-a-classic-priority-queue", "classic-publisher-on-a-plain-classic-queue"])
def test_a_turn_sent_to_a_queue_of_the_other_type_raises_queue_mismatch(
        classic: RabbitVhost, redis_url: str, clean_redis: redis.Redis, queue: str, arguments: dict[str, object],
        configured: RabbitQueueType, existing: str, switch: str | None) -> None:
    declare(classic.url, queue, arguments)
    orch = orchestrator(redis_url, classic.url, configured, default_queue=queue)
    for attempt in range(2):  # the refusal closed the publisher's channel: the next send says so again
        with pytest.raises(QueueMismatch) as raised:
            orch.run_calls(f"s-mismatch-{attempt}", [call(0, "mark", label="never")])
        message = str(raised.value)
        assert raised.value.queue == queue and raised.value.configured == configured
        assert f"exists as {existing}, but toolchord is configured for" in message
        assert f"(TOOLCHORD_RABBITMQ_QUEUE_TYPE={configured})" in message and "delete_queue" in message
        assert (f"or set TOOLCHORD_RABBITMQ_QUEUE_TYPE={switch}" in message) == (switch is not None)
    assert ready_messages(classic.url, queue) == 0


def test_the_fairness_bench_runs_on_rabbitmq_in_a_queue_of_its_own_and_removes_it(
        classic: RabbitVhost, tmp_path: Path) -> None:
    idle, loaded = fairness.run(fanout=8, small=2, work_ms=20, workdir=tmp_path, broker_url=classic.url,
                                queue_type="classic")
    assert idle > 0 and loaded > 0
    queues = rabbitmqctl("list_queues", "-p", classic.name, "name", "--quiet", "--no-table-headers").split()
    exchanges = rabbitmqctl("list_exchanges", "-p", classic.name, "name", "--quiet", "--no-table-headers").split()
    assert not [name for name in queues + exchanges if name.startswith("toolchord-fairness-")], (queues, exchanges)
