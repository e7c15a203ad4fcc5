"""What travels in a Celery message for one call (JSON, small; DESIGN.md section 2)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from worker.models import ToolCall


def cancel_scope(turn_id: str, key: str) -> str:
    """Cancel flags are per turn, so cancelling one turn never blocks a business key in later turns."""
    return f"{turn_id}:{key}"


class CallPayload(BaseModel):
    """Everything a worker needs to run one validated call, and nothing it must not see twice."""

    call: ToolCall
    arguments: dict[str, Any]
    key: str
    session_id: str
    turn_id: str
    deadline: float

    @property
    def cancel_scope(self) -> str:
        return cancel_scope(self.turn_id, self.key)


class CallRef(BaseModel):
    """A call as the chord callback sees it: enough to order and synthesize, no arguments.

    Every header message carries a copy of the callback (celery-findings pitfall 8), so this
    stays small: no arguments, which would make a turn's messages grow with the square of its calls.
    """

    id: str
    name: str
    side_effect: str = "unsafe"
