"""The timeline of an embedded session (`toolchord ui --log-dir`): each call has its own start and
end, as the cluster's workers record them, not one mark at the end of its turn."""

from __future__ import annotations

import time
from pathlib import Path

from toolchord import Agent, JsonlEventLog, Registry, SandboxProfile, tool
from toolchord.orchestrator.ui.session_view import session_view
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn


@tool(side_effect="read", sandbox=SandboxProfile(isolate=False))
def quick(x: int) -> str:
    """Answer at once."""
    return str(x)


@tool(side_effect="read", sandbox=SandboxProfile(isolate=False), timeout=30)
def slow(seconds: float) -> str:
    """Take a while."""
    time.sleep(seconds)
    return "slept"


def test_an_embedded_sessions_calls_have_their_own_start_and_end(tmp_path: Path) -> None:
    script = [ScriptedTurn(calls=[ScriptedCall(name="quick", arguments={"x": 1}),
                                  ScriptedCall(name="slow", arguments={"seconds": 1.0})]),
              ScriptedTurn(text="Done.")]
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer(script) as server, Agent(Registry([quick, slow]), model="scripted",
                                                      base_url=server.base_url + "/v1", api_key="-",
                                                      event_log=log) as agent:
        assert agent.run("go", session_id="embedded-ui").stop_reason == "final"
    (turn,) = session_view(JsonlEventLog(tmp_path), "embedded-ui").turns
    fast, long = turn.calls
    spans = []
    for bar in (fast, long):
        assert bar.phase == "done" and bar.code == "ok" and bar.worker
        assert bar.started_at is not None and bar.finished_at is not None and bar.started_at < bar.finished_at
        spans.append((bar.started_at, bar.finished_at))
    (_, fast_end), (long_start, long_end) = spans
    # The quick call ended while the slow one still ran: its bar does not stretch to the turn's end.
    assert fast_end < long_end - 0.5
    assert long_end - long_start >= 0.9
