"""Structured tool errors and the model-facing text for each (docs/errors.md).

Every error says what went wrong, shows the offending input (redacted, bounded) and how to fix
it, in one fixed layout the model learns quickly:

    <CODE>: <what went wrong>
    Input: <excerpt>
    Fix: <how to fix it>
"""

from __future__ import annotations

import difflib
import itertools
import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from toolchord.worker.models import ErrorCode, ToolCall, ToolError, ToolResult
from toolchord.worker.redaction import MASK, excerpt, is_secret_key, redact_text, well_formed

# A list of 100,000 wrong items is one line per item to pydantic; the model needs the first few.
_MAX_FIELD_LINES = 20
_VERIFY = "Do not retry blindly: check whether the action took effect (for example by reading its state) before calling again."


def render(error: ToolError) -> str:
    """The text the model reads for an error."""
    lines = [f"{error.code.value}: {error.message}"]
    if error.input_excerpt:
        lines.append(f"Input: {error.input_excerpt}")
    if error.hint:
        lines.append(f"Fix: {error.hint}")
    return "\n".join(lines)


def error_result(
    call: ToolCall,
    error: ToolError,
    *,
    attempts: int = 0,
    duration_ms: float = 0.0,
    output: str = "",
    output_label: str = "Output before the error:",
) -> ToolResult:
    """A ToolResult carrying `error`; `output` (what the handler printed so far) follows the error text."""
    content = render(error)
    if output:
        content = f"{content}\n{output_label}\n{output}"
    return ToolResult(
        call_id=call.id,
        name=call.name,
        status="error",
        content=content,
        error=error,
        attempts=attempts,
        duration_ms=duration_ms,
    )


def unknown_tool(call: ToolCall, available: Sequence[str]) -> ToolError:
    """`available` is ordered closest name first (Registry.closest)."""
    listed = ", ".join(available) if available else "(none)"
    close = difflib.get_close_matches(call.name, available, n=1, cutoff=0.6)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return ToolError(
        code=ErrorCode.UNKNOWN_TOOL,
        message=f"there is no tool named {call.name!r}. Available tools: {listed}.",
        hint=f"Call one of the available tools by its exact name{suggestion}.",
        input_excerpt=excerpt(call.name, 120),
    )


def json_problem(problem: json.JSONDecodeError) -> str:
    """Where and why JSON text could not be read, for an INVALID_JSON message."""
    # Some messages end in "at" already ("Unterminated string starting at").
    return f"{problem.msg.removesuffix(' at')} at line {problem.lineno} column {problem.colno} (char {problem.pos})"


