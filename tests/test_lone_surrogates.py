"""A lone surrogate escape ("\\ud800") in a non-streamed model reply, in its text or in a call's
arguments, as each provider's API sends it: the turn goes on, the text is repaired (U+FFFD), the
call is answered INVALID_JSON without running, and the log and the rebuilt request stay valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolchord import Agent, JsonlEventLog, Registry, SandboxProfile, tool
from toolchord.orchestrator.events import CallParsed, ModelOutput
from toolchord.orchestrator.request_builder import RequestBuilder
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import ErrorCode
from toolchord.worker.registry import Provider

NOTES: list[str] = []


@tool(side_effect="unsafe", sandbox=SandboxProfile(isolate=False))
def note(note: str) -> str:
    """Write a note."""
    NOTES.append(note)
    return "noted"


@pytest.mark.parametrize("provider", ["chat", "anthropic", "responses"])
def test_a_lone_surrogate_in_a_reply_is_repaired_or_answered_invalid_json(tmp_path: Path, provider: Provider) -> None:
    NOTES.clear()
    script = [ScriptedTurn(text="Writing \ud83d", calls=[ScriptedCall(name="note", arguments={"note": "B\ud800"})]),
              ScriptedTurn(text="Done \ud83d.")]
    log = JsonlEventLog(tmp_path)
    with ScriptedModelServer(script) as server:
        base = server.base_url if provider == "anthropic" else server.base_url + "/v1"
        with Agent(Registry([note]), model="scripted", provider=provider, base_url=base, api_key="-",
                   event_log=log) as agent:
            result = agent.run("note it", session_id="lone")
            second = server.requests[1].body
    assert result.stop_reason == "final" and result.text == "Done \ufffd."
    first = result.steps[0]
    assert first.text == "Writing \ufffd"
    (answer,) = first.results
    assert answer.error is not None and answer.error.code == ErrorCode.INVALID_JSON
    assert "surrogate" in answer.content and NOTES == []
    events = log.read("lone")
    (parsed,) = [e for e in events if isinstance(e, CallParsed)]
    assert parsed.call.arguments is None and "\\ud800" in parsed.call.arguments_raw
    assert len([e for e in events if isinstance(e, ModelOutput)]) == 2
    # The request sent after the call, and any rebuild of it, is valid JSON again.
    assert "Writing \ufffd" in str(second)
    RequestBuilder(log).build_bytes("lone")
