"""Where a sandboxed call's time goes: each step's wall time on the call's critical path and CPU.

Used by `toolchord bench sandbox`. The child reports when each of its setup steps ended
(`runner.report_setup_timings`, CLOCK_MONOTONIC, shared by all processes); the worker's steps are
timed here by wrapping the runner's functions for the length of the measurement, so nothing is
timed outside a benchmark. CPU per process comes from /proc: the zygote's own, and its waited-for
children's (spares from their fork to their exit, rehearsal included).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from toolchord.worker.context import ToolContext
from toolchord.worker.sandbox import cgroup, runner
from toolchord.worker.sandbox.child import TIMINGS_PREFIX
from toolchord.worker.sandbox.zygote import ZygoteClient
from toolchord.worker.tools import ToolSpec

_inside: list[str] = []
Mark = tuple[str, float, float]
"""(step that just ended, monotonic seconds, CPU seconds of the process or thread that ran it)."""


@dataclass
class StepProfile:
    """Medians over calls: each step's wall time (ms, from the previous mark of either process)
    and CPU (ms, in the process that ran it), in the order the steps happen."""

    calls: int
    prepared_calls: int
    """Calls that found a spare confined ahead (no layer steps after their arrival)."""
    wall_ms: dict[str, float]
    cpu_ms: dict[str, float]
    owner: dict[str, str]
    total_wall_ms: float
    spare_cpu_ms: float
    """CPU a spare spent before its call arrived (fork faults, rehearsal): off the critical path."""
    ahead_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Steps of spares confined ahead, before their call arrived: (wall, CPU) medians."""
    process_cpu_ms: dict[str, float] = field(default_factory=dict)
    """Per call: worker, zygote, zygote's children (whole lives), whole machine."""


def _wrap(
    marks: list[Mark], target: Any, name: str, before: str | None, after: str | None
) -> Callable[[], None]:
    """Mark `before` and `after` each call of target.name, except inside another wrapped call."""
    original = getattr(target, name)
    caller = threading.get_ident()

    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != caller:
            return original(*args, **kwargs)  # a spare prepared in the background: off the path
        outermost = not _inside
        if outermost and before is not None:
            marks.append((before, time.monotonic(), time.thread_time()))
        _inside.append(name)
        try:
            return original(*args, **kwargs)
        finally:
            _inside.pop()
            if outermost and after is not None:
                marks.append((after, time.monotonic(), time.thread_time()))

    setattr(target, name, timed)
    return lambda: setattr(target, name, original)


@contextlib.contextmanager
def _worker_marks(marks: list[Mark]) -> Iterator[None]:
    """Time the worker's steps of each call (single-threaded benchmark only)."""
    undo = [
        _wrap(marks, runner, "make_workdir", None, "worker: workdir created"),
        _wrap(marks, runner, "_make_cgroup", None, "worker: cgroup created"),
        _wrap(marks, ZygoteClient, "submit", "worker: call planned", "worker: handed to spare"),
        _wrap(marks, runner._Watch, "run", None, "worker: frame read, group killed"),
        _wrap(marks, cgroup, "release_later", None, "worker: cgroup handed off"),
        _wrap(marks, runner, "_clean_up", None, "worker: workdir handed off"),
    ]
    runner.report_setup_timings(True)
    try:
        yield
    finally:
        runner.report_setup_timings(False)
        for restore in undo:
            restore()


