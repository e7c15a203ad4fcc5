"""The session timeline page (`toolchord ui`); see docs/operations.md."""

from __future__ import annotations

from toolchord.orchestrator.ui.server import AUTH_ENV, TimelineServer
from toolchord.orchestrator.ui.session_view import (
    CallBar,
    SessionSummary,
    SessionView,
    TurnView,
    recent_sessions,
    session_view,
)

__all__ = [
    "AUTH_ENV",
    "CallBar",
    "SessionSummary",
    "SessionView",
    "TimelineServer",
    "TurnView",
    "recent_sessions",
    "session_view",
]
