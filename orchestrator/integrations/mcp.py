"""MCP tools in a toolchord `Registry`: `mcp_registry(McpServer.stdio(...))`. Needs the `mcp` extra.

The server's tools are listed (over a short-lived session) when the registry is first used, in
every process that uses it: the orchestrator (declarations, argument validation against each
tool's input schema) and each worker (which runs the calls). A worker calls the server on the model's
behalf through the session it keeps per server (`toolchord.orchestrator.integrations.mcp_sessions`), so MCP
tools run in the worker process, not in a sandbox child: the MCP server process is the boundary.

Side-effect classes come from the tools' annotations (`side_effect_for`), overridable per tool.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

from jsonschema.validators import validator_for
from mcp import types
from pydantic import BaseModel, ConfigDict, create_model, model_validator
from pydantic_core import PydanticCustomError

from toolchord.orchestrator.integrations.mcp_sessions import SESSIONS, McpServer, list_tools, run_blocking
from toolchord.worker.context import ToolContext
from toolchord.worker.execution import ToolOutput
from toolchord.worker.models import SideEffect
from toolchord.worker.registry import Registry
from toolchord.worker.sandbox.profile import SandboxProfile
from toolchord.worker.tools import ToolSpec

DEFAULT_TIMEOUT = 30.0


class McpToolError(Exception):
    """The MCP server answered the call with `isError`: the text is what it said."""


class McpArguments(BaseModel):
    """Arguments checked against an MCP tool's JSON input schema (subclassed per tool)."""

    model_config = ConfigDict(extra="allow")
    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}

    @model_validator(mode="before")
    @classmethod
    def _matches_schema(cls, data: Any) -> Any:
        validator = validator_for(cls.input_schema)(cls.input_schema)
        problems = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
        if problems:
            lines = "; ".join(f"{'.'.join(str(p) for p in e.absolute_path) or '(arguments)'}: {e.message}"
                              for e in problems)
            raise PydanticCustomError("mcp_input_schema", "{problems}", {"problems": lines})
        return data

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The server's input schema, as declared (toolchord inlines refs and drops titles)."""
        return copy.deepcopy(cls.input_schema)


def arguments_model(tool: types.Tool) -> type[McpArguments]:
    """An argument model for one MCP tool, validating against its input schema."""
    name = "".join(part.capitalize() for part in tool.name.replace("-", "_").split("_") if part) + "McpArgs"
    model = create_model(name, __base__=McpArguments)
    model.input_schema = dict(tool.input_schema)
    return model


def side_effect_for(annotations: types.ToolAnnotations | None) -> SideEffect:
    """`readOnlyHint` -> read; `idempotentHint` (unless `destructiveHint` is explicitly true) ->
    idempotent; anything else, a missing annotation included -> unsafe (MCP's own defaults)."""
    if annotations is None:
        return "unsafe"
    if annotations.read_only_hint:
        return "read"
    if annotations.idempotent_hint and annotations.destructive_hint is not True:
        return "idempotent"
    return "unsafe"


def content_text(content: list[Any]) -> str:
    """The text of an MCP result's content blocks; non-text blocks are named, not inlined."""
    parts: list[str] = []
    for block in content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.EmbeddedResource):
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {resource.uri}]")
        elif isinstance(block, types.ResourceLink):
            parts.append(f"[resource link {block.uri}]")
        else:
            parts.append(f"[{getattr(block, 'type', 'content')} {getattr(block, 'mime_type', '')}]".replace(" ]", "]"))
    return "\n".join(parts)


class McpToolHandler:
    """The handler of one MCP tool: calls it through this process's session to its server."""

    def __init__(self, server: McpServer, tool_name: str, timeout: float) -> None:
        self.server = server
        self.tool_name = tool_name
        self.timeout = timeout

    def __call__(self, arguments: McpArguments, ctx: ToolContext) -> ToolOutput:
        limit = max(min(self.timeout, ctx.remaining), 0.001)
        result = SESSIONS.call(self.server, self.tool_name, arguments.model_dump(mode="json"), limit)
        text = content_text(result.content)
        if result.is_error:
            raise McpToolError(text or "the MCP server reported an error without text")
        return ToolOutput(content=text, data=result.structured_content)


