"""Test doubles for toolchord users: a scripted OpenAI- and Anthropic-compatible model server.

`ScriptedModelServer` speaks the real APIs over HTTP, so the official `openai` and `anthropic`
SDK clients (and frameworks built on them) run unchanged against it; each `ScriptedTurn` is one
model answer, text or `ScriptedCall`s (docs/agent-loop.md).
"""

from __future__ import annotations

from toolchord.orchestrator.scripted_model import ScriptedCall, ScriptedModelServer, ScriptedTurn

__all__ = ["ScriptedCall", "ScriptedModelServer", "ScriptedTurn"]
