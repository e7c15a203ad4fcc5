"""Fair share of the fleet through broker priorities (docs/flow-control.md, "Fair share").

The k-th call of a turn is sent at a lower priority the larger k is (steps grow with log2 k), so
the single call of a small turn overtakes the tail of a 128-call fan-out instead of queueing behind
it; batch turns and batch tools use the lower half of the range. A step is 0 (taken first) to 9
(taken last); worker/priorities.py turns it into each broker's number: the step itself on Redis
(one list per step, `priority_steps` 0..9), `9 - step` on RabbitMQ, where classic queues declared
with x-max-priority 9 (`TOOLCHORD_RABBITMQ_QUEUE_TYPE=classic`) deliver the highest first. RabbitMQ
3.x quorum queues, the default, have no priorities: there the order is the queue's, and classes are
separated with a queue per class (the tool's `queue`).
"""

from __future__ import annotations

from toolchord.worker.tools import PriorityClass

_BATCH_BASE = 5
_RANK_STEPS = 4


def call_priority(rank: int, turn_class: PriorityClass, tool_class: PriorityClass) -> int:
    """The priority step (0 first .. 9 last) of a turn's call at position `rank` (0-based)."""
    base = _BATCH_BASE if "batch" in (turn_class, tool_class) else 0
    return base + min(_RANK_STEPS, rank.bit_length())


__all__ = ["call_priority"]
