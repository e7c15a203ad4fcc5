"""A Pydantic AI agent whose tool calls run through toolchord (docs/integrations/pydantic-ai.md).

    pip install '.[pydantic-ai]'
    python examples/pydantic_ai_example.py

Embedded: no broker, no Redis, no API key. The scripted model server of `toolchord demo` starts in
this process and plays the demo conversation over `worker.demo_tools` (parallel calls, a tool that
does not exist, one that times out, invalid arguments). With TOOLCHORD_BROKER_URL set and
`toolchord worker --tools worker.demo_tools` running, the same calls run on the worker fleet.
"""

from __future__ import annotations

import asyncio

from pydantic_ai import Agent
from pydantic_ai.messages import ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from orchestrator import Orchestrator, ScriptedModelServer
from orchestrator.demo import DEMO_PROMPT, DEMO_SYSTEM, demo_script
from orchestrator.integrations.pydantic_ai import ToolchordCapability, ToolchordToolset
from worker.demo_tools import registry


async def main() -> None:
    orchestrator = Orchestrator(registry)  # embedded; Orchestrator(registry, worker.create_app()) for a fleet
    toolset = ToolchordToolset(orchestrator)  # idempotency keys scoped by the run's conversation id
    with ScriptedModelServer(demo_script()) as server:
        model = OpenAIChatModel("scripted", provider=OpenAIProvider(base_url=server.base_url + "/v1", api_key="example"))
        agent = Agent(model, instructions=DEMO_SYSTEM, capabilities=[ToolchordCapability(toolset)])
        result = await agent.run(DEMO_PROMPT)
    for message in result.all_messages():
        for part in message.parts:
            if isinstance(part, ToolReturnPart):
                print(f"{part.tool_call_id} {part.tool_name} → {str(part.content).splitlines()[0]}")
    print(f"final answer: {result.output}")
    await orchestrator.aclose()


if __name__ == "__main__":
    asyncio.run(main())
