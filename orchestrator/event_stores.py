"""Where a session's events are kept: the `EventLog` protocol and its two stores.

Redis Streams (XADD / XRANGE) when distributed, a local JSONL file per session when embedded;
`toolchord.orchestrator.stores` picks one for a configuration. Both are append-only: history changes are new
events (`events.Transformation`), never rewrites.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel

from toolchord.orchestrator.events import Event, decode_event, encode_event
from toolchord.worker.store_errors import store_operation

LOG_DIR_ENV = "TOOLCHORD_LOG_DIR"
DEFAULT_LOG_DIR = ".toolchord/logs"
STREAM_PREFIX = "toolchord:log:"


@runtime_checkable
class EventLog(Protocol):
    """An append-only log of events per session."""

    def append(self, session_id: str, event: BaseModel) -> int:
        """Append one event; returns its position (seq, from 0) in the session's log."""
        ...

    def read(self, session_id: str) -> list[Event]:
        """All events of the session, in order (empty for an unknown session)."""
        ...

    def sessions(self) -> list[str]:
        """Known session ids."""
        ...


_SAFE_SESSION = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def check_session_id(session_id: str) -> str:
    """The session id, if it is safe as a file name and a key part; ValueError otherwise."""
    # Session ids become file names and Redis keys: refuse anything that could escape the directory.
    if not _SAFE_SESSION.match(session_id) or session_id in (".", ".."):
        raise ValueError(f"invalid session id {session_id!r}: use letters, digits, '.', '_' or '-'")
    return session_id


class JsonlEventLog:
    """One `<session>.jsonl` file per session under `directory` (embedded mode).

    Each event is written with a single O_APPEND write and fsync, so a crash leaves at most one
    partial last line, which `read` ignores (it was never acknowledged to the caller) and the next
    `append` cuts off before writing. Appends know each file's size and event count from the last
    append, so they read the file only when it changed behind their back.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory or os.environ.get(LOG_DIR_ENV) or DEFAULT_LOG_DIR)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._known: dict[Path, tuple[int, int]] = {}  # path -> (size, events) after our last append

    def path(self, session_id: str) -> Path:
        return self.directory / f"{check_session_id(session_id)}.jsonl"

    def append(self, session_id: str, event: BaseModel) -> int:
        path = self.path(session_id)
        line = (encode_event(event) + "\n").encode()
        with self._lock:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                known = self._known.get(path)
                if known is not None and known[0] == size:
                    seq = known[1]
                else:
                    data = os.pread(fd, size, 0)
                    complete = data[: data.rfind(b"\n") + 1]
                    if len(complete) != size:
                        # A torn last line from a crash: appending after it would glue the two.
                        os.ftruncate(fd, len(complete))
                        size = len(complete)
                    seq = sum(1 for part in complete.split(b"\n") if part)
                os.write(fd, line)
                os.fsync(fd)
                self._known[path] = (size + len(line), seq + 1)
            finally:
                os.close(fd)
        return seq

    def read(self, session_id: str) -> list[Event]:
        return [decode_event(line) for line in self._lines(self.path(session_id))]

    def sessions(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.jsonl"))

    @staticmethod
    def _lines(path: Path) -> list[bytes]:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        # The last element is b"" after a complete write, or a torn partial line after a crash.
        return [line for line in lines[:-1] if line]


class RedisEventLog:
    """One Redis Stream per session (`toolchord:log:<session>`), one JSON field per entry."""

    def __init__(self, url: str | None = None, *, client: Any = None, prefix: str = STREAM_PREFIX,
                 master_name: str | None = None) -> None:
        from toolchord.worker.redis_clients import redis_client

        self.redis = (
            client if client is not None
            else redis_client(url or "redis://127.0.0.1:6379/0", master_name=master_name)
        )
        self.prefix = prefix

    def key(self, session_id: str) -> str:
        return self.prefix + check_session_id(session_id)

    @store_operation
    def append(self, session_id: str, event: BaseModel) -> int:
        key = self.key(session_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(key, {"e": encode_event(event)})
        pipe.xlen(key)
        _, length = pipe.execute()
        return int(length) - 1

    @store_operation
    def read(self, session_id: str) -> list[Event]:
        key = self.key(session_id)
        events: list[Event] = []
        start = "-"
        while True:
            batch = self.redis.xrange(key, min=start, max="+", count=1000)
            if not batch:
                return events
            for _entry_id, fields in batch:
                events.append(decode_event(fields.get(b"e") or fields.get("e")))
            last = batch[-1][0]
            last = last.decode() if isinstance(last, bytes) else last
            start = "(" + last  # exclusive range start: continue after the last entry read

    @store_operation
    def sessions(self) -> list[str]:
        names = (k.decode() if isinstance(k, bytes) else k for k in self.redis.scan_iter(match=self.prefix + "*"))
        return sorted(name.removeprefix(self.prefix) for name in names)


__all__ = ["EventLog", "JsonlEventLog", "RedisEventLog", "check_session_id"]
