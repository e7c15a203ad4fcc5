"""Keeping Celery's soft time limit out of toolchord's own bookkeeping.

The prefork pool enforces a task's soft time limit by sending SIGUSR1 to the pool process, whose
handler raises `SoftTimeLimitExceeded` wherever the task thread happens to be. For a call task
that can be inside the idempotency store's `complete` after the handler has finished: the result
would be lost (found with a worker paused past the limit). So a call task holds the signal off for
its whole run, and lets it through only around an in-process handler, the one place it can stop
something. An isolated handler is stopped by its sandbox at the tool's own timeout; the hard time
limit stays the last resort for a worker that hangs.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger("toolchord.worker")

_SIGNAL = getattr(signal, "SIGUSR1", None)
# The handlers `held` replaced, innermost last: `live` puts the outermost one back for a while.
_replaced: list[Any] = []


def _can_switch() -> bool:
    # Only the main thread may set signal handlers; the thread pools have no soft limit anyway.
    return _SIGNAL is not None and threading.current_thread() is threading.main_thread()


def _note(signum: int, frame: FrameType | None) -> None:
    log.warning("Celery's soft time limit passed while toolchord was waiting for or storing a call's result; "
                "it did not interrupt that (the sandbox enforces the tool's own timeout)")


@contextmanager
def _handler(replacement: Callable[[int, FrameType | None], Any] | int) -> Iterator[Any]:
    assert _SIGNAL is not None
    previous = signal.signal(_SIGNAL, replacement)
    try:
        yield previous
    finally:
        signal.signal(_SIGNAL, previous)


@contextmanager
def soft_limit_held() -> Iterator[None]:
    """Within the block, a soft time limit is logged instead of raised."""
    if not _can_switch():
        yield
        return
    with _handler(_note) as previous:
        _replaced.append(previous)
        try:
            yield
        finally:
            _replaced.pop()


@contextmanager
def soft_limit_live() -> Iterator[None]:
    """Within the block (an in-process handler run), the soft limit raises as Celery set it up."""
    if not _can_switch() or not _replaced:
        yield
        return
    with _handler(_replaced[0]):
        yield


__all__ = ["soft_limit_held", "soft_limit_live"]
