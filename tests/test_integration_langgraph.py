"""LangGraph: a real graph whose tools node is `ToolchordToolNode`, the model played by the scripted
server through the real `openai` client, and the calls run by real `toolchord worker` processes."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from openai import OpenAI

from tests.cluster_helpers import TOOLS, effects, orchestrator, run_in_thread, wait_for
from tests.conftest import ROOT
from toolchord.orchestrator.integrations.langgraph import ToolchordToolNode
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import ErrorCode


def _example() -> ModuleType:
    # The example imports its tools from the module beside it, as `python examples/...` finds it.
    if str(ROOT / "examples") not in sys.path:
        sys.path.append(str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("langgraph_example", ROOT / "examples" / "langgraph_example.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: LangGraph resolves the state's annotations through the module.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


def tool_messages(state: dict) -> list[ToolMessage]:
    return [m for m in state["messages"] if isinstance(m, ToolMessage)]


@pytest.mark.slow
def test_parallel_calls_come_back_paired_by_id_with_timeout_and_unknown_tool(start_worker, redis_url):
    start_worker(TOOLS, concurrency=3)
    orch = orchestrator(redis_url)
    script = [
        ScriptedTurn(calls=[ScriptedCall(name="echo", arguments={"text": "a"}),
                            ScriptedCall(name="slow", arguments={"seconds": 5}),
                            ScriptedCall(name="teleport", arguments={"to": "Oslo"}),
                            ScriptedCall(name="echo", arguments={"text": "b"})]),
        ScriptedTurn(text="done"),
    ]
    with ScriptedModelServer(script) as server:
        node = ToolchordToolNode(orch.registry, orchestrator=orch)
        graph = EXAMPLE.build_graph(OpenAI(base_url=server.base_url + "/v1", api_key="t"), node)
        state = graph.invoke({"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "lg-pairing"}})
        second_request = server.requests[1].body["messages"]
    ids = [tc["id"] for tc in state["messages"][1].tool_calls]
    messages = tool_messages(state)
    assert [m.tool_call_id for m in messages] == ids
    assert [m.status for m in messages] == ["success", "error", "error", "success"]
    assert [m.content for m in messages][::3] == ["a", "b"]
    assert [m.artifact["error"]["code"] for m in messages[1:3]] == ["TIMEOUT", "UNKNOWN_TOOL"]
    # The model's next request carries one tool message per call id, in order, errors included.
    sent = [m for m in second_request if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in sent] == ids
    assert "TIMEOUT" in sent[1]["content"] and "UNKNOWN_TOOL" in sent[2]["content"]
    assert state["messages"][-1].content == "done"


@pytest.mark.slow
def test_unsafe_call_not_rerun_after_worker_sigkill_and_graph_replay(start_worker, redis_url, clean_redis):
    victim = start_worker(TOOLS, concurrency=2, name="victim")
    orch = orchestrator(redis_url)
    script = [ScriptedTurn(calls=[ScriptedCall(name="effect_unsafe", arguments={"key": "lg-u", "seconds": 3}),
                                  ScriptedCall(name="echo", arguments={"text": "x"})]),
              ScriptedTurn(text="first answer"), ScriptedTurn(text="answer after the replay")]
    config = {"configurable": {"thread_id": "lg-kill"}}
    with ScriptedModelServer(script) as server:
        graph = EXAMPLE.build_graph(OpenAI(base_url=server.base_url + "/v1", api_key="t"),
                                    ToolchordToolNode(orch.registry, orchestrator=orch))
        thread, box = run_in_thread(graph.invoke, {"messages": [HumanMessage("go")]}, config)
        wait_for(lambda: effects(clean_redis, "lg-u") == 1, 30, "the unsafe handler to start")
        victim.kill()
        start_worker(TOOLS, concurrency=2, name="rescuer")
        thread.join(90)
        first = tool_messages(box["value"])
        assert first[0].artifact["error"]["code"] == ErrorCode.OUTCOME_UNKNOWN.value
        assert first[1].content == "x"
        # LangGraph runs the tools node again from the checkpoint before it (as a resumed or
        # replayed run does): toolchord returns the turn's stored results, nothing runs again.
        before_tools = next(s for s in graph.get_state_history(config) if s.next == ("tools",))
        replayed = graph.invoke(None, before_tools.config)
    again = tool_messages(replayed)
    assert [(m.tool_call_id, m.content) for m in again] == [(m.tool_call_id, m.content) for m in first]
    assert replayed["messages"][-1].content == "answer after the replay"
    assert effects(clean_redis, "lg-u") == 1


@pytest.mark.slow
def test_the_example_runs_embedded_with_no_redis(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "examples/langgraph_example.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for expected in ("TIMEOUT", "UNKNOWN_TOOL", "booked Maaemo for 2", "your table at Maaemo is booked"):
        assert expected in done.stdout, done.stdout


def test_node_accepts_tool_call_lists_and_answers_invalid_json():
    node = ToolchordToolNode(EXAMPLE.REGISTRY)  # embedded
    out = node.invoke([{"type": "tool_call", "name": "nope", "args": {}, "id": "c1"}])
    assert [(m.tool_call_id, m.artifact["error"]["code"]) for m in out] == [("c1", "UNKNOWN_TOOL")]
    message = AIMessage(content="", tool_calls=[], invalid_tool_calls=[
        {"type": "invalid_tool_call", "name": "get_weather", "args": '{"city": ', "id": "c2", "error": "bad"}])
    out = node.invoke({"messages": [message]})["messages"]
    assert [(m.tool_call_id, m.artifact["error"]["code"]) for m in out] == [("c2", "INVALID_JSON")]
    assert json.loads(json.dumps(out[0].artifact))["status"] == "error"


def test_ainvoke_runs_the_turn_on_asyncio():
    node = ToolchordToolNode(EXAMPLE.REGISTRY)  # embedded
    message = AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Rome"}, "id": "w1"},
                                                {"name": "get_weather", "args": {"city": "Pisa"}, "id": "w2"}])
    out = asyncio.run(node.ainvoke([message]))
    assert [(m.tool_call_id, m.content) for m in out] == [("w1", "sunny and 21 C in Rome"),
                                                          ("w2", "sunny and 21 C in Pisa")]
