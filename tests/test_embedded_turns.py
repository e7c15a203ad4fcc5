"""Turns in the embedded mode (no broker configured): in-memory transport, cache backend, one process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from toolchord.orchestrator import Orchestrator
from toolchord.worker import Registry, tool
from toolchord.worker.config import Settings
from toolchord.worker.models import ToolCall


@tool(side_effect="read", sandbox={"isolate": False})
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def embedded() -> Orchestrator:
    # No broker URL: the embedded mode, whatever the environment says.
    return Orchestrator(Registry([add]), settings=Settings())


def test_embedded_chord_completes_without_waiting_for_a_join_timeout(embedded: Orchestrator) -> None:
    calls = [ToolCall(id=f"c{i}", name="add", arguments_raw=f'{{"a": {i}, "b": 1}}', index=i) for i in range(3)]
    join_timeout = embedded.app.conf.result_chord_join_timeout
    for turn_no in range(2):
        started = time.monotonic()
        turn = embedded.run_calls(f"s-embedded-{turn_no}", calls)
        elapsed = time.monotonic() - started
        assert [r.content for r in turn.results] == ["1", "2", "3"]
        # The cache backend joins a chord by reading each header task's stored result: were those
        # results not stored, every turn would sit out the join timeout and then lose its callback.
        assert elapsed < join_timeout, f"an embedded turn took {elapsed:.2f} s (chord join timeout {join_timeout} s)"


@tool(side_effect="read", sandbox={"isolate": False})
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def test_two_embedded_orchestrators_in_one_process_keep_their_calls_apart() -> None:
    # The in-memory transport's queues are process-wide: without queues of its own, each
    # embedded worker would take the other's calls and answer UNKNOWN_TOOL for them.
    adder = Orchestrator(Registry([add]), settings=Settings())
    shouter = Orchestrator(Registry([shout]), settings=Settings())
    for i in range(4):
        sums = adder.run_calls(f"s-add-{i}", [ToolCall(id="c", name="add", arguments_raw='{"a": 1, "b": 1}', index=0)])
        loud = shouter.run_calls(f"s-shout-{i}", [ToolCall(id="c", name="shout", arguments_raw='{"text": "hi"}', index=0)])
        assert [r.content for r in sums.results] == ["2"]
        assert [r.content for r in loud.results] == ["HI"]


@tool(side_effect="read", sandbox={"isolate": False}, max_output_chars=200)
def long_text(word: str) -> str:
    """A text too long to show in full."""
    return " ".join([word] * 200)


def _read_output(orchestrator: Orchestrator, session_id: str, ref: str, call_id: str = "r") -> str:
    call = ToolCall(id=call_id, name="read_output", arguments_raw=f'{{"ref": "{ref}", "limit": 40}}')
    (result,) = orchestrator.run_calls(session_id, [call]).results
    return result.content


def test_each_embedded_orchestrator_reads_its_own_spilled_outputs() -> None:
    first = Orchestrator(Registry([long_text]), settings=Settings())
    second = Orchestrator(Registry([long_text]), settings=Settings())
    spilled = ToolCall(id="c", name="long_text", arguments_raw='{"word": "alpha"}')
    (cut,) = first.run_calls("s-spill", [spilled]).results
    assert cut.truncated is not None and cut.truncated.spill_ref
    # The second orchestrator spills too: the first must still find its own outputs.
    (other,) = second.run_calls("s-spill-2", [spilled.model_copy(update={"arguments_raw": '{"word": "beta"}'})]).results
    assert other.truncated is not None
    assert "alpha alpha" in _read_output(first, "s-spill", cut.truncated.spill_ref)
    assert "no stored output" in _read_output(second, "s-spill", cut.truncated.spill_ref, "r2")


def test_importing_the_packages_builds_no_celery_app() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, orchestrator, worker; "
        "module = sys.modules.get('toolchord.worker.celery_app'); "
        "print('built' if module is not None and 'app' in vars(module) else 'lazy')"
    )
    env = {"TOOLCHORD_BROKER_URL": "redis://127.0.0.1:1/0", "PATH": ""}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert done.stdout.strip() == "lazy", done.stderr


@tool(side_effect="read", sandbox={"isolate": False}, timeout=5)
def nap(seconds: float) -> str:
    """Sleep a while."""
    time.sleep(seconds)
    return "rested"


def test_a_cancelled_async_waiter_leaves_no_trace_of_its_turn() -> None:
    orch = Orchestrator(Registry([nap]), settings=Settings())
    call = ToolCall(id="c", name="nap", arguments_raw='{"seconds": 1.5}', index=0)
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(orch.arun_calls("s-cancelled-waiter", [call]), 0.3))
    # A framework that gives up on a call (a cancelled tool invocation) must not leave the turn in
    # this long-lived orchestrator's watch list: it would grow by one entry per abandoned turn.
    assert orch._waiting == set() and orch._cancelled_here == set()


def _stream_calls(count: int) -> list[ToolCall]:
    return [ToolCall(id=f"st{i}", name="add", arguments_raw=f'{{"a": {i}, "b": 10}}', index=i) for i in range(count)]


def test_run_stream_runs_calls_as_the_stream_hands_them_out(embedded: Orchestrator) -> None:
    handed: list[str] = []

    def stream() -> Iterator[ToolCall]:
        for call in _stream_calls(3):
            handed.append(call.id)
            yield call

    turn = embedded.run_stream("s-run-stream", stream())
    assert turn is not None and handed == ["st0", "st1", "st2"]
    assert [(r.call_id, r.content) for r in turn.results] == [("st0", "10"), ("st1", "11"), ("st2", "12")]
    # A message that did not complete: nothing more starts and there is no turn result.
    assert embedded.run_stream("s-run-stream-cut", iter(_stream_calls(2)), message_complete=lambda seen: None) is None


def test_a_stream_that_fails_ends_its_turn_and_raises(embedded: Orchestrator) -> None:
    def broken() -> Iterator[ToolCall]:
        yield from _stream_calls(1)
        raise ConnectionError("the model's stream dropped")

    with pytest.raises(ConnectionError):
        embedded.run_stream("s-run-stream-broken", broken())


def test_arun_stream_is_the_async_twin(embedded: Orchestrator) -> None:
    async def stream() -> AsyncIterator[ToolCall]:
        for call in _stream_calls(2):
            yield call

    turn = asyncio.run(embedded.arun_stream("s-arun-stream", stream()))
    assert turn is not None
    assert [(r.call_id, r.content) for r in turn.results] == [("st0", "10"), ("st1", "11")]


def test_a_streamed_turn_keeps_its_own_tenant_and_priority(embedded: Orchestrator) -> None:
    turn = embedded.run_stream("s-stream-tenant", iter(_stream_calls(1)), tenant="acme", priority="batch")
    assert turn is not None
    record = embedded.turns.record("s-stream-tenant", turn.turn_id)
    assert (record.tenant, record.priority) == ("acme", "batch")


def test_a_resubmitted_turn_gets_its_first_result_and_asks_the_permission_hook_once() -> None:
    """Without a hook a turn is planned before it is looked up (one round trip for both on Redis);
    with one, which may ask a person, a resubmitted turn is looked up first and never asks again."""
    asked: list[str] = []

    def hook(call: ToolCall, spec: object) -> bool:
        asked.append(call.id)
        return True

    calls = [ToolCall(id=f"c{i}", name="add", arguments_raw=f'{{"a": {i}, "b": 1}}', index=i) for i in range(2)]
    for permission_hook in (None, hook):
        orch = Orchestrator(Registry([add]), settings=Settings(), permission_hook=permission_hook)
        first = orch.run_calls("s-resubmitted", calls, turn_id="t-1")
        again = orch.run_calls("s-resubmitted", calls, turn_id="t-1")
        assert [r.content for r in first.results] == ["1", "2"]
        assert again == first
    assert asked == ["c0", "c1"]
