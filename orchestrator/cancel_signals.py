"""Turn cancels announced over Redis pub/sub, so an orchestrator process hears another's at once.

`Orchestrator.cancel` sets the turn's cancel flag in Redis (the record of truth) and publishes the
turn on one channel. Each process that waits on turns listens on that channel with one connection
and one thread, shared by its orchestrators; each orchestrator marks the turns it waits on as
cancelled, and its waiting loop sees the mark at the next wait slice. Pub/sub may drop a message
(a reconnect in between), so waiting turns still read the flag itself now and then
(`_REMOTE_CANCEL_POLL` in turn_wait.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from typing import Protocol

import redis
from redis.client import PubSub

from toolchord.worker.store_errors import store_operation

log = logging.getLogger("toolchord.orchestrator")

CHANNEL = "toolchord:turn-cancels"
# Pause after a failed read of the channel (Redis restarting, say) before trying again.
_RETRY_PAUSE = 0.5


@store_operation
def announce_cancel(client: redis.Redis, session_id: str, turn_id: str) -> None:
    """Tell every listening process that this turn was cancelled."""
    client.publish(CHANNEL, json.dumps([session_id, turn_id]))


class CancelSubscriber(Protocol):
    """Something that waits on turns: an `Orchestrator`."""

    def heard_cancel(self, session_id: str, turn_id: str) -> None: ...


class CancelListener:
    """One subscriber thread and connection: hands each announcement to every live subscriber.

    Subscribers are held weakly, so an orchestrator that is dropped without `close()` leaves
    nothing behind; the listener itself lives as long as the process.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._subscribers: weakref.WeakSet[CancelSubscriber] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(**{CHANNEL: self._on_message})
        self._thread = self._pubsub.run_in_thread(sleep_time=1.0, daemon=True, exception_handler=self._on_error)
        self._thread.name = "toolchord-cancel-listener"

    def add(self, subscriber: CancelSubscriber) -> None:
        with self._lock:
            self._subscribers.add(subscriber)

    def _on_message(self, message: dict[str, object]) -> None:
        try:
            session_id, turn_id = json.loads(message["data"])  # type: ignore[arg-type]
        except (TypeError, ValueError):
            log.warning("ignoring a malformed message on %s", CHANNEL)
            return
        with self._lock:
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            subscriber.heard_cancel(str(session_id), str(turn_id))

    @staticmethod
    def _on_error(exc: BaseException, pubsub: PubSub, thread: threading.Thread) -> None:
        # The connection dropped: redis-py subscribes again on the next read. Messages sent in
        # between are lost; the waiting loop's occasional read of the flag covers them.
        log.debug("cancel channel read failed (%r); retrying", exc)
        time.sleep(_RETRY_PAUSE)


_listeners: dict[tuple[int, str], CancelListener] = {}
_listeners_lock = threading.Lock()


@store_operation
def listen_for_cancels(client: redis.Redis, subscriber: CancelSubscriber) -> None:
    """Have `subscriber` hear the cancels announced on `client`'s Redis, through this process's
    one listener for that Redis (started on first use; a forked child starts its own).

    Raises StoreUnavailable when the listener cannot subscribe (Redis unreachable).
    """
    kwargs = client.connection_pool.connection_kwargs
    where = f"{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db')}{kwargs.get('path') or ''}"
    key = (os.getpid(), where)
    with _listeners_lock:
        listener = _listeners.get(key)
        if listener is None:
            listener = _listeners[key] = CancelListener(client)
    listener.add(subscriber)


__all__ = ["CHANNEL", "CancelListener", "CancelSubscriber", "announce_cancel", "listen_for_cancels"]
