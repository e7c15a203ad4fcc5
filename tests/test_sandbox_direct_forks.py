"""Tools the sandbox zygote cannot run: refused with TOOLCHORD_SANDBOX_DIRECT_FORK=refuse, run in
the zygote when they only re-wrap an importable function, and kept away from the worker's
connection secrets when they do run in a direct fork of the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import sandbox_tools
from toolchord.worker import tool
from toolchord.worker.config import Settings
from toolchord.worker.sandbox import run_isolated
from toolchord.worker.sandbox.zygote import set_zygote_enabled, start_zygote, zygote_pid

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "hunter2-broker-pw-5c1e"


@pytest.fixture(autouse=True)
def zygote_on() -> Iterator[None]:
    set_zygote_enabled(True)
    yield
    set_zygote_enabled(None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zygote", ["zygote", "no-zygote"])
def test_a_direct_fork_cannot_read_the_broker_password(zygote: str) -> None:
    finished = subprocess.run(
        [sys.executable, "-m", "tests.direct_fork_secrets_worker", zygote],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "TOOLCHORD_BROKER_URL": f"redis://toolchord:{PASSWORD}@127.0.0.1:1/0",
            "TOOLCHORD_TOOL_MODULES": "",
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    lines = [line for line in finished.stdout.splitlines() if line.startswith("{")]
    assert lines, finished.stderr[-3000:]
    outcome = json.loads(lines[-1])["outcome"]
    assert outcome["status"] == "ok", outcome
    found = outcome["data"]
    leaks = {place: text for place, text in found.items() if PASSWORD in text}
    assert leaks == {}
    assert "runs in a direct fork" in finished.stderr or zygote == "no-zygote"


def test_refused_direct_fork_fails_with_a_structured_error() -> None:
    @tool(timeout=5)
    def defined_in_a_test() -> int:
        """Defined inside a function: the zygote cannot import it."""
        return os.getpid()

    outcome = run_isolated(
        defined_in_a_test,
        defined_in_a_test.args_model(),
        sandbox_tools.make_context("defined_in_a_test"),
        direct_fork="refuse",
    )
    assert (outcome.status, outcome.started, outcome.error_type) == (
        "error",
        False,
        "DirectForkRefused",
    )
    assert outcome.error_message is not None
    assert "tool defined_in_a_test was not run" in outcome.error_message
    assert "defined in __main__ or inside a function" in outcome.error_message
    assert "TOOLCHORD_SANDBOX_DIRECT_FORK=refuse" in outcome.error_message
    allowed = run_isolated(
        defined_in_a_test,
        defined_in_a_test.args_model(),
        sandbox_tools.make_context("defined_in_a_test"),
    )
    assert allowed.status == "ok", allowed


def test_zygote_switched_off_with_direct_forks_refused_fails_every_isolated_call() -> None:
    set_zygote_enabled(False)
    outcome = run_isolated(
        sandbox_tools.add,
        sandbox_tools.add.args_model(a=1, b=2),
        sandbox_tools.make_context("add"),
        direct_fork="refuse",
    )
    assert (outcome.status, outcome.error_type) == ("error", "DirectForkRefused")
    assert "TOOLCHORD_SANDBOX_ZYGOTE=0" in (outcome.error_message or "")


def test_the_setting_is_read_from_the_environment() -> None:
    assert Settings.from_env({}).sandbox_direct_fork == "allow"
    refused = Settings.from_env({"TOOLCHORD_SANDBOX_DIRECT_FORK": "refuse"})
    assert refused.sandbox_direct_fork == "refuse"
    with pytest.raises(ValueError):
        Settings.from_env({"TOOLCHORD_SANDBOX_DIRECT_FORK": "sometimes"})


def test_a_rewrapped_importable_function_runs_in_the_zygote() -> None:
    start_zygote([sandbox_tools.__name__])
    rewrapped = tool(sandbox_tools.plain_parent_pid, name="rewrapped_parent", timeout=5)
    again = tool(sandbox_tools.fill_workdir.handler, name="fill_again", timeout=5)
    for spec, arguments in ((rewrapped, {}), (again, {"megabytes": 1})):
        outcome = run_isolated(
            spec,
            spec.args_model(**arguments),
            sandbox_tools.make_context(spec.name),
            direct_fork="refuse",
        )
        assert outcome.status == "ok", outcome
    outcome = run_isolated(
        rewrapped, rewrapped.args_model(), sandbox_tools.make_context(rewrapped.name)
    )
    assert outcome.data == zygote_pid()


LARGE_HEAP_CALL = """
import json, sys, time
from tests import sandbox_tools
from toolchord.worker import tool
from toolchord.worker.sandbox import run_isolated
from toolchord.worker.sandbox.zygote import set_zygote_enabled

set_zygote_enabled(False)  # every isolated call is a direct fork of this process
heap = [[i] for i in range(4_000_000)]  # a worker that holds millions of objects
spec = tool(sandbox_tools.plain_parent_pid, name="large_heap_call", timeout=1)
outcome = run_isolated(spec, spec.args_model(), sandbox_tools.make_context(spec.name))
print(json.dumps({"status": outcome.status, "started": outcome.started, "ms": outcome.duration_ms}))
"""


@pytest.mark.timeout(180)
def test_a_direct_fork_of_a_worker_with_a_large_heap_starts_within_its_time() -> None:
    # Finding the secret-holding objects walks the whole heap: in the child it copied every page
    # and counted against the call's 1 s limit (it timed out before it started).
    done = subprocess.run([sys.executable, "-c", LARGE_HEAP_CALL], cwd=ROOT, capture_output=True, text=True,
                          timeout=150, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert (outcome["status"], outcome["started"]) == ("ok", True), outcome
