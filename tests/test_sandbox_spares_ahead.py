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


def wait_for_a_confined_spare(ended_call: int) -> None:
    """Until a spare of the zygote (a child other than the process of the call that ended, which
    may still be exiting) has taken a per-call uid."""
    zygote = zygote_pid()
    assert zygote is not None
    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{zygote}/task/{zygote}/children") as children:
            pids = children.read().split()
        for pid in (p for p in pids if int(p) != ended_call):
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
    runner.report_setup_timings(True)
    first = tools.run(tools.where_am_i)
    assert first.status == "ok", first
    # The spares are confined in the background while a call runs.
    assert first.data is not None
    wait_for_a_confined_spare(first.data["pid"])
    outcome = tools.run(tools.where_am_i)
    assert outcome.status == "ok", outcome
    reported = steps(outcome)
    assert reported[0] == "layers received", reported
    arrival = reported.index("call received")
    # Every layer before the call arrived; after it, only what is the call's own.
    assert {"uid", "landlock", "seccomp"} <= set(reported[:arrival]), reported
    assert not {"cgroup join", "uid", "landlock", "seccomp"} & set(reported[arrival:]), reported
    assert outcome.sandbox_layers == first.sandbox_layers
    # Nothing shared with the call before it.
    assert first.data is not None and outcome.data is not None
    for key in ("uid", "workdir", "pid"):
        assert first.data[key] != outcome.data[key], (first.data, outcome.data)


def test_a_spare_confined_for_one_profile_never_runs_a_call_of_another() -> None:
    if "netns" not in probe().available():
        pytest.skip("needs the netns layer")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        # A spare confined for the default profile, which has the network, is waiting.
        for _ in range(2):
            last = tools.run(tools.where_am_i)
            assert last.status == "ok" and last.data is not None, last
        wait_for_a_confined_spare(last.data["pid"])
        refused = tools.run(tools.connect, host="127.0.0.1", port=port)
    assert refused.status == "error", refused
    assert "netns" in refused.sandbox_layers, refused
    assert tools.run(tools.where_am_i).status == "ok"
