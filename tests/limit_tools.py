"""Tools with fleet-wide limits for the flow-control tests: handlers record in Redis how many run at
once and when each started (they run in the worker process: isolation would only slow them)."""

from __future__ import annotations

import os
import time

import redis

from toolchord.worker import tool
from toolchord.worker.limits import Limit

IN_PROCESS = {"isolate": False}
POOL = Limit(name="tc-test-pool", concurrency=5)
PAYMENTS = Limit(name="tc-test-payments", rate="20/s", burst=5)
# INCR the in-flight count and keep its maximum, in one step.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def ledger() -> redis.Redis:
    return redis.Redis.from_url(os.environ["TC_TEST_LEDGER"])


@tool(sandbox=IN_PROCESS, side_effect="read", limits=POOL, timeout=60)
def pool_call(n: int, seconds: float, hold: bool = False) -> int:
    """Run `seconds` while counting how many calls of the pool run at once; with `hold`, only while
    `tc-test:pool:hold` exists."""
    client = ledger()
    client.eval(_ENTER, 2, "tc-test:pool:inflight", "tc-test:pool:max")
    try:
        if hold:
            until = time.time() + seconds
            while time.time() < until and client.exists("tc-test:pool:hold"):
                time.sleep(0.05)
        else:
            time.sleep(seconds)
    finally:
        client.decr("tc-test:pool:inflight")
    client.incr("tc-test:pool:done")
    return n


@tool(sandbox=IN_PROCESS, side_effect="unsafe", limits=POOL)
def pool_unsafe(n: int, seconds: float) -> int:
    """Act once (counted), holding a permit of the pool for a while."""
    client = ledger()
    client.incr(f"tc-test:effects:pool-{n}")
    client.set("tc-test:pool:started", n)
    time.sleep(seconds)
    return n


@tool(sandbox=IN_PROCESS, side_effect="read", limits=PAYMENTS)
def pay(n: int) -> int:
    """Record when the call started (the payments API allows 20/s, 5 at once)."""
    ledger().rpush("tc-test:payments:starts", repr(time.time()))
    return n


# One call at a time per tenant: the flow-visibility tests hold a lane and watch the next call wait.
LANE = Limit(name="tc-test-lane", concurrency=1, key=lambda args, ctx: ctx.tenant)


@tool(sandbox=IN_PROCESS, side_effect="read", limits=LANE, timeout=60)
def lane_call(n: int, seconds: float = 40) -> int:
    """Hold the caller's lane while `tc-test:lane:hold` exists (at most `seconds`); record the start."""
    client = ledger()
    client.sadd("tc-test:lane:started", n)
    until = time.time() + seconds
    while time.time() < until and client.exists("tc-test:lane:hold"):
        time.sleep(0.05)
    return n
