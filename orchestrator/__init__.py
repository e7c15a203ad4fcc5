"""toolchord orchestrator side: provider adapters, the call pipeline, turns, the agent loop."""

from __future__ import annotations

from toolchord.orchestrator.agent import Agent, AgentResult, AgentStep
from toolchord.orchestrator.approval_store import Approval
from toolchord.orchestrator.approvals import SessionWaiting, Settlement, UnknownApproval
from toolchord.orchestrator.eventlog import EventLog, JsonlEventLog, RedisEventLog, SessionRecorder, open_event_log
from toolchord.orchestrator.model_clients import ModelError, make_model_client
from toolchord.orchestrator.pipeline import PermissionHook, Pipeline, PreparedCall, prepare_call
from toolchord.orchestrator.providers import ProviderAdapter, ProviderFormatError, get_adapter
from toolchord.orchestrator.request_builder import PairingError, RequestBuilder, check_pairing, request_bytes
from toolchord.orchestrator.runtime import Orchestrator
from toolchord.orchestrator.turn import LateCall, TurnRecord, TurnResult

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
    "get_adapter",
    "make_model_client",
    "open_event_log",
    "prepare_call",
    "request_bytes",
]
