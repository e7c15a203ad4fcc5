"""An OpenAI Agents SDK agent whose tool calls run through toolchord (docs/integrations/openai-agents.md).

    pip install '.[openai-agents]'
    python examples/openai_agents_example.py

Runs embedded (no broker, no Redis, no API key): a scripted OpenAI-compatible model server starts
in this process and plays a model that calls the demo tools of `worker.demo_tools` in parallel,
including a tool that does not exist and one that times out. Set TOOLCHORD_BROKER_URL (and start
`toolchord worker --tools worker.demo_tools`) to run the same calls on a worker fleet.
"""

from __future__ import annotations

import asyncio

from agents import Agent, OpenAIChatCompletionsModel, Runner
from openai import AsyncOpenAI

from orchestrator import Orchestrator, ScriptedCall, ScriptedModelServer, ScriptedTurn
from orchestrator.integrations.openai_agents import ToolchordTools
from worker.demo_tools import registry

SCRIPT = [
    ScriptedTurn(calls=[
        ScriptedCall(name="lookup_order", arguments={"order_id": "A-1001"}),
        ScriptedCall(name="lookup_order", arguments={"order_id": "A-1002"}),
        ScriptedCall(name="cancel_order", arguments={"order_id": "A-1001"}),
        ScriptedCall(name="slow_report", arguments={"days": 7}),
    ]),
    ScriptedTurn(text="A-1001 has shipped and A-1002 is being processed; the sales report timed out."),
]


async def main() -> None:
    orchestrator = Orchestrator(registry)  # embedded; pass app=worker.create_app() for a fleet
    tools = ToolchordTools(orchestrator, session_id="example-conversation")
    with ScriptedModelServer(SCRIPT) as server:
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="example")
        agent = Agent(name="shop assistant", instructions="Use the tools; never guess an order's state.",
                      model=OpenAIChatCompletionsModel(model="scripted", openai_client=client), tools=tools.tools)
        result = await Runner.run(agent, "Where are my orders? And get me a sales report.",
                                  run_config=tools.run_config(tracing_disabled=True))
        # What the model was told, call by call, in the request after its tool calls.
        calls = {c["id"]: c["function"]["name"] for m in server.requests[1].body["messages"] for c in m.get("tool_calls", [])}
        for message in server.requests[1].body["messages"]:
            if message["role"] == "tool":
                print(f"{message['tool_call_id']} {calls[message['tool_call_id']]} → {message['content'].splitlines()[0]}")
    print(f"final answer: {result.final_output}")
    await orchestrator.aclose()


if __name__ == "__main__":
    asyncio.run(main())
