"""Smoke test of `toolchord bench sandbox`: a short run prints each path's time, the CPU a call
costs, the profile of a call step by step (calls back to back, or `--pause-ms` apart) and the
targets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolchord.orchestrator.bench.processes import ROOT

# Loaded 2-core machine: about 7 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_short_run_reports_wall_time_and_cpu_per_call() -> None:
    completed = subprocess.run(
        # The installed entry point, as a user runs it (argument passing included).
        [str(Path(sys.executable).with_name("toolchord")), "bench", "sandbox", "--calls", "5",
         "--pause-ms", "2"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=45,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    for path in ("zygote:", "direct fork:"):
        assert re.search(rf"run_isolated, {path}\s+median\s+\d+\.\d+ ms", out), out
    cpu = re.search(r"CPU per zygote call, all processes:\s+(\d+\.\d+) ms over 5 calls", out)
    assert cpu is not None, out
    # A forked, confined child per call cannot be free: a zero would mean the counters were not read.
    assert float(cpu.group(1)) > 0
    # The profile step by step, from the child's own timestamps, and the targets with a verdict.
    assert re.search(r"root worker, zygote call, 2 ms apart: 5 calls, \d+ on a spare confined ahead", out), out
    assert re.search(r"child: payload read\s+\d+\.\d+\s+\d+\.\d+", out), out
    assert re.search(r"target: zygote call overhead <= 1 ms: \d+\.\d+ ms (MET|MISSED)", out), out
    assert re.search(r"floor: \d+\.\d+ ms per call .* the CPU target \(3 ms\) (leaves|is)", out), out
    assert re.search(
        r"target: CPU per sandboxed call <= 3 ms: \d+\.\d+ ms (MET|MISSED) \(floor of a process per call and the layers", out
    ), out


def test_the_profile_from_an_unprivileged_worker_is_printed() -> None:
    # Issue 22 asks for the profile of a root and of an unprivileged worker; a worker process that
    # cannot run the interpreter's path uses direct forks, whose children have no spare's marks.
    completed = subprocess.run(
        [str(Path(sys.executable).with_name("toolchord")), "bench", "sandbox", "--calls", "5",
         "--unprivileged", "61234"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=50,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    assert "failed" not in out, out
    found = re.search(r"unprivileged worker \(uid 61234\), (zygote|direct fork) call: 5 calls", out)
    assert found is not None, out
    assert re.search(r"child: (call received|fork)\s+\d+\.\d+\s+\d+\.\d+", out), out
    assert re.search(r"child: handler\s+\d+\.\d+\s+\d+\.\d+", out), out
    assert re.search(r"root worker, zygote call, back to back: 5 calls", out), out
