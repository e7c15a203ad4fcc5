"""toolchord orchestrator side: provider adapters, the call pipeline, turns, the agent loop."""

from __future__ import annotations
