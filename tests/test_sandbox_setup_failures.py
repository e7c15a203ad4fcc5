"""A call's child that fails before its pipes are ready says why in the log, and a spare never
dies of its call's arrival (two SIGIOs: its layers, then the call, back to back)."""

from __future__ import annotations

import os
import signal

import pytest

from toolchord.worker.sandbox.child import SETUP_FAILED_STATUS, exit_setup_failed
from toolchord.worker.sandbox.zygote_server import _CallAlarm, _CallArrived

pytestmark = pytest.mark.timeout(60)


def test_a_second_call_signal_while_the_first_is_handled_does_not_escape() -> None:
    alarm = _CallAlarm()
    previous = signal.signal(signal.SIGIO, alarm)
    try:
        with pytest.raises(_CallArrived):
            signal.raise_signal(signal.SIGIO)
        # The call's own SIGIO, arriving while the layers' one is being handled: it used to
        # raise again, out of the rehearsal, and the spare exited with the setup status.
        signal.raise_signal(signal.SIGIO)
        assert not alarm.armed
    finally:
        signal.signal(signal.SIGIO, previous)


def test_a_child_that_fails_before_its_pipes_are_ready_says_why_on_stderr() -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(write_end, 2)
            raise OSError(9, "Bad file descriptor")
        except OSError:
            exit_setup_failed()
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stderr:
        said = stderr.read().decode()
    _pid, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == SETUP_FAILED_STATUS
    assert said == (
        "toolchord sandbox: a call's child failed before its result pipe was ready: "
        "OSError: [Errno 9] Bad file descriptor\n"
    )
