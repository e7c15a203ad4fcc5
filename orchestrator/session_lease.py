"""One driver per session: a lease held while an agent runs or resumes a session.

Two processes that drive one session at once (an approver's web handler and a sweeper, say) would
each ask the model and dispatch what it answers; a real model gives fresh call ids every time, so
an unsafe call it repeats would get a new idempotency key and run twice. The lease serializes them:
the second driver waits until the first is done, then reads the log and finds the session finished
(or waiting, or needing one more step) like any later resume.

The lease lives where the log lives. Redis Streams log: a redis-py `Lock` on the log's own client,
with an expiry renewed by a thread while it is held (a crashed driver frees it after `LEASE_TTL`
seconds). JSONL log: `flock` on `<session>.lock` next to the log file (the kernel frees it when the
process dies). Any other `EventLog`: a lock of this process.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from redis.exceptions import LockError

from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog, RedisEventLog

LEASE_PREFIX = "toolchord:driver:"
# Long enough that a busy process renews it in time, short enough that a crashed driver's session
# is taken over soon.
LEASE_TTL = 30.0

_local_locks: dict[tuple[int, str], threading.Lock] = {}
_local_guard = threading.Lock()


@contextmanager
def _redis_lease(log: RedisEventLog, session_id: str) -> Iterator[None]:
    # thread_local=False: the renewing thread must see the token the acquiring thread got.
    log.key(session_id)  # validates the id
    lock = log.redis.lock(LEASE_PREFIX + session_id, timeout=LEASE_TTL, sleep=0.05, thread_local=False)
    lock.acquire(blocking=True)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_TTL / 3):
            try:
                lock.reacquire()
            except LockError:  # expired while this process stalled: another driver may hold it now
                return

    renewer = threading.Thread(target=renew, name=f"toolchord-lease-{session_id}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        try:
            lock.release()
        except LockError:
            pass  # it expired (see renew): nothing of ours to release


@contextmanager
def _file_lease(log: JsonlEventLog, session_id: str) -> Iterator[None]:
    path = log.path(session_id).with_suffix(".lock")
    # One open file description per lease: flock conflicts between threads of one process too.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


@contextmanager
def _local_lease(log: EventLog, session_id: str) -> Iterator[None]:
    with _local_guard:
        lock = _local_locks.setdefault((id(log), session_id), threading.Lock())
    with lock:
        yield


def session_lease(log: EventLog, session_id: str) -> AbstractContextManager[None]:
    """Hold the session's driver lease for the `with` block, waiting while another driver holds it."""
    if isinstance(log, RedisEventLog):
        return _redis_lease(log, session_id)
    if isinstance(log, JsonlEventLog):
        return _file_lease(log, session_id)
    return _local_lease(log, session_id)


__all__ = ["LEASE_PREFIX", "LEASE_TTL", "session_lease"]
