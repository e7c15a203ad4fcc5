"""toolchord orchestrator side: provider adapters, the call pipeline, turns, the agent loop."""

from __future__ import annotations

from orchestrator.pipeline import PermissionHook, Pipeline, PreparedCall, prepare_call
from orchestrator.providers import ProviderAdapter, ProviderFormatError, get_adapter
from orchestrator.runtime import Orchestrator
from orchestrator.turn import LateCall, TurnRecord, TurnResult

__all__ = [
    "LateCall",
    "Orchestrator",
    "PermissionHook",
    "Pipeline",
    "PreparedCall",
    "ProviderAdapter",
    "ProviderFormatError",
    "TurnRecord",
    "TurnResult",
    "get_adapter",
    "prepare_call",
]

# Agent loop, event log and request builder (issue 6).
from orchestrator.agent import Agent, AgentResult, AgentStep
from orchestrator.eventlog import EventLog, JsonlEventLog, RedisEventLog, SessionRecorder, open_event_log
from orchestrator.model_clients import ModelError, make_model_client
from orchestrator.request_builder import PairingError, RequestBuilder, check_pairing, request_bytes
from orchestrator.scripted_model import ScriptedCall, ScriptedModelServer, ScriptedTurn

__all__ += [
    "Agent",
    "AgentResult",
    "AgentStep",
    "EventLog",
    "JsonlEventLog",
    "ModelError",
    "PairingError",
    "RedisEventLog",
    "RequestBuilder",
    "ScriptedCall",
    "ScriptedModelServer",
    "ScriptedTurn",
    "SessionRecorder",
    "check_pairing",
    "make_model_client",
    "open_event_log",
    "request_bytes",
]
