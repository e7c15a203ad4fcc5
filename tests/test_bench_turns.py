"""Smoke test of `toolchord.orchestrator.bench.turns`: a tiny run starts its own Redis and worker and writes a full report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolchord.orchestrator.bench.processes import ROOT

# Loaded 2-core machine: about 15 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def processes_using(path: Path) -> list[int]:
    """Pids whose command line or open files mention `path` (redis-server's --dir, the worker's log)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            refs = [(entry / "cmdline").read_bytes().decode(errors="replace")]
            refs += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(str(path) in ref for ref in refs):
            found.append(int(entry.name))
    return found


def test_tiny_run_writes_report_and_cleans_up(tmp_path: Path) -> None:
    report_path = tmp_path / "turns.json"
    completed = subprocess.run(
        [sys.executable, "-m", "toolchord.orchestrator.bench.turns", "--rounds", "1", "--sizes", "1", "--turns-per-round", "2",
         "--pipeline-calls", "4", "--inflight", "2", "--warmup", "1", "--redis-stats-turns", "20",
         "--concurrency", "1", "--json", str(report_path)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=60,
        # The benchmark's scratch directory lands under tmp_path, so leftovers can be found.
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "p50/bare" in completed.stdout
    assert processes_using(tmp_path) == [], "redis-server or worker processes outlived the benchmark"

    report = json.loads(report_path.read_text())
    assert report["environment"]["celery"] and report["environment"]["cpu_count"]
    assert report["parameters"]["sizes"] == [1] and report["parameters"]["concurrency"] == 1
    assert report["targets"] == {
        "p50_ratio_max": 1.15, "throughput_ratio_min": 0.9, "sandbox_p50_ratio_max": 1.5,
        "sandbox_throughput_ratio_min": 0.6, "sandbox_cpu_ms_per_call_max": 3.0,
    }
    (result,) = report["results"]
    assert result["size"] == 1
    assert set(result["latency"]) == {"bare", "toolchord", "toolchord-nosandbox"}
    for latency in result["latency"].values():
        assert latency["samples"] == 2
        assert 0 < latency["p50_ms"] <= latency["p95_ms"]
    assert set(result["throughput"]) == {
        "bare", "toolchord", "toolchord-nosandbox", "toolchord-nosandbox+asyncio"
    }
    assert all(t["turns_per_s"] > 0 for t in result["throughput"].values())
    assert set(result["p50_ratio"]) == {"toolchord", "toolchord-nosandbox"}
    # Without sandbox on both paths; sandboxed: latency, throughput and the CPU the sandbox adds.
    assert set(result["targets_met"]) == {
        "p50:toolchord-nosandbox", "throughput:toolchord-nosandbox", "throughput:toolchord-nosandbox+asyncio",
        "p50:toolchord", "throughput:toolchord", "sandbox-cpu:toolchord",
    }
    assert result["sandbox_cpu_ms_per_call"] is not None
    assert result["sandbox_p50_ms"] == round(
        result["latency"]["toolchord"]["p50_ms"] - result["latency"]["toolchord-nosandbox"]["p50_ms"], 2
    )
    assert re.search(r"\ntargets: (all MET|MISSED: )", completed.stdout), completed.stdout
    assert set(result["throughput_ratio"]) == set(result["throughput"]) - {"bare"}
    assert all(cost["commands_per_turn"] > 0 for cost in result["redis"].values())
    for cost in result["redis"].values():
        assert set(cost["cpu_ms_per_turn"]) == {"orchestrator", "worker", "redis"}
        # 20 turns keep the worker busy far longer than one 10 ms tick of the CPU counters: a zero
        # means the counters were not read.
        assert cost["cpu_ms_per_turn"]["worker"] > 0
