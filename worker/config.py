"""toolchord configuration from the environment (docs/configuration.md).

Every URL can also come from a file named by `<VARIABLE>_FILE` (Docker/Kubernetes secrets), so
passwords need not sit in the environment or on a command line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import redis
from pydantic import BaseModel, Field

from toolchord.worker.redis_clients import is_redis_url, is_sentinel_url, redis_client, scheme_of
from toolchord.worker.sandbox.profile import DirectFork

DEFAULT_MAX_ARGUMENT_BYTES = 1024 * 1024
DEFAULT_MAX_RESULT_DATA_BYTES = 1024 * 1024
DEFAULT_MAX_CALLS_PER_TURN = 128


class ConfigError(ValueError):
    """The configuration cannot work (for example pickle requested, or a missing secret file)."""


def _read(env: Mapping[str, str], name: str) -> str | None:
    file_name = env.get(f"{name}_FILE")
    if file_name:
        try:
            return Path(file_name).read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"{name}_FILE={file_name!r} cannot be read: {exc.strerror}") from exc
    return env.get(name) or None


AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
RabbitQueueType = Literal["quorum", "classic"]


class Settings(BaseModel):
    """Resolved settings. `embedded` is True when no broker is configured."""

    broker_url: str | None = None
    result_backend: str | None = None
    redis_url: str | None = None
    redis_master_name: str | None = Field(
        default=None, description="Sentinel master (service) name, for sentinel:// URLs."
    )
    tool_modules: tuple[str, ...] = ()
    default_queue: str = "toolchord"
    rabbitmq_queue_type: RabbitQueueType = Field(
        default="quorum",
        description=(
            "RabbitMQ broker only. quorum: replicated queues without priorities; classic: queues with "
            "x-max-priority 9, so fair share and batch priorities hold, on one node (not replicated)."
        ),
    )
    visibility_timeout: int = Field(default=3600, gt=0)
    result_ttl: int = Field(default=86400, gt=0)
    claim_lease: float = Field(default=15.0, gt=0, description="Seconds a claim lives without renewal.")
    result_store_patience: float = Field(
        default=30.0, ge=0, description="Seconds a worker keeps trying to store a finished call's result while Redis is unreachable."
    )
    redis_min_replicas: int | None = Field(
        default=None, ge=0,
        description="Replicas that must hold an unsafe call's claim and result (Redis WAIT); None: 1 with a "
        "sentinel:// Redis URL, else 0.",
    )
    redis_replica_timeout: float = Field(
        default=1.0, gt=0, description="Seconds one WAIT for those replicas may take."
    )
    sandbox_uid: int | None = Field(
        default=None, description="One uid for every sandboxed call of a root worker; None: a uid per call."
    )
    sandbox_direct_fork: DirectFork = Field(
        default="allow",
        description=(
            "refuse: a tool the sandbox zygote cannot run fails (DirectForkRefused) instead of "
            "running in a direct fork of the worker, whose memory holds the worker's secrets."
        ),
    )
    log_dir: str = ".toolchord/logs"
    max_argument_bytes: int = Field(
        default=DEFAULT_MAX_ARGUMENT_BYTES, gt=0,
        description="Largest arguments text (UTF-8 bytes) a call may carry; larger ones are refused unparsed.",
    )
    max_result_data_bytes: int = Field(
        default=DEFAULT_MAX_RESULT_DATA_BYTES, gt=0,
        description="Largest structured `data` (bytes of JSON) a result may carry; larger ones become an error.",
    )
    max_calls_per_turn: int = Field(
        default=DEFAULT_MAX_CALLS_PER_TURN, gt=0,
        description="Calls of one turn that run; the excess each get a NOT_EXECUTED result.",
    )

    task_events: bool = Field(
        default=False,
        description="Workers send Celery task events from the start (Flower's task views). Off by default: they "
        "cost PUBLISH round trips per task in the worker's main process, and a running Flower switches them on "
        "by itself (its `enable_events` broadcast, every few seconds).",
    )

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    @property
    def broker_kind(self) -> str:
        """"redis" (a Redis server or Sentinel group), "amqp" (RabbitMQ), "memory" (embedded) or the scheme."""
        if self.broker_url is None:
            return "memory"
        if is_redis_url(self.broker_url):
            return "redis"
        scheme = scheme_of(self.broker_url)
        return "amqp" if scheme in AMQP_SCHEMES else scheme

    @property
    def min_replicas(self) -> int:
        """Replicas an unsafe call's claim and result must reach before it starts and before it is reported."""
        if self.redis_min_replicas is not None:
            return self.redis_min_replicas
        return 1 if is_sentinel_url(self.redis_url) else 0

    def redis_client(self, **options: object) -> redis.Redis:
        """A client for `redis_url` (Sentinel-aware): the idempotency store, turns, events, spill."""
        if self.redis_url is None:
            raise ConfigError("no Redis configured (embedded mode)")
        return redis_client(self.redis_url, master_name=self.redis_master_name, **options)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read TOOLCHORD_* variables (see docs/configuration.md)."""
        env = os.environ if env is None else env
        broker = _read(env, "TOOLCHORD_BROKER_URL")
        redis_url = _read(env, "TOOLCHORD_REDIS_URL") or (broker if is_redis_url(broker) else None)
        backend = _read(env, "TOOLCHORD_RESULT_BACKEND") or redis_url
        if broker and not backend:
            raise ConfigError(
                "TOOLCHORD_BROKER_URL is not Redis, so set TOOLCHORD_RESULT_BACKEND or TOOLCHORD_REDIS_URL: "
                "chords need a result backend"
            )
        if broker and not redis_url:
            raise ConfigError("set TOOLCHORD_REDIS_URL: idempotency claims and results need Redis")
        master_name = env.get("TOOLCHORD_REDIS_MASTER_NAME") or None
        if not master_name and any(is_sentinel_url(url) for url in (broker, redis_url, backend)):
            raise ConfigError("a sentinel:// URL is configured, so set TOOLCHORD_REDIS_MASTER_NAME")
        modules = tuple(m.strip() for m in env.get("TOOLCHORD_TOOL_MODULES", "").split(",") if m.strip())
        values: dict[str, object] = {
            "broker_url": broker,
            "result_backend": backend,
            "redis_url": redis_url,
            "redis_master_name": master_name,
            "tool_modules": modules,
        }
        for field, var in (
            ("default_queue", "TOOLCHORD_DEFAULT_QUEUE"),
            ("rabbitmq_queue_type", "TOOLCHORD_RABBITMQ_QUEUE_TYPE"),
            ("visibility_timeout", "TOOLCHORD_VISIBILITY_TIMEOUT"),
            ("result_ttl", "TOOLCHORD_RESULT_TTL"),
            ("claim_lease", "TOOLCHORD_CLAIM_LEASE"),
            ("result_store_patience", "TOOLCHORD_RESULT_STORE_PATIENCE"),
            ("redis_min_replicas", "TOOLCHORD_REDIS_MIN_REPLICAS"),
            ("redis_replica_timeout", "TOOLCHORD_REDIS_REPLICA_TIMEOUT"),
            ("sandbox_uid", "TOOLCHORD_SANDBOX_UID"),
            ("sandbox_direct_fork", "TOOLCHORD_SANDBOX_DIRECT_FORK"),
            ("log_dir", "TOOLCHORD_LOG_DIR"),
            ("max_argument_bytes", "TOOLCHORD_MAX_ARGUMENT_BYTES"),
            ("max_result_data_bytes", "TOOLCHORD_MAX_RESULT_DATA_BYTES"),
            ("max_calls_per_turn", "TOOLCHORD_MAX_CALLS_PER_TURN"),
            ("task_events", "TOOLCHORD_TASK_EVENTS"),
        ):
            if env.get(var):
                values[field] = env[var]
        return cls.model_validate(values)
