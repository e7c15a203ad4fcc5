"""A result that arrives after its turn ended reaches the model in the next request (issue 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_request_builder_rebuild import PROVIDERS, REGISTRY, assert_provider_accepts, write_conversation
from toolchord.orchestrator.event_stores import JsonlEventLog
from toolchord.orchestrator.recorder import SessionRecorder
from toolchord.orchestrator.request_builder import RequestBuilder
from toolchord.worker.models import ToolResult
from toolchord.worker.registry import Provider


@pytest.mark.parametrize("provider", PROVIDERS)
def test_late_result_is_a_note_after_the_turns_results(tmp_path: Path, provider: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", provider, turns=1)
    before = RequestBuilder(log).build("s")
    late = ToolResult(call_id="call-early", name="lookup", status="ok", content="found 3 invoices")
    SessionRecorder(log, "s", REGISTRY).result("turn-1", late, late=True)
    request = RequestBuilder(log).build("s")
    assert_provider_accepts(provider, request)
    body = RequestBuilder(log).build_bytes("s")
    assert b"found 3 invoices" in body and b"call-early" in body
    # Only appended: everything before the note is unchanged (prompt caches keep their prefix).
    key = "input" if provider == "responses" else "messages"
    if provider == "anthropic":
        # Anthropic turns alternate, so the note joins the tool_result message as a trailing block.
        assert request[key][:-1] == before[key][:-1]
        assert request[key][-1]["content"][:-1] == before[key][-1]["content"]
    else:
        assert request[key][:-1] == before[key]
    last = request[key][-1]
    text = last["content"] if isinstance(last["content"], str) else last["content"][-1]["text"]
    assert "finished after its turn had ended" in text


@pytest.mark.parametrize("provider", PROVIDERS)
def test_late_results_are_rendered_in_the_models_call_order(tmp_path: Path, provider: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", provider, turns=2)
    history = RequestBuilder(log).history("s")
    order = [(turn.turn_id, call) for turn in history.turns for call in turn.calls]
    assert len(order) >= 3
    recorder = SessionRecorder(log, "s", REGISTRY)
    # Found (and logged) in another order than the model's, as a Redis hash hands them out.
    for turn_id, call in reversed(order):
        recorder.result(turn_id, ToolResult(call_id=call.id, name=call.name, status="ok", content=f"late {call.id}"),
                        late=True)
    body = RequestBuilder(log).build_bytes("s").decode()
    positions = [body.index(f"late {call.id}") for _, call in order]
    assert positions == sorted(positions)
