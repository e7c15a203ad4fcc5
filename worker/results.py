"""Turning how a handler ended (`HandlerOutcome`) into the result the model reads."""

from __future__ import annotations

import json
from typing import Any

import toolchord.worker.errors as errors
from toolchord.worker.config import DEFAULT_MAX_RESULT_DATA_BYTES
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.policy import policy_of
from toolchord.worker.shaping import cap_content
from toolchord.worker.spill import SessionSpill
from toolchord.worker.tools import ToolSpec

# Partial output shown with TIMEOUT/crash errors is kept short: it is a clue, not the answer.
_PARTIAL_OUTPUT_CHARS = 2_000


def _json_bytes(data: Any) -> int:
    return len(json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str).encode("utf-8", "surrogatepass"))


def result_from_outcome(
    call: ToolCall,
    spec: ToolSpec,
    outcome: HandlerOutcome,
    *,
    attempts: int,
    spill: SessionSpill | None,
    max_data_bytes: int = DEFAULT_MAX_RESULT_DATA_BYTES,
) -> ToolResult:
    """One ToolResult for a finished attempt, with the side-effect class deciding unknown outcomes.

    A cut output is spilled into `spill`, the calling session's part of the spill store.
    Structured `data` over `max_data_bytes` of JSON is dropped whole (never cut into invalid JSON)
    and the result is an EXECUTION_ERROR that says so, followed by the handler's capped text.
    """
    if outcome.status == "ok":
        text = outcome.content if outcome.content else outcome.output
        content, truncated = cap_content(text or "", spec.max_output_chars, spill)
        size = _json_bytes(outcome.data) if outcome.data is not None else 0
        if size > max_data_bytes:
            error = errors.result_data_too_large(call, size, max_data_bytes)
            return errors.error_result(
                call, error, attempts=attempts, duration_ms=outcome.duration_ms, output=content, output_label="Text output:"
            ).model_copy(update={"truncated": truncated})
        return ToolResult(
            call_id=call.id,
            name=call.name,
            status="ok",
            content=content,
            data=outcome.data,
            attempts=attempts,
            duration_ms=outcome.duration_ms,
            truncated=truncated,
        )
    partial, _ = cap_content(outcome.output, _PARTIAL_OUTPUT_CHARS, None) if outcome.output.strip() else ("", None)
    unsafe_unobserved = policy_of(spec.side_effect).unobserved_is_unknown and outcome.started
    if outcome.status == "timeout":
        error = (
            errors.outcome_unknown(call, f"it exceeded its {spec.timeout:g} s limit and was killed")
            if unsafe_unobserved
            else errors.timeout(call, spec.timeout)
        )
    elif outcome.status == "crashed" and unsafe_unobserved:
        error = errors.outcome_unknown(call, outcome.error_message or "the handler process died")
    elif outcome.status == "cancelled":
        error = errors.cancelled(call)
    else:
        error = errors.execution_error(call, outcome.error_type or "Error", outcome.error_message or "")
    return errors.error_result(
        call, error, attempts=attempts, duration_ms=outcome.duration_ms, output=partial
    )
