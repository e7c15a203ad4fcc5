"""The pairing rules every provider shares: each call answered exactly once, never before it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from toolchord.orchestrator.providers.protocol import PairingError

PairingEntry = tuple[Literal["call", "result"], str, int]
"""(kind, call id, position of the message/item) for a call or a result in a rendered request."""

Placement = Callable[[str, int, int], str | None]
"""(call id, call position, result position) -> why the result is misplaced, or None."""


def check_entries(entries: list[PairingEntry], misplaced: Placement) -> None:
    """Raise PairingError for a duplicate call id, a result for an unknown or answered call, a
    misplaced result (per `misplaced`, the provider's rule) or a call without a result."""
    calls: dict[str, int] = {}
    answered: set[str] = set()
    for kind, call_id, position in entries:
        if kind == "call":
            if call_id in calls:
                raise PairingError(f"duplicate call id {call_id!r}")
            calls[call_id] = position
            continue
        if call_id not in calls:
            raise PairingError(f"result for unknown call {call_id!r}")
        if call_id in answered:
            raise PairingError(f"second result for call {call_id!r}")
        answered.add(call_id)
        problem = misplaced(call_id, calls[call_id], position)
        if problem is not None:
            raise PairingError(problem)
    unanswered = [c for c in calls if c not in answered]
    if unanswered:
        raise PairingError(f"call(s) without result: {unanswered}")
