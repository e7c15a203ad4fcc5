"""When and where each call ran, kept for the session timeline page (`toolchord ui`).

Workers write one JSON record per call into a hash per session in Redis: when a delivery starts
(the bar turns from queued to running), when it ends (the bar gets its result code), and when it
goes back to the broker to wait for a limit (phase `waiting`, naming the limit and since when). The
embedded worker, without Redis, appends the same records to `<log dir>/timeline/<session>.jsonl`
beside the session's JSONL log (the last record of a call wins). Only names, ids, times and codes:
never arguments or output.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from toolchord.worker.models import SideEffect

PREFIX = "toolchord:calls:"
TIMELINE_DIR = "timeline"
# Session ids become file names: the event log allows these (and refuses others before a turn).
_SAFE_SESSION = re.compile(r"^[A-Za-z0-9._-]{1,200}$")

CallPhase = Literal["waiting", "running", "retrying", "done"]


class CallTiming(BaseModel):
    """One call's run as workers saw it (the latest delivery; `attempts` counts them all)."""

    session_id: str
    turn_id: str
    call_id: str
    tool: str
    side_effect: SideEffect | None = None
    key: str
    queue: str | None = None
    published_at: float | None = None
    started_at: float = Field(description="Start of the latest delivery.")
    first_started_at: float | None = Field(default=None, description="Start of the first attempt.")
    finished_at: float | None = None
    worker: str | None = None
    attempts: int = Field(default=1, description="Attempts so far; deliveries that waited for a limit are none.")
    phase: CallPhase = "running"
    code: str | None = None
    waiting_for: str | None = Field(default=None, description="The limit the call waited (or waits) for.")
    waiting_since: float | None = Field(default=None, description="When its first wait for a limit began.")


def timing_key(session_id: str) -> str:
    return PREFIX + session_id


def add_timing(pipe: Any, timing: CallTiming, ttl: int | None) -> None:
    """Add the record's write to a redis-py pipeline; the hash expires with the session's results.

    `ttl` None: no EXPIRE, for a record that follows one whose TTL already covers it (a delivery's
    "done" record after its "running" one, which is given the time the call may still run on top).
    """
    key = timing_key(timing.session_id)
    # Call ids are unique within a turn only.
    pipe.hset(key, f"{timing.turn_id}:{timing.call_id}", timing.model_dump_json())
    if ttl is not None:
        pipe.expire(key, ttl)


def save_timing(client: Any, timing: CallTiming, ttl: int) -> None:
    """Write the record (one round trip)."""
    pipe = client.pipeline(transaction=False)
    add_timing(pipe, timing, ttl)
    pipe.execute()


def read_timing(client: Any, session_id: str, turn_id: str, call_id: str) -> CallTiming | None:
    """One call's record, if written."""
    raw = client.hget(timing_key(session_id), f"{turn_id}:{call_id}")
    return CallTiming.model_validate_json(raw) if raw else None


def read_timings(client: Any, session_id: str) -> dict[tuple[str, str], CallTiming]:
    """Every call record of a session, by (turn id, call id)."""
    found = (CallTiming.model_validate_json(v) for v in client.hvals(timing_key(session_id)))
    return {(t.turn_id, t.call_id): t for t in found}


def _timing_file(directory: Path, session_id: str) -> Path | None:
    if not _SAFE_SESSION.match(session_id) or session_id in (".", ".."):
        return None
    return directory / f"{session_id}.jsonl"


def append_timing(directory: Path, timing: CallTiming) -> None:
    """Append the record to the session's timeline file (one write of one line)."""
    path = _timing_file(directory, timing.session_id)
    if path is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (timing.model_dump_json() + "\n").encode())
    finally:
        os.close(fd)


def read_timing_file(directory: Path, session_id: str) -> dict[tuple[str, str], CallTiming]:
    """Every call record of a session's timeline file, by (turn id, call id); the last one wins."""
    path = _timing_file(directory, session_id)
    try:
        lines = path.read_bytes().split(b"\n") if path is not None else []
    except FileNotFoundError:
        return {}
    found = (CallTiming.model_validate_json(line) for line in lines[:-1] if line)  # the last may be torn
    return {(t.turn_id, t.call_id): t for t in found}


__all__ = ["PREFIX", "TIMELINE_DIR", "CallPhase", "CallTiming", "add_timing", "append_timing", "read_timing", "read_timing_file",
           "read_timings", "save_timing", "timing_key"]
