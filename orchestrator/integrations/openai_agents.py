"""OpenAI Agents SDK integration (extra `toolchord[openai-agents]`; docs/integrations/openai-agents.md).

`ToolchordTools` turns a toolchord `Registry` into the SDK's `FunctionTool`s whose invocations
run through an `Orchestrator`: the calls of one model response become one toolchord turn
(`TurnBatcher`), the SDK's `tool_call_id` is toolchord's call id, and every outcome, errors
included, comes back as the model-facing text of docs/errors.md. `run_config()` adds the SDK
settings that send calls of unknown tools back to the model as toolchord's `UNKNOWN_TOOL` text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents import FunctionTool, RunConfig, Tool
from agents.run_config import ToolErrorFormatterArgs
from agents.tool_context import ToolContext

from toolchord.orchestrator.integrations.batching import DEFAULT_BATCH_WINDOW, TurnBatcher, with_late_results
from toolchord.orchestrator.pipeline import prepare_call
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import Registry
from toolchord.worker.schema import parameters_schema, strict_compatible
from toolchord.worker.tools import ToolSpec

SessionId = str | Callable[[ToolContext[Any]], str]
"""The toolchord session of an invocation: fixed, or read from the SDK's tool context."""


def _response_key(ctx: ToolContext[Any]) -> tuple[int, int]:
    """Identifies the model response a call belongs to: the run's usage record (one object shared
    by every context of a run) and its request count, which only grows with the next model call."""
    return id(ctx.usage), ctx.usage.requests


class ToolchordTools:
    """The registry's tools as `FunctionTool`s that execute through toolchord.

    `session_id` scopes the idempotency keys: pass the conversation's id (a string, or a function
    of the `ToolContext`, e.g. `lambda ctx: ctx.context.conversation_id`). A call invoked again
    with the same session and call id — a retried or resumed run — returns its first result and
    is never run twice.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        session_id: SessionId,
        registry: Registry | None = None,
        batch_window: float = DEFAULT_BATCH_WINDOW,
    ) -> None:
        self.orchestrator = orchestrator
        self.registry = registry if registry is not None else orchestrator.registry
        self.session_id = session_id
        self.batcher = TurnBatcher(orchestrator, window=batch_window)
        self.tools: list[Tool] = [self._function_tool(spec) for spec in self.registry]

    def _session(self, ctx: ToolContext[Any]) -> str:
        return self.session_id(ctx) if callable(self.session_id) else self.session_id

    def _function_tool(self, spec: ToolSpec) -> FunctionTool:
        params = parameters_schema(spec.args_model)

        async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
            # The SDK hands the arguments over as the model sent them: toolchord parses and
            # validates them, so malformed ones get INVALID_JSON / INVALID_ARGUMENTS text.
            turn, result = await self.batcher.run(
                self._session(ctx), _response_key(ctx), ctx.tool_call_id, spec.name, arguments
            )
            return with_late_results(turn, result)

        return FunctionTool(
            name=spec.name,
            description=spec.description,
            params_json_schema=params,
            on_invoke_tool=invoke,
            strict_json_schema=strict_compatible(params),
        )

    def format_tool_error(self, args: ToolErrorFormatterArgs[Any]) -> str | None:
        """`RunConfig.tool_error_formatter`: toolchord's UNKNOWN_TOOL text for a call of a name the
        registry lacks (listing the tools, closest first); the SDK's own text for anything else."""
        if args.kind != "tool_not_found":
            return None
        checked = prepare_call(ToolCall(id=args.call_id, name=args.tool_name, arguments_raw=""), self.registry, "")
        return checked.content if isinstance(checked, ToolResult) else None

    def run_config(self, **options: Any) -> RunConfig:
        """A `RunConfig` (with `options`) that returns calls of unknown tools to the model as results."""
        options.setdefault("tool_not_found_behavior", "return_error_to_model")
        options.setdefault("tool_error_formatter", self.format_tool_error)
        return RunConfig(**options)


def function_tools(orchestrator: Orchestrator, *, session_id: SessionId, **options: Any) -> list[Tool]:
    """Shortcut for `ToolchordTools(orchestrator, session_id=..., **options).tools`."""
    return ToolchordTools(orchestrator, session_id=session_id, **options).tools


__all__ = ["SessionId", "ToolchordTools", "function_tools"]
