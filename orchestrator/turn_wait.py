"""When a waiting turn ends: one decision, stepped by a blocking driver and an asyncio driver.

`TurnWait` is the single source of truth: before each wait slice it says what to wait for (the
chord's callback, or only time while the idempotency store is watched), and after each slice it
decides whether the turn ends and how: the callback's results arrived, every call's result is
stored, the turn was cancelled, or its deadline passed. `wait_blocking` (threads, Celery's
`AsyncResult.get`) and `wait_async` (a `ResultWaiter` on the event loop) only carry out the waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult

from toolchord.orchestrator.turn import TurnRecord
from toolchord.orchestrator.waiting import ResultWaiter
from toolchord.worker.tasks import with_lost_results

log = logging.getLogger("toolchord.orchestrator")

# How long one wait for a turn's result lasts before the turn looks at its cancel state again.
_CANCEL_POLL = 0.25
# How often a waiting turn reads its cancel flag in Redis and looks for its calls' stored results.
# Cancels made here, and cancels that other processes announce on the cancel channel, are seen at
# the next wait slice without it; the read covers an announcement lost to a reconnect. The stored
# results, read in the same round trip, cover a chord callback that is never sent: a worker killed
# after taking Celery's callback-dispatch claim (a Redis key that outlives the broker's redelivery
# of its task) leaves the chord complete with nobody to send the callback. One round trip per
# waiting turn per second adds up at a thousand waiting turns.
_REMOTE_CANCEL_POLL = 5.0
# A blocking wait is one slice (it holds a thread); an asyncio wait costs nothing while it lasts.
BLOCKING_SLICE = _CANCEL_POLL
ASYNC_SLICE = _CANCEL_POLL * 4
# A turn without a callback (its calls started one by one while the model's message streamed) ends
# when the idempotency store holds every result: it looks that often, so the turn ends at most this
# much after its slowest call (one MGET of the turn's keys per look).
STORE_POLL = 0.02


@dataclass(frozen=True)
class WaitSlice:
    """Wait up to `seconds`: for the chord's callback, or (once it failed) only for time to pass."""

    seconds: float
    for_callback: bool


@dataclass(frozen=True)
class TurnEnds:
    """The turn ends now: the callback's results (None: read the idempotency store), and why."""

    collected: list[dict[str, Any]] | None
    reason: str = ""


class _RemoteCancelClock:
    """Says when a waiting turn should next ask Redis for its cancel flag."""

    def __init__(self) -> None:
        self._next = time.monotonic() + _REMOTE_CANCEL_POLL

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + _REMOTE_CANCEL_POLL
        return True


class TurnWait:
    """The decisions of one waiting turn. Call `next()` before each wait slice, `after(meta)` after it."""

    def __init__(
        self,
        record: TurnRecord,
        *,
        callback_slice: float,
        cancelled: Callable[[], bool],
        all_stored: Callable[[], bool],
        look: Callable[[], tuple[bool, bool]],
        has_callback: bool = True,
    ) -> None:
        """`cancelled()`: whether this process knows the turn cancelled (no Redis);
        `all_stored()`: whether every dispatched call has a stored result (False if unreachable);
        `look()`: the turn's cancel flag in Redis and `all_stored()`, in one round trip (both False
        if unreachable); `has_callback=False`: no chord callback exists (calls sent one by one), the
        turn waits on the idempotency store alone, looking every `STORE_POLL` seconds."""
        self.record = record
        self._callback_slice = callback_slice
        self._cancelled = cancelled
        self._all_stored = all_stored
        self._look = look
        self._remote_check = _RemoteCancelClock()
        self._callback_failed = False
        self._store_poll = _CANCEL_POLL if has_callback else STORE_POLL
        self._has_callback = has_callback

    def _slice(self, most: float) -> float:
        # Up to `most`, never past the deadline; never zero: Celery reads a zero timeout as "forever".
        return min(max(self.record.deadline - time.time(), 0.001), most)

    def next(self) -> WaitSlice | TurnEnds:
        """What to wait for next, or the end when the callback failed and every result is stored."""
        if self._callback_failed or not self._has_callback:
            if self._all_stored():
                return TurnEnds(None)
            return WaitSlice(self._slice(self._store_poll), for_callback=False)
        return WaitSlice(self._slice(self._callback_slice), for_callback=True)

    def after(self, meta: dict[str, Any] | None) -> TurnEnds | None:
        """After a slice: `meta` is the callback's ready meta (`status`, `result`) or None; the end or None."""
        if meta is not None:
            if meta.get("status") == states.SUCCESS:
                return TurnEnds(with_lost_results(meta.get("result"), self.record.dispatched))
            # A failed callback (a chord part lost to a Redis outage) is no news about the calls: they
            # may have finished and stored their results, or be about to. The turn keeps to its
            # deadline, now waiting on the idempotency store, instead of synthesizing early.
            log.warning("the callback of turn %s ended %s; waiting for its calls' stored results",
                        self.record.turn_id, meta.get("status"))
            self._callback_failed = True
        flagged = False
        if self._remote_check.due():
            flagged, all_stored = self._look()
            if all_stored and not self._callback_failed:
                return TurnEnds(None)
        if flagged or self._cancelled():
            return TurnEnds(None, "the turn was cancelled")
        record = self.record
        if record.deadline <= time.time():
            return TurnEnds(None, f"the turn's {round(record.deadline - record.started_at, 1):g} s deadline passed")
        return None


def wait_blocking(wait: TurnWait, callback: AsyncResult | None) -> TurnEnds:
    """Step `wait` on this thread, waiting for the chord's callback with Celery's `get` (None: a
    turn without a callback, `TurnWait(has_callback=False)`)."""
    while True:
        step = wait.next()
        if isinstance(step, TurnEnds):
            return step
        meta: dict[str, Any] | None = None
        if not step.for_callback or callback is None:
            time.sleep(step.seconds)
        else:
            try:
                value = callback.get(timeout=step.seconds, interval=0.002, propagate=False, disable_sync_subtasks=False)
            except CeleryTimeoutError:
                pass
            except (redis.RedisError, OSError, RuntimeError) as exc:
                # The result backend is unreachable (or Celery's consumer gave up): keep to the
                # deadline, then the idempotency store supplies what finished.
                log.warning("waiting for turn %s: %s", wait.record.turn_id, exc)
                time.sleep(_CANCEL_POLL)
            else:
                meta = {"status": callback.status, "result": value}
        end = wait.after(meta)
        if end is not None:
            return end


async def wait_async(wait: TurnWait, waiter: ResultWaiter | None, callback_id: str | None) -> TurnEnds:
    """Step `wait` on the event loop, waiting for the chord's callback with `waiter` (None: a turn
    without a callback, `TurnWait(has_callback=False)`)."""
    while True:
        step = wait.next()
        if isinstance(step, TurnEnds):
            return step
        meta: dict[str, Any] | None = None
        if step.for_callback and waiter is not None and callback_id is not None:
            meta = await waiter.wait(callback_id, step.seconds)
        else:
            await asyncio.sleep(step.seconds)
        end = wait.after(meta)
        if end is not None:
            return end
