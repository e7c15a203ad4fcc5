"""A Pydantic AI agent whose toolset runs its calls through toolchord.

    pip install '.[pydantic-ai]' && python examples/pydantic_ai_example.py

No Redis and no API key needed: toolchord runs embedded and the script serves the model itself
(the scripted conversation of `toolchord demo`). What it prints: docs/integrations/pydantic-ai.md.
"""

from __future__ import annotations

import asyncio

from pydantic_ai import Agent
from pydantic_ai.messages import ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from toolchord import Orchestrator
from toolchord.orchestrator.demo import DEMO_PROMPT, DEMO_SYSTEM, demo_script
from toolchord.orchestrator.integrations.pydantic_ai import ToolchordCapability, ToolchordToolset
from toolchord.testing import ScriptedModelServer
from toolchord.worker.demo_tools import registry


async def main() -> None:
    orchestrator = Orchestrator(registry)  # embedded; Orchestrator(registry, create_app()) for a fleet
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
