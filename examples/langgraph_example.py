"""A LangGraph agent whose tool calls run on toolchord: `python examples/langgraph_example.py`.

The graph is the usual ReAct loop (model node -> tools node -> model node ...) with LangGraph's
`ToolNode` replaced by `ToolchordToolNode`. The model is a scripted OpenAI-compatible server that
this script starts itself, called with the real `openai` client, so no key or network is needed.
With no TOOLCHORD_BROKER_URL the calls run embedded (an in-process worker); with one set, start
`toolchord worker --tools weather_tools` (from this directory) and pass `Orchestrator(REGISTRY, create_app())`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypedDict, cast

from langchain_core.messages import (
    AIMessage,
    AnyMessage,
    HumanMessage,
    convert_to_openai_messages,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import tools_condition
from openai import OpenAI

# The tools live in their own module, importable by name: the sandbox zygote imports it and forks
# each call from there. Tools defined in this script (`__main__`) would run in a direct fork of
# the worker instead, whose memory they could read.
from weather_tools import REGISTRY

from toolchord.orchestrator.integrations.langgraph import ToolchordToolNode
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn

SCRIPT = [
    ScriptedTurn(text="Checking.", calls=[
        ScriptedCall(name="get_weather", arguments={"city": "Oslo"}),
        ScriptedCall(name="get_weather", arguments={"city": "Bergen"}),
        ScriptedCall(name="forecast", arguments={"city": "Oslo", "days": 3}),
        ScriptedCall(name="teleport", arguments={"to": "Oslo"}),
    ]),
    ScriptedTurn(calls=[ScriptedCall(name="book_table", arguments={"restaurant": "Maaemo", "people": 2})]),
    ScriptedTurn(text="Sunny in Oslo and Bergen; the forecast timed out; your table at Maaemo is booked."),
]


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def ai_message(choice_message: Any) -> AIMessage:
    """An AIMessage from an OpenAI chat completion message (invalid JSON arguments kept as invalid calls)."""
    calls, invalid = [], []
    for tc in choice_message.tool_calls or []:
        try:
            calls.append(tool_call(name=tc.function.name, args=json.loads(tc.function.arguments or "{}"), id=tc.id))
        except json.JSONDecodeError as exc:
            invalid.append(invalid_tool_call(name=tc.function.name, args=tc.function.arguments, id=tc.id,
                                             error=str(exc)))
    return AIMessage(content=choice_message.content or "", tool_calls=calls, invalid_tool_calls=invalid)


def build_graph(client: OpenAI, tools: ToolchordToolNode, model: str = "scripted") -> Any:
    """model -> tools -> model ... until the model answers without tool calls."""

    def call_model(state: State) -> dict[str, list[AnyMessage]]:
        response = client.chat.completions.create(
            # Plain JSON messages and tool declarations: what the SDK's TypedDict parameters describe.
            model=model,
            messages=cast(Any, convert_to_openai_messages(state["messages"])),
            tools=cast(Any, tools.tool_schemas),
        )
        return {"messages": [ai_message(response.choices[0].message)]}

    graph = StateGraph(State)
    graph.add_node("model", call_model)
    graph.add_node("tools", tools)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=InMemorySaver())


def main() -> int:
    with ScriptedModelServer(SCRIPT) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="example")
        graph = build_graph(client, ToolchordToolNode(REGISTRY))
        config = {"configurable": {"thread_id": "example-thread"}}
        state = graph.invoke({"messages": [HumanMessage("Weather in Oslo and Bergen? Book Maaemo for 2.")]}, config)
    for message in state["messages"]:
        if isinstance(message, AIMessage):
            names = ", ".join(tc["name"] for tc in message.tool_calls)
            print(f"model: {message.content or '(no text)'}" + (f"  → calls {names}" if names else ""))
        elif message.type == "tool":
            # An error's content already starts with its code ("TIMEOUT: ..."), as the model reads it.
            text = message.content.splitlines()[0]
            print(f"  ← {message.name} [{message.tool_call_id}] {text if message.status == 'error' else 'ok: ' + text}")
    final = state["messages"][-1]
    return 0 if isinstance(final, AIMessage) and not final.tool_calls else 1


if __name__ == "__main__":
    raise SystemExit(main())
