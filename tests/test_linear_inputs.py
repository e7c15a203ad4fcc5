"""Every function that reads model-supplied text costs time linear in its size (hardening item 6).

Each is run on 1 MB and 10 MB of input shaped to hit its worst case (long runs of word characters,
credential words repeated, unclosed quotes, many deltas, many calls); `tests/linear_time.py`
compares the two CPU times, so a quadratic version fails (or is killed) instead of passing on a
fast machine. The size caps on arguments and result data are tested here as well.
"""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.linear_time import assert_linear
from toolchord.orchestrator.bench.inputs import hostile_text, responses_stream_events
from toolchord.orchestrator.events import CallParsed, CallResult, Event, ModelOutput
from toolchord.orchestrator.history_repair import History
from toolchord.orchestrator.pipeline import Pipeline, prepare_call
from toolchord.orchestrator.providers import get_adapter
from toolchord.worker import ErrorCode, Registry, ToolCall, tool
from toolchord.worker.errors import error_result
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.models import ToolError, ToolResult
from toolchord.worker.redaction import MASK, excerpt, redact, redact_text
from toolchord.worker.registry import Provider
from toolchord.worker.results import result_from_outcome
from toolchord.worker.shaping import cap_content

MIB = 1024 * 1024


@tool(side_effect="read", sandbox={"isolate": False})
def store_text(text: str, count: int = 0) -> str:
    """Take a text (in-process, for speed)."""
    return f"{len(text)}:{count}"


@tool(side_effect="read", sandbox={"isolate": False})
def numbers(values: list[int]) -> str:
    """Take numbers."""
    return str(sum(values))


REGISTRY = Registry([store_text, numbers])


def _truncated_arguments(size: int) -> str:
    """A JSON object cut off mid-string, like a model output that hit its token limit."""
    return '{"count": 1, "text": "' + hostile_text(size)[: size - 30].replace('"', "'").replace("\\", "/")


def _call(arguments_raw: str, name: str = "store_text") -> ToolCall:
    return ToolCall(id="call_1", name=name, arguments_raw=arguments_raw)


# --- redaction and excerpts -------------------------------------------------------------------


def test_redact_text_is_linear() -> None:
    assert_linear(redact_text, hostile_text)


def test_excerpt_of_a_long_string_is_linear_and_bounded() -> None:
    assert_linear(lambda text: excerpt(text), hostile_text)
    text = "password=hunter2 " + hostile_text(MIB)
    shown = excerpt(text, 300)
    assert "hunter2" not in shown and MASK in shown
    assert shown.endswith(f"… ({len(text)} chars)") and len(shown) < 340


