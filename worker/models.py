"""The internal form of a tool call and its result (docs/errors.md, docs/api.md).

These models cross every process boundary as JSON: orchestrator -> broker -> worker -> sandbox
child -> result backend -> event log. Nothing here is ever pickled.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SideEffect = Literal["read", "idempotent", "unsafe"]
Risk = Literal["low", "high"]


class ErrorCode(str, Enum):
    """Why a call has no normal result. The value is what the model and logs see."""

    UNKNOWN_TOOL = "UNKNOWN_TOOL"
    INVALID_JSON = "INVALID_JSON"
    INVALID_ARGUMENTS = "INVALID_ARGUMENTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    TIMEOUT = "TIMEOUT"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    NOT_EXECUTED = "NOT_EXECUTED"
    ABORTED = "ABORTED"
    CANCELLED = "CANCELLED"


class ToolCall(BaseModel):
    """One call as the model asked for it, whatever the provider."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    arguments_raw: str = Field(description="Arguments exactly as received (JSON text).")
    arguments: dict[str, Any] | None = Field(
        default=None, description="Arguments after parsing, or None when they are not a JSON object."
    )
    index: int = Field(default=0, description="Position of the call in the model's message.")


class ToolError(BaseModel):
    """A structured error at the tool boundary: what was wrong, the input, how to fix it."""

    code: ErrorCode
    message: str
    hint: str = ""
    input_excerpt: str | None = Field(default=None, description="Redacted, bounded excerpt of the input.")


class Truncation(BaseModel):
    """Set when `content` was cut to the tool's budget."""

    original_chars: int
    kept_chars: int
    spill_ref: str | None = Field(default=None, description="Reference readable with the read_output tool.")


class ToolResult(BaseModel):
    """Exactly one per call id, in the model's order."""

    call_id: str
    name: str
    status: Literal["ok", "error"]
    content: str = Field(min_length=1, description="Text for the model; never empty.")
    data: Any = None
    error: ToolError | None = None
    attempts: int = 0
    duration_ms: float = 0.0
    truncated: Truncation | None = None

    @property
    def is_error(self) -> bool:
        return self.status == "error"
