"""An MCP server's tools run by toolchord: `python examples/mcp_example.py`.

toolchord starts examples/mcp_example_server.py over stdio, lists its tools (side-effect classes
from their annotations, one overridden), and an agent played by a scripted OpenAI-compatible
server (started here) calls them. With no TOOLCHORD_BROKER_URL everything runs in this process;
on a fleet, put the `registry = mcp_registry(...)` line in a tools module and start
`toolchord worker --tools that.module`: each worker process keeps its own session to the server.
"""

from __future__ import annotations

import sys
from pathlib import Path

from toolchord import Agent, AgentStep
from toolchord.orchestrator.integrations.mcp import McpServer, mcp_registry
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn

SERVER = McpServer.stdio(sys.executable, [str(Path(__file__).with_name("mcp_example_server.py"))], name="notes")
registry = mcp_registry(SERVER, overrides={"export_notes": {"timeout": 1.0, "max_retries": 0}})

SCRIPT = [
    ScriptedTurn(text="Looking.", calls=[
        ScriptedCall(name="search_notes", arguments={"query": "meetings"}),
        ScriptedCall(name="save_note", arguments={"title": "summary", "text": "standup + retro"}),
        ScriptedCall(name="export_notes", arguments={"fmt": "pdf"}),
        ScriptedCall(name="print_notes", arguments={}),
    ]),
    ScriptedTurn(calls=[ScriptedCall(name="send_notes", arguments={"to": "ann@example.com"})]),
    ScriptedTurn(text="Saved a summary and sent the notes; the PDF export timed out and printing is not available."),
]


def show(step: AgentStep) -> None:
    for call in step.calls:
        spec = registry.get(call.name)
        print(f"→ {call.name}({call.arguments_raw}) [{spec.side_effect if spec else 'not a tool'}]")
    for result in step.results:
        label = result.error.code.value if result.error else "ok"
        print(f"  ← {result.name} [{result.call_id}] {label}: {result.content.splitlines()[0]}")


def main() -> int:
    with ScriptedModelServer(SCRIPT) as model, Agent(
        registry, model="scripted", base_url=model.base_url + "/v1", api_key="example", on_step=show
    ) as agent:
        result = agent.run("Summarize my meeting notes and send them to Ann.")
    print(f"final answer: {result.text}")
    return 0 if result.stop_reason == "final" else 1


if __name__ == "__main__":
    raise SystemExit(main())
