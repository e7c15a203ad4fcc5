"""Sending a call task's retry through a broker outage.

Celery's `Task.retry` publishes the next attempt before the current delivery is acknowledged, and
when that publish fails it raises `Reject(requeue=False)`: the message is dropped, and with it the
call and the rest of its resource chain (NOT_EXECUTED at the turn's deadline), although toolchord
retries only when the retry is safe. The usual cause is a claim that found Redis unreachable for
longer than its patience, and with a Redis broker the broker is that same Redis. So a call task's
retry waits here for the broker, reconnecting with backoff, and is published once the broker is
back: until the call's deadline, or `_HARD_LIMIT_MARGIN` before the task's hard time limit,
whichever comes first. Past that nothing was published, and the task answers the call itself.

The wait holds the pool process, which could not take another call from an unreachable broker
anyway. Flow-control waits (worker/admission.py) keep Celery's plain retry: a wait comes before
the claim, so a dropped wait is a call that never started, reported NOT_EXECUTED at the deadline.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, Task
from celery.exceptions import Reject, Retry
from kombu.exceptions import OperationalError

from toolchord.worker.hard_limit import hard_limit_of

log = logging.getLogger("toolchord.worker")

# Left of the hard time limit when the wait ends: the task still answers the call (and may store
# its result) before the pool kills it, and a connection attempt can overrun its wait by about a second.
_HARD_LIMIT_MARGIN = 2.0
# Pauses between connection attempts while the broker is away (kombu's ensure_connection backoff).
_FIRST_INTERVAL = 0.1
_INTERVAL_STEP = 0.2
_MAX_INTERVAL = 1.0


def give_up_at(task: Task, began: float, deadline: float) -> float:
    """The `time.monotonic()` instant a retry stops waiting for the broker: the call's `deadline`
    (epoch seconds), or shortly before the hard time limit of the task that began at `began`."""
    give_up = time.monotonic() + (deadline - time.time())
    hard = hard_limit_of(task)
    if hard is not None:
        give_up = min(give_up, began + hard - _HARD_LIMIT_MARGIN)
    return give_up


def _broker_errors(app: Celery) -> tuple[type[BaseException], ...]:
    """What a publish raises when the broker cannot be reached (kombu wraps most as OperationalError)."""
    with app.connection_for_write() as connection:
        return (OperationalError, *connection.connection_errors)


def _wait_for_broker(app: Celery, seconds: float, unreachable: tuple[type[BaseException], ...]) -> bool:
    """Whether a connection to the broker succeeded within about `seconds`."""
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=None, timeout=seconds, interval_start=_FIRST_INTERVAL,
                                         interval_step=_INTERVAL_STEP, interval_max=_MAX_INTERVAL)
    except unreachable:
        return False
    return True


def publish_retry(task: Task, give_up: float, **options: Any) -> Retry | None:
    """Celery's `task.retry(**options)`, waiting for an unreachable broker until `give_up` (a
    `time.monotonic()` instant, see `give_up_at`): the published retry to raise, or None when the
    broker could not be reached by then (nothing was published). A publish that fails for another
    reason raises Celery's `Reject` as `Task.retry` does."""
    unreachable = _broker_errors(task.app)
    while True:
        try:
            sent: Retry = task.retry(throw=False, **options)
            return sent
        except Reject as rejected:
            if not isinstance(rejected.reason, unreachable):
                raise
            reason = rejected.reason
        left = give_up - time.monotonic()
        if left > 0:
            log.warning("could not send the retry of %s[%s] (%s); waiting up to %.1f s for the broker",
                        task.name, task.request.id, reason, left)
        if left <= 0 or not _wait_for_broker(task.app, left, unreachable):
            log.warning("could not send the retry of %s[%s]: the broker stayed unreachable (%s)",
                        task.name, task.request.id, reason)
            return None


__all__ = ["give_up_at", "publish_retry"]
