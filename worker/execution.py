"""Calling a handler with validated arguments, in whatever process runs it.

`call_handler` is what runs inside a sandbox child (or in-process for tools with `isolate=False`);
it never raises: every way a handler can end becomes a `HandlerOutcome`, a JSON-safe value that
crosses the pipe back to the worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Coroutine
from typing import Any, Literal

from pydantic import BaseModel, Field

from toolchord.worker.context import ToolContext
from toolchord.worker.redaction import well_formed
from toolchord.worker.tools import ToolSpec, handler_kwargs

OutcomeStatus = Literal["ok", "error", "timeout", "crashed", "cancelled"]


class ToolOutput(BaseModel):
    """What a handler may return to set the model text and the structured data separately."""

    content: str = ""
    data: Any = None


class HandlerTimeout(Exception):
    """Raised by an in-process handler (`isolate=False`) that stopped waiting at its time limit.

    In-process handlers cannot be killed by the sandbox, so one that drives a remote call (an
    MCP server, say) enforces its limit itself; raising this reports `TIMEOUT` (`OUTCOME_UNKNOWN`
    for an unsafe tool), exactly as a sandboxed call killed at its limit.
    """


class HandlerLost(Exception):
    """Raised by an in-process handler whose remote executor died mid-call: reported like a crashed
    sandbox child (`OUTCOME_UNKNOWN` for an unsafe tool, an execution error otherwise)."""


class HandlerOutcome(BaseModel):
    """How one handler run ended. `started` tells whether the handler body was entered."""

    status: OutcomeStatus
    started: bool = True
    content: str | None = Field(default=None, description="Text for the model, when the handler gave one.")
    data: Any = None
    output: str = Field(default="", description="Captured stdout/stderr (partial on timeout).")
    error_type: str | None = None
    error_message: str | None = None
    transient: bool = Field(default=False, description="The error is of a type the tool declared transient.")
    duration_ms: float = 0.0
    sandbox_layers: list[str] = Field(default_factory=list)


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    json.dumps(value)
    return value


def outcome_from_value(value: Any) -> HandlerOutcome:
    """Split a handler's return value into model text and structured data."""
    if isinstance(value, ToolOutput):
        return HandlerOutcome(status="ok", content=well_formed(value.content), data=_jsonable(value.data))
    if value is None:
        return HandlerOutcome(status="ok", content="")
    if isinstance(value, str):
        return HandlerOutcome(status="ok", content=well_formed(value))
    try:
        data = _jsonable(value)
    except (TypeError, ValueError):
        return HandlerOutcome(status="ok", content=repr(value))
    return HandlerOutcome(status="ok", content=well_formed(json.dumps(data, ensure_ascii=False, default=str)), data=data)


def outcome_from_exception(spec: ToolSpec, exc: BaseException) -> HandlerOutcome:
    """An outcome for a handler that raised, flagged transient by the tool's declared types."""
    if isinstance(exc, HandlerTimeout):
        return HandlerOutcome(status="timeout", error_type="Timeout", error_message=str(exc))
    if isinstance(exc, HandlerLost):
        return HandlerOutcome(status="crashed", error_type=type(exc).__name__, error_message=str(exc))
    return HandlerOutcome(
        status="error",
        error_type=type(exc).__name__,
        error_message=str(exc),
        transient=isinstance(exc, spec.transient),
    )


def _run_coroutine(coroutine: Coroutine[Any, Any, Any]) -> Any:
    # Imported on first use: asyncio (with ssl) is 4 MB of heap that the sandbox zygote would
    # otherwise hold, and every spare it forks would copy the page tables of.
    import asyncio

    return asyncio.run(coroutine)


def call_handler(spec: ToolSpec, args: BaseModel, context: ToolContext) -> HandlerOutcome:
    """Run the handler (sync or async) to completion and describe how it ended. Never raises."""
    start = time.perf_counter()
    try:
        kwargs = handler_kwargs(spec, args, context)
        if spec.is_async:
            value = _run_coroutine(spec.handler(**kwargs))
        else:
            value = spec.handler(**kwargs)
            if isinstance(value, Coroutine):
                value = _run_coroutine(value)
        outcome = outcome_from_value(value)
    except Exception as exc:  # noqa: BLE001 - the tool boundary turns every failure into a value
        outcome = outcome_from_exception(spec, exc)
    outcome.duration_ms = (time.perf_counter() - start) * 1000
    return outcome

