"""The README's headline calls, as a new user would write them: `Orchestrator.run_turn` on an
assistant message, `TurnResult.to_messages()` appended to the conversation, and `arun_turn`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletion

from toolchord.orchestrator import Orchestrator, check_pairing, get_adapter
from toolchord.worker import Registry, ToolContext, tool

REFUNDS: list[tuple[str, int]] = []


@tool(side_effect="read", timeout=10, sandbox={"isolate": False})
def get_order(order_id: str) -> dict[str, Any]:
    """Look up an order by id."""
    return {"order_id": order_id, "status": "shipped"}


@tool(side_effect="unsafe", idempotency_key=lambda args: args["order_id"], sandbox={"isolate": False})
def refund(order_id: str, cents: int, ctx: ToolContext) -> str:
    """Refund an order (at most once per order)."""
    REFUNDS.append((order_id, cents))
    return f"refunded {cents} on {order_id}"


@pytest.fixture(scope="module")
def orch() -> Iterator[Orchestrator]:
    orchestrator = Orchestrator(Registry([get_order, refund]))
    yield orchestrator
    orchestrator.close()


def _chat_completion(suffix: str) -> ChatCompletion:
    return ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_get_{suffix}", "type": "function",
                 "function": {"name": "get_order", "arguments": f'{{"order_id": "o-{suffix}"}}'}},
                {"id": f"call_refund_{suffix}", "type": "function",
                 "function": {"name": "refund", "arguments": f'{{"order_id": "o-{suffix}", "cents": 500}}'}},
            ]}}],
    })


def test_run_turn_and_to_messages_continue_a_chat_conversation(orch: Orchestrator) -> None:
    completion = _chat_completion("1")
    assistant_message = completion.choices[0].message
    messages: list[dict[str, Any]] = [{"role": "user", "content": "refund o-1"}]
    messages += get_adapter("chat").assistant_items(assistant_message)
    turn = orch.run_turn("session-readme-1", assistant_message, provider="chat")
    messages += turn.to_messages()
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_get_1", "content": '{"order_id": "o-1", "status": "shipped"}'},
        {"role": "tool", "tool_call_id": "call_refund_1", "content": "refunded 500 on o-1"},
    ]
    check_pairing("chat", {"messages": messages})
    # The same turn again (a retry after a crash) runs nothing twice.
    assert orch.run_turn("session-readme-1", assistant_message, provider="chat").results == turn.results
    assert REFUNDS.count(("o-1", 500)) == 1


def test_arun_turn_is_the_async_twin(orch: Orchestrator) -> None:
    message = Message.model_validate({
        "id": "msg", "type": "message", "role": "assistant", "model": "m", "stop_reason": "tool_use",
        "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1},
        "content": [{"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_a", "name": "get_order", "input": {"order_id": "o-2"}},
                    {"type": "tool_use", "id": "toolu_b", "name": "get_orders", "input": {}}],
    })

    async def one_turn() -> list[dict[str, Any]]:
        turn = await orch.arun_turn("session-readme-2", message, provider="anthropic")
        await orch.aclose()
        return turn.to_messages()

    (user,) = asyncio.run(one_turn())
    assert user["role"] == "user"
    first, second = user["content"]
    assert (first["tool_use_id"], first["is_error"]) == ("toolu_a", False)
    assert (second["tool_use_id"], second["is_error"]) == ("toolu_b", True)
    assert second["content"].startswith("UNKNOWN_TOOL")
    check_pairing("anthropic", {"messages": get_adapter("anthropic").assistant_items(message) + [user]})
