"""`toolchord mcp serve`: a toolchord Registry as an MCP server whose calls run on the fleet.

Each `tools/call` becomes a one-call toolchord turn (`Orchestrator.arun_calls`): checked,
dispatched to the workers (or the embedded worker), sandboxed, retried by side-effect class.
Errors are results: the MCP client gets `isError` with toolchord's error text, and the error
code in the result's `_meta`. Side-effect classes are published as MCP tool annotations.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from mcp import types
from mcp.server.mcpserver import MCPServer

from toolchord.orchestrator.runtime import Orchestrator
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.policy import policy_of
from toolchord.worker.schema import parameters_schema
from toolchord.worker.tools import ToolSpec


def _annotations(spec: ToolSpec) -> types.ToolAnnotations:
    """The side-effect class's policy as MCP hints (a read-only tool is neither destructive nor not)."""
    policy = policy_of(spec.side_effect)
    if policy.read_only:
        return types.ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True)
    if policy.repeatable:
        return types.ToolAnnotations(read_only_hint=False, idempotent_hint=True)
    return types.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False)


def mcp_tool(spec: ToolSpec) -> types.Tool:
    """A toolchord tool as an MCP tool declaration; its side-effect class as annotations."""
    return types.Tool(name=spec.name, description=spec.description, input_schema=parameters_schema(spec.args_model),
                      annotations=_annotations(spec))


def call_result(result: ToolResult) -> types.CallToolResult:
    """A toolchord result as an MCP tool result (`isError` for every error code)."""
    meta: dict[str, Any] = {"toolchord": {"call_id": result.call_id, "attempts": result.attempts,
                                          "error_code": result.error.code.value if result.error else None}}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=result.content)],
        structured_content=result.data if isinstance(result.data, dict) else None,
        is_error=result.is_error,
        _meta=meta,
    )


class RegistryMcpServer(MCPServer):
    """An MCP server listing the orchestrator's tools and running each call as a toolchord turn.

    All calls of one server process share a session id; every call has a fresh call id (MCP has
    none), so a client's retry is a new call: dedupe across retries needs a tool `idempotency_key`.
    """

    def __init__(self, orchestrator: Orchestrator, *, name: str = "toolchord", session_id: str | None = None) -> None:
        super().__init__(name)
        self.orchestrator = orchestrator
        self.session_id = session_id or f"mcp-{uuid.uuid4().hex[:12]}"

    async def list_tools(self) -> list[types.Tool]:
        return [mcp_tool(spec) for spec in self.orchestrator.registry]

    def _tool_input_schema(self, name: str) -> dict[str, Any] | None:
        spec = self.orchestrator.registry.get(name)
        return None if spec is None else parameters_schema(spec.args_model)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> types.CallToolResult:
        call = ToolCall(id=f"mcp-{uuid.uuid4().hex}", name=name, arguments_raw=json.dumps(arguments),
                        arguments=arguments)
        turn = await self.orchestrator.arun_calls(self.session_id, [call])
        return call_result(turn.results[0])


__all__ = ["RegistryMcpServer", "call_result", "mcp_tool"]
