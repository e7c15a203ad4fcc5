"""Spares confined ahead of their calls: later calls find their layers applied already, with a
uid, workdir and cgroup of their own, each spare rehearses before it applies its layers, a spare
confined for one profile never runs another's, a
call's replacement spare is forked after the call, not while it runs, and stopping a zygote holds up
nothing and logs nothing for spares that were still confining themselves."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests import sandbox_tools as tools
from toolchord.worker.execution import HandlerOutcome
from toolchord.worker.sandbox import runner, zygote
from toolchord.worker.sandbox.capabilities import probe
from toolchord.worker.sandbox.child import SETUP_FAILED_STATUS, TIMINGS_PREFIX
from toolchord.worker.sandbox.zygote import (
    REPLY_SECONDS,
    SPARES,
    stop_zygote,
    zygote_client,
    zygote_pid,
)
from toolchord.worker.sandbox.zygote_protocol import ZygoteReply

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


def confined_children(*ended_calls: int) -> set[int]:
    """The zygote's children other than `ended_calls` (processes of calls that ended, which may
    still be exiting) that have taken a per-call uid."""
    zygote = zygote_pid()
    assert zygote is not None
    with open(f"/proc/{zygote}/task/{zygote}/children") as children:
        pids = {int(p) for p in children.read().split()} - set(ended_calls)
    confined = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        except (FileNotFoundError, ProcessLookupError):
            continue
        if uid != os.geteuid():
            confined.add(pid)
    return confined


def wait_for_confined_spares(*ended_calls: int, count: int = 1) -> set[int]:
    """Until `count` spares of the zygote have taken a per-call uid; their pids."""
    deadline = time.monotonic() + 30
    while len(found := confined_children(*ended_calls)) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} spares were confined ahead"
        time.sleep(0.02)
    return found


def test_later_calls_run_on_spares_confined_ahead_with_every_layer() -> None:
    runner.report_setup_timings(True)
    first = tools.run(tools.where_am_i)
    assert first.status == "ok", first
    # The spares are confined in the background while a call runs.
    assert first.data is not None
    wait_for_confined_spares(first.data["pid"])
    outcome = tools.run(tools.where_am_i)
    assert outcome.status == "ok", outcome
    reported = steps(outcome)
    # The spare's own steps first: its layers' arrival and its rehearsal, in either order.
    assert set(reported[:2]) == {"layers received", "rehearsal"}, reported
    arrival = reported.index("call received")
    # Every layer before the call arrived; after it, only what is the call's own.
    assert {"uid", "landlock", "seccomp"} <= set(reported[:arrival]), reported
    assert not {"cgroup join", "uid", "landlock", "seccomp"} & set(reported[arrival:]), reported
    assert outcome.sandbox_layers == first.sandbox_layers
    # Nothing shared with the call before it.
    assert first.data is not None and outcome.data is not None
    for key in ("uid", "workdir", "pid"):
        assert first.data[key] != outcome.data[key], (first.data, outcome.data)


def test_a_spare_confined_ahead_runs_the_call_it_was_handed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The spare's plan was made for its layers: the call's own part (arguments, context, timeout,
    # the worker's values of allowed variables) must be the call's, not the spare's or a former one's.
    runner.report_setup_timings(True)
    monkeypatch.setenv("TOOLCHORD_TEST_CALL_VALUE", "first")
    first = tools.run(tools.call_facts, tag="one")
    assert first.status == "ok" and first.data is not None, first
    wait_for_confined_spares(first.data["pid"])
    monkeypatch.setenv("TOOLCHORD_TEST_CALL_VALUE", "second")
    context = tools.make_context("second-call")
    spec = tools.call_facts
    outcome = runner.run_isolated(spec, spec.args_model(tag="two"), context, timeout=3.2)
    assert outcome.status == "ok" and outcome.data is not None, outcome
    assert "uid" in steps(outcome)[: steps(outcome).index("call received")], "not a spare confined ahead"
    del outcome.data["pid"]
    assert outcome.data == {
        "tag": "two",
        "call_id": "call-second-call",
        "deadline": context.deadline,
        "value": "second",
        "cpu_limit": 5,
    }, outcome.data
    assert first.data["value"] == "first" and first.data["cpu_limit"] == 6, first.data


def test_a_spare_rehearses_before_its_layers_even_when_they_reach_it_first() -> None:
    # A call's end confines its replacement as soon as the zygote offers it, so the layers
    # mostly reach a new spare before or during its rehearsal. It used to skip the rest of the
    # rehearsal then, leaving its first pass over the memory it shares with the zygote to the
    # confinement and to the call.
    runner.report_setup_timings(True)
    first = tools.run(tools.where_am_i)
    assert first.status == "ok" and first.data is not None, first
    ended = [first.data["pid"]]
    layers_first = 0
    for calls in range(1, 41):
        wait_for_confined_spares(*ended, count=SPARES)
        outcome = tools.run(tools.where_am_i)
        assert outcome.status == "ok" and outcome.data is not None, outcome
        ended.append(outcome.data["pid"])
        reported = steps(outcome)
        first_layer = min(
            reported.index(step) for step in ("cgroup join", "signals and streams") if step in reported
        )
        assert "rehearsal" in reported[:first_layer], reported
        layers_first += reported.index("layers received") < reported.index("rehearsal")
        if calls >= 2 * SPARES and layers_first >= 2:
            break
    # The case this is about happened (every replacement's layers are sent within a millisecond
    # of its offer, a rehearsal takes a few).
    assert layers_first >= 2, f"{layers_first} of {calls} spares had their layers before rehearsing"


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
        wait_for_confined_spares(last.data["pid"])
        refused = tools.run(tools.connect, host="127.0.0.1", port=port)
    assert refused.status == "error", refused
    assert "netns" in refused.sandbox_layers, refused
    assert tools.run(tools.where_am_i).status == "ok"


def test_a_call_s_replacement_spare_is_asked_for_when_the_call_is_over() -> None:
    first = tools.run(tools.where_am_i)
    assert first.status == "ok" and first.data is not None, first
    spares = wait_for_confined_spares(first.data["pid"], count=SPARES)
    connection = zygote_client()._connection
    assert connection is not None

    def on_offer() -> tuple[set[int], int]:
        """The pids of the spares on offer, and how many more the zygote was asked for."""
        with connection._spare_lock:
            return {spare.pid for spare in connection._spares}, connection._pending

    assert on_offer() == (spares, 0)
    outcomes: list[HandlerOutcome] = []
    call = threading.Thread(target=lambda: outcomes.append(tools.run(tools.sleep_forever)))
    call.start()
    deadline = time.monotonic() + 30
    while (now := on_offer())[0] == spares:
        assert time.monotonic() < deadline, "the call never took a spare"
        time.sleep(0.001)
    # The call took one of the spares confined ahead, and nothing was asked of the zygote: forking
    # and confining a replacement now would compete with the call for the CPU.
    assert len(now[0]) == SPARES - 1 and now[0] < spares and now[1] == 0, (spares, now)
    call.join(30)
    assert outcomes and outcomes[0].status == "timeout", outcomes
    # Once the call is over, its spare is replaced and confined for the same profile.
    replaced = wait_for_confined_spares(first.data["pid"], *(spares - now[0]), count=SPARES)
    assert replaced > now[0], (now[0], replaced)


def _preparer_frames() -> list[str]:
    """The functions on the stack of the thread that confines spares (none while it is idle)."""
    names: list[str] = []
    for thread in threading.enumerate():
        if thread.name.startswith("toolchord-spares") and thread.ident is not None:
            frame = sys._current_frames().get(thread.ident)
            while frame is not None:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
    return names


def test_replacements_wait_for_a_quiet_moment_while_a_confined_spare_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A quiet moment that never comes: only a call leaving fewer confined spares lets them go.
    monkeypatch.setattr(zygote, "REFILL_QUIET_SECONDS", 3600.0)
    runner.report_setup_timings(True)
    first = tools.run(tools.where_am_i)
    assert first.status == "ok" and first.data is not None, first
    ended = [first.data["pid"]]
    wait_for_confined_spares(*ended, count=SPARES)
    connection = zygote_client()._connection
    assert connection is not None
    second = tools.run(tools.where_am_i)
    assert second.status == "ok" and second.data is not None, second
    ended.append(second.data["pid"])
    deadline = time.monotonic() + 30
    while "_wait_for_quiet" not in _preparer_frames():
        assert time.monotonic() < deadline, "the replacement did not wait for a quiet moment"
        time.sleep(0.005)
    with connection._spare_lock:
        # Nothing asked of the zygote while it waits: the turn that used the spare has the CPU.
        assert (len(connection._spares), connection._pending) == (SPARES - 1, 0)
    # A call right after (a burst) finds a spare confined ahead, and leaving fewer than all but
    # one confined ends the wait: the spares are replaced though the quiet moment never comes.
    third = tools.run(tools.where_am_i)
    assert third.status == "ok" and third.data is not None, third
    assert "uid" in steps(third)[: steps(third).index("call received")], steps(third)
    ended.append(third.data["pid"])
    wait_for_confined_spares(*ended, count=SPARES)


def test_stopping_a_zygote_wakes_the_thread_waiting_for_its_spares() -> None:
    first = tools.run(tools.where_am_i)
    assert first.status == "ok" and first.data is not None, first
    wait_for_confined_spares(first.data["pid"], count=SPARES)
    connection = zygote_client()._connection
    assert connection is not None
    with connection._spare_lock:
        connection._pending += 1  # a spare asked for and not offered yet
    thread_id: list[int] = []

    def wait_for_the_offer() -> None:
        thread_id.append(threading.get_native_id())
        connection.prepare_spares(b"", lambda: pytest.fail("every spare on offer is confined"))

    waiting = threading.Thread(target=wait_for_the_offer)
    waiting.start()
    deadline = time.monotonic() + 30
    while not thread_id or not _in_select(thread_id[0]):
        assert time.monotonic() < deadline, "the thread never waited for the offer"
        time.sleep(0.005)
    # It used to go on waiting for the rest of REPLY_SECONDS: the one thread that confines
    # spares then left those of the next zygote (after a restart) unconfined all that time.
    stop_zygote()
    waiting.join(REPLY_SECONDS / 2)
    assert not waiting.is_alive()


def _wait_for_state(pid: int, state: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == state:
                return
        assert time.monotonic() < deadline, f"process {pid} never reached state {state}"
        time.sleep(0.005)


def _in_select(thread_id: int) -> bool:
    with open(f"/proc/self/task/{thread_id}/wchan") as wchan:
        return wchan.read().startswith("poll_schedule_timeout")


@pytest.mark.parametrize("let_go", [True, False], ids=["let-go", "kept"])
def test_a_spare_that_fails_to_confine_itself_reports_only_if_a_call_may_still_come(
    let_go: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    profile, caps = tools.where_am_i.sandbox, probe()
    if "disk" not in caps.available():
        pytest.skip("needs the disk layer (the spare fails mounting its workdir)")
    client = zygote_client()
    client.ensure_started()
    connection = client._connection
    assert connection is not None
    spare = connection.take_spare(0, b"")  # not confined yet: waiting for its layers
    held = runner._Held.make(profile, caps)
    try:
        # Its workdir is gone, as when a stopping zygote's spares are let go and their workdirs
        # removed while they confine themselves.
        layers = held.spare_layers(profile).model_copy(update={"workdir": held.workdir.path + "-gone"})
        # Stopped meanwhile, so that the layers and the end of file (let go) are both there
        # when it reads them.
        os.kill(spare.pid, signal.SIGSTOP)
        _wait_for_state(spare.pid, "T")
        spare.call.send(layers.model_dump_json().encode())
        if let_go:
            spare.call.close()
        os.kill(spare.pid, signal.SIGCONT)
        spare.status.settimeout(30)
        ended = ZygoteReply.model_validate_json(spare.status.recv(4096))
    finally:
        held.release_later()
        spare.close_sockets()
    said = capfd.readouterr().err
    if let_go:
        assert os.waitstatus_to_exitcode(ended.status) == 0
        assert "failed before its result pipe was ready" not in said, said
    else:
        assert os.waitstatus_to_exitcode(ended.status) == SETUP_FAILED_STATUS
        assert "failed before its result pipe was ready: FileNotFoundError" in said, said
