"""History repair: a log cut at every possible point (a crash) still gives a request the provider
accepts, with every call paired, deterministic repair results, and the repair logged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_request_builder_rebuild import (
    PROVIDERS,
    assert_provider_accepts,
    write_conversation,
)
from toolchord.orchestrator.event_stores import JsonlEventLog
from toolchord.orchestrator.events import CallResult, Transformation, encode_event
from toolchord.orchestrator.history_repair import History, plan_repair
from toolchord.orchestrator.request_builder import RequestBuilder, request_bytes
from toolchord.worker.models import ToolResult
from toolchord.worker.registry import Provider


def _copy_prefix(source: Path, target: Path, lines: int) -> None:
    target.mkdir(parents=True)
    data = source.read_bytes().splitlines(keepends=True)
    (target / "s.jsonl").write_bytes(b"".join(data[:lines]))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_log_cut_at_every_point_repairs_to_an_accepted_request(tmp_path: Path, provider: Provider) -> None:
    full = JsonlEventLog(tmp_path / "full")
    write_conversation(full, "s", provider)
    total = len(full.read("s"))
    source = full.path("s")
    for cut in range(3, total + 1):  # from the first user input on
        directory = tmp_path / f"cut{cut}"
        _copy_prefix(source, directory, cut)
        log = JsonlEventLog(directory)
        builder = RequestBuilder(log)
        first = builder.build_bytes("s")
        assert_provider_accepts(provider, builder.build("s"))
        events_after = log.read("s")
        # Idempotent: the repair was persisted once; building again changes neither log nor bytes.
        assert builder.build_bytes("s") == first
        assert len(log.read("s")) == len(events_after)
        history = History.from_events(events_after)
        assert all(not turn.missing() for turn in history.turns)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_torn_last_line_is_ignored(tmp_path: Path, provider: Provider) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", provider, turns=1)
    with open(log.path("s"), "ab") as handle:
        handle.write(b'{"type":"call_result","turn_id":"turn-1","res')
    request = RequestBuilder(log).build("s")
    assert_provider_accepts(provider, request)


def test_an_append_after_a_torn_line_starts_a_clean_line(tmp_path: Path) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", "chat", turns=1)
    before = log.read("s")
    with open(log.path("s"), "ab") as handle:
        handle.write(b'{"type":"call_result","turn_id":"turn-1","res')
    # A new process (no knowledge of the file) appends after the crash, then appends again.
    restarted = JsonlEventLog(tmp_path)
    assert restarted.append("s", before[0]) == len(before)
    assert restarted.append("s", before[1]) == len(before) + 1
    assert log.read("s") == [*before, before[0], before[1]]
    # The first instance sees the file changed behind its back and counts again.
    assert log.append("s", before[2]) == len(before) + 2


def _synthesized(log: JsonlEventLog) -> dict[str, ToolResult]:
    return {e.result.name: e.result for e in log.read("s") if isinstance(e, CallResult) and e.synthesized}


def test_undispatched_calls_get_not_executed(tmp_path: Path) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", "chat", turns=1, with_results=False)
    events = log.read("s")
    # Drop the dispatch record: the crash happened before the calls were handed to the runtime.
    log.path("s").write_text("".join(encode_event(e) + "\n" for e in events if e.type != "turn_dispatched"))
    RequestBuilder(log).build("s")
    codes = {name: r.error.code.value for name, r in _synthesized(log).items()}
    assert codes == {"lookup": "NOT_EXECUTED", "upsert": "NOT_EXECUTED", "charge": "NOT_EXECUTED"}


def test_dispatched_calls_without_end_get_outcome_unknown_or_aborted(tmp_path: Path) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", "chat", turns=1, with_results=False)
    request = RequestBuilder(log).build("s")
    results = _synthesized(log)
    assert results["charge"].error.code.value == "OUTCOME_UNKNOWN"  # unsafe: it may have charged
    assert results["lookup"].error.code.value == "ABORTED"
    assert results["upsert"].error.code.value == "ABORTED"
    for result in results.values():
        assert "do not retry blindly" in result.content.lower()
        assert "verify" in result.content.lower() or "check whether" in result.content.lower()
    tool_messages = [m for m in request["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [results[n].content for n in ("lookup", "upsert", "charge")]
    repairs = [e for e in log.read("s") if isinstance(e, Transformation) and e.kind == "repair"]
    assert len(repairs) == 1
    assert repairs[0].details["synthesized"] == {"call_001_0": "ABORTED", "call_001_1": "ABORTED",
                                                 "call_001_2": "OUTCOME_UNKNOWN"}
    assert repairs[0].range[0] <= repairs[0].range[1]


def test_repair_is_deterministic_across_logs(tmp_path: Path) -> None:
    outputs = []
    for name in ("a", "b"):
        log = JsonlEventLog(tmp_path / name)
        write_conversation(log, "s", "anthropic", turns=2, with_results=False)
        outputs.append(RequestBuilder(log).build_bytes("s"))
    assert outputs[0] == outputs[1]


def test_orphan_and_duplicate_results_are_left_out_and_logged(tmp_path: Path) -> None:
    log = JsonlEventLog(tmp_path)
    write_conversation(log, "s", "responses", turns=1)
    orphan = ToolResult(call_id="call_ghost", name="lookup", status="ok", content="boo")
    duplicate = ToolResult(call_id="call_001_0", name="lookup", status="ok", content="second answer")
    orphan_seq = log.append("s", CallResult(turn_id="turn-1", result=orphan))
    duplicate_seq = log.append("s", CallResult(turn_id="turn-1", result=duplicate))
    builder = RequestBuilder(log)
    request = builder.build("s")
    assert_provider_accepts("responses", request)
    text = request_bytes(request).decode()
    assert "call_ghost" not in text and "second answer" not in text
    repairs = [e for e in log.read("s") if isinstance(e, Transformation) and e.kind == "repair"]
    assert repairs and repairs[-1].details["dropped_results"] == [orphan_seq, duplicate_seq]
    assert plan_repair(History.from_events(log.read("s"))) == []  # reported once only
