"""Stopping an in-process handler at its tool's timeout.

An isolated handler runs in a sandbox child that the sandbox kills at the tool's timeout. An
in-process one (`isolate=False`) runs in the worker's pool process itself: a SIGALRM timer, armed
only around the handler's run, raises `HandlerTimeout` in it at the timeout. Nothing else of the
call task can be interrupted, so it never lands in toolchord's bookkeeping (the claim, the stored
result) nor in Celery's (task entry, `on_chord_part_return`, the chord callback's publish).

Celery's soft time limit did this job before and could not be aimed: the prefork pool raises
`SoftTimeLimitExceeded` wherever the task is when the limit passes, and after a pause, a partition
or high latency to Redis that was inside Celery's chord bookkeeping, losing the turn's callback
(docs/architecture.md, "Celery behaviour"). Call tasks get no soft limit any more.

Only the main thread receives signals, so handlers run by a thread pool (the embedded worker) are
not stopped here, as Celery's limits never stopped them either; the hard time limit
(worker/hard_limit.py) stays the last resort for a handler that ignores `HandlerTimeout`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from toolchord.worker.execution import HandlerOutcome, HandlerTimeout, outcome_from_exception
from toolchord.worker.tools import ToolSpec

_SIGNAL = getattr(signal, "SIGALRM", None)
# setitimer(0) would disarm the timer: a timeout is never shorter than this.
_SHORTEST = 0.001


def _can_arm() -> bool:
    # Only the main thread may set signal handlers, and only it runs them.
    return _SIGNAL is not None and threading.current_thread() is threading.main_thread()


@contextmanager
def handler_deadline(seconds: float) -> Iterator[None]:
    """Within the block, `HandlerTimeout` is raised in this thread once `seconds` have passed
    (once: a handler that catches it is not interrupted again). Off the main thread, nothing."""
    if not _can_arm():
        yield
        return
    assert _SIGNAL is not None

    def expire(signum: int, frame: FrameType | None) -> None:
        raise HandlerTimeout(f"the handler ran past its {seconds:g} s timeout and was stopped")

    previous = signal.signal(_SIGNAL, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, _SHORTEST))
    try:
        yield
    finally:
        try:
            # If the timer goes off right here, HandlerTimeout leaves from this line: the inner
            # finally still puts the previous handler back.
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(_SIGNAL, previous)


def stop_at_timeout(spec: ToolSpec, run: Callable[[], HandlerOutcome]) -> HandlerOutcome:
    """`run()`, the handler's run; an in-process handler is stopped at the tool's timeout (TIMEOUT,
    or OUTCOME_UNKNOWN for an unsafe tool, as a sandboxed call killed at its limit)."""
    if spec.sandbox.isolate:
        return run()
    try:
        with handler_deadline(spec.timeout):
            return run()
    except HandlerTimeout as exc:
        # The timer went off as the handler returned, in toolchord's code just around it: the
        # handler's own HandlerTimeout is already an outcome (call_handler turns it into one).
        return outcome_from_exception(spec, exc)


__all__ = ["handler_deadline", "stop_at_timeout"]
