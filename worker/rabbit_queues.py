"""toolchord's queues on RabbitMQ: how Celery declares them, and a clear error when one exists otherwise.

`TOOLCHORD_RABBITMQ_QUEUE_TYPE` picks the type of every queue toolchord declares (the default
queue and each tool's, by whichever worker or publisher names it first):

- `quorum` (the default): replicated, durable, with delivery counting; RabbitMQ 3.x quorum queues
  have no priorities, so fair share and batch priorities are not applied.
- `classic`: one node (not replicated), declared with `x-max-priority` 9 so the priorities of
  worker/priorities.py hold.

Both are Celery's own declarations (`task_default_queue_type`, `task_create_missing_queue_type`,
`task_queue_max_priority`): no queue of toolchord's own. A queue's type and arguments are fixed when
it is first declared, so RabbitMQ refuses (PRECONDITION_FAILED) a worker or publisher configured for
another kind; `QueueMismatch` says which queue, what exists, what is configured and how to fix it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from amqp.exceptions import PreconditionFailed

from toolchord.worker.config import ConfigError, RabbitQueueType
from toolchord.worker.priorities import AMQP_MAX_PRIORITY

# RabbitMQ's text for a queue declared again with other arguments, e.g. "PRECONDITION_FAILED -
# inequivalent arg 'x-queue-type' for queue 'toolchord' in vhost 'v': received none but current is
# the value 'quorum' of type 'longstr'" (or "received 'classic' but current is 'quorum'").
_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for queue '(?P<queue>[^']*)' in vhost '(?P<vhost>[^']*)': "
    r"received (?P<received>.+?) but current is (?P<current>.+)$"
)
_QUOTED = re.compile(r"'([^']*)'")


def queue_config(queue_type: RabbitQueueType) -> dict[str, Any]:
    """The Celery settings that declare toolchord's queues as `queue_type` on a RabbitMQ broker."""
    # Topic exchanges with either type: Celery's native delayed delivery (retry countdowns on
    # quorum queues, which cannot hold messages back) routes through topic exchanges only, and one
    # exchange type for both keeps a switch of queue type from failing on the exchanges too.
    config: dict[str, Any] = {
        "task_default_exchange_type": "topic",
        "task_create_missing_queues": True,
        "task_create_missing_queue_exchange_type": "topic",
        "task_default_queue_type": queue_type,
        "task_create_missing_queue_type": queue_type,
    }
    if queue_type == "quorum":
        config.update(
            broker_native_delayed_delivery_queue_type="quorum",
            # Quorum queues refuse global QoS: the worker switches to per-consumer prefetch.
            worker_detect_quorum_queues=True,
        )
    else:
        # Celery adds x-max-priority to every queue it declares, tool queues included. Countdowns
        # are then held by the worker until due (Celery's plain ETA handling): native delayed
        # delivery is only set up for quorum queues.
        config["task_queue_max_priority"] = AMQP_MAX_PRIORITY
    return config


def describe(queue_type: RabbitQueueType) -> str:
    """What a queue declared as `queue_type` is, in the words QueueMismatch uses."""
    if queue_type == "quorum":
        return "a quorum queue"
    return f"a classic queue with priorities (x-max-priority {AMQP_MAX_PRIORITY})"


class QueueMismatch(ConfigError):
    """A RabbitMQ queue exists with another type or arguments than toolchord is configured to declare."""

    def __init__(self, queue: str, vhost: str, existing: str, configured: RabbitQueueType, refusal: str,
                 matching: RabbitQueueType | None) -> None:
        self.queue, self.vhost, self.existing, self.configured = queue, vhost, existing, configured
        fix = f"drain and delete the queue (`rabbitmqctl delete_queue -p {vhost} {queue}`) so it is declared again as configured"
        if matching is not None and matching != configured:
            fix += f", or set TOOLCHORD_RABBITMQ_QUEUE_TYPE={matching} on every worker and orchestrator to use it as it is"
        super().__init__(
            f"RabbitMQ queue {queue!r} (vhost {vhost!r}) exists as {existing}, but toolchord is configured for "
            f"{describe(configured)} (TOOLCHORD_RABBITMQ_QUEUE_TYPE={configured}); a queue's type and arguments "
            f"cannot change once declared: {fix}. RabbitMQ said: {refusal}"
        )


def _value(text: str) -> str | None:
    """A value as RabbitMQ's refusal writes it: `none`, `'quorum'` or `the value '9' of type 'signedint'`."""
    quoted = _QUOTED.search(text)
    return quoted.group(1) if quoted else None


def _existing(arg: str, current: str | None) -> tuple[str, RabbitQueueType | None]:
    """What the refusal says exists, and the setting that would declare it so (None: neither does)."""
    if arg == "x-queue-type":
        if current in (None, "classic"):
            return "a classic queue", None
        return f"a {current} queue", "quorum" if current == "quorum" else None
    if arg == "x-max-priority":
        if current is None:
            return "a queue without priorities (no x-max-priority)", None
        return f"a classic queue with x-max-priority {current}", "classic" if current == str(AMQP_MAX_PRIORITY) else None
    return f"a queue with {arg} {current if current is not None else 'unset'}", None


def mismatch_of(exc: PreconditionFailed, configured: RabbitQueueType) -> QueueMismatch | None:
    """The QueueMismatch a refused queue declaration means; None for any other refusal."""
    refusal = str(getattr(exc, "reply_text", "") or exc)
    found = _INEQUIVALENT.search(refusal)
    if found is None:
        return None
    existing, matching = _existing(found["arg"], _value(found["current"]))
    return QueueMismatch(found["queue"], found["vhost"], existing, configured, refusal, matching)


@contextmanager
def queue_mismatch_named(configured: RabbitQueueType) -> Iterator[None]:
    """Turn RabbitMQ's refusal of a queue declaration inside the block into a QueueMismatch."""
    try:
        yield
    except PreconditionFailed as exc:
        mismatch = mismatch_of(exc, configured)
        if mismatch is None:
            raise
        # The refusal's text is in the message: the amqp traceback would add nothing.
        raise mismatch from None


__all__ = ["QueueMismatch", "describe", "mismatch_of", "queue_config", "queue_mismatch_named"]