def test_redact_of_a_large_structure_is_linear() -> None:
    def make(size: int) -> dict[str, Any]:
        chunk = hostile_text(10_000)
        return {"items": [{"note": chunk, "api_key": "k"} for _ in range(size // 10_000)]}

    assert_linear(redact, make)
    masked = redact(make(20_000))
    assert all(item["api_key"] == MASK for item in masked["items"])


# --- argument parsing, INVALID_JSON position, INVALID_ARGUMENTS ---------------------------------


def test_truncated_arguments_give_invalid_json_with_position_in_linear_time() -> None:
    def prepare(raw: str) -> object:
        return prepare_call(_call(raw), REGISTRY, "s", max_argument_bytes=64 * MIB)

    assert_linear(prepare, _truncated_arguments)
    result = prepare(_truncated_arguments(MIB))
    assert isinstance(result, ToolResult) and result.error.code == ErrorCode.INVALID_JSON
    assert re.search(r"Unterminated string starting at line 1 column \d+ \(char 21\)", result.error.message)
    assert len(result.content) < 1_000


def test_arguments_over_the_limit_are_refused_unparsed_with_size_and_limit() -> None:
    raw = json.dumps({"text": "x" * (2 * MIB)})
    result = prepare_call(_call(raw), REGISTRY, "s")
    assert isinstance(result, ToolResult) and result.error.code == ErrorCode.INVALID_ARGUMENTS
    assert f"{len(raw):,} bytes" in result.content and f"{MIB:,} bytes" in result.content
    assert "TOOLCHORD_MAX_ARGUMENT_BYTES" in result.content and "reference" in result.error.hint
    # Multi-byte characters count as the bytes they take, not as characters.
    wide = json.dumps({"text": "é" * (MIB // 2 + 10)}, ensure_ascii=False)
    assert len(wide) < MIB
    result = prepare_call(_call(wide), REGISTRY, "s")
    assert isinstance(result, ToolResult) and "too large" in result.error.message
    # The check happens before parsing, so even 10 MB of broken JSON costs next to nothing.
    assert_linear(lambda raw: prepare_call(_call(raw), REGISTRY, "s"), _truncated_arguments)
    # Within the limit, the same arguments run.
    assert Pipeline(REGISTRY, max_argument_bytes=4 * MIB).run(_call(raw)).content == f"{2 * MIB}:0"


def test_invalid_arguments_for_a_huge_value_is_linear_and_bounded() -> None:
    def prepare(raw: str) -> object:
        return prepare_call(_call(raw, "numbers"), REGISTRY, "s", max_argument_bytes=64 * MIB)

    assert_linear(prepare, lambda size: json.dumps({"values": hostile_text(size)}))
    many_wrong = json.dumps({"values": ["x"] * 5_000})
    result = prepare(many_wrong)
    assert isinstance(result, ToolResult) and result.error.code == ErrorCode.INVALID_ARGUMENTS
    assert "… and 4980 more fields with errors" in result.content and len(result.content) < 5_000


# --- output shaping and result data -----------------------------------------------------------


def test_cap_content_is_linear() -> None:
    assert_linear(lambda text: cap_content(text, 20_000, None), hostile_text)


def test_result_data_over_the_limit_is_a_clear_error_not_a_crash_or_a_cut() -> None:
    spec = REGISTRY["store_text"]
    data = {"rows": ["r" * 1000] * 2_000}
    outcome = HandlerOutcome(status="ok", content="2000 rows", data=data)
    result = result_from_outcome(_call("{}"), spec, outcome, attempts=1, spill=None, max_data_bytes=MIB)
    size = len(json.dumps(data, separators=(",", ":")))
    assert result.status == "error" and result.error.code == ErrorCode.EXECUTION_ERROR and result.data is None
    assert f"{size:,} bytes of JSON" in result.content and f"{MIB:,} bytes" in result.content
    assert "TOOLCHORD_MAX_RESULT_DATA_BYTES" in result.content and "did run" in result.error.hint
    assert result.content.endswith("Text output:\n2000 rows")
    small = result_from_outcome(_call("{}"), spec, outcome, attempts=1, spill=None, max_data_bytes=4 * MIB)
    assert small.status == "ok" and small.data == data

    def shape(size: int) -> HandlerOutcome:
        return HandlerOutcome(status="ok", content="", data={"blob": hostile_text(size)})

    assert_linear(lambda o: result_from_outcome(_call("{}"), spec, o, attempts=1, spill=None), shape)


# --- provider adapters ------------------------------------------------------------------------


def _chat_stream(size: int) -> list[dict[str, Any]]:
    raw = json.dumps({"text": hostile_text(size)})
    pieces = [raw[i:i + 1024] for i in range(0, len(raw), 1024)]
    first = {"index": 0, "id": "call_1", "function": {"name": "store_text", "arguments": ""}}
    events = [{"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]}]
    events += [{"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "call_1", "function": {"arguments": p}}]}}]}
               for p in pieces]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return events


def _anthropic_stream(size: int) -> list[dict[str, Any]]:
    raw = json.dumps({"text": hostile_text(size // 2)})
    text = hostile_text(size // 2)
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"role": "assistant", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ]
    events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text[i:i + 1024]}}
               for i in range(0, len(text), 1024)]
    events += [{"type": "content_block_stop", "index": 0},
               {"type": "content_block_start", "index": 1,
                "content_block": {"type": "tool_use", "id": "toolu_1", "name": "store_text", "input": {}}}]
    events += [{"type": "content_block_delta", "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": raw[i:i + 1024]}} for i in range(0, len(raw), 1024)]
    events.append({"type": "content_block_stop", "index": 1})
    return events


def _streamed(provider: Provider) -> Any:
    def run(events: list[dict[str, Any]]) -> list[ToolCall]:
        accumulator = get_adapter(provider).stream_accumulator()
        calls = [call for event in events for call in accumulator.feed(event)]
        calls += accumulator.finish()
        get_adapter(provider).parse_calls(accumulator.assistant_output())
        return calls

    return run


def test_chat_stream_and_parse_are_linear() -> None:
    assert_linear(_streamed("chat"), _chat_stream)
    (call,) = _streamed("chat")(_chat_stream(10_000))
    assert call.arguments is not None and len(call.arguments["text"]) == 10_000


def test_anthropic_stream_is_linear() -> None:
    assert_linear(_streamed("anthropic"), _anthropic_stream)


def testresponses_stream_events_is_linear() -> None:
    assert_linear(_streamed("responses"), responses_stream_events)
    (call,) = _streamed("responses")(responses_stream_events(10_000))
    assert call.arguments is not None and len(call.arguments["text"]) == 10_000


def _many_anthropic_calls(size: int) -> list[dict[str, Any]]:
    """One streamed tool_use block per 1 KB of `size`: 10,000 calls for 10 MB."""
    events: list[dict[str, Any]] = [{"type": "message_start", "message": {"role": "assistant", "content": []}}]
    for i in range(size // 1_000):
        block = {"type": "tool_use", "id": f"toolu_{i}", "name": "store_text", "input": {}}
        events += [{"type": "content_block_start", "index": i, "content_block": block},
                   {"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
                   {"type": "content_block_stop", "index": i}]
    return events


def _many_responses_calls(size: int) -> list[dict[str, Any]]:
    """One streamed function_call item per 1 KB of `size`: 10,000 calls for 10 MB."""
    events: list[dict[str, Any]] = []
    for i in range(size // 1_000):
        item = {"type": "function_call", "id": f"fc_{i}", "call_id": f"call_{i}", "name": "store_text", "arguments": ""}
        events += [{"type": "response.output_item.added", "output_index": i, "item": item},
                   {"type": "response.function_call_arguments.delta", "output_index": i, "delta": "{}"},
                   {"type": "response.function_call_arguments.done", "output_index": i}]
    return events


def test_streams_with_many_calls_are_linear_in_the_number_of_calls() -> None:
    assert_linear(_streamed("anthropic"), _many_anthropic_calls)
    assert_linear(_streamed("responses"), _many_responses_calls)
    cases: tuple[tuple[Provider, Any], ...] = (("anthropic", _many_anthropic_calls), ("responses", _many_responses_calls))
    for provider, make in cases:
        calls = _streamed(provider)(make(50_000))
        assert [call.index for call in calls] == list(range(50)), provider


def test_parse_calls_of_a_large_message_is_linear() -> None:
    def message(size: int) -> dict[str, Any]:
        raw = json.dumps({"text": hostile_text(size)})
        return {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "store_text", "arguments": raw}}]}

    assert_linear(get_adapter("chat").parse_calls, message)


# --- history repair ---------------------------------------------------------------------------


def _turn_events(size: int) -> list[Event]:
    """One turn with a call per 1 KB of `size`, each parsed and answered (many calls, not long ones)."""
    count = size // 1_000
    calls = [ToolCall(id=f"call_{i}", name="store_text", arguments_raw='{"text": "x"}', index=i) for i in range(count)]
    items = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_raw}} for c in calls]}]
    events: list[Event] = [ModelOutput(provider="chat", model="m", turn_id="t", output=None, items=items,
                                        call_ids=[c.id for c in calls])]
    events += [CallParsed(turn_id="t", call=c, side_effect="read") for c in calls]
    events += [CallResult(turn_id="t", result=ToolResult(call_id=c.id, name=c.name, status="ok", content="ok"))
               for c in calls]
    return events


def test_history_of_a_turn_with_many_calls_is_linear() -> None:
    history = History.from_events(_turn_events(100_000))
    assert not history.orphans and len(history.turns[0].results) == 100
    assert_linear(History.from_events, _turn_events)


# --- properties -------------------------------------------------------------------------------

# The key=value pattern before it was made linear: the reference for what it must still match.
_QUADRATIC_KEY_VALUE = re.compile(
    r"""(?ix)
    (?P<key>["']?[\w.-]*(pass(word|wd)?|secret|token|api[-_]?key|apikey|credential)[\w.-]*["']?)
    (?P<sep>\s*[:=]\s*)
    (?P<value>"[^"]*"|'[^']*'|[^\s,;&}]+)
    """
)
_PIECES = st.sampled_from(["token", "pass", "password", "api_key", "secret", "=", ":", " ", '"', "'", ",", "x",
                           "-", ".", "_", "é", "1", "}", ";", "\n", "sk-", "Bearer "])
_SECRET = st.text(alphabet="ABCDEFGHJKLMNPQRSTUVWXYZ23456789", min_size=12, max_size=24)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_PIECES, max_size=40).map("".join))
def test_linear_key_value_pattern_masks_what_the_quadratic_one_did(text: str) -> None:
    """Everything the old pattern masked is still masked (the new output has no more raw values)."""
    old = _QUADRATIC_KEY_VALUE.sub(lambda m: f"{m['key']}{m['sep']}{MASK}", text)
    new = redact_text(text)
    assert len(re.sub(re.escape(MASK), "", new)) <= len(re.sub(re.escape(MASK), "", old))


# Around a planted secret: no quotes, and a delimiter before it, since a value is read up to the next
# delimiter ("token= token: 'x'" masks "token:" and leaves 'x', with the old pattern as with this one).
_PLAIN_PIECES = st.sampled_from(["token", "pass", "api_key", "=", ":", " ", ",", "x", "-", ".", "é", "1", "}", "\n"])


@settings(max_examples=200, deadline=None)
@given(before=st.lists(_PLAIN_PIECES, max_size=20).map("".join), after=st.lists(_PLAIN_PIECES, max_size=20).map("".join),
       secret=_SECRET, form=st.sampled_from(['password={}', '"api_key": "{}"', 'Bearer {}', '"session_id": "{}"',
                                            "https://user:{}@host", "token: '{}'"]))
def test_planted_secrets_never_reach_an_excerpt(before: str, after: str, secret: str, form: str) -> None:
    text = f"{before}; {form.format(secret)} {after}"
    assert secret not in redact_text(text)
    assert secret not in excerpt(text, 10_000)
    assert secret not in excerpt(text + " " + "y" * 20_000, 10_000)  # the unparsed head-window path


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400), st.integers(min_value=1, max_value=200))
def test_excerpts_are_bounded_and_encodable(text: str, limit: int) -> None:
    for raw in (text, text * 50):
        shown = excerpt(raw, limit)
        assert len(shown) <= limit + len(f"… ({len(raw)} chars)")
        shown.encode("utf-8")
        error_result(_call(raw), ToolError(code=ErrorCode.INVALID_JSON, message="m", input_excerpt=shown))


def test_input_benchmark_runs(capsys: Any) -> None:
    from toolchord.orchestrator.bench.inputs import CASES, main

    main(["--sizes", "0.01,0.02"])
    out = capsys.readouterr().out
    assert all(name in out for name in CASES)


def test_size_and_call_caps_come_from_the_environment() -> None:
    from toolchord.worker.config import Settings

    defaults = Settings.from_env({})
    assert (defaults.max_argument_bytes, defaults.max_result_data_bytes, defaults.max_calls_per_turn) == (MIB, MIB, 128)
    settings = Settings.from_env({"TOOLCHORD_MAX_ARGUMENT_BYTES": "2048", "TOOLCHORD_MAX_RESULT_DATA_BYTES": "4096",
                                  "TOOLCHORD_MAX_CALLS_PER_TURN": "7"})
    assert (settings.max_argument_bytes, settings.max_result_data_bytes, settings.max_calls_per_turn) == (2048, 4096, 7)
