"""Tools for the RabbitMQ priority tests: each handler appends its label to `tc-test:order` when it
starts, so the test reads the order the worker took the calls in (in the worker process: isolation
would only slow them)."""

from __future__ import annotations

import os

import redis

from toolchord.worker import tool

IN_PROCESS = {"isolate": False}
ORDER = "tc-test:order"
GATE = "tc-test:gate"


def ledger() -> redis.Redis:
    return redis.Redis.from_url(os.environ["TC_TEST_LEDGER"])


@tool(sandbox=IN_PROCESS, side_effect="read", timeout=60)
def gate(label: str) -> str:
    """Record the start, then hold the worker's only process until the test pushes to the gate."""
    client = ledger()
    client.rpush(ORDER, label)
    client.blpop([GATE], timeout=50)
    return label


@tool(sandbox=IN_PROCESS, side_effect="read")
def mark(label: str) -> str:
    """Record the start."""
    ledger().rpush(ORDER, label)
    return label


@tool(sandbox=IN_PROCESS, side_effect="read", max_retries=3)
def flaky(key: str, failures: int) -> int:
    """Fail with a connection error `failures` times (a retried error for a read tool), then succeed."""
    count = int(ledger().incr(f"tc-test:attempts:{key}"))
    if count <= failures:
        raise ConnectionError(f"attempt {count} failed")
    return count
