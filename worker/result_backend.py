"""Celery's Redis result backends, without a result subscription per tool call.

Call tasks store no result of their own on a Redis backend (`ignore_result`: the chord joins from
its own list and the idempotency store keeps each result by key), but Celery's chord machinery
still builds result objects for the header, and each registers with the backend, which
SUBSCRIBEs to the task's result channel and UNSUBSCRIBEs when toolchord lets it go: two commands
per call that can never deliver anything. These backends leave call tasks out of the
subscriptions; the turn's callback, and every other task, is listened for as before.
"""

from __future__ import annotations

import re
from typing import Any

from celery.backends.redis import RedisBackend, ResultConsumer, SentinelBackend

# A call task's id: "tc-" and a 32-digit hex digest (`call_task_id`). The turn's callback
# ("tc-collect-...") and other tasks do not match.
_CALL_TASK_ID = re.compile(r"tc-[0-9a-f]{32}")


def call_task_id(digest: str) -> str:
    """The task id of a call whose (key, call id) digest is `digest` (32 hex digits)."""
    task_id = "tc-" + digest
    if not is_call_task_id(task_id):
        raise ValueError(f"not a 32-digit hex digest: {digest!r}")
    return task_id


def is_call_task_id(task_id: str) -> bool:
    """Whether `task_id` names a tool call's task (whose result lives in the idempotency store)."""
    return _CALL_TASK_ID.fullmatch(task_id) is not None


class _CallsUnheard(ResultConsumer):
    """Celery's Redis result consumer, which never subscribes to a call task's channel."""

    def consume_from(self, task_id: str) -> Any:
        if not is_call_task_id(task_id):
            return super().consume_from(task_id)
        return None

    def cancel_for(self, task_id: str) -> Any:
        if not is_call_task_id(task_id):
            return super().cancel_for(task_id)
        return None


class CallAwareRedisBackend(RedisBackend):
    """`RedisBackend` without a result subscription per call task."""

    ResultConsumer = _CallsUnheard


class CallAwareSentinelBackend(SentinelBackend):
    """`SentinelBackend` without a result subscription per call task."""

    ResultConsumer = _CallsUnheard


__all__ = ["CallAwareRedisBackend", "CallAwareSentinelBackend", "call_task_id", "is_call_task_id"]
