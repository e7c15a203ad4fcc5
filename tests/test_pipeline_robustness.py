"""Whatever the model sends, the pipeline answers each call with exactly one well-formed result:
property tests over arbitrary bytes and JSON, pathological nesting and escapes, unions, secrets,
and the streamed forms of broken arguments."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, SecretStr

from tests import pipeline_tools as t
from toolchord.orchestrator.pipeline import Pipeline
from toolchord.orchestrator.providers import get_adapter
from toolchord.worker import ErrorCode, Provider, Registry, ToolCall, ToolResult, tool


@tool(side_effect="read", sandbox={"isolate": False})
def lookup(name: str, limit: int = 3, exact: bool = False) -> str:
    """Look a name up (in-process, for speed)."""
    return f"{name[:20]}:{limit}:{exact}"


@tool(side_effect="read", sandbox={"isolate": False})
def choose(value: int | str, maybe: int | None = None, items: list[int | bool] = []) -> str:  # noqa: B006 - a list default, as a model would declare
    """Take a union."""
    return repr(value)


@tool(side_effect="read", sandbox={"isolate": False})
def anything(payload: Any) -> str:
    """Accept any JSON."""
    return "accepted"


@tool(side_effect="read", sandbox={"isolate": False})
def connect(host: str, api_key: SecretStr, port: int = 443) -> str:
    """Connect with a key (returns only its length)."""
    return f"{host}:{port} key of {len(api_key.get_secret_value())} chars, ends {api_key.get_secret_value()[-3:]}"


FAST = Pipeline(Registry([lookup, choose, anything, connect, t.echo]))


def _one_result(raw: str, name: str = "lookup") -> ToolResult:
    output = {"role": "assistant", "tool_calls": [{"id": "call_p", "type": "function",
                                                   "function": {"name": name, "arguments": raw}}]}
    (call,) = get_adapter("chat").parse_calls(output)
    assert call.arguments_raw == raw
    results = FAST.run_all([call], "sess-prop")
    assert len(results) == 1
    (result,) = results
    assert result.call_id == "call_p" and result.content
    assert result.status in ("ok", "error")
    # Results cross process boundaries as JSON: every one must survive the trip.
    assert ToolResult.model_validate_json(result.model_dump_json()).content == result.content
    rendered = get_adapter("chat").result_items(results)
    assert [item["tool_call_id"] for item in rendered] == ["call_p"]
    return result


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


def _splice(data: bytes, at: int, insert: bytes, drop: int) -> bytes:
    at %= len(data) + 1
    return data[:at] + insert + data[at + drop:]


# Random bytes are almost never JSON; half the examples are JSON for the tool, damaged a little,
# so the later stages (validation, handler, shaping) see arbitrary input too.
_json_bytes = st.builds(
    lambda name, rest: json.dumps({"name": name, **rest}, ensure_ascii=False).encode(),
    _json_values,
    st.dictionaries(st.sampled_from(["limit", "exact", "api_key", "extra"]), _json_values, max_size=3),
)
_byte_strings = st.binary(max_size=300) | _json_bytes | st.builds(
    _splice, _json_bytes, st.integers(0, 400), st.binary(max_size=4), st.integers(0, 3)
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_byte_strings)
def test_any_bytes_as_utf8_yield_one_result(data: bytes) -> None:
    _one_result(data.decode("utf-8", errors="replace"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_byte_strings)
def test_any_bytes_as_latin1_yield_one_result(data: bytes) -> None:
    _one_result(data.decode("latin-1"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["name", "limit", "exact", "password", "x"]) | st.text(max_size=6),
                       _json_values, max_size=5))
def test_any_json_object_yields_one_result(arguments: dict[str, Any]) -> None:
    result = _one_result(json.dumps(arguments))
    if result.status == "ok":
        assert result.content.startswith(str(arguments["name"])[:20])
    else:
        assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS


def test_deeply_nested_arguments_are_answered() -> None:
    depth = 5000
    raw = '{"name": ' + "[" * depth + "]" * depth + "}"
    result = _one_result(raw)
    assert result.error is not None and result.error.code is ErrorCode.INVALID_JSON
    nested = '{"name": ' + "[" * 900 + "]" * 900 + "}"
    result = _one_result(nested)
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    assert "- name: Input should be a valid string" in result.content
    # Valid for `Any`, but deeper than pydantic will serialize for the trip to the worker.
    result = _one_result('{"payload": ' + "[" * 900 + "]" * 900 + "}", "anything")
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    assert "nested too deeply" in result.content
    assert _one_result('{"payload": ' + "[" * 50 + "]" * 50 + "}", "anything").content == "accepted"


def test_lone_surrogate_escapes_are_answered() -> None:
    # A lone surrogate is not Unicode: the arguments could not reach the sandbox or a worker.
    for raw, name in (('{"name": "ok", "limit": "\\ud800"}', "lookup"), ('{"text": "a\\udc00b"}', "echo")):
        broken = _one_result(raw, name)
        assert broken.error is not None and broken.error.code is ErrorCode.INVALID_JSON
        assert "lone surrogate (\\udc00)" in broken.content or "lone surrogate (\\ud800)" in broken.content
    pair = _one_result('{"text": "\\ud83d\\ude00"}', "echo")
    assert (pair.status, pair.content) == ("ok", "\U0001F600")


def test_union_alternatives_share_one_line_per_field() -> None:
    result = _one_result(json.dumps({"value": [1], "maybe": "x", "items": [1, "q", {}]}), "choose")
    assert result.error is not None
    lines = [line for line in result.error.message.splitlines() if line.startswith("- ")]
    fields = [line.split(":", 1)[0].removeprefix("- ") for line in lines]
    assert fields == ["value", "maybe", "items.1", "items.2"]
    assert lines[0] == "- value: Input should be a valid integer; or Input should be a valid string (got [1])"


class Address(BaseModel):
    street: str
    city: str


@tool(side_effect="idempotent", sandbox={"isolate": False})
def create_contact(name: str, address: Address, tags: list[str]) -> str:
    """Create a contact."""
    return name


def test_nested_missing_field_names_its_path() -> None:
    pipeline = Pipeline(Registry([create_contact]))
    call = ToolCall(id="c1", name="create_contact", arguments_raw=json.dumps(
        {"name": "Ada", "address": {"street": "1 Loop"}, "tags": "vip"}))
    result = pipeline.run(call)
    assert result.error is not None
    assert "- address.city: required field is missing" in result.content
    assert "- tags: Input should be a valid list (got vip)" in result.content


def test_secret_str_argument_reaches_the_handler_and_nowhere_else() -> None:
    key = "sk-proj-Z9y8X7w6V5u4T3s2R1q0"
    ok = _one_result(json.dumps({"host": "db.internal", "api_key": key}), "connect")
    assert (ok.status, ok.content) == ("ok", f"db.internal:443 key of {len(key)} chars, ends {key[-3:]}")
    bad = _one_result(json.dumps({"host": "db.internal", "api_key": key, "port": "https"}), "connect")
    assert bad.error is not None and bad.error.code is ErrorCode.INVALID_ARGUMENTS
    assert key not in bad.model_dump_json()


def test_failing_permission_hook_does_not_stop_other_calls() -> None:
    def hook(call: ToolCall, spec: Any) -> bool:
        if call.name == "echo":
            raise ConnectionError("policy server down")
        return True

    pipeline = Pipeline(Registry([lookup, t.echo]), permission_hook=hook)
    calls = [ToolCall(id="a", name="echo", arguments_raw='{"text": "x"}', index=0),
             ToolCall(id="b", name="lookup", arguments_raw='{"name": "y"}', index=1)]
    first, second = pipeline.run_all(calls)
    assert first.error is not None and first.error.code is ErrorCode.PERMISSION_DENIED
    assert "policy server down" not in first.content
    assert second.status == "ok"


# --- streamed calls with broken arguments ---------------------------------------------------------


def test_anthropic_streamed_invalid_json_becomes_invalid_json_result() -> None:
    accumulator = get_adapter("anthropic").stream_accumulator()
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "msg_s", "type": "message", "role": "assistant",
                                              "content": [], "model": "m", "usage": {"input_tokens": 1}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "tool_use", "id": "toolu_bad", "name": "lookup", "input": {}}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": '{"name": "ad'}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": 'a", "limit": 2,'}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_good", "name": "lookup", "input": {}}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '{"name": "bob"}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
    ]
    calls = [call for event in events for call in accumulator.feed(event)] + accumulator.finish()
    assert [c.id for c in calls] == ["toolu_bad", "toolu_good"]
    assert calls[0].arguments is None and calls[0].arguments_raw == '{"name": "ada", "limit": 2,'
    # The assembled message reads back to the same calls (what the log and the next request hold).
    assert get_adapter("anthropic").parse_calls(accumulator.assistant_output()) == calls
    results = FAST.run_all(calls, "sess-stream")
    assert results[0].error is not None and results[0].error.code is ErrorCode.INVALID_JSON
    assert "Input: {\"name\": \"ada\", \"limit\": 2," in results[0].content
    assert (results[1].status, results[1].content) == ("ok", "bob:3:False")
    (message,) = get_adapter("anthropic").result_items(results)
    assert [(b["tool_use_id"], b["is_error"]) for b in message["content"]] == [("toolu_bad", True), ("toolu_good", False)]


@pytest.mark.parametrize("provider", ["chat", "responses"])
def test_streamed_truncated_arguments_become_invalid_json(provider: Provider) -> None:
    accumulator = get_adapter(provider).stream_accumulator()
    if provider == "chat":
        events: list[dict[str, Any]] = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
                {"index": 0, "id": "call_s", "type": "function", "function": {"name": "lookup", "arguments": ""}}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"name": '}}]}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        ]
    else:
        events = [
            {"type": "response.output_item.added", "output_index": 0,
             "item": {"type": "function_call", "id": "fc_1", "call_id": "call_s", "name": "lookup", "arguments": ""}},
            {"type": "response.function_call_arguments.delta", "output_index": 0, "item_id": "fc_1", "delta": '{"name": '},
        ]
    calls = [call for event in events for call in accumulator.feed(event)] + accumulator.finish()
    (call,) = calls
    (result,) = FAST.run_all(calls)
    assert result.call_id == "call_s"
    assert result.error is not None and result.error.code is ErrorCode.INVALID_JSON


def test_handler_text_with_lone_surrogates_is_still_one_ok_result() -> None:
    from toolchord.orchestrator import Pipeline
    from toolchord.worker import Registry, ToolCall, tool

    @tool(side_effect="read", sandbox={"isolate": False})
    def broken_text() -> str:
        """Return text that is not valid Unicode."""
        return "before \ud800 after"

    result = Pipeline(Registry([broken_text])).run(ToolCall(id="c1", name="broken_text", arguments_raw="{}"))
    assert result.status == "ok"
    assert result.content == "before \ufffd after"
    result.model_dump_json()


def test_a_failing_policy_function_is_a_result_not_an_exception() -> None:
    from toolchord.orchestrator import Pipeline
    from toolchord.worker import ErrorCode, Registry, ToolCall, tool

    @tool(side_effect="read", sandbox={"isolate": False}, resource=lambda args: args["missing"])
    def locked(path: str) -> str:
        """Touch a path."""
        return path

    registry = Registry([locked])
    result = Pipeline(registry).run(ToolCall(id="c1", name="locked", arguments_raw='{"path": "a"}'))
    assert result.error is not None and result.error.code == ErrorCode.EXECUTION_ERROR
    assert "policy function failed" in result.content
    assert "read_output" not in registry  # the caller's registry is not modified


def test_embedded_stores_stay_bounded() -> None:
    import time as _time

    from toolchord.orchestrator.turn import TurnRecord, TurnResult
    from toolchord.orchestrator.turn_store import MemoryTurnStore
    from toolchord.worker.idempotency import MemoryIdempotencyStore

    turns = MemoryTurnStore(max_finished=3)
    for i in range(10):
        record = TurnRecord(session_id="s", turn_id=f"t{i}", provider="chat", calls=[], deadline=0)
        turns.save(record)
        turns.finish(record, TurnResult(session_id="s", turn_id=f"t{i}", provider="chat", calls=[], results=[]))
    assert turns.find("s", "t0")[0] is None and turns.find("s", "t9")[0] is not None
    assert len(turns._records) == len(turns._results) == 3

    store = MemoryIdempotencyStore()
    for i in range(store._SWEEP_EVERY):
        store.cancel(f"k{i}", ttl=0)  # expires at once; nobody reads it again
    _time.sleep(0.01)
    store.cancel("last", ttl=60)
    for i in range(store._SWEEP_EVERY - 1):
        store.cancel(f"again{i}", ttl=60)
    assert len(store._values) < store._SWEEP_EVERY * 2
