"""toolchord worker side: tools, the registry, execution, sandboxing and the Celery app."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolchord.worker.context import ToolContext
from toolchord.worker.execution import HandlerOutcome, ToolOutput, call_handler
from toolchord.worker.models import ErrorCode, Risk, SideEffect, ToolCall, ToolError, ToolResult, Truncation
from toolchord.worker.registry import PROVIDERS, DuplicateToolError, Provider, Registry
from toolchord.worker.sandbox.profile import SandboxProfile
from toolchord.worker.tools import ToolSpec, tool

if TYPE_CHECKING:
    from celery import Celery

    from toolchord.worker.celery_app import create_app
    from toolchord.worker.redis_clients import redis_client

    app: Celery


def __getattr__(name: str) -> Any:
    # Lazy: importing the Celery app reads the environment and imports the configured tool
    # modules, which must not happen just because someone imported `toolchord.worker.tool`.
    if name in ("app", "create_app"):
        from toolchord.worker import celery_app

        return getattr(celery_app, name)
    if name == "redis_client":
        # Lazy too: the sandbox zygote imports `toolchord.worker` and has no use for redis-py.
        from toolchord.worker.redis_clients import redis_client

        return redis_client
    raise AttributeError(f"module 'toolchord.worker' has no attribute {name!r}")

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
    "app",
    "create_app",
    "Truncation",
    "call_handler",
    "redis_client",
    "tool",
]
