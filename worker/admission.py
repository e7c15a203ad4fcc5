"""Admission of one delivery of a call against its tool's limits (docs/flow-control.md).

Runs before the idempotency claim: a call refused admission has claimed nothing and started
nothing. A call over a limit does not wait here: `WaitForLimit` sends it back to the broker with a
countdown (Celery's retry: same task id, same chord), so it holds no pool process, slot or thread,
and the wait is never an attempt. A call that could not start before its turn's deadline is
refused (`Refusal`, reported NOT_EXECUTED naming the limit and the time waited).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from toolchord.worker.limits import Bucket, LimitContext, Limiter, buckets_for
from toolchord.worker.observability.metrics import metrics
from toolchord.worker.payloads import CallPayload
from toolchord.worker.tools import ToolSpec

# Longest pause between two looks at a concurrency limit: permits free up without notice, and a
# countdown must stay far below the Redis broker's visibility timeout (docs/architecture.md).
_MAX_WAIT = 5.0
_FIRST_WAIT = 0.1
# How long a waiting call is counted as waiting after its last look, beyond its countdown.
_WAITING_GRACE = 10.0


class WaitForLimit(Exception):
    """Send the call back to the broker for `countdown` seconds; `payload` records the wait."""

    def __init__(self, countdown: float, limit: str, payload: dict[str, Any]) -> None:
        super().__init__(f"waiting {countdown:.2f} s for limit {limit!r}")
        self.countdown = countdown
        self.limit = limit
        self.payload = payload


class Refusal(NamedTuple):
    """The call cannot start before its turn's deadline: why, for its NOT_EXECUTED result."""

    reason: str


def wait_countdown(waits: int, retry_after: float | None, visibility_timeout: int) -> float:
    """Seconds until the next look: a rate limit says when; a concurrency limit backs off with jitter."""
    cap = min(_MAX_WAIT, visibility_timeout / 4)
    if retry_after is not None:
        return min(cap, retry_after * random.uniform(1.0, 1.1) + 0.001)
    return min(cap, _FIRST_WAIT * 2**min(waits, 8)) * random.uniform(0.5, 1.0)


@contextmanager
def admitted(limiter: Limiter, renewer: Any, spec: ToolSpec, payload: CallPayload,
             visibility_timeout: int) -> Iterator[Refusal | None]:
    """Hold the call's permits while the block runs (renewed with the claim's lease, given back at the
    end). Yields None when admitted, a Refusal when the call cannot start in time; raises
    WaitForLimit when it should wait in the broker. A tool without limits costs nothing."""
    if not spec.limits:
        yield None
        return
    context = LimitContext(tool=spec.name, session_id=payload.session_id, tenant=payload.tenant)
    buckets: list[Bucket] = buckets_for(spec.limits, payload.arguments, context)
    holder = payload.key
    now = time.time()
    admission = limiter.acquire(buckets, holder, renewer.lease, _MAX_WAIT + _WAITING_GRACE)
    if not admission.admitted:
        since = payload.waiting_since or now
        countdown = wait_countdown(payload.waits, admission.retry_after, visibility_timeout)
        limit = next(b.limit for b in buckets if b.limit.name == admission.limit)
        if (m := metrics()) is not None:
            m.limit_refusals.labels(limit.name).inc()
        if now + countdown >= payload.deadline:
            limiter.release(buckets, holder)
            yield Refusal(
                f"it waited {now - since:.1f} s for the limit {limit.name!r} ({limit.describe()}) "
                "and could not start before the turn's deadline"
            )
            return
        update = {"waits": payload.waits + 1, "waiting_since": since, "waiting_for": limit.name}
        raise WaitForLimit(countdown, limit.name, payload.model_copy(update=update).model_dump(mode="json"))
    try:
        with renewer.keep(f"limits:{holder}", lambda: limiter.renew(buckets, holder, renewer.lease)):
            yield None
    finally:
        limiter.release(buckets, holder)


__all__ = ["Refusal", "WaitForLimit", "admitted", "wait_countdown"]
