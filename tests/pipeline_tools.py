"""Tools and helpers for the pipeline tests: provider-shaped assistant outputs, one turn in process.

The tools are module-level (as users write them) and run through the real sandbox unless a test
needs speed (`isolate=False`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel

from toolchord.orchestrator.pipeline import PermissionHook, Pipeline
from toolchord.orchestrator.providers import get_adapter
from toolchord.worker import Registry, ToolCall, ToolContext, ToolOutput, ToolResult, tool
from toolchord.worker.registry import Provider

PROVIDER_IDS: list[Provider] = ["chat", "anthropic", "responses"]
SECRETS = ("hunter2-very-secret", "sk-live-0123456789abcdefXYZ", "eyJhbGciOiJIUzI1NiJ9.payload.sig")
FLOOD_CHARS = 120_000


@tool(side_effect="read", timeout=5)
def read_file(path: str, max_lines: int = 100) -> str:
    """Read the first lines of a text file."""
    return f"contents of {path} ({max_lines} lines)"


@tool(side_effect="read", timeout=5)
def list_dir(path: str) -> list[str]:
    """List a directory."""
    return [f"{path}/a.txt", f"{path}/b.txt"]


@tool(side_effect="idempotent", timeout=5)
def write_file(path: str, text: str) -> str:
    """Write a text file."""
    return f"wrote {len(text)} chars to {path}"


@tool(side_effect="read", timeout=5)
def explode(reason: str) -> str:
    """Fail on purpose."""
    raise ValueError(f"disk on fire: {reason}")


@tool(side_effect="read", timeout=5)
def silent() -> None:
    """Return nothing."""


def flood_text() -> str:
    """The long output `flood` returns: numbered lines, distinct head and tail."""
    lines = [f"line {n:06d} " + "x" * 40 for n in range(FLOOD_CHARS // 52 + 1)]
    return ("HEAD-MARKER\n" + "\n".join(lines))[: FLOOD_CHARS - len("\nTAIL-MARKER")] + "\nTAIL-MARKER"


@tool(side_effect="read", timeout=5, max_output_chars=2_000)
def flood() -> str:
    """Return far more text than the budget allows."""
    return flood_text()


@tool(side_effect="read", timeout=5)
async def fetch_async(url: str) -> str:
    """Fetch a URL (pretend), after an await."""
    await asyncio.sleep(0.001)
    return f"fetched {url} asynchronously"


@tool(side_effect="read", timeout=5)
def fetch_sync(url: str) -> str:
    """Fetch a URL (pretend), synchronously."""
    return f"fetched {url} synchronously"


@tool(side_effect="idempotent", timeout=7)
def whoami(ctx: ToolContext, note: str = "") -> dict[str, Any]:
    """Report the context the handler received."""
    return {
        "call_id": ctx.call_id,
        "session_id": ctx.session_id,
        "tool_name": ctx.tool_name,
        "idempotency_key": ctx.idempotency_key,
        "deadline": ctx.deadline,
        "remaining": ctx.remaining,
        "note": note,
    }


@tool(side_effect="idempotent", timeout=5, idempotency_key=lambda args: f"order-{args['order_id']}")
def pay(ctx: ToolContext, order_id: str, cents: int) -> str:
    """Pay an order once."""
    return ctx.idempotency_key


class Weather(BaseModel):
    city: str
    celsius: float
    sky: Literal["clear", "cloudy", "rain"]


@tool(side_effect="read", timeout=5)
def weather_dict(city: str) -> dict[str, Any]:
    """Weather as a dict."""
    return {"city": city, "celsius": 21.5, "sky": "clear"}


@tool(side_effect="read", timeout=5)
def weather_model(city: str) -> Weather:
    """Weather as a pydantic model."""
    return Weather(city=city, celsius=-3.0, sky="rain")


@tool(side_effect="read", timeout=5)
def weather_output(city: str) -> ToolOutput:
    """Weather with separate text and data."""
    return ToolOutput(content=f"It is cloudy in {city}.", data={"city": city, "celsius": 12.0, "sky": "cloudy"})


@tool(side_effect="unsafe", risk="high", timeout=5)
def deploy(service: str) -> str:
    """Deploy a service to production."""
    return f"deployed {service}"


@tool(side_effect="unsafe", timeout=5)
def send_mail(to: str, body: str) -> str:
    """Send an e-mail."""
    return f"sent to {to}"


@tool(side_effect="read", timeout=5)
def login(username: str, password: str, api_key: str, retries: int = 1) -> str:
    """Log in to a service."""
    return f"logged in as {username}"


@tool(side_effect="read", sandbox={"isolate": False})
def echo(text: str, times: int = 1) -> str:
    """Echo text (in-process, for speed)."""
    return text * times


@tool(side_effect="read", sandbox={"isolate": False})
def scale(factor: float, tags: dict[str, Any] | None = None) -> float:
    """Multiply by two (in-process): takes any JSON number, and free-form data."""
    return factor * 2


ALL_TOOLS = [
    read_file, list_dir, write_file, explode, silent, flood, fetch_async, fetch_sync, whoami, pay,
    weather_dict, weather_model, weather_output, deploy, send_mail, login, echo, scale,
]


def make_pipeline(permission_hook: PermissionHook | None = None) -> Pipeline:
    """A pipeline over every test tool (plus the built-in read_output the pipeline adds)."""
    return Pipeline(Registry(ALL_TOOLS), permission_hook=permission_hook)


def call_id(provider: Provider, n: int) -> str:
    """An id in the provider's own style."""
    return {"chat": f"call_{n:04d}abc", "anthropic": f"toolu_01{n:04d}XYZ", "responses": f"call_r{n:04d}"}[provider]