def invalid_json(call: ToolCall, problem: str) -> ToolError:
    """The arguments are not one JSON object; `problem` says why (see `json_problem`)."""
    return ToolError(
        code=ErrorCode.INVALID_JSON,
        message=f"the arguments for {call.name!r} are not a JSON object: {problem}.",
        hint="Send the arguments as one JSON object matching the tool's parameters, e.g. {\"field\": \"value\"}.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def _field_path(loc: tuple[int | str, ...], error_type: str, arguments: Any) -> tuple[int | str, ...]:
    """Where an error is in the arguments, without the union-member tags pydantic adds to `loc`.

    For `x: int | str` pydantic reports `x.int` and `x.str`; those tags are not fields the model
    can fix. A part is kept when it exists in the arguments (or names the missing field).
    """
    path: list[int | str] = []
    node = arguments
    for position, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (error_type == "missing" and position == len(loc) - 1):
            continue
        path.append(part)
    return tuple(path)


def _field_line(field: str, errs: list[dict[str, Any]], secret: bool) -> str:
    types = {err["type"] for err in errs}
    if "missing" in types:
        return f"- {field}: required field is missing"
    if "extra_forbidden" in types:
        return f"- {field}: unexpected field (not a parameter of this tool)"
    problems = "; or ".join(dict.fromkeys(well_formed(redact_text(err["msg"])) for err in errs))
    got = MASK if secret else excerpt(errs[0].get("input"), 80)
    return f"- {field}: {problems} (got {got})"


def invalid_arguments(call: ToolCall, exc: ValidationError) -> ToolError:
    """One line per field (a union's alternatives share it); values of secret-named fields masked."""
    by_field: dict[tuple[int | str, ...], list[Any]] = {}
    for err in exc.errors(include_url=False):
        path = _field_path(tuple(err["loc"]), err["type"], call.arguments)
        by_field.setdefault(path, []).append(err)
    lines = [
        _field_line(
            ".".join(str(part) for part in path) or "(arguments)",
            errs,
            secret=any(isinstance(part, str) and is_secret_key(part) for part in path),
        )
        for path, errs in itertools.islice(by_field.items(), _MAX_FIELD_LINES)
    ]
    if len(by_field) > _MAX_FIELD_LINES:
        lines.append(f"- … and {len(by_field) - _MAX_FIELD_LINES} more fields with errors")
    return ToolError(
        code=ErrorCode.INVALID_ARGUMENTS,
        message=f"the arguments for {call.name!r} do not match its parameters:\n" + "\n".join(lines),
        hint="Correct the listed fields and call the tool again; the parameter schema is in the tool declaration.",
        input_excerpt=excerpt(call.arguments if call.arguments is not None else call.arguments_raw),
    )


def arguments_too_large(call: ToolCall, size: int, limit: int) -> ToolError:
    """Arguments over TOOLCHORD_MAX_ARGUMENT_BYTES: refused before they are parsed."""
    return ToolError(
        code=ErrorCode.INVALID_ARGUMENTS,
        message=(
            f"the arguments for {call.name!r} are too large: {size:,} bytes, over the limit of {limit:,} bytes "
            "(TOOLCHORD_MAX_ARGUMENT_BYTES); they were not read."
        ),
        hint="Send much smaller arguments: pass a reference (a path, URL or id) instead of the content itself, "
        "or split the work into several calls.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def result_data_too_large(call: ToolCall, size: int, limit: int) -> ToolError:
    """A handler's structured `data` over TOOLCHORD_MAX_RESULT_DATA_BYTES: dropped, not cut."""
    return ToolError(
        code=ErrorCode.EXECUTION_ERROR,
        message=(
            f"{call.name!r} finished, but its structured result is too large: {size:,} bytes of JSON, over the "
            f"limit of {limit:,} bytes (TOOLCHORD_MAX_RESULT_DATA_BYTES), so the structured data was dropped."
        ),
        hint="The call did run: do not repeat it just to get the data. If you need the data, ask for less of it "
        "(a filter, a page, a limit); the text output, if any, follows.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def unusable_arguments(call: ToolCall, reason: str) -> ToolError:
    """Arguments that validated but cannot be carried to the handler (e.g. nested too deeply)."""
    return ToolError(
        code=ErrorCode.INVALID_ARGUMENTS,
        message=f"the arguments for {call.name!r} cannot be used: {reason}.",
        hint="Send flatter, smaller arguments that match the tool's parameters.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def permission_denied(call: ToolCall, reason: str) -> ToolError:
    return ToolError(
        code=ErrorCode.PERMISSION_DENIED,
        message=f"the call to {call.name!r} was refused before it ran: {reason}",
        hint="Do not retry this call as is; ask the user for approval or choose another approach.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def timeout(call: ToolCall, seconds: float) -> ToolError:
    """The tool's own timeout stopped the handler."""
    return ToolError(
        code=ErrorCode.TIMEOUT,
        message=f"{call.name!r} did not finish within the tool's own {seconds:g} s timeout and was stopped.",
        hint="Retry with a smaller request (narrower query, fewer items), or try a different approach.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def turn_stopped_waiting(call: ToolCall, reason: str) -> ToolError:
    """The turn stopped waiting for a call that was still running (it was not stopped)."""
    return ToolError(
        code=ErrorCode.TIMEOUT,
        message=f"{call.name!r} had not finished when {reason}: the turn stopped waiting for it, "
        "but the call was not stopped.",
        hint="If it finishes, its result is reported with a later turn; call it again only if that result "
        "does not come, or retry with a smaller request.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def execution_error(call: ToolCall, error_type: str, message: str) -> ToolError:
    return ToolError(
        code=ErrorCode.EXECUTION_ERROR,
        message=f"{call.name!r} failed: {error_type}: {excerpt(message, 1000)}",
        hint="Check the arguments against the error; retry only if a change to them can help.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def outcome_unknown(call: ToolCall, reason: str) -> ToolError:
    return ToolError(
        code=ErrorCode.OUTCOME_UNKNOWN,
        message=f"{call.name!r} started but its end was not observed ({reason}); it may or may not have taken effect.",
        hint=_VERIFY,
        input_excerpt=excerpt(call.arguments_raw),
    )


def not_executed(call: ToolCall, reason: str) -> ToolError:
    return ToolError(
        code=ErrorCode.NOT_EXECUTED,
        message=f"{call.name!r} was not run: {reason}.",
        hint="It had no effect; call it again if it is still needed.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def over_call_cap(call: ToolCall, calls: int, limit: int) -> ToolError:
    """A call past the per-turn cap (TOOLCHORD_MAX_CALLS_PER_TURN): never read, never run."""
    return ToolError(
        code=ErrorCode.NOT_EXECUTED,
        message=(
            f"{call.name!r} was not run: this turn has {calls:,} calls and at most {limit} calls run per turn "
            f"(TOOLCHORD_MAX_CALLS_PER_TURN); the first {limit} in order ran."
        ),
        hint=f"It had no effect. Call it again in a later turn if it is still needed, with at most {limit} calls per turn.",
        input_excerpt=excerpt(call.arguments_raw),
    )


def aborted(call: ToolCall) -> ToolError:
    return ToolError(
        code=ErrorCode.ABORTED,
        message=f"{call.name!r} has no recorded result: the conversation was restored after an interruption.",
        hint=_VERIFY,
        input_excerpt=excerpt(call.arguments_raw),
    )


def cancelled(call: ToolCall) -> ToolError:
    return ToolError(
        code=ErrorCode.CANCELLED,
        message=f"{call.name!r} was cancelled while running.",
        hint="Call it again if it is still needed; if it changes anything, check its effect first.",
        input_excerpt=excerpt(call.arguments_raw),
    )
