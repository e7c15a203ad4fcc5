"""Writes that can wait for the calling thread's next round trip to Redis.

A worker far from Redis pays each round trip of a call's path in latency (docs/deployment.md, "How
far workers may be from Redis"). Bookkeeping that needs no answer is queued here and sent in the
same pipeline as the call's next step: the call timeline's "running" record with the claim, its
"done" record with the stored result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from toolchord.worker.models import ToolResult

Write = Callable[[Any], object]  # adds its commands to a redis-py pipeline
ResultWrite = Callable[[ToolResult], Write]  # the write that records a call's result


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

    def give_back(self, writes: list[Write]) -> None:
        """Writes a pipeline took and could not send (Redis unreachable): the next one sends them."""
        self._queue()[:0] = writes

    def on_result(self, make: ResultWrite | None) -> None:
        """When this thread's call has its result, queue `make(result)` (None: nothing)."""
        self._local.on_result = make

    def result_ready(self, result: ToolResult) -> None:
        """This thread's call has its result, about to be stored: queue its write, once."""
        make: ResultWrite | None = getattr(self._local, "on_result", None)
        self._local.on_result = None
        if make is not None:
            self.add(make(result))


__all__ = ["PendingWrites", "ResultWrite", "Write"]
