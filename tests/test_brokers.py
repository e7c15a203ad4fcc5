"""Each broker gets its own settings (RabbitMQ: quorum queues, or classic queues with priorities); a
small load run on RabbitMQ balances its ledger on quorum queues."""

from __future__ import annotations

import pytest
import redis.sentinel
from pydantic import ValidationError

from tests.brokers import RabbitVhost, rabbitmqctl
from toolchord.orchestrator.bench.load import LoadConfig, run_scenario
from toolchord.worker.celery_app import create_app
from toolchord.worker.config import ConfigError, Settings
from toolchord.worker.priorities import broker_priority
from toolchord.worker.redis_clients import REDIS_SOCKET_TIMEOUT

REDIS = "redis://127.0.0.1:6390/0"
AMQP = "amqp://guest:guest@127.0.0.1:5672/tc"
SENTINELS = "sentinel://127.0.0.1:26390/0;sentinel://127.0.0.1:26391/0"


def test_rabbitmq_broker_gets_quorum_queues_and_confirms_not_redis_options() -> None:
    app = create_app(Settings.from_env({"TOOLCHORD_BROKER_URL": AMQP, "TOOLCHORD_REDIS_URL": REDIS}))
    conf = app.conf
    assert conf.broker_transport_options == {"confirm_publish": True}
    assert conf.task_default_queue_type == conf.task_create_missing_queue_type == "quorum"
    assert conf.task_default_exchange_type == conf.task_create_missing_queue_exchange_type == "topic"
    assert conf.worker_detect_quorum_queues is True
    assert conf.task_queue_max_priority is None
    assert app.amqp.queues["toolchord"].queue_arguments == {"x-queue-type": "quorum"}
    assert app.amqp.queues["a-tool-queue"].queue_arguments == {"x-queue-type": "quorum"}
    assert app.whole_second_countdowns  # Celery's native delayed delivery counts whole seconds
    assert conf.result_backend == REDIS and not conf.result_backend_transport_options


def test_rabbitmq_classic_queue_type_declares_every_queue_with_priorities() -> None:
    env = {"TOOLCHORD_BROKER_URL": AMQP, "TOOLCHORD_REDIS_URL": REDIS, "TOOLCHORD_RABBITMQ_QUEUE_TYPE": "classic"}
    app = create_app(Settings.from_env(env))
    conf = app.conf
    assert conf.task_default_queue_type == conf.task_create_missing_queue_type == "classic"
    # The same exchanges as quorum queues: switching the type does not clash on them.
    assert conf.task_default_exchange_type == conf.task_create_missing_queue_exchange_type == "topic"
    # Celery declares the default queue and each tool queue it creates on demand with x-max-priority.
    assert app.amqp.queues["toolchord"].queue_arguments == {"x-max-priority": 9}
    assert app.amqp.queues["a-tool-queue"].queue_arguments == {"x-max-priority": 9}
    assert not app.whole_second_countdowns  # the worker holds a countdown: fractions stay
    with pytest.raises(ValidationError, match="rabbitmq_queue_type"):
        Settings.from_env({**env, "TOOLCHORD_RABBITMQ_QUEUE_TYPE": "stream"})


def test_priority_steps_become_each_broker_s_numbers() -> None:
    # Redis takes step 0 first; RabbitMQ delivers the highest priority first.
    assert [broker_priority(step, "redis") for step in range(10)] == list(range(10))
    assert [broker_priority(step, "memory") for step in range(10)] == list(range(10))
    assert [broker_priority(step, "amqp") for step in range(10)] == list(range(9, -1, -1))
    with pytest.raises(ValueError, match="outside 0..9"):
        broker_priority(10, "amqp")


def test_redis_broker_gets_visibility_timeout_and_classic_queues() -> None:
    conf = create_app(Settings.from_env({"TOOLCHORD_BROKER_URL": REDIS, "TOOLCHORD_VISIBILITY_TIMEOUT": "400"})).conf
    assert conf.broker_transport_options == {
        "visibility_timeout": 400, "unacked_restore_interval": 100, "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 200, "priority_steps": list(range(10)),
        # A partitioned broker is an error after this long, not a block without end.
        "socket_timeout": REDIS_SOCKET_TIMEOUT, "socket_connect_timeout": REDIS_SOCKET_TIMEOUT,
    }
    assert (conf.redis_socket_timeout, conf.redis_socket_connect_timeout) == (REDIS_SOCKET_TIMEOUT,) * 2
    assert conf.task_default_queue_type == "classic"
    assert not conf.result_backend_transport_options


def test_sentinel_urls_need_a_master_name_and_pass_it_to_celery_and_clients() -> None:
    env = {"TOOLCHORD_BROKER_URL": AMQP, "TOOLCHORD_REDIS_URL": SENTINELS}
    with pytest.raises(ConfigError, match="TOOLCHORD_REDIS_MASTER_NAME"):
        Settings.from_env(env)
    settings = Settings.from_env({**env, "TOOLCHORD_REDIS_MASTER_NAME": "tc"})
    conf = create_app(settings).conf
    assert conf.result_backend == SENTINELS
    assert conf.result_backend_transport_options == {"master_name": "tc", "sentinel_kwargs": {
        "socket_timeout": REDIS_SOCKET_TIMEOUT, "socket_connect_timeout": REDIS_SOCKET_TIMEOUT}}
    client = settings.redis_client()
    pool = client.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool) and pool.service_name == "tc"
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in pool.sentinel_manager.sentinels] == [("127.0.0.1", 26390), ("127.0.0.1", 26391)]
    # A Sentinel broker is a Redis broker: the Redis transport options, plus the master's name.
    broker = Settings.from_env({"TOOLCHORD_BROKER_URL": SENTINELS, "TOOLCHORD_REDIS_MASTER_NAME": "tc"})
    assert broker.redis_url == SENTINELS
    assert create_app(broker).conf.broker_transport_options["master_name"] == "tc"


@pytest.mark.slow
def test_small_load_run_on_rabbitmq_balances_on_quorum_queues(rabbitmq: RabbitVhost) -> None:
    rabbitmq.purge()
    report = run_scenario(LoadConfig(sessions=20, turns=2, calls=2, workers=1, max_seconds=90,
                                     broker_url=rabbitmq.url))
    assert report.completed
    assert report.ledger.calls == 21 * 2 * 2 and report.ledger.ok == report.ledger.calls
    assert report.ledger.balanced and report.ledger.unsafe_twice == 0
    queues = dict(line.split("\t") for line in rabbitmqctl(
        "list_queues", "-p", rabbitmq.name, "name", "type", "--quiet", "--no-table-headers").splitlines() if line)
    assert queues["toolchord"] == "quorum"
