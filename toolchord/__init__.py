"""toolchord: run LLM agents' tool calls on a Celery fleet, once where once matters, sandboxed.

The public API (docs/api.md). Names load on first use, so importing `toolchord` (or a worker-side
module such as `toolchord.worker.tasks`) does not import the orchestrator, the provider SDKs or
build a Celery app. `toolchord.app` is the app configured from the environment, so
`celery -A toolchord worker` works; test doubles live in `toolchord.testing`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Celery

    from toolchord.orchestrator.agent import Agent, AgentResult, AgentStep
    from toolchord.orchestrator.approval_store import Approval
    from toolchord.orchestrator.approvals import SessionWaiting, Settlement, UnknownApproval
    from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog, RedisEventLog
    from toolchord.orchestrator.model_clients import ModelError, make_model_client
    from toolchord.orchestrator.pipeline import PermissionHook, Pipeline, PreparedCall, prepare_call
    from toolchord.orchestrator.providers import (
        ProviderAdapter,
        ProviderFormatError,
        declaration,
        declarations,
        get_adapter,
    )
    from toolchord.orchestrator.recorder import SessionRecorder
    from toolchord.orchestrator.request_builder import PairingError, RequestBuilder, check_pairing, request_bytes
    from toolchord.orchestrator.runtime import Orchestrator
    from toolchord.orchestrator.stores import open_event_log
    from toolchord.orchestrator.turn import LateCall, TurnRecord, TurnResult
    from toolchord.worker.celery_app import create_app
    from toolchord.worker.config import Settings
    from toolchord.worker.context import ToolContext
    from toolchord.worker.execution import HandlerOutcome, ToolOutput, call_handler
    from toolchord.worker.limits import Limit
    from toolchord.worker.models import ErrorCode, Risk, SideEffect, ToolCall, ToolError, ToolResult, Truncation
    from toolchord.worker.redis_clients import redis_client
    from toolchord.worker.registry import PROVIDERS, DuplicateToolError, Provider, Registry
    from toolchord.worker.sandbox.profile import SandboxProfile
    from toolchord.worker.tools import ToolSpec, tool

    app: Celery

_SOURCES: dict[str, str] = {
    "tool": "toolchord.worker.tools",
    "ToolSpec": "toolchord.worker.tools",
    "Limit": "toolchord.worker.limits",
    "Registry": "toolchord.worker.registry",
    "DuplicateToolError": "toolchord.worker.registry",
    "Provider": "toolchord.worker.registry",
    "PROVIDERS": "toolchord.worker.registry",
    "ToolContext": "toolchord.worker.context",
    "ToolOutput": "toolchord.worker.execution",
    "HandlerOutcome": "toolchord.worker.execution",
    "call_handler": "toolchord.worker.execution",
    "ToolCall": "toolchord.worker.models",
    "ToolResult": "toolchord.worker.models",
    "ToolError": "toolchord.worker.models",
    "ErrorCode": "toolchord.worker.models",
    "Truncation": "toolchord.worker.models",
    "Risk": "toolchord.worker.models",
    "SideEffect": "toolchord.worker.models",
    "SandboxProfile": "toolchord.worker.sandbox.profile",
    "Settings": "toolchord.worker.config",
    "create_app": "toolchord.worker.celery_app",
    "redis_client": "toolchord.worker.redis_clients",
    "Orchestrator": "toolchord.orchestrator.runtime",
    "Agent": "toolchord.orchestrator.agent",
    "AgentResult": "toolchord.orchestrator.agent",
    "AgentStep": "toolchord.orchestrator.agent",
    "Approval": "toolchord.orchestrator.approval_store",
    "SessionWaiting": "toolchord.orchestrator.approvals",
    "Settlement": "toolchord.orchestrator.approvals",
    "UnknownApproval": "toolchord.orchestrator.approvals",
    "EventLog": "toolchord.orchestrator.event_stores",
    "JsonlEventLog": "toolchord.orchestrator.event_stores",
    "RedisEventLog": "toolchord.orchestrator.event_stores",
    "SessionRecorder": "toolchord.orchestrator.recorder",
    "open_event_log": "toolchord.orchestrator.stores",
    "ModelError": "toolchord.orchestrator.model_clients",
    "make_model_client": "toolchord.orchestrator.model_clients",
    "PermissionHook": "toolchord.orchestrator.pipeline",
    "Pipeline": "toolchord.orchestrator.pipeline",
    "PreparedCall": "toolchord.orchestrator.pipeline",
    "prepare_call": "toolchord.orchestrator.pipeline",
    "ProviderAdapter": "toolchord.orchestrator.providers",
    "ProviderFormatError": "toolchord.orchestrator.providers",
    "get_adapter": "toolchord.orchestrator.providers",
    "declaration": "toolchord.orchestrator.providers",
    "declarations": "toolchord.orchestrator.providers",
    "PairingError": "toolchord.orchestrator.request_builder",
    "RequestBuilder": "toolchord.orchestrator.request_builder",
    "check_pairing": "toolchord.orchestrator.request_builder",
    "request_bytes": "toolchord.orchestrator.request_builder",
    "LateCall": "toolchord.orchestrator.turn",
    "TurnRecord": "toolchord.orchestrator.turn",
    "TurnResult": "toolchord.orchestrator.turn",
    "app": "toolchord.worker.celery_app",
}

__all__ = [
    "Agent",
    "AgentResult",
    "AgentStep",
    "Approval",
    "DuplicateToolError",
    "ErrorCode",
    "EventLog",
    "HandlerOutcome",
    "JsonlEventLog",
    "LateCall",
    "ModelError",
    "Orchestrator",
    "PROVIDERS",
    "PairingError",
    "PermissionHook",
    "Pipeline",
    "PreparedCall",
    "Provider",
    "ProviderAdapter",
    "ProviderFormatError",
    "RedisEventLog",
    "Limit",
    "Registry",
    "RequestBuilder",
    "Risk",
    "SandboxProfile",
    "SessionRecorder",
    "SessionWaiting",
    "Settings",
    "Settlement",
    "SideEffect",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "ToolResult",
    "ToolSpec",
    "Truncation",
    "TurnRecord",
    "TurnResult",
    "UnknownApproval",
    "app",
    "call_handler",
    "check_pairing",
    "create_app",
    "declaration",
    "declarations",
    "get_adapter",
    "make_model_client",
    "open_event_log",
    "prepare_call",
    "redis_client",
    "request_bytes",
    "tool",
]


def __getattr__(name: str) -> Any:
    # PEP 562: import the defining module on first use, then cache the name here.
    try:
        module = _SOURCES[name]
    except KeyError:
        raise AttributeError(f"module 'toolchord' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    if name != "app":  # the app is built from the environment on first access, and may be reset
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
