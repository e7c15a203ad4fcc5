"""Idempotency keys and the claim protocol (docs/idempotency.md).

A worker claims a call's key (atomic set-if-absent with a lease it renews while the handler runs)
before any side effect, and stores the final result under the key before the task is acknowledged.
Each key has up to four records:

- `result`  the final ToolResult JSON, kept for the result TTL (or the tool's dedupe window);
- `claim`   the live owner's token, expiring with the lease unless renewed;
- `started` set when a claim is taken and kept with the result TTL: a later claimer that finds it
            knows an earlier attempt began and may have acted (worker lost);
- `cancel`  a cooperative cancel flag the orchestrator sets; a worker that sees it does not start;
            it is also the tombstone of a call reported NOT_EXECUTED (`settle`), so that call
            can never start afterwards;
- `provisional` set beside a result that stands in for an outcome nobody saw (`OUTCOME_UNKNOWN`
            stored by a redelivery while the first attempt looked lost): if that first attempt
            comes back after all, its real result replaces the stand-in.

`RedisIdempotencyStore` is the distributed one (Lua scripts keep each step atomic);
`MemoryIdempotencyStore` serves the embedded mode, where worker and orchestrator share a process.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any, NamedTuple, Protocol

import redis
from pydantic import BaseModel

from toolchord.worker.pending_writes import PendingWrites, Write
from toolchord.worker.redis_clients import redis_client
from toolchord.worker.store_errors import StoreUnavailable, store_operation
from toolchord.worker.tools import ToolSpec

PREFIX = "toolchord:idem:"


def idempotency_key(spec: ToolSpec, session_id: str, call_id: str, arguments: dict[str, Any]) -> str:
    """The call's key: the tool's business key when it declares one, else session + call id.

    A business key dedupes the same action across turns (the model re-issuing a payment), so it
    is scoped by tool name only; the default key is unique per call of a session.
    """
    if spec.idempotency_key is not None:
        material = f"biz\0{spec.name}\0{spec.idempotency_key(arguments)}"
    else:
        material = f"call\0{session_id}\0{call_id}"
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def eager_idempotency_key(spec: ToolSpec, session_id: str, scope: str, arguments: dict[str, Any]) -> str:
    """The key of a call started while its message streamed: the tool's business key when it
    declares one, else session + `scope` (the model request and the call's occurrence in its
    message) + name + arguments.

    Not the provider's call id: a retried model request that returns the same call (same name and
    arguments) gets the same key, so the first run's stored result is reused instead of running again.
    """
    if spec.idempotency_key is not None:
        return idempotency_key(spec, session_id, "", arguments)
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    material = f"eager\0{session_id}\0{scope}\0{spec.name}\0{canonical}"
    return hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()[:40]


class ClaimState(str, Enum):
    CANCELLED = "cancelled"  # the turn was cancelled (or gave up) before this call started: do not run
    CLAIMED = "claimed"  # first attempt: run the handler
    RECLAIMED = "reclaimed"  # an earlier attempt started and its claim expired: it may have acted
    STORED = "stored"  # a result is stored: return it without running
    BUSY = "busy"  # another attempt holds a live claim: wait
    STARTED = "started"  # (settle only) an attempt began: the call may have acted, it cannot be settled unrun


class Claim(BaseModel):
    state: ClaimState
    result_json: str | None = None


class ReplicationLagError(StoreUnavailable):
    """Fewer replicas than required acknowledged a claim or a result within the replica timeout."""


class IdempotencyStore(Protocol):
    """Claims and results by idempotency key."""

    def claim(self, key: str, token: str, lease: float, ttl: int, cancel_scope: str | None = None, *,
              replicas: int = 0) -> Claim:
        """Take the claim, unless a result is stored, another live claim holds it, or `cancel_scope`
        is cancelled — in one atomic step, so a cancel either precedes the start or sees it.

        With `replicas`, a claim taken must reach that many replicas (Redis WAIT): if it does not,
        it is released and ReplicationLagError raised, so a failover cannot forget a call that ran.
        """
        ...

    def renew(self, key: str, token: str, lease: float) -> bool: ...

    def complete(self, key: str, token: str, result_json: str, ttl: int, *, provisional: bool = False,
                 replicas: int = 0) -> str:
        """Store the result unless one is stored already (first wins); release the claim.

        Returns the stored result, so a late duplicate reports what the first attempt reported.
        A `provisional` result (an outcome nobody observed) gives way to the real result of the
        attempt that started first, should it ever arrive. With `replicas`, ReplicationLagError
        when the stored result did not reach that many replicas (storing again is harmless).
        """
        ...

    def release(self, key: str, token: str, *, forget_start: bool) -> None:
        """Give the claim up without a result (before a retry); `forget_start` when nothing ran in
        this attempt (an earlier attempt's start is never forgotten)."""
        ...

    def result(self, key: str) -> str | None: ...

    def results(self, keys: list[str]) -> list[str | None]: ...

    def started(self, key: str) -> bool: ...

    def cancel(self, key: str, ttl: int) -> None: ...

    def cancelled(self, key: str) -> bool: ...

    def settle(self, key: str, cancel_scope: str, ttl: int) -> Claim:
        """Make sure a call that has not started never starts, before it is reported NOT_EXECUTED.

        One atomic step: a stored result is returned (STORED); a recorded start means an attempt
        began and may have acted (STARTED); otherwise the cancel flag of `cancel_scope` is set, which
        every later claim in that scope refuses (CANCELLED).
        """
        ...


_CLAIM = """
local result = redis.call('GET', KEYS[1])
if result then return {'stored', result} end
if KEYS[4] and redis.call('EXISTS', KEYS[4]) == 1 then return {'cancelled', false} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- `started` keeps the token of the attempt that started first: only it may replace a
  -- provisional result later.
  if redis.call('SET', KEYS[3], ARGV[1], 'NX', 'EX', ARGV[3]) then return {'claimed', false} end
  return {'reclaimed', false}
end
return {'busy', false}
"""

_SETTLE = """
local result = redis.call('GET', KEYS[1])
if result then return {'stored', result} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'started', false} end
redis.call('SET', KEYS[3], '1', 'EX', ARGV[1])
return {'cancelled', false}
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# Returns nil when this attempt's result is the one stored (the caller has it: no copy comes back),
# else the result stored before it.
_COMPLETE = """
local earlier = false
if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'EX', ARGV[3]) then
  if ARGV[4] == '1' then redis.call('SET', KEYS[4], '1', 'EX', ARGV[3]) end
