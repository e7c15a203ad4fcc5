"""Writes that can wait for the calling thread's next round trip to Redis.

A worker far from Redis pays each round trip of a call's path in latency (docs/deployment.md, "How
far workers may be from Redis"). Bookkeeping that needs no answer, such as the call timeline's
"running" record, is queued here and sent in the same pipeline as the call's claim.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Write = Callable[[Any], object]  # adds its commands to a redis-py pipeline


class PendingWrites:
    """Per-thread queue of writes; the thread's next pipeline takes them."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _queue(self) -> list[Write]:
        queue: list[Write] | None = getattr(self._local, "queue", None)
        if queue is None:
            queue = self._local.queue = []
        return queue

    def add(self, write: Write) -> None:
        """Send `write` with this thread's next pipeline."""
        self._queue().append(write)

    def take(self) -> list[Write]:
        """This thread's queued writes, removed from the queue."""
        queue = self._queue()
        taken, queue[:] = list(queue), []
        return taken


__all__ = ["PendingWrites", "Write"]
