"""The claim protocol's edge cases, on the Redis store (real server) and the embedded memory store."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from toolchord.orchestrator.bench.processes import free_port
from toolchord.worker.idempotency import ClaimState, IdempotencyStore, MemoryIdempotencyStore, RedisIdempotencyStore
from toolchord.worker.models import ToolResult
from toolchord.worker.pending_writes import PendingWrites
from toolchord.worker.store_errors import StoreUnavailable

LEASE = 0.05  # seconds: short enough to let a claim lapse within a test
TTL = 60


@pytest.fixture(params=["redis", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[IdempotencyStore]:
    if request.param == "memory":
        yield MemoryIdempotencyStore()
    else:
        client: redis.Redis = request.getfixturevalue("clean_redis")
        yield RedisIdempotencyStore(client)


def lapse() -> None:
    """Let a claim's lease run out (a stalled worker)."""
    time.sleep(LEASE * 3)


def test_the_first_attempts_real_result_replaces_a_provisional_outcome_unknown(store: IdempotencyStore) -> None:
    assert store.claim("k", "first", LEASE, TTL).state is ClaimState.CLAIMED
    lapse()
    # A redelivery finds the start but no live claim: it stores a stand-in for the unseen outcome.
    assert store.claim("k", "second", LEASE, TTL).state is ClaimState.RECLAIMED
    assert store.complete("k", "second", "unknown", TTL, provisional=True) == "unknown"
    # Another delivery of the same call is not the first attempt: the stand-in stays.
    assert store.complete("k", "third", "other", TTL) == "unknown"
    # The first attempt was slow, not lost: its real result wins over the stand-in, once.
    assert store.complete("k", "first", "real", TTL) == "real"
    assert store.result("k") == "real"
    assert store.complete("k", "first", "again", TTL) == "real"


def test_a_real_result_is_never_replaced(store: IdempotencyStore) -> None:
    store.claim("k", "first", LEASE, TTL)
    lapse()
    assert store.claim("k", "second", LEASE, TTL).state is ClaimState.RECLAIMED
    # The redelivery ran the call (a reconcile said it had not taken effect): first result wins.
    assert store.complete("k", "second", "second-run", TTL) == "second-run"
    assert store.complete("k", "first", "first-run", TTL) == "second-run"


def test_a_retry_before_running_does_not_erase_an_earlier_start(store: IdempotencyStore) -> None:
    store.claim("k", "first", LEASE, TTL)
    lapse()
    assert store.claim("k", "second", LEASE, TTL).state is ClaimState.RECLAIMED
    # The redelivery gives up before its handler started (a transient error, say) and retries...
    store.release("k", "second", forget_start=True)
    # ...but the first attempt did start: the next delivery must still know it.
    assert store.started("k")
    assert store.claim("k", "third", LEASE, TTL).state is ClaimState.RECLAIMED


def test_an_attempt_that_never_ran_is_forgotten(store: IdempotencyStore) -> None:
    assert store.claim("k", "first", LEASE, TTL).state is ClaimState.CLAIMED
    store.release("k", "first", forget_start=True)
    assert not store.started("k")
    assert store.claim("k", "second", LEASE, TTL).state is ClaimState.CLAIMED


def test_a_settled_call_never_starts_in_its_turn(store: IdempotencyStore) -> None:
    # Nothing started: settling sets the turn's flag, and no later claim in that turn takes the key.
    assert store.settle("k", "turn-1:k", TTL).state is ClaimState.CANCELLED
    assert store.claim("k", "late", LEASE, TTL, cancel_scope="turn-1:k").state is ClaimState.CANCELLED
    assert not store.started("k")
    # The flag is per turn: a business key's call may run in a later turn.
    assert store.claim("k", "next", LEASE, TTL, cancel_scope="turn-2:k").state is ClaimState.CLAIMED


def test_settling_a_started_or_finished_call_says_so(store: IdempotencyStore) -> None:
    store.claim("k", "first", LEASE, TTL, cancel_scope="t:k")
    # It began: it may have acted, so it cannot be reported NOT_EXECUTED.
    assert store.settle("k", "t:k", TTL).state is ClaimState.STARTED
    store.complete("k", "first", "done", TTL)
    settled = store.settle("k", "t:k", TTL)
    assert (settled.state, settled.result_json) == (ClaimState.STORED, "done")


def test_bookkeeping_riding_with_a_result_that_could_not_be_stored_goes_with_the_next_attempt(
        clean_redis: redis.Redis) -> None:
    pending = PendingWrites()
    # A Redis nobody listens on, then the real one: the worker's result store retries (tasks._store).
    unreachable = redis.Redis(port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    down = RedisIdempotencyStore(unreachable, pending=pending)
    up = RedisIdempotencyStore(clean_redis, pending=pending)
    up.claim("k", "token", LEASE * 100, TTL)
    pending.on_result(lambda result: lambda pipe: pipe.set("done-record", result.content))
    pending.result_ready(ToolResult(call_id="c", name="t", status="ok", content="stored"))
    with pytest.raises(StoreUnavailable):
        down.complete("k", "token", "result", TTL)
    assert clean_redis.get("done-record") is None
    assert up.complete("k", "token", "result", TTL) == "result"
    # The write the failed pipeline took went with the one that reached Redis, once.
    assert clean_redis.get("done-record") == b"stored"
    assert pending.take() == []
