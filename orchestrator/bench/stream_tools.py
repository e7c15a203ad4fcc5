"""What `bench.stream` runs on the worker: a tool that takes a given time (in the pool process, so
the figure is dispatch and waiting, not the sandbox's fork)."""

from __future__ import annotations

import time

from toolchord.worker import tool


@tool(side_effect="read", timeout=10, sandbox={"isolate": False})
def bench_nap(seconds: float) -> str:
    """Take `seconds`, then say so."""
    time.sleep(seconds)
    return f"slept {seconds}"
