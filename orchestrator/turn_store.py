"""Where the orchestrator keeps turn records, turn results, cancel flags and late calls.

Redis when distributed (so another orchestrator process can resume a session), process memory
when embedded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import redis

from toolchord.orchestrator.turn import LateCall, TurnRecord, TurnResult
from toolchord.worker.idempotency import result_key
from toolchord.worker.store_errors import store_operation


class TurnStore(Protocol):
    def save(self, record: TurnRecord) -> None: ...

    def begin(self, record: TurnRecord) -> tuple[TurnResult | TurnRecord, list[LateCall]]:
        """Save `record` unless its turn exists, and read the session's late calls, in one round trip:
        the turn's result when it finished, else its record as saved before (a resubmitted turn keeps
        its plan), else `record`, now saved."""
        ...

    def active(self, session_id: str) -> TurnRecord | None:
        """The session's turn that has not finished, if any."""
        ...

    def record(self, session_id: str, turn_id: str) -> TurnRecord | None: ...

    def find(self, session_id: str, turn_id: str) -> tuple[TurnResult | TurnRecord | None, list[LateCall]]:
        """The turn's result when it finished, else its record when it exists; and the session's
        late calls (one round trip for both: a turn needs them at its start and at its end)."""
        ...

    def finish(
        self, record: TurnRecord, result: TurnResult, settled_late: Sequence[str] = (), watched: Sequence[LateCall] = ()
    ) -> None:
        """Store the turn's result, drop the late calls (by key) whose results it reported, and
        record its own calls whose results may still arrive (reported by the session's next turns)."""
        ...

    def result(self, session_id: str, turn_id: str) -> TurnResult | None: ...

    def cancel(self, session_id: str, turn_id: str) -> None: ...

    def cancelled(self, session_id: str, turn_id: str) -> bool: ...

    def look(self, session_id: str, turn_id: str, keys: Sequence[str]) -> tuple[bool, list[str | None]]:
        """Whether the turn's cancel flag is set, and the stored results of the idempotency `keys`
        (one round trip for both: a waiting turn asks for them together)."""
        ...


# Save the record unless the turn exists, and read the late calls: a turn's start in one round trip.
# KEYS: result, record, active, late; ARGV: record JSON, turn id, TTL.
_BEGIN = """
local late = redis.call('HVALS', KEYS[4])
local result = redis.call('GET', KEYS[1])
if result then return {'result', result, late} end
local record = redis.call('GET', KEYS[2])
if record then return {'record', record, late} end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[3], ARGV[2], 'EX', ARGV[3])
return {'saved', false, late}
"""


class RedisTurnStore:
    """Turn state in Redis under `toolchord:turn:*` and `toolchord:late:*`, expiring with the TTL."""

    def __init__(self, client: redis.Redis, ttl: int) -> None:
        self.redis = client
        self.ttl = ttl
        self._begin = client.register_script(_BEGIN)

    @staticmethod
    def _key(session_id: str, turn_id: str, part: str = "record") -> str:
        return f"toolchord:turn:{session_id}:{turn_id}:{part}"

    @store_operation
    def save(self, record: TurnRecord) -> None:
        pipe = self.redis.pipeline()
        pipe.set(self._key(record.session_id, record.turn_id), record.model_dump_json(), ex=self.ttl)
        pipe.set(f"toolchord:turn:{record.session_id}:active", record.turn_id, ex=self.ttl)
        pipe.execute()

    @store_operation
    def begin(self, record: TurnRecord) -> tuple[TurnResult | TurnRecord, list[LateCall]]:
        session_id, turn_id = record.session_id, record.turn_id
        keys = [self._key(session_id, turn_id, "result"), self._key(session_id, turn_id),
                f"toolchord:turn:{session_id}:active", f"toolchord:late:{session_id}"]
        state, found, late_values = self._begin(keys=keys, args=[record.model_dump_json(), turn_id, self.ttl])
        late = [LateCall.model_validate_json(v) for v in late_values]
        if state == b"result":
            return TurnResult.model_validate_json(found), late
        if state == b"record":
            return TurnRecord.model_validate_json(found), late
        return record, late

    @store_operation
    def active(self, session_id: str) -> TurnRecord | None:
        turn_id = self.redis.get(f"toolchord:turn:{session_id}:active")
        return self.record(session_id, turn_id.decode()) if turn_id else None

    @store_operation
    def record(self, session_id: str, turn_id: str) -> TurnRecord | None:
        raw = self.redis.get(self._key(session_id, turn_id))
        return TurnRecord.model_validate_json(raw) if raw else None

    @store_operation
    def find(self, session_id: str, turn_id: str) -> tuple[TurnResult | TurnRecord | None, list[LateCall]]:
        pipe = self.redis.pipeline(transaction=False)
        pipe.mget(self._key(session_id, turn_id, "result"), self._key(session_id, turn_id))
        pipe.hvals(f"toolchord:late:{session_id}")
        (result, record), late_values = pipe.execute()
        late = [LateCall.model_validate_json(v) for v in late_values]
        if result is not None:
            return TurnResult.model_validate_json(result), late
        return (TurnRecord.model_validate_json(record) if record is not None else None), late

    @store_operation
    def finish(
        self, record: TurnRecord, result: TurnResult, settled_late: Sequence[str] = (), watched: Sequence[LateCall] = ()
    ) -> None:
        done = record.model_copy(update={"status": "done"})
        late_key = f"toolchord:late:{record.session_id}"
        pipe = self.redis.pipeline()
        pipe.set(self._key(record.session_id, record.turn_id), done.model_dump_json(), ex=self.ttl)
        pipe.set(self._key(record.session_id, record.turn_id, "result"), result.model_dump_json(), ex=self.ttl)
        pipe.delete(f"toolchord:turn:{record.session_id}:active")
        if settled_late:
            pipe.hdel(late_key, *settled_late)
        if watched:
            pipe.hset(late_key, mapping={late.key: late.model_dump_json() for late in watched})
            pipe.expire(late_key, self.ttl)
        pipe.execute()

    @store_operation
    def result(self, session_id: str, turn_id: str) -> TurnResult | None:
        raw = self.redis.get(self._key(session_id, turn_id, "result"))
        return TurnResult.model_validate_json(raw) if raw else None

    @store_operation
    def cancel(self, session_id: str, turn_id: str) -> None:
        self.redis.set(self._key(session_id, turn_id, "cancel"), "1", ex=self.ttl)

    @store_operation
    def cancelled(self, session_id: str, turn_id: str) -> bool:
        return bool(self.redis.exists(self._key(session_id, turn_id, "cancel")))

    @store_operation
    def look(self, session_id: str, turn_id: str, keys: Sequence[str]) -> tuple[bool, list[str | None]]:
        # The idempotency store shares this client (toolchord.worker.stores): one pipeline for both.
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(self._key(session_id, turn_id, "cancel"))
        if keys:
            pipe.mget([result_key(k) for k in keys])
        replies = pipe.execute()
        stored = [v.decode() if v is not None else None for v in replies[1]] if keys else []
        return bool(replies[0]), stored



