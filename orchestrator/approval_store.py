"""Where calls waiting for a person's decision are kept, and where that decision is made atomically.

One record per waiting call: what it is (tool, redacted arguments, idempotency key, the Celery
signature it will be sent with) and its state, which moves `PENDING_APPROVAL` → `APPROVED` |
`DENIED` | `EXPIRED` exactly once. In Redis the move is one Lua script, so two processes deciding
at once get one winner; in memory (embedded mode) a lock does the same.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Literal, Protocol

import redis
from pydantic import BaseModel, Field

from toolchord.worker.models import SideEffect, ToolCall
from toolchord.worker.store_errors import store_operation

ApprovalState = Literal["PENDING_APPROVAL", "APPROVED", "DENIED", "EXPIRED"]
Decision = Literal["APPROVED", "DENIED", "EXPIRED"]
PREFIX = "toolchord:approval:"
PENDING_INDEX = "toolchord:approvals:pending"


class Approval(BaseModel):
    """A call that was not dispatched because its tool's policy wants a person's decision."""

    session_id: str
    turn_id: str
    call: ToolCall = Field(description="The call as the log shows it (secrets masked).")
    tool: str
    side_effect: SideEffect
    arguments: dict[str, Any] = Field(description="The validated arguments, redacted.")
    key: str = Field(description="The idempotency key the call was planned with.")
    task_id: str
    run_window: float = Field(description="Seconds an approved call may take before it is given up on.")
    requested_at: float
    expires_at: float
    state: ApprovalState = "PENDING_APPROVAL"
    decided_by: str | None = None
    decided_at: float | None = None
    note: str | None = None
    dispatched: bool = Field(default=False, description="The approved call's task was sent.")
    signature: dict[str, Any] | None = Field(
        default=None, repr=False, description="The Celery signature to send on approval (holds the real arguments).")

    @property
    def dispatch_deadline(self) -> float:
        """When an approved call's result is no longer waited for."""
        return (self.decided_at or self.requested_at) + self.run_window

    def public(self) -> dict[str, Any]:
        """The record without the signature (which carries unredacted arguments)."""
        return self.model_dump(mode="json", exclude={"signature"})


class ApprovalStore(Protocol):
    """Waiting calls by session and call id; `decide` is the one atomic state change."""

    def open(self, approvals: list[Approval], ttl: int) -> None:
        """Record waiting calls (those already recorded are left as they are)."""
        ...

    def get(self, session_id: str, call_id: str) -> Approval | None: ...

    def for_turn(self, session_id: str, turn_id: str) -> list[Approval]:
        """The turn's waiting calls in model order, whatever their state."""
        ...

    def pending(self, session_id: str | None = None) -> list[Approval]:
        """Calls still in PENDING_APPROVAL (of one session, or all), soonest deadline first."""
        ...

    def decide(self, session_id: str, call_id: str, decision: Decision, by: str, note: str | None,
               now: float) -> tuple[Approval | None, bool]:
        """Move a pending call to `decision` (EXPIRED instead once its deadline passed), unless it was
        decided already. Returns the record after the attempt and whether this call changed it."""
        ...

    def mark_dispatched(self, session_id: str, call_id: str) -> None: ...


# KEYS: record hash, pending index. ARGV: decision, by, note, now, index member.
_DECIDE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'PENDING_APPROVAL' then return 0 end
local decision, by, note = ARGV[1], ARGV[2], ARGV[3]
if tonumber(ARGV[4]) >= tonumber(redis.call('HGET', KEYS[1], 'expires_at')) then
    decision, by, note = 'EXPIRED', 'toolchord', ''
end
redis.call('HSET', KEYS[1], 'state', decision, 'by', by, 'note', note, 'at', ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[5])
return 1
"""

# KEYS: record hash, turn index, pending index. ARGV: request json, signature json, expires_at,
# ttl, call id, index member.
_OPEN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'request', ARGV[1], 'signature', ARGV[2], 'state', 'PENDING_APPROVAL',
           'expires_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[6])
return 1
"""

_STATE_FIELDS = ("state", "decided_by", "decided_at", "note", "dispatched", "signature")


