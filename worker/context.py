"""What a handler knows about the call it serves, passed explicitly instead of globals."""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class ToolContext(BaseModel):
    """Per-call context handed to a handler that declares a `ToolContext` parameter.

    `idempotency_key` is the key toolchord claims before running the handler; pass it to downstream
    APIs that accept one (payments, ticketing) so a re-run on their side is a no-op too.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    call_id: str
    session_id: str
    tool_name: str
    idempotency_key: str
    deadline: float = Field(description="Wall-clock epoch seconds by which the handler must finish.")
    attempt: int = 1
    workdir: str | None = None

    _cancel_check: Callable[[], bool] | None = PrivateAttr(default=None)

    def bind_cancel_check(self, check: Callable[[], bool]) -> ToolContext:
        """Attach the function that tells whether this call was cancelled; returns self."""
        self._cancel_check = check
        return self

    @property
    def cancelled(self) -> bool:
        """True once the turn or this call was cancelled; long handlers should poll it."""
        return bool(self._cancel_check and self._cancel_check())

    @property
    def remaining(self) -> float:
        """Seconds left before the deadline (may be negative)."""
        return self.deadline - time.time()
