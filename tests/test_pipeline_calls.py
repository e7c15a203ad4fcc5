"""The in-process pipeline, call by call, for every provider: parse → look up → validate →
permission → sandboxed run → shape → render, checking that rendered items pair with the call ids."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from tests import pipeline_tools as t
from toolchord.orchestrator.pipeline import Pipeline
from toolchord.orchestrator.providers import get_adapter
from toolchord.worker import ErrorCode, Registry, ToolCall, ToolSpec, tool
from toolchord.worker.idempotency import idempotency_key
from toolchord.worker.registry import Provider
from toolchord.worker.shaping import EMPTY_PLACEHOLDER

pytestmark = pytest.mark.parametrize("provider", t.PROVIDER_IDS)


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    return t.make_pipeline()


def test_normal_call(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "read_file", {"path": "/etc/motd", "max_lines": 3})
    assert result.status == "ok", result.content
    assert result.content == "contents of /etc/motd (3 lines)"
    assert result.error is None and result.truncated is None
    assert result.attempts == 1 and result.duration_ms > 0


def test_default_argument_is_applied(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "read_file", {"path": "notes.txt"})
    assert result.content == "contents of notes.txt (100 lines)"


def test_unknown_tool_lists_available_tools_closest_first(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "read_fil", {"path": "x"})
    assert result.status == "error" and result.error is not None
    assert result.error.code is ErrorCode.UNKNOWN_TOOL
    assert result.content.startswith("UNKNOWN_TOOL: there is no tool named 'read_fil'")
    listed = re.search(r"Available tools: (.*)\.", result.content)
    assert listed is not None
    names = listed.group(1).split(", ")
    assert names[0] == "read_file"
    assert sorted(names) == sorted(pipeline.registry.names)
    assert "did you mean 'read_file'" in result.content


def test_invalid_json_names_the_position(pipeline: Pipeline, provider: Provider) -> None:
    raw = '{"path": "a.txt", "max_lines": 3'
    result = t.run_one(pipeline, provider, "read_file", raw)
    assert result.error is not None and result.error.code is ErrorCode.INVALID_JSON
    assert "line 1 column" in result.content and "(char " in result.content
    assert result.error.input_excerpt == raw
    assert "Fix: Send the arguments as one JSON object" in result.content


@pytest.mark.parametrize("raw", ["[1, 2]", '"just text"', "42", "null"])
def test_json_that_is_not_an_object_is_invalid_json(pipeline: Pipeline, provider: Provider, raw: str) -> None:
    result = t.run_one(pipeline, provider, "read_file", raw)
    assert result.error is not None and result.error.code is ErrorCode.INVALID_JSON
    assert "expected an object" in result.content


def test_nan_is_not_json(pipeline: Pipeline, provider: Provider) -> None:
    # The provider adapters read NaN as "not JSON"; the pipeline must agree, or the history
    # rebuilt from the log would show different arguments from the ones that ran.
    result = t.run_one(pipeline, provider, "echo", '{"text": "a", "times": NaN}')
    assert result.error is not None and result.error.code is ErrorCode.INVALID_JSON
    assert "NaN" in result.content


@pytest.mark.parametrize(("raw", "field"), [
    ('{"factor": 1e400}', "factor"),
    ('{"factor": 2, "tags": {"limits": [1, -1e400]}}', "tags.limits.1"),
])
def test_numbers_too_large_for_a_float_are_invalid_arguments(
    pipeline: Pipeline, provider: Provider, raw: str, field: str
) -> None:
    # JSON has no size limit on numbers; 1e400 reads as infinity, which no tool can use.
    result = t.run_one(pipeline, provider, "scale", raw)
    # Anthropic's arguments arrive as an object, where the number is already infinity: the same answer.
    assert result.error is not None and result.attempts == 0, result
    assert result.error.code is ErrorCode.INVALID_ARGUMENTS, result
    assert f"- {field}:" in result.content and "finite" in result.content, result.content


def test_missing_field(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "write_file", {"path": "a.txt"})
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    assert "- text: required field is missing" in result.content
    assert "path" not in result.error.message.split("\n", 1)[1]


def test_extra_field(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "read_file", {"path": "a", "encoding": "utf-8"})
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    assert "- encoding: unexpected field (not a parameter of this tool)" in result.content


def test_wrong_types_one_line_per_field(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "read_file", {"path": ["a", "b"], "max_lines": "many"})
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    lines = [line for line in result.error.message.splitlines() if line.startswith("- ")]
    assert len(lines) == 2
    assert lines[0].startswith("- path: Input should be a valid string")
    assert lines[1].startswith("- max_lines: Input should be a valid integer")
    assert "(got many)" in lines[1]


def test_handler_exception_is_execution_error(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "explode", {"reason": "too hot"})
    assert result.error is not None and result.error.code is ErrorCode.EXECUTION_ERROR
    assert result.content.startswith("EXECUTION_ERROR: 'explode' failed: ValueError: disk on fire: too hot")
    assert result.attempts == 1


def test_empty_output_gets_a_placeholder(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "silent", {})
    assert (result.status, result.content) == ("ok", EMPTY_PLACEHOLDER)


def test_huge_output_is_cut_and_readable_page_by_page(pipeline: Pipeline, provider: Provider) -> None:
    full = t.flood_text()
    result = t.run_one(pipeline, provider, "flood", {})
    assert result.status == "ok"
    assert len(result.content) <= t.flood.max_output_chars
    assert result.truncated is not None
    assert result.truncated.original_chars == len(full) == t.FLOOD_CHARS
    assert result.content.startswith("HEAD-MARKER") and result.content.endswith("TAIL-MARKER")
    notice = re.search(
        r"\[… (\d+) of (\d+) characters cut from the middle; "
        r'read the rest with read_output\(ref="(out_\w+)", offset=(\d+)\) …\]',
        result.content,
    )
    assert notice is not None, result.content
    cut, original, ref, offset = int(notice[1]), int(notice[2]), notice[3], int(notice[4])
    assert original == len(full) and ref == result.truncated.spill_ref
    head = result.content[: notice.start()].removesuffix("\n")
    tail = result.content[notice.end():].removeprefix("\n")
    assert full.startswith(head) and full.endswith(tail)
    assert offset == len(head) and cut == len(full) - len(head) - len(tail)

    def page_through(start: int) -> str:
        text, position, n = "", start, 100
        while True:
            n += 1
            page = t.run_one(pipeline, provider, "read_output", {"ref": ref, "offset": position}, n=n)
            assert page.status == "ok", page.content
            header, _, body = page.content.partition("\n")
            span = re.match(r"\[characters (\d+)-(\d+) of (\d+)\.", header)
            assert span is not None and int(span[1]) == position and int(span[3]) == len(full)
            text += body
            position = int(span[2])
            if header.endswith("This is the end.]"):
                return text
            assert f"offset={position}" in header

    assert page_through(0) == full
    # Reading on from where the notice points completes the head without overlap.
    assert head + page_through(offset) == full


def test_read_output_with_unknown_ref_says_so(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "read_output", {"ref": "out_nope"})
    assert result.error is not None and result.error.code is ErrorCode.EXECUTION_ERROR
    assert "no stored output 'out_nope'" in result.content


SECRET_ARGS = {
    "username": "ada",
    "password": t.SECRETS[0],
    "api_key": t.SECRETS[1],
    "retries": "Bearer " + t.SECRETS[2],
    "note": "Authorization: Bearer " + t.SECRETS[2],
}


def _no_secret_in(result_text: str) -> None:
    for secret in t.SECRETS:
        assert secret not in result_text


def test_secrets_never_appear_in_validation_errors(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "login", SECRET_ARGS)
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    assert "- retries:" in result.content and "- note: unexpected field" in result.content
    _no_secret_in(result.content)
    _no_secret_in(result.error.model_dump_json())
    assert "[REDACTED]" in (result.error.input_excerpt or "")


def test_secret_field_with_wrong_type_is_not_echoed(pipeline: Pipeline, provider: Provider) -> None:
    # A password that is not a string is still a password: the per-field line must not show it.
    args = {"username": "ada", "password": 48151623, "api_key": ["sk", "hunter2-very-secret"]}
    result = t.run_one(pipeline, provider, "login", args)
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    assert "- password:" in result.content and "- api_key:" in result.content
    assert "48151623" not in result.content
    _no_secret_in(result.error.model_dump_json())


def test_secrets_never_appear_with_an_unknown_tool(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "log_in", SECRET_ARGS)
    assert result.error is not None and result.error.code is ErrorCode.UNKNOWN_TOOL
    _no_secret_in(result.error.model_dump_json())


def test_secrets_never_appear_in_invalid_json_excerpts(pipeline: Pipeline, provider: Provider) -> None:
    raw = f'{{"username": "ada", "password": "{t.SECRETS[0]}", "api_key": "{t.SECRETS[1]}", '
    result = t.run_one(pipeline, provider, "login", raw)
    assert result.error is not None and result.error.code is ErrorCode.INVALID_JSON
    _no_secret_in(result.error.model_dump_json())


def test_parallel_calls_answered_in_model_order(pipeline: Pipeline, provider: Provider) -> None:
    specs = [
        ("read_file", {"path": "one"}),
        ("nope", {}),
        ("fetch_async", {"url": "http://example.test/2"}),
        ("write_file", '{"path": '),
        ("fetch_sync", {"url": "http://example.test/4"}),
        ("silent", {}),
    ]
    output = t.assistant_output(provider, [(t.call_id(provider, n), name, args) for n, (name, args) in enumerate(specs)])
    adapter = get_adapter(provider)
    calls = adapter.parse_calls(output)
    assert [c.index for c in calls] == list(range(len(specs)))
    shuffled = calls[:]
    random.Random(7).shuffle(shuffled)
    results = pipeline.run_all(shuffled, "sess-par")
    assert [r.call_id for r in results] == [c.id for c in calls]
    assert len({r.call_id for r in results}) == len(calls)
    assert [r.status for r in results] == ["ok", "error", "ok", "error", "ok", "ok"]
    assert results[2].content == "fetched http://example.test/2 asynchronously"
    assert results[4].content == "fetched http://example.test/4 synchronously"
    pairs = t.rendered_pairs(provider, adapter.result_items(results))
    assert [cid for cid, _ in pairs] == [c.id for c in calls]


def test_async_and_sync_handlers(pipeline: Pipeline, provider: Provider) -> None:
    assert t.fetch_async.is_async and not t.fetch_sync.is_async
    a = t.run_one(pipeline, provider, "fetch_async", {"url": "u1"})
    s = t.run_one(pipeline, provider, "fetch_sync", {"url": "u2"}, n=2)
    assert (a.status, a.content) == ("ok", "fetched u1 asynchronously")
    assert (s.status, s.content) == ("ok", "fetched u2 synchronously")


def test_handler_receives_tool_context(pipeline: Pipeline, provider: Provider) -> None:
    cid = t.call_id(provider, 5)
    before = time.time()
    _, (result,) = t.run_turn(pipeline, provider, t.assistant_output(provider, [(cid, "whoami", {"note": "hi"})]), "sess-ctx")
    after = time.time()
    assert result.status == "ok", result.content
    ctx = result.data
    assert (ctx["call_id"], ctx["session_id"], ctx["tool_name"], ctx["note"]) == (cid, "sess-ctx", "whoami", "hi")
    expected_key = idempotency_key(t.whoami, "sess-ctx", cid, {"note": "hi"})
    assert ctx["idempotency_key"] == expected_key
    assert before + t.whoami.timeout <= ctx["deadline"] <= after + t.whoami.timeout
    assert 0 < ctx["remaining"] <= t.whoami.timeout
    # The model text is the JSON of the data, and the data is the handler's value.
    assert json.loads(result.content) == ctx


def test_business_idempotency_key_reaches_the_handler(pipeline: Pipeline, provider: Provider) -> None:
    first = t.run_one(pipeline, provider, "pay", {"order_id": "A17", "cents": 500}, n=1)
    again = t.run_one(pipeline, provider, "pay", {"order_id": "A17", "cents": 500}, n=2)
    other = t.run_one(pipeline, provider, "pay", {"order_id": "B2", "cents": 500}, n=3)
    assert first.status == "ok" and first.content == again.content != other.content


def test_dict_return_is_data_and_json_content(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "weather_dict", {"city": "Oslo"})
    assert result.data == {"city": "Oslo", "celsius": 21.5, "sky": "clear"}
    assert json.loads(result.content) == result.data


def test_model_return_is_dumped_to_data(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "weather_model", {"city": "Bergen"})
    assert result.data == {"city": "Bergen", "celsius": -3.0, "sky": "rain"}
    assert json.loads(result.content) == result.data


def test_tool_output_keeps_text_and_data_apart(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "weather_output", {"city": "Tromsø"})
    assert result.content == "It is cloudy in Tromsø."
    assert result.data == {"city": "Tromsø", "celsius": 12.0, "sky": "cloudy"}


def test_permission_hook_denies_with_reason(provider: Provider) -> None:
    seen: list[tuple[str, str]] = []

    def hook(call: ToolCall, spec: ToolSpec) -> bool | str | None:
        seen.append((call.name, spec.side_effect))
        return "mail is disabled in this workspace" if call.name == "send_mail" else None

    pipeline = t.make_pipeline(hook)
    result = t.run_one(pipeline, provider, "send_mail", {"to": "a@b.test", "body": "hi"})
    assert result.error is not None and result.error.code is ErrorCode.PERMISSION_DENIED
    assert "mail is disabled in this workspace" in result.content
    assert "Fix: Do not retry this call as is" in result.content
    assert seen == [("send_mail", "unsafe")]
    # Abstaining allows a low-risk tool.
    assert t.run_one(pipeline, provider, "read_file", {"path": "a"}).status == "ok"


def test_permission_hook_false_denies(provider: Provider) -> None:
    pipeline = t.make_pipeline(lambda call, spec: False)
    result = t.run_one(pipeline, provider, "read_file", {"path": "a"})
    assert result.error is not None and result.error.code is ErrorCode.PERMISSION_DENIED
    assert "the permission policy refused it" in result.content


def test_high_risk_tool_without_hook_is_denied(pipeline: Pipeline, provider: Provider) -> None:
    result = t.run_one(pipeline, provider, "deploy", {"service": "api"})
    assert result.error is not None and result.error.code is ErrorCode.PERMISSION_DENIED
    assert "high-risk tool and no permission hook allowed it" in result.content


def test_high_risk_tool_with_abstaining_hook_is_denied(provider: Provider) -> None:
    result = t.run_one(t.make_pipeline(lambda call, spec: None), provider, "deploy", {"service": "api"})
    assert result.error is not None and result.error.code is ErrorCode.PERMISSION_DENIED


def test_hook_true_allows_a_high_risk_tool(provider: Provider) -> None:
    pipeline = t.make_pipeline(lambda call, spec: call.name == "deploy" or None)
    result = t.run_one(pipeline, provider, "deploy", {"service": "api"})
    assert (result.status, result.content) == ("ok", "deployed api")


def test_permission_runs_after_validation(provider: Provider) -> None:
    asked: list[str] = []
    def allow_and_note(call: ToolCall, spec: ToolSpec) -> bool:
        asked.append(call.name)
        return True

    pipeline = t.make_pipeline(allow_and_note)
    result = t.run_one(pipeline, provider, "deploy", {"service": 3, "region": "eu"})
    assert result.error is not None and result.error.code is ErrorCode.INVALID_ARGUMENTS
    assert asked == []


def test_failing_permission_hook_denies_instead_of_raising(provider: Provider) -> None:
    def hook(call: ToolCall, spec: ToolSpec) -> bool:
        raise RuntimeError("policy service unreachable")

    result = t.run_one(t.make_pipeline(hook), provider, "read_file", {"path": "a"})
    assert result.error is not None and result.error.code is ErrorCode.PERMISSION_DENIED
    assert "RuntimeError" in result.content


def test_pipeline_with_its_own_spill_store_serves_read_output(provider: Provider) -> None:
    from toolchord.worker.spill import MemorySpillStore

    store = MemorySpillStore()
    pipeline = Pipeline(Registry([t.flood]), spill=store)
    result = t.run_one(pipeline, provider, "flood", {})
    assert result.truncated is not None and result.truncated.spill_ref is not None
    page = t.run_one(pipeline, provider, "read_output", {"ref": result.truncated.spill_ref, "limit": 50}, n=2)
    assert page.status == "ok", page.content
    assert page.content.endswith(t.flood_text()[:50])


def test_tool_without_parameters_accepts_empty_arguments(provider: Provider) -> None:
    pipeline = Pipeline(Registry([tool(lambda: "pong", name="ping", side_effect="read", sandbox={"isolate": False})]))
    assert t.run_one(pipeline, provider, "ping", {}).content == "pong"
    if provider != "anthropic":
        assert t.run_one(pipeline, provider, "ping", "", n=2).content == "pong"
