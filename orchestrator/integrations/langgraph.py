"""LangGraph / LangChain: `ToolchordToolNode`, a drop-in replacement for LangGraph's `ToolNode`.

The node takes the last `AIMessage`'s `tool_calls` (and `invalid_tool_calls`, which LangChain
sends back to the model too) and runs them as one toolchord turn: checked, dispatched to the
Celery fleet (or the embedded worker), and collected as exactly one `ToolMessage` per
`tool_call_id`, in the model's order, including the results toolchord synthesizes (`TIMEOUT`,
`OUTCOME_UNKNOWN`, `NOT_EXECUTED`, `UNKNOWN_TOOL`...). Needs the `langgraph` extra.

The turn id is derived from the session (the graph's `thread_id`) and the call ids, so when
LangGraph runs the node again for the same message (a retry, a resume from a checkpoint, a
replay) toolchord returns the stored results instead of running anything twice.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from pydantic import BaseModel

from toolchord.orchestrator.pipeline import PermissionHook
from toolchord.orchestrator.providers import declarations
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import Registry
from toolchord.worker.tools import ToolSpec

InputKind = Literal["dict", "list", "tool_calls"]


def tool_calls_of(message: AIMessage) -> list[ToolCall]:
    """toolchord calls for an AIMessage: its `tool_calls`, then its `invalid_tool_calls`.

    Invalid calls (arguments that were not JSON) keep their raw text, so they get an
    `INVALID_JSON` result the model can act on instead of being left without a reply.
    """
    calls = [
        ToolCall(id=tc["id"] or f"missing-id-{i}", name=tc["name"], arguments_raw=json.dumps(tc["args"]),
                 arguments=tc["args"], index=i)
        for i, tc in enumerate(message.tool_calls)
    ]
    for tc in message.invalid_tool_calls:
        index = len(calls)
        calls.append(ToolCall(id=tc.get("id") or f"missing-id-{index}", name=tc.get("name") or "",
                              arguments_raw=tc.get("args") or "", index=index))
    return calls


def tool_message(result: ToolResult) -> ToolMessage:
    """The ToolMessage for one result; `artifact` holds the whole ToolResult (error code, data, attempts)."""
    return ToolMessage(
        content=result.content,
        tool_call_id=result.call_id,
        name=result.name,
        status="error" if result.is_error else "success",
        artifact=result.model_dump(mode="json"),
    )


class ToolchordToolNode(RunnableLambda):
    """A LangGraph node that runs an AIMessage's tool calls as one toolchord turn.

    Use it where `ToolNode` was: `graph.add_node("tools", ToolchordToolNode(registry))`; it reads
    the same inputs (a state with `messages`, a list of messages, or a list of tool-call dicts)
    and writes the same outputs (`{"messages": [ToolMessage, ...]}` or a list). Tools are
    toolchord tools (`toolchord.tool`) in a `Registry`; bind `node.tool_schemas` to the chat model.
    Pass `orchestrator` to run on a Celery fleet (`Orchestrator(registry, create_app())`); with
    none, an embedded orchestrator is made from `tools`.
    """

    def __init__(
        self,
        tools: Registry | Iterable[ToolSpec],
        *,
        orchestrator: Orchestrator | None = None,
        name: str = "tools",
        messages_key: str = "messages",
        session_id: str | None = None,
        turn_timeout: float | None = None,
        permission_hook: PermissionHook | None = None,
    ) -> None:
        registry = tools if isinstance(tools, Registry) else Registry(tools)
        self.orchestrator = orchestrator or Orchestrator(
            registry, turn_timeout=turn_timeout, permission_hook=permission_hook
        )
        self.registry = registry
        self.messages_key = messages_key
        # Used when the graph runs without a thread_id: retries in this process still find the turn.
        self.default_session = session_id or f"langgraph-{uuid.uuid4().hex[:12]}"
        super().__init__(self._run, afunc=self._arun, name=name)

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as OpenAI function declarations, for `chat_model.bind_tools(...)` or a raw client."""
        return declarations(self.registry, "chat")

    def _parse(self, value: Any) -> tuple[list[ToolCall], InputKind]:
        if isinstance(value, list) and value and isinstance(value[-1], dict) and value[-1].get("type") == "tool_call":
            message = AIMessage(content="", tool_calls=value)
            return tool_calls_of(message), "tool_calls"
        if isinstance(value, list):
            messages: Sequence[AnyMessage] = value
            kind: InputKind = "list"
        elif isinstance(value, dict):
            messages, kind = value.get(self.messages_key, []), "dict"
        elif isinstance(value, BaseModel):
            messages, kind = getattr(value, self.messages_key, []), "dict"
        else:
            raise ValueError(f"ToolchordToolNode: no messages in input of type {type(value).__name__}")
        last = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
        if last is None:
            raise ValueError("ToolchordToolNode: no AIMessage found in input")
        return tool_calls_of(last), kind

    def _session(self, config: RunnableConfig | None) -> str:
        thread = ((config or {}).get("configurable") or {}).get("thread_id")
        return str(thread) if thread else self.default_session

    def _output(self, results: list[ToolResult], kind: InputKind) -> Any:
        messages = [tool_message(result) for result in results]
        return {self.messages_key: messages} if kind == "dict" else messages

    def _run(self, value: Any, config: RunnableConfig) -> Any:
        calls, kind = self._parse(value)
        if not calls:
            return self._output([], kind)
        return self._output(self.orchestrator.run_calls(self._session(config), calls).results, kind)

    async def _arun(self, value: Any, config: RunnableConfig) -> Any:
        calls, kind = self._parse(value)
        if not calls:
            return self._output([], kind)
        return self._output((await self.orchestrator.arun_calls(self._session(config), calls)).results, kind)


__all__ = ["ToolchordToolNode", "tool_calls_of", "tool_message"]
