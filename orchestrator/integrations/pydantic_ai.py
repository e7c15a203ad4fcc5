"""Pydantic AI integration (extra `toolchord[pydantic-ai]`; docs/integrations/pydantic-ai.md).

`ToolchordToolset` is a Pydantic AI toolset (`AbstractToolset`) serving a toolchord `Registry`:
each call Pydantic AI makes runs through an `Orchestrator`, the calls of one model response as one
toolchord turn (`TurnBatcher`, keyed by the run and its step), with Pydantic AI's `tool_call_id`
as toolchord's call id. Arguments reach toolchord as the model sent them, so every outcome —
invalid JSON or arguments, a timeout, a lost worker — comes back as a tool return carrying the
model-facing text of docs/errors.md, never as an exception or a framework retry prompt.
`ToolchordCapability` adds the same text for calls of tools that do not exist.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pydantic_ai.models import ModelRequestContext
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool

from toolchord.orchestrator.integrations.batching import DEFAULT_BATCH_WINDOW, TurnBatcher, with_late_results
from toolchord.orchestrator.pipeline import prepare_call
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import Registry
from toolchord.worker.schema import parameters_schema, strict_compatible

SessionId = str | Callable[[RunContext[Any]], str]
"""The toolchord session of a call: fixed, or read from the run context."""

RAW_ARGUMENTS = "__toolchord_raw_arguments__"
"""Where arguments that are not a JSON object travel from validation to `call_tool`, unparsed."""


class _ModelArguments:
    """The toolset's argument validator: accepts whatever the model sent.

    toolchord validates against the tool's own argument model and answers with INVALID_JSON or
    INVALID_ARGUMENTS text; Pydantic AI's validation would answer with its own retry prompt.
    """

    def validate_json(self, input: str | bytes | bytearray, **_: Any) -> dict[str, Any]:
        text = input.decode("utf-8", "replace") if isinstance(input, (bytes, bytearray)) else input
        try:
            value = json.loads(text) if text.strip() else {}
        except ValueError:
            return {RAW_ARGUMENTS: text}
        return value if isinstance(value, dict) else {RAW_ARGUMENTS: text}

    def validate_python(self, input: Any, **_: Any) -> dict[str, Any]:
        return input if isinstance(input, dict) else {RAW_ARGUMENTS: json.dumps(input)}


def _session_default(ctx: RunContext[Any]) -> str:
    # The conversation id spans the runs of one conversation: a retried run keeps its keys.
    return ctx.conversation_id or ctx.run_id or "pydantic-ai"


class ToolchordToolset(AbstractToolset[Any]):
    """The registry's tools for a Pydantic AI agent, executed through toolchord.

    `session_id` scopes the idempotency keys; by default the run's `conversation_id`. A call made
    again with the same session and tool call id — a retried or replayed run — returns its first
    result and is never run twice.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        session_id: SessionId = _session_default,
        registry: Registry | None = None,
        batch_window: float = DEFAULT_BATCH_WINDOW,
        max_retries: int = 1,
        id: str | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.registry = registry if registry is not None else orchestrator.registry
        self.session_id = session_id
        self.batcher = TurnBatcher(orchestrator, window=batch_window)
        self.max_retries = max_retries
        self._id = id
        self._tools = {spec.name: self._definition(spec.name) for spec in self.registry}

    @property
    def id(self) -> str | None:
        return self._id

    def _definition(self, name: str) -> ToolDefinition:
        spec = self.registry[name]
        params = parameters_schema(spec.args_model)
        return ToolDefinition(name=name, description=spec.description, parameters_json_schema=params,
                              strict=strict_compatible(params))

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        return {
            name: ToolsetTool(toolset=self, tool_def=tool_def, max_retries=self.max_retries,
                              args_validator=_ModelArguments())
            for name, tool_def in self._tools.items()
        }

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]) -> str:
        """Run the call as part of its model response's turn; the result's text, errors included."""
        raw = tool_args[RAW_ARGUMENTS] if set(tool_args) == {RAW_ARGUMENTS} else json.dumps(tool_args)
        session = self.session_id(ctx) if callable(self.session_id) else self.session_id
        assert ctx.tool_call_id is not None, "Pydantic AI sets the call id for every tool call"
        turn, result = await self.batcher.run(session, (ctx.run_id, ctx.run_step), ctx.tool_call_id, name, raw)
        return with_late_results(turn, result)


class ToolchordCapability(AbstractCapability[Any]):
    """Serves `toolset` to an agent and answers calls of unknown tools with toolchord's text.

    Pydantic AI rejects a call of a name no toolset has before any toolset sees it, with a retry
    prompt of its own; this rewrites that prompt, in the run's history and in the request, into
    the UNKNOWN_TOOL text of docs/errors.md (the available tools, closest first). The retry still
    counts against the run's retry budget as before.
    """

    def __init__(self, toolset: ToolchordToolset) -> None:
        self.toolset = toolset

    def get_toolset(self) -> ToolchordToolset:
        return self.toolset

    def _rewritten(self, part: Any) -> Any:
        """`part`, or a copy with toolchord's UNKNOWN_TOOL text when it answers a call of an unknown tool."""
        if not (isinstance(part, ToolReturnPart) and part.retry is not None and part.retry.cause == "unknown_tool"):
            return part
        checked = prepare_call(ToolCall(id=part.tool_call_id, name=part.tool_name, arguments_raw=""),
                               self.toolset.registry, "")
        if not isinstance(checked, ToolResult) or part.content == checked.content:
            return part
        return replace(part, content=checked.content)

    def _rewrite(self, messages: list[Any]) -> None:
        for i, message in enumerate(messages):
            if isinstance(message, ModelRequest):
                parts = [self._rewritten(part) for part in message.parts]
                if any(new is not old for new, old in zip(parts, message.parts, strict=True)):
                    messages[i] = replace(message, parts=parts)

    async def before_model_request(self, ctx: RunContext[Any], request_context: ModelRequestContext) -> ModelRequestContext:
        # In the run's history as well as this request: runs continuing the history replay the same text.
        self._rewrite(ctx.messages)
        self._rewrite(request_context.messages)
        return request_context


__all__ = ["RAW_ARGUMENTS", "SessionId", "ToolchordCapability", "ToolchordToolset"]
