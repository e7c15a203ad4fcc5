"""The sandbox zygote: calls run in its children, it holds none of the worker's secrets, it is
restarted when it dies, and tools it cannot import fall back to a direct fork of the worker.

The tools below are module-level on purpose: the zygote imports this module by name.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import sandbox_tools
from toolchord.worker import ToolContext, tool
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import run_isolated
from toolchord.worker.sandbox.zygote import (
    ENV_ALLOW,
    set_zygote_enabled,
    start_zygote,
    stop_zygote,
    zygote_pid,
)
from toolchord.worker.tools import ToolSpec

ROOT = Path(__file__).resolve().parent.parent
WORKER_STATE: dict[str, str] = {}
"""Filled by the tests in the worker process only, the way a worker loads credentials at start."""


@tool(timeout=5)
def parent_pid() -> int:
    """The pid of the process that forked this call."""
    return os.getppid()


@tool(timeout=5)
def peek_worker_state() -> dict[str, str]:
    """What this process's copy of WORKER_STATE holds."""
    return dict(WORKER_STATE)


@tool(timeout=5)
def nap(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "rested"


@tool(timeout=5)
def timed_nap(seconds: float) -> list[float]:
    """Sleep; say when the nap began and ended (CLOCK_MONOTONIC, the same in every process)."""
    began = time.monotonic()
    time.sleep(seconds)
    return [began, time.monotonic()]


def run(spec: ToolSpec, **arguments: Any) -> HandlerOutcome:
    return run_isolated(
        spec, spec.args_model(**arguments), sandbox_tools.make_context(spec.name)
    )


@pytest.fixture(autouse=True)
def zygote_on() -> Iterator[None]:
    set_zygote_enabled(True)
    yield
    set_zygote_enabled(None)


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
        return False


def wait_gone(pid: int, seconds: float = 3.0) -> bool:
    """True once `pid` no longer exists (or is a zombie waiting for its parent)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or before the read
            return True
        time.sleep(0.02)
    return False


def runs_a_call(pid: int) -> bool:
    """The process runs a `nap` call: alive, under a per-call uid (a root worker gives every call
    a uid of its own) and sleeping in the handler; spares confined ahead of their call have their
    uid already, but wait on their call socket."""
    try:
        with open(f"/proc/{pid}/status") as status:
            uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        with open(f"/proc/{pid}/wchan") as wchan:
            napping = "nanosleep" in wchan.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return uid != os.geteuid() and napping and running(pid)


def zygote_children(pid: int) -> list[int]:
    """The zygote's children (spares and running calls), waiting a little for its first spares."""
    deadline = time.monotonic() + 3
    while True:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            found = [int(child) for child in children.read().split()]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_calls_run_in_children_of_the_zygote() -> None:
    outcome = run(parent_pid)
    assert outcome.status == "ok", outcome
    zygote = zygote_pid()
    assert zygote is not None and zygote != os.getpid()
    assert outcome.data == zygote


def test_zygote_environment_is_only_the_allow_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = "zygote-must-not-see-7c1e"
    monkeypatch.setenv("TOOLCHORD_FAKE_API_KEY", secret)
    stop_zygote()
    pid = start_zygote()
    assert pid is not None
    with open(f"/proc/{pid}/environ", "rb") as environ:
        names = {
            entry.split(b"=", 1)[0].decode()
            for entry in environ.read().split(b"\0")
            if entry
        }
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        assert secret.encode() not in cmdline.read()
    assert names <= set(ENV_ALLOW), names
    outcome = run(sandbox_tools.environment, ppid=pid)
    assert outcome.status == "ok", outcome
    assert secret not in str(outcome.data)


def test_worker_memory_is_in_a_direct_fork_but_not_in_a_zygote_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A secret the worker holds in a Python object after start (not in its environment)."""
    monkeypatch.setitem(WORKER_STATE, "api_key", "sk-worker-only-91d2")

    @tool(timeout=5)
    def peek_from_a_direct_fork() -> dict[str, str]:
        """Defined in a function, so the zygote cannot import it: the worker forks itself."""
        return dict(WORKER_STATE)

    from_zygote = run(peek_worker_state)
    from_direct_fork = run(peek_from_a_direct_fork)
    assert (from_zygote.status, from_zygote.data) == ("ok", {})
    assert (from_direct_fork.status, from_direct_fork.data) == (
        "ok",
        {"api_key": "sk-worker-only-91d2"},
    )


def test_handlers_the_zygote_cannot_import_by_name_use_a_direct_fork(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def report_parent() -> int:
        """Parent pid, from a function defined in __main__."""
        return os.getppid()

    report_parent.__module__ = "__main__"
    in_main = tool(report_parent, timeout=5)

    @tool(timeout=5)
    def nested_parent() -> int:
        """Parent pid, from a function defined inside a test."""
        return os.getppid()

    def ghost_parent() -> int:
        """Parent pid, from a module the worker has but the zygote cannot import."""
        return os.getppid()

    ghost_spec = importlib.util.spec_from_loader("toolchord_ghost_tools", loader=None)
    assert ghost_spec is not None
    ghost = importlib.util.module_from_spec(ghost_spec)
    ghost_parent.__module__ = ghost.__name__
    in_ghost = tool(ghost_parent, timeout=5)
    ghost.ghost_parent = in_ghost  # type: ignore[attr-defined]
    sys.modules[ghost.__name__] = ghost
    try:
        with caplog.at_level("WARNING", logger="toolchord.sandbox"):
            outcomes = [run(spec) for spec in (in_main, nested_parent, in_ghost)]
    finally:
        del sys.modules[ghost.__name__]
    assert [(o.status, o.data) for o in outcomes] == [("ok", os.getpid())] * 3
    assert all("rlimits" in o.sandbox_layers for o in outcomes)
    warned = " ".join(record.getMessage() for record in caplog.records)
    assert "tool report_parent runs in a direct fork" in warned
    assert (
        "tool ghost_parent runs in a direct fork of the worker, not in the sandbox zygote: the zygote cannot load it"
        in warned
    )
    assert run(parent_pid).data == zygote_pid()


@pytest.mark.slow
def test_killed_zygote_is_restarted(caplog: pytest.LogCaptureFixture) -> None:
    assert run(parent_pid).status == "ok"
    first = zygote_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert wait_gone(first)
    with caplog.at_level("WARNING", logger="toolchord.sandbox"):
        outcome = run(parent_pid)
    assert outcome.status == "ok", outcome
    second = zygote_pid()
    assert second is not None and second != first
    assert run(parent_pid).data == second
    assert f"sandbox zygote (pid {first}) killed by SIGKILL" in caplog.text


@pytest.mark.slow
def test_zygote_dying_during_a_call_fails_the_call_and_kills_its_children(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("tells the call's child from the spares by its per-call uid, which needs a root worker")
    # The zygote has loaded the tool once: its spares are of the generation the call uses.
    assert run(nap, seconds=0).status == "ok"
    zygote = zygote_pid()
    assert zygote is not None
    outcomes: list[HandlerOutcome] = []
    caller = threading.Thread(target=lambda: outcomes.append(run(nap, seconds=4)))
    with caplog.at_level("WARNING", logger="toolchord.sandbox"):
        # The first call's child may still be ending: the zygote must be running no call but ours.
        deadline = time.monotonic() + 10
        while any(runs_a_call(c) for c in zygote_children(zygote)):
            assert time.monotonic() < deadline, "the first call's child did not end"
            time.sleep(0.02)
        caller.start()
        # Counting children is not enough: a replacement spare forked for the first call may
        # appear after it, before ours is handed over. The call's child is the one with its uid.
        while not any(runs_a_call(c) for c in zygote_children(zygote)):
            assert time.monotonic() < deadline + 10, "the call did not start in a child of the zygote"
            time.sleep(0.02)
        children = zygote_children(zygote)
        killed_at = time.monotonic()
        os.kill(zygote, signal.SIGKILL)
        caller.join(10)
    assert not caller.is_alive()
    # The call would nap 4 s: it ends at the zygote's death instead.
    assert time.monotonic() - killed_at < 3
    (outcome,) = outcomes
    assert (outcome.status, outcome.error_type) == ("crashed", "ChildCrashed"), outcome
    assert "zygote ended during the call" in (outcome.error_message or "")
    # Parent-death signals: the running child and the spares die with the zygote.
    assert all(wait_gone(child) for child in children)
    assert "lost: it ended during a call" in caplog.text
    after = run(parent_pid)
    assert after.status == "ok" and after.data == zygote_pid() != zygote


@pytest.mark.slow
def test_zygote_dies_with_its_worker() -> None:
    script = (
        "import time\n"
        "from toolchord.worker.sandbox.zygote import start_zygote\n"
        "print(start_zygote(), flush=True)\n"
        "time.sleep(60)\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None
        zygote = int(worker.stdout.readline())
        children = zygote_children(zygote)
        assert children  # its spare children
    finally:
        worker.kill()
        worker.wait()
    assert wait_gone(zygote)
    assert all(wait_gone(child) for child in children)


def test_concurrent_calls_share_one_zygote() -> None:
    results: list[HandlerOutcome] = []
    lock = threading.Lock()

    def call() -> None:
        outcome = run(timed_nap, seconds=1.0)
        with lock:
            results.append(outcome)

    run(parent_pid)
    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [o.status for o in results] == ["ok"] * 4, results
    # They ran side by side, not one after the other: all four naps were on at one moment.
    spans = [o.data for o in results]
    assert max(began for began, _ in spans) < min(ended for _, ended in spans), spans


def test_context_arguments_and_allowed_environment_reach_the_zygote_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TZ", "Europe/Paris")
    outcome = run_isolated(
        context_echo,
        context_echo.args_model(label="été ✓"),
        sandbox_tools.make_context("context_echo"),
    )
    assert outcome.status == "ok", outcome
    assert outcome.data["label"] == "été ✓"
    assert outcome.data["call_id"] == "call-context_echo"
    assert outcome.data["tz"] == "Europe/Paris"
    assert outcome.data["parent"] == zygote_pid()


@tool(timeout=5)
def context_echo(label: str, ctx: ToolContext) -> dict[str, object]:
    """Echo the label, the call id, TZ and the parent pid."""
    return {
        "label": label,
        "call_id": ctx.call_id,
        "tz": os.environ.get("TZ"),
        "parent": os.getppid(),
    }


def test_zygote_started_from_a_short_lived_thread_outlives_it() -> None:
    """The parent-death signal follows the thread that forked: a zygote started on behalf of a
    thread that ends (an embedded worker's task thread) must not die with that thread."""
    stop_zygote()
    outcomes: list[HandlerOutcome] = []
    caller = threading.Thread(target=lambda: outcomes.append(run(parent_pid)))
    caller.start()
    caller.join(10)
    started_by_thread = zygote_pid()
    assert outcomes[0].status == "ok" and outcomes[0].data == started_by_thread
    time.sleep(0.2)
    assert run(parent_pid).data == started_by_thread == zygote_pid()
