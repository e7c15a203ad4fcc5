"""Cancelling turns, reconciling lost unsafe calls, and Flower showing calls (real Redis and workers)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import pytest

from tests.cluster_helpers import TOOLS, call, effects, orchestrator, run_in_thread, wait_for
from tests.conftest import ROOT, free_port, worker_env
from toolchord.orchestrator import turn_wait
from toolchord.orchestrator.turn import TurnResult
from toolchord.worker import ErrorCode
from toolchord.worker.idempotency import PREFIX, idempotency_key

# Loaded 2-core machine: up to about 12 s (Flower).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _finished_in_log(log: Path, task_id: str) -> bool:
    """The worker logged that it is done with the task: it ran to the end, or it was discarded as revoked."""
    return any(task_id in line and ("succeeded" in line or "revoked" in line)
               for line in log.read_text(errors="replace").splitlines())


def test_cancel_stops_the_turn_and_unstarted_calls_never_start(start_worker, redis_url, clean_redis):
    worker = start_worker(TOOLS, concurrency=1)
    orch = orchestrator(redis_url)
    calls = [call(0, "effect_read", key="c-running", seconds=3), call(1, "effect_unsafe", key="c-queued")]
    thread, box = run_in_thread(orch.run_calls, "s-cancel", calls, turn_id="t1")
    wait_for(lambda: effects(clean_redis, "c-running") == 1, 20, "the first call to start")
    cancelled_at = time.monotonic()
    orch.cancel("s-cancel", "t1")
    thread.join(10)
    # The call runs 3 s: the turn ending before it (CANCELLED below) is what shows the cancel was seen.
    assert time.monotonic() - cancelled_at < 5, "run_calls did not return promptly after cancel"
    running, queued = box["value"].results
    assert running.error.code == ErrorCode.CANCELLED
    assert queued.error.code == ErrorCode.NOT_EXECUTED
    # The worker gets to the queued call once the running one is done: it must still not run.
    queued_task = orch.turns.record("s-cancel", "t1").dispatched[1].task_id
    wait_for(lambda: _finished_in_log(worker.log, queued_task), 30, "the worker to be done with the queued call")
    assert effects(clean_redis, "c-queued") == 0


@pytest.mark.parametrize(
    ("answer", "status", "code", "runs"),
    [("yes", "ok", None, 0), ("no", "ok", None, 1), ("unknown", "error", ErrorCode.OUTCOME_UNKNOWN, 0)],
)
def test_reconcile_decides_a_lost_unsafe_call(start_worker, redis_url, clean_redis, answer, status, code, runs):
    start_worker(TOOLS, concurrency=1)
    orch = orchestrator(redis_url)
    spec = orch.registry["effect_reconciled"]
    args = {"key": f"rec-{answer}", "answer": answer}
    # An earlier attempt started and lost its worker: its `started` record outlived its claim.
    key = idempotency_key(spec, "s-rec", "call_0", args)
    clean_redis.set(f"{PREFIX}{key}:started", "lost-token", ex=60)
    turn = orch.run_calls("s-rec", [call(0, "effect_reconciled", **args)])
    result = turn.results[0]
    assert result.status == status
    assert (result.error.code if result.error else None) == code
    assert effects(clean_redis, f"rec-{answer}") == runs


def _get(url: str, auth: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except urllib.error.URLError:
        return 0, b""  # not listening yet


def test_flower_shows_each_call_by_tool_and_call_id_behind_auth(start_worker, redis_url, tmp_path):
    start_worker(TOOLS, concurrency=1)
    port = free_port()
    env = worker_env(redis_url, TOOLS, FLOWER_BASIC_AUTH="ops:s3cret")
    log = (tmp_path / "flower.log").open("wb")
    flower = subprocess.Popen([sys.executable, "-m", "toolchord.orchestrator.cli", "flower", "--port", str(port)],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _get(f"{base}/healthcheck", None)[0] == 200, 20, "Flower to answer")
        assert _get(f"{base}/api/tasks", None)[0] == 401
        orch = orchestrator(redis_url)
        seen: dict = {}

        def shown() -> bool:
            status, body = _get(f"{base}/api/tasks", "ops:s3cret")
            assert status == 200
            seen.update({k: v for k, v in json.loads(body).items() if v.get("name") == "toolchord.call.read"})
            return bool(seen)

        # Flower attaches its event consumer some time after it answers: events sent before that
        # are not shown, so run turns (new sessions, same call) until one is.
        deadline = time.monotonic() + 20
        attempt = 0
        while not seen and time.monotonic() < deadline:
            attempt += 1
            orch.run_calls(f"s-flower-{attempt}", [call(7, "echo", text="hello")])
            try:
                wait_for(shown, 5, "Flower to show the call")
            except AssertionError:
                continue
        assert seen, "Flower showed no call in 20 s"
        task = next(iter(seen.values()))
        assert "echo call=call_7" in task["args"]
        assert "hello" not in json.dumps(task)  # neither arguments nor output are in events
    finally:
        flower.terminate()
        flower.wait(10)


@pytest.fixture
def no_cancel_flag_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting turns never read the cancel flag on their own: only the announcement can stop them."""
    monkeypatch.setattr(turn_wait, "_REMOTE_CANCEL_POLL", 600.0)


@pytest.mark.usefixtures("no_cancel_flag_poll")
def test_cancel_from_another_orchestrator_process_is_seen(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=1)
    waiting, other = orchestrator(redis_url), orchestrator(redis_url)
    calls = [call(0, "effect_read", key="r-running", seconds=8)]
    thread, box = run_in_thread(waiting.run_calls, "s-rc", calls, turn_id="t2")
    wait_for(lambda: effects(clean_redis, "r-running") == 1, 20, "the call to start")
    cancelled_at = time.monotonic()
    other.cancel("s-rc", "t2")  # only Redis carries this cancel to the waiting orchestrator
    thread.join(15)
    # With the flag poll off, CANCELLED before the 8 s call ends means the announcement was heard
    # (at the next quarter-second wait slice; the bound leaves room for a loaded machine).
    assert box["value"].results[0].error.code == ErrorCode.CANCELLED
    assert time.monotonic() - cancelled_at < 6, "a remote cancel must be seen within a wait slice"


@pytest.mark.usefixtures("no_cancel_flag_poll")
def test_async_turn_hears_a_remote_cancel_promptly(start_worker, redis_url, clean_redis):
    start_worker(TOOLS, concurrency=1)
    waiting, other = orchestrator(redis_url), orchestrator(redis_url)
    calls = [call(0, "effect_read", key="r-async", seconds=8)]

    async def run_and_cancel() -> tuple[float, TurnResult]:
        task = asyncio.create_task(waiting.arun_calls("s-arc", calls, turn_id="t3"))
        while effects(clean_redis, "r-async") == 0:
            await asyncio.sleep(0.05)
        cancelled_at = time.monotonic()
        other.cancel("s-arc", "t3")
        turn = await asyncio.wait_for(task, 15)
        await waiting.aclose()
        return time.monotonic() - cancelled_at, turn

    elapsed, turn = asyncio.run(run_and_cancel())
    # As above: only the announcement can end the turn before its 8 s call (one-second wait slices).
    assert turn.results[0].error.code == ErrorCode.CANCELLED
    assert elapsed < 6, f"the async wait saw the remote cancel after {elapsed:.2f} s"
    waiting.close()
    other.close()
