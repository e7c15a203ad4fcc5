"""`toolchord demo`: a full multi-turn conversation on the embedded default, no network, no keys.

A scripted model server runs in-process and plays a model that calls the example tools of
`toolchord.worker.demo_tools`: one of each side-effect class, one that times out, one tool that does not
exist and one call with invalid arguments. The timeline of calls and results is printed as it
happens; the run ends with the model's final answer.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from toolchord.orchestrator.agent import Agent, AgentStep
from toolchord.orchestrator.event_stores import EventLog
from toolchord.orchestrator.scripted_model import ScriptedCall, ScriptedModelServer, ScriptedTurn
from toolchord.orchestrator.stores import open_event_log
from toolchord.worker.config import Settings
from toolchord.worker.models import ToolCall, ToolResult
from toolchord.worker.registry import Provider, Registry

DEMO_PROMPT = "Order A-1002 should go to 5 Oak Ave. Check my orders, fix the address, email me, and get a sales report."
DEMO_SYSTEM = "You are a shop assistant. Use the tools; never guess an order's state."


def demo_script() -> list[ScriptedTurn]:
    """The model's side of the demo conversation."""
    return [
        ScriptedTurn(
            reasoning="Look up both orders, fix the address, and fetch the report in parallel.",
            text="Let me check the orders first.",
            calls=[
                ScriptedCall(name="lookup_order", arguments={"order_id": "A-1001"}),
                ScriptedCall(name="set_shipping_address", arguments={"order_id": "A-1002", "address": "5 Oak Ave"}),
                ScriptedCall(name="cancel_order", arguments={"order_id": "A-1001"}),
                ScriptedCall(name="slow_report", arguments={"days": 7}),
            ],
        ),
        ScriptedTurn(
            text="The address is updated. Sending the confirmation and re-checking the order.",
            calls=[
                ScriptedCall(name="send_email", arguments={"to": "ann@example.com", "subject": "Address updated",
                                                           "body": "Order A-1002 now ships to 5 Oak Ave."}),
                ScriptedCall(name="lookup_order", arguments={"order": 1002}),
            ],
        ),
        ScriptedTurn(
            calls=[ScriptedCall(name="lookup_order", arguments={"order_id": "A-1002"})],
        ),
        ScriptedTurn(
            text=("Done: A-1001 has shipped, A-1002 will ship to 5 Oak Ave and you have a confirmation email. "
                  "The sales report timed out; I can retry it for a shorter period."),
        ),
    ]


def _one_line(text: str, limit: int = 110) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class Timeline:
    """Prints each step of a run: the model's text, each call, and each result."""

    def __init__(self, registry: Registry, out: TextIO = sys.stdout) -> None:
        self.registry = registry
        self.out = out

    def _call(self, call: ToolCall) -> str:
        spec = self.registry.get(call.name)
        kind = spec.side_effect if spec else "not in registry"
        return f"  → {call.name}({_one_line(call.arguments_raw, 80)})  [{kind}]"

    def _result(self, result: ToolResult) -> str:
        label = "ok" if result.status == "ok" else (result.error.code.value if result.error else "error")
        timing = f"{result.duration_ms:.0f} ms" if result.duration_ms else "not run"
        return f"  ← {result.name}: {label} ({timing}) {_one_line(result.content)}"

    def __call__(self, step: AgentStep) -> None:
        print(f"step {step.step} · model: {_one_line(step.text) if step.text else '(no text)'}", file=self.out)
        for call in step.calls:
            print(self._call(call), file=self.out)
        for result in step.results:
            print(self._result(result), file=self.out)
        for result in step.late_results:
            print(f"  ← late {self._result(result).lstrip(' ←')}", file=self.out)
        self.out.flush()


def run_demo(*, provider: Provider = "chat", stream: bool = False, log: EventLog | None = None,
             out: TextIO = sys.stdout) -> int:
    """Run the demo conversation; returns the process exit code (0 when it reached the final answer)."""
    from toolchord.worker.demo_tools import registry

    log = log if log is not None else open_event_log()
    timeline = Timeline(registry, out)
    runtime = "embedded runtime" if Settings.from_env().embedded else "cluster runtime (TOOLCHORD_BROKER_URL)"
    print(f"toolchord demo · provider {provider}{' (streaming)' if stream else ''} · {runtime}", file=out)
    print(f"user: {DEMO_PROMPT}", file=out)
    with ScriptedModelServer(demo_script(), model="scripted-demo") as server:
        base_url = server.base_url if provider == "anthropic" else server.base_url + "/v1"
        with Agent(registry, model="scripted-demo", provider=provider, base_url=base_url, api_key="demo",
                   event_log=log, system=DEMO_SYSTEM, stream=stream, max_steps=8, on_step=timeline) as agent:
            result = agent.run(DEMO_PROMPT)
    print(f"final answer: {result.text}", file=out)
    calls = sum(len(step.calls) for step in result.steps)
    print(f"{len(result.steps)} model calls, {calls} tool calls · session {result.session_id}", file=out)
    print(f"replay the requests with: toolchord replay {result.session_id}", file=out)
    summary = {"session_id": result.session_id, "stop_reason": result.stop_reason}
    print(json.dumps(summary), file=out)
    return 0 if result.stop_reason == "final" else 1


__all__ = ["DEMO_PROMPT", "Timeline", "demo_script", "run_demo"]
