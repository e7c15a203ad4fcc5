"""MCP: a real stdio MCP server (tests/mcp_server.py, written with the `mcp` package's MCPServer)
registered into a Registry and called by real `toolchord worker` processes; and `toolchord mcp
serve` driven by the `mcp` package's own client over stdio."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.cluster_helpers import TOOLS, call, effects, run_in_thread, settings_for, wait_for
from tests.conftest import ROOT, free_port, worker_env
from toolchord.orchestrator import Agent, JsonlEventLog, Orchestrator
from toolchord.orchestrator.integrations.mcp import McpServer, mcp_tools, side_effect_for
from toolchord.orchestrator.providers import declarations
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.worker import ErrorCode, Registry
from toolchord.worker.celery_app import create_app
from toolchord.worker.idempotency import PREFIX

MCP_TOOLS = "tests.mcp_tools"


@pytest.fixture(scope="module")
def mcp_tools_module():
    from tests import mcp_tools

    return mcp_tools


def test_annotations_map_to_side_effect_classes_and_overrides_apply(mcp_tools_module):
    registry = mcp_tools_module.registry
    assert {spec.name: spec.side_effect for spec in registry} == {
        "lookup": "read", "put_value": "idempotent", "sleepy": "read", "effect": "unsafe", "fail": "unsafe",
        "crash": "unsafe"}
    assert registry["sleepy"].timeout == 1.0 and registry["lookup"].timeout == 30.0
    assert all(not spec.sandbox.isolate for spec in registry)
    declared = declarations(registry, "chat")[0]["function"]
    assert declared["name"] == "lookup" and declared["parameters"]["required"] == ["item"]
    assert side_effect_for(types.ToolAnnotations(idempotent_hint=True, destructive_hint=True)) == "unsafe"
    assert side_effect_for(None) == "unsafe"
    with pytest.raises(ValueError, match="does not list"):
        mcp_tools(mcp_tools_module.SERVER, overrides={"lookup_typo": {"side_effect": "read"}})


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_streamable_http_server_tools_run_embedded(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.mcp_server", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "server.log").open("wb"))
    try:
        wait_for(lambda: _listening(port) or proc.poll() is not None, 60, "the HTTP MCP server to listen")
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
        registry = Registry(mcp_tools(McpServer.http(f"http://127.0.0.1:{port}/mcp"), defaults={"timeout": 10}))
        orch = Orchestrator(registry)
        turn = orch.run_calls("http", [call(0, "lookup", item="x"), call(1, "put_value", key="k", value=3)])
        assert [r.content for r in turn.results] == ["found x", "k=3"]
        assert turn.results[1].data == {"result": "k=3"}
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_a_server_that_dies_mid_call_is_lost_then_restarted(mcp_tools_module):
    orch = Orchestrator(mcp_tools_module.registry)
    lost = orch.run_calls("crash", [call(0, "crash")]).results[0]
    # An unsafe call whose server died under it may have acted: never reported as failed-and-safe.
    assert lost.error is not None and lost.error.code == ErrorCode.OUTCOME_UNKNOWN
    assert "went away" in lost.content
    after = orch.run_calls("crash", [call(1, "lookup", item="z")]).results[0]
    assert after.content == "found z"


@pytest.mark.slow
def test_model_turn_on_workers_pairs_results_and_reports_timeout_and_unknown_tool(start_worker, redis_url, tmp_path):
    start_worker(MCP_TOOLS, concurrency=2)
    registry = Registry.from_modules([MCP_TOOLS])
    orch = Orchestrator(registry, create_app(settings_for(redis_url), registry))
    script = [
        ScriptedTurn(calls=[ScriptedCall(name="lookup", arguments={"item": "a"}),
                            ScriptedCall(name="sleepy", arguments={"seconds": 8}),
                            ScriptedCall(name="teleport", arguments={}),
                            ScriptedCall(name="fail", arguments={"reason": "disk full"}),
                            ScriptedCall(name="put_value", arguments={"key": "k", "value": 1})]),
        ScriptedTurn(text="done"),
    ]
    with ScriptedModelServer(script) as server:
        agent = Agent(registry, model="scripted", base_url=server.base_url + "/v1", api_key="t", orchestrator=orch,
                      event_log=JsonlEventLog(tmp_path))
        result = agent.run("go")
        second = server.requests[1].body["messages"]
    step = result.steps[0]
    assert [r.call_id for r in step.results] == [c.id for c in step.calls]
    assert [(r.status, r.error.code.value if r.error else None) for r in step.results] == [
        ("ok", None), ("error", "TIMEOUT"), ("error", "UNKNOWN_TOOL"), ("error", "EXECUTION_ERROR"), ("ok", None)]
    assert step.results[0].content == "found a" and "disk full" in step.results[3].content
    tool_messages = [m for m in second if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == [c.id for c in step.calls]
    assert "TIMEOUT" in tool_messages[1]["content"] and "UNKNOWN_TOOL" in tool_messages[2]["content"]
    assert result.text == "done"


@pytest.mark.slow
def test_unsafe_mcp_call_not_rerun_after_worker_sigkill_and_resubmission(start_worker, redis_url, clean_redis):
    victim = start_worker(MCP_TOOLS, concurrency=2, name="victim")
    registry = Registry.from_modules([MCP_TOOLS])
    orch = Orchestrator(registry, create_app(settings_for(redis_url), registry))
    calls = [call(0, "effect", key="mcp-u", seconds=3), call(1, "lookup", item="b")]
    thread, box = run_in_thread(orch.run_calls, "s-mcp-kill", calls)
    wait_for(lambda: effects(clean_redis, "mcp-u") == 1, 60, "the unsafe MCP tool to start")
    victim.kill()
    start_worker(MCP_TOOLS, concurrency=2, name="rescuer")
    thread.join(90)
    unsafe, read = box["value"].results
    assert unsafe.error is not None and unsafe.error.code == ErrorCode.OUTCOME_UNKNOWN
    assert read.content == "found b"  # re-run by the rescuer, through a session of its own
    # The caller retries the turn (same session and call ids): the stored results come back.
    again = orch.run_calls("s-mcp-kill", calls)
    assert [r.model_dump() for r in again.results] == [r.model_dump() for r in box["value"].results]
    assert effects(clean_redis, "mcp-u") == 1


async def _drive_served(env: dict[str, str]) -> dict[str, Any]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "toolchord.orchestrator.cli", "mcp", "serve",
                                                                  "--tools", TOOLS], env=env, cwd=str(ROOT))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = {t.name: t for t in (await session.list_tools()).tools}
        echo_a, echo_b, unknown, slow = await asyncio.gather(
            session.call_tool("echo", {"text": "a"}), session.call_tool("echo", {"text": "b"}),
            session.call_tool("teleport", {}), session.call_tool("slow", {"seconds": 8}))
    return {"listed": listed, "results": [echo_a, echo_b, unknown, slow]}


@pytest.mark.slow
def test_toolchord_mcp_serve_runs_calls_on_the_fleet(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=3)
    env = worker_env(redis_url, TOOLS)
    out = asyncio.run(_drive_served(env))
    listed = out["listed"]
    assert listed["echo"].annotations.read_only_hint is True
    assert listed["effect_idempotent"].annotations.idempotent_hint is True
    assert listed["effect_unsafe"].annotations.destructive_hint is True
    assert listed["echo"].input_schema["required"] == ["text"]
    echo_a, echo_b, unknown, slow = out["results"]
    texts = [r.content[0].text for r in (echo_a, echo_b, unknown, slow)]
    assert texts[:2] == ["a", "b"] and not echo_a.is_error
    assert unknown.is_error and "UNKNOWN_TOOL" in texts[2]
    assert slow.is_error and "TIMEOUT" in texts[3]
    assert slow.meta["toolchord"]["error_code"] == "TIMEOUT"
    # The calls ran on the worker: the orchestrator's call tasks went through this Redis.
    assert clean_redis.keys(PREFIX + "*")




@pytest.mark.slow
def test_the_example_runs_embedded_with_no_redis(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    env.update(PYTHONPATH=str(ROOT), TOOLCHORD_LOG_DIR=str(tmp_path / "logs"))
    done = subprocess.run([sys.executable, "examples/mcp_example.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for expected in ("[idempotent]", "[unsafe]", "TIMEOUT", "UNKNOWN_TOOL", "sent 1 notes to ann@example.com"):
        assert expected in done.stdout, done.stdout


@pytest.mark.slow
def test_mcp_serve_over_streamable_http_round_trips_into_a_registry(tmp_path):
    """toolchord tools served over HTTP, registered back through MCP: the classes survive both ways."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLCHORD_")}
    env["TOOLCHORD_LOG_DIR"] = str(tmp_path / "logs")
    proc = subprocess.Popen([sys.executable, "-m", "toolchord.orchestrator.cli", "mcp", "serve", "--tools", "toolchord.worker.demo_tools",
                             "--transport", "streamable-http", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "serve.log").open("wb"))
    try:
        wait_for(lambda: _listening(port) or proc.poll() is not None, 60, "toolchord mcp serve to listen")
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        registry = Registry(mcp_tools(McpServer.http(f"http://127.0.0.1:{port}/mcp")))
        served = Registry.from_modules(["toolchord.worker.demo_tools"])
        assert {s.name: s.side_effect for s in served} == {
            s.name: s.side_effect for s in registry if s.name != "read_output"}
        turn = Orchestrator(registry).run_calls("http-rt", [call(0, "lookup_order", order_id="A-1001"),
                                                            call(1, "lookup_order", order=1)])
        assert turn.results[0].status == "ok" and "A-1001" in turn.results[0].content
        # Checked against the served schema before dispatch, by the registering side.
        assert turn.results[1].error is not None and turn.results[1].error.code == ErrorCode.INVALID_ARGUMENTS
    finally:
        proc.terminate()
        proc.wait(10)


def test_mcp_serve_refuses_a_non_loopback_address(capsys):
    from toolchord.orchestrator.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["mcp", "serve", "--transport", "streamable-http", "--host", "0.0.0.0"])
    assert exited.value.code == 2 and "loopback addresses only" in capsys.readouterr().err
