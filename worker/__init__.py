"""toolchord worker side: tools, the registry, execution, sandboxing and the Celery app."""

from __future__ import annotations

from worker.context import ToolContext
from worker.execution import HandlerOutcome, ToolOutput, call_handler
from worker.models import ErrorCode, Risk, SideEffect, ToolCall, ToolError, ToolResult, Truncation
from worker.registry import PROVIDERS, DuplicateToolError, Provider, Registry, declaration
from worker.sandbox.profile import SandboxProfile
from worker.tools import ToolSpec, tool

__all__ = [
    "PROVIDERS",
    "DuplicateToolError",
    "ErrorCode",
    "HandlerOutcome",
    "Provider",
    "Registry",
    "Risk",
    "SandboxProfile",
    "SideEffect",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "ToolResult",
    "ToolSpec",
    "Truncation",
    "call_handler",
    "declaration",
    "tool",
]
