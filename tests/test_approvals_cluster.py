"""Approvals on the private Redis with real `toolchord worker` processes: decisions from other
processes after the first one exited, deny, expiry, racing approvers, a worker SIGKILLed after
approval. Effects are counted in Redis by the test tools (tests/celery_tools.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.approval_tools import approval_orchestrator, approval_registry
from tests.cluster_helpers import TOOLS, call, effects, wait_for
from tests.conftest import ROOT, worker_env
from toolchord.orchestrator import Agent
from toolchord.orchestrator.event_stores import RedisEventLog
from toolchord.orchestrator.events import ApprovalDecided
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import ErrorCode

pytestmark = pytest.mark.slow

SCRIPT = [
    ScriptedTurn(calls=[ScriptedCall(name="effect_unsafe", arguments={"key": "cross"}),
                        ScriptedCall(name="echo", arguments={"text": "hi"})]),
    ScriptedTurn(text="All done."),
]

# The first process: runs the agent until it waits, prints the held call, exits.
FIRST = """
import json, sys
from toolchord.orchestrator import Agent
from toolchord.orchestrator.event_stores import RedisEventLog
from tests.approval_tools import approval_orchestrator, approval_registry
url, base = sys.argv[1], sys.argv[2]
agent = Agent(approval_registry(), model="scripted", base_url=base, api_key="-",
              orchestrator=approval_orchestrator(url), event_log=RedisEventLog(url))
result = agent.run("do it", session_id="s-cross")
print(json.dumps({"stop": result.stop_reason, "held": [a.call.id for a in result.awaiting_approval]}))
"""


def _python(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return _python("-c", "from toolchord.orchestrator.cli import main; main()", *args, env=env)


def _done(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 3), err
    return proc.returncode, out


def _decisions(url: str, session: str) -> list[ApprovalDecided]:
    return [e for e in RedisEventLog(url).read(session) if isinstance(e, ApprovalDecided)]


def test_approved_from_another_process_after_the_first_exited(start_worker, redis_url, clean_redis):
    start_worker(TOOLS)
    env = worker_env(redis_url, TOOLS)
    with ScriptedModelServer(SCRIPT) as server:
        first = _python("-c", FIRST, redis_url, server.base_url + "/v1", env=env)
        _, out = _done(first)
        state = json.loads(out.strip().splitlines()[-1])
        assert state["stop"] == "waiting_approval" and len(state["held"]) == 1
        held = state["held"][0]
        assert effects(clean_redis, "cross") == 0

        code, listing = _done(_cli("approvals", "list", "--session", "s-cross", env=env))
        assert f"s-cross {held} effect_unsafe({json.dumps({'key': 'cross', 'seconds': 0.0})})" in listing
        code, out = _done(_cli("approvals", "approve", "s-cross", held, "--by", "alice", "--note", "fine", env=env))
        assert code == 0 and "APPROVED by alice" in out

        orch = approval_orchestrator(redis_url)
        agent = Agent(approval_registry(), model="scripted", base_url=server.base_url + "/v1", api_key="-",
                      orchestrator=orch, event_log=RedisEventLog(redis_url))
        done = agent.resume("s-cross")
        assert done.stop_reason == "final" and done.text == "All done."
        tool_messages = [m for m in server.requests[1].body["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["1", "hi"]
    assert effects(clean_redis, "cross") == 1
    assert [(d.decision, d.by) for d in _decisions(redis_url, "s-cross")] == [("approved", "alice")]
    code, replay = _done(_cli("replay", "s-cross", "--redis-url", redis_url, env=env))
    assert f"approval approved: call {held} (effect_unsafe) by alice" in replay
    assert replay.count("identical to the request sent") == 2 and "DIFFERS" not in replay


def test_deny_and_expiry_end_in_results_without_effects(start_worker, redis_url, clean_redis):
    start_worker(TOOLS)
    orch = approval_orchestrator(redis_url)
    quick = approval_orchestrator(redis_url, {"charge": 0.5})  # charge waits half a second at most
    calls = [call(0, "effect_unsafe", key="denied"), call(1, "charge", order_id="o-1", cents=5),
             call(2, "echo", text="x")]
    turn = quick.run_calls("s-deny", calls)
    assert turn.waiting and [r.content for r in turn.results] == ["x"]
    assert orch.deny("s-deny", "call_0", by="bob", note="too risky").state == "DENIED"
    assert orch.approve("s-deny", "call_0", by="alice").state == "DENIED"
    wait_for(lambda: not orch.pending_approvals("s-deny"), 30, "the approval deadline to pass")
    assert orch.approve("s-deny", "call_1", by="alice").state == "EXPIRED"
    settled = orch.approvals.settle("s-deny", turn.turn_id)
    denied, expired = settled.results
    assert denied.error.code == ErrorCode.PERMISSION_DENIED and "bob denied it: too risky" in denied.content
    assert expired.error.code == ErrorCode.NOT_EXECUTED
    assert effects(clean_redis, "denied") == 0 and clean_redis.get("tc-test:charges:o-1") is None
    decisions = [(d.decision, d.by) for d in _decisions(redis_url, "s-deny")]
    assert decisions == [("denied", "bob"), ("expired", "toolchord")]


def test_racing_approvers_run_the_call_once(start_worker, redis_url, clean_redis):
    start_worker(TOOLS)
    orch = approval_orchestrator(redis_url)
    turn = orch.run_calls("s-race", [call(0, "effect_unsafe", key="race")])
    assert turn.waiting
    env = worker_env(redis_url, TOOLS)
    racers = [_cli("approvals", "approve", "s-race", "call_0", "--by", f"a{i}", env=env) for i in range(4)]
    outcomes = [_done(p) for p in racers]
    assert all(code == 0 for code, _ in outcomes)
    winners = {out.strip().rsplit(" by ", 1)[1] for _, out in outcomes}
    assert len(winners) == 1 and [d.by for d in _decisions(redis_url, "s-race")] == list(winners)
    # Even a second send under the planned task id and key does not run it again (the worker's claim).
    approval = orch.approvals.store.get("s-race", "call_0")
    assert approval is not None
    orch.approvals._send(approval)
    result, = orch.approvals.settle("s-race", turn.turn_id).results
    assert result.status == "ok" and result.content == "1"
    wait_for(lambda: effects(clean_redis, "race") >= 1, 30, "the call to run")
    assert effects(clean_redis, "race") == 1


def test_approved_unsafe_call_whose_worker_is_sigkilled_runs_at_most_once(start_worker, redis_url, clean_redis):
    first = start_worker(TOOLS, concurrency=1, name="w-killed")
    orch = approval_orchestrator(redis_url)
    turn = orch.run_calls("s-kill", [call(0, "effect_unsafe", key="killed", seconds=60)])
    orch.approve("s-kill", "call_0", by="alice")
    wait_for(lambda: effects(clean_redis, "killed") == 1, 60, "the approved call to start")
    first.kill()
    start_worker(TOOLS, concurrency=1, name="w-after")
    # Another approver after the kill: already decided, nothing is sent again.
    assert approval_orchestrator(redis_url).approve("s-kill", "call_0", by="bob").decided_by == "alice"
    result, = approval_orchestrator(redis_url).approvals.settle("s-kill", turn.turn_id).results
    assert result.error is not None and result.error.code == ErrorCode.OUTCOME_UNKNOWN
    assert effects(clean_redis, "killed") == 1