def tool_spec(server: McpServer, tool: types.Tool, *, name: str | None = None, **policy: Any) -> ToolSpec:
    """A ToolSpec for one MCP tool. `policy` takes ToolSpec fields; `side_effect` defaults from
    the annotations. The sandbox is always `isolate=False`: the call runs where the session is."""
    if "sandbox" in policy:
        raise ValueError(f"MCP tool {tool.name!r}: MCP calls run in the worker process, a sandbox cannot apply")
    policy.setdefault("side_effect", side_effect_for(tool.annotations))
    policy.setdefault("timeout", DEFAULT_TIMEOUT)
    return ToolSpec(
        name=name or tool.name,
        description=tool.description or tool.title or tool.name,
        handler=McpToolHandler(server, tool.name, float(policy["timeout"])),
        args_model=arguments_model(tool),
        context_param="ctx",
        unpack_args=False,
        sandbox=SandboxProfile(isolate=False),
        **policy,
    )


def mcp_tools(
    server: McpServer,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    prefix: str = "",
) -> list[ToolSpec]:
    """ToolSpecs for every tool the server lists (named `prefix + name`).

    `defaults` applies ToolSpec fields to every tool, `overrides` to one tool by its MCP name
    (e.g. `{"delete_file": {"side_effect": "unsafe", "timeout": 5}}`); an override for a tool the
    server does not list is an error, so a renamed tool does not silently lose its policy.
    """
    overrides = dict(overrides or {})
    listed = run_blocking(lambda: list_tools(server))
    unknown = set(overrides) - {t.name for t in listed}
    if unknown:
        raise ValueError(f"overrides name tools that MCP server {server.name!r} does not list: {sorted(unknown)}")
    return [tool_spec(server, t, name=prefix + t.name, **{**(defaults or {}), **overrides.get(t.name, {})})
            for t in listed]


class McpRegistry(Registry):
    """A Registry of an MCP server's tools, listed from the server on first use.

    Lazily, because a tools module is imported where nothing asks for its tools: a sandbox
    zygote imports every tool module, and MCP tools never run there.
    """

    def __init__(
        self,
        server: McpServer,
        *,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        defaults: Mapping[str, Any] | None = None,
        prefix: str = "",
    ) -> None:
        self.server = server
        self._source = (dict(overrides or {}), dict(defaults or {}), prefix)
        self._listed: dict[str, ToolSpec] | None = None
        super().__init__()

    @property
    def _tools(self) -> dict[str, ToolSpec]:
        if self._listed is None:
            overrides, defaults, prefix = self._source
            specs = mcp_tools(self.server, overrides=overrides, defaults=defaults, prefix=prefix)
            self._listed = {spec.name: spec for spec in specs}
        return self._listed

    @_tools.setter
    def _tools(self, value: dict[str, ToolSpec]) -> None:
        # Registry.__init__ starts from an empty dict; the listing fills it on first use.
        if value:
            raise ValueError("McpRegistry lists its tools from the server")


def mcp_registry(
    server: McpServer,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Any] | None = None,
    prefix: str = "",
) -> McpRegistry:
    """A Registry of the server's tools (see `mcp_tools`), listed on first use; merge it into
    yours or leave it at module level in a tools module for `toolchord worker --tools`."""
    return McpRegistry(server, overrides=overrides, defaults=defaults, prefix=prefix)


__all__ = [
    "McpArguments",
    "McpRegistry",
    "McpServer",
    "McpToolError",
    "McpToolHandler",
    "arguments_model",
    "content_text",
    "mcp_registry",
    "mcp_tools",
    "side_effect_for",
    "tool_spec",
]
