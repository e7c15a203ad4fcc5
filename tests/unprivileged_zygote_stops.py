"""A worker process for tests/test_sandbox_zygote_stops.py, run as an unprivileged uid.

`python -m tests.unprivileged_zygote_stops` starts its zygote (in a pid namespace of its own),
runs a call and stops the zygote, several times; then SIGKILLs the zygote and runs one more call,
which starts a new one. Everything goes to the log on stderr, as a worker's does.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from tests import sandbox_tools
from toolchord.worker.sandbox import run_isolated
from toolchord.worker.sandbox.zygote import set_zygote_enabled, start_zygote, stop_zygote, zygote_pid

STOPS = 6


def call() -> str:
    spec = sandbox_tools.add
    return run_isolated(spec, spec.args_model(a=1, b=2), sandbox_tools.make_context("add")).status


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    set_zygote_enabled(True)
    for _ in range(STOPS):
        start_zygote([sandbox_tools.__name__])
        print(call(), flush=True)
        stop_zygote()
    start_zygote([sandbox_tools.__name__])
    print(call(), flush=True)
    killed = zygote_pid()
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    while zygote_pid() == killed:
        time.sleep(0.01)
    print(call(), flush=True)
    stop_zygote()


if __name__ == "__main__":
    main()
