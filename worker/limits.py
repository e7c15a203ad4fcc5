"""Fleet-wide flow control: named limits on calls in flight and on call rates (docs/flow-control.md).

A `Limit` caps the calls of one or more tools fleet-wide: `concurrency` permits are LEASED (a sorted
set of holders scored by lease expiry, expired holders purged by the same script), so the permits of
a killed worker come back within the lease; `rate` is a GCRA (one key per limit key, no timers).
`RedisLimiter` checks and takes every limit of a call in one atomic script (one round trip): all
permits or none. `MemoryLimiter` is the same for the embedded mode (one process).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toolchord.worker.store_errors import store_operation

if TYPE_CHECKING:
    # Tools import this module, and so does the sandbox zygote, which has no use for redis-py.
    import redis

PREFIX = "toolchord:limit:"
_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
          "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d*(?:\.\d+)?)\s*([a-z]+)\s*$")


class LimitContext(BaseModel):
    """What a limit's key function may look at besides the arguments."""

    model_config = ConfigDict(frozen=True)

    tool: str
    session_id: str
    tenant: str | None = None


LimitKey = Callable[[dict[str, Any], LimitContext], "str | None"]
"""A function of (arguments, context) naming the bucket a call counts against (a tenant, a
credential, a resource); None counts the call against the limit's shared bucket."""


def parse_rate(text: str) -> tuple[int, float]:
    """"100/s", "5000/h", "10/2s" → (calls, period in seconds)."""
    match = _RATE.match(text.lower())
    if match is None or match.group(3) not in _UNITS or int(match.group(1)) <= 0:
        raise ValueError(f"rate {text!r} is not like '100/s', '5000/h' or '10/2m'")
    count, multiple, unit = match.groups()
    period = float(multiple or 1) * _UNITS[unit]
    if period <= 0:
        raise ValueError(f"rate {text!r} has no period")
    return int(count), period