def _member(session_id: str, call_id: str) -> str:
    return json.dumps([session_id, call_id])


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class RedisApprovalStore:
    """Records in Redis hashes `toolchord:approval:<session>:<call>`, expiring `ttl` after the deadline."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._decide = client.register_script(_DECIDE)
        self._open = client.register_script(_OPEN)

    @staticmethod
    def _key(session_id: str, call_id: str) -> str:
        return f"{PREFIX}{session_id}:{call_id}"

    @staticmethod
    def _turn_key(session_id: str, turn_id: str) -> str:
        return f"{PREFIX}turn:{session_id}:{turn_id}"

    @store_operation
    def open(self, approvals: list[Approval], ttl: int) -> None:
        for approval in approvals:
            keep = int(max(approval.expires_at - time.time(), 0) + approval.run_window + ttl)
            self._open(
                keys=[self._key(approval.session_id, approval.call.id),
                      self._turn_key(approval.session_id, approval.turn_id), PENDING_INDEX],
                args=[approval.model_dump_json(exclude=set(_STATE_FIELDS)), json.dumps(approval.signature),
                      repr(approval.expires_at), keep, approval.call.id,
                      _member(approval.session_id, approval.call.id)],
            )

    def _read(self, session_id: str, call_id: str) -> Approval | None:
        raw = {_text(k) or "": _text(v) or "" for k, v in self.redis.hgetall(self._key(session_id, call_id)).items()}
        if not raw.get("request"):
            return None
        at = raw.get("at")
        return Approval.model_validate_json(raw["request"]).model_copy(update={
            "state": raw["state"],
            "decided_by": raw.get("by") or None,
            "decided_at": float(at) if at else None,
            "note": raw.get("note") or None,
            "dispatched": raw.get("dispatched") == "1",
            "signature": json.loads(raw["signature"]) if raw.get("signature") else None,
        })

    @store_operation
    def get(self, session_id: str, call_id: str) -> Approval | None:
        return self._read(session_id, call_id)

    @store_operation
    def for_turn(self, session_id: str, turn_id: str) -> list[Approval]:
        ids = sorted(_text(m) or "" for m in self.redis.smembers(self._turn_key(session_id, turn_id)))
        found = [a for a in (self._read(session_id, call_id) for call_id in ids) if a is not None]
        return sorted(found, key=lambda a: a.call.index)

    @store_operation
    def pending(self, session_id: str | None = None) -> list[Approval]:
        out = []
        members: list[bytes] = self.redis.zrange(PENDING_INDEX, 0, -1)
        for member in members:
            member_session, call_id = json.loads(_text(member) or "[]")
            if session_id is not None and member_session != session_id:
                continue
            approval = self._read(member_session, call_id)
            if approval is None:  # expired out of Redis: drop the stale index entry
                self.redis.zrem(PENDING_INDEX, member)
            elif approval.state == "PENDING_APPROVAL":
                out.append(approval)
        return out

    @store_operation
    def decide(self, session_id: str, call_id: str, decision: Decision, by: str, note: str | None,
               now: float) -> tuple[Approval | None, bool]:
        changed = self._decide(keys=[self._key(session_id, call_id), PENDING_INDEX],
                               args=[decision, by, note or "", repr(now), _member(session_id, call_id)])
        return self._read(session_id, call_id), changed == 1

    @store_operation
    def mark_dispatched(self, session_id: str, call_id: str) -> None:
        self.redis.hset(self._key(session_id, call_id), "dispatched", "1")


class MemoryApprovalStore:
    """The same in process memory (embedded mode: decisions come from this process only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], Approval] = {}

    def open(self, approvals: list[Approval], ttl: int) -> None:
        with self._lock:
            for approval in approvals:
                self._records.setdefault((approval.session_id, approval.call.id), approval)

    def get(self, session_id: str, call_id: str) -> Approval | None:
        with self._lock:
            return self._records.get((session_id, call_id))

    def for_turn(self, session_id: str, turn_id: str) -> list[Approval]:
        with self._lock:
            found = [a for (s, _), a in self._records.items() if s == session_id and a.turn_id == turn_id]
        return sorted(found, key=lambda a: a.call.index)

    def pending(self, session_id: str | None = None) -> list[Approval]:
        with self._lock:
            found = [a for (s, _), a in self._records.items()
                     if a.state == "PENDING_APPROVAL" and session_id in (None, s)]
        return sorted(found, key=lambda a: a.expires_at)

    def decide(self, session_id: str, call_id: str, decision: Decision, by: str, note: str | None,
               now: float) -> tuple[Approval | None, bool]:
        with self._lock:
            approval = self._records.get((session_id, call_id))
            if approval is None or approval.state != "PENDING_APPROVAL":
                return approval, False
            if now >= approval.expires_at:
                decision, by, note = "EXPIRED", "toolchord", None
            approval = approval.model_copy(update={"state": decision, "decided_by": by, "decided_at": now,
                                                   "note": note or None})
            self._records[(session_id, call_id)] = approval
            return approval, True

    def mark_dispatched(self, session_id: str, call_id: str) -> None:
        with self._lock:
            approval = self._records.get((session_id, call_id))
            if approval is not None:
                self._records[(session_id, call_id)] = approval.model_copy(update={"dispatched": True})


__all__ = ["Approval", "ApprovalState", "ApprovalStore", "Decision", "MemoryApprovalStore", "RedisApprovalStore"]
