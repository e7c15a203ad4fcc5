"""Executing one validated call on a worker: sandboxed handler run, then shaping into a ToolResult.

Shared by the Celery task and the in-process pipeline so both behave the same.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

import toolchord.worker.errors as errors
from toolchord.worker.config import DEFAULT_MAX_RESULT_DATA_BYTES
from toolchord.worker.context import ToolContext
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.observability.hooks import observe_sandbox_run
from toolchord.worker.results import result_from_outcome
from toolchord.worker.sandbox import run_isolated
from toolchord.worker.sandbox.profile import DirectFork
from toolchord.worker.spill import SessionSpill, SpillStore
from toolchord.worker.tools import ToolSpec


def run_handler(
    spec: ToolSpec,
    arguments: dict[str, Any],
    context: ToolContext,
    *,
    sandbox_uid: int | None = None,
    direct_fork: DirectFork = "allow",
) -> HandlerOutcome:
    """Re-validate the arguments (they crossed a process boundary as JSON) and run the handler.

    `sandbox_uid` (TOOLCHORD_SANDBOX_UID) applies to tools whose profile names no uid of its own;
    `direct_fork` (TOOLCHORD_SANDBOX_DIRECT_FORK) says whether a tool the sandbox zygote cannot
    run may run in a direct fork of the worker.
    """
    if sandbox_uid is not None and spec.sandbox.uid is None:
        spec = spec.model_copy(update={"sandbox": spec.sandbox.model_copy(update={"uid": sandbox_uid})})
    try:
        args = spec.args_model.model_validate(arguments)
    except ValidationError as exc:
        return HandlerOutcome(status="error", started=False, error_type="ValidationError", error_message=str(exc))
    return observe_sandbox_run(
        spec, lambda: run_isolated(spec, args, context, direct_fork=direct_fork)
    )


def execute_call(
    call: ToolCall,
    spec: ToolSpec,
    arguments: dict[str, Any],
    context: ToolContext,
    *,
    spill: SpillStore | None,
    attempts: int = 1,
    max_data_bytes: int = DEFAULT_MAX_RESULT_DATA_BYTES,
) -> ToolResult:
    """Run one call once and shape its result. Never raises for handler misbehaviour."""
    outcome = run_handler(spec, arguments, context)
    session_spill = SessionSpill(spill, context.session_id) if spill is not None else None
    return result_from_outcome(
        call, spec, outcome, attempts=attempts, spill=session_spill, max_data_bytes=max_data_bytes
    )


def unavailable_tool_result(call: ToolCall, available: list[str]) -> ToolResult:
    """A worker asked to run a tool it does not have (deployment skew between orchestrator and worker)."""
    return errors.error_result(call, errors.unknown_tool(call, available))
