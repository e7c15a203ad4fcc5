"""One driver per session: a finished session resumed again asks the model nothing, two processes
resuming one session at once ask the model once and run its calls once, and steps go on counting
across a resume (toolchord replay labels them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster_helpers import TOOLS, effects, settings_for
from tests.conftest import ROOT, worker_env
from toolchord import Agent, JsonlEventLog, Registry, tool
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.event_stores import RedisEventLog
from toolchord.orchestrator.events import CallResult, ModelRequest
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import SandboxProfile
from toolchord.worker.celery_app import create_app

RUNS: list[str] = []


@tool(side_effect="unsafe", approval="always", sandbox=SandboxProfile(isolate=False))
def refund(order_id: str) -> str:
    """Refund an order (always held for a decision)."""
    RUNS.append(order_id)
    return f"refunded {order_id}"


def test_resuming_a_finished_session_asks_the_model_nothing_and_gives_the_same_result(tmp_path: Path) -> None:
    RUNS.clear()
    script = [ScriptedTurn(calls=[ScriptedCall(name="refund", arguments={"order_id": "A-1"})]),
              ScriptedTurn(text="Refunded."), ScriptedTurn(text="A second answer nobody asked for.")]
    with ScriptedModelServer(script) as server:
        agent = Agent(Registry([refund]), model="scripted", base_url=server.base_url + "/v1", api_key="-",
                      event_log=JsonlEventLog(tmp_path))
        waiting = agent.run("refund A-1", session_id="done")
        agent.orchestrator.approve("done", waiting.awaiting_approval[0].call.id, by="alice")
        first = agent.resume("done")
        # Another process (another agent on the same log) resumes it again.
        other = Agent(Registry([refund]), model="scripted", base_url=server.base_url + "/v1", api_key="-",
                      event_log=JsonlEventLog(tmp_path))
        again = other.resume("done")
        third = agent.resume("done")
        other.close()
        agent.close()
        requests = len(server.requests)
    assert first.stop_reason == "final" and first.text == "Refunded."
    assert again == first and third == first
    assert [s.step for s in first.steps] == [2]
    assert requests == 2 and RUNS == ["A-1"]
    log = JsonlEventLog(tmp_path).read("done")
    assert [e.step for e in log if isinstance(e, ModelRequest)] == [1, 2]
    replay = subprocess.run([sys.executable, "-c", "from toolchord.orchestrator.cli import main; main()", "replay",
                             "done", "--log-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                            timeout=120, check=True).stdout
    assert "(step 1, identical to" in replay and "(step 2, identical to" in replay


# A driver in its own process: resumes the session and prints how it ended.
RESUME = """
import json, sys
from toolchord.orchestrator import Agent
from toolchord.orchestrator import Orchestrator
from toolchord.orchestrator.event_stores import RedisEventLog
from tests.test_one_driver import driver_orchestrator
url, base = sys.argv[1], sys.argv[2]
orch = driver_orchestrator(url)
agent = Agent(orch.registry, model="scripted", base_url=base, api_key="-", orchestrator=orch,
              event_log=RedisEventLog(url))
result = agent.resume("s-two")
print(json.dumps({"stop": result.stop_reason, "text": result.text}))
"""


def driver_orchestrator(url: str) -> Orchestrator:
    """The cluster's test tools with `effect_unsafe` held for a decision when its key is "held"."""
    registry = Registry([
        spec.model_copy(update={"approval": lambda args: args["key"] == "held"}) if spec.name == "effect_unsafe"
        else spec
        for spec in Registry.from_modules([TOOLS])
    ])
    return Orchestrator(registry, create_app(settings_for(url), registry), event_log=RedisEventLog(url))


def _resume(redis_url: str, base_url: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", RESUME, redis_url, base_url], cwd=ROOT, text=True,
                            env=worker_env(redis_url, TOOLS), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_resuming_one_session_at_once_ask_the_model_once(start_worker, redis_url, clean_redis):
    start_worker(TOOLS)
    script = [
        ScriptedTurn(calls=[ScriptedCall(name="effect_unsafe", arguments={"key": "held", "seconds": 3})]),
        ScriptedTurn(calls=[ScriptedCall(name="effect_unsafe", arguments={"key": "again"})]),
        ScriptedTurn(text="All done."),
        ScriptedTurn(text="All done."),
        ScriptedTurn(text="All done."),
    ]
    with ScriptedModelServer(script) as server:
        orch = driver_orchestrator(redis_url)
        agent = Agent(orch.registry, model="scripted", base_url=server.base_url + "/v1", api_key="-",
                      orchestrator=orch, event_log=RedisEventLog(redis_url))
        waiting = agent.run("do it", session_id="s-two")
        assert waiting.stop_reason == "waiting_approval"
        orch.approve("s-two", waiting.awaiting_approval[0].call.id, by="alice")
        # The approved call takes 3 s on the worker: both drivers wait for it in `settle`, then race on.
        drivers = [_resume(redis_url, server.base_url + "/v1") for _ in range(2)]
        outcomes = []
        for proc in drivers:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
        requests = len(server.requests)
        agent.close()
    assert outcomes == [{"stop": "final", "text": "All done."}] * 2
    assert requests == 3  # the pause, the repeated unsafe call, the final answer: nothing twice
    assert effects(clean_redis, "held") == 1 and effects(clean_redis, "again") == 1
    results = [e.result.call_id for e in RedisEventLog(redis_url).read("s-two") if isinstance(e, CallResult)]
    assert len(results) == len(set(results)) == 2
