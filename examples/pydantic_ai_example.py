"""A Pydantic AI agent whose tool calls run through toolchord (docs/integrations/pydantic-ai.md).

    pip install '.[pydantic-ai]'
    python examples/pydantic_ai_example.py

Runs embedded (no broker, no Redis, no API key): a scripted OpenAI-compatible model server starts
in this process and plays a model that calls the demo tools of `worker.demo_tools` in parallel,
including a tool that does not exist and one that times out. Set TOOLCHORD_BROKER_URL (and start
`toolchord worker --tools worker.demo_tools`) to run the same calls on a worker fleet.
"""

from __future__ import annotations

import asyncio

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from orchestrator import Orchestrator, ScriptedCall, ScriptedModelServer, ScriptedTurn
from orchestrator.integrations.pydantic_ai import ToolchordCapability, ToolchordToolset
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
    toolset = ToolchordToolset(orchestrator)  # idempotency keys scoped by the run's conversation id
    with ScriptedModelServer(SCRIPT) as server:
        model = OpenAIChatModel("scripted", provider=OpenAIProvider(base_url=server.base_url + "/v1", api_key="example"))
        agent = Agent(model, instructions="Use the tools; never guess an order's state.",
                      capabilities=[ToolchordCapability(toolset)])
        result = await agent.run("Where are my orders? And get me a sales report.")
        # What the model was told, call by call, in the request after its tool calls.
        calls = {c["id"]: c["function"]["name"] for m in server.requests[1].body["messages"] for c in m.get("tool_calls", [])}
        for message in server.requests[1].body["messages"]:
            if message["role"] == "tool":
                print(f"{message['tool_call_id']} {calls[message['tool_call_id']]} → {message['content'].splitlines()[0]}")
    print(f"final answer: {result.output}")
    await orchestrator.aclose()


if __name__ == "__main__":
    asyncio.run(main())