elseif ARGV[4] == '0' and redis.call('EXISTS', KEYS[4]) == 1 and redis.call('GET', KEYS[3]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  redis.call('DEL', KEYS[4])
else
  earlier = redis.call('GET', KEYS[1])
end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return earlier
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  -- Forget the start only if it was this attempt's: an earlier attempt's start stays on record.
  if ARGV[2] == '1' and redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
end
return 0
"""


class _Keys(NamedTuple):
    result: str
    claim: str
    started: str
    cancel: str
    provisional: str


def _keys(key: str) -> _Keys:
    base = PREFIX + key
    return _Keys(f"{base}:result", f"{base}:claim", f"{base}:started", f"{base}:cancel", f"{base}:provisional")


def result_key(key: str) -> str:
    """The Redis key of the result stored under idempotency key `key`."""
    return _keys(key).result


class RedisIdempotencyStore:
    """The claim protocol on Redis; every step is one atomic script."""

    def __init__(self, client: redis.Redis, *, replica_timeout: float = 1.0,
                 pending: PendingWrites | None = None) -> None:
        self.redis = client
        self.replica_timeout = replica_timeout
        # Bookkeeping writes that ride along with the next claim or result (one round trip for both).
        self.pending = pending
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)
        self._settle = client.register_script(_SETTLE)

    @classmethod
    def from_url(cls, url: str, master_name: str | None = None) -> RedisIdempotencyStore:
        """A store on `url` (a sentinel:// URL needs `master_name`)."""
        return cls(redis_client(url, master_name=master_name, health_check_interval=30))

    def _pipelined(self, script: Any, keys: list[str], args: list[Any], replicas: int,
                   writes: list[Write]) -> tuple[Any, int]:
        """`writes`, then `script`, then (with `replicas`) WAIT on the same connection: one round trip.

        The script goes as EVAL (not EVALSHA): a pipeline holding a registered script first asks
        Redis whether it is loaded, which would cost a second round trip.
        """
        with self.redis.pipeline(transaction=False) as pipe:
            for write in writes:
                write(pipe)
            first = len(pipe)
            pipe.eval(script.script, len(keys), *keys, *args)
            if replicas > 0:
                pipe.wait(replicas, int(self.replica_timeout * 1000))
            try:
                # A failed bookkeeping write must not fail the script's step.
                replies = pipe.execute(raise_on_error=False)[first:]
            except BaseException:
                # Nothing was sent, or nobody knows: the step is tried again, and its writes with it.
                if self.pending is not None:
                    self.pending.give_back(writes)
                raise
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies[0], int(replies[1]) if replicas > 0 else replicas

    def _lag(self, what: str, acknowledged: int, replicas: int) -> ReplicationLagError:
        return ReplicationLagError(
            f"{what} reached {acknowledged} of {replicas} Redis replicas within {self.replica_timeout:g} s"
        )

    @store_operation
    def claim(self, key: str, token: str, lease: float, ttl: int, cancel_scope: str | None = None, *,
              replicas: int = 0) -> Claim:
        names = _keys(key)
        keys = [names.result, names.claim, names.started]
        if cancel_scope is not None:
            keys.append(_keys(cancel_scope).cancel)
        args = [token, int(lease * 1000), ttl]
        writes = self.pending.take() if self.pending is not None else []
        if replicas <= 0 and not writes:
            state, value = self._claim(keys=keys, args=args)
            acknowledged = replicas
        else:
            (state, value), acknowledged = self._pipelined(self._claim, keys, args, replicas, writes)
        claim = Claim(state=ClaimState(state.decode()), result_json=value.decode() if value else None)
        if acknowledged < replicas and claim.state in (ClaimState.CLAIMED, ClaimState.RECLAIMED):
            # A failover now could promote a replica that never saw this claim, and a redelivery
            # would run the call again: give it up before anything runs.
            self.release(key, token, forget_start=True)
            raise self._lag("the claim", acknowledged, replicas)
        return claim

    @store_operation
    def renew(self, key: str, token: str, lease: float) -> bool:
        return bool(self._renew(keys=[_keys(key).claim], args=[token, int(lease * 1000)]))

    @store_operation
    def complete(self, key: str, token: str, result_json: str, ttl: int, *, provisional: bool = False,
                 replicas: int = 0) -> str:
        names = _keys(key)
        keys = [names.result, names.claim, names.started, names.provisional]
        args = [token, result_json, ttl, "1" if provisional else "0"]
        writes = self.pending.take() if self.pending is not None else []
        if replicas <= 0 and not writes:
            earlier = self._complete(keys=keys, args=args)
        else:
            earlier, acknowledged = self._pipelined(self._complete, keys, args, replicas, writes)
            if acknowledged < replicas:
                raise self._lag("the stored result", acknowledged, replicas)
        return result_json if earlier is None else earlier.decode()

    @store_operation
    def release(self, key: str, token: str, *, forget_start: bool) -> None:
        names = _keys(key)
        self._release(keys=[names.claim, names.started], args=[token, "1" if forget_start else "0"])

    @store_operation
    def result(self, key: str) -> str | None:
        value = self.redis.get(_keys(key).result)
        return value.decode() if value is not None else None

    @store_operation
    def results(self, keys: list[str]) -> list[str | None]:
        """Stored results for many keys in one round trip."""
        if not keys:
            return []
        return [v.decode() if v is not None else None for v in self.redis.mget([result_key(k) for k in keys])]

    @store_operation
    def started(self, key: str) -> bool:
        return bool(self.redis.exists(_keys(key).started))

    @store_operation
    def cancel(self, key: str, ttl: int) -> None:
        self.redis.set(_keys(key).cancel, "1", ex=ttl)

    @store_operation
    def cancelled(self, key: str) -> bool:
        return bool(self.redis.exists(_keys(key).cancel))

    @store_operation
    def settle(self, key: str, cancel_scope: str, ttl: int) -> Claim:
        names = _keys(key)
        state, value = self._settle(keys=[names.result, names.started, _keys(cancel_scope).cancel], args=[ttl])
        return Claim(state=ClaimState(state.decode()), result_json=value.decode() if value else None)


class MemoryIdempotencyStore:
    """The same protocol in process memory, for the embedded mode and its in-process worker."""

    # Expired records nobody reads again would stay forever: sweep them every so many writes.
    _SWEEP_EVERY = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, tuple[str, float]] = {}
        self._writes = 0

    def _get(self, name: str) -> str | None:
        entry = self._values.get(name)
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            del self._values[name]
            return None
        return entry[0]

    def _set(self, name: str, value: str, seconds: float) -> None:
        now = time.monotonic()
        self._values[name] = (value, now + seconds)
        self._writes += 1
        if self._writes % self._SWEEP_EVERY == 0:
            for expired in [k for k, (_, until) in self._values.items() if until < now]:
                del self._values[expired]

    def claim(self, key: str, token: str, lease: float, ttl: int, cancel_scope: str | None = None, *,
              replicas: int = 0) -> Claim:
        # One process, no replicas: `replicas` has nothing to wait for.
        names = _keys(key)
        with self._lock:
            stored = self._get(names.result)
            if stored is not None:
                return Claim(state=ClaimState.STORED, result_json=stored)
            if cancel_scope is not None and self._get(_keys(cancel_scope).cancel) is not None:
                return Claim(state=ClaimState.CANCELLED)
            if self._get(names.claim) is not None:
                return Claim(state=ClaimState.BUSY)
            self._set(names.claim, token, lease)
            if self._get(names.started) is not None:
                return Claim(state=ClaimState.RECLAIMED)
            self._set(names.started, token, ttl)
            return Claim(state=ClaimState.CLAIMED)

    def renew(self, key: str, token: str, lease: float) -> bool:
        claim_key = _keys(key).claim
        with self._lock:
            if self._get(claim_key) != token:
                return False
            self._set(claim_key, token, lease)
            return True

    def complete(self, key: str, token: str, result_json: str, ttl: int, *, provisional: bool = False,
                 replicas: int = 0) -> str:
        names = _keys(key)
        with self._lock:
            stored = self._get(names.result)
            replaces_stand_in = (
                not provisional and self._get(names.provisional) is not None and self._get(names.started) == token
            )
            if stored is None or replaces_stand_in:
                self._set(names.result, result_json, ttl)
                stored = result_json
                if provisional:
                    self._set(names.provisional, "1", ttl)
                else:
                    self._values.pop(names.provisional, None)
            if self._get(names.claim) == token:
                del self._values[names.claim]
            return stored

    def release(self, key: str, token: str, *, forget_start: bool) -> None:
        names = _keys(key)
        with self._lock:
            if self._get(names.claim) == token:
                del self._values[names.claim]
                if forget_start and self._get(names.started) == token:
                    del self._values[names.started]

    def result(self, key: str) -> str | None:
        with self._lock:
            return self._get(_keys(key).result)

    def results(self, keys: list[str]) -> list[str | None]:
        return [self.result(k) for k in keys]

    def started(self, key: str) -> bool:
        with self._lock:
            return self._get(_keys(key).started) is not None

    def cancel(self, key: str, ttl: int) -> None:
        with self._lock:
            self._set(_keys(key).cancel, "1", ttl)

    def cancelled(self, key: str) -> bool:
        with self._lock:
            return self._get(_keys(key).cancel) is not None

    def settle(self, key: str, cancel_scope: str, ttl: int) -> Claim:
        names = _keys(key)
        with self._lock:
            stored = self._get(names.result)
            if stored is not None:
                return Claim(state=ClaimState.STORED, result_json=stored)
            if self._get(names.started) is not None:
                return Claim(state=ClaimState.STARTED)
            self._set(_keys(cancel_scope).cancel, "1", ttl)
            return Claim(state=ClaimState.CANCELLED)


class LeaseRenewer:
    """Renews every live claim of this process (and the limit permits its calls hold) from one
    background thread.

    One thread per process (not per call) keeps the per-call cost to a dict update; the thread
    starts with the first lease it holds.
    """

    def __init__(self, store: IdempotencyStore, lease: float) -> None:
        self._store, self.lease = store, lease
        self._held: dict[str, Callable[[], object]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextmanager
    def hold(self, key: str, token: str) -> Iterator[None]:
        """Keep the claim on `key` alive while the block runs."""
        with self.keep(key, lambda: self._store.renew(key, token, self.lease)):
            yield

    @contextmanager
    def keep(self, name: str, renew: Callable[[], object]) -> Iterator[None]:
        """Call `renew` every third of the lease while the block runs (a claim, a call's permits)."""
        with self._lock:
            self._held[name] = renew
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="toolchord-lease-renewer", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._held.pop(name, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.lease / 3)
            with self._lock:
                held = list(self._held.values())
            for renew in held:
                try:
                    renew()
                except StoreUnavailable:
                    # A blip in Redis: try again next round, before the lease would run out.
                    continue