def child_marks(output: str) -> list[Mark]:
    """The child's marks from a call's captured output (empty when it wrote none)."""
    prefix = TIMINGS_PREFIX.decode()
    start = output.rfind(prefix)
    if start < 0:
        return []
    line = output[start + len(prefix) :].split("\n", 1)[0]
    return [("child: " + step, at, cpu) for step, at, cpu in json.loads(line)]


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(own, waited-for children's) CPU seconds of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, (int(fields[13]) + int(fields[14])) / ticks


def busy_seconds() -> float:
    """CPU time the whole machine has spent busy (not idle or waiting for I/O) since boot."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def profile_steps(
    spec: ToolSpec,
    args: Any,
    context: ToolContext,
    calls: int,
    zygote: int | None,
    pause: float = 0.0,
) -> StepProfile:
    """Run `calls` sandboxed calls one after another, `pause` seconds apart, and profile each
    step."""
    walls: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    owner: dict[str, str] = {}
    positions: dict[str, list[int]] = {}
    ahead: dict[str, list[tuple[float, float]]] = {}
    timelines: list[tuple[bool, list[Mark]]] = []
    prepared = 0
    totals: list[float] = []
    spare_cpu: list[float] = []
    zygote_before = _proc_cpu(zygote) if zygote else (0.0, 0.0)
    worker_before = time.process_time()
    busy_before = busy_seconds()
    for _ in range(calls):
        if pause:
            time.sleep(pause)
        marks: list[Mark] = [("worker: start", time.monotonic(), time.thread_time())]
        with _worker_marks(marks):
            outcome = runner.run_isolated(spec, args, context)
        marks.append(("worker: returned", time.monotonic(), time.thread_time()))
        totals.append((marks[-1][1] - marks[0][1]) * 1000)
        found = child_marks(outcome.output)
        arrival = next((i for i, mark in enumerate(found) if mark[0] == "child: call received"), None)
        if arrival is None and found and found[0][0] == "child: fork":
            arrival = 0  # a direct fork: no spare, the child's life starts with its call
        if arrival is None:
            raise RuntimeError(f"the child reported no timings: {outcome!r}")
        before, found = found[:arrival], found[arrival:]
        for previous, current in zip(before, before[1:], strict=False):
            if current[0] == "child: layers received":
                continue  # after a rehearsal that ended first: time spent waiting, not working
            ahead.setdefault(current[0], []).append(
                ((current[1] - previous[1]) * 1000, (current[2] - previous[2]) * 1000)
            )
        spare_cpu.append(found[0][2] * 1000 if found[0][0] == "child: call received" else 0.0)
        confined_ahead = not any(step == "child: seccomp" for step, _at, _cpu in found)
        prepared += confined_ahead
        timelines.append((confined_ahead, sorted([*marks, *found], key=lambda mark: mark[1])))
    # The table is of the calls that found a spare confined ahead, when there were any.
    for confined_ahead, timeline in timelines:
        if prepared and not confined_ahead:
            continue
        # The child's CPU before its call arrived is the spare's, reported apart.
        last_cpu = {"worker": timeline[0][2]}
        last_cpu["child"] = next(cpu for step, _at, cpu in timeline if step.startswith("child:"))
        for position, (previous, current) in enumerate(zip(timeline, timeline[1:], strict=False)):
            step = current[0]
            process = step.split(":", 1)[0]
            if step not in walls:
                walls[step], cpus[step], owner[step], positions[step] = [], [], process, []
            positions[step].append(position)
            walls[step].append((current[1] - previous[1]) * 1000)
            cpus[step].append((current[2] - last_cpu[process]) * 1000)
            last_cpu[process] = current[2]
    time.sleep(0.2)  # let the last children exit and be reaped before reading the counters
    zygote_after = _proc_cpu(zygote) if zygote else (0.0, 0.0)
    per_call = 1000 / calls
    order = sorted(walls, key=lambda step: statistics.mean(positions[step]))
    return StepProfile(
        calls=calls,
        prepared_calls=prepared,
        wall_ms={step: statistics.median(walls[step]) for step in order},
        cpu_ms={step: statistics.median(cpus[step]) for step in order},
        owner=owner,
        total_wall_ms=statistics.median(totals),
        spare_cpu_ms=statistics.median(spare_cpu),
        ahead_ms={
            step: (
                statistics.median(wall for wall, _cpu in values),
                statistics.median(cpu for _wall, cpu in values),
            )
            for step, values in ahead.items()
        },
        process_cpu_ms={
            "worker (this process)": (time.process_time() - worker_before) * per_call,
            "zygote itself": (zygote_after[0] - zygote_before[0]) * per_call,
            "zygote's children, whole lives": (zygote_after[1] - zygote_before[1]) * per_call,
            "whole machine (other load included)": (busy_seconds() - busy_before) * per_call,
        },
    )


def format_profile(title: str, profile: StepProfile) -> str:
    """The profile as a table: step, wall ms on the critical path, CPU ms."""
    lines = [
        f"{title}: {profile.calls} calls, {profile.prepared_calls} on a spare confined ahead "
        f"(the steps are theirs, if any); median {profile.total_wall_ms:.3f} ms per call",
        f"  {'step (ended)':44s} {'wall ms':>8s} {'CPU ms':>8s}",
    ]
    for step, wall in profile.wall_ms.items():
        lines.append(f"  {step:44s} {wall:8.3f} {profile.cpu_ms[step]:8.3f}")
    lines.append(f"  {'spare before its call (off the path)':44s} {'':8s} {profile.spare_cpu_ms:8.3f}")
    if profile.ahead_ms:
        lines.append("  of which, confining the spare ahead of its call (off the path):")
        for step, (wall, cpu) in profile.ahead_ms.items():
            lines.append(f"    {step:42s} {wall:8.3f} {cpu:8.3f}")
    lines.append("  CPU per call by process:")
    for name, value in profile.process_cpu_ms.items():
        lines.append(f"    {name:42s} {value:8.3f} ms")
    return "\n".join(lines)
