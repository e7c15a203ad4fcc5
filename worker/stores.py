"""The one place that picks the worker side's stores for a configuration.

A configured Redis (`Settings.redis_url`) holds idempotency claims, stored results and spilled
outputs, so every process of the fleet sees them; without one (embedded mode) they live in this
process's memory. The orchestrator's own stores (`toolchord.orchestrator.stores`) build on this
choice and never make it again.
"""

from __future__ import annotations

from typing import NamedTuple

import redis

from toolchord.worker.config import Settings
from toolchord.worker.idempotency import IdempotencyStore, MemoryIdempotencyStore, RedisIdempotencyStore
from toolchord.worker.observability.hooks import ObservedStore
from toolchord.worker.pending_writes import PendingWrites
from toolchord.worker.spill import MemorySpillStore, RedisSpillStore, SpillStore


class WorkerStores(NamedTuple):
    """The stores of one worker runtime; `redis` is None when they live in process memory."""

    redis: redis.Redis | None
    idempotency: IdempotencyStore
    spill: SpillStore


def stores_for(settings: Settings, *, pending: PendingWrites | None = None) -> WorkerStores:
    """Redis-backed stores when a Redis is configured, in-memory ones otherwise.

    Each call opens its own connections (a forked pool child calls it again); in-memory stores are
    new and empty, so a runtime keeps the bundle it made for its whole life.
    """
    if settings.redis_url is None:
        return WorkerStores(None, ObservedStore(MemoryIdempotencyStore()), MemorySpillStore())
    client = settings.redis_client(health_check_interval=30)
    # `pending`: bookkeeping writes that ride in the claim's pipeline (a worker runtime's).
    idempotency = RedisIdempotencyStore(client, replica_timeout=settings.redis_replica_timeout, pending=pending)
    return WorkerStores(client, ObservedStore(idempotency), RedisSpillStore(client, settings.result_ttl))


__all__ = ["WorkerStores", "stores_for"]
