"""toolchord orchestrator side: provider adapters, the call pipeline, turns, the agent loop.

The names below load on first use, as the top package's do (toolchord/__init__.py): the `toolchord`
command lives in this package (`toolchord.orchestrator.cli`), and `toolchord worker` must not pay
for, nor carry in its processes, the orchestrator, the provider SDKs and the agent loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import toolchord

if TYPE_CHECKING:
    # The top package's face says where each name is defined.
    from toolchord import (
        Agent,
        AgentResult,
        AgentStep,
        Approval,
        EventLog,
        JsonlEventLog,
        LateCall,
        ModelError,
        Orchestrator,
        PairingError,
        PermissionHook,
        Pipeline,
        PreparedCall,
        ProviderAdapter,
        ProviderFormatError,
        RedisEventLog,
        RequestBuilder,
        SessionRecorder,
        SessionWaiting,
        Settlement,
        TurnRecord,
        TurnResult,
        UnknownApproval,
        check_pairing,
        declaration,
        declarations,
        get_adapter,
        make_model_client,
        open_event_log,
        prepare_call,
        request_bytes,
    )

__all__ = [
    "Agent",
    "AgentResult",
    "AgentStep",
    "Approval",
    "EventLog",
    "JsonlEventLog",
    "LateCall",
    "ModelError",
    "Orchestrator",
    "PairingError",
    "PermissionHook",
    "Pipeline",
    "PreparedCall",
    "ProviderAdapter",
    "ProviderFormatError",
    "RedisEventLog",
    "RequestBuilder",
    "SessionRecorder",
    "SessionWaiting",
    "Settlement",
    "TurnRecord",
    "TurnResult",
    "UnknownApproval",
    "check_pairing",
    "declaration",
    "declarations",
    "get_adapter",
    "make_model_client",
    "open_event_log",
    "prepare_call",
    "request_bytes",
]


def __getattr__(name: str) -> Any:
    # PEP 562: the top package knows where each public name is defined.
    if name not in __all__:
        raise AttributeError(f"module 'toolchord.orchestrator' has no attribute {name!r}")
    value = getattr(toolchord, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