def assistant_output(provider: Provider, calls: list[tuple[str, str, Any]], text: str = "Let me check.") -> Any:
    """An assistant output in the provider's shape with the given (id, name, arguments) calls.

    Arguments are JSON text or an object. Anthropic `input` is always an object: text that is not a
    JSON object is carried the way the adapter documents for streamed invalid input.
    """
    if provider == "chat":
        return {
            "role": "assistant",
            "content": text,
            "tool_calls": [
                {
                    "id": cid,
                    "type": "function",
                    "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
                }
                for cid, name, args in calls
            ],
        }
    if provider == "anthropic":
        from toolchord.orchestrator.providers.anthropic_messages import INVALID_JSON_KEY

        blocks: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for cid, name, args in calls:
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = None
                args = parsed if isinstance(parsed, dict) else {INVALID_JSON_KEY: args}
            blocks.append({"type": "tool_use", "id": cid, "name": name, "input": args})
        return {"id": "msg_01", "type": "message", "role": "assistant", "content": blocks,
                "stop_reason": "tool_use"}
    output: list[dict[str, Any]] = [
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": []}]}
    ]
    for n, (cid, name, args) in enumerate(calls):
        output.append({
            "type": "function_call", "id": f"fc_{n}", "call_id": cid, "name": name,
            "arguments": args if isinstance(args, str) else json.dumps(args), "status": "completed",
        })
    return {"id": "resp_1", "object": "response", "output": output}


def rendered_pairs(provider: Provider, items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(call id, content) of each rendered result item, in order."""
    if provider == "chat":
        assert all(item["role"] == "tool" for item in items)
        return [(item["tool_call_id"], item["content"]) for item in items]
    if provider == "anthropic":
        (message,) = items
        assert message["role"] == "user"
        assert all(block["type"] == "tool_result" for block in message["content"])
        return [(block["tool_use_id"], block["content"]) for block in message["content"]]
    assert all(item["type"] == "function_call_output" for item in items)
    return [(item["call_id"], item["output"]) for item in items]


def run_turn(
    pipeline: Pipeline, provider: Provider, output: Any, session_id: str = "sess-1"
) -> tuple[list[ToolCall], list[ToolResult]]:
    """Parse, run every call through the pipeline, render, and check the items pair with the calls."""
    adapter = get_adapter(provider)
    calls = adapter.parse_calls(output)
    results = pipeline.run_all(calls, session_id)
    items = adapter.result_items(results)
    pairs = rendered_pairs(provider, items)
    assert [cid for cid, _ in pairs] == [call.id for call in calls]
    assert [content for _, content in pairs] == [result.content for result in results]
    assert all(content for _, content in pairs)
    if provider == "anthropic" and items:
        flags = [block["is_error"] for block in items[0]["content"]]
        assert flags == [result.status == "error" for result in results]
    for call, result in zip(calls, results, strict=True):
        assert (result.call_id, result.name) == (call.id, call.name)
    return calls, results


def run_one(pipeline: Pipeline, provider: Provider, name: str, args: Any, n: int = 1) -> ToolResult:
    """One call of `name` in the provider's shape, run the whole way; its single result."""
    _, (result,) = run_turn(pipeline, provider, assistant_output(provider, [(call_id(provider, n), name, args)]))
    return result
