"""toolchord orchestrator side: provider adapters, the call pipeline, turns, the agent loop."""

from __future__ import annotations

from orchestrator.agent import Agent, AgentResult, AgentStep
from orchestrator.approval_store import Approval
from orchestrator.approvals import SessionWaiting, Settlement, UnknownApproval
from orchestrator.eventlog import EventLog, JsonlEventLog, RedisEventLog, SessionRecorder, open_event_log
from orchestrator.model_clients import ModelError, make_model_client
from orchestrator.pipeline import PermissionHook, Pipeline, PreparedCall, prepare_call
from orchestrator.providers import ProviderAdapter, ProviderFormatError, get_adapter
from orchestrator.request_builder import PairingError, RequestBuilder, check_pairing, request_bytes
from orchestrator.runtime import Orchestrator
from orchestrator.scripted_model import ScriptedCall, ScriptedModelServer, ScriptedTurn
from orchestrator.turn import LateCall, TurnRecord, TurnResult

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
    "ScriptedCall",
    "ScriptedModelServer",
    "ScriptedTurn",
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
