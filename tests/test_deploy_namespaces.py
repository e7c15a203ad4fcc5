"""A worker whose deployment refuses the sandbox's namespaces says so at start, and one with a
tool that requires a refused layer does not start. The restriction is the one systemd's
`RestrictNamespaces=user net` (the unit before this fix) applies, emulated with a seccomp filter
in the worker's process (tests/restricted_namespaces_worker.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def start(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.restricted_namespaces_worker", mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.timeout(120)
def test_refused_namespaces_are_an_error_at_start_with_the_fix() -> None:
    finished = start("probe")
    errors = [line for line in finished.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, finished.stderr[-3000:]
    assert "SANDBOX LAYERS REFUSED" in errors[0]
    assert "disk (" in errors[0] and "Operation not permitted" in errors[0]
    assert "RestrictNamespaces=user mnt net pid ipc" in errors[0]


@pytest.mark.timeout(120)
def test_a_worker_with_a_tool_requiring_a_refused_layer_does_not_start() -> None:
    finished = start("start")
    assert finished.returncode != 0
    assert "started" not in finished.stdout
    assert "refuses to start" in finished.stderr
    assert "tool needs_a_disk_quota requires disk" in finished.stderr
