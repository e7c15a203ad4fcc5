"""How an unprivileged worker's log reports its zygote's stops: a stop is quiet (no traceback from
the zygote when the worker closes its control socket), and a zygote killed by a signal is
reported as killed by that signal, not as an exit status.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.test_sandbox_escapes import ROOT, drop_to_unprivileged, unprivileged_env, unprivileged_python


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_zygote_stops_leave_no_traceback_and_a_kill_names_its_signal() -> None:
    if os.geteuid() != 0:
        pytest.skip("starting a worker as another uid needs root")
    python = unprivileged_python()
    if python is None:
        pytest.skip("no interpreter with this environment's packages is usable by another uid")
    finished = subprocess.run(
        [*python, "-m", "tests.unprivileged_zygote_stops"],
        env=unprivileged_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        **drop_to_unprivileged(),
    )
    log = finished.stderr
    assert finished.stdout.split() == ["ok"] * 8, log[-3000:]
    assert "in a pid namespace of its own" in log, log[-3000:]
    assert "Traceback" not in log and "ConnectionResetError" not in log, log[-3000:]
    assert "killed by SIGKILL; starting a new one" in log, log[-3000:]
    assert "exited with status" not in log, log[-3000:]