class MemoryTurnStore:
    """The same in process memory, for the embedded mode.

    Finished turns are kept for resubmission up to `max_finished` (oldest dropped first), so a
    long-lived embedded agent does not grow without bound.
    """

    def __init__(self, max_finished: int = 10_000,
                 results: Callable[[list[str]], list[str | None]] | None = None) -> None:
        """`results`: the stored results of idempotency keys (the embedded runtime's store), for `look`."""
        self._stored_results = results
        self._lock = threading.Lock()
        self._max_finished = max_finished
        self._records: dict[tuple[str, str], TurnRecord] = {}
        self._active: dict[str, str] = {}
        self._results: OrderedDict[tuple[str, str], TurnResult] = OrderedDict()
        self._cancelled: set[tuple[str, str]] = set()
        self._late: dict[str, dict[str, LateCall]] = {}

    def save(self, record: TurnRecord) -> None:
        with self._lock:
            self._records[(record.session_id, record.turn_id)] = record
            self._active[record.session_id] = record.turn_id

    def begin(self, record: TurnRecord) -> tuple[TurnResult | TurnRecord, list[LateCall]]:
        with self._lock:
            key = (record.session_id, record.turn_id)
            late = list(self._late.get(record.session_id, {}).values())
            found = self._results.get(key) or self._records.get(key)
            if found is not None:
                return found, late
            self._records[key] = record
            self._active[record.session_id] = record.turn_id
            return record, late

    def active(self, session_id: str) -> TurnRecord | None:
        with self._lock:
            turn_id = self._active.get(session_id)
            return self._records.get((session_id, turn_id)) if turn_id else None

    def record(self, session_id: str, turn_id: str) -> TurnRecord | None:
        with self._lock:
            return self._records.get((session_id, turn_id))

    def find(self, session_id: str, turn_id: str) -> tuple[TurnResult | TurnRecord | None, list[LateCall]]:
        with self._lock:
            key = (session_id, turn_id)
            late = list(self._late.get(session_id, {}).values())
            return self._results.get(key) or self._records.get(key), late

    def finish(
        self, record: TurnRecord, result: TurnResult, settled_late: Sequence[str] = (), watched: Sequence[LateCall] = ()
    ) -> None:
        with self._lock:
            key = (record.session_id, record.turn_id)
            pending = self._late.get(record.session_id, {})
            for late_key in settled_late:
                pending.pop(late_key, None)
            if watched:
                self._late.setdefault(record.session_id, {}).update((late.key, late) for late in watched)
            self._records[key] = record.model_copy(update={"status": "done"})
            self._results[key] = result
            self._cancelled.discard(key)
            if self._active.get(record.session_id) == record.turn_id:
                del self._active[record.session_id]
            while len(self._results) > self._max_finished:
                oldest, _ = self._results.popitem(last=False)
                self._records.pop(oldest, None)

    def result(self, session_id: str, turn_id: str) -> TurnResult | None:
        with self._lock:
            return self._results.get((session_id, turn_id))

    def cancel(self, session_id: str, turn_id: str) -> None:
        with self._lock:
            self._cancelled.add((session_id, turn_id))

    def cancelled(self, session_id: str, turn_id: str) -> bool:
        with self._lock:
            return (session_id, turn_id) in self._cancelled

    def look(self, session_id: str, turn_id: str, keys: Sequence[str]) -> tuple[bool, list[str | None]]:
        stored: list[str | None] = [None] * len(keys)
        if self._stored_results is not None and keys:
            stored = self._stored_results(list(keys))
        return self.cancelled(session_id, turn_id), stored