class Limit(BaseModel):
    """A named fleet-wide limit; pass the same object to several tools to share it.

    `concurrency`: most calls in flight at once. `rate`: calls per period ("100/s", "5000/h") with
    up to `burst` calls back to back (default 1: evenly spaced). `key`: per-bucket limits (each
    tenant, credential or resource its own `concurrency` and `rate`).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    concurrency: int | None = Field(default=None, gt=0)
    rate: str | None = None
    burst: int = Field(default=1, ge=1)
    key: LimitKey | None = None

    @model_validator(mode="after")
    def _check(self) -> Limit:
        if self.concurrency is None and self.rate is None:
            raise ValueError(f"limit {self.name!r} needs concurrency=, rate= or both")
        if self.rate is not None:
            parse_rate(self.rate)
        return self

    @property
    def interval(self) -> float | None:
        """Seconds between calls at the steady rate (GCRA's emission interval)."""
        if self.rate is None:
            return None
        count, period = parse_rate(self.rate)
        return period / count

    def describe(self) -> str:
        parts = [f"concurrency {self.concurrency}"] if self.concurrency else []
        if self.rate:
            parts.append(f"rate {self.rate}" + (f" (burst {self.burst})" if self.burst > 1 else ""))
        return ", ".join(parts) + (" per key" if self.key else "")


class Bucket(NamedTuple):
    """One limit as it applies to one call: the limit and the bucket key its function chose."""

    limit: Limit
    key: str


def buckets_for(limits: Sequence[Limit], arguments: dict[str, Any], context: LimitContext) -> list[Bucket]:
    """The buckets a call counts against (a key function that raises is the caller's to report)."""
    found = []
    for limit in limits:
        key = limit.key(arguments, context) if limit.key is not None else None
        found.append(Bucket(limit, "_" if key is None else str(key)))
    return found


class Admission(NamedTuple):
    """What the limiter said: admitted, or which limit refused and when to ask again (None: unknown)."""

    admitted: bool
    limit: str | None = None
    retry_after: float | None = None


class Usage(NamedTuple):
    """A limit's fleet-wide use right now."""

    name: str
    in_use: int
    waiting: int


class LimitedTool(Protocol):
    """A tool as far as its limits go (a ToolSpec)."""

    @property
    def name(self) -> str: ...

    @property
    def limits(self) -> tuple[Limit, ...]: ...


def declared_limits(tools: Iterable[LimitedTool]) -> dict[str, tuple[Limit, list[str]]]:
    """Every limit the tools declare, by name (sorted), with the tools that count against it."""
    found: dict[str, tuple[Limit, list[str]]] = {}
    for spec in tools:
        for limit in spec.limits:
            found.setdefault(limit.name, (limit, []))[1].append(spec.name)
    return dict(sorted(found.items()))


class Limiter(Protocol):
    """Takes, renews and gives back the permits of one call (`holder`: the call's idempotency key)."""

    def acquire(self, buckets: Sequence[Bucket], holder: str, lease: float, wait_ttl: float) -> Admission: ...

    def renew(self, buckets: Sequence[Bucket], holder: str, lease: float) -> None: ...

    def release(self, buckets: Sequence[Bucket], holder: str) -> None: ...

    def usage(self, names: Sequence[str]) -> list[Usage]: ...


# KEYS per bucket i: 3i-2 its state (holders zset or GCRA time), 3i-1 the limit's in-use zset,
# 3i the limit's waiting zset. ARGV: now_ms, holder, lease_ms, wait_ttl_ms, then per bucket
# kind ('c' concurrency, 'r' rate), max (concurrency) or interval_ms (rate), burst, bucket key.
# Checks every bucket first and takes nothing unless all admit.
_ACQUIRE = """
local now, holder, lease = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local n = #KEYS / 3
local blocked, wait = 0, -1
local tats = {}
for i = 1, n do
  local state, kind = KEYS[3*i-2], ARGV[4*i+1]
  local a, b = tonumber(ARGV[4*i+2]), tonumber(ARGV[4*i+3])
  if kind == 'c' then
    redis.call('ZREMRANGEBYSCORE', state, '-inf', now)
    redis.call('ZREMRANGEBYSCORE', KEYS[3*i-1], '-inf', now)
    if not redis.call('ZSCORE', state, holder) and redis.call('ZCARD', state) >= a then
      if blocked == 0 then blocked = i end
    end
  else
    local tat = tonumber(redis.call('GET', state) or now)
    if tat < now then tat = now end
    local allow_at = tat + a - b * a
    if now < allow_at then
      if blocked == 0 then blocked = i end
      if allow_at - now > wait then wait = allow_at - now end
    else
      tats[i] = tat + a
    end
  end
end
if blocked > 0 then
  for i = 1, n do
    redis.call('ZREMRANGEBYSCORE', KEYS[3*i], '-inf', now)
  end
  redis.call('ZADD', KEYS[3*blocked], now + tonumber(ARGV[4]), holder)
  redis.call('PEXPIRE', KEYS[3*blocked], ARGV[4])
  return {blocked, wait}
end
for i = 1, n do
  local state = KEYS[3*i-2]
  if ARGV[4*i+1] == 'c' then
    redis.call('ZADD', state, now + lease, holder)
    redis.call('PEXPIRE', state, lease * 2)
    redis.call('ZADD', KEYS[3*i-1], now + lease, ARGV[4*i+4] .. '|' .. holder)
    redis.call('PEXPIRE', KEYS[3*i-1], lease * 2)
  else
    redis.call('SET', state, tats[i], 'PX', math.max(1, tats[i] - now))
  end
  redis.call('ZREM', KEYS[3*i], holder)
end
return {0, 0}
"""

# KEYS per concurrency bucket: its holders and the limit's in-use zset; ARGV: now_ms, holder,
# lease_ms, then each bucket key. Only a permit still held is extended (ZADD XX).
_RENEW = """
local expiry = tonumber(ARGV[1]) + tonumber(ARGV[3])
for i = 1, #KEYS / 2 do
  if redis.call('ZADD', KEYS[2*i-1], 'XX', 'CH', expiry, ARGV[2]) == 1 then
    redis.call('PEXPIRE', KEYS[2*i-1], tonumber(ARGV[3]) * 2)
    redis.call('ZADD', KEYS[2*i], 'XX', expiry, ARGV[3+i] .. '|' .. ARGV[2])
    redis.call('PEXPIRE', KEYS[2*i], tonumber(ARGV[3]) * 2)
  end
end
return 0
"""

_USAGE = """
local now = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS / 2 do
  out[2*i-1] = redis.call('ZCOUNT', KEYS[2*i-1], now, '+inf')
  out[2*i] = redis.call('ZCOUNT', KEYS[2*i], now, '+inf')
end
return out
"""


def _state_key(bucket: Bucket) -> str:
    kind = "holders" if bucket.limit.concurrency else "tat"
    return f"{PREFIX}{bucket.limit.name}:{kind}:{bucket.key}"


def _name_keys(name: str) -> tuple[str, str]:
    return f"{PREFIX}{name}:in-use", f"{PREFIX}{name}:waiting"


def _parts(buckets: Sequence[Bucket]) -> list[tuple[Bucket, str]]:
    """Each bucket once per kind: a limit with both concurrency and rate is two checks."""
    parts = []
    for bucket in buckets:
        if bucket.limit.concurrency:
            parts.append((bucket, "c"))
        if bucket.limit.rate:
            parts.append((bucket, "r"))
    return parts


class RedisLimiter:
    """Limits on Redis: each step is one atomic script, whatever the broker."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._usage = client.register_script(_USAGE)

    @store_operation
    def acquire(self, buckets: Sequence[Bucket], holder: str, lease: float, wait_ttl: float) -> Admission:
        parts = _parts(buckets)
        if not parts:
            return Admission(True)
        keys: list[str] = []
        args: list[Any] = [int(time.time() * 1000), holder, int(lease * 1000), int(wait_ttl * 1000)]
        for bucket, kind in parts:
            limit = bucket.limit
            state = _state_key(bucket) if kind == "c" else f"{PREFIX}{limit.name}:tat:{bucket.key}"
            keys.extend([state, *_name_keys(limit.name)])
            amount = limit.concurrency if kind == "c" else int((limit.interval or 0) * 1000) or 1
            args.extend([kind, amount, limit.burst, bucket.key])
        blocked, wait = self._acquire(keys=keys, args=args)
        if int(blocked) == 0:
            return Admission(True)
        name = parts[int(blocked) - 1][0].limit.name
        return Admission(False, name, None if int(wait) < 0 else int(wait) / 1000)

    @store_operation
    def renew(self, buckets: Sequence[Bucket], holder: str, lease: float) -> None:
        held = [b for b in buckets if b.limit.concurrency]
        if not held:
            return
        keys = [k for b in held for k in (_state_key(b), _name_keys(b.limit.name)[0])]
        self._renew(keys=keys, args=[int(time.time() * 1000), holder, int(lease * 1000), *(b.key for b in held)])

    @store_operation
    def release(self, buckets: Sequence[Bucket], holder: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for bucket in buckets:
            in_use, waiting = _name_keys(bucket.limit.name)
            if bucket.limit.concurrency:
                pipe.zrem(_state_key(bucket), holder)
                pipe.zrem(in_use, f"{bucket.key}|{holder}")
            pipe.zrem(waiting, holder)
        pipe.execute()

    @store_operation
    def usage(self, names: Sequence[str]) -> list[Usage]:
        if not names:
            return []
        keys = [k for name in names for k in _name_keys(name)]
        counts = self._usage(keys=keys, args=[int(time.time() * 1000)])
        return [Usage(name, int(counts[2 * i]), int(counts[2 * i + 1])) for i, name in enumerate(names)]


class MemoryLimiter:
    """The same limits in process memory (embedded mode: the whole fleet is this process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[str, dict[str, float]] = {}
        self._tats: dict[str, float] = {}
        self._waiting: dict[str, dict[str, float]] = {}

    def acquire(self, buckets: Sequence[Bucket], holder: str, lease: float, wait_ttl: float) -> Admission:
        now = time.time()
        with self._lock:
            tats: dict[str, float] = {}
            for bucket, kind in _parts(buckets):
                limit, state = bucket.limit, _state_key(bucket)
                if kind == "c":
                    held = self._live(self._holders.setdefault(state, {}), now)
                    if holder not in held and len(held) >= (limit.concurrency or 0):
                        return self._blocked(limit.name, holder, now, wait_ttl, None)
                else:
                    interval = limit.interval or 0.0
                    tat = max(self._tats.get(state, now), now)
                    allow_at = tat + interval - limit.burst * interval
                    if now < allow_at:
                        return self._blocked(limit.name, holder, now, wait_ttl, allow_at - now)
                    tats[state] = tat + interval
            for bucket, kind in _parts(buckets):
                if kind == "c":
                    self._holders[_state_key(bucket)][holder] = now + lease
                self._waiting.get(bucket.limit.name, {}).pop(holder, None)
            self._tats.update(tats)
            return Admission(True)

    def _blocked(self, name: str, holder: str, now: float, wait_ttl: float, wait: float | None) -> Admission:
        self._waiting.setdefault(name, {})[holder] = now + wait_ttl
        return Admission(False, name, wait)

    @staticmethod
    def _live(entries: dict[str, float], now: float) -> dict[str, float]:
        for expired in [h for h, until in entries.items() if until <= now]:
            del entries[expired]
        return entries

    def renew(self, buckets: Sequence[Bucket], holder: str, lease: float) -> None:
        with self._lock:
            for bucket in buckets:
                held = self._holders.get(_state_key(bucket), {})
                if holder in held:
                    held[holder] = time.time() + lease

    def release(self, buckets: Sequence[Bucket], holder: str) -> None:
        with self._lock:
            for bucket in buckets:
                self._holders.get(_state_key(bucket), {}).pop(holder, None)
                self._waiting.get(bucket.limit.name, {}).pop(holder, None)

    def usage(self, names: Sequence[str]) -> list[Usage]:
        now = time.time()
        with self._lock:
            found = []
            for name in names:
                in_use = sum(len(self._live(held, now)) for state, held in self._holders.items()
                             if state.startswith(f"{PREFIX}{name}:holders:"))
                found.append(Usage(name, in_use, len(self._live(self._waiting.get(name, {}), now))))
            return found


__all__ = ["Admission", "Bucket", "Limit", "LimitContext", "LimitKey", "LimitedTool", "Limiter", "MemoryLimiter",
           "RedisLimiter", "Usage", "buckets_for", "declared_limits", "parse_rate"]
