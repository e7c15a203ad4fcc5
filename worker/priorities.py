"""Broker priorities from toolchord's priority steps (docs/flow-control.md, "Fair share and priorities").

toolchord ranks every message it sends by a step, 0 (taken first) to 9 (taken last): the numbering
of kombu's Redis transport, whose `priority_steps` 0..9 are one list each, 0 read first. RabbitMQ
numbers the other way round: a priority queue delivers its highest `priority` first. So the step
becomes `9 - step` on an AMQP broker, and RabbitMQ queues that keep priorities are declared with
`x-max-priority` 9 (worker/rabbit_queues.py). The in-memory transport of the embedded mode keeps
no priorities; it gets the step as it is.
"""

from __future__ import annotations

FIRST_STEP = 0
LAST_STEP = 9
# The highest AMQP priority toolchord sends, and the x-max-priority of its classic queues: one
# level per step, no more (each level costs RabbitMQ memory and CPU per queue).
AMQP_MAX_PRIORITY = LAST_STEP - FIRST_STEP


def broker_priority(step: int, broker_kind: str) -> int:
    """The message `priority` for a step (0 first .. 9 last) on a broker of `broker_kind`
    ("amqp", "redis", "memory"; see `Settings.broker_kind`)."""
    if not FIRST_STEP <= step <= LAST_STEP:
        raise ValueError(f"priority step {step} is outside {FIRST_STEP}..{LAST_STEP}")
    return AMQP_MAX_PRIORITY - step if broker_kind == "amqp" else step


__all__ = ["AMQP_MAX_PRIORITY", "FIRST_STEP", "LAST_STEP", "broker_priority"]
