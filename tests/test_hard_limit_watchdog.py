"""The pool process's hard-limit watchdog (worker/hard_limit.py), in real processes: once armed it
ends its process with every thread's traceback on stderr; disarming or arming again replaces the
earlier arming; a forked child is not ended with its parent's timer. The watchdog in a real worker
whose main process is blocked: tests/test_celery_limits.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from toolchord.worker.hard_limit import WATCHDOG_SIGNAL

pytestmark = pytest.mark.timeout(60)


def _start(body: str) -> subprocess.Popen[str]:
    """A Python process running `body` with `watchdog`, a Watchdog, and `say` (one line to stdout)."""
    script = "import os, sys, threading, time\n" \
        "from toolchord.worker.hard_limit import Watchdog\n" \
        "watchdog = Watchdog()\n" \
        "def say(text):\n    print(text, flush=True)\n" + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _ended(process: subprocess.Popen[str]) -> tuple[float, str]:
    """When the process ended (monotonic) and what it wrote to stderr."""
    process.wait(30)
    ended = time.monotonic()
    assert process.stderr is not None
    return ended, process.stderr.read()


def test_an_armed_watchdog_ends_its_process_with_every_thread_s_traceback() -> None:
    process = _start("""
        def stuck_helper():
            threading.Event().wait()
        threading.Thread(target=stuck_helper, name="helper", daemon=True).start()
        def stuck_handler():
            say(time.monotonic())
            watchdog.arm(0.3)
            threading.Event().wait()
        stuck_handler()
    """)
    assert process.stdout is not None
    armed = float(process.stdout.readline())
    ended, said = _ended(process)
    assert process.returncode == -WATCHDOG_SIGNAL, (process.returncode, said)
    assert ended - armed >= 0.3, ended - armed
    # Where each thread was, so that the log tells why the call never ended.
    assert "in stuck_handler" in said and "in stuck_helper" in said, said


def test_disarming_or_arming_again_replaces_the_earlier_arming() -> None:
    process = _start("""
        watchdog.arm(0.2)
        watchdog.disarm()
        watchdog.arm(30)
        watchdog.arm(1.0)
        say(time.monotonic())
        threading.Event().wait()
    """)
    assert process.stdout is not None
    armed = float(process.stdout.readline())
    ended, said = _ended(process)
    assert process.returncode == -WATCHDOG_SIGNAL, (process.returncode, said)
    # Neither at the first arming's 0.2 s nor at the 30 s one: at the last one's 1 s.
    assert 0.95 <= ended - armed < 25, ended - armed


def test_a_forked_child_is_not_ended_by_its_parent_s_watchdog() -> None:
    process = _start("""
        parent, armed = os.getpid(), time.monotonic()
        watchdog.arm(0.3)
        if os.fork() == 0:
            while os.getppid() == parent:
                time.sleep(0.01)
            # Alive well past the moment its parent's timer went off (POSIX timers are not inherited).
            time.sleep(max(0.0, armed + 1.0 - time.monotonic()))
            say("child alive")
            os._exit(0)
        threading.Event().wait()
    """)
    _at, said = _ended(process)
    assert process.returncode == -WATCHDOG_SIGNAL, (process.returncode, said)
    assert process.stdout is not None
    assert process.stdout.readline() == "child alive\n"
