"""CPU cost of reading hostile model input: redaction, excerpts, argument checks, stream assembly.

Run with `python -m toolchord.orchestrator.bench.inputs [--sizes 1,10]` (megabytes). For each function that
reads model-supplied text it prints the CPU seconds for each size and the growth factor between
the smallest and the largest: about the size ratio for a linear function (the unit tests in
tests/test_linear_inputs.py enforce that; this prints the figures).
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from collections.abc import Callable
from typing import Any

from toolchord.orchestrator.pipeline import prepare_call
from toolchord.orchestrator.providers import get_adapter
from toolchord.worker import Registry, ToolCall, tool
from toolchord.worker.redaction import excerpt, redact_text
from toolchord.worker.shaping import cap_content

MB = 1_000_000


@tool(side_effect="read", sandbox={"isolate": False})
def store_text(text: str) -> str:
    """Take a text."""
    return str(len(text))


_REGISTRY = Registry([store_text])


def hostile_text(size: int) -> str:
    """Long base64 runs, repeated credential words, unclosed quotes: what made the old regex quadratic."""
    unit = (
        base64.b64encode(bytes(range(256)) * 12).decode()
        + " " + "token" * 400 + " " + "password" * 100 + "=" + " " + '"' * 200 + " sk-" + "-" * 300
        + " ://a:" + "b" * 300 + " bearer " + " " * 200 + "x "
    )
    return (unit * (size // len(unit) + 1))[:size]


def responses_stream_events(size: int) -> list[dict[str, Any]]:
    """A Responses stream of one call whose arguments (hostile text of `size`) arrive in 1 KB deltas."""
    raw = json.dumps({"text": hostile_text(size)})
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "store_text", "arguments": ""}
    events: list[dict[str, Any]] = [{"type": "response.output_item.added", "output_index": 0, "item": item}]
    events += [{"type": "response.function_call_arguments.delta", "output_index": 0, "delta": raw[i:i + 1024]}
               for i in range(0, len(raw), 1024)]
    events.append({"type": "response.function_call_arguments.done", "output_index": 0})
    return events


def _assemble(events: list[dict[str, Any]]) -> object:
    accumulator = get_adapter("responses").stream_accumulator()
    for event in events:
        accumulator.feed(event)
    return accumulator.finish()


CASES: dict[str, tuple[Callable[[int], Any], Callable[[Any], object]]] = {
    "redact_text": (hostile_text, redact_text),
    "excerpt": (hostile_text, excerpt),
    "prepare_call (over the cap)": (
        lambda size: ToolCall(id="c", name="store_text", arguments_raw='{"text": "' + hostile_text(size)),
        lambda call: prepare_call(call, _REGISTRY, "s"),
    ),
    "prepare_call (truncated JSON, cap raised)": (
        lambda size: ToolCall(id="c", name="store_text", arguments_raw='{"text": "' + hostile_text(size)),
        lambda call: prepare_call(call, _REGISTRY, "s", max_argument_bytes=1 << 30),
    ),
    "cap_content": (hostile_text, lambda text: cap_content(text, 20_000, None)),
    "responses stream (1 KB deltas)": (responses_stream_events, _assemble),
}


def measure(make: Callable[[int], Any], fn: Callable[[Any], object], size: int) -> float:
    """CPU seconds of one call of `fn` on an input of `size` characters."""
    value = make(size)
    start = time.process_time()
    fn(value)
    return time.process_time() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,10", help="comma-separated input sizes in MB")
    args = parser.parse_args(argv)
    sizes = [int(float(part) * MB) for part in args.sizes.split(",")]
    print(f"{'function':45} " + " ".join(f"{size / MB:>8g} MB" for size in sizes) + "   growth")
    for name, (make, fn) in CASES.items():
        times = [measure(make, fn, size) for size in sizes]
        growth = times[-1] / max(times[0], 1e-6)
        print(f"{name:45} " + " ".join(f"{t:>9.3f}s" for t in times) + f"   {growth:6.1f}x")


if __name__ == "__main__":
    main()
