"""Tools the load test runs on real workers (`TOOLCHORD_TOOL_MODULES=toolchord.orchestrator.bench.load_tools`).

Every call counts its side effect in Redis under its `tag` (one tag per call of the load), so
the ledger can tell how often each call really ran. `*_inproc` tools run in the pool process
(`sandbox={"isolate": False}`) for the throughput figures; the others use the default sandbox.
`bare_call` does the same work as a plain Celery task, for the bare-Celery baseline.

The kill scenario SIGKILLs a worker while it runs chosen calls, not at a random moment: a call
asked to `hold` counts its effect, records its worker under `HELD_PREFIX + tag` and stays in its
handler until the driver kills that worker (or sets `RELEASE_KEY`). Only its first delivery
holds: the redelivery after the kill runs through.
"""

from __future__ import annotations

import os
import time
from functools import cache

import redis
from celery import shared_task
from celery.signals import worker_ready

from toolchord.worker import tool
from toolchord.worker.sandbox.profile import SandboxProfile

EFFECTS_PREFIX = "toolchord-bench:effects:"
READY_PREFIX = "toolchord-bench:ready:"
HELD_PREFIX = "toolchord-bench:held:"
RELEASE_KEY = "toolchord-bench:release"
# The bare-Celery baseline's tasks (`shared_task`: every app finalized after this import knows them).
BARE_CALL_TASK = "bench.load.bare_call"
BARE_COLLECT_TASK = "bench.load.bare_collect"
# The worker's name, set by bench.load for each worker it starts: a held call says where it holds.
WORKER_NAME_ENV = "TC_BENCH_WORKER"
_HOLD_POLL = 0.02
# Long enough that a queue backlog of a few thousand calls never hits a turn's deadline.
LOAD_TOOL_TIMEOUT = 60.0

# The ledger's Redis, set by bench.load_cluster. Sandboxed calls get this one variable through
# the profile's allow-list (the sandbox scrubs everything else, TOOLCHORD_* included).
LEDGER_URL_ENV = "TC_BENCH_LEDGER_URL"
_REDIS_URL = os.environ.get(LEDGER_URL_ENV, "")
_IN_PROCESS = SandboxProfile(isolate=False)
_SANDBOXED = SandboxProfile(env_allow=(*SandboxProfile().env_allow, LEDGER_URL_ENV, WORKER_NAME_ENV))


@cache
def _ledger(pid: int) -> redis.Redis:
    # Keyed by pid: a client inherited over fork must not be shared with the parent. A sandboxed
    # call may run in a process that imported this module with a scrubbed environment, so the
    # URL is looked up again when the call runs.
    return redis.Redis.from_url(os.environ.get(LEDGER_URL_ENV) or _REDIS_URL)


@worker_ready.connect
def _announce_ready(sender: object = None, **_: object) -> None:
    """Tell the load driver this worker consumes (log lines are off at load: they cost throughput)."""
    hostname = getattr(sender, "hostname", "")
    if _REDIS_URL and hostname:
        _ledger(os.getpid()).set(READY_PREFIX + hostname, str(time.time()))


def _act(tag: str, work_ms: float, hold: bool) -> int:
    ledger = _ledger(os.getpid())
    count = int(ledger.incr(EFFECTS_PREFIX + tag))
    if hold and ledger.set(HELD_PREFIX + tag, os.environ.get(WORKER_NAME_ENV, ""), nx=True):
        while not ledger.exists(RELEASE_KEY):
            time.sleep(_HOLD_POLL)
    if work_ms > 0:
        time.sleep(work_ms / 1000)
    return count


@tool(side_effect="read", timeout=LOAD_TOOL_TIMEOUT, sandbox=_IN_PROCESS)
def load_read_inproc(tag: str, work_ms: float = 0.0, hold: bool = False) -> int:
    """Count one run of this call, then work for `work_ms` (first holding until killed, if asked)."""
    return _act(tag, work_ms, hold)


@tool(side_effect="idempotent", timeout=LOAD_TOOL_TIMEOUT, sandbox=_IN_PROCESS)
def load_idempotent_inproc(tag: str, work_ms: float = 0.0, hold: bool = False) -> int:
    """Count one run of this call, then work for `work_ms` (first holding until killed, if asked)."""
    return _act(tag, work_ms, hold)


@tool(side_effect="unsafe", timeout=LOAD_TOOL_TIMEOUT, sandbox=_IN_PROCESS)
def load_unsafe_inproc(tag: str, work_ms: float = 0.0, hold: bool = False) -> int:
    """Count one run of this call, then work for `work_ms` (first holding until killed, if asked)."""
    return _act(tag, work_ms, hold)


@tool(side_effect="read", timeout=LOAD_TOOL_TIMEOUT, sandbox=_SANDBOXED)
def load_read_sandboxed(tag: str, work_ms: float = 0.0, hold: bool = False) -> int:
    """Count one run of this call, then work for `work_ms` (first holding until killed, if asked)."""
    return _act(tag, work_ms, hold)


@tool(side_effect="idempotent", timeout=LOAD_TOOL_TIMEOUT, sandbox=_SANDBOXED)
def load_idempotent_sandboxed(tag: str, work_ms: float = 0.0, hold: bool = False) -> int:
    """Count one run of this call, then work for `work_ms` (first holding until killed, if asked)."""
    return _act(tag, work_ms, hold)


@tool(side_effect="unsafe", timeout=LOAD_TOOL_TIMEOUT, sandbox=_SANDBOXED)
def load_unsafe_sandboxed(tag: str, work_ms: float = 0.0, hold: bool = False) -> int:
    """Count one run of this call, then work for `work_ms` (first holding until killed, if asked)."""
    return _act(tag, work_ms, hold)


@shared_task(name=BARE_CALL_TASK)
def bare_call(tag: str, work_ms: float = 0.0) -> int:
    """The baseline's call: the tools' work (count one run, then work for `work_ms`) as a plain Celery task."""
    return _act(tag, work_ms, False)


@shared_task(name=BARE_COLLECT_TASK)
def bare_collect(results: list[int]) -> list[int]:
    """The baseline chord's callback: hand the calls' results back."""
    return results
