"""Where full outputs go when `content` is cut, and the built-in `read_output` tool that reads them.

Embedded mode keeps spills in memory, one store per embedded app (the worker runs in the same
process); distributed mode keeps them in Redis with the result TTL so any worker can serve
`read_output`.

A spill belongs to the session whose call produced it: it is stored under that session and
`read_output` reads only the calling session's spills, so a reference seen (or guessed) in
another session reads as unknown.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Annotated, NamedTuple, Protocol

import redis
from pydantic import Field

from toolchord.worker.context import ToolContext
from toolchord.worker.store_errors import store_operation
from toolchord.worker.tools import ToolSpec, tool


class SpillStore(Protocol):
    """Stores full outputs under a session and a reference, and serves slices of them."""

    def put(self, session_id: str, text: str) -> str: ...

    def read(self, session_id: str, ref: str, offset: int, limit: int) -> tuple[str, int] | None:
        """The slice and the full length, or None when the session has no such (unexpired) reference."""
        ...


class SessionSpill(NamedTuple):
    """A spill store as one session's calls write to it."""

    store: SpillStore
    session_id: str

    def put(self, text: str) -> str:
        return self.store.put(self.session_id, text)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _ref(session_id: str, text: str) -> str:
    # Per session: the same output spilled by two sessions gets two references.
    return "out_" + _digest(session_id, text)


class MemorySpillStore:
    """Bounded in-process store (oldest evicted first) for embedded mode and tests."""

    def __init__(self, max_items: int = 256) -> None:
        self._items: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._max = max_items
        self._lock = threading.Lock()

    def put(self, session_id: str, text: str) -> str:
        ref = _ref(session_id, text)
        with self._lock:
            self._items[(session_id, ref)] = text
            self._items.move_to_end((session_id, ref))
            while len(self._items) > self._max:
                self._items.popitem(last=False)
        return ref

    def read(self, session_id: str, ref: str, offset: int, limit: int) -> tuple[str, int] | None:
        with self._lock:
            text = self._items.get((session_id, ref))
        return None if text is None else (text[offset : offset + limit], len(text))


class RedisSpillStore:
    """Spills in Redis under `toolchord:spill:<session digest>:<ref>`, expiring with the result TTL."""

    def __init__(self, client: redis.Redis, ttl: int = 86400) -> None:
        self._redis = client
        self._ttl = ttl

    @staticmethod
    def _key(session_id: str, ref: str) -> str:
        return f"toolchord:spill:{_digest(session_id)}:{ref}"

    @store_operation
    def put(self, session_id: str, text: str) -> str:
        ref = _ref(session_id, text)
        self._redis.set(self._key(session_id, ref), text.encode("utf-8", "replace"), ex=self._ttl)
        return ref

    @store_operation
    def read(self, session_id: str, ref: str, offset: int, limit: int) -> tuple[str, int] | None:
        raw = self._redis.get(self._key(session_id, ref))
        if raw is None:
            return None
        text = raw.decode("utf-8", "replace")
        return text[offset : offset + limit], len(text)


def read_output_tool(store: SpillStore) -> ToolSpec:
    """The built-in `read_output` tool, reading `store`.

    There is no process-wide store: each worker runtime (one per Celery app, so one per embedded
    orchestrator) and each `Pipeline` spills into its own and binds its own `read_output` to it, or
    the refs its notices hand out would resolve in another's store.
    """

    def read_output(
        ref: Annotated[str, Field(description="The reference given in a cut output's notice.")],
        context: ToolContext,
        offset: Annotated[int, Field(ge=0, description="First character to return.")] = 0,
        limit: Annotated[int, Field(ge=1, le=40_000, description="How many characters to return.")] = 20_000,
    ) -> str:
        """Read part of a tool output that was too long to show in full."""
        # Only this session's spills: another session's reference reads as unknown.
        found = store.read(context.session_id, ref, offset, limit)
        if found is None:
            raise LookupError(f"no stored output {ref!r} in this conversation: the reference is wrong or has expired")
        text, total = found
        end = offset + len(text)
        more = f" Next: read_output(ref={ref!r}, offset={end})." if end < total else " This is the end."
        return f"[characters {offset}-{end} of {total}.{more}]\n{text}"

    return tool(read_output, side_effect="read", timeout=10, sandbox={"isolate": False}, max_output_chars=50_000)

