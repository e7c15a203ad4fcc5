"""Per-call cost of the sandbox: run_isolated against calling the handler in-process.

Run with `python -m bench.sandbox [--calls N]`. Prints the active layers, the median time of both
ways to run a trivial handler, and the median overhead against the 5 ms target.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from worker import ToolContext, call_handler, tool
from worker.sandbox import describe_layers, run_isolated

TARGET_MS = 5.0


@tool(side_effect="read", timeout=10)
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _median_ms(run: Callable[[], object], calls: int) -> float:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    """Measure and print the median per-call overhead of the sandbox."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    options = parser.parse_args()
    args = add.args_model(a=2, b=3)
    context = ToolContext(
        call_id="bench",
        session_id="bench",
        tool_name="add",
        idempotency_key="bench",
        deadline=time.time() + 3600,
    )
    print(describe_layers())
    for _ in range(10):  # warm up: probe, compiled seccomp filter, page cache
        run_isolated(add, args, context)
    outcome = run_isolated(add, args, context)
    assert outcome.status == "ok" and outcome.content == "5", outcome
    in_process = _median_ms(lambda: call_handler(add, args, context), options.calls)
    isolated = _median_ms(lambda: run_isolated(add, args, context), options.calls)
    overhead = isolated - in_process
    print(f"layers applied per call: {', '.join(outcome.sandbox_layers)}")
    print(
        f"in-process call_handler: median {in_process:8.3f} ms over {options.calls} calls"
    )
    print(
        f"sandboxed run_isolated:  median {isolated:8.3f} ms over {options.calls} calls"
    )
    verdict = "within" if overhead < TARGET_MS else "ABOVE"
    print(
        f"sandbox overhead:        median {overhead:8.3f} ms per call ({verdict} the {TARGET_MS:g} ms target)"
    )


if __name__ == "__main__":
    main()
