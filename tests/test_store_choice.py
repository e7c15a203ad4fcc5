"""One place picks the stores of a configuration, and every store reports an outage as one type."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from toolchord.orchestrator.approval_store import MemoryApprovalStore, RedisApprovalStore
from toolchord.orchestrator.cancel_signals import announce_cancel
from toolchord.orchestrator.event_stores import JsonlEventLog, RedisEventLog
from toolchord.orchestrator.events import UserInput
from toolchord.orchestrator.stores import stores_for
from toolchord.orchestrator.turn_store import MemoryTurnStore, RedisTurnStore
from toolchord.worker.config import Settings
from toolchord.worker.idempotency import MemoryIdempotencyStore, RedisIdempotencyStore
from toolchord.worker.spill import MemorySpillStore, RedisSpillStore
from toolchord.worker.store_errors import StoreUnavailable


def test_embedded_without_redis_keeps_everything_in_this_process(tmp_path: Path) -> None:
    stores = stores_for(Settings(log_dir=str(tmp_path)))
    assert stores.redis is None
    assert isinstance(stores.worker.idempotency.inner, MemoryIdempotencyStore)  # type: ignore[attr-defined]
    assert isinstance(stores.worker.spill, MemorySpillStore)
    assert isinstance(stores.turns, MemoryTurnStore)
    assert isinstance(stores.approvals, MemoryApprovalStore)
    assert isinstance(stores.event_log, JsonlEventLog) and stores.event_log.directory == tmp_path


def test_a_configured_redis_holds_the_state_and_the_cluster_log(redis_url: str, tmp_path: Path) -> None:
    stores = stores_for(Settings(broker_url=redis_url, result_backend=redis_url, redis_url=redis_url,
                                 log_dir=str(tmp_path)))
    assert stores.redis is not None and stores.redis.ping()
    assert isinstance(stores.worker.idempotency.inner, RedisIdempotencyStore)  # type: ignore[attr-defined]
    assert isinstance(stores.worker.spill, RedisSpillStore)
    assert isinstance(stores.turns, RedisTurnStore)
    assert isinstance(stores.approvals, RedisApprovalStore)
    assert isinstance(stores.event_log, RedisEventLog)


def test_embedded_with_a_redis_still_logs_to_files(redis_url: str, tmp_path: Path) -> None:
    # The log follows the mode (docs/agent-loop.md): only a cluster writes Redis Streams.
    stores = stores_for(Settings(redis_url=redis_url, log_dir=str(tmp_path)))
    assert isinstance(stores.turns, RedisTurnStore)
    assert isinstance(stores.event_log, JsonlEventLog)


def _dead_redis() -> redis.Redis:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return redis.Redis(port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))


OPERATIONS: dict[str, Callable[[redis.Redis], Any]] = {
    "event log": lambda c: RedisEventLog(client=c).append("s", UserInput(text="x")),
    "turn store": lambda c: RedisTurnStore(c, 60).cancelled("s", "t"),
    "approval store": lambda c: RedisApprovalStore(c).pending(),
    "idempotency store": lambda c: RedisIdempotencyStore(c).results(["k"]),
    "spill store": lambda c: RedisSpillStore(c).put("s", "text"),
    "cancel channel": lambda c: announce_cancel(c, "s", "t"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", sorted(OPERATIONS))
def test_an_unreachable_redis_is_store_unavailable_with_its_cause(store: str) -> None:
    with pytest.raises(StoreUnavailable) as raised:
        OPERATIONS[store](_dead_redis())
    assert isinstance(raised.value.__cause__, redis.ConnectionError)
