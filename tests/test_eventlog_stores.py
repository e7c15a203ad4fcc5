"""The event log stores (JSONL file, Redis Streams) and what the recorder writes into them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_request_builder_rebuild import REGISTRY, write_conversation
from toolchord.orchestrator.event_stores import EventLog, JsonlEventLog, RedisEventLog
from toolchord.orchestrator.events import CallParsed, ModelOutput, Transformation, UserInput
from toolchord.orchestrator.recorder import SessionRecorder
from toolchord.orchestrator.stores import open_event_log


@pytest.fixture(params=["jsonl", "redis"])
def log(request: pytest.FixtureRequest, tmp_path: Path) -> EventLog:
    if request.param == "jsonl":
        return JsonlEventLog(tmp_path)
    store = RedisEventLog(request.getfixturevalue("redis_url"))
    for key in store.redis.scan_iter(match=store.prefix + "*"):
        store.redis.delete(key)
    return store


def test_append_returns_positions_and_read_keeps_order(log: EventLog) -> None:
    seqs = [log.append("s", UserInput(text=f"m{i}")) for i in range(5)]
    assert seqs == [0, 1, 2, 3, 4]
    assert [e.text for e in log.read("s")] == [f"m{i}" for i in range(5)]
    assert log.read("other") == []
    log.append("other", UserInput(text="x"))
    assert log.sessions() == ["other", "s"]


def test_redis_log_reads_past_one_page(redis_url: str) -> None:
    log = RedisEventLog(redis_url)
    log.redis.delete(log.key("long"))
    for i in range(2105):
        log.append("long", UserInput(text=str(i)))
    assert [e.text for e in log.read("long")] == [str(i) for i in range(2105)]


def test_redis_log_is_a_stream(redis_url: str) -> None:
    log = RedisEventLog(redis_url)
    log.redis.delete(log.key("st"))
    log.append("st", UserInput(text="hello"))
    assert log.redis.type(log.key("st")) == b"stream"
    [(_, fields)] = log.redis.xrange(log.key("st"))
    assert json.loads(fields[b"e"])["text"] == "hello"


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".", "x" * 300])
def test_session_ids_cannot_escape(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        JsonlEventLog(tmp_path).append(bad, UserInput(text="x"))


def test_jsonl_is_the_embedded_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOOLCHORD_BROKER_URL", raising=False)
    monkeypatch.delenv("TOOLCHORD_REDIS_URL", raising=False)
    monkeypatch.setenv("TOOLCHORD_LOG_DIR", str(tmp_path / "logs"))
    log = open_event_log()
    assert isinstance(log, JsonlEventLog)
    log.append("s", UserInput(text="x"))
    assert (tmp_path / "logs" / "s.jsonl").exists()


def test_redis_streams_when_distributed(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLCHORD_BROKER_URL", redis_url)
    assert isinstance(open_event_log(), RedisEventLog)


def test_secrets_are_redacted_before_writing_and_the_redaction_is_logged(log: EventLog) -> None:
    write_conversation(log, "s", "chat")
    raw = "\n".join(e.model_dump_json() for e in log.read("s"))
    assert "hunter22" not in raw  # user input
    assert "abc123" not in raw  # tool result content
    assert "sk-abcdefghijklmnopqrstu" not in raw  # tool arguments
    redactions = [e for e in log.read("s") if isinstance(e, Transformation) and e.kind == "redaction"]
    assert redactions
    events = log.read("s")
    for redaction in redactions:
        first, last = redaction.range
        assert first == last and events[first].type in ("user_input", "model_output", "call_parsed", "call_result")


def test_raw_arguments_are_kept_only_where_the_tool_allows(log: EventLog) -> None:
    write_conversation(log, "s", "chat", turns=1)
    parsed = {e.call.name: e for e in log.read("s") if isinstance(e, CallParsed)}
    assert parsed["upsert"].raw_stored and parsed["upsert"].call.arguments_raw == '{"key": "b", "value": '
    charge = parsed["charge"]
    assert not charge.raw_stored
    assert charge.call.arguments == {"account": "acme", "amount": 5, "api_key": "[REDACTED]"}
    assert json.loads(charge.call.arguments_raw) == charge.call.arguments
    output = next(e for e in log.read("s") if isinstance(e, ModelOutput))
    stored_arguments = [c["function"]["arguments"] for c in output.items[0]["tool_calls"]]
    assert stored_arguments[2] == charge.call.arguments_raw  # the same withheld form in the items
    assert "sk-abcdefghijklmnopqrstu" not in json.dumps(output.output)


def test_reasoning_is_stored_verbatim(tmp_path: Path) -> None:
    log = JsonlEventLog(tmp_path)
    recorder = SessionRecorder(log, "s", REGISTRY)
    items = [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "the token=abc is in the doc", "signature": "c2lnbmF0dXJl"},
        {"type": "text", "text": "use password=hunter22"},
    ]}]
    recorder.model_output("anthropic", "m", "t1", {"content": items[0]["content"]}, items, [])
    [stored] = [e for e in log.read("s") if isinstance(e, ModelOutput)]
    assert stored.items[0]["content"][0] == items[0]["content"][0]  # signed: byte for byte
    assert "hunter22" not in json.dumps(stored.items)
