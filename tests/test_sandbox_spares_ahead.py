"""Spares confined ahead of their calls: later calls find their layers applied already, with a
uid, workdir and cgroup of their own, and a spare confined for one profile never runs another's."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator

import pytest

from tests import sandbox_tools as tools
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import runner
from toolchord.worker.sandbox.capabilities import probe
from toolchord.worker.sandbox.child import TIMINGS_PREFIX
from toolchord.worker.sandbox.zygote import stop_zygote, zygote_pid

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not {"uid", "landlock", "seccomp"} <= probe().available(),
        reason="needs the uid, landlock and seccomp layers (a root worker)",
    ),
]


@pytest.fixture(autouse=True)
def fresh_zygote() -> Iterator[None]:
    stop_zygote()
    yield
    runner.report_setup_timings(False)
    stop_zygote()


def steps(outcome: HandlerOutcome) -> list[str]:
    """The setup steps the call's child reported, in order."""
    text, prefix = outcome.output or "", TIMINGS_PREFIX.decode()
    start = text.rfind(prefix)
    assert start >= 0, outcome
    line = text[start + len(prefix) :].split("\n", 1)[0]
    return [step for step, _at, _cpu in json.loads(line)]


def wait_for_a_confined_spare() -> None:
    """Until a child of the zygote (no call runs now: a spare) has taken a per-call uid."""
    zygote = zygote_pid()
    assert zygote is not None
    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{zygote}/task/{zygote}/children") as children:
            pids = children.read().split()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as status:
                    uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
            except (FileNotFoundError, ProcessLookupError):
                continue
            if uid != os.geteuid():
                return
        assert time.monotonic() < deadline, "no spare was confined ahead"
        time.sleep(0.02)


def test_later_calls_run_on_spares_confined_ahead_with_every_layer() -> None:
    first = tools.run(tools.where_am_i)
    assert first.status == "ok", first
    runner.report_setup_timings(True)
    seen: list[HandlerOutcome] = []
    # The spares are confined in the background while a call runs: within a few calls, one is.
    for _ in range(10):
        outcome = tools.run(tools.where_am_i)
        assert outcome.status == "ok", outcome
        seen.append(outcome)
        reported = steps(outcome)
        if reported[0] == "layers received":
            break
    else:
        pytest.fail(f"no call ran on a spare confined ahead: {[steps(o) for o in seen]}")
    arrival = reported.index("call received")
    # Every layer before the call arrived; after it, only what is the call's own.
    assert {"cgroup join", "landlock", "seccomp", "uid"} & set(reported[:arrival])
    assert not {"cgroup join", "landlock", "seccomp", "uid"} & set(reported[arrival:])
    assert outcome.sandbox_layers == first.sandbox_layers
    # Nothing shared with the call before it.
    before, last = seen[-2] if len(seen) > 1 else first, outcome
    assert before.data is not None and last.data is not None
    for key in ("uid", "workdir", "pid"):
        assert before.data[key] != last.data[key], (before.data, last.data)


def test_a_spare_confined_for_one_profile_never_runs_a_call_of_another() -> None:
    if "netns" not in probe().available():
        pytest.skip("needs the netns layer")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        # A spare confined for the default profile, which has the network, is waiting.
        for _ in range(2):
            assert tools.run(tools.where_am_i).status == "ok"
        wait_for_a_confined_spare()
        refused = tools.run(tools.connect, host="127.0.0.1", port=port)
    assert refused.status == "error", refused
    assert "netns" in refused.sandbox_layers, refused
    assert tools.run(tools.where_am_i).status == "ok"
