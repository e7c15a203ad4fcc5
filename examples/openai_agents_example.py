"""An OpenAI Agents SDK agent whose function tools run through toolchord.

    pip install '.[openai-agents]' && python examples/openai_agents_example.py

Plays the `toolchord demo` conversation from a scripted model server this script starts, with
toolchord embedded (no Redis, no key); docs/integrations/openai-agents.md explains each line printed.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from agents import Agent, OpenAIChatCompletionsModel, Runner
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from toolchord import Orchestrator
from toolchord.orchestrator.demo import DEMO_PROMPT, DEMO_SYSTEM, demo_script
from toolchord.orchestrator.integrations.openai_agents import ToolchordTools
from toolchord.testing import ScriptedModelServer
from toolchord.worker.demo_tools import registry


async def main() -> None:
    orchestrator = Orchestrator(registry)  # embedded; Orchestrator(registry, create_app()) for a fleet
    tools = ToolchordTools(orchestrator, session_id="example-conversation")
    with ScriptedModelServer(demo_script()) as server:
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="example")
        agent = Agent(name="shop assistant", instructions=DEMO_SYSTEM, tools=tools.tools,
                      model=OpenAIChatCompletionsModel(model="scripted", openai_client=client))
        result = await Runner.run(agent, DEMO_PROMPT, run_config=tools.run_config(tracing_disabled=True))
    # raw items are the SDK's unions of every tool kind; these are function calls and their outputs.
    calls: list[Any] = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    names = {raw.call_id: raw.name for raw in calls}
    for item in result.new_items:
        if isinstance(item, ToolCallOutputItem):
            call_id = cast(Any, item.raw_item)["call_id"]
            print(f"{call_id} {names[call_id]} → {str(item.output).splitlines()[0]}")
    print(f"final answer: {result.final_output}")
    await orchestrator.aclose()


if __name__ == "__main__":
    asyncio.run(main())
