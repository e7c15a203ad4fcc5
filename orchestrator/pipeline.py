"""Before dispatch: parse → look up → validate → permission, for each call of a turn.

Errors found here never reach a worker: they become results directly (docs/architecture.md, the turn diagram).
`Pipeline.run` adds in-process execution so one call can go the whole way without Celery.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretBytes, SecretStr, ValidationError

from toolchord.orchestrator.providers.plain_data import ArgumentsProblem, load_arguments
from toolchord.worker import errors
from toolchord.worker.config import DEFAULT_MAX_ARGUMENT_BYTES, DEFAULT_MAX_RESULT_DATA_BYTES
from toolchord.worker.context import ToolContext
from toolchord.worker.idempotency import eager_idempotency_key, idempotency_key
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import Registry
from toolchord.worker.runner import execute_call
from toolchord.worker.spill import MemorySpillStore, SpillStore, read_output_tool
from toolchord.worker.tools import ToolSpec

_log = logging.getLogger("toolchord.pipeline")

PermissionHook = Callable[[ToolCall, ToolSpec], "bool | str | None"]
"""Decides a call before it runs: True allows; False or a reason string refuses; None abstains
(abstaining allows low-risk tools and refuses high-risk ones)."""


class PreparedCall(BaseModel):
    """A call that passed every pre-dispatch check, with arguments as validated JSON."""

    model_config = ConfigDict(frozen=True)

    call: ToolCall
    arguments: dict[str, Any]
    idempotency_key: str
    resource: str | None = None


def utf8_size_over(text: str, limit: int) -> int | None:
    """The UTF-8 size of `text` when it is over `limit` bytes, else None; encodes only when it must."""
    if len(text) * 4 <= limit:
        return None  # at most 4 bytes per character
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


def parse_arguments(call: ToolCall) -> dict[str, Any] | ToolResult:
    """The call's arguments as a JSON object, or an INVALID_JSON result.

    The rules are the provider adapters' (`toolchord.orchestrator.providers.plain_data.load_arguments`), so a
    call that ran has the arguments the rebuilt history shows: empty text means `{}`; NaN, Infinity
    and lone surrogates are not JSON.
    """
    try:
        return load_arguments(call.arguments_raw)
    except ArgumentsProblem as problem:
        return errors.error_result(call, errors.invalid_json(call, str(problem)))


def _non_finite_numbers(arguments: dict[str, Any]) -> list[dict[str, Any]]:
    """pydantic error entries for the numbers JSON text overflowed to infinity (1e400, -1e400):
    no tool can use them, and they cannot be passed on as JSON. Without recursion: arguments may
    be nested as deeply as json.loads allows."""
    found: list[dict[str, Any]] = []
    pending: list[tuple[tuple[int | str, ...], Any]] = [((), arguments)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            found.append({"type": "finite_number", "loc": path, "input": value})
        elif isinstance(value, dict):
            pending.extend(((*path, key), item) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend(((*path, index), item) for index, item in enumerate(value))
    return found


def check_permission(call: ToolCall, spec: ToolSpec, hook: PermissionHook | None) -> ToolResult | None:
    """A PERMISSION_DENIED result, or None when the call may run. A hook that raises refuses."""
    try:
        decision = hook(call, spec) if hook is not None else None
    except Exception as exc:  # noqa: BLE001 - fail closed, and keep one result per call
        _log.exception("permission hook failed for %s (call %s)", call.name, call.id)
        reason = f"the permission check failed ({type(exc).__name__}), so the call was refused"
        return errors.error_result(call, errors.permission_denied(call, reason))
    if decision is True or (decision is None and spec.risk == "low"):
        return None
    if isinstance(decision, str) and decision:
        reason = decision
    elif decision is None:
        reason = "this is a high-risk tool and no permission hook allowed it"
    else:
        reason = "the permission policy refused it"
    return errors.error_result(call, errors.permission_denied(call, reason))


def _with_secrets(value: Any, dumped: Any) -> Any:
    """`dumped` (a JSON-mode dump of `value`) with SecretStr/SecretBytes values put back.

    JSON-mode dumps mask secrets as "**********", but the handler must receive the real value:
    the arguments are re-validated on the worker. Redaction happens where text leaves (errors, logs).
    """
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, SecretBytes):
        return value.get_secret_value().decode("utf-8", "replace")
    if isinstance(value, BaseModel) and isinstance(dumped, dict):
        return {key: _with_secrets(getattr(value, key, None), item) for key, item in dumped.items()}
    if isinstance(value, (list, tuple)) and isinstance(dumped, list) and len(value) == len(dumped):
        return [_with_secrets(v, d) for v, d in zip(value, dumped, strict=True)]
    if isinstance(value, dict) and isinstance(dumped, dict):
        return {key: _with_secrets(value.get(key), item) for key, item in dumped.items()}
    return dumped


def prepare_call(
    call: ToolCall,
    registry: Registry,
    session_id: str,
    permission_hook: PermissionHook | None = None,
    *,
    max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
    eager_scope: str | None = None,
) -> PreparedCall | ToolResult:
    """Run the pre-dispatch checks in order: the name before the arguments, permission last.

    Arguments over `max_argument_bytes` are refused (INVALID_ARGUMENTS) before they are parsed.
    `eager_scope` (a call started while its message streams): the key is derived from the scope,
    name and arguments instead of the call id (`eager_idempotency_key`).
    """
    spec = registry.get(call.name)
    if spec is None:
        return errors.error_result(call, errors.unknown_tool(call, registry.closest(call.name)))
    oversize = utf8_size_over(call.arguments_raw, max_argument_bytes)
    if oversize is not None:
        return errors.error_result(call, errors.arguments_too_large(call, oversize, max_argument_bytes))
    parsed = parse_arguments(call)
    if isinstance(parsed, ToolResult):
        return parsed
    try:
        overflowed = _non_finite_numbers(parsed)
        if overflowed:
            raise ValidationError.from_exception_data(spec.args_model.__name__, overflowed)  # type: ignore[arg-type]
        validated = spec.args_model.model_validate(parsed)
    except ValidationError as exc:
        return errors.error_result(call, errors.invalid_arguments(call.model_copy(update={"arguments": parsed}), exc))
    denied = check_permission(call, spec, permission_hook)
    if denied is not None:
        return denied
    try:
        arguments = _with_secrets(validated, validated.model_dump(mode="json"))
    except (ValueError, RecursionError) as exc:
        # pydantic's serializer has a depth limit that json.loads and validation do not share.
        reason = f"they are nested too deeply to pass on ({type(exc).__name__})"
        return errors.error_result(call, errors.unusable_arguments(call, reason))
    try:
        key = (idempotency_key(spec, session_id, call.id, arguments) if eager_scope is None
               else eager_idempotency_key(spec, session_id, eager_scope, arguments))
        resource = spec.resource(arguments) if spec.resource is not None else None
    except Exception as exc:  # noqa: BLE001 - a failing policy function must not end the turn
        _log.exception("idempotency_key/resource function of %s failed (call %s)", call.name, call.id)
        failure = errors.execution_error(call, type(exc).__name__, f"the tool's policy function failed: {exc}")
        return errors.error_result(call, failure)
    return PreparedCall(call=call, arguments=arguments, idempotency_key=key, resource=resource)


class Pipeline:
    """The whole pipeline for one call in this process (no Celery): checks, sandboxed run, shaping."""

    def __init__(
        self,
        registry: Registry,
        *,
        permission_hook: PermissionHook | None = None,
        spill: SpillStore | None = None,
        max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
        max_result_data_bytes: int = DEFAULT_MAX_RESULT_DATA_BYTES,
    ) -> None:
        # A copy, so the caller's registry is left as it was.
        self.registry = Registry(registry)
        self.permission_hook = permission_hook
        self.max_argument_bytes = max_argument_bytes
        self.max_result_data_bytes = max_result_data_bytes
        # A store of its own unless given one: pipelines (and orchestrators) never share spills.
        self.spill: SpillStore = spill if spill is not None else MemorySpillStore()
        # Cut outputs point the model at read_output; like the Orchestrator, make sure it exists,
        # reading the store this pipeline spills into.
        self.registry.add_missing([read_output_tool(self.spill)])

    def run(self, call: ToolCall, session_id: str = "local") -> ToolResult:
        """Exactly one result for the call; never raises for anything the model or handler did."""
        prepared = prepare_call(
            call, self.registry, session_id, self.permission_hook, max_argument_bytes=self.max_argument_bytes
        )
        if isinstance(prepared, ToolResult):
            return prepared
        spec = self.registry[call.name]
        context = ToolContext(
            call_id=call.id,
            session_id=session_id,
            tool_name=call.name,
            idempotency_key=prepared.idempotency_key,
            deadline=time.time() + spec.timeout,
        )
        return execute_call(
            call, spec, prepared.arguments, context, spill=self.spill, max_data_bytes=self.max_result_data_bytes
        )

    def run_all(self, calls: list[ToolCall], session_id: str = "local") -> list[ToolResult]:
        """Results for several calls, one each, in the model's order (run one after another)."""
        return [self.run(call, session_id) for call in sorted(calls, key=lambda c: c.index)]
