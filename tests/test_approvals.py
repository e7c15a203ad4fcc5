"""Approvals in embedded mode: the policy, the waiting result, decisions, resume and replay
(the distributed cases, with real Redis and workers, are in test_approvals_cluster.py)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import SecretStr

from tests.cluster_helpers import wait_for
from toolchord.orchestrator import (
    Agent,
    AgentResult,
    JsonlEventLog,
    Orchestrator,
    SessionWaiting,
    UnknownApproval,
)
from toolchord.orchestrator.events import ApprovalDecided, ApprovalRequested, ModelRequest
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import ErrorCode, Registry, SandboxProfile, ToolCall, tool
from toolchord.worker.redaction import MASK

ROOT = Path(__file__).resolve().parent.parent
REFUNDS: list[str] = []


# In the orchestrator's process (embedded worker, no sandbox child), so REFUNDS counts the runs.
@tool(side_effect="unsafe", approval=lambda args: args["cents"] > 1000, sandbox=SandboxProfile(isolate=False))
def refund(order_id: str, cents: int) -> str:
    """Refund an order."""
    REFUNDS.append(order_id)
    return f"refunded {cents} on {order_id}"


@tool(side_effect="read")
def lookup(order_id: str) -> str:
    """Look an order up."""
    return f"{order_id} is paid"


HELD = Registry([refund, lookup])
# The same tools, nothing held: what an uninterrupted run sends.
FREE = Registry([refund.model_copy(update={"approval": "never"}), lookup])

SCRIPT = [
    ScriptedTurn(text="Checking.", calls=[
        ScriptedCall(name="refund", arguments={"order_id": "big", "cents": 5000}),
        ScriptedCall(name="lookup", arguments={"order_id": "big"}),
        ScriptedCall(name="refund", arguments={"order_id": "small", "cents": 100}),
    ]),
    ScriptedTurn(text="Done."),
]


@pytest.fixture(scope="module")
def orchestrators() -> Iterator[dict[str, Orchestrator]]:
    made = {"held": Orchestrator(HELD), "free": Orchestrator(FREE)}
    yield made
    for orch in made.values():
        orch.close()


def _agent(registry: Registry, orch: Orchestrator, server: ScriptedModelServer, log: JsonlEventLog) -> Agent:
    return Agent(registry, model="scripted", base_url=server.base_url + "/v1", api_key="-", orchestrator=orch,
                 event_log=log)


@contextmanager
def _paused(orch: Orchestrator, log: JsonlEventLog,
            session_id: str) -> Iterator[tuple[Agent, ScriptedModelServer, AgentResult]]:
    """An agent on the held tools whose session `session_id` has just paused on the big refund."""
    REFUNDS.clear()
    with ScriptedModelServer(SCRIPT) as server:
        agent = _agent(HELD, orch, server, log)
        yield agent, server, agent.run("refund", session_id=session_id)


def _digests(log: JsonlEventLog, session_id: str) -> list[str]:
    return [e.request_digest for e in log.read(session_id) if isinstance(e, ModelRequest)]


def test_held_call_waits_then_resumes_with_the_request_an_uninterrupted_run_sends(
        tmp_path: Path, orchestrators: dict[str, Orchestrator]) -> None:
    log = JsonlEventLog(tmp_path)
    orch = orchestrators["held"]
    with _paused(orch, log, "held") as (agent, server, waiting):
        assert waiting.stop_reason == "waiting_approval"
        # Only the big refund waits; the others ran with the turn.
        assert [a.call.arguments for a in waiting.awaiting_approval] == [{"order_id": "big", "cents": 5000}]
        assert [r.content for r in waiting.steps[0].results] == ["big is paid", "refunded 100 on small"]
        assert REFUNDS == ["small"] and len(server.requests) == 1
        held = waiting.awaiting_approval[0]
        assert [a.call.id for a in orch.pending_approvals("held")] == [held.call.id]
        with pytest.raises(SessionWaiting):
            agent.run("anything else?", session_id="held")
        assert agent.resume("held").stop_reason == "waiting_approval"  # undecided: nothing appended
        assert orch.approve("held", held.call.id, by="alice", note="ok").state == "APPROVED"
        assert orch.approve("held", held.call.id, by="mallory").decided_by == "alice"
        done = agent.resume("held")
    assert done.stop_reason == "final" and done.text == "Done."
    assert REFUNDS == ["small", "big"]
    assert orch.pending_approvals("held") == []
    with pytest.raises(UnknownApproval):
        orch.approve("held", "no-such-call", by="alice")

    with ScriptedModelServer(SCRIPT) as server:
        _agent(FREE, orchestrators["free"], server, JsonlEventLog(tmp_path / "free")).run("refund", session_id="held")
    assert _digests(log, "held") == _digests(JsonlEventLog(tmp_path / "free"), "held")
    decided = [e for e in log.read("held") if isinstance(e, ApprovalDecided)]
    assert [(e.decision, e.by, e.note) for e in decided] == [("approved", "alice", "ok")]


def test_an_async_agent_resumes_once_the_held_call_is_approved(
        tmp_path: Path, orchestrators: dict[str, Orchestrator]) -> None:
    log = JsonlEventLog(tmp_path)
    orch = orchestrators["held"]
    REFUNDS.clear()

    async def conversation(agent: Agent) -> tuple[AgentResult, AgentResult, AgentResult]:
        paused = await agent.arun("refund", session_id="async")
        undecided = await agent.aresume("async")
        orch.approve("async", paused.awaiting_approval[0].call.id, by="alice")
        return paused, undecided, await agent.aresume("async")

    with ScriptedModelServer(SCRIPT) as server:
        paused, undecided, done = asyncio.run(conversation(_agent(HELD, orch, server, log)))
        assert len(server.requests) == 2
    assert (paused.stop_reason, undecided.stop_reason) == ("waiting_approval", "waiting_approval")
    assert [a.call.id for a in undecided.awaiting_approval] == [a.call.id for a in paused.awaiting_approval]
    assert done.stop_reason == "final" and done.text == "Done." and REFUNDS == ["small", "big"]
    with ScriptedModelServer(SCRIPT) as server:
        _agent(FREE, orchestrators["free"], server, JsonlEventLog(tmp_path / "free")).run("refund", session_id="async")
    assert _digests(log, "async") == _digests(JsonlEventLog(tmp_path / "free"), "async")


def test_deny_gives_the_model_the_reason_and_replay_shows_the_decisions(
        tmp_path: Path, orchestrators: dict[str, Orchestrator]) -> None:
    log = JsonlEventLog(tmp_path)
    orch = orchestrators["held"]
    with _paused(orch, log, "denied") as (agent, server, paused):
        held = paused.awaiting_approval[0]
        waiting_replay = _replay(tmp_path, "denied")
        assert "approval requested: call " + held.call.id in waiting_replay
        assert "no next request yet" in waiting_replay
        orch.deny("denied", held.call.id, by="bob", note="over the limit")
        assert orch.approve("denied", held.call.id, by="alice").state == "DENIED"
        done = agent.resume("denied")
        sent = server.requests[1].body["messages"]
    assert done.stop_reason == "final" and "big" not in REFUNDS
    denial = next(m for m in sent if m.get("tool_call_id") == held.call.id)["content"]
    assert denial.startswith("PERMISSION_DENIED") and "bob denied it: over the limit" in denial
    replay = _replay(tmp_path, "denied")
    assert re.search(rf"approval denied: call {held.call.id} \(refund\) by bob at \S+: over the limit", replay)
    assert replay.count("identical to the request sent") == 2 and "DIFFERS" not in replay
    assert [type(e) for e in log.read("denied")].count(ApprovalRequested) == 1


def test_an_undecided_call_expires_into_a_result(tmp_path: Path) -> None:
    quick = refund.model_copy(update={"approval": "always", "approval_timeout": 0.2})
    orch = Orchestrator(Registry([quick]))
    REFUNDS.clear()
    try:
        with ScriptedModelServer([SCRIPT[0].model_copy(update={"calls": SCRIPT[0].calls[:1]}), SCRIPT[1]]) as server:
            agent = _agent(Registry([quick]), orch, server, JsonlEventLog(tmp_path))
            held = agent.run("refund", session_id="late").awaiting_approval[0]
            wait_for(lambda: not orch.pending_approvals("late"), 30, "the approval deadline to pass")
            assert orch.approve("late", held.call.id, by="alice").state == "EXPIRED"
            done = agent.resume("late")
    finally:
        orch.close()
    assert done.stop_reason == "final" and REFUNDS == []
    result = next(e for e in JsonlEventLog(tmp_path).read("late") if e.type == "call_result").result
    assert result.error is not None and result.error.code == ErrorCode.NOT_EXECUTED
    assert "nobody approved it within 0.2 s" in result.content


def test_a_session_pauses_and_resumes_many_times_and_its_log_only_grows(
        tmp_path: Path, orchestrators: dict[str, Orchestrator]) -> None:
    log = JsonlEventLog(tmp_path)
    orch = orchestrators["held"]
    big = [ScriptedTurn(calls=[ScriptedCall(name="refund", arguments={"order_id": f"o{i}", "cents": 2000})])
           for i in range(3)]
    with ScriptedModelServer([*big, ScriptedTurn(text="All refunded.")]) as server:
        agent = _agent(HELD, orch, server, log)
        result = asyncio.run(agent.arun("refund three", session_id="many"))  # the async loop holds calls too
        seen = log.read("many")
        for _ in range(3):
            assert result.stop_reason == "waiting_approval"
            orch.approve("many", result.awaiting_approval[0].call.id, by="carol")
            result = agent.resume("many")
            now = log.read("many")
            assert now[: len(seen)] == seen
            seen = now
    assert result.stop_reason == "final" and result.text == "All refunded."
    assert len(server.requests) == 4
    assert [e.by for e in seen if isinstance(e, ApprovalDecided)] == ["carol"] * 3


@tool(side_effect="unsafe", approval="always", store_raw_arguments=False, sandbox=SandboxProfile(isolate=False))
def deploy(service: str, token: SecretStr) -> str:
    """Deploy a service with a deploy token."""
    return f"deployed {service} with a token of {len(token.get_secret_value())} characters"


def test_held_arguments_are_redacted_but_the_approved_call_gets_them_whole() -> None:
    orch = Orchestrator(Registry([deploy]))
    try:
        arguments = '{"service": "api", "token": "s3cr3t-value"}'
        turn = orch.run_calls("secret", [ToolCall(id="c1", name="deploy", arguments_raw=arguments, index=0)])
        held, = turn.awaiting_approval
        listed, = orch.pending_approvals("secret")
        for shown in (held, listed):
            assert shown.arguments == {"service": "api", "token": MASK}
            assert "s3cr3t" not in shown.call.model_dump_json()
        assert held.signature is None
        orch.approve("secret", "c1", by="alice")
        result, = orch.approvals.settle("secret", turn.turn_id).results
    finally:
        orch.close()
    assert result.content == "deployed api with a token of 12 characters"


def test_an_approved_call_resumed_after_its_records_expired_is_outcome_unknown() -> None:
    orch = Orchestrator(HELD)
    try:
        turn = orch.run_calls("old", [ToolCall(id="c1", name="refund", arguments_raw='{"order_id": "o", "cents": 5000}',
                                               index=0)])
        # Decided and sent two result TTLs ago: the idempotency store no longer knows the call.
        long_ago = time.time() - 2 * orch.runtime.settings.result_ttl
        orch.approvals.store.decide("old", "c1", "APPROVED", "alice", None, long_ago)
        orch.approvals.store.mark_dispatched("old", "c1")
        result, = orch.approvals.settle("old", turn.turn_id).results
    finally:
        orch.close()
    assert result.error is not None and result.error.code == ErrorCode.OUTCOME_UNKNOWN


def test_the_documented_example_runs_as_written(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "approvals.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert code is not None
    script = tmp_path / "example.py"
    script.write_text(code.group(1))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "waiting_approval",
        "refund {'order_id': 'A-17', 'cents': 25000} PENDING_APPROVAL",
        "APPROVED alice",
        "final The refund of 250.00 on A-17 went through.",
    ]


def _replay(log_dir: Path, session: str) -> str:
    run = subprocess.run([sys.executable, "-c", "from toolchord.orchestrator.cli import main; main()", "replay", session,
                          "--log-dir", str(log_dir)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr
    return run.stdout
