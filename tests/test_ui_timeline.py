"""The session timeline page (`toolchord ui`) in a real headless browser, over a real cluster.

A scripted model asks for 50 calls in one turn; real workers run them; the page, opened before the
session exists, must show it live and draw every call with its result, attempts and worker. The
screenshot lands in the test's directory (and at $TC_UI_SCREENSHOT when set: docs/ui-timeline.png).
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster_helpers import TOOLS, orchestrator, run_in_thread
from tests.test_eager_dispatch import one_eager_turn
from toolchord.orchestrator.agent import Agent
from toolchord.orchestrator.event_stores import RedisEventLog
from toolchord.orchestrator.ui import TimelineServer
from toolchord.testing import ScriptedCall, ScriptedModelServer, ScriptedTurn

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def fifty_calls() -> list[ScriptedCall]:
    calls = [ScriptedCall(name="echo", arguments={"text": f"item {i}"}) for i in range(44)]
    calls += [ScriptedCall(name="flaky_read", arguments={"key": f"ui-{i}", "failures": 1}) for i in range(3)]
    calls += [ScriptedCall(name="slow", arguments={"seconds": 3}) for _ in range(2)]
    calls.append(ScriptedCall(name="no_such_tool", arguments={}))
    return calls


@pytest.fixture
def browser_page() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        yield page
        browser.close()


@pytest.mark.slow
def test_a_fifty_call_session_appears_live_and_is_drawn(start_worker, redis_url, tmp_path: Path, browser_page) -> None:
    start_worker(TOOLS, concurrency=4, name="ui-worker")
    server = TimelineServer(RedisEventLog(redis_url), RedisEventLog(redis_url).redis, port=0)
    server.start()
    page = browser_page
    try:
        page.goto(server.url)
        page.wait_for_selector("#status:has-text('live')")
        script = [ScriptedTurn(text="Fifty at once.", calls=fifty_calls()), ScriptedTurn(text="Done.")]
        with ScriptedModelServer(script, model="scripted-ui") as model:
            agent = Agent(orchestrator(redis_url).registry, model="scripted-ui", base_url=model.base_url + "/v1",
                          api_key="test", orchestrator=orchestrator(redis_url), event_log=RedisEventLog(redis_url))
            thread, box = run_in_thread(agent.run, "run fifty calls", session_id="ui-fifty")
            # The page was loaded before the session existed: the refresh brings it in.
            page.click("nav a:has-text('ui-fifty')", timeout=60_000)
            # Drawn while it runs: calls still queued or running show as such.
            page.wait_for_selector("section.turn .label .code-queued, section.turn .label .code-running",
                                   timeout=60_000)
            thread.join(120)
        assert box["value"].stop_reason == "final"
        labels = page.locator("section.turn .label")
        page.wait_for_function(
            "() => document.querySelectorAll('section.turn .label').length === 50 && "
            "![...document.querySelectorAll('section.turn .label .code')].some("
            "e => ['running', 'queued', 'retrying'].includes(e.textContent))", timeout=30_000)
        rows = [row.split("\n") for row in labels.evaluate_all("rows => rows.map(r => r.innerText)")]
        by_tool: dict[str, list[list[str]]] = {}
        for row in rows:
            by_tool.setdefault(row[0], []).append(row)
        assert len(by_tool["echo"]) == 44 and all(r[-1] == "ok" for r in by_tool["echo"])
        assert [(r[2], r[-1]) for r in by_tool["flaky_read"]] == [("×2", "ok")] * 3
        assert [r[-1] for r in by_tool["slow"]] == ["TIMEOUT", "TIMEOUT"]
        assert by_tool["no_such_tool"][0][-1] == "UNKNOWN_TOOL"
        assert all(r[3].startswith("ui-worker@") for r in by_tool["echo"]), by_tool["echo"][0]
        # Hovering a row names the idempotency key and the worker in full.
        title = labels.first.get_attribute("title")
        assert f"ui-worker@{socket.gethostname()}" in title and "key " in title, title
        key = title.split("key ", 1)[1].split(" ", 1)[0]
        assert len(key) >= 32, title
        assert page.locator("section.turn .track .bar.code-ok").count() >= 47
        assert page.locator("section.turn .track .bar.code-TIMEOUT").count() == 2
        # The five retried calls show their earlier attempts before the last one.
        assert page.locator("section.turn .track .bar.seg-retrying").count() == 5
        shot = tmp_path / "ui-timeline.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("TC_UI_SCREENSHOT"):
            shutil.copy(shot, os.environ["TC_UI_SCREENSHOT"])
    finally:
        server.stop()


def _get(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_page_asks_for_basic_auth_when_configured(tmp_path: Path) -> None:
    from toolchord.orchestrator.event_stores import JsonlEventLog

    server = TimelineServer(JsonlEventLog(tmp_path), None, port=0, basic_auth="ops:s3cret")
    server.start()
    try:
        assert _get(server.url) == 401
        assert _get(server.url + "api/sessions", "ops:wrong") == 401
        assert _get(server.url + "api/sessions", "ops:s3cret") == 200
        assert _get(server.url + "static/app.js", "ops:s3cret") == 200
    finally:
        server.stop()


def test_toolchord_ui_refuses_a_public_address_without_auth(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from toolchord.orchestrator.cli import main

    monkeypatch.delenv("TOOLCHORD_UI_BASIC_AUTH", raising=False)
    monkeypatch.delenv("TOOLCHORD_UI_BASIC_AUTH_FILE", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["ui", "--address", "0.0.0.0"])
    assert exited.value.code == 2
    assert "TOOLCHORD_UI_BASIC_AUTH" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_on_a_cluster_shows_up_on_the_page(start_worker, redis_url, clean_redis) -> None:
    """The documented flow: `toolchord ui`, then `toolchord demo` with TOOLCHORD_BROKER_URL set."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, worker_env

    # As a new user starts it: no tool modules named, so the worker serves the demo tools.
    start_worker("", name="demo-worker")
    server = TimelineServer(RedisEventLog(redis_url), clean_redis, port=0)
    server.start()
    try:
        env = worker_env(redis_url, "toolchord.worker.demo_tools")
        done = subprocess.run([sys.executable, "-m", "toolchord.orchestrator.cli", "demo"], check=False, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "cluster runtime" in done.stdout.splitlines()[0]
        session_id = json.loads(done.stdout.strip().splitlines()[-1])["session_id"]
        with urllib.request.urlopen(server.url + "api/sessions", timeout=10) as response:
            assert session_id in [s["session_id"] for s in json.load(response)]
        with urllib.request.urlopen(server.url + "api/sessions/" + session_id, timeout=10) as response:
            view = json.load(response)
        calls = [c for turn in view["turns"] for c in turn["calls"]]
        assert len(view["turns"]) == 3 and len(calls) == 7
        ran = [c for c in calls if c["worker"]]
        assert ran and all(c["worker"].startswith("demo-worker@") and c["key"] for c in ran)
        assert {c["code"] for c in calls} >= {"ok", "TIMEOUT", "UNKNOWN_TOOL", "INVALID_ARGUMENTS"}
        assert all(c["phase"] == "done" for c in calls)
    finally:
        server.stop()


@pytest.mark.slow
def test_a_call_that_outlives_its_turn_ends_where_the_model_got_its_answer(start_worker, redis_url, clean_redis):
    from tests.cluster_helpers import call, wait_for
    from toolchord.orchestrator.recorder import SessionRecorder
    from toolchord.orchestrator.ui import session_view
    from toolchord.worker.observability.call_timeline import read_timings

    start_worker(TOOLS)
    log = RedisEventLog(redis_url)
    recorder = SessionRecorder(log, "s-outlive")
    calls = [call(0, "effect_read", key="outlive", seconds=3)]
    recorder.model_output("chat", "scripted", "t-1", output={}, items=[], calls=calls)
    recorder.dispatched("t-1", ["call_0"])
    turn = orchestrator(redis_url, turn_timeout=1.0).run_calls("s-outlive", calls, turn_id="t-1")
    recorder.result("t-1", turn.results[0])
    assert turn.results[0].error.code.value == "TIMEOUT"

    bar = session_view(log, "s-outlive", clean_redis).turns[0].calls[0]
    # A worker still has it, but the model has its answer: the bar is done, with that answer.
    assert (bar.phase, bar.code) == ("done", "TIMEOUT") and bar.worker and bar.started_at
    wait_for(lambda: read_timings(clean_redis, "s-outlive")[("t-1", "call_0")].phase == "done", 30, "the late end")
    bar = session_view(log, "s-outlive", clean_redis).turns[0].calls[0]
    assert (bar.phase, bar.code) == ("done", "TIMEOUT")
    assert bar.finished_at is not None and bar.started_at is not None
    assert bar.finished_at - bar.started_at >= 2.5


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_call_waiting_for_its_limit_is_drawn_as_waiting_with_the_limit_s_name(
        start_worker, redis_url, clean_redis, tmp_path: Path, browser_page) -> None:
    """The screenshot lands in the test's directory (and at $TC_UI_WAITING_SCREENSHOT when set:
    docs/ui-timeline-waiting.png)."""
    from tests.cluster_helpers import wait_for
    from tests.test_flow_visible import one_holds_one_waits
    from toolchord.orchestrator.ui import session_view

    start_worker("tests.limit_tools", concurrency=4, name="lane-worker")
    log = RedisEventLog(redis_url)
    server = TimelineServer(log, clean_redis, port=0)
    server.start()
    page = browser_page
    try:
        with one_holds_one_waits(redis_url, clean_redis, "ui-lane"):
            page.goto(server.url + "#ui-lane")
            label = page.locator("section.turn .label .code-waiting")
            label.wait_for(timeout=30_000)
            assert label.inner_text() == "waiting: tc-test-lane"
            waiting = page.locator("section.turn .track .bar.seg-waiting")
            assert waiting.count() == 1
            assert (waiting.get_attribute("title") or "").startswith("waiting for limit tc-test-lane")
            assert page.locator(".legend i.seg-waiting").count() == 1
            # Long enough to show as a segment beside the running call.
            wait_for(lambda: any(time.time() - (bar.waiting_since or time.time()) > 2.0
                                 for bar in session_view(log, "ui-lane", clean_redis).turns[0].calls),
                     15, "two seconds of waiting")
            # Drawn live after those two seconds: one call running, the other waiting, named.
            page.wait_for_function(f"() => Number(document.body.dataset.updated) > {time.time() * 1000}",
                                   timeout=10_000)
            shot = tmp_path / "ui-timeline-waiting.png"
            page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("TC_UI_WAITING_SCREENSHOT"):
                shutil.copy(shot, os.environ["TC_UI_WAITING_SCREENSHOT"])
        page.wait_for_function(
            "() => [...document.querySelectorAll('section.turn .label .code')].filter("
            "e => e.textContent === 'ok').length === 2", timeout=30_000)
        # Admitted and done, it keeps its waiting segment before its run, and its row names the limit.
        assert page.locator("section.turn .track .bar.seg-waiting").count() == 1
        titles = page.locator("section.turn .label").evaluate_all("rows => rows.map(r => r.title)")
        assert sum("waited for limit tc-test-lane" in title for title in titles) == 1, titles
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_eager_turn_s_view_has_its_message_end_after_the_early_call_s_start(
        start_worker, redis_url, clean_redis) -> None:
    from toolchord.orchestrator.ui import session_view

    start_worker(TOOLS)
    one_eager_turn(redis_url, "ui-eager")
    (view,) = session_view(RedisEventLog(redis_url), "ui-eager", clean_redis).turns
    read, unsafe = view.calls
    assert view.message_ended_at is not None and read.started_at is not None and unsafe.started_at is not None
    (read_start,) = [float(v) for v in clean_redis.lrange("tc-test:starts:ui-eager-r", 0, -1)]
    # The read call ran while the model still streamed; the unsafe one waited for the message's end.
    assert read.sent_early and read_start < view.message_ended_at
    assert read.queued_at is not None and read.queued_at <= read.started_at < view.message_ended_at
    assert not unsafe.sent_early and unsafe.started_at > view.message_ended_at
    assert (read.code, unsafe.code) == ("ok", "ok")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_page_draws_the_message_end_and_the_early_call_left_of_it(
        start_worker, redis_url, clean_redis, tmp_path: Path, browser_page) -> None:
    """The screenshot lands in the test's directory (and at $TC_UI_EAGER_SCREENSHOT when set:
    docs/ui-timeline-eager.png)."""
    start_worker(TOOLS, name="eager-worker")
    one_eager_turn(redis_url, "ui-eager-page")
    server = TimelineServer(RedisEventLog(redis_url), clean_redis, port=0)
    server.start()
    page = browser_page
    try:
        page.goto(server.url + "#ui-eager-page")
        page.wait_for_function("() => [...document.querySelectorAll('section.turn .label .code')].filter("
                               "e => e.textContent === 'ok').length === 2", timeout=30_000)
        # One line per track and one on the axis, all at the same place.
        markers = page.locator("section.turn .msg-end")
        assert markers.count() == 3
        assert page.locator("section.turn .axis .msg-end-label").inner_text() == "message ended"
        lines = {round(box["x"]) for box in markers.evaluate_all(
            "ms => ms.map(m => m.getBoundingClientRect().toJSON())")}
        assert len(lines) == 1, lines
        (line,) = lines
        early = page.locator("section.turn .track.eager")
        assert early.count() == 1 and "sent while streaming" in (early.get_attribute("title") or "")
        ran = early.locator(".bar.code-ok")
        assert "sent while streaming" in (ran.get_attribute("title") or "")
        assert ran.bounding_box()["x"] < line  # started before the message ended
        after = page.locator("section.turn .track:not(.eager) .bar.code-ok")
        assert after.bounding_box()["x"] > line  # the unsafe call: only once it had ended
        assert page.locator(".legend i.msg-end-key").count() == 1 and page.locator(".legend i.eager").count() == 1
        shot = tmp_path / "ui-timeline-eager.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("TC_UI_EAGER_SCREENSHOT"):
            shutil.copy(shot, os.environ["TC_UI_EAGER_SCREENSHOT"])
    finally:
        server.stop()
