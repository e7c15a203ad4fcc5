"""The orchestrator side's stores for a configuration, built on the worker side's choice.

`toolchord.worker.stores.stores_for` decides once whether a configuration's state lives in Redis
or in process memory; the turn store, the approval store and the cancel channel follow its client.
The event log follows the mode: Redis Streams on a cluster, a JSONL file per session when
embedded (docs/agent-loop.md, "Event log").
"""

from __future__ import annotations

import os
from functools import cached_property

import redis

from toolchord.orchestrator.approval_store import ApprovalStore, MemoryApprovalStore, RedisApprovalStore
from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog, RedisEventLog
from toolchord.orchestrator.turn_store import MemoryTurnStore, RedisTurnStore, TurnStore
from toolchord.worker.config import Settings
from toolchord.worker.stores import WorkerStores
from toolchord.worker.stores import stores_for as worker_stores_for


class OrchestratorStores:
    """Turns, approvals, the cancel channel's client and the event log of one configuration."""

    def __init__(self, settings: Settings, worker: WorkerStores) -> None:
        self.settings = settings
        self.worker = worker
        self.turns: TurnStore = (
            MemoryTurnStore(results=worker.idempotency.results) if worker.redis is None
            else RedisTurnStore(worker.redis, settings.result_ttl)
        )
        self.approvals: ApprovalStore = (
            MemoryApprovalStore() if worker.redis is None else RedisApprovalStore(worker.redis)
        )

    @property
    def redis(self) -> redis.Redis | None:
        """Where cancels are announced and heard; None when turns live in this process only."""
        return self.worker.redis

    @cached_property
    def event_log(self) -> EventLog:
        """Opened on first use: a JSONL log creates its directory."""
        if not self.settings.embedded and self.worker.redis is not None:
            return RedisEventLog(client=self.worker.redis)
        return JsonlEventLog(self.settings.log_dir)


def stores_for(settings: Settings, worker: WorkerStores | None = None) -> OrchestratorStores:
    """The orchestrator's stores for `settings`, sharing `worker`'s stores when given (a runtime's own)."""
    return OrchestratorStores(settings, worker if worker is not None else worker_stores_for(settings))


def open_event_log(*, redis_url: str | None = None, log_dir: str | os.PathLike[str] | None = None) -> EventLog:
    """The log for the configuration: Redis Streams when distributed, a JSONL file per session when embedded.

    Explicit arguments win; otherwise `toolchord.worker.config.Settings.from_env()` decides (a configured
    broker means distributed, and its Redis URL holds the streams).
    """
    if redis_url:
        return RedisEventLog(redis_url, master_name=os.environ.get("TOOLCHORD_REDIS_MASTER_NAME"))
    if log_dir is not None:
        return JsonlEventLog(log_dir)
    return stores_for(Settings.from_env()).event_log


__all__ = ["OrchestratorStores", "open_event_log", "stores_for"]
