"""What travels in a Celery message for one call (JSON, small; docs/architecture.md, "What a task message carries")."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from toolchord.worker.models import ToolCall


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
    tenant: str | None = None
    # Flow control (worker/admission.py): deliveries spent waiting for a limit (never attempts),
    # when the first of them began, and the limit the latest one waited for (the timeline shows it).
    waits: int = 0
    waiting_since: float | None = None
    waiting_for: str | None = None

    @property
    def cancel_scope(self) -> str:
        return cancel_scope(self.turn_id, self.key)
